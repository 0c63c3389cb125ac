"""``tdist.elastic.utils``: the agents' store helpers, with torch's keys (a torch caller and a
tdist caller meet through them), on a real store from several threads."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed.elastic.utils import store as torch_store_utils

import tdist
from tdist._core.errors import StoreTimeoutError
from tdist.elastic.utils import store as store_utils
from tdist.elastic.utils.distributed import create_c10d_store, get_free_port

pytestmark = pytest.mark.timeout(60)


def test_synchronize_gives_every_rank_every_ranks_bytes_even_with_a_torch_caller() -> None:
    store = tdist.HashStore()
    out: dict[int, list[bytes]] = {}

    def rank(r: int) -> None:
        sync = torch_store_utils.synchronize if r == 2 else store_utils.synchronize  # (torch's: the same keys)
        out[r] = list(sync(store, f"data{r}".encode(), r, 3, "sync/", 20))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {r: [b"data0", b"data1", b"data2"] for r in range(3)}
    assert store.timeout == tdist.HashStore().timeout  # (the block's timeout given back)


def test_a_barrier_waits_for_all_and_names_the_ranks_that_never_came() -> None:
    store = tdist.HashStore()
    threads = [threading.Thread(target=store_utils.barrier, args=(store, 2, "b1", 20)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(StoreTimeoutError, match=r"never reached barrier 'b2': \[1, 2\]"):
        store_utils.barrier(store, 3, "b2", barrier_timeout=0.2, rank=0)
    assert store.timeout == timedelta(seconds=300)
    assert 0 < get_free_port() < 65536


def test_create_c10d_store_as_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    # (torch.distributed.elastic.utils.distributed.create_c10d_store: one member on a free port,
    # or world_size members on a given one, each returning once all have joined)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    alone = create_c10d_store(True, "127.0.0.1")
    try:
        alone.set("k", "v")
        assert alone.get("k") == b"v"
        with pytest.raises(RuntimeError, match=f"on 127.0.0.1, port: {alone.port} already in use"):
            create_c10d_store(True, "127.0.0.1", alone.port)
    finally:
        alone.close()
    with pytest.raises(ValueError, match="server_port must be specified when world_size > 1"):
        create_c10d_store(True, "127.0.0.1", world_size=2)
    port, stores = get_free_port(), {}

    def member(i: int) -> None:
        stores[i] = create_c10d_store(i == 0, "127.0.0.1", port, 3, timeout=20)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert sorted(stores) == [0, 1, 2]
        assert stores[2].add("_tcp_store/num_members/num_members", 0) == 3  # (torch's keys: every member counted)
    finally:
        for store in sorted(stores.items(), reverse=True):
            store[1].close()
