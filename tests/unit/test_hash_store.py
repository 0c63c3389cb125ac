"""HashStore: every method, timeouts, threads, and side by side with torch's HashStore."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as tdd

import tdist
from tdist._core.errors import DistStoreError, QueueEmptyError, StoreTimeoutError, StoreValueError
from tdist.testing import run_threads

from .._sync import wait_inside, when_inside

pytestmark = pytest.mark.timeout(30)

SHORT = timedelta(milliseconds=200)


def when_waiting(fn: Callable[[], object]) -> threading.Thread:
    """Run ``fn`` on a thread once the calling thread waits (on the store's condition); the
    caller joins it."""
    return when_inside("wait", fn, "threading.py")


@pytest.fixture
def store() -> tdist.HashStore:
    s = tdist.HashStore()
    s.set_timeout(SHORT)
    return s


# -- set / get ---------------------------------------------------------------------------------
def test_set_get_str_bytes_and_binary(store: tdist.HashStore) -> None:
    store.set("s", "héllo")
    store.set("b", b"\x00\xff\x00")
    store.set("ba", bytearray(b"xy"))  # type: ignore[arg-type]
    store.set("empty", b"")
    store.set("", "empty key")
    assert store.get("s") == "héllo".encode()
    assert store.get("b") == b"\x00\xff\x00"
    assert store.get("ba") == b"xy"
    assert store.get("empty") == b""
    assert store.get("") == b"empty key"
    store.set("s", "new")
    assert store.get("s") == b"new"


def test_set_rejects_bad_types(store: tdist.HashStore) -> None:
    with pytest.raises(TypeError, match="key must be str"):
        store.set(1, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="value must be str or bytes"):
        store.set("k", 1.5)  # type: ignore[arg-type]
    assert store.num_keys() == 0


def test_get_waits_for_another_thread(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=5))
    t = when_waiting(lambda: store.set("late", "v"))  # (so only a wake-up can answer it)
    start = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - start < 4  # woken by the set, not at the 5 s timeout
    t.join()


def test_get_timeout_names_key_and_timeout(store: tdist.HashStore) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.get("missing")
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 2
    assert str(info.value).startswith("wait timeout after 200ms, keys: missing (HashStore; ")
    # torch users catch these
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, DistStoreError)
    assert isinstance(info.value, RuntimeError)


def test_timeout_zero_waits_forever_like_torch() -> None:
    # torch's Store::kNoTimeout: a zero timeout means no timeout for HashStore
    # (the key is set only once the get waits: a zero timeout that expired at once would fail)
    def reading(s: Any) -> bytes:  # (torch's get is C code, not on the Python stack: this is)
        return bytes(s.get("k"))

    for s in (tdist.HashStore(), tdd.HashStore()):
        s.set_timeout(timedelta(0))
        if isinstance(s, tdist.HashStore):
            t = when_waiting(lambda s=s: s.set("k", "v"))  # type: ignore[misc]
        else:
            t = when_inside("reading", lambda s=s: s.set("k", "v"))  # type: ignore[misc]
        assert reading(s) == b"v"
        t.join()


# -- wait / check ------------------------------------------------------------------------------
def test_wait_timeout_names_only_missing_keys(store: tdist.HashStore) -> None:
    store.set("a", "1")
    with pytest.raises(
        StoreTimeoutError, match=r"^wait timeout after 100ms, keys: b, c \(HashStore"
    ):
        store.wait(["a", "b", "c"], timedelta(milliseconds=100))


def test_wait_explicit_timeout_overrides_default(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=60))
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="after 50ms"):
        store.wait(["x"], timedelta(milliseconds=50))
    assert time.monotonic() - start < 5


def test_wait_returns_when_all_keys_set_by_threads(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=5))
    keys = [f"k{i}" for i in range(4)]
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (store.wait(keys), returned.set()), daemon=True)
    waiter.start()
    for k in keys[:3]:  # each set while the waiter waits
        wait_inside(waiter, "wait", "threading.py")
        store.set(k, "v")
    assert not returned.wait(0.1), "wait() returned with k3 still missing"
    store.set("k3", "v")
    assert returned.wait(4)  # woken by the last set, not at the 5 s timeout
    waiter.join(5)


def test_wait_on_nothing_returns(store: tdist.HashStore) -> None:
    store.wait([])
    assert store.check([])


def test_check(store: tdist.HashStore) -> None:
    assert not store.check(["a"])
    store.set("a", "")
    assert store.check(["a"])
    assert not store.check(["a", "b"])


# -- add / compare_set / append ----------------------------------------------------------------
def test_add(store: tdist.HashStore) -> None:
    assert store.add("n", 3) == 3
    assert store.add("n", -5) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    store.set("t", "41")
    assert store.add("t", 1) == 42
    with pytest.raises(TypeError, match="amount must be int"):
        store.add("n", 1.0)  # type: ignore[arg-type]


def test_add_on_non_number_raises_and_store_stays_usable(store: tdist.HashStore) -> None:
    store.set("v", "abc")
    with pytest.raises(StoreValueError, match="'v' holds b'abc'"):
        store.add("v", 1)
    assert isinstance(StoreValueError("x"), ValueError)
    assert store.get("v") == b"abc"
    assert store.add("other", 1) == 1


def test_compare_set(store: tdist.HashStore) -> None:
    assert store.compare_set("k", "x", "y") == b"x"  # missing, expected non-empty: no change
    assert not store.check(["k"])
    assert store.compare_set("k", "", "first") == b"first"  # missing counts as b""
    assert store.compare_set("k", "wrong", "z") == b"first"
    assert store.compare_set("k", "first", b"second") == b"second"
    assert store.get("k") == b"second"


def test_compare_set_wakes_waiters(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=5))
    t = when_waiting(lambda: store.compare_set("cs", "", "v"))
    assert store.get("cs") == b"v"
    t.join()


def test_append(store: tdist.HashStore) -> None:
    store.append("a", "x")
    store.append("a", b"\x00y")
    assert store.get("a") == b"x\x00y"


# -- delete / num_keys / list_keys -------------------------------------------------------------
def test_delete_num_keys_list_keys(store: tdist.HashStore) -> None:
    assert store.num_keys() == 0
    store.set("a", "1")
    assert store.num_keys() == 1  # torch's HashStore: exactly the user's keys
    store.add("b", 1)
    assert sorted(store.list_keys()) == ["a", "b"]
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1
    assert store.list_keys() == ["b"]
    assert not store.check(["a"])


# -- multi_get / multi_set ---------------------------------------------------------------------
def test_multi_set_multi_get(store: tdist.HashStore) -> None:
    store.multi_set(["a", "b"], ["1", b"2"])
    assert store.multi_get(["b", "a"]) == [b"2", b"1"]
    assert store.multi_get([]) == []
    with pytest.raises(tdist.DistStoreError, match="2 keys but 1 values"):  # (torch: DistStoreError)
        store.multi_set(["a", "b"], ["1"])


def test_multi_get_waits_and_times_out_naming_missing(store: tdist.HashStore) -> None:
    store.set("a", "1")
    with pytest.raises(StoreTimeoutError, match=r"keys: b \(HashStore"):
        store.multi_get(["a", "b"])
    store.set_timeout(timedelta(seconds=5))
    t = when_waiting(lambda: store.multi_set(["b"], ["2"]))
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    t.join()


# -- queues ------------------------------------------------------------------------------------
def test_queue_fifo_len_and_empty(store: tdist.HashStore) -> None:
    assert store.queue_len("q") == 0
    store.queue_push("q", "1")
    store.queue_push("q", b"2")
    assert store.queue_len("q") == 2
    assert store.queue_pop("q") == b"1"
    assert store.queue_pop("q", block=False) == b"2"
    with pytest.raises(QueueEmptyError, match="'q' is empty"):
        store.queue_pop("q", block=False)
    with pytest.raises(StoreTimeoutError, match=r"^wait timeout after 200ms, keys: q \(HashStore"):
        store.queue_pop("q")


def test_wait_and_check_see_non_empty_queues(store: tdist.HashStore) -> None:
    assert not store.check(["q"])
    store.queue_push("q", "x")
    assert store.check(["q"])
    store.wait(["q"])
    store.queue_pop("q")
    assert not store.check(["q"])
    # get needs a value: a queue of that name is not one
    store.queue_push("q", "x")
    with pytest.raises(StoreTimeoutError):
        store.get("q")


def test_blocking_pop_waits_for_push(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=5))
    t = when_waiting(lambda: store.queue_push("q", "v"))
    assert store.queue_pop("q") == b"v"
    t.join()


def test_concurrent_consumers_each_value_once(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=10))
    n_items, n_consumers = 200, 4

    def consume(rank: int, world_size: int) -> list[bytes]:
        return [store.queue_pop("jobs") for _ in range(n_items // world_size)]

    def produce() -> None:
        for i in range(n_items):
            store.queue_push("jobs", str(i))

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    results = run_threads(consume, n_consumers, timeout=20)
    producer.join()
    got = sorted(int(v) for r in results for v in r)
    assert got == list(range(n_items))
    for r in results:  # each consumer sees values in push order
        assert [int(v) for v in r] == sorted(int(v) for v in r)
    assert store.queue_len("jobs") == 0


# -- threads, clone, barrier -------------------------------------------------------------------
def test_concurrent_adds_are_exact(store: tdist.HashStore) -> None:
    def body(rank: int, world_size: int) -> list[int]:
        handle = store if rank % 2 else store.clone()
        return [handle.add("counter", 1) for _ in range(200)]

    results = run_threads(body, 8, timeout=20)
    assert store.get("counter") == b"1600"
    seen = sorted(v for r in results for v in r)
    assert seen == list(range(1, 1601))  # every add saw a distinct value


def test_clone_shares_data_with_its_own_timeout(store: tdist.HashStore) -> None:
    other = store.clone()
    assert isinstance(other, tdist.HashStore)
    other.set("k", "v")
    assert store.get("k") == b"v"
    assert other.timeout == SHORT
    other.set_timeout(timedelta(seconds=7))
    assert store.timeout == SHORT
    # an independent store shares nothing
    assert not tdist.HashStore().check(["k"])


def test_barrier_with_threads(store: tdist.HashStore) -> None:
    store.set_timeout(timedelta(seconds=10))
    order: list[str] = []

    def body(rank: int, world_size: int) -> None:
        time.sleep(0.01 * rank)
        order.append("before")
        store.barrier("b", world_size)
        order.append("after")

    run_threads(body, 4, timeout=20)
    assert order == ["before"] * 4 + ["after"] * 4


def test_timeout_property_and_validation(store: tdist.HashStore) -> None:
    assert tdist.HashStore().timeout == timedelta(seconds=300)  # torch's default
    store.set_timeout(timedelta(seconds=3))
    assert store.timeout == timedelta(seconds=3)
    with pytest.raises(ValueError, match="negative"):
        store.set_timeout(timedelta(seconds=-1))
    assert store.has_extended_api()


# -- side by side with torch -------------------------------------------------------------------
def run_script(store: Any) -> list[object]:
    """The same calls on a tdist or a torch store; the outcomes, errors as their kind."""
    out: list[object] = []

    def step(fn: Callable[[], object]) -> None:
        try:
            out.append(fn())
        except ValueError:
            out.append("ValueError")
        except TimeoutError:
            out.append("timeout")
        except RuntimeError:  # torch's HashStore raises a plain DistStoreError on timeout
            out.append("timeout")

    store.set_timeout(timedelta(milliseconds=50))
    step(store.num_keys)
    step(lambda: store.set("a", "1"))
    step(store.num_keys)
    step(lambda: store.add("a", 5))
    step(lambda: store.add("new", -3))
    step(lambda: store.get("a"))
    step(lambda: store.compare_set("c", "", "x"))
    step(lambda: store.compare_set("d", "y", "x"))
    step(lambda: store.compare_set("c", "x", "z"))
    step(lambda: store.compare_set("c", "q", "w"))
    step(lambda: store.check(["a", "c"]))
    step(lambda: store.check(["a", "d"]))
    step(lambda: store.delete_key("a"))
    step(lambda: store.delete_key("a"))
    step(store.num_keys)
    step(lambda: sorted(store.list_keys()))
    step(lambda: store.set("v", "abc"))
    step(lambda: store.add("v", 1))
    step(lambda: store.get("v"))
    step(lambda: store.append("ap", "x"))
    step(lambda: store.append("ap", "y"))
    step(lambda: store.get("ap"))
    step(lambda: store.multi_set(["m1", "m2"], ["1", "2"]))
    step(lambda: store.multi_get(["m2", "m1"]))
    step(lambda: store.get("missing"))
    step(lambda: store.wait(["missing"], timedelta(milliseconds=20)))
    step(store.num_keys)
    step(lambda: store.queue_push("q", "1"))
    step(lambda: store.queue_len("q"))
    step(lambda: store.check(["q"]))
    step(lambda: store.queue_pop("q"))
    step(lambda: store.queue_len("q"))
    return out


def test_same_outcomes_as_torch_hashstore() -> None:
    ours = run_script(tdist.HashStore())
    theirs = run_script(tdd.HashStore())
    assert ours == theirs
    assert ours[2] == 1  # num_keys after one set


def test_a_torch_store_wrapped_for_tdist_raises_tdists_errors_which_are_torchs_too() -> None:
    """tdist's own code catches its own classes (a timeout as ``StoreTimeoutError``): a torch
    store that tdist was handed (``init_process_group(store=)``, torchrun's store under
    ``env://``) raises those, which torch's ``except`` clauses catch as well."""
    import torch.distributed as tdc

    from tdist._core.errors import DistStoreError, QueueEmptyError, StoreTimeoutError
    from tdist.store._foreign import ForeignStore

    store = ForeignStore(tdc.HashStore())
    store.set_timeout(timedelta(milliseconds=50))
    with pytest.raises(StoreTimeoutError) as timed_out:
        store.get("missing")
    assert isinstance(timed_out.value, tdc.DistStoreError) and isinstance(timed_out.value.__cause__, tdc.DistStoreError)
    with pytest.raises(StoreTimeoutError):
        store.wait(["missing"], timedelta(milliseconds=50))
    with pytest.raises(QueueEmptyError) as empty:
        store.queue_pop("q", block=False)
    assert isinstance(empty.value, tdc.QueueEmptyError)
    store.set("a", "1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2
    assert issubclass(StoreTimeoutError, DistStoreError)


def test_a_list_of_byte_values_is_refused_as_torchs_bindings_refuse_it() -> None:
    """torch 2.13's ``set``, ``compare_set``, ``append`` and ``multi_set`` take ``str`` or
    ``bytes`` only (``TypeError: incompatible function arguments``); tdist stored the list."""
    store = tdist.HashStore()
    for call in (
        lambda: store.set("k", [1, 2, 3]),  # type: ignore[arg-type]
        lambda: store.compare_set("k", "", [1]),  # type: ignore[arg-type]
        lambda: store.append("k", [1]),  # type: ignore[arg-type]
        lambda: store.multi_set(["k"], [[1]]),  # type: ignore[list-item]
    ):
        with pytest.raises(TypeError, match="must be str or bytes"):
            call()
    assert store.num_keys() == 0
    store.set("k", bytearray(b"x"))  # (as torch's)
    assert store.get("k") == b"x"
