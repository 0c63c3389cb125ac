"""The ``mpi`` backend: tdist's process groups on a real MPI, through mpi4py.

``init_process_group("mpi")`` under ``mpiexec -n N python script.py`` takes rank and world size
from ``MPI_COMM_WORLD`` (``rank``/``world_size`` arguments that differ are ignored with a
warning, as torch's MPI backend ignores them; a process that MPI sees alone in a larger job is
refused) and needs no ``MASTER_ADDR``: rank 0 serves the group's store
from a thread and tells the others where it is over MPI (``mpi_world_store``). The store carries
what MPI does not: ``monitored_barrier``, the debug checks, and the diagnosis of a timed-out
operation (which ranks never reached it).

Each operation starts MPI's non-blocking call (``Iallreduce``, ``Ibcast``, ``Isend``, ...) in the
caller's thread, so every rank starts its collectives in program order, and returns a ``Work``
that completes when the request does. Waiting polls the request (``Test``) against the
operation's deadline: a stuck collective raises ``CollectiveTimeoutError`` naming the ranks that
never reached it, where torch's MPI backend waits forever.

Buffers: a contiguous tensor goes to MPI as a buffer on its own memory (no copy); a
non-contiguous one through one staging copy. Operations that only move bytes (broadcast,
gathers, scatters, all-to-all, send/recv) take every dtype as bytes; reductions take torch's
MPI types (uint8, int8, int16, int32, int64, float32, float64) and SUM, PRODUCT, MIN, MAX, the
bitwise ops on integers, and AVG on floating types (a sum, then a division).

Sub-groups (``new_group``) are communicators made by ``MPI_Comm_create_group`` among their
members only.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from mpi4py import MPI

from .._core.deadline import to_seconds
from .._core.errors import CollectiveTimeoutError, DistBackendError, DistError
from ..store import Store
from . import _flight_recorder as fr
from ._backend import Backend
from ._checks import CollectiveArgumentError
from ._tcp_backend import _NUMPY_DTYPES, _Flat, bytes_view
from ._types import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RedOpType,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
    as_red_op,
)

log = logging.getLogger(__name__)

__all__ = ["ProcessGroupMPI", "mpi_world", "mpi_world_store"]

_TYPES: dict[torch.dtype, Any] = {
    torch.uint8: MPI.UNSIGNED_CHAR,
    torch.int8: MPI.SIGNED_CHAR,
    torch.int16: MPI.SHORT,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
}
_OPS: dict[RedOpType, Any] = {
    RedOpType.SUM: MPI.SUM,
    RedOpType.AVG: MPI.SUM,  # (then divided by the group's size)
    RedOpType.PRODUCT: MPI.PROD,
    RedOpType.MIN: MPI.MIN,
    RedOpType.MAX: MPI.MAX,
    RedOpType.BAND: MPI.BAND,
    RedOpType.BOR: MPI.BOR,
    RedOpType.BXOR: MPI.BXOR,
}
_GRACE = 3.0  # seconds a timed-out rank waits to hear which others reached the operation
_POLLS = 64  # request tests between two looks at the clock (and a yield of the GIL)
_EXIT_WAIT = 10.0  # seconds a rank leaving waits for the others to leave too
_exit_hook = False


def mpi_world(rank: int = -1, world_size: int = -1) -> tuple[int, int]:
    """This process's rank and the world size in ``MPI_COMM_WORLD``. A ``rank`` or
    ``world_size`` given (not -1) that differs is ignored with a warning, as torch's MPI backend
    ignores both.

    Raises:
        RuntimeError: MPI's world is this process alone where the job is larger (``world_size``,
            else ``WORLD_SIZE``, or srun's task count): the process was not started by an MPI
            launcher (torchrun, say, starts each worker as an MPI world of its own), so every
            worker would be rank 0 of a group of 1 and train alone.
    """
    me, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if n == 1 and tasks.isdigit() and int(tasks) > 1 and "SLURM_PROCID" in os.environ:
        raise _refused(
            f"init_process_group('mpi'): srun started {tasks} tasks, but MPI sees a world of 1 "
            f"(this is task {os.environ['SLURM_PROCID']}): srun did not hand MPI its PMI; run "
            "`srun --mpi=pmi2 ...` (or set MpiDefault=pmi2 in slurm.conf)"
        )
    env_size = os.environ.get("WORLD_SIZE", "")
    wanted = world_size if world_size >= 0 else int(env_size) if env_size.isdigit() else -1
    if n == 1 and wanted > 1:
        said = f"world_size={world_size}" if world_size >= 0 else f"WORLD_SIZE={env_size}"
        raise _refused(
            f"init_process_group('mpi'): MPI sees a world of 1 process, but {said}: this process "
            "was not started by an MPI launcher (a launcher such as torchrun starts each worker as "
            f"an MPI world of its own, where each would train alone as rank 0); run `mpiexec -n "
            f"{wanted} python ...`, or use the gloo backend under torchrun"
        )
    if (rank >= 0 and rank != me) or (world_size >= 0 and world_size != n):
        warnings.warn(
            f"For MPI backend, world_size ({world_size}) and rank ({rank}) are ignored since they "
            f"are assigned by the MPI runtime (rank {me} of {n} here).",
            stacklevel=3,
        )
    return me, n


def _refused(text: str) -> RuntimeError:
    """The error of a refused MPI world, MPI finalized first. A lone MPI process (MPICH's
    singleton) holds a shared-memory file (``/dev/shm/mpich_shm_<pid>_0``) until it finalizes;
    the tasks of a refused job are then often killed (``srun --kill-on-bad-exit`` when one of
    them exits), and a task killed before its exit handlers ran left the file behind."""
    if not MPI.Is_finalized():
        MPI.Finalize()
    return RuntimeError(text)


def mpi_world_store(rank: int, world_size: int, timeout: timedelta) -> tuple[Store, int, int]:
    """The default group's store for an MPI job, with the MPI rank and world size.

    Rank 0 serves a ``TCPStore`` from a thread; the others learn its address over MPI (the
    loopback when every rank shares rank 0's host, where the store listens on the loopback
    alone; else the first of rank 0's addresses they reach; ``MASTER_ADDR`` wins where set).
    The job's secret goes over MPI too, the launcher being the trust root: ``TDIST_SECRET`` of
    rank 0, or a fresh one, set as every rank's ``TDIST_SECRET`` (the store and any tdist
    connection of the job then prove it).

    Raises:
        RuntimeError: as ``mpi_world``.
    """
    from ..store import TCPStore
    from ..store._tcp import serving_in_a_thread
    from ..transport._link import host_id

    comm = MPI.COMM_WORLD
    me, n = mpi_world(rank, world_size)
    hosts = comm.allgather(host_id())
    global _exit_hook
    if not _exit_hook:  # (after mpi4py's own: exit handlers run last-registered first)
        atexit.register(_at_exit)
        _exit_hook = True
    explicit = os.environ.get("MASTER_ADDR")
    if me == 0:
        os.environ["TDIST_SECRET"] = os.environ.get("TDIST_SECRET") or secrets.token_hex(16)
        one_host = all(h == hosts[0] for h in hosts) and not explicit
        with serving_in_a_thread():
            store: Store = TCPStore("127.0.0.1" if one_host else "0.0.0.0", 0, n, True, timeout, wait_for_workers=False)
        port = store.port  # type: ignore[attr-defined]
        addrs = [explicit] if explicit else _local_addresses()
        comm.bcast((addrs, port, os.environ["TDIST_SECRET"]), root=0)
        return store, me, n
    addrs, port, os.environ["TDIST_SECRET"] = comm.bcast(None, root=0)
    if hosts[me] == hosts[0] and not explicit:
        addr = "127.0.0.1"
    else:
        addr = _reachable(addrs, port)
    return TCPStore(addr, port, n, False, timeout), me, n


def _quiet_barrier(comm: Any, seconds: float) -> bool:
    """A barrier on ``comm`` that gives up after ``seconds`` (and never raises); whether every
    rank came. It waits with the GIL free, so that rank 0's store thread goes on serving."""
    try:
        request = comm.Ibarrier()
        deadline = time.monotonic() + seconds
        while not request.Test():
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-4)
        return True
    except MPI.Exception:
        return False


def _at_exit() -> None:
    """Before MPI finalizes (which blocks holding the GIL, so that rank 0's store thread could
    not answer a rank still using it): wait for every rank to be at its exit too."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        _quiet_barrier(MPI.COMM_WORLD, _EXIT_WAIT)


def _local_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last (from the kernel's routing table)."""
    found: list[str] = []
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for prev, line in itertools.pairwise(lines):
        if "/32 host LOCAL" in line:
            addr = prev.strip().split()[-1]
            if addr not in found:
                found.append(addr)
    found.sort(key=lambda a: a.startswith("127."))
    return found or ["127.0.0.1"]


def _reachable(addrs: Sequence[str], port: int) -> str:
    """The first of ``addrs`` where something listens on ``port``."""
    for addr in addrs:
        try:
            with socket.create_connection((addr, port), timeout=2.0):
                return addr
        except OSError:
            continue
    raise DistBackendError(
        f"init_process_group('mpi'): cannot reach rank 0's store on port {port} at any of "
        f"{', '.join(addrs)}; set MASTER_ADDR to an address of rank 0's host that this host reaches"
    )


def _typed(t: torch.Tensor, op: RedOpType, what: str) -> Any:
    mpi_type = _TYPES.get(t.dtype)
    if mpi_type is None:
        raise CollectiveArgumentError(
            f"{what}: the mpi backend reduces uint8, int8, int16, int32, int64, float32 and "
            f"float64 tensors (MPI's types), not {str(t.dtype).replace('torch.', '')}"
        )
    mpi_op = _OPS.get(op)
    if mpi_op is None:
        raise CollectiveArgumentError(f"{what}: ReduceOp.{op.name} is not supported by the mpi backend")
    if op == RedOpType.AVG and not t.is_floating_point():
        raise CollectiveArgumentError(f"{what}: ReduceOp.AVG on the mpi backend needs a floating-point tensor")
    return mpi_type


def _settle_reduced(flat: _Flat, op: RedOpType, size: int) -> Callable[[], None]:
    """What a reduction does once MPI is done: AVG's division (MPI summed), then the copy back
    of a staged result."""

    def settle() -> None:
        if op == RedOpType.AVG:
            flat.flat.div_(size)
        flat.commit()

    return settle


def _averaged(t: torch.Tensor, size: int) -> Callable[[], None]:
    """AVG's division once MPI has summed into ``t`` itself."""

    def settle() -> None:
        t.div_(size)

    return settle


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where MPI can take its memory as it is (contiguous), else one contiguous
    copy."""
    return t if t.is_contiguous() else t.contiguous()


def _concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after another, in a fresh buffer."""
    out = torch.empty(sum(_nbytes(t) for t in tensors), dtype=torch.uint8)
    off = 0
    for t in tensors:
        n = _nbytes(t)
        if n:
            out[off : off + n].copy_(_own(t).reshape(-1).view(torch.uint8))
        off += n
    return out


def _split_into(stage: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``stage``'s bytes out into ``tensors``, one after another."""
    off = 0
    for t in tensors:
        n = _nbytes(t)
        if n:
            t.copy_(stage[off : off + n].view(t.dtype).view(t.shape))
        off += n


def _displs(counts: Sequence[int]) -> list[int]:
    out, off = [], 0
    for c in counts:
        out.append(off)
        off += c
    return out


class _MPIWork(Work):
    """An operation whose MPI requests are in flight: done when they all are, then ``settle``
    (copies out of staging buffers) runs once."""

    def __init__(
        self,
        backend: ProcessGroupMPI,
        what: str,
        requests: list[Any],
        result: list[torch.Tensor],
        settle: Callable[[], None] | None,
        deadline: float,
        peer: int = -1,
        status: Any = None,
        keep: Any = None,
        entry: list[Any] | None = None,
    ) -> None:
        super().__init__(what, result=result)
        self._entry = entry  # (its flight-record entry)
        self._backend = backend
        self._requests = requests
        self._settle_fn = settle
        self._deadline = deadline
        self._peer = peer
        self._status = status
        self._keep = keep  # (staging buffers MPI writes into until the requests complete)
        self._poll_lock = threading.Lock()
        self._driven = False  # (a thread tests the requests: ``_drive``)

    def _poll(self, tries: int = 1) -> bool:
        """Test the requests (up to ``tries`` times in a tight loop, as a blocking MPI call
        drives its progress engine); complete the work if they are done."""
        if self._is_done:
            return True
        if not self._poll_lock.acquire(blocking=False):
            return False
        try:
            if self._is_done:
                return True
            requests = self._requests
            try:
                test: Callable[[], Any]
                if self._status is not None:
                    test = functools.partial(requests[0].Test, self._status)
                elif len(requests) == 1:  # (the usual case: one call, tested without a list)
                    test = requests[0].Test
                else:
                    test = functools.partial(MPI.Request.Testall, requests)
                done = bool(test())
                while not done and tries > 1:
                    tries -= 1
                    done = bool(test())
            except MPI.Exception as exc:
                err = DistBackendError(f"rank {self._backend.rank()}: {self._op} failed in MPI: {exc.Get_error_string()}")
                self._backend._broken = err
                self._fail(err)
                return True
            if not done:
                return False
            if self._settle_fn is not None:
                self._settle_fn()
            source = self._status.Get_source() if self._status is not None else -1
            self._keep = None
            if self._entry is not None:
                self._entry[fr.DONE] = time.time_ns()
            self._complete(None, source_rank=source)
            return True
        finally:
            self._poll_lock.release()

    def is_completed_quietly(self) -> bool:
        return super().is_completed()

    def is_completed(self) -> bool:
        return self._poll()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Poll the requests until done. Past the operation's deadline the work fails and the
        group is broken (its ranks no longer agree on what is in flight); past a shorter
        ``timeout`` of this call only, it raises and the operation goes on."""
        if self._poll(_POLLS):  # (the usual case: done within one round of tests)
            if timeout is None and self._exc is None:
                return True
            return super().wait(timeout)
        mine = to_seconds(timeout)
        until = time.monotonic() + mine if mine else None
        slow = time.monotonic() + 1.0
        waited = self._backend._waited
        key = (id(self._entry), threading.get_ident())
        waited.add(key)  # (a thread waits on it: the watchdog may warn of it)
        try:
            while not self._poll(_POLLS):
                now = time.monotonic()
                if now >= self._deadline:
                    err = self._backend._timed_out(self._op, self._peer, now - self._started, self._entry)
                    self._backend._broken = err
                    self._fail(err)
                    break
                if until is not None and now >= until:
                    raise CollectiveTimeoutError(f"rank {self._backend.rank()}: {self._op}: wait timed out after {mine} s")
                time.sleep(0 if now < slow else 1e-4)  # (the GIL for other threads; after a second, the core too)
        finally:
            waited.discard(key)
        return super().wait(timeout)

    def get_future(self) -> Any:
        fut = super().get_future()
        self._drive()
        return fut

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """As ``Work``'s; the requests are tested from a thread of their own meanwhile (an MPI
        request completes only when tested: a callback, such as those of the ``*_coalesced``
        and ``*_multigpu`` forms, which chain works, would otherwise never run)."""
        super().add_done_callback(fn)
        self._drive()

    def _drive(self) -> None:
        """Test the requests from a thread until they complete (once per work), unless done."""
        with self._lock:
            if self._is_done or self._driven:
                return
            self._driven = True
        threading.Thread(target=self._wait_quietly, name="tdist-mpi-future", daemon=True).start()

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # (the future carries the failure)
            pass


class ProcessGroupMPI(Backend):
    """One rank's end of a process group on the MPI communicator ``comm``.

    Args:
        comm: the group's communicator (a duplicate, so that a program's own MPI calls on
            ``MPI_COMM_WORLD`` never match ours).
        store: the group's store namespace (for the diagnosis of a timeout).
        timeout: the default deadline of every operation.
    """

    def __init__(self, comm: Any, store: Store | None, timeout: timedelta) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm
        # the barrier of ``shutdown`` runs on a communicator of its own: on ``comm`` it would
        # pair with a collective another rank still waits in, which then returned garbage
        self._exit_comm = comm.Dup()
        self._store = store
        self._timeout = timeout.total_seconds()
        self._seq = 0
        self._broken: DistError | None = None
        self._closed = False
        # the flight record, and its answers to a timed-out rank's questions (``_desync``)
        self._fr = fr.make_recorder(self._rank, self._size, self._timeout)
        self._waited: set[tuple[int, int]] = set()  # (id of an entry, a thread blocked in its wait)
        self._responder: Any = None
        if self._fr is not None and store is not None and self._size > 1:
            from ._desync import Responder

            self._responder = Responder(store, self._fr)
            from ._desync import watch

            watch(self._fr, self._long_wait_check)  # (a wait of 30 s names who it waits for)

    @property
    def flight_recorder(self) -> fr.Recorder | None:
        """This rank's flight record of the group (``None`` when the recorder is off)."""
        return self._fr
    @classmethod
    def create(
        cls, store: Store, rank: int, size: int, timeout: timedelta, name: str, ranks: list[int],
        gone: Callable[[int], str | None] | None = None,
    ) -> ProcessGroupMPI:
        """The group of global ranks ``ranks`` (every rank of it calls this; no other does;
        ``gone`` is not used: MPI makes the communicator)."""
        world = MPI.COMM_WORLD
        if list(ranks) == list(range(world.Get_size())):
            comm = world.Dup()
        else:
            tag = int(name) if name.isdigit() else int(name[:6], 16)
            comm = world.Create_group(world.Get_group().Incl(list(ranks)), tag % 32768)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise DistBackendError(
                f"mpi backend: group {name!r} has rank {comm.Get_rank()} of {comm.Get_size()} in MPI, "
                f"{rank} of {size} in tdist"
            )
        return cls(comm, store, timeout)

    def name(self) -> str:
        return "mpi"

    # -- running -------------------------------------------------------------------------------
    def _start(
        self,
        what: str,
        opts: Any,
        start: Callable[[], list[Any]],
        result: list[torch.Tensor],
        settle: Callable[[], None] | None = None,
        peer: int = -1,
        status: Any = None,
        keep: Any = None,
    ) -> Work:
        if self._closed:
            raise DistBackendError(f"rank {self._rank}: {what} on a destroyed process group")
        if self._broken is not None:
            raise DistBackendError(
                f"rank {self._rank}: {what}: the process group is broken by an earlier failure: {self._broken}"
            ) from self._broken
        entry = None
        rec = self._fr
        if peer == -1:  # (a collective: numbered, as every rank numbers it)
            self._seq += 1
            if rec is not None:
                if len(result) == 1:
                    entry = rec.one(what, result[0])
                else:
                    entry = rec.collective(what, tuple(t.shape for t in result), result[0].dtype if result else None)
            what = f"{what} #{self._seq}"
        elif rec is not None and result:
            t0 = result[0]
            sending = what.startswith("send")
            src, dst = (self._rank, peer) if sending else (peer, self._rank)
            entry = rec.p2p("send" if sending else "recv", t0.shape, t0.dtype, src, dst)
        t = getattr(opts, "timeout", None)
        seconds = t.total_seconds() if isinstance(t, timedelta) and t.total_seconds() > 0 else self._timeout
        try:
            requests = start()
        except MPI.Exception as exc:
            raise DistBackendError(f"rank {self._rank}: {what} failed in MPI: {exc.Get_error_string()}") from exc
        work = _MPIWork(self, what, requests, result, settle, time.monotonic() + seconds, peer, status, keep, entry)
        work._poll()
        return work

    def _long_wait_check(self, entry: list[Any]) -> None:
        """The watchdog's look at an operation that blocks (``_desync.watch``), where a thread
        waits for it: from ``_desync.long_wait()`` seconds on, each look logs a warning with
        what every rank is doing (the group's timeout still ends the wait, as in torch)."""
        from ._desync import ask_all, long_wait, say_long_wait

        rec = self._fr
        if rec is None or self._store is None or self._closed or self._broken is not None or entry[fr.DONE]:
            return
        if not any(e == id(entry) for e, _ in list(self._waited)):  # (done in MPI maybe, not waited for yet)
            return
        age = (time.time_ns() - entry[fr.STARTED]) / 1e9
        if age < long_wait():
            return
        heads, unanswered = ask_all(self._store, rec, {}, None, 1.0)
        if entry[fr.DONE]:
            return
        mine = fr.brief(fr.normalized(rec, entry), time.time_ns())
        say_long_wait(self._rank, self._size, rec.label, mine, heads, unanswered, age, self._timeout, "mpi")

    def _timed_out(self, what: str, peer: int, waited: float, entry: list[Any] | None = None) -> CollectiveTimeoutError:
        """The error of an operation past its deadline, naming who kept it waiting (what every
        rank was doing, from the flight record, where there is one: ``_desync``)."""
        if peer == -2:
            return CollectiveTimeoutError(
                f"rank {self._rank}: {what} timed out after {waited:.1f} s on the mpi backend: no rank "
                "of the group sent a matching message"
            )
        if peer >= 0:
            return CollectiveTimeoutError(
                f"rank {self._rank}: {what} timed out after {waited:.1f} s on the mpi backend: rank "
                f"{peer} of the group never matched it (dead, stopped, or in another operation)"
            )
        rec = self._fr
        if entry is not None and rec is not None and self._store is not None:
            from ._desync import diagnose

            err = CollectiveTimeoutError(f"rank {self._rank}: {what} timed out after {waited:.1f} s on the mpi backend")
            fr.Recorder.failed(entry, err)
            prefix = fr.dump_prefix() if fr.dump_on_failure() else None
            text = diagnose(self._store, rec, entry, {}, prefix)
            if prefix is not None:
                try:
                    fr.write_dump(f"{prefix}{rec.global_rank}", rec.global_rank, failed=rec)
                except OSError:
                    pass
            return CollectiveTimeoutError(f"{err}\n{text}")
        return CollectiveTimeoutError(
            f"rank {self._rank}: {what} timed out after {waited:.1f} s on the mpi backend; {self._who_is_missing(what)}"
        )

    def _who_is_missing(self, what: str) -> str:
        """Through the store: every rank that times out in the same operation says so; the
        ranks that do not within ``_GRACE`` never reached it."""
        store = self._store
        if store is None or self._size == 1:
            return "no store to ask the other ranks"
        key = f"mpi_timeout/{what}/"
        try:
            store.set(f"{key}{self._rank}", b"waiting")
            deadline = time.monotonic() + _GRACE
            waiting = {self._rank}
            while len(waiting) < self._size and time.monotonic() < deadline:
                for r in range(self._size):
                    if r not in waiting and store.check([f"{key}{r}"]):
                        waiting.add(r)
                if len(waiting) < self._size:
                    time.sleep(0.05)
        except Exception as exc:  # (the store's host may be the rank that died)
            return f"the other ranks could not be asked ({type(exc).__name__}: {exc})"
        missing = [r for r in range(self._size) if r not in waiting]
        if not missing:
            return "every rank of the group is waiting in it"
        ranks = ", ".join(map(str, missing))
        return (
            f"rank{'s' if len(missing) > 1 else ''} {ranks} of the group never reached it (dead, stopped, or "
            f"in another operation); ranks {', '.join(map(str, sorted(waiting)))} wait in it"
        )

    # -- collectives ---------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> Work:
        flat = _Flat(tensors[0])
        buf = bytes_view(flat.flat)
        return self._start(
            "broadcast", opts, lambda: [self._comm.Ibcast([buf, MPI.BYTE], root=opts.rootRank)], [tensors[0]], flat.commit
        )

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work:
        t = tensors[0]
        op = as_red_op(opts.reduceOp)
        mpi_type = _typed(t, op, "all_reduce")
        if t.dim() and t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.is_neg():  # (the quick way: MPI on t's own memory)
            arr: Any = t.numpy()
            n = arr.size
            settle = _averaged(t, self._size) if op == RedOpType.AVG else None
        else:
            flat = _Flat(t)
            arr = bytes_view(flat.flat)
            n = flat.flat.numel()
            settle = _settle_reduced(flat, op, self._size)
        return self._start(
            "all_reduce", opts, lambda: [self._comm.Iallreduce(MPI.IN_PLACE, [arr, n, mpi_type], _OPS[op])], [t], settle,
        )

    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> Work:
        t = tensors[0]
        op = as_red_op(opts.reduceOp)
        mpi_type = _typed(t, op, "reduce")
        flat = _Flat(t)
        buf = bytes_view(flat.flat)
        n = flat.flat.numel()
        root = opts.rootRank

        def start() -> list[Any]:
            if self._rank == root:
                return [self._comm.Ireduce(MPI.IN_PLACE, [buf, n, mpi_type], _OPS[op], root=root)]
            return [self._comm.Ireduce([buf, n, mpi_type], None, _OPS[op], root=root)]

        return self._start("reduce", opts, start, [t], _settle_reduced(flat, op, self._size) if self._rank == root else None)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: AllgatherOptions
    ) -> Work:
        outs = output_tensors[0]
        send = _own(input_tensors[0])
        counts = [_nbytes(o) for o in outs]
        stage = torch.empty(sum(counts), dtype=torch.uint8)
        sbuf, rbuf = bytes_view(send), bytes_view(stage)
        return self._start(
            "all_gather",
            opts,
            lambda: [self._comm.Iallgatherv([sbuf, MPI.BYTE], [rbuf, counts, _displs(counts), MPI.BYTE])],
            outs,
            lambda: _split_into(stage, outs),
            keep=(send, stage),
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions) -> Work:
        out = _Flat(output)
        send = _own(input)
        sbuf, rbuf = bytes_view(send), bytes_view(out.flat)
        return self._start(
            "all_gather_into_tensor",
            opts,
            lambda: [self._comm.Iallgather([sbuf, MPI.BYTE], [rbuf, MPI.BYTE])],
            [output],
            out.commit,
            keep=send,
        )

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: GatherOptions
    ) -> Work:
        root = opts.rootRank
        send = _own(input_tensors[0])
        sbuf = bytes_view(send)
        if self._rank != root:
            return self._start(
                "gather", opts, lambda: [self._comm.Igatherv([sbuf, MPI.BYTE], None, root=root)], [], keep=send
            )
        outs = output_tensors[0]
        counts = [_nbytes(o) for o in outs]
        stage = torch.empty(sum(counts), dtype=torch.uint8)
        rbuf = bytes_view(stage)
        return self._start(
            "gather",
            opts,
            lambda: [self._comm.Igatherv([sbuf, MPI.BYTE], [rbuf, counts, _displs(counts), MPI.BYTE], root=root)],
            outs,
            lambda: _split_into(stage, outs),
            keep=(send, stage),
        )

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> Work:
        root = opts.rootRank
        out = output_tensors[0]
        stage = torch.empty(_nbytes(out), dtype=torch.uint8)
        rbuf = bytes_view(stage)
        if self._rank == root:
            ins = input_tensors[0]
            send = _concat(ins)
            counts = [_nbytes(i) for i in ins]
            sbuf = bytes_view(send)

            def start() -> list[Any]:
                return [self._comm.Iscatterv([sbuf, counts, _displs(counts), MPI.BYTE], [rbuf, MPI.BYTE], root=root)]

            keep: Any = (send, stage)
        else:

            def start() -> list[Any]:
                return [self._comm.Iscatterv(None, [rbuf, MPI.BYTE], root=root)]

            keep = stage
        return self._start("scatter", opts, start, [out], lambda: _split_into(stage, [out]), keep=keep)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions,
    ) -> Work:
        out = output_tensors[0]
        ins = input_tensors[0]
        op = as_red_op(opts.reduceOp)
        mpi_type = _typed(out, op, "reduce_scatter")
        send = _concat(ins)
        counts = [i.numel() for i in ins]
        res = _Flat(out)
        sbuf, rbuf = bytes_view(send), bytes_view(res.flat)
        n_send = sum(counts)
        return self._start(
            "reduce_scatter",
            opts,
            lambda: [self._comm.Ireduce_scatter([sbuf, n_send, mpi_type], [rbuf, out.numel(), mpi_type], counts, _OPS[op])],
            [out],
            _settle_reduced(res, op, self._size),
            keep=send,
        )

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions) -> Work:
        op = as_red_op(opts.reduceOp)
        mpi_type = _typed(output, op, "reduce_scatter_tensor")
        send = _own(input)
        res = _Flat(output)
        sbuf, rbuf = bytes_view(send), bytes_view(res.flat)
        return self._start(
            "reduce_scatter_tensor",
            opts,
            lambda: [self._comm.Ireduce_scatter_block([sbuf, mpi_type], [rbuf, mpi_type], _OPS[op])],
            [output],
            _settle_reduced(res, op, self._size),
            keep=send,
        )

    def _alltoallv(
        self, what: str, opts: Any, outs: list[torch.Tensor], send: torch.Tensor, scounts: list[int], rcounts: list[int],
        result: list[torch.Tensor],
    ) -> Work:
        stage = torch.empty(sum(rcounts), dtype=torch.uint8)
        sbuf, rbuf = bytes_view(send), bytes_view(stage)
        return self._start(
            what,
            opts,
            lambda: [
                self._comm.Ialltoallv(
                    [sbuf, scounts, _displs(scounts), MPI.BYTE], [rbuf, rcounts, _displs(rcounts), MPI.BYTE]
                )
            ],
            result,
            lambda: _split_into(stage, outs),
            keep=(send, stage),
        )

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: AllToAllOptions) -> Work:
        send = _concat(input_tensors)
        return self._alltoallv(
            "all_to_all", opts, output_tensors, send, [_nbytes(t) for t in input_tensors],
            [_nbytes(t) for t in output_tensors], output_tensors,
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions,
    ) -> Work:
        n = self._size
        in_rows = list(input_split_sizes) or [input.shape[0] // n] * n
        out_rows = list(output_split_sizes) or [output.shape[0] // n] * n
        row_in = _nbytes(input) // max(1, input.shape[0]) if input.dim() else 0
        row_out = _nbytes(output) // max(1, output.shape[0]) if output.dim() else 0
        send = _own(input)
        return self._alltoallv(
            "all_to_all_single", opts, [output], send, [r * row_in for r in in_rows], [r * row_out for r in out_rows],
            [output],
        )

    def barrier(self, opts: BarrierOptions) -> Work:
        return self._start("barrier", opts, lambda: [self._comm.Ibarrier()], [])

    # -- point to point ------------------------------------------------------------------------
    def _tag(self, tag: int) -> int:
        upper = int(self._comm.Get_attr(MPI.TAG_UB) or 32767)
        if not 0 <= tag <= upper:
            raise CollectiveArgumentError(f"tag must be an integer from 0 to {upper} (MPI_TAG_UB) on the mpi backend, got {tag}")
        return tag

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        t = tensors[0]
        send = t if t.is_contiguous() else t.contiguous()
        buf = bytes_view(send)
        tag = self._tag(tag)
        return self._start(
            f"send to rank {dst}", None, lambda: [self._comm.Isend([buf, MPI.BYTE], dst, tag)], [t], peer=dst, keep=send
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        return self._recv(tensors[0], src, tag, f"recv from rank {src}")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        return self._recv(tensors[0], MPI.ANY_SOURCE, tag, "recv from any rank")

    def _recv(self, t: torch.Tensor, src: int, tag: int, what: str) -> Work:
        flat = _Flat(t)
        buf = bytes_view(flat.flat)
        tag = self._tag(tag)
        status = MPI.Status()
        return self._start(
            what, None, lambda: [self._comm.Irecv([buf, MPI.BYTE], src, tag)], [t], flat.commit,
            peer=src if src != MPI.ANY_SOURCE else -2, status=status,
        )

    # -- lifetime ------------------------------------------------------------------------------
    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def shutdown(self) -> None:
        """Wait (within bounds) for every rank of the group to get here, then free the
        communicator: no rank then still needs the store that rank 0's process serves."""
        if self._closed:
            return
        if self._responder is not None:
            self._responder.stop()
        if self._fr is not None:
            from ._desync import unwatch

            unwatch(self._fr)
        if self._broken is None and not MPI.Is_finalized():
            _quiet_barrier(self._exit_comm, min(self._timeout, _EXIT_WAIT))
        self._closed = True
        comm, self._comm = self._comm, None
        for c in (comm, self._exit_comm):
            if c is not None and c != MPI.COMM_NULL and not MPI.Is_finalized():
                try:
                    c.Free()
                except MPI.Exception:
                    pass

    def abort(self) -> None:
        """Ends the whole MPI job, as torch's MPI backend does (MPI has no way to leave one
        communicator's operations behind)."""
        MPI.COMM_WORLD.Abort(1)
