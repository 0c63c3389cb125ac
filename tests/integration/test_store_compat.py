"""Stores as a program ported one file at a time meets them: torch's store handed to tdist
(``init_process_group(store=...)``, ``PrefixStore``), keys given as one string, counters at the
edge of 64 bits, and a Python ``Store`` subclass that implements only the core calls."""

from __future__ import annotations

import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

import tdist
from tdist.distributed_c10d import _get_default_store
from tdist.store._foreign import ForeignStore
from tdist.testing import free_port, run_processes

pytestmark = pytest.mark.timeout(60)


def _group_on_torchs_store(rank: int, world_size: int, port: int) -> list[float]:
    store = torch_dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timedelta(seconds=20))
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        t = torch.full((3,), float(rank + 1))
        tdist.all_reduce(t)
        # the group's namespace of the store it was made on, as torch's helper gives it
        _get_default_store().set(f"from{rank}", "x")
        assert store.get(f"0//from{rank}") == b"x"  # (torch's layout: the namespace is "0/")
        tdist.barrier()  # (rank 0's process serves the store: it stays until rank 1 has read)
        return t.tolist()
    finally:
        tdist.destroy_process_group()


def test_a_group_forms_on_torchs_tcp_store() -> None:
    assert run_processes(_group_on_torchs_store, 2, free_port(), timeout=40) == [[3.0, 3.0, 3.0]] * 2


def test_a_prefix_store_over_torchs_store_and_a_torch_error_through_it() -> None:
    inner = torch_dist.HashStore()
    outer = tdist.PrefixStore("a", tdist.PrefixStore("b", inner))
    outer.set("k", "v")
    assert inner.get("b/a/k") == b"v" and outer.add("n", 2) == 2 and outer.check(["k"])
    outer.set_timeout(timedelta(milliseconds=50))
    with pytest.raises(torch_dist.DistStoreError):
        outer.get("missing")
    with pytest.raises(TypeError, match="must be a Store"):
        tdist.PrefixStore("p", object())  # type: ignore[arg-type]


def _store_of_kind(kind: str, tmp_path: object) -> tuple[tdist.Store, tdist.TCPStore | None]:
    """A store of ``kind`` (``hash``, ``file``, ``tcp``: a client, and its master to close)."""
    if kind == "hash":
        return tdist.HashStore(), None
    if kind == "file":
        return tdist.FileStore(str(tmp_path) + "/store", 1), None  # type: ignore[operator]
    master = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5))
    return tdist.TCPStore("127.0.0.1", master.port, 1, False, timedelta(seconds=5)), master


@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
def test_one_string_is_not_a_list_of_keys_bytes_are_a_key_and_counters_wrap_at_64_bits(kind: str, tmp_path: object) -> None:
    store, master = _store_of_kind(kind, tmp_path)
    store.set("abc", "1")
    for call in (store.check, store.wait, store.multi_get):
        with pytest.raises(TypeError, match="keys must be a list of str"):
            call("abc")  # type: ignore[arg-type]  (torch's binding refuses it; not keys a, b, c)
    # torch's int64 counter wraps around; the connection stays usable
    assert store.add("c", 2**63 - 1) == 2**63 - 1
    assert store.add("c", 1) == -(2**63)
    assert store.get("c") == b"-9223372036854775808" and store.add("c", 0) == -(2**63)
    with pytest.raises(TypeError, match="64-bit"):
        store.add("c", 2**64)
    assert store.get("abc") == b"1"
    store.set(b"bytes", "key")  # type: ignore[arg-type]  (torch's binding takes bytes keys)
    assert store.get("bytes") == b"key" and store.check([b"bytes"])  # type: ignore[list-item]
    if master is not None:
        master.close()


@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
def test_what_torchs_bindings_take_for_an_amount_a_prefix_a_value_and_a_timeout(kind: str, tmp_path: object) -> None:
    """torch's ``int64_t`` takes what stands for an int (numpy's, a tensor's, a bool); a stored
    counter must be decimal text of 64 bits (torch's parse fails past them: no wrapping, and no
    digits with underscores, which Python's int() takes); a bytes prefix, a bytes subclass
    value and ``timedelta.max`` (a wait of 31 years) are taken."""
    import numpy as np

    store, master = _store_of_kind(kind, tmp_path)
    assert [store.add("a", np.int64(3)), store.add("a", True), store.add("a", torch.tensor(2))] == [3, 4, 6]  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="amount must be int, got float"):
        store.add("a", 1.5)  # type: ignore[arg-type]
    for text in ("99999999999999999999", "-99999999999999999999", "1_000", "7x"):
        store.set("c", text)
        with pytest.raises(tdist.DistStoreError, match="not an integer of 64 bits"):
            store.add("c", 1)
        assert store.get("c") == text.encode()  # (unchanged, and the store goes on)
    store.set("c", "-3")
    assert store.add("c", 1) == -2
    store.set("b", np.bytes_(b"q"))  # type: ignore[arg-type]
    assert type(store.get("b")) is bytes
    prefixed = tdist.PrefixStore(b"pb", store)  # type: ignore[arg-type]
    prefixed.set("k", "v")
    assert store.get("pb/k") == b"v"
    store.set_timeout(timedelta.max)
    assert store.timeout >= timedelta(days=365 * 30) and store.get("pb/k") == b"v"  # ("forever")
    if master is not None:
        master.close()


class CoreOnly(tdist.Store):
    """A store that implements the core calls alone (a dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: object) -> bool:
        return all(k in self.data for k in keys)  # type: ignore[attr-defined]

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected = expected_value if isinstance(expected_value, bytes) else expected_value.encode()
        desired = desired_value if isinstance(desired_value, bytes) else desired_value.encode()
        current = self.data.get(key)
        if current is None and expected:
            return expected
        if current is None or current == expected:
            self.data[key] = desired
            return desired
        return current


def test_a_subclass_with_the_core_calls_gets_append_and_says_it_has_no_extended_api() -> None:
    store = CoreOnly()
    assert not store.has_extended_api() and tdist.HashStore().has_extended_api()
    store.append("a", "x")
    store.append("a", b"x")
    store.set("b", "")
    store.append("b", "y")
    assert store.data == {"a": b"xx", "b": b"y"}


def test_a_timeout_of_none_and_a_subclass_that_skips_stores_init_are_type_errors() -> None:
    with pytest.raises(TypeError, match="timedelta"):
        tdist.HashStore().set_timeout(None)  # type: ignore[arg-type]

    class Bare(tdist.Store):
        def __init__(self) -> None:  # (no Store.__init__)
            pass

    with pytest.raises(TypeError, match=r"must call Store\.__init__"):
        tdist.PrefixStore("p", Bare())


def test_a_torch_store_error_leaves_no_cycle_through_the_callers_frame() -> None:
    """tdist's error for torch's store error kept the frame that raised it, and so every
    caller's frame up to the catch, in a reference cycle: what those frames held lived until
    a collection, and a forked child that collected it destroyed the parent's torch
    ``TCPStore`` server, joining a thread it does not have (``std::system_error``, SIGABRT)."""
    class Held:
        pass

    def caller() -> weakref.ref[Held]:
        held = Held()  # (what a caller's frame holds: a torch store with its threads, say)
        store = ForeignStore(torch_dist.HashStore())
        with pytest.raises(tdist.DistStoreError):
            store.wait(["absent"], timedelta(milliseconds=10))
        return weakref.ref(held)

    gc.disable()
    try:
        gc.collect()
        assert caller()() is None  # (freed with the frame, no collection needed)
    finally:
        gc.enable()
