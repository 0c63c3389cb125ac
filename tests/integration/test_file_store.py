"""FileStore: every method, several handles, threads, real processes, torn records, cleanup,
compaction, and side by side with torch's FileStore."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tdist
from tdist._core.errors import DistStoreError, QueueEmptyError, StoreTimeoutError, StoreValueError
from tdist.store import _file
from tdist.store._file import FILE_MAGIC, FileOp, Kind, encode_record, parse_records
from tdist.testing import run_processes, run_threads

from .._sync import wait_inside, when_inside

pytestmark = pytest.mark.timeout(60)

SHORT = timedelta(milliseconds=200)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(path: str) -> Iterator[tdist.FileStore]:
    s = tdist.FileStore(path)
    s.set_timeout(SHORT)
    yield s
    s.close()


def records(path: str) -> tuple[list[FileOp], bool]:
    """The operations logged in the file, and whether a torn tail follows them."""
    data = Path(path).read_bytes()
    assert data.startswith(FILE_MAGIC)
    ops, _, torn = parse_records(data, len(FILE_MAGIC))
    return ops, torn


# -- the record format, bytes alone ------------------------------------------------------------
def test_records_round_trip_and_every_cut_is_torn() -> None:
    first = encode_record([FileOp(Kind.SET, "a", b"1")])
    second = encode_record(
        [FileOp(Kind.SET, "bé", b"\x00" * 300), FileOp(Kind.PUSH, "q", b""), FileOp(Kind.POP, "q")]
    )
    data = first + second
    ops, end, torn = parse_records(data)
    assert (end, torn) == (len(data), False)
    assert [op.kind for op in ops] == [Kind.SET, Kind.SET, Kind.PUSH, Kind.POP]
    assert ops[1] == FileOp(Kind.SET, "bé", b"\x00" * 300)
    for cut in range(len(first) + 1, len(data)):
        ops, end, torn = parse_records(data[:cut])
        # a record is all or nothing: the cut one is not seen, the one before it is
        assert (len(ops), end, torn) == (1, len(first), True)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert parse_records(bytes(flipped))[1:] == (len(first), True)


# -- the API in one process --------------------------------------------------------------------
def test_every_method(store: tdist.FileStore) -> None:
    store.set("s", "héllo")
    assert store.get("s") == "héllo".encode()
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    assert store.compare_set("c", "x", "y") == b"x"
    assert store.compare_set("c", "", "first") == b"first"
    assert store.compare_set("c", "nope", "z") == b"first"
    assert store.compare_set("c", "first", "second") == b"second"
    store.append("a", "1")
    store.append("a", b"\x002")
    assert store.get("a") == b"1\x002"
    store.multi_set(["m1", "m2"], ["1", b"2"])
    assert store.multi_get(["m2", "m1"]) == [b"2", b"1"]
    with pytest.raises(tdist.DistStoreError, match="2 keys but 1 values"):  # (torch: DistStoreError)
        store.multi_set(["a", "b"], ["1"])
    assert store.check(["s", "n", "c"])
    assert not store.check(["s", "zz"])
    store.wait(["s", "m1"])
    assert sorted(store.list_keys()) == ["a", "c", "m1", "m2", "n", "s"]
    assert store.num_keys() == 7  # the six keys, and the one that coordinates the handles
    assert store.delete_key("s") is True
    assert store.delete_key("s") is False
    assert not store.check(["s"])
    assert store.num_keys() == 6
    assert store.path == store._path
    assert store.has_extended_api()


def test_add_on_non_number_raises_and_writes_nothing(store: tdist.FileStore, path: str) -> None:
    store.set("v", "abc")
    before = os.path.getsize(path)
    with pytest.raises(StoreValueError, match="'v' holds b'abc'"):
        store.add("v", 1)
    assert os.path.getsize(path) == before
    assert store.get("v") == b"abc"
    assert store.add("w", 2) == 2


def test_delete_of_a_missing_key_returns_false(store: tdist.FileStore, path: str) -> None:
    before = os.path.getsize(path)
    assert store.delete_key("never") is False  # torch's FileStore says True
    assert os.path.getsize(path) == before  # and no tombstone is written
    store.set("k", "v")
    other = tdist.FileStore(path)
    assert other.delete_key("k") is True
    assert store.delete_key("k") is False
    assert not store.check(["k"])
    other.close()


def test_queues(store: tdist.FileStore) -> None:
    assert store.queue_len("q") == 0
    assert not store.check(["q"])
    store.queue_push("q", "1")
    store.queue_push("q", b"\x002")
    assert store.queue_len("q") == 2
    assert store.check(["q"])
    store.wait(["q"])
    assert store.queue_pop("q") == b"1"
    assert store.queue_pop("q", block=False) == b"\x002"
    with pytest.raises(QueueEmptyError, match="'q' is empty"):
        store.queue_pop("q", block=False)
    with pytest.raises(StoreTimeoutError, match=r"^wait timeout after 200ms, keys: q \(FileStore"):
        store.queue_pop("q")
    store.queue_push("q", "x")
    # as torch: a queue is not a key, so delete_key leaves it alone
    assert store.delete_key("q") is False
    assert store.queue_len("q") == 1


def test_get_timeout_names_key_timeout_and_path(store: tdist.FileStore, path: str) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.get("missing")
    assert 0.19 <= time.monotonic() - start < 2
    assert str(info.value).startswith(
        f"wait timeout after 200ms, keys: missing (FileStore at {path}; "
    )
    assert isinstance(info.value, TimeoutError)
    store.set("a", "1")
    with pytest.raises(StoreTimeoutError, match=r"after 50ms, keys: b, c \(FileStore"):
        store.wait(["a", "b", "c"], timedelta(milliseconds=50))
    with pytest.raises(StoreTimeoutError, match=r"keys: b \(FileStore"):
        store.multi_get(["a", "b"])


def test_two_handles_share_one_file(path: str) -> None:
    a, b = tdist.FileStore(path), tdist.FileStore(path)
    b.set_timeout(timedelta(seconds=5))
    a.set("k", "v")
    assert b.get("k") == b"v"
    assert b.add("k2", 1) == 1
    assert a.add("k2", 1) == 2
    c = a.clone()
    assert isinstance(c, tdist.FileStore)
    assert c.get("k2") == b"2"

    reader = threading.current_thread()

    def later() -> None:  # (each write while the reader waits for it)
        wait_inside(reader, "queue_pop", "_file.py")
        a.queue_push("q", "item")
        wait_inside(reader, "get", "_file.py")
        a.set("late", "1")

    t = threading.Thread(target=later, daemon=True)
    t.start()
    assert b.queue_pop("q") == b"item"
    assert b.get("late") == b"1"
    t.join()
    for s in (a, b, c):
        s.close()


def test_large_binary_values(path: str) -> None:
    rng = random.Random(7)
    big = rng.randbytes(4 << 20)
    every_byte = bytes(range(256)) * 3
    a, b = tdist.FileStore(path), tdist.FileStore(path)
    a.set("big", big)
    a.multi_set(["bytes", "big2"], [every_byte, big[::-1]])
    a.append("big", b"tail")
    assert b.get("big") == big + b"tail"
    assert b.multi_get(["bytes", "big2"]) == [every_byte, big[::-1]]
    assert b.num_keys() == 4
    a.close()
    b.close()


def test_closed_handle_raises_and_close_is_idempotent(path: str) -> None:
    with tdist.FileStore(path) as s:
        s.set("k", "v")
    with pytest.raises(DistStoreError, match="this handle is closed"):
        s.get("k")
    s.close()
    assert "closed" in repr(s)


def test_file_removed_under_an_open_handle(store: tdist.FileStore, path: str) -> None:
    store.set("k", "v")
    os.unlink(path)
    with pytest.raises(DistStoreError, match="the file was removed"):
        store.get("k")


def test_not_a_filestore_file(path: str) -> None:
    Path(path).write_bytes(b"hello, this is someone else's file")
    with pytest.raises(DistStoreError, match="not a tdist FileStore file"):
        tdist.FileStore(path)
    assert Path(path).read_bytes() == b"hello, this is someone else's file"


def test_unopenable_path_raises_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(DistStoreError, match=r"opening the file failed: .*No such file or dir"):
        tdist.FileStore(str(tmp_path / "no-such-dir" / "store"))
    with pytest.raises(TypeError, match="world_size must be int"):
        tdist.FileStore(str(tmp_path / "s"), "2")  # type: ignore[arg-type]


def test_lock_held_elsewhere_costs_a_timeout_not_a_hang(store: tdist.FileStore, path: str) -> None:
    fd = os.open(path, os.O_RDWR)  # another open file description: its flock excludes ours
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"could not lock the file within 0\.2 s"):
            store.set("k", "v")
        assert time.monotonic() - start < 2
        fcntl.flock(fd, fcntl.LOCK_UN)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        os.close(fd)


# -- torn records ------------------------------------------------------------------------------
TORN_TAILS: dict[str, Callable[[], bytes]] = {
    "short header": lambda: encode_record([FileOp(Kind.SET, "torn", b"x")])[:5],
    "short payload": lambda: encode_record([FileOp(Kind.SET, "torn", b"x" * 100)])[:-10],
    "zeros": lambda: b"\x00" * 64,
    "bad crc": lambda: encode_record([FileOp(Kind.SET, "torn", b"xyz")])[:-1] + b"Z",
}


@pytest.mark.parametrize("tail", TORN_TAILS, ids=list(TORN_TAILS))
def test_torn_last_record_is_unwritten_until_a_writer_repairs_it(path: str, tail: str) -> None:
    a = tdist.FileStore(path)
    a.set_timeout(timedelta(milliseconds=50))
    a.set("k", "v")
    with open(path, "ab") as f:  # what a writer killed mid-write leaves
        f.write(TORN_TAILS[tail]())
    torn_size = os.path.getsize(path)
    # readers (not a new handle: opening one writes) see the old records and nothing of the
    # torn one, and leave it alone
    assert a.get("k") == b"v"
    assert not a.check(["torn"])
    assert a.num_keys() == 2
    with pytest.raises(StoreTimeoutError):
        a.get("torn")
    assert os.path.getsize(path) == torn_size
    # the next writer cuts it off before appending
    a.set("after", "1")
    ops, torn = records(path)
    assert not torn
    assert [op.key for op in ops if op.kind == Kind.SET] == ["k", "after"]
    b = tdist.FileStore(path)
    assert b.multi_get(["k", "after"]) == [b"v", b"1"]
    assert not b.check(["torn"])
    a.close()
    b.close()


def test_a_cut_multi_set_is_all_or_nothing(store: tdist.FileStore, path: str) -> None:
    before = os.path.getsize(path)
    store.multi_set(["x", "y", "z"], ["1", "2", "3"])
    data = Path(path).read_bytes()
    ops, _ = records(path)
    assert [op.key for op in ops[-3:]] == ["x", "y", "z"]  # one record, three operations
    cut = before + (len(data) - before) // 2
    with open(path, "r+b") as f:
        f.truncate(cut)
    other = tdist.FileStore(path)
    assert not other.check(["x"]) and not other.check(["z"])
    ops, torn = records(path)  # the opening handle repaired the tail before writing
    assert not torn
    assert not {"x", "y", "z"} & {op.key for op in ops}
    other.close()


def test_torn_header_is_rewritten(path: str) -> None:
    Path(path).write_bytes(FILE_MAGIC[:4])
    with tdist.FileStore(path) as s:
        s.set("k", "v")
        assert s.get("k") == b"v"
    assert Path(path).read_bytes().startswith(FILE_MAGIC)


def _die_mid_write(path: str) -> None:
    """Hold the file lock, write part of a record, and get killed (a crash, for real)."""
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    record = encode_record([FileOp(Kind.SET, "half", b"x" * 1000)])
    os.pwrite(fd, record[:600], os.fstat(fd).st_size)
    os.kill(os.getpid(), signal.SIGKILL)


def test_writer_killed_mid_write(path: str) -> None:
    a = tdist.FileStore(path)
    a.set("k", "v")
    proc = multiprocessing.get_context("fork").Process(target=_die_mid_write, args=(path,))
    proc.start()
    proc.join(20)
    assert proc.exitcode == -signal.SIGKILL
    assert records(path)[1]  # the torn record is there
    assert not a.check(["half"])
    assert a.add("n", 1) == 1  # the lock died with the writer; the write repairs the tail
    ops, torn = records(path)
    assert not torn
    assert "half" not in {op.key for op in ops}
    a.close()


# -- handles counted, and the file cleaned up --------------------------------------------------
def test_last_of_world_size_handles_removes_the_file(path: str) -> None:
    a, b = tdist.FileStore(path, 2), tdist.FileStore(path, 2)
    a.set("k", "v")
    a.close()
    assert os.path.exists(path)
    assert b.get("k") == b"v"
    del b  # destruction counts as closing, as in torch
    assert not os.path.exists(path)


def test_world_size_not_reached_or_unset_keeps_the_file(tmp_path: Path) -> None:
    p1, p2 = str(tmp_path / "a"), str(tmp_path / "b")
    tdist.FileStore(p1, 3).close()
    tdist.FileStore(p1, 3).close()
    assert os.path.exists(p1)  # 2 of 3 closed
    tdist.FileStore(p1, 3).close()
    assert not os.path.exists(p1)
    for _ in range(3):
        tdist.FileStore(p2).close()
    assert os.path.exists(p2)  # world_size -1: never removed
    assert tdist.FileStore(p2).world_size == -1


def test_open_handle_keeps_the_file_past_world_size_closes(path: str) -> None:
    keep = tdist.FileStore(path, 1)
    tdist.FileStore(path, 1).close()  # one closed (= world_size), but `keep` is open
    assert os.path.exists(path)
    keep.set("k", "v")
    keep.close()
    assert not os.path.exists(path)


def test_cleanup_like_torch(tmp_path: Path) -> None:
    import torch.distributed as tdd

    for name, cls in (("ours", tdist.FileStore), ("torch", tdd.FileStore)):
        p = str(tmp_path / name)
        a = cls(p, 1)
        a.set("k", "v")
        assert os.path.exists(p)
        del a
        assert not os.path.exists(p), name


# -- side by side with torch -------------------------------------------------------------------
def file_script(make: Callable[[str, int], Any], path: str) -> list[object]:
    out: list[object] = []
    s = make(path, -1)
    s.set_timeout(timedelta(milliseconds=50))

    def step(fn: Callable[[], object]) -> None:
        try:
            out.append(fn())
        except ValueError:
            out.append("ValueError")
        except (TimeoutError, RuntimeError):  # torch's FileStore times out with RuntimeError
            out.append("timeout")

    step(s.num_keys)
    step(lambda: s.set("a", "1"))
    step(s.num_keys)
    step(lambda: s.add("a", 5))
    step(lambda: s.add("new", -3))
    step(lambda: s.get("a"))
    step(lambda: s.compare_set("c", "", "x"))
    step(lambda: s.compare_set("d", "y", "x"))
    step(lambda: s.compare_set("c", "x", "z"))
    step(lambda: s.compare_set("c", "q", "w"))
    step(lambda: s.check(["a", "c"]))
    step(lambda: s.check(["a", "d"]))
    step(lambda: s.delete_key("a"))
    step(s.num_keys)
    step(lambda: s.set("v", "abc"))
    step(lambda: s.add("v", 1))
    step(lambda: s.append("ap", "x"))
    step(lambda: s.append("ap", "y"))
    step(lambda: s.get("ap"))
    step(lambda: s.multi_set(["m1", "m2"], ["1", "2"]))
    step(lambda: s.multi_get(["m2", "m1"]))
    step(lambda: s.get("missing"))
    step(lambda: s.wait(["missing"], timedelta(milliseconds=20)))
    other = make(path, -1)
    step(lambda: other.get("m1"))
    step(lambda: other.add("new", 10))
    step(other.num_keys)
    step(lambda: s.get("new"))
    return out


def test_same_outcomes_as_torch_filestore(tmp_path: Path) -> None:
    import torch.distributed as tdd

    ours = file_script(tdist.FileStore, str(tmp_path / "ours"))
    theirs = file_script(tdd.FileStore, str(tmp_path / "torch"))
    assert ours == theirs
    assert ours[0] == 1 and ours[2] == 2  # num_keys counts the coordination key, as torch


def test_timeout_zero_waits_forever_like_torch(tmp_path: Path) -> None:
    import torch.distributed as tdd

    # (the key is set only once the get waits: a zero timeout that expired at once would fail)
    def reading(s: Any) -> bytes:  # (torch's get is C code, not on the Python stack: this is)
        return bytes(s.get("k"))

    for name, cls in (("ours", tdist.FileStore), ("torch", tdd.FileStore)):
        p = str(tmp_path / name)
        reader, writer = cls(p), cls(p)
        reader.set_timeout(timedelta(0))
        if name == "ours":
            t = when_inside("_poll", lambda w=writer: w.set("k", "v"), "_file.py")  # type: ignore[misc]
        else:
            t = when_inside("reading", lambda w=writer: w.set("k", "v"))  # type: ignore[misc]
        assert reading(reader) == b"v", name
        t.join()


# -- threads -----------------------------------------------------------------------------------
def test_concurrent_adds_from_threads_are_exact(path: str) -> None:
    shared = tdist.FileStore(path)

    def body(rank: int, world_size: int) -> list[int]:
        # half the threads share one handle, half have their own (their own flock)
        handle = shared if rank % 2 else shared.clone()
        return [handle.add("counter", 1) for _ in range(200)]

    results = run_threads(body, 8, timeout=60)
    assert shared.get("counter") == b"1600"
    assert sorted(v for r in results for v in r) == list(range(1, 1601))
    shared.close()


# -- processes ---------------------------------------------------------------------------------
def _adds_and_appends(rank: int, world_size: int, path: str) -> list[int]:
    s = tdist.FileStore(path, world_size)
    s.set_timeout(timedelta(seconds=30))
    seen = []
    for i in range(100):
        seen.append(s.add("counter", 1))
        if i % 2 == 0:
            s.append("log", f"{rank}:{i};")
    s.barrier("done", world_size)
    total = s.get("counter")
    s.close()
    assert total == b"400"
    return seen


def test_processes_concurrent_adds_and_appends(path: str) -> None:
    results = run_processes(_adds_and_appends, 4, path, timeout=60, start_method="forkserver")
    assert sorted(v for r in results for v in r) == list(range(1, 401))
    # every process closed its handle: the last of world_size removed the file
    assert not os.path.exists(path)


def _appends_then_read(rank: int, world_size: int, path: str) -> bytes:
    s = tdist.FileStore(path)
    s.set_timeout(timedelta(seconds=30))
    for i in range(50):
        s.append("log", f"{rank}:{i};")
    s.add("finished", 1)
    s.barrier("done", world_size)
    value = s.get("log")
    s.close()
    return value


def test_processes_concurrent_appends_lose_nothing(path: str) -> None:
    results = run_processes(_appends_then_read, 4, path, timeout=60)
    log = results[0]
    assert all(r == log for r in results)  # everyone reads the same bytes
    entries = log.decode().rstrip(";").split(";")
    assert sorted(entries) == sorted(f"{r}:{i}" for r in range(4) for i in range(50))
    for r in range(4):  # each writer's appends in its own order
        mine = [int(e.split(":")[1]) for e in entries if e.startswith(f"{r}:")]
        assert mine == list(range(50))


def _wait_or_set(rank: int, world_size: int, path: str) -> float:
    s = tdist.FileStore(path)
    s.set_timeout(timedelta(seconds=30))
    if rank == 0:
        # (rank 1 sets the key once this rank waits for it: its own handle says so)
        def say_waiting() -> None:
            with tdist.FileStore(path) as mine:
                mine.set("waiting", "1")

        when_inside("wait", say_waiting, "_file.py")
        start = time.monotonic()
        s.wait(["ready"])
        assert s.check(["ready"])  # (not back before it was set)
        value = s.get("ready")
        assert value == b"go"
        waited = time.monotonic() - start
    else:
        s.wait(["waiting"])
        s.set("ready", "go")
        waited = 0.0
    s.close()
    return waited


def test_process_waits_for_a_key_another_sets(path: str) -> None:
    waited, _ = run_processes(_wait_or_set, 2, path, timeout=60)
    assert waited < 20  # woken by the set, not at the 30 s timeout


def _queue_worker(rank: int, world_size: int, path: str, items: int) -> list[int]:
    s = tdist.FileStore(path)
    s.set_timeout(timedelta(seconds=30))
    if rank == 0:
        for i in range(items):
            s.queue_push("jobs", str(i))
        s.close()
        return []
    per_consumer = items // (world_size - 1)
    got = [int(s.queue_pop("jobs")) for _ in range(per_consumer)]
    s.close()
    return got


def test_queue_across_processes_each_item_once(path: str) -> None:
    results = run_processes(_queue_worker, 4, path, 90, timeout=60)
    popped = [v for r in results[1:] for v in r]
    assert sorted(popped) == list(range(90))
    for r in results[1:]:
        assert r == sorted(r)  # FIFO as each consumer sees it
    with tdist.FileStore(path) as s:
        assert s.queue_len("jobs") == 0


def test_handle_inherited_across_fork_counts_itself(path: str) -> None:
    parent = tdist.FileStore(path, 5)
    parent.set_timeout(timedelta(seconds=30))
    parent.set("from-parent", "1")

    def child(rank: int, world_size: int) -> bytes:
        for _ in range(50):
            parent.add("n", 1)
        value = parent.get("from-parent")
        parent.close()
        return value

    assert run_processes(child, 4, timeout=60, start_method="fork") == [b"1"] * 4
    assert parent.get("n") == b"200"
    # four children joined and left: with the parent, five handles; the parent is the last
    assert os.path.exists(path)
    parent.close()
    assert not os.path.exists(path)


def test_fork_while_another_thread_is_inside_the_handle(path: str) -> None:
    s = tdist.FileStore(path)
    s.set("k", "v")
    with s._lock:  # as if another thread were in the middle of a call when the child forks

        def child(rank: int, world_size: int) -> bytes:
            return s.get("k")

        assert run_processes(child, 1, timeout=20, start_method="fork") == [b"v"]
    s.close()


# -- compaction --------------------------------------------------------------------------------
def test_compaction_keeps_state_and_handles_follow(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_file, "COMPACT_MIN_BYTES", 8192)
    a, b = tdist.FileStore(path, 3), tdist.FileStore(path, 3)
    b.set_timeout(timedelta(seconds=5))
    for i in range(3):
        a.queue_push("q", str(i))
    a.queue_pop("q")
    a.set("keep", "me")
    old_inode = os.stat(path).st_ino
    for i in range(400):
        a.set("churn", f"{i:04d}" + "x" * 96)
    assert os.stat(path).st_ino != old_inode  # replaced by a compacted copy
    assert os.path.getsize(path) < 8192
    # b still holds the old file open: it must notice and follow
    assert b.get("churn") == b"0399" + b"x" * 96
    assert b.get("keep") == b"me"
    assert b.queue_len("q") == 2
    assert b.queue_pop("q") == b"1"
    assert b.num_keys() == 3  # queues are not keys (as torch)
    assert b.add("n", 1) == 1
    c = tdist.FileStore(path, 3)
    assert c.multi_get(["keep", "n"]) == [b"me", b"1"]
    assert sorted(c.list_keys()) == ["churn", "keep", "n"]
    # the handle count survived the compaction: the third close removes the file
    a.close()
    b.close()
    assert os.path.exists(path)
    c.close()
    assert not os.path.exists(path)
    assert not [p for p in os.listdir(os.path.dirname(path)) if "compact" in p]


def test_compaction_with_concurrent_writers(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_file, "COMPACT_MIN_BYTES", 4096)
    shared = tdist.FileStore(path)

    def body(rank: int, world_size: int) -> None:
        s = shared.clone()
        for i in range(150):
            s.set(f"k{rank}", str(i))
            s.add("total", 1)
        s.close()

    run_threads(body, 4, timeout=60)
    assert shared.get("total") == b"600"
    assert shared.multi_get([f"k{r}" for r in range(4)]) == [b"149"] * 4
    assert os.path.getsize(path) < 16384
    shared.close()


# -- PrefixStore over FileStore ----------------------------------------------------------------
def test_prefix_store_over_file_store(store: tdist.FileStore, path: str) -> None:
    p = tdist.PrefixStore("job", store)
    p.set("k", "v")
    p.queue_push("q", "1")
    assert store.get("job/k") == b"v"
    assert p.num_keys() == store.num_keys() == 2  # k and the coordination key; queues are not keys
    assert sorted(p.list_keys()) == ["k"]
    with tdist.FileStore(path) as other:
        assert tdist.PrefixStore("job", other).get("k") == b"v"
    with pytest.raises(StoreTimeoutError, match=r"keys: job/missing \(FileStore"):
        p.get("missing")


@pytest.mark.parametrize("kind", ["file", "hash", "tcp", "prefix"])
def test_a_store_neither_copies_nor_pickles_and_stays_usable(kind: str, tmp_path: Path) -> None:
    """As torch's ("cannot pickle ... object"): a copy that shared the original's file or socket
    closed it when the copy was dropped, and the original then failed."""
    import copy
    import gc
    import pickle

    from tdist.testing import free_port

    store: tdist.Store
    if kind == "file":
        store = tdist.FileStore(str(tmp_path / "f"), 1)
    elif kind == "hash":
        store = tdist.HashStore()
    elif kind == "tcp":
        store = tdist.TCPStore("127.0.0.1", free_port(), 1, True)
    else:
        store = tdist.PrefixStore("p", tdist.HashStore())
    store.set("k", "v")
    for how in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=f"cannot pickle '{type(store).__name__}' object"):
            how(store)
    gc.collect()
    assert store.get("k") == b"v"
