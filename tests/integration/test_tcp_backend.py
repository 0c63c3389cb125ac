"""The tcp backend directly: every collective, dtypes, views, mismatches, and a rank killed."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import tdist
from tdist._core.errors import DistError, DistTimeoutError, PeerError
from tdist.c10d._tcp_backend import ProcessGroupTCP
from tdist.c10d._types import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ScatterOptions,
)
from tdist.testing import run_threads

from .._sync import join_or_kill, when_inside

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True, params=["shm", "sockets"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run every test over both same-host paths: the shared-memory arena, and the schedules
    over the transport (what ranks on different hosts use)."""
    monkeypatch.setenv("TDIST_SHM", "1" if request.param == "shm" else "0")
    return str(request.param)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def group(store: tdist.Store, rank: int, n: int, name: str = "g") -> ProcessGroupTCP:
    return ProcessGroupTCP(tdist.PrefixStore(name, store), rank, n, timedelta(seconds=30))


def expected_reduce(values: list[torch.Tensor], op: object) -> torch.Tensor:
    out = values[0].clone()
    for v in values[1:]:
        if op == ReduceOp.SUM:
            out = torch.logical_or(out, v) if out.dtype == torch.bool else out + v
        elif op == ReduceOp.PRODUCT:
            out = torch.logical_and(out, v) if out.dtype == torch.bool else out * v
        elif op == ReduceOp.MIN:
            out = torch.minimum(out, v)
        elif op == ReduceOp.MAX:
            out = torch.maximum(out, v)
        elif op == ReduceOp.BAND:
            out = out & v
        elif op == ReduceOp.BOR:
            out = out | v
        elif op == ReduceOp.BXOR:
            out = out ^ v
    return out


def make(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(numel) % 7 + rank + 1
    if dtype == torch.bool:
        return (base % 2).bool()
    if dtype.is_complex:
        return torch.complex(base.float(), -base.float()).to(dtype)
    return base.to(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_every_op_and_dtype(n: int) -> None:
    store = tdist.HashStore()
    cases = []
    for dtype in DTYPES:
        ops = [ReduceOp.SUM, ReduceOp.PRODUCT]
        if not dtype.is_complex:
            ops += [ReduceOp.MIN, ReduceOp.MAX]
        if not (dtype.is_floating_point or dtype.is_complex):
            ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
        cases += [(dtype, op) for op in ops]

    def body(rank: int, size: int) -> None:
        pg = group(store, rank, size)
        try:
            for numel in (1, 5, 70_000):  # recursive doubling and ring
                for dtype, op in cases:
                    if numel > 5 and dtype not in (torch.float32, torch.int64):
                        continue
                    t = make(rank, numel, dtype)
                    pg.allreduce([t], AllreduceOptions(reduceOp=op)).wait()
                    want = expected_reduce([make(r, numel, dtype) for r in range(size)], op)
                    if dtype.is_floating_point and dtype != torch.float64:
                        assert torch.allclose(t.double(), want.double(), rtol=1e-2), (dtype, op)
                    else:
                        assert torch.equal(t, want), (numel, dtype, op)
            t = torch.full((6,), float(rank + 1))
            pg.allreduce([t], AllreduceOptions(reduceOp=ReduceOp.AVG)).wait()
            assert torch.allclose(t, torch.full((6,), (size + 1) / 2))
        finally:
            pg.shutdown()

    run_threads(body, n, timeout=80)


def test_views_are_written_only_inside() -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n)
        try:
            m = torch.full((5, 4), -1.0)
            col = m[:, 1]
            col.copy_(torch.arange(5.0) + rank)
            pg.allreduce([col]).wait()
            assert torch.equal(m[:, 1], 2 * torch.arange(5.0) + 1)
            assert (m[:, [0, 2, 3]] == -1).all()
            x = torch.full((10,), -1.0)
            strided = x[::2]
            if rank == 0:
                strided.copy_(torch.arange(5.0))
            pg.broadcast([strided], BroadcastOptions(rootRank=0)).wait()
            assert torch.equal(x[::2], torch.arange(5.0)) and (x[1::2] == -1).all()
            outs = [torch.full((2, 3), -1.0)[:, 0] for _ in range(n)]
            pg.allgather([outs], [torch.tensor([float(rank), float(rank)])]).wait()
            assert all(torch.equal(o, torch.tensor([float(r)] * 2)) for r, o in enumerate(outs))
        finally:
            pg.shutdown()

    run_threads(body, 2, timeout=30)


def test_a_receive_that_times_out_names_the_tags_its_peer_sent_instead() -> None:
    """gloo's sender blocks in its send until a receive with its tag comes; tdist's send
    returns, and the receive that waits for another tag times out: its error names the tag
    that came."""
    store = tdist.HashStore()
    failed = threading.Event()

    def body(rank: int, n: int) -> str:
        pg = ProcessGroupTCP(tdist.PrefixStore("tags", store), rank, n, timedelta(seconds=2))
        try:
            if rank == 0:
                pg.send([torch.ones(3)], 1, 1).wait()
                assert failed.wait(20)  # (alive until the receive has failed)
                return ""
            with pytest.raises(DistTimeoutError) as info:
                pg.recv([torch.zeros(3)], 0, 2).wait()
            failed.set()
            return str(info.value)
        finally:
            pg.shutdown()

    said = run_threads(body, 2, timeout=30)[1]
    assert "rank 0 sent messages with tag 1, which no receive took: this one waits for tag 2" in said, said


def test_a_receive_whose_wait_timed_out_goes_on_and_gets_its_message() -> None:
    """``irecv(...).wait(timeout)`` that expires raises ``DistTimeoutError``, and the receive goes
    on, as any work's after its caller's timeout: the message that comes later lands in its
    tensor and a later ``wait`` returns, where it was lost before (the sender's ``send``
    succeeded, a new ``irecv`` never completed)."""
    store = tdist.HashStore()
    timed_out = threading.Event()

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n)
        try:
            if rank == 0:
                with pytest.raises(RuntimeError, match="tag must be a non-negative"):  # (gloo's type)
                    pg.send([torch.zeros(1)], 1, -1)
                assert timed_out.wait(20)
                pg.send([torch.tensor([1.0, 2.0])], 1, 0).wait()
                pg.send([torch.tensor([3.0, 4.0])], 1, 0).wait()
            else:
                first, second = torch.zeros(2), torch.zeros(2)
                work = pg.recv([first], 0, 0)
                with pytest.raises(DistTimeoutError):
                    work.wait(timedelta(seconds=0.2))
                assert not work.is_completed()
                timed_out.set()
                later = pg.recv([second], 0, 0)
                assert work.wait() and first.tolist() == [1.0, 2.0] and work.is_completed()
                assert later.wait() and second.tolist() == [3.0, 4.0]
        finally:
            pg.shutdown()

    run_threads(body, 2, timeout=30)


def test_a_receive_into_a_larger_tensor_fills_its_start_as_gloos() -> None:
    """gloo's ``recv`` takes a message shorter than its tensor: it fills the tensor's start
    and leaves the rest. Every way a message travels: a small one, one through the
    connection, one by cross-memory copy; arrived before its receive or after; a tensor
    that is not contiguous. A longer message than the tensor is refused."""
    store = tdist.HashStore()
    sent = threading.Event()
    sizes = {1: 4, 2: 30_000, 3: 300_000}  # (elements of float32: 16 B, 120 KB, 1.2 MB)

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n)
        try:
            if rank == 0:
                for tag in (1, 2):  # (these arrive before their receives)
                    pg.send([torch.arange(sizes[tag], dtype=torch.float32)], 1, tag).wait()
                sent.set()
                pg.send([torch.arange(sizes[3], dtype=torch.float32)], 1, 3).wait()
                pg.send([torch.arange(6, dtype=torch.float32)], 1, 4).wait()
                pg.send([torch.arange(8, dtype=torch.float32)], 1, 5).wait()
                return
            bufs = {tag: torch.full((k + 5,), -1.0) for tag, k in sizes.items()}
            late = pg.recv([bufs[3]], 0, 3)  # (posted before its message)
            assert sent.wait(30)
            for tag in (1, 2):
                assert pg.recv([bufs[tag]], 0, tag).wait()
            assert late.wait()
            for tag, k in sizes.items():
                assert torch.equal(bufs[tag][:k], torch.arange(k, dtype=torch.float32)), tag
                assert bufs[tag][k:].tolist() == [-1.0] * 5, tag
            strided = torch.full((10, 2), -1.0)[:, 0]  # (not contiguous: 10 elements)
            pg.recv([strided], 0, 4).wait()
            assert strided.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] + [-1.0] * 4
            with pytest.raises(DistError, match="sent 32 bytes but the receiving tensor holds only 16 bytes"):
                pg.recv([torch.zeros(4)], 0, 5).wait()
        finally:
            pg.shutdown()

    run_threads(body, 2, timeout=60)


def test_tensors_with_the_negative_bit_send_and_take_their_values() -> None:
    """``z.conj().imag`` (and ``_neg_view``) holds the negatives of its values in memory: what
    is sent, reduced and received is its values, on either path, where it is an input and
    where it is written (torch's gloo sends its values too)."""
    store = tdist.HashStore()

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n)
        try:
            z = torch.tensor([1 + 2j, 3 + 4j])
            x = z.clone().conj().imag  # values [-2, -4]
            assert x.is_neg()
            pg.allreduce([x]).wait()
            assert x.tolist() == [-4.0, -8.0]
            if rank == 0:
                pg.send([z.conj().imag], 1, 0).wait()
                pg.send([torch.tensor([5.0, 6.0])], 1, 1).wait()
            else:
                got = torch.zeros(2)
                pg.recv([got], 0, 0).wait()
                assert got.tolist() == [-2.0, -4.0]
                into = torch.zeros(2)._neg_view()  # (received into: its values become 5, 6)
                pg.recv([into], 0, 1).wait()
                assert into.tolist() == [5.0, 6.0]
            outs = [torch.zeros(2) for _ in range(n)]
            pg.allgather([outs], [torch.tensor([1.0, 2.0 + rank])._neg_view()]).wait()
            assert [o.tolist() for o in outs] == [[-1.0, -2.0 - r] for r in range(n)]
            b = torch.tensor([float(rank), 1.0])._neg_view()
            pg.broadcast([b], BroadcastOptions(rootRank=1)).wait()
            assert b.tolist() == [-1.0, -1.0]
        finally:
            pg.shutdown()

    run_threads(body, 2, timeout=30)


@pytest.mark.parametrize("n", [2, 3])
def test_rooted_and_uneven_collectives(n: int) -> None:
    store = tdist.HashStore()

    def body(rank: int, size: int) -> None:
        pg = group(store, rank, size)
        try:
            for root in range(size):
                t = torch.full((3,), float(rank + 1))
                pg.reduce([t], ReduceOptions(rootRank=root, reduceOp=ReduceOp.SUM)).wait()
                if rank == root:
                    assert torch.equal(t, torch.full((3,), float(sum(range(1, size + 1)))))
                else:
                    assert torch.equal(t, torch.full((3,), float(rank + 1)))  # inputs untouched
                outs = [torch.empty(r + 1) for r in range(size)] if rank == root else []
                pg.gather([outs], [torch.full((rank + 1,), float(rank))], GatherOptions(rootRank=root)).wait()
                if rank == root:
                    assert all(torch.equal(o, torch.full((r + 1,), float(r))) for r, o in enumerate(outs))
                out = torch.empty(2)
                ins = [[torch.full((2,), float(r * 10 + root)) for r in range(size)]] if rank == root else []
                pg.scatter([out], ins, ScatterOptions(rootRank=root)).wait()
                assert torch.equal(out, torch.full((2,), float(rank * 10 + root)))
            # uneven all_gather and all_to_all (gloo rejects both)
            outs = [torch.empty(r + 2) for r in range(size)]
            pg.allgather([outs], [torch.full((rank + 2,), float(rank))], AllgatherOptions()).wait()
            assert all(torch.equal(o, torch.full((r + 2,), float(r))) for r, o in enumerate(outs))
            ins = [torch.full((rank + 1 + d,), float(rank * 10 + d)) for d in range(size)]
            outs = [torch.empty(s + 1 + rank) for s in range(size)]
            pg.alltoall(outs, ins).wait()
            assert all(torch.equal(o, torch.full((s + 1 + rank,), float(s * 10 + rank))) for s, o in enumerate(outs))
            inp = torch.arange(float(size * 2)) + 100 * rank
            out = torch.empty(size * 2)
            pg.alltoall_base(out, inp, [], []).wait()
            want = torch.cat([torch.arange(float(rank * 2), float(rank * 2 + 2)) + 100 * s for s in range(size)])
            assert torch.equal(out, want)
            full = torch.empty(size * 2)
            pg._allgather_base(full, torch.full((2,), float(rank))).wait()
            assert torch.equal(full, torch.arange(float(size)).repeat_interleave(2))
            rs = torch.empty(2)
            pg._reduce_scatter_base(rs, torch.arange(float(size * 2))).wait()
            assert torch.equal(rs, size * torch.arange(float(rank * 2), float(rank * 2 + 2)))
            pg.barrier().wait()
        finally:
            pg.shutdown()

    run_threads(body, n, timeout=60)


def test_async_ops_complete_in_order_and_p2p() -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n)
        try:
            ts = [torch.full((100,), float(i + rank)) for i in range(10)]
            works = [pg.allreduce([t]) for t in ts]
            for i, (w, t) in enumerate(zip(works, ts, strict=True)):
                w.wait()
                assert w.is_completed() and w.is_success() and w.exception() is None
                assert torch.equal(t, torch.full((100,), float(2 * i + 1)))
            fut = pg.allreduce([torch.ones(3)]).get_future()
            assert torch.equal(fut.wait()[0], torch.full((3,), 2.0))
            # p2p: both ranks receive first (async), then send: never a deadlock
            buf = torch.empty(4)
            w = pg.recv([buf], 1 - rank, 7)
            pg.send([torch.full((4,), float(rank))], 1 - rank, 7).wait()
            w.wait()
            assert torch.equal(buf, torch.full((4,), float(1 - rank)))
        finally:
            pg.shutdown()

    run_threads(body, 2, timeout=30)


def test_mismatched_calls_fail_on_every_rank() -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> str:
        pg = group(store, rank, n)
        try:
            t = torch.ones(4 if rank == 0 else 8)
            with pytest.raises(DistError) as info:
                pg.allreduce([t], AllreduceOptions(asyncOp=False)).wait()
            # later calls fail fast: the group is broken
            t0 = time.monotonic()
            with pytest.raises(DistError, match="broken"):
                pg.barrier().wait()
            assert time.monotonic() - t0 < 10  # at once: not at the group's timeout (30 s)
            return str(info.value)
        finally:
            pg.shutdown()

    messages = run_threads(body, 2, timeout=30)
    assert any(("[4]" in m and "[8]" in m) or ("numel=4" in m and "numel=8" in m) for m in messages), messages


@pytest.mark.parametrize("case", ["reduction", "root"])
def test_ranks_that_disagree_on_the_reduction_or_the_root_fail_naming_both(case: str) -> None:
    """One rank asks for MAX where the others ask for SUM (every rank would get its own
    result), or for another root (the messages never meet: a hang until the timeout): each
    rank fails with an error that says what each side called, on either path (over the
    transport: the first message, or the desync check once the call blocks)."""
    store = tdist.HashStore()

    def body(rank: int, n: int) -> str:
        pg = group(store, rank, n)
        try:
            t = torch.full((100,), float(rank + 1))
            with pytest.raises(DistError) as info:
                if case == "reduction":
                    pg.allreduce([t], AllreduceOptions(reduceOp=ReduceOp.MAX if rank == 1 else ReduceOp.SUM)).wait()
                else:
                    pg.reduce([t], ReduceOptions(rootRank=1 if rank == 1 else 0)).wait()
                pg.barrier().wait()  # (a rank whose part was done: at its next call, the group broken)
            return str(info.value)
        finally:
            pg.shutdown()

    messages = run_threads(body, 3, timeout=30)
    said = ("op=MAX", "op=SUM") if case == "reduction" else ("root=1", "root=0")
    assert any(all(x in m for x in said) for m in messages), messages


def test_two_ranks_that_both_take_themselves_for_a_broadcasts_root_fail_at_the_next_call(path: str) -> None:
    """Both send and return, each with its own data (nothing blocks: over the transport no
    message ever meets its receive). Their next call fails on both, naming the call that no
    one took, where they went on with different data silently."""
    store = tdist.HashStore()

    def body(rank: int, n: int) -> str:
        pg = group(store, rank, n)
        try:
            t = torch.full((100,), float(rank))
            try:
                pg.broadcast([t], BroadcastOptions(rootRank=rank)).wait()  # (each its own root)
                pg.allreduce([torch.ones(2)]).wait()
                pg.allreduce([torch.ones(2)]).wait()
            except DistError as exc:
                return str(exc)
            return "no error"
        finally:
            pg.shutdown()

    messages = run_threads(body, 2, timeout=30)
    assert all(m != "no error" for m in messages), messages
    if path == "sockets":
        assert any("sent broadcast#1 float32 [100] root=" in m and "which no call of this rank took" in m for m in messages), messages


def _killed_rank(rank: int, n: int, port: int) -> None:
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20))
    pg = ProcessGroupTCP(tdist.PrefixStore("k", store), rank, n, timedelta(seconds=60))
    store.set(f"pid{rank}", str(os.getpid()))
    if rank == 1:
        time.sleep(60)
        os._exit(0)
    store.wait(["armed"])
    t0 = time.monotonic()
    # (the test kills rank 1 once this rank is inside the all_reduce: a watcher of its stack says so)
    when_inside("allreduce", lambda: store.clone().set(f"inside{rank}", "1"), "_tcp_backend.py")
    try:
        pg.allreduce([torch.ones(1000)], AllreduceOptions(asyncOp=False)).wait()
        store.set(f"result{rank}", json.dumps(["no error"]))
    except DistError as exc:
        store.set(f"result{rank}", json.dumps([time.monotonic() - t0, str(exc), isinstance(exc, PeerError)]))
    os._exit(0)


def test_killed_rank_fails_the_collective_everywhere_within_5s() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_killed_rank, args=(r, 4, master.port)) for r in range(4)]
    for p in procs:
        p.start()
    victim = 0
    try:
        master.wait([f"pid{r}" for r in range(4)])
        victim = int(master.get("pid1"))
        master.set("armed", "1")
        master.wait([f"inside{r}" for r in (0, 2, 3)])  # the others wait on rank 1 in the all_reduce
        os.kill(victim, signal.SIGKILL)
        for r in (0, 2, 3):
            elapsed, message, _is_peer_error = json.loads(master.get(f"result{r}"))
            assert elapsed < 5, message
            assert "rank 1" in message, message
            assert "all_reduce" in message, message
    finally:
        if victim:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        join_or_kill(procs)
        master.close()


def test_no_arena_where_memory_order_is_weaker_than_x86s(path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the arena's counters rely on x86's store order: on ARM a group of one host says so and
    # runs its collectives over sockets, with the same results
    import platform

    from tdist.c10d import _tcp_backend

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(_tcp_backend, "_no_arena_logged", set())
    store = tdist.HashStore()

    def body(rank: int, size: int) -> tuple[bool, list[float]]:
        pg = group(store, rank, size)
        try:
            t = torch.arange(70_000, dtype=torch.float32) + rank
            pg.allreduce([t], AllreduceOptions()).wait()
            return pg.uses_shared_memory, t[:3].tolist()
        finally:
            pg.shutdown()

    with caplog.at_level("WARNING", logger="tdist"):
        results = run_threads(body, 2, timeout=60)
    assert results == [(False, [1.0, 3.0, 5.0])] * 2
    if path == "shm":  # (asked for the arena: told why there is none)
        assert any("aarch64" in r.getMessage() and "over sockets" in r.getMessage() for r in caplog.records)


def _half_without_arena(rank: int, world: int, port: int) -> dict[str, object]:
    if rank == 1:
        os.environ["TDIST_SHM"] = "0"  # (this rank alone: it offers no part of an arena)
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20))
    pg = group(store, rank, world)
    try:
        t = torch.full((1000,), float(rank + 1))
        pg.allreduce([t], AllreduceOptions()).wait()
        if rank == 0:
            pg.send([torch.arange(10.0)], 1, 0).wait()
            got = None
        else:
            got = torch.empty(10)
            pg.recv([got], 0, 0).wait()
        return {"arena": pg._arena is not None, "sum": t[0].item(), "p2p": None if got is None else got.tolist()}
    finally:
        pg.shutdown()
        store.close()


def test_a_rank_without_its_part_of_the_arena_makes_every_rank_use_sockets() -> None:
    """Each rank offers its half of the shared-memory arena with its address; a rank that
    offers none (``TDIST_SHM=0`` there alone, or a failure to make it) takes the whole group
    over sockets, on every rank, instead of leaving the others waiting for its half."""
    from tdist.testing import free_port, run_processes

    port = free_port()
    master = tdist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    try:
        out = run_processes(_half_without_arena, 2, port, timeout=60)
    finally:
        master.close()
    assert [o["arena"] for o in out] == [False, False]
    assert [o["sum"] for o in out] == [3.0, 3.0] and out[1]["p2p"] == [float(i) for i in range(10)]


@pytest.mark.parametrize("slow", [1, 0])
def test_no_rank_finishes_forming_the_group_before_every_rank_has_joined_its_arena(
    path: str, slow: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that forms a group and destroys it at once must not close its arena under a peer
    that has not opened it yet: a rank's set-up ends only once every other rank has joined (a
    rank accepts and connects only after joining). Rank ``slow``'s join waits (at most 2 s) for
    the other rank to finish forming the group; with the order right, the other cannot, and rank
    ``slow`` joins, the connection is made, and both finish. (A lower rank that accepted at once
    let the higher one finish first: a full run's failure in ``new_subgroups_by_enumeration``.)"""
    from tdist.c10d._shm import ShmArena

    formed = threading.Event()
    seen: list[bool] = []
    real_join = ShmArena.join

    def join(self: ShmArena, records: Any) -> None:
        if self.rank == slow:
            seen.append(formed.wait(2.0))
        real_join(self, records)

    monkeypatch.setattr(ShmArena, "join", join)
    store = tdist.HashStore()

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n)
        if rank != slow:
            formed.set()
        pg.shutdown()

    run_threads(body, 2, timeout=60)
    assert seen == ([False] if path == "shm" else [])  # (over sockets there is no arena to join)


def _with_its_own_secret(rank: int, world: int, path: str) -> str:
    os.environ["TDIST_SECRET"] = f"not-the-same-{rank}"  # (a misconfigured job)
    store = tdist.FileStore(path, world)  # (a store that asks for no secret: the group must)
    try:
        pg = ProcessGroupTCP(tdist.PrefixStore("g", store), rank, world, timedelta(seconds=2))
    except DistError as exc:
        return type(exc).__name__
    pg.shutdown()
    return "formed"


def test_ranks_that_do_not_share_the_job_secret_do_not_form_a_group(path: str) -> None:
    """Forming a group proves the job secret both ways on every connection, on the arena path
    too, where the collectives then need no socket: ranks with different secrets get an error
    from forming the group, not a group whose collectives run."""
    import tempfile

    from tdist.testing import run_processes

    with tempfile.TemporaryDirectory() as d:
        out = run_processes(_with_its_own_secret, 2, os.path.join(d, "store"), timeout=60)
    assert "formed" not in out, out


def test_a_rank_that_leaves_at_once_leaves_the_others_point_to_point_working(path: str) -> None:
    """Rank 0 destroys the group as soon as it is formed (it has no use for it); ranks 1 and 2
    still exchange messages over it."""
    store = tdist.HashStore()
    formed = threading.Barrier(3)
    out: dict[int, Any] = {}

    def body(rank: int, n: int) -> None:
        pg = group(store, rank, n, "leave")
        formed.wait(30)
        if rank == 0:
            pg.shutdown()
            return
        if rank == 1:
            pg.send([torch.arange(3.0)], 2, 7).wait()
        else:
            x = torch.zeros(3)
            pg.recv([x], 1, 7).wait()
            out[rank] = x.tolist()
        pg.shutdown()

    run_threads(body, 3, timeout=60)
    assert out == {2: [0.0, 1.0, 2.0]}
