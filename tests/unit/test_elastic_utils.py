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
from tdist.elastic.utils.distributed import get_free_port

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
