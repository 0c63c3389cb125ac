"""``EtcdStore``: the Store API over a real etcd server (started by the ``etcd_endpoint``
fixture), several clients at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from tdist._core.errors import DistNetworkError, DistStoreError, StoreTimeoutError, StoreValueError
from tdist.store._etcd import EtcdStore

from .._sync import inside, wait_until, when_inside

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(etcd_endpoint: tuple[str, int], request: pytest.FixtureRequest) -> EtcdStore:
    s = EtcdStore(*etcd_endpoint, prefix=f"/test/{request.node.name}", timeout=timedelta(seconds=5))
    s.delete_all()
    return s


def test_the_store_api(store: EtcdStore) -> None:
    store.set("a", "x")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"x" and store.get("b") == b"\x00\xff"
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    assert store.add("n", 2) == 2 and store.add("n", -5) == -3
    # compare_set as torch's: a missing key holds b""; a mismatch returns the current value
    assert store.compare_set("c", "", "v1") == b"v1"
    assert store.compare_set("c", "v1", "v2") == b"v2"
    assert store.compare_set("c", "nope", "v3") == b"v2"
    assert store.compare_set("missing", "expected", "v") == b"expected" and not store.check(["missing"])
    store.append("l", "ab")
    store.append("l", b"cd")
    assert store.get("l") == b"abcd"
    store.multi_set(["m1", "m2"], ["1", "2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert sorted(store.list_keys()) == ["a", "b", "c", "l", "m1", "m2", "n"] and store.num_keys() == 7
    assert store.delete_key("a") and not store.delete_key("a")
    with pytest.raises(StoreValueError, match="not an integer"):
        store.add("l", 1)
    with pytest.raises(DistStoreError, match="no queues"):
        store.queue_push("q", b"1")


def test_stores_with_other_prefixes_do_not_see_each_other(store: EtcdStore, etcd_endpoint: tuple[str, int]) -> None:
    other = EtcdStore(*etcd_endpoint, prefix="/test/other-job")
    other.delete_all()
    store.set("k", "mine")
    other.set("k", "theirs")
    assert store.get("k") == b"mine" and other.get("k") == b"theirs"
    assert other.delete_all() == 1 and store.check(["k"])


def test_wait_wakes_when_another_client_sets_the_keys(store: EtcdStore) -> None:
    writer = store.clone()
    returned = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            store.wait(["k1", "k2"])
        except BaseException as exc:
            errors.append(exc)
        finally:
            returned.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    watching = lambda: inside(t, "_watch_once", "_etcd.py")  # noqa: E731  (it sleeps in etcd)
    wait_until(watching, 10, "the waiter watches etcd")
    writer.set("k1", "1")
    assert not returned.wait(0.3), f"wait() returned with k2 still missing: {errors}"
    assert watching(), "the waiter should watch on for k2"
    writer.set("k2", "2")
    assert returned.wait(4), "wait() was not woken by the set (the store's timeout is 5 s)"
    assert not errors, errors
    t.join(5)
    # get waits too: its key comes while it watches
    late = when_inside("_watch_once", lambda: store.clone().set("k3", "3"), "_etcd.py")
    assert store.get("k3") == b"3"
    late.join(5)


def test_counters_under_contention(store: EtcdStore) -> None:
    clients = [store.clone() for _ in range(4)]
    seen: list[int] = []
    lock = threading.Lock()

    def work(c: EtcdStore) -> None:
        for _ in range(10):
            v = c.add("counter", 1)
            with lock:
                seen.append(v)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 41))  # every add got its own value


def test_timeouts_and_an_unreachable_etcd(store: EtcdStore) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"keys still missing: \['never'\]"):
        store.wait(["never"], timedelta(seconds=0.4))
    assert 0.35 <= time.monotonic() - start < 2
    with pytest.raises(TimeoutError):  # (the builtin, as every tdist timeout)
        store.get("never") if store.set_timeout(timedelta(seconds=0.2)) is None else None
    with pytest.raises(LookupError):  # (and the error torch's EtcdStore documents for get/wait)
        store.wait(["never"], timedelta(seconds=0.1))
    with pytest.raises(DistNetworkError, match="cannot be reached"):
        EtcdStore("127.0.0.1", 1)


def test_many_keys_are_checked_in_chunks(store: EtcdStore) -> None:
    keys = [f"k{i}" for i in range(300)]  # (more than etcd's 128 operations per transaction)
    store.multi_set(keys[:299], ["v"] * 299)
    assert not store.check(keys) and store.check(keys[:299])
    store.set("k299", "v")
    store.wait(keys, timedelta(seconds=2))


def test_leased_keys_live_while_their_store_does(store: EtcdStore, etcd_endpoint: tuple[str, int]) -> None:
    leased = store.clone()
    leased.keep_alive(ttl=2)  # renewed every second
    leased.set("mine", "1")
    assert leased.add("counter", 1) == 1
    time.sleep(2.5)
    assert store.check(["mine", "counter"])  # (past the ttl: renewed)
    leased.close()  # a launcher that stops: its keys leave etcd a ttl later
    deadline = time.monotonic() + 6
    while store.check(["mine"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not store.check(["mine"]) and not store.check(["counter"])


def test_adding_zero_reads_without_writing(store: EtcdStore) -> None:
    assert store.add("z", 0) == 0 and store.check(["z"])  # (created once, as torch's add)
    _, before = store._range("z")
    assert [store.add("z", 0) for _ in range(5)] == [0] * 5
    _, after = store._range("z")
    assert after == before  # no new revision: nothing was written
