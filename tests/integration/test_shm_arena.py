"""ShmArena: every collective against torch computations, real processes and threads, failures
(kill -9, SIGSTOP, deadlines, mismatches, close) and /dev/shm hygiene.

Most tests run with small frames (64 KiB, 3 per ring, 4 KiB "small" all_reduce limit) so that
modest tensors cross every path: the one-frame all_reduce, the pipelined one, and rings that
wrap many times.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from tdist._core.errors import DistBackendError, DistTimeoutError, PeerError, StoreTimeoutError
from tdist.c10d._shm import SHM_DIR, CollectiveMismatchError, ShmArena, cleanup_stale
from tdist.c10d._shm._layout import _CLOSED, _SLEEP, _STATE
from tdist.c10d._types import RedOpType
from tdist.store import HashStore, Store, TCPStore
from tdist.testing import LocalStore, local_store, run_processes, run_threads

pytestmark = pytest.mark.timeout(60)

OPTS: dict[str, Any] = {"frame_bytes": 64 << 10, "frames": 3, "small_bytes": 4 << 10, "timeout": 30}

R = RedOpType
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
]


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[LocalStore]:
    with local_store(4, timeout=30) as s:
        yield s


def unique(tag: str) -> str:
    return f"{tag}{uuid.uuid4().hex[:8]}"


def shm_files(name: str) -> list[str]:
    return [f for f in os.listdir(SHM_DIR) if name in f]


def new_entries(before: set[str]) -> set[str]:
    """What is in /dev/shm now and was not in ``before``, but other programs' named semaphores
    and MPICH segments (the suite's other stream makes them meanwhile; tdist makes neither)."""
    return {n for n in set(os.listdir(SHM_DIR)) - before if not n.startswith(("sem.", "mpich_shm_"))}


PARENT = os.getpid()


def arena(rank: int, ws: int, where: int | Store, name: str, **kw: Any) -> ShmArena:
    """An arena for ``rank``; ``where`` is a store, or the port of the test's store server."""
    if os.getpid() != PARENT:
        # the test's own torch computations, a few ranks per core: one thread each
        torch.set_num_threads(1)
    store = where if isinstance(where, Store) else TCPStore("127.0.0.1", where, timeout=timedelta(seconds=30))
    return ShmArena(store, rank, ws, name=name, **{**OPTS, **kw})


def wait_blocked(a: ShmArena, q: int, timeout: float = 20.0) -> None:
    """Until rank ``q`` of ``a`` waits in the kernel for its peers (its sleep word is set: it
    is inside an operation, blocked)."""
    deadline = time.monotonic() + timeout
    while a._w[a._base[q] + _SLEEP] != 1:
        assert time.monotonic() < deadline, f"rank {q} never blocked in a wait"
        time.sleep(0.001)


def data(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers (exact in every dtype, whatever the order of a sum or product)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 4, (n,), generator=g).to(dtype)
    if dtype.is_complex:
        re = torch.randint(-2, 3, (n,), generator=g).float()
        im = torch.randint(-2, 3, (n,), generator=g).float()
        return torch.complex(re, im).to(dtype)
    return torch.randint(-2, 3, (n,), generator=g).to(dtype)


REF: dict[RedOpType, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    R.SUM: torch.add, R.AVG: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum,
    R.MAX: torch.maximum, R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or,
    R.BXOR: torch.bitwise_xor,
}


def reference(inputs: list[torch.Tensor], op: RedOpType) -> torch.Tensor:
    acc = inputs[0].clone()
    for x in inputs[1:]:
        acc = REF[op](acc, x)
    if op is R.AVG:
        acc.div_(len(inputs))
    return acc


def ops_for(dtype: torch.dtype) -> list[RedOpType]:
    if dtype.is_complex:
        return [R.SUM, R.PRODUCT, R.AVG]
    if dtype.is_floating_point:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def sizes_for(dtype: torch.dtype) -> list[int]:
    item = torch.empty(0, dtype=dtype).element_size()
    small = OPTS["small_bytes"] // item
    return [0, 1, 7, small, small + 1, (OPTS["frame_bytes"] * 7) // (2 * item) + 3]


# -- all_reduce ----------------------------------------------------------------------------------
def all_reduce_body(rank: int, ws: int, where: int | Store, name: str) -> int:
    a = arena(rank, ws, where, name)
    checked = 0
    try:
        for seed, dtype in enumerate(DTYPES):
            for op in ops_for(dtype):
                for n in sizes_for(dtype):
                    inputs = [data(q, n, dtype, seed) for q in range(ws)]
                    x = inputs[rank].clone()
                    a.all_reduce(x, op)
                    expected = reference(inputs, op)
                    assert torch.equal(x, expected), f"rank {rank}: {dtype} {op.name} n={n}: {x} != {expected}"
                    checked += 1
    finally:
        a.close()
    return checked


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ws", [2, 3])
def test_all_reduce_every_op_and_dtype_processes(server: LocalStore, ws: int) -> None:
    name = unique("ar")
    counts = run_processes(all_reduce_body, ws, server.port, name, timeout=80)
    assert counts[0] > 250 and len(set(counts)) == 1
    assert shm_files(name) == []


@pytest.mark.timeout(90)
def test_all_reduce_every_op_and_dtype_threads_4() -> None:
    name = unique("art")
    run_threads(all_reduce_body, 4, HashStore(), name, timeout=80)
    assert shm_files(name) == []


def test_all_reduce_default_frames_large_and_bitwise_equal(server: LocalStore) -> None:
    """Default geometry (1 MiB frames): a 5.5 MiB float tensor wraps the ring; random floats
    give bitwise the same result on every rank."""

    def body(rank: int, ws: int, port: int, name: str) -> list[float]:
        torch.set_num_threads(1)
        store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
        a = ShmArena(store, rank, ws, name=name, timeout=30)
        try:
            g = torch.Generator().manual_seed(rank)
            n = (11 << 20) // 8 + 5
            inputs = [torch.randn(n, generator=torch.Generator().manual_seed(q)) for q in range(ws)]
            x = torch.randn(n, generator=g)
            assert torch.equal(x, inputs[rank])
            a.all_reduce(x)
            torch.testing.assert_close(x, inputs[0] + inputs[1], rtol=0, atol=1e-6)
            small = torch.randn(100, generator=g)
            a.all_reduce(small)
            return [float(x.sum()), float(x[12345]), float(small.sum())]
        finally:
            a.close()

    name = unique("big")
    results = run_processes(body, 2, server.port, name, timeout=60)
    assert results[0] == results[1]
    assert shm_files(name) == []


# -- views ---------------------------------------------------------------------------------------
def views_body(rank: int, ws: int, where: int | Store, name: str) -> None:
    a = arena(rank, ws, where, name)
    try:
        for n in (5, 3000, 40_000):  # small path, pipelined path, several frames
            # a 1-D strided view: only every other element is written
            base = torch.full((2 * n,), -7.0)
            x = base[::2]
            x.copy_(data(rank, n, torch.float32, 1))
            a.all_reduce(x, R.SUM)
            assert torch.equal(x, reference([data(q, n, torch.float32, 1) for q in range(ws)], R.SUM))
            assert torch.all(base[1::2] == -7.0)
            # a column of a matrix
            m = torch.full((n, 3), -9, dtype=torch.int32)
            m[:, 1] = data(rank, n, torch.int32, 2)
            a.all_reduce(m[:, 1], R.MAX)
            assert torch.equal(m[:, 1], reference([data(q, n, torch.int32, 2) for q in range(ws)], R.MAX))
            assert torch.all(m[:, 0] == -9) and torch.all(m[:, 2] == -9)
            # a block that is no 1-D view (two columns): copied, reduced, copied back
            m = torch.full((n, 4), -5.0, dtype=torch.float64)
            m[:, 1:3] = data(rank, 2 * n, torch.float64, 3).view(n, 2)
            a.all_reduce(m[:, 1:3], R.SUM)
            exp = reference([data(q, 2 * n, torch.float64, 3) for q in range(ws)], R.SUM).view(n, 2)
            assert torch.equal(m[:, 1:3], exp)
            assert torch.all(m[:, 0] == -5.0) and torch.all(m[:, 3] == -5.0)
            # broadcast into a strided view, any root
            root = n % ws
            base = torch.full((2 * n,), -1, dtype=torch.int16)
            src = data(root, n, torch.int16, 4)
            if rank == root:
                base[::2] = src
            a.broadcast(base[::2], root)
            assert torch.equal(base[::2], src) and torch.all(base[1::2] == -1)
            # all_gather into column views
            outs_base = torch.full((n, ws * 2), -3.0)
            outs = [outs_base[:, 2 * q] for q in range(ws)]
            a.all_gather(outs, data(rank, n, torch.float32, 5))
            for q in range(ws):
                assert torch.equal(outs[q], data(q, n, torch.float32, 5))
                assert torch.all(outs_base[:, 2 * q + 1] == -3.0)
            # reduce into a view on the root; the others' tensors stay as they were
            m = torch.full((n, 2), -4.0)
            m[:, 0] = data(rank, n, torch.float32, 6)
            before = m.clone()
            a.reduce(m[:, 0], root, R.SUM)
            if rank == root:
                assert torch.equal(m[:, 0], reference([data(q, n, torch.float32, 6) for q in range(ws)], R.SUM))
                assert torch.all(m[:, 1] == -4.0)
            else:
                assert torch.equal(m, before)
    finally:
        a.close()


def test_views_processes(server: LocalStore) -> None:
    name = unique("views")
    run_processes(views_body, 3, server.port, name, timeout=50)
    assert shm_files(name) == []


def test_views_threads() -> None:
    run_threads(views_body, 2, HashStore(), unique("viewt"), timeout=50)


# -- the other collectives -------------------------------------------------------------------------
COLLECTIVE_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]


def collectives_body(
    rank: int, ws: int, where: int | Store, name: str, dtypes: list[torch.dtype] = COLLECTIVE_DTYPES
) -> int:
    a = arena(rank, ws, where, name)
    checks = 0
    try:
        for seed, dtype in enumerate(dtypes):
            item = torch.empty(0, dtype=dtype).element_size()
            big = (OPTS["frame_bytes"] * 5) // item + 3  # several (sub-)frames: the ring wraps
            for n in (0, 1, 13, big):
                # uneven sizes: rank q contributes n + q elements (and 0 when n == 0)
                size = [n + q if n else 0 for q in range(ws)]
                mine = data(rank, size[rank], dtype, seed)

                # broadcast, from every root
                for root in range(ws):
                    x = data(rank + 100, n, dtype, seed) if rank != root else data(root, n, dtype, seed)
                    a.broadcast(x, root)
                    assert torch.equal(x, data(root, n, dtype, seed)), f"broadcast {dtype} n={n} root={root}"

                # all_gather, uneven
                outs = [torch.empty(size[q], dtype=dtype) for q in range(ws)]
                a.all_gather(outs, mine)
                for q in range(ws):
                    assert torch.equal(outs[q], data(q, size[q], dtype, seed)), f"all_gather {dtype} n={n}"

                # all_gather_into_tensor, even; the input may be a view of its own block
                out = torch.empty(ws * n, dtype=dtype)
                own = out[rank * n: (rank + 1) * n]
                own.copy_(data(rank, n, dtype, seed))
                a.all_gather_into_tensor(out, own)
                assert torch.equal(out, torch.cat([data(q, n, dtype, seed) for q in range(ws)]))

                # gather at a root, uneven
                root = (n + 1) % ws
                outs2 = [torch.empty(size[q], dtype=dtype) for q in range(ws)] if rank == root else None
                a.gather(outs2, mine, root)
                if outs2 is not None:
                    for q in range(ws):
                        assert torch.equal(outs2[q], data(q, size[q], dtype, seed)), f"gather {dtype} n={n}"

                # scatter from a root, uneven
                ins = [data(q + 50, size[q], dtype, seed) for q in range(ws)] if rank == root else None
                y = torch.empty(size[rank], dtype=dtype)
                a.scatter(y, ins, root)
                assert torch.equal(y, data(rank + 50, size[rank], dtype, seed)), f"scatter {dtype} n={n}"

                # all_to_all, uneven: rank s sends (n + s + d) elements to rank d
                def block(s: int, d: int, n: int = n, dtype: torch.dtype = dtype, seed: int = seed) -> torch.Tensor:
                    return data(1000 + s * ws + d, n + s + d if n else 0, dtype, seed)

                outs3 = [torch.empty(n + q + rank if n else 0, dtype=dtype) for q in range(ws)]
                a.all_to_all(outs3, [block(rank, d) for d in range(ws)])
                for q in range(ws):
                    assert torch.equal(outs3[q], block(q, rank)), f"all_to_all {dtype} n={n}"

                # reduce_scatter (list, uneven) and reduce_scatter_tensor, with every op
                for op in ops_for(dtype):
                    def piece(
                        s: int, d: int, size: list[int] = size, dtype: torch.dtype = dtype, seed: int = seed
                    ) -> torch.Tensor:
                        return data(2000 + s * ws + d, size[d], dtype, seed)

                    z = torch.empty(size[rank], dtype=dtype)
                    a.reduce_scatter(z, [piece(rank, d) for d in range(ws)], op)
                    exp = reference([piece(s, rank) for s in range(ws)], op)
                    assert torch.equal(z, exp), f"reduce_scatter {dtype} {op.name} n={n}"

                    full = [data(3000 + s, ws * n, dtype, seed) for s in range(ws)]
                    z2 = torch.empty(n, dtype=dtype)
                    a.reduce_scatter_tensor(z2, full[rank], op)
                    exp2 = reference([f[rank * n: (rank + 1) * n] for f in full], op)
                    assert torch.equal(z2, exp2), f"reduce_scatter_tensor {dtype} {op.name} n={n}"

                    # reduce to a root (others unchanged)
                    w = data(rank + 4000, n, dtype, seed)
                    a.reduce(w, root, op)
                    if rank == root:
                        exp3 = reference([data(q + 4000, n, dtype, seed) for q in range(ws)], op)
                        assert torch.equal(w, exp3), f"reduce {dtype} {op.name} n={n}"
                    else:
                        assert torch.equal(w, data(rank + 4000, n, dtype, seed))
                checks += 1
                a.barrier()
    finally:
        a.close()
    return checks


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ws", [2, 3])
def test_collectives_processes(server: LocalStore, ws: int) -> None:
    name = unique("coll")
    run_processes(collectives_body, ws, server.port, name, timeout=80)
    assert shm_files(name) == []


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_collectives_processes_4_on_2_cores(server: LocalStore) -> None:
    name = unique("coll4")
    run_processes(collectives_body, 4, server.port, name, timeout=110)
    assert shm_files(name) == []


@pytest.mark.timeout(90)
def test_collectives_threads_4() -> None:
    dtypes = [torch.float32, torch.bool, torch.complex64]  # threads share one GIL: keep it short
    run_threads(collectives_body, 4, HashStore(), unique("collt"), dtypes, timeout=80)


def test_world_size_one() -> None:
    with ShmArena(HashStore(), 0, 1, name=unique("one"), **OPTS) as a:
        x = torch.arange(5.0)
        a.all_reduce(x, R.AVG)
        a.broadcast(x, 0)
        a.reduce(x, 0, R.MAX)
        assert torch.equal(x, torch.arange(5.0))
        out = [torch.empty(5)]
        a.all_gather(out, x)
        assert torch.equal(out[0], x)
        big = torch.empty(5)
        a.all_gather_into_tensor(big, x)
        assert torch.equal(big, x)
        a.gather([big], x * 2, 0)
        assert torch.equal(big, x * 2)
        a.scatter(big, [x * 3], 0)
        assert torch.equal(big, x * 3)
        a.reduce_scatter(big, [x * 4], R.SUM)
        assert torch.equal(big, x * 4)
        a.reduce_scatter_tensor(big, x * 5, R.SUM)
        assert torch.equal(big, x * 5)
        a.all_to_all([big], [x * 6])
        assert torch.equal(big, x * 6)
        a.barrier()


# -- argument errors, mismatches -----------------------------------------------------------------
def test_bad_reductions_raise_everywhere_and_leave_the_arena_usable() -> None:
    def body(rank: int, ws: int, store: Store, name: str) -> None:
        a = arena(rank, ws, store, name)
        try:
            with pytest.raises(ValueError, match="complex"):
                a.all_reduce(torch.ones(3, dtype=torch.complex64), R.MAX)
            with pytest.raises(ValueError, match="AVG"):
                a.all_reduce(torch.ones(3, dtype=torch.int32), R.AVG)
            with pytest.raises(ValueError, match="BXOR"):
                a.all_reduce(torch.ones(3), R.BXOR)
            with pytest.raises(ValueError, match="PREMUL_SUM"):
                a.all_reduce(torch.ones(3), R.PREMUL_SUM)
            with pytest.raises(ValueError, match="root"):
                a.broadcast(torch.ones(3), ws)
            with pytest.raises(ValueError, match="one tensor per rank"):
                a.all_gather([torch.ones(3)], torch.ones(3))
            x = torch.ones(3)
            a.all_reduce(x)
            assert torch.equal(x, torch.full((3,), float(ws)))
        finally:
            a.close()

    run_threads(body, 2, HashStore(), unique("bad"), timeout=30)


@pytest.mark.parametrize(
    "call",
    ["numel", "kind", "dtype", "op", "root", "gather_sizes"],
)
def test_mismatch_raises_on_every_rank_naming_both_sides(call: str) -> None:
    def body(rank: int, ws: int, store: Store, name: str) -> str:
        a = arena(rank, ws, store, name)
        odd = rank == ws - 1
        try:
            with pytest.raises(CollectiveMismatchError) as info:
                if call == "numel":
                    a.all_reduce(torch.ones(20_000 if odd else 10))  # different paths as well
                elif call == "kind":
                    if odd:
                        a.broadcast(torch.ones(10), 0)
                    else:
                        a.all_reduce(torch.ones(10))
                elif call == "dtype":
                    a.all_reduce(torch.ones(10, dtype=torch.float64 if odd else torch.float32))
                elif call == "op":
                    a.all_reduce(torch.ones(10), R.MAX if odd else R.SUM)
                elif call == "root":
                    a.broadcast(torch.ones(10), 1 if odd else 0)
                else:
                    outs = [torch.empty(4 if odd else 5) for _ in range(ws)]
                    a.all_gather(outs, torch.ones(4 if odd else 5))
            # broken from now on: later calls fail at once
            t0 = time.monotonic()
            with pytest.raises(DistBackendError, match="broken"):
                a.barrier()
            assert time.monotonic() - t0 < 10  # at once: not at the timeout (30 s)
            return str(info.value)
        finally:
            a.close()

    messages = run_threads(body, 3, HashStore(), unique("mm"), timeout=30)
    for rank, msg in enumerate(messages):
        assert "collective mismatch" in msg and f"rank {rank} called" in msg, msg
        assert ("but rank 2 called" if rank < 2 else "but rank 0 called") in msg, msg
        if call == "dtype":
            assert "float64" in msg and "float32" in msg, msg


def test_a_peers_dtype_is_named_even_if_this_process_never_used_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.c10d._shm import _layout

    code = _layout._dtype_code(torch.int16)
    monkeypatch.setattr(_layout, "_dtype_names", {})  # (a process that used float32 only, so far)
    monkeypatch.setattr(_layout, "_dtype_codes", {})
    _layout._dtype_code(torch.float32)
    assert _layout._dtype_name(code) == "int16"  # (was "dtype#<crc>")


def test_timeout_names_the_missing_rank_and_breaks_the_arena() -> None:
    import threading

    timed_out = threading.Event()

    def body(rank: int, ws: int, store: Store, name: str) -> str:
        a = arena(rank, ws, store, name, heartbeat_interval=0.2)
        try:
            if rank == 1:  # stays away until rank 0 has timed out
                assert timed_out.wait(20), "rank 0 never timed out"
                t0 = time.monotonic()
                with pytest.raises(PeerError, match=r"rank 0 .*failed: CollectiveTimeoutError"):
                    a.all_reduce(torch.ones(3))
                assert time.monotonic() - t0 < 10  # at once: not after a timeout of its own (30 s)
                return ""
            t0 = time.monotonic()
            try:
                with pytest.raises(DistTimeoutError) as info:
                    a.all_reduce(torch.ones(3), timeout=0.3)
            finally:
                timed_out.set()
            # (one family on both ranks: rank 1's PeerError is a DistBackendError too, as under NCCL)
            assert isinstance(info.value, DistBackendError), type(info.value)
            # at the timeout, not later (the peer never comes: a hang ends at run_threads' 30 s)
            assert 0.25 < time.monotonic() - t0 < 10
            return str(info.value)
        finally:
            a.close()

    msg = run_threads(body, 2, HashStore(), unique("to"), timeout=30)[0]
    assert "all_reduce" in msg and "[1]" in msg and "0.3" in msg


def test_close_of_a_peer_wakes_waiters() -> None:
    def body(rank: int, ws: int, store: Store, name: str) -> None:
        # (heartbeats 20 s apart: a waiter the close did not wake would look again only then)
        a = arena(rank, ws, store, name, heartbeat_interval=20)
        try:
            if rank == 1:
                wait_blocked(a, 0)  # rank 0 waits for this rank in its all_reduce
                a.close()
                return
            t0 = time.monotonic()
            with pytest.raises(PeerError, match=r"rank 1 .*closed"):
                a.all_reduce(torch.ones(3))
            assert time.monotonic() - t0 < 20  # woken: not at the timeout (30 s)
        finally:
            a.close()

    run_threads(body, 2, HashStore(), unique("cl"), timeout=30)


def test_a_peer_that_did_its_part_and_closed_meanwhile_is_no_error() -> None:
    # (a waiter that saw the word missing, then the peer set it and closed before the waiter
    # looked at its state, raised "closed ... while this rank waited": a flaky CI failure)
    def body(rank: int, ws: int, store: Store, name: str) -> bool:
        a = arena(rank, ws, store, name)
        try:
            x = torch.arange(5.0) if rank == 0 else torch.zeros(5)
            if rank == 0:
                wait_blocked(a, 1)  # rank 1 waits in the kernel
                a.broadcast(x, 0)
                return True
            a._spin_s = 0.0
            check = a._check_peers
            state = a._base[0] + _STATE  # rank 0's state word

            def late_check(missing: list[int], now: float) -> None:
                end = time.monotonic() + 5  # look only once rank 0 has done its part and left
                while a._w[state] != _CLOSED and time.monotonic() < end:
                    time.sleep(0.005)
                a._check_peers = check  # type: ignore[method-assign]
                check(missing, now)

            a._check_peers = late_check  # type: ignore[method-assign]
            a.broadcast(x, 0)
            return torch.equal(x, torch.arange(5.0))
        finally:
            a.close()

    assert run_threads(body, 2, HashStore(), unique("late"), timeout=30) == [True, True]


def test_abort_from_another_thread_ends_the_wait_and_tells_the_peers() -> None:
    import threading

    aborted = threading.Event()

    def body(rank: int, ws: int, store: Store, name: str) -> None:
        # (heartbeats 20 s apart: a waiter the abort did not wake would look again only then)
        a = arena(rank, ws, store, name, heartbeat_interval=20)
        try:
            if rank == 1:  # comes once rank 0's wait was aborted
                assert aborted.wait(20), "rank 0's all_reduce never ended"
                with pytest.raises(PeerError, match="watchdog"):
                    a.all_reduce(torch.ones(3))
                return

            def watchdog() -> None:
                wait_blocked(a, 0)  # this rank waits in its all_reduce
                a.abort("watchdog")

            threading.Thread(target=watchdog, daemon=True).start()
            t0 = time.monotonic()
            try:
                with pytest.raises(DistBackendError, match="aborted: watchdog"):
                    a.all_reduce(torch.ones(3))
            finally:
                aborted.set()
            assert time.monotonic() - t0 < 10  # woken by the abort (not 20 s later, nor at 30 s)
        finally:
            a.close()

    run_threads(body, 2, HashStore(), unique("ab"), timeout=30)


# -- faults in real processes --------------------------------------------------------------------
def _child(fn: Callable[..., Any], rank: int, ws: int, args: tuple[Any, ...], conn: Any) -> None:
    try:
        value = fn(rank, ws, *args)
        conn.send(("ok", value))
    except BaseException as exc:
        conn.send(("error", (type(exc).__name__, str(exc))))
    conn.close()


class Ranks:
    """Rank processes whose results are read one by one; every process is killed and reaped."""

    def __init__(self, fn: Callable[..., Any], ws: int, *args: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self.procs: list[Any] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for rank in range(ws):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, rank, ws, args, w), daemon=True)
            p.start()
            w.close()
            self.procs.append(p)
            self.conns.append(r)

    def result(self, rank: int, timeout: float) -> tuple[str, Any]:
        if not self.conns[rank].poll(timeout):
            raise AssertionError(f"rank {rank} gave no result within {timeout} s")
        status, value = self.conns[rank].recv()
        return status, value

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # also ends a stopped process
            p.join(10)
        for c in self.conns:
            c.close()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def kill_body(rank: int, ws: int, port: int, name: str, how: str) -> tuple[str, str, float]:
    a = arena(rank, ws, port, name, heartbeat_interval=0.2, timeout=30)
    x = torch.ones(200_000)  # 800 KB: a dozen frames of 64 KiB
    a.all_reduce(x)
    if rank == 1:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            pub = a._pub
            calls = [0]

            def dying_pub(word: int, value: int) -> None:
                pub(word, value)
                calls[0] += 1
                if calls[0] == 7:  # mid-operation: some frames done, most not
                    os.kill(os.getpid(), signal.SIGKILL)

            a._pub = dying_pub  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        a.all_reduce(x)
    except PeerError as exc:
        return ("PeerError", str(exc), time.monotonic() - t0)
    finally:
        a.close()
    return ("no error", "", time.monotonic() - t0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ws", [2, 3])
def test_kill_9_mid_all_reduce_raises_peer_error_naming_it(server: LocalStore, ws: int) -> None:
    name = unique("kill")
    with Ranks(kill_body, ws, server.port, name, "kill") as ranks:
        pid = ranks.procs[1].pid
        for rank in [0, *range(2, ws)]:
            status, value = ranks.result(rank, 30)
            assert status == "ok", value
            kind, msg, elapsed = value
            assert kind == "PeerError", msg
            assert "rank 1" in msg and f"pid {pid}" in msg and "all_reduce" in msg, msg
            assert elapsed < 5, elapsed
        ranks.procs[1].join(10)
        assert ranks.procs[1].exitcode == -signal.SIGKILL
    assert shm_files(name) == []


@pytest.mark.timeout(60)
def test_sigstop_is_detected_as_a_stall(server: LocalStore) -> None:
    name = unique("stop")
    with Ranks(kill_body, 2, server.port, name, "stop") as ranks:
        pid = ranks.procs[1].pid
        status, value = ranks.result(0, 30)
        assert status == "ok", value
        kind, msg, elapsed = value
        assert kind == "PeerError" and "stalled" in msg and "rank 1" in msg and f"pid {pid}" in msg, msg
        # heartbeats every 0.2/3 s, stalled after 0.6 s without one (plus the poll period)
        assert elapsed < 3, elapsed
        os.kill(pid, signal.SIGCONT)
        ranks.procs[1].join(5)  # it resumes, finds rank 0 failed, and exits
    assert shm_files(name) == []


# -- files ---------------------------------------------------------------------------------------
def test_stale_files_of_dead_processes_are_removed() -> None:
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    dead = os.path.join(SHM_DIR, f"tdist-{os.getuid()}-{p.pid}-0000-stale.seg")
    live = os.path.join(SHM_DIR, f"tdist-{os.getuid()}-{os.getpid()}-0000-live.seg")
    for path in (dead, live):
        with open(path, "wb"):
            pass
    try:
        # a fresh process's first arena sweeps them once it is formed (its first heartbeat)
        sweep = (
            "import os, sys, time\n"
            "from tdist import HashStore\n"
            "from tdist.c10d._shm import ShmArena\n"
            f"a = ShmArena(HashStore(), 0, 1, name='sweep', heartbeat_interval=0.1, stall_timeout=5, timeout=30)\n"
            f"deadline = time.monotonic() + 20\n"
            f"while os.path.exists({dead!r}) and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            f"print(os.path.exists({dead!r}), os.path.exists({live!r}))\n"
            "a.close()\n"
        )
        out = subprocess.run([sys.executable, "-c", sweep], capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == ["False", "True"], out.stderr
        assert cleanup_stale() == []
    finally:
        for path in (dead, live):
            if os.path.exists(path):
                os.unlink(path)


def test_files_are_unlinked_once_every_rank_has_mapped_them() -> None:
    name = unique("files")

    def body(rank: int, ws: int, store: Store) -> list[str]:
        a = arena(rank, ws, store, name)
        try:
            a.barrier()
            return shm_files(name)
        finally:
            a.close()

    assert run_threads(body, 3, HashStore(), timeout=30) == [[], [], []]


def _wait_for_peers(port: int, name: str) -> None:
    arena(0, 2, port, name)  # rank 1 never comes: waits in its construction


@pytest.mark.timeout(60)
def test_a_rank_killed_while_the_arena_forms_leaves_nothing_behind(server: LocalStore) -> None:
    # The segment is a memfd and the wake-ups are pipes: nothing has a name in /dev/shm, even
    # while the ranks meet (files there outlived a rank killed at that moment).
    name = unique("formkill")
    before = set(os.listdir(SHM_DIR))
    p = multiprocessing.get_context("fork").Process(target=_wait_for_peers, args=(server.port, name))
    p.start()
    try:
        client = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30))
        client.wait([f"shm/{name}/1/rank/0"])  # rank 0 made its segment and waits for rank 1
        assert shm_files(name) == [] and new_entries(before) == set()
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert shm_files(name) == [] and new_entries(before) == set()
        client.close()
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)


def test_setting_up_waits_for_the_other_ranks_within_the_arenas_timeout_not_the_stores() -> None:
    # the store waits up to 300 s by default; a rank that never comes fails the set-up at the
    # arena's own timeout, naming the key of the rank it waited for
    store = HashStore()
    assert store.timeout == timedelta(seconds=300)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="rank/1"):
        ShmArena(store, 0, 2, name=unique("alone"), timeout=0.5)
    assert time.monotonic() - t0 < 60  # (the test's own limit; a wait of the store's 300 s fails it)
