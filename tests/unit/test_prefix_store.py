"""PrefixStore over a HashStore: every method lands on ``prefix/key``; side by side with torch."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as tdd

import tdist
from tdist._core.errors import QueueEmptyError, StoreTimeoutError, StoreValueError
from tdist.testing import run_threads

from .._sync import inside, wait_until

pytestmark = pytest.mark.timeout(30)

SHORT = timedelta(milliseconds=200)


@pytest.fixture
def base() -> tdist.HashStore:
    s = tdist.HashStore()
    s.set_timeout(SHORT)
    return s


@pytest.fixture
def store(base: tdist.HashStore) -> tdist.PrefixStore:
    return tdist.PrefixStore("pre", base)


def test_set_get_land_under_the_prefix(base: tdist.HashStore, store: tdist.PrefixStore) -> None:
    store.set("k", "v")
    assert base.get("pre/k") == b"v"
    base.set("pre/other", b"\x00")
    assert store.get("other") == b"\x00"
    assert not store.check(["pre/k"])  # no double prefix
    assert store.prefix == "pre"


def test_every_method_delegates_with_the_prefix(
    base: tdist.HashStore, store: tdist.PrefixStore
) -> None:
    assert store.add("n", 2) == 2
    assert base.get("pre/n") == b"2"
    assert store.compare_set("c", "", "x") == b"x"
    assert store.compare_set("c", "nope", "y") == b"x"
    assert store.compare_set("c", "x", "y") == b"y"
    assert base.get("pre/c") == b"y"
    store.append("a", "1")
    store.append("a", "2")
    assert base.get("pre/a") == b"12"
    store.multi_set(["m1", "m2"], ["1", "2"])
    assert base.multi_get(["pre/m1", "pre/m2"]) == [b"1", b"2"]
    assert store.multi_get(["m2", "m1"]) == [b"2", b"1"]
    assert store.check(["n", "c", "a"])
    assert not base.check(["n"])
    store.wait(["n", "m1"])
    store.queue_push("q", "x")
    assert base.queue_len("pre/q") == 1
    assert store.queue_len("q") == 1
    assert store.queue_pop("q") == b"x"
    with pytest.raises(QueueEmptyError):
        store.queue_pop("q", block=False)
    assert store.delete_key("n") is True
    assert store.delete_key("n") is False
    assert not base.check(["pre/n"])
    store.set("v", "abc")
    with pytest.raises(StoreValueError):
        store.add("v", 1)


def test_num_keys_counts_the_underlying_store(
    base: tdist.HashStore, store: tdist.PrefixStore
) -> None:
    base.set("elsewhere", "1")
    store.set("k", "1")
    assert store.num_keys() == 2  # as torch: the underlying store's count, all prefixes


def test_list_keys_only_under_the_prefix_stripped(
    base: tdist.HashStore, store: tdist.PrefixStore
) -> None:
    base.set("elsewhere", "1")
    base.set("prefix/not-ours", "1")  # starts with "pre" but not with "pre/"
    store.set("k", "1")
    store.set("sub/k", "1")
    assert sorted(store.list_keys()) == ["k", "sub/k"]


def test_nesting(base: tdist.HashStore, store: tdist.PrefixStore) -> None:
    inner = tdist.PrefixStore("in", store)
    inner.set("z", "1")
    assert base.get("pre/in/z") == b"1"
    assert store.get("in/z") == b"1"
    assert inner.list_keys() == ["z"]
    assert store.list_keys() == ["in/z"]
    assert inner.underlying_store is store
    assert store.underlying_store is base
    assert inner._underlying_non_prefix_store is base


def test_empty_prefix_like_torch(base: tdist.HashStore) -> None:
    tdist.PrefixStore("", base).set("k", "1")
    t = tdd.HashStore()
    tdd.PrefixStore("", t).set("k", "1")
    assert base.list_keys() == t.list_keys() == ["/k"]


def test_timeout_is_the_underlying_stores(base: tdist.HashStore, store: tdist.PrefixStore) -> None:
    assert store.timeout == SHORT
    store.set_timeout(timedelta(seconds=3))
    assert base.timeout == timedelta(seconds=3)
    base.set_timeout(timedelta(milliseconds=100))
    assert store.timeout == timedelta(milliseconds=100)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"^wait timeout after 100ms, keys: pre/missing \("):
        store.get("missing")
    assert time.monotonic() - start < 2


def test_wait_timeout_names_prefixed_keys(store: tdist.PrefixStore) -> None:
    store.set("a", "1")
    with pytest.raises(StoreTimeoutError, match=r"keys: pre/b \(HashStore"):
        store.wait(["a", "b"], timedelta(milliseconds=50))


def test_blocking_calls_wake_on_writes_through_another_prefix_store(
    base: tdist.HashStore,
) -> None:
    base.set_timeout(timedelta(seconds=5))
    one, two = tdist.PrefixStore("p", base), tdist.PrefixStore("p", base.clone())

    reader = threading.current_thread()

    def waits_in(call: str) -> bool:  # (each write comes while the reader waits for it)
        return inside(reader, call, "_prefix.py") and inside(reader, "wait", "threading.py")

    def writer() -> None:
        wait_until(lambda: waits_in("get"), 10, "the reader waits in get")
        two.set("k", "v")
        wait_until(lambda: waits_in("queue_pop"), 10, "the reader waits in queue_pop")
        two.queue_push("q", "item")

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    assert one.get("k") == b"v"
    assert one.queue_pop("q") == b"item"
    t.join()


def test_clone_wraps_a_clone_of_the_underlying_store(store: tdist.PrefixStore) -> None:
    other = store.clone()
    assert isinstance(other, tdist.PrefixStore)
    assert other.prefix == "pre"
    assert other.underlying_store is not store.underlying_store
    other.set("k", "1")
    assert store.get("k") == b"1"


def test_concurrent_adds_and_barrier_through_prefix(base: tdist.HashStore) -> None:
    base.set_timeout(timedelta(seconds=10))

    def body(rank: int, world_size: int) -> None:
        s = tdist.PrefixStore("job", base.clone())
        for _ in range(100):
            s.add("n", 1)
        s.barrier("bar", world_size)
        assert s.get("n") == b"400"

    run_threads(body, 4, timeout=20)
    assert base.get("job/n") == b"400"
    assert base.check(["job/bar/done"])


def test_constructor_checks_types(base: tdist.HashStore) -> None:
    with pytest.raises(ValueError, match="store argument cannot be None"):  # (torch's type and words)
        tdist.PrefixStore("p", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefix must be str"):
        tdist.PrefixStore(1, base)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a Store"):
        tdist.PrefixStore("p", object())  # type: ignore[arg-type]
    assert tdist.PrefixStore("p", base).has_extended_api()


def run_script(base: Any, make_prefix: Any) -> list[object]:
    """The same calls through a prefix store of tdist or of torch."""
    base.set("outside", "1")
    p = make_prefix("pre", base)
    q = make_prefix("q", p)
    return [
        p.num_keys(),
        p.set("k", "v"),
        q.set("z", "1"),
        sorted(base.list_keys()),
        sorted(p.list_keys()),
        q.list_keys(),
        p.num_keys(),
        q.num_keys(),
        p.add("n", 4),
        p.compare_set("c", "", "x"),
        p.compare_set("c", "y", "w"),
        p.compare_set("d", "y", "w"),
        p.check(["k", "n"]),
        q.check(["k"]),
        p.delete_key("k"),
        p.delete_key("k"),
        sorted(base.list_keys()),
    ]


def test_same_outcomes_as_torch_prefixstore() -> None:
    ours = run_script(tdist.HashStore(), tdist.PrefixStore)
    theirs = run_script(tdd.HashStore(), tdd.PrefixStore)
    assert ours == theirs


# -- a store written in Python (a subclass of Store), behind a prefix store: torch's own tests ----
def _python_store(dist: Any) -> Any:
    """torch's test_store.py's MyPythonStore: the core calls only, values checked to be bytes."""

    class MyPythonStore(dist.Store):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.store: dict[str, bytes] = {}

        def set(self, key: str, value: object) -> None:
            assert type(value) is bytes, value
            self.store[key] = value

        def get(self, key: str) -> bytes:
            return self.store.get(key, b"")

        def compare_set(self, key: str, expected: object, desired: object) -> bytes:
            assert type(expected) is bytes and type(desired) is bytes, (expected, desired)
            val = self.store.get(key)
            if expected == val or val is None:
                val = self.store[key] = desired
            return val

    return MyPythonStore()


@pytest.mark.parametrize("impl", ["torch", "tdist"])
def test_a_python_store_gets_bytes_and_the_fallbacks_use_compare_set_alone(impl: str) -> None:
    """torch's test_extended_methods_fallbacks and test_append_roundtrip: a prefix store hands a
    Store subclass its values as bytes, and the base class's append needs compare_set alone."""
    dist: Any = tdd if impl == "torch" else tdist
    inner = _python_store(dist)  # (held: torch's prefix store keeps only its C++ half alive)
    store = dist.PrefixStore("p", inner)
    assert not store.has_extended_api()
    store.set("s", "text")  # (a str becomes bytes on the way)
    store.append("foo", b"po")
    store.append("foo", "tato")
    assert store.get("foo") == b"potato"
    store.multi_set(["a", "b"], [b"c", "d"])
    assert store.multi_get(["a", "b", "foo", "s"]) == [b"c", b"d", b"potato", b"text"]
    assert store.compare_set("a", "c", "e") == b"e"


@pytest.mark.parametrize("impl", ["torch", "tdist"])
def test_a_python_store_without_a_method_says_not_implemented(impl: str) -> None:
    """torch's test_optional_methods_fail: a RuntimeError saying "Not implemented."."""
    dist: Any = tdd if impl == "torch" else tdist

    class Empty(dist.Store):  # type: ignore[name-defined,misc]
        pass

    store = Empty()
    assert not store.has_extended_api()
    for call in (lambda: store.append("foo", "bar"), lambda: store.multi_get(["foo"]), lambda: store.multi_set(["foo"], [b"bar"])):
        with pytest.raises(RuntimeError, match=r"Not implemented\."):
            call()
