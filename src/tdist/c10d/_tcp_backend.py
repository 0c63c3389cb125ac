"""The ``tcp`` backend (alias ``gloo``): collectives as pure schedules run over the transport.

Theory of operation. Each collective takes the next sequence number of the group, picks an
algorithm (``_schedules``), cuts its data into chunks (contiguous flat views of the tensors, or
staging copies), and runs the schedule step by step: post this step's receives, send this
step's chunks, wait for the receives, then copy or reduce what arrived. Every message carries a
fingerprint of the call (operation, sequence number, dtype, size) that the receiver compares
with its own: ranks that call different collectives, or the same with different shapes or
dtypes, fail with an error naming both sides instead of corrupting data or hanging; the rank
that notices aborts the group so that every other rank hears of it at once.

Operations run inline in the calling thread when nothing issued earlier is still pending and the
caller will wait anyway (``opts.asyncOp`` false); otherwise they queue, in issue order, for the
group's worker thread. Point-to-point receives complete from the transport's reader threads.

Tensors may be non-contiguous: they are gathered into a contiguous copy and written back only
inside the view. Integer AVG is refused (there is no exact integer mean).

Every operation also takes an entry of the group's flight record (``_flight_recorder``) as it is
issued, stamped as it starts and completes. A timeout or a lost peer asks every rank what it
was doing (``_desync.diagnose``), adds the account to the error before the group is aborted (so
the abort carries it to every rank), and has every rank write its dump; a collective that
blocks is compared with the other ranks' calls by the watchdog (``_desync.watch``), whose
verdict on a mismatch breaks the group the same way.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Container, Sequence
from datetime import timedelta
from typing import Any

import torch

from .._core._process import proc_stat
from .._core.errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistTimeoutError,
    PeerError,
    fresh,
)
from ..transport import Endpoint, RecvHandle
from ..transport._liveness import GROUP_STALL, default_interval, default_stall_timeout
from ..transport._serialization import dumps, loads
from . import _flight_recorder as fr
from . import _schedules as S
from ._backend import Backend, register_backend_creator
from ._checks import CollectiveArgumentError, check_split_sizes
from ._desync import (
    Responder,
    ask_all,
    crossed,
    cycle,
    describe_call,
    diagnose,
    entered,
    explain,
    frames_of,
    long_wait,
    mismatch,
    receives_crossed,
    request_dumps,
    say_long_wait,
    stuck,
    unwatch,
    watch,
)
from ._flight_recorder import DONE, STARTED, UNTIMED, Recorder
from ._reduce import reduce_into
from ._shm._tensors import copy_back
from ._threads import PARALLEL_BYTES, capped
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

__all__ = ["ProcessGroupTCP", "bytes_view", "reduce_into"]

log = logging.getLogger(__name__)

_COLL_TAG = 1 << 62
_CHAIN_MIN = 4 << 20  # bytes: pipelined chain broadcast above (world > 2)


def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (no copy), or of a copy of its
    values where its memory holds their negatives (the negative bit, ``z.conj().imag``: for
    sending; what is received goes into a ``_Flat``, which has no such bit)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype in _NUMPY_DTYPES and t.dim() and t.is_contiguous():  # (the quick way)
        quick: Any = t.numpy()
        return memoryview(quick).cast("B")
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


# dtypes whose numpy arrays a memoryview takes (not bfloat16 and the like, which numpy lacks,
# nor complex ones, whose buffer format memoryview cannot cast)
_NUMPY_DTYPES = frozenset({
    torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.bool,
})


def _shapes(ts: list[torch.Tensor]) -> tuple[torch.Size, ...]:
    """The shapes the flight recorder keeps (never the tensors)."""
    return (ts[0].shape,) if len(ts) == 1 else tuple(t.shape for t in ts)


def _stacked(n: int, t: torch.Tensor) -> tuple[torch.Size]:
    """``n`` tensors like ``t`` as one shape (how torch's recorder shows a list of them)."""
    return (torch.Size((n, *t.shape)),)


_time_ns = time.time_ns
_get_ident = threading.get_ident
Entry = list[Any] | tuple[Any, ...]  # a flight-record entry: full, or short (``_flight_recorder``)
_MARK = "What the ranks of group"  # (how ``_desync.explain`` starts)
_MISMATCH = "collective mismatch in group"  # (the desync check's verdict)
_DEADLOCK = "deadlock between groups"  # (its verdict on calls crossed between groups)
_DEADLOCK_P2P = "point-to-point deadlock in group"  # (on two ranks that both receive first)
_RECENT_OWN = 16  # (this rank's operations looked at for any other in flight)
# a failure that quotes one of these says already what went wrong, naming both sides
_QUOTED = (_MARK, _MISMATCH, _DEADLOCK, _DEADLOCK_P2P, "mismatched calls", "collective mismatch in shared-memory arena")
# the groups a deadlock verdict names ("deadlock between groups 'a', 'b' and 'c' (found ...")
_DEADLOCK_GROUPS = re.compile(_DEADLOCK + r" ((?:'[^']*'(?:, | and )?)+) \(")


# what the transport and the arena say of a peer that is gone, wherever in a (quoted) message
_FATES = (
    (re.compile(r"peer rank (\d+) \(pid \d+\) stalled|rank (\d+) \([^)]*\) has sent nothing"),
     "is stalled (no heartbeat: stopped, hung, or cut off)"),
    (re.compile(r"peer rank (\d+) \(pid \d+\) closed|rank (\d+) \([^)]*\) left the process group"),
     "left the group"),
    (re.compile(r"peer rank (\d+) \(pid \d+\) died|connection to rank (\d+) \([^)]*\)[^;]* was lost"),
     "is gone (its process died or its connection was lost)"),
)


def _gone(exc: PeerError, me: int) -> dict[int, str]:
    """The peers a ``PeerError`` (or the failure of another rank it quotes) says are gone:
    dead, stalled or left, with what became of them. A peer that failed or aborted the group
    itself is alive and can still answer."""
    text = str(exc)
    out: dict[int, str] = {}
    for pattern, fate in _FATES:
        for m in pattern.finditer(text):
            q = int(m.group(1) or m.group(2))
            if q != me:
                out.setdefault(q, fate)
    return out


def _check_op(op: RedOpType, dtype: torch.dtype, what: str) -> None:
    # CollectiveArgumentError is both the RuntimeError gloo raises here and a ValueError
    if op == RedOpType.PREMUL_SUM:
        raise CollectiveArgumentError(f"{what}: Cannot use ReduceOp.PREMUL_SUM with Gloo (only NCCL has it)")
    if op == RedOpType.UNUSED:
        raise CollectiveArgumentError(f"{what}: invalid ReduceOp.UNUSED")
    if op in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise CollectiveArgumentError(
            f"{what}: Cannot use ReduceOp.{op.name} with non-integral dtype ({dtype})"
        )
    if op in (RedOpType.MIN, RedOpType.MAX) and dtype.is_complex:
        raise CollectiveArgumentError(f"{what}: ReduceOp.{op.name} is not defined for complex tensors ({dtype})")
    if op == RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise CollectiveArgumentError(
            f"{what}: ReduceOp.AVG needs a floating point or complex tensor, got {dtype}"
        )
    if dtype not in _KERNELS:  # (uint16/32/64, float8s, ...: probed; one set lookup)
        missing = _no_kernel(op, dtype)
        if missing is not None:
            raise CollectiveArgumentError(f"{what}: cannot apply ReduceOp.{op.name} to {dtype}: {missing}")


# the dtypes torch 2.13 has every reduction kernel for (the op checks above aside); the others
# (uint16/32/64 have no add, min or max, float8s no add, ...) are probed once per op
_KERNELS = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})


_kernels: dict[tuple[RedOpType, torch.dtype], str | None] = {}


def _no_kernel(op: RedOpType, dtype: torch.dtype) -> str | None:
    """Why torch cannot reduce ``dtype`` with ``op`` (uint16/32/64 have no add, min or max), or None.

    Probed once per pair on two elements, before anything is sent, so that every world size
    (one rank too) and both paths (arena, sockets) refuse the same calls, as RuntimeError
    (gloo's "Invalid scalar type")."""
    key = (op, dtype)
    if key not in _kernels:
        try:
            reduce_into(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype), op)
            _kernels[key] = None
        except Exception as exc:  # torch has no kernel for this dtype
            _kernels[key] = str(exc)
    return _kernels[key]


# Python processes on a CPU-bound host: reductions cost (torch's add runs at a few GB/s), so
# large all_reduces prefer the ring, which reduces 1/n of the buffer, to recursive doubling
_COST = S.CostModel(reduce_bytes_per_s=4e9)
_PIECE = 1 << 20  # bytes per message of a large transfer
_MAX_PIECES = 4096


def _check_own_part(outs: list[torch.Tensor], ins: list[torch.Tensor], rank: int, what: str) -> None:
    """What a rank sends itself fits where it lands (checked before anything is sent; gloo's
    type, RuntimeError, which CollectiveArgumentError is)."""
    if outs[rank].numel() != ins[rank].numel():
        raise CollectiveArgumentError(
            f"{what}: rank {rank} sends itself {ins[rank].numel()} elements (its input's part "
            f"{rank}) into {outs[rank].numel()} (its output's part {rank}): the sizes must agree"
        )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: ``[first, end)`` in the address space (empty: nothing)."""
    p = t.data_ptr()
    if t.is_contiguous():
        return p, p + t.nbytes
    if t.numel() == 0:
        return p, p
    return p, p + (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _apart(ins: list[torch.Tensor], outs: list[torch.Tensor], harmless: Container[tuple[int, int]] = ()) -> list[torch.Tensor]:
    """``ins``, each that shares memory with an output slot replaced by a copy. A collective
    writes its output slots while it still reads its inputs; an input that is another slot
    (``all_gather(outs, outs[k])``), a view of another rank's part of the output, or an input
    list that is the output list turned round, would be read after a peer's data overwrote
    it (gloo copies its inputs first). ``harmless`` holds the pairs ``(i, k)`` where input
    ``i`` may be exactly slot ``k`` (the usual in-place call: the input is its own slot),
    which copies nothing."""
    spans = [_span(o) for o in outs]
    result = ins
    for i, t in enumerate(ins):
        lo, hi = _span(t)
        if lo == hi:
            continue
        for k, (a, b) in enumerate(spans):
            if a < hi and lo < b and not ((a, b) == (lo, hi) and (i, k) in harmless):
                if result is ins:
                    result = list(ins)
                result[i] = t.clone(memory_format=torch.contiguous_format)
                break
    return result


def _apart_from_part(inp: torch.Tensor, output: torch.Tensor, part: int) -> torch.Tensor:
    """``inp``, or a copy of it where it shares memory with ``output`` other than by being
    exactly its part ``part`` (parts as large as ``inp``, in order: all_gather_into_tensor's
    in-place call, which copies nothing); ``_apart`` for one output cut in parts."""
    lo, hi = _span(inp)
    a, b = _span(output)
    if lo == hi or hi <= a or b <= lo:
        return inp
    if output.is_contiguous() and inp.is_contiguous() and lo == a + part * inp.nbytes:
        return inp
    return inp.clone(memory_format=torch.contiguous_format)


def _align(nbytes: int) -> int:
    return (nbytes + 63) & ~63


def _piece_bounds(numel: int, element_size: int) -> list[tuple[int, int]]:
    """Element ranges of the pieces a transfer of ``numel`` elements travels in."""
    per = max(1, _PIECE // element_size, -(-numel // _MAX_PIECES))
    return [(a, min(a + per, numel)) for a in range(0, numel, per)] or [(0, 0)]


class _StepRecv:
    """One receive of a schedule step: where it lands and how far it has been applied."""

    __slots__ = ("bounds", "buf", "direct", "handles", "next", "recv")

    def __init__(
        self, recv: S.Recv, buf: torch.Tensor, direct: bool, bounds: list[tuple[int, int]], handles: list[RecvHandle]
    ) -> None:
        self.recv = recv
        self.buf = buf
        self.direct = direct
        self.bounds = bounds
        self.handles = handles
        self.next = 0


class _Flat:
    """A contiguous flat working copy of a tensor, written back on ``commit`` (the tensor
    itself where it is contiguous and its memory holds its values: no negative bit)."""

    def __init__(self, t: torch.Tensor, copy: bool = False) -> None:
        self.orig = t
        self.direct = t.is_contiguous() and not copy and not t.is_neg()
        self.flat = t.view(-1) if self.direct else t.reshape(-1).clone()

    def commit(self) -> None:
        if not self.direct:
            copy_back(self.orig, self.flat)


class _RecvWork(Work):
    """A point-to-point receive: done when the transport's reader has filled the tensor."""

    def __init__(
        self, backend: ProcessGroupTCP, handle: RecvHandle, flat: _Flat, what: str, deadline: float, entry: list[Any] | None
    ) -> None:
        super().__init__(what, result=[flat.orig])
        self._backend = backend
        self._handle = handle
        self._flat = flat
        self._deadline = deadline
        self._entry = entry

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Wait for the message (see ``Work.wait``): a ``timeout`` that expires before the
        group's deadline raises ``DistTimeoutError`` and the receive goes on, as every work's
        (the message is not lost: it lands in this tensor, and a later ``wait`` returns)."""
        if not self.is_completed():
            deadline = self._deadline
            if timeout is not None:
                seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
                if seconds > 0:
                    deadline = min(deadline, time.monotonic() + seconds)
            try:
                self._backend._ep.wait(self._handle, deadline, self._op)
            except DistError as caught:
                if isinstance(caught, DistTimeoutError) and deadline < self._deadline and not self._handle.finished:
                    raise  # (the caller's own limit: the operation goes on)
                # (the desync check's verdict, where it broke the group under this receive: it
                # says why, and what both sides were doing, already)
                exc = self._backend._verdict or caught
                if exc is caught:
                    self._backend._untaken_tags(self._handle, exc)
                if self._entry is not None:
                    Recorder.failed(self._entry, exc)
                    if exc is caught:  # (what every rank of the group was doing, as a collective's failure says)
                        self._backend._explain(self._entry, exc)
                self._fail(exc)
                try:
                    if exc is caught:
                        raise
                    raise fresh(exc) from caught  # (the verdict is kept: see ``fresh``)
                finally:  # (no cycle through this frame: see ``errors.fresh``)
                    del exc
            self._settle()
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not super().is_completed() and self._backend._ep.progress(self._handle):
            self._settle()
        return super().is_completed()

    def _settle(self) -> None:
        h = self._handle
        e = self._entry
        if h.error is not None:
            exc = self._backend._verdict or h.error
            if e is not None:
                Recorder.failed(e, exc)
            self._fail(exc)
            return
        self._flat.commit()
        if e is not None:
            e[DONE] = _time_ns()
        self._complete([self._flat.orig], source_rank=h.source)

    def get_future(self) -> Any:
        fut = super().get_future()
        if not self.is_completed():
            threading.Thread(target=self._wait_quietly, daemon=True).start()
        return fut

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except DistError:
            pass


_no_arena_logged: set[str] = set()
_recording: weakref.WeakSet[ProcessGroupTCP] = weakref.WeakSet()  # (the groups with a flight record)


def _log_no_arena(why: str) -> None:
    """Say once per process why groups of one host run their collectives over sockets."""
    if why not in _no_arena_logged:
        _no_arena_logged.add(why)
        log.warning("tdist: %s; process groups of one host run their collectives over sockets", why)


class ProcessGroupTCP(Backend):
    """Our CPU backend over ``tdist.transport`` (Unix sockets on one host, TCP across hosts).

    Args:
        store: the group's private store.
        rank: this rank in the group.
        size: the group's size.
        timeout: the default deadline of every operation (and of building connections).
    """

    def __init__(
        self, store: Any, rank: int, size: int, timeout: timedelta, name: str = "",
        gone: Callable[[int], str | None] | None = None,
    ) -> None:
        super().__init__(rank, size)
        self._timeout = timeout.total_seconds()
        self._group_name = name
        self._store = store
        self._seq = 0
        self._lock = threading.Lock()  # serializes execution of collectives
        self._queue: deque[tuple[Work, Callable[[], list[torch.Tensor]], list[Any] | None]] = deque()
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._broken: BaseException | None = None
        self._arena: Any = None
        self._stage_buf: torch.Tensor | None = None
        self._topo: S.Topology | None = None
        self._schedules: dict[int, S.Schedule] = {}  # (all_reduce's, by size)
        # The shared-memory arena's half of this rank goes out with its address: one exchange
        # through the store, one wait for the other ranks. (The connections are then made in a
        # thread while the arena is joined.)
        try:
            self._form(store, rank, size, name, gone)
        except BaseException as exc:
            # (a rank that fails on its own, as a listener that cannot take its address, says
            # so: the others fail at once, naming it, where they would wait for it until the
            # group's timeout; not one that failed for them, nor over a peer, which it names)
            if size > 1 and not isinstance(exc, DistError):  # (tdist's errors are about its peers)
                Endpoint.publish_failure(store, rank, exc)
            raise
        # the flight record (None with TDIST_FR_BUFFER_SIZE=0) and its answers to the group's
        # diagnosis requests (``_desync``)
        self._fr = fr.make_recorder(rank, size, self._timeout)
        if self._fr is not None:
            _recording.add(self)
        self._timed = self._fr is not None and self._fr.timed  # (stamp inline completions)
        if self._fr is not None:
            self._fr.busy = self._lock.locked  # (a short entry runs under the lock)
        self._responder: Responder | None = None
        self._watching = False  # (the desync check's watch started: ``_after_forming``)
        self._verdict: CollectiveMismatchError | None = None  # the desync check's
        if self._fr is not None:
            self._fr.identify(name=name or None)
            if size > 1:
                # (the responder, and the watch of the desync check, start on the endpoint's
                # first heartbeat round, on its reader thread: forming the group starts no
                # thread for them, and the responder connects once the group is up)
                self._responder = Responder(store, self._fr, start=False)
                self._ep.add_tick(self._after_forming)

    def _form(self, store: Any, rank: int, size: int, name: str, gone: Callable[[int], str | None] | None) -> None:
        """Exchange addresses and this host's arena halves through ``store``, join the arena,
        make the connections."""
        offer = self._offer_arena(rank, size, name)
        try:
            self._ep = Endpoint(
                store, rank, size, timeout=self._timeout, name=name, connect_later=True,
                extra=None if offer is None else {"shm": offer.record}, gone=gone,
            )
        except BaseException:
            if offer is not None:
                offer.close()
            raise
        if offer is not None:
            # Every rank of the group on this host, each with its half made (symmetric facts, so
            # all ranks agree): collectives go through the arena, never through sockets
            records = {q: (x or {}).get("shm") for q, x in self._ep.peer_extras.items()}
            if all(self._ep.same_host(q) for q in records) and all(r is not None for r in records.values()):
                try:
                    offer.join({**records, rank: offer.record})
                except BaseException:
                    self._ep.close()
                    raise
                self._arena = offer
                self._ep.add_tick(offer.beat)  # (its heartbeat rides on the endpoint's thread)
            else:
                offer.close()
        try:
            self._ep.connected()
        except BaseException:
            if self._arena is not None:
                self._arena.close()
            self._ep.close()
            raise
        if self._arena is not None:
            # (the arena proves what lanes need: x86's store order, and that these processes
            # may open each other's descriptors): small point-to-point messages go by lane
            self._ep.enable_lanes()

    def _after_forming(self) -> None:
        """Each of the endpoint's heartbeat rounds (on its reader thread): the first starts the
        desync responder and the watch of this group's collectives (never raises)."""
        if self._watching or self._closed or self._fr is None:
            return
        self._watching = True
        try:
            if self._responder is not None:
                self._responder.start()
            watch(self._fr, self._desync_check)
        except Exception as exc:  # (the interpreter is shutting down)
            log.debug("rank %d: the flight recorder's watch did not start: %s", self._rank, exc)

    def _offer_arena(self, rank: int, size: int, name: str) -> Any:
        """This rank's half of a shared-memory arena (``ShmArena(store=None)``), or None where
        there can be none: one rank, ``TDIST_SHM=0``, a memory order weaker than x86's (the same
        for every rank of a host), or a failure to make it (said once; the group then runs
        over sockets, as every rank learns from this one's missing half)."""
        if size <= 1 or os.environ.get("TDIST_SHM", "1") == "0":
            return None
        from ._shm import ShmArena, memory_order_ok

        refused = memory_order_ok()
        if refused is not None:
            _log_no_arena(refused)
            return None
        try:
            return ShmArena(
                None, rank, size, name=name or "pg", timeout=self._timeout,
                heartbeat_interval=default_interval(), stall_timeout=default_stall_timeout(GROUP_STALL), beats=False,
            )
        except (OSError, DistError) as exc:
            _log_no_arena(f"rank {rank} could not make its part of a shared-memory arena ({exc})")
            return None

    def lost_peers(self) -> dict[int, str]:
        """The ranks of the group whose process is known gone, with why (``monitored_barrier``
        does not wait for them)."""
        return self._ep.lost_peers()

    def _untaken_tags(self, handle: RecvHandle, exc: DistError) -> None:
        """A receive that failed: name the tags of the messages its peer sent that no receive
        took (gloo's sender would block in its send; tdist's returned, and its receiver waits)."""
        tags = [t for t in self._ep.untaken_tags(handle.peer, _COLL_TAG) if t != handle.tag]
        if tags and exc.args and isinstance(exc.args[0], str):
            who = "its peer" if handle.peer < 0 else f"rank {handle.peer}"
            exc.args = (
                f"{exc.args[0]} ({who} sent messages with tag {', '.join(map(str, tags))}, which no receive "
                f"took: this one waits for tag {handle.tag}; do the tags of send and recv agree?)",
                *exc.args[1:],
            )

    def broken_by(self) -> BaseException | None:
        """The failure that broke the group (here, or on a peer, which said so), or None."""
        return self._broken or self._ep.broken

    def break_group(self, exc: DistError) -> None:
        """Break the group with ``exc``, a failure found outside its operations (the debug
        check's: a rank gone before the call): every rank's next operation fails with it, as
        after a failed operation, instead of waiting for a rank that will not come."""
        if self._broken is not None or self._closed:
            return
        self._broken = exc
        self._abort(f"rank {self._rank}: {exc}")

    def _abort(self, reason: str) -> None:
        """Tell every rank of the group that it is broken, and why (through the connections and,
        on one host, the shared-memory arena): their pending and next operations fail with it."""
        self._ep.abort(reason)
        if self._arena is not None:
            self._arena.abort(reason)

    @property
    def flight_recorder(self) -> Recorder | None:
        """This rank's flight record of the group (``None`` when the recorder is off)."""
        return self._fr

    def _dump_everywhere(self) -> None:
        """Every rank of the group writes its dump (``TDIST_FR_DUMP_ON_FAILURE``)."""
        rec = self._fr
        if rec is None or not fr.dump_on_failure():
            return
        try:
            request_dumps(self._store, rec, fr.dump_prefix(), 1.0, first=True)
        except Exception as err:  # (the store may be what failed)
            log.warning("rank %d: writing the flight-record dumps failed: %s", self._rank, err)

    def _desync_check(self, entry: list[Any]) -> None:
        """The watchdog's check of a collective that blocks (``_desync.watch``): ask the other
        ranks what they called at its sequence number; another call there (no message may ever
        cross between such calls, so nothing else would notice before the timeout) breaks the
        group with a ``CollectiveMismatchError`` naming both sides, on every rank."""
        rec = self._fr
        if rec is None or self._closed or self._broken is not None or self._verdict is not None or entry[DONE]:
            return
        if entry[fr.PEER] is not None:
            self._check_receives_crossed(entry)
            if (_time_ns() - entry[STARTED]) / 1e9 >= long_wait() and not entry[DONE] and self._broken is None:
                heads, unanswered = ask_all(self._store, rec, {}, None, 1.0)
                self._warn_of_long_wait(entry, fr.brief(fr.normalized(rec, entry), _time_ns()), heads, unanswered)
            return
        heads, unanswered = ask_all(self._store, rec, {}, None, 1.0)
        mine = fr.brief(fr.normalized(rec, entry), _time_ns())
        culprits = mismatch(mine, heads)
        if not culprits:
            self._check_crossed(entry, mine, heads)
            self._warn_of_long_wait(entry, mine, heads, unanswered)
            return
        if entry[DONE] or self._broken is not None:
            return
        q = culprits[0]
        theirs = next(b for b in heads[q]["recent"] if not b.get("p2p") and b.get("seq") == mine["seq"])  # type: ignore[index]
        age = (_time_ns() - entry[STARTED]) / 1e9

        message = (
            f"rank {self._rank}: {_MISMATCH} {rec.label!r} (found by the desync check after {age:.1f} s "
            f"without progress): rank {self._rank} called {describe_call(mine)} but rank {q} called {describe_call(theirs)}; "
            "every rank must call the same collectives in the same order with the same shapes and "
            f"dtypes. {explain(self._rank, self._size, mine, heads, {}, rec.label, unanswered)}"
        )
        self._break_with(CollectiveMismatchError(message))

    def _warn_of_long_wait(
        self, entry: list[Any], mine: dict[str, Any], heads: dict[int, dict[str, Any] | None], unanswered: str
    ) -> None:
        """A collective that the desync check found blocked for ``long_wait()`` seconds or more
        with nothing wrong (each rank that has not come is alive, and has called nothing else
        there) may still be a hang: a rank stuck in a loop of its own, or waiting on something
        outside the group. A warning says who the wait is for and where it is now, at this
        check and at each later one; the group's timeout still ends the wait, as in torch."""
        rec = self._fr
        if rec is None or entry[DONE] or self._broken is not None or self._verdict is not None or self._closed:
            return
        age = (_time_ns() - entry[STARTED]) / 1e9
        if age < long_wait():
            return
        say_long_wait(self._rank, self._size, rec.label, mine, heads, unanswered, age, self._timeout)

    def _break_with(self, verdict: CollectiveMismatchError, dump: bool = True, also: Sequence[ProcessGroupTCP] = ()) -> None:
        """Break the group with the desync check's ``verdict``: every rank's call fails with it;
        and the groups ``also`` with it, before this one: this group's abort wakes this rank's
        caller, which fails and may destroy its groups at once, and a rank waiting in one of
        those would then hear only that this rank closed it, not why."""
        self._verdict = verdict
        if dump:
            self._dump_everywhere()
        for g in also:
            g._break_with(CollectiveMismatchError(str(verdict)), dump=False)
        self._abort(str(verdict))

    def _check_crossed(self, entry: list[Any], mine: dict[str, Any], heads: dict[int, dict[str, Any] | None]) -> None:
        """The desync check's second question: does a rank that this blocked call waits for
        wait in turn, in another group's collective, for this rank, which cannot get there
        before this call returns (``_desync.crossed``)? Asked only where both ranks are certain
        of it (``_desync.stuck``): here, the one thread that issues this rank's operations is
        blocked in this call."""
        rec = self._fr
        me = self._blocked_for_certain(entry)
        if rec is None or me is None:
            return
        here = {**entered(me), rec.label: int(mine["seq"])}  # (this group: as far as this call)
        found = crossed(mine, heads, self._rank, here)
        if found is None:
            self._check_cycle(entry, mine, me, here, heads)
            return
        if entry[DONE] or self._broken is not None:
            return
        q, theirs = found
        h = heads[q] or {}
        who = f"rank {q}" + (f" (global rank {h['global_rank']})" if h.get("global_rank", q) != q else "")
        age = (_time_ns() - entry[STARTED]) / 1e9
        last = here[theirs["group"]]
        message = (
            f"rank {self._rank}: {_DEADLOCK} {rec.label!r} and {theirs['group']!r} (found by the desync "
            f"check after {age:.1f} s without progress): this rank is in {describe_call(mine)} of group "
            f"{rec.label!r}, which waits for {who}; {who} is in {describe_call(theirs)} of group "
            f"{theirs['group']!r}, which this rank has not entered (its last collective there is "
            f"#{last}) and cannot enter before its call in group {rec.label!r} returns. Ranks must "
            "call the collectives of the groups they share in the same order."
        )
        # and the other group, which this rank cannot call now: the rank waiting there hears of
        # it at once (its own check may come later)
        self._break_with(CollectiveMismatchError(message), also=self._siblings({theirs["group"]}))

    def _siblings(self, labels: set[str] | None = None) -> list[ProcessGroupTCP]:
        """This rank's other groups in this process (the same global rank) that are neither
        broken nor closed, oldest first; only those labelled ``labels`` where given."""
        rec = self._fr
        if rec is None:
            return []
        me = rec.global_rank
        out = [
            g for g in list(_recording)
            if g is not self and (r := g._fr) is not None and r.global_rank == me and (labels is None or r.label in labels)
            and g._broken is None and g._verdict is None and not g._closed
        ]
        return sorted(out, key=lambda g: g._fr.pg_id if g._fr is not None else 0)

    def _check_cycle(
        self, entry: list[Any], mine: dict[str, Any], me: int, entered: dict[str, int], answers: dict[int, dict[str, Any] | None]
    ) -> None:
        """The desync check's third question, where no rank of this group waits for this one
        (``_check_crossed``): do the waits go round a cycle of ranks through other groups, back
        to this rank (``_desync.cycle``)? The other ranks' answers come through the default
        group, of which every rank is a member (the largest group of this process, the oldest
        among equals); where this group is that one, its own ``answers`` are everyone's."""
        rec = self._fr
        if rec is None:
            return
        # (the largest, the oldest among equals: ``_siblings`` gives them oldest first)
        world = max(self._siblings(), key=lambda g: g._fr.size if g._fr is not None else 0, default=None)
        if world is not None and world._fr is not None and world._fr.size > self._size:
            answers, _ = ask_all(world._store, world._fr, {}, None, 1.0)
            ranks = world._fr.ranks
        elif world is not None:
            ranks = rec.ranks  # (this group is the largest: its answers are every rank's)
        else:
            return  # (no other group: no cycle through one)
        heads = {ranks[q]: h for q, h in answers.items() if q < len(ranks)}
        hops = cycle(me, mine, rec.label, rec.ranks, heads, entered)
        if hops is None or entry[DONE] or self._broken is not None:
            return
        age = (_time_ns() - entry[STARTED]) / 1e9
        groups = [rec.label, *dict.fromkeys(b["group"] for _, b, _ in hops if b["group"] != rec.label)]
        named = ", ".join(repr(g) for g in groups[:-1]) + f" and {groups[-1]!r}" if len(groups) > 1 else repr(rec.label)
        steps = [f"this rank (global rank {me}) is in {describe_call(mine)} of group {rec.label!r}, which waits for global rank {hops[0][0]}"]
        for q, b, nxt in hops:
            steps.append(
                f"global rank {q} is in {describe_call(b)} of group {b['group']!r}, which waits for "
                + (f"global rank {nxt}" if nxt != me else "this rank")
            )
        last = hops[-1][1]["group"]
        message = (
            f"rank {self._rank}: {_DEADLOCK} {named} (found by the desync check after {age:.1f} s without "
            f"progress): {'; '.join(steps)}, which has not entered it (its last collective there is "
            f"#{entered.get(last, 0)}) and cannot enter it before its call in group {rec.label!r} returns. "
            "Ranks must call the collectives of the groups they share in the same order."
        )
        # (and the group where a rank waits for this one: it hears of it at once)
        self._break_with(CollectiveMismatchError(message), also=self._siblings({last}))

    def _check_receives_crossed(self, entry: list[Any]) -> None:
        """The desync check of a receive that blocks: is the rank it waits for blocked in a
        receive from this rank (``_desync.receives_crossed``)? Asked only where this rank is
        certain that it cannot send meanwhile: the one thread that issues its operations is
        blocked in this receive, and nothing else of it is in flight."""
        rec = self._fr
        me = self._blocked_for_certain(entry)
        if rec is None or me is None:
            return
        if any(e is not entry and not e[DONE] and not e[fr.ERROR] for other in fr.recorders()
               if other.global_rank == me for e in other.live(_RECENT_OWN)):
            return
        heads, _ = ask_all(self._store, rec, {}, None, 1.0)
        mine = fr.brief(fr.normalized(rec, entry), _time_ns())
        q = receives_crossed(mine, heads, self._rank)
        if q is None or entry[DONE] or self._broken is not None:
            return
        age = (_time_ns() - entry[STARTED]) / 1e9
        message = (
            f"rank {self._rank}: {_DEADLOCK_P2P} {rec.label!r} (found by the desync check after {age:.1f} s "
            f"without progress): this rank is in {describe_call(mine)}, from rank {q}, and rank {q} is in a "
            f"receive from this rank; neither sends before its receive returns. One of the two must send "
            "first (or use isend/irecv, or batch_isend_irecv)."
        )
        self._break_with(CollectiveMismatchError(message))

    def _blocked_for_certain(self, entry: list[Any]) -> int | None:
        """This rank's global rank where the group is whole and the one thread that issues its
        operations is blocked in ``entry`` (``_desync.stuck``): it cannot issue another before
        ``entry`` returns. None where that is not certain."""
        rec = self._fr
        if rec is None or entry[DONE] or self._broken is not None:
            return None
        me = rec.global_rank
        if stuck(me) != entry[fr.THREAD] or not self._issuer_blocked(entry):
            return None
        return me

    def _issuer_blocked(self, entry: list[Any]) -> bool:
        """Whether the thread that issued ``entry`` (this group's oldest running operation) is
        blocked in it: running it (operations run one at a time) or waiting for its ``Work``."""
        for frame in frames_of(entry[fr.THREAD]):
            if frame.f_code.co_name in ("_execute", "wait"):
                owner = frame.f_locals.get("self")
                if owner is self or (isinstance(owner, Work) and getattr(owner, "_entry", None) is entry):
                    return True
        return False

    def _local_fates(self) -> dict[int, str]:
        """Peers on this host whose process is stopped or gone, as ``/proc`` says (a stopped
        rank answers nothing; this says why)."""
        out: dict[int, str] = {}
        me = os.getpid()
        for q in range(self._size):
            if q == self._rank or not self._ep.same_host(q):
                continue
            pid = self._ep.peer_pid(q)
            if pid <= 0 or pid == me:
                continue
            fields = proc_stat(pid)
            state = fields[0] if fields else None
            if state is None or state in ("Z", "X"):
                out[q] = f"is gone (its process, pid {pid}, has exited)"
            elif state in ("T", "t"):
                out[q] = f"is stopped (pid {pid} is in state {state}: SIGSTOP, or a debugger)"
        return out

    def request_dumps(self, prefix: str, timeout: float = 10.0) -> list[str]:
        """Have every rank of the group write its flight-record dump to ``<prefix><global
        rank>`` (``tdist.flight_recorder.dump_all``); the paths of those that did in time."""
        if self._fr is None:
            return []
        return request_dumps(self._store, self._fr, prefix, timeout)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether collectives run through the same-host shared-memory arena."""
        return self._arena is not None

    def _left(self, deadline: float) -> float:
        return max(0.001, deadline - time.monotonic())

    def name(self) -> str:
        return "tcp"

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    @property
    def endpoint(self) -> Endpoint:
        return self._ep

    # -- running operations --------------------------------------------------------------------
    def _deadline(self, opts: Any) -> float:
        t = getattr(opts, "timeout", None)
        seconds = t.total_seconds() if isinstance(t, timedelta) and t.total_seconds() > 0 else self._timeout
        return time.monotonic() + seconds

    def _submit(
        self, what: str, opts: Any, fn: Callable[[], list[torch.Tensor]], entry: Entry | None = None
    ) -> Work:
        if self._closed:
            raise DistBackendError(f"rank {self._rank}: {what} on a destroyed process group")
        if self._broken is not None:
            raise DistBackendError(
                f"rank {self._rank}: {what}: the process group is broken by an earlier failure: {self._broken}"
            ) from self._broken
        work = Work(what)
        with self._cv:
            inline = not getattr(opts, "asyncOp", True) and not self._queue and self._lock.acquire(blocking=False)
            if not inline:
                if entry is not None:
                    if isinstance(entry, tuple):  # (a short entry runs where it was issued)
                        entry = self._widen(entry)
                    entry[STARTED] = 0  # (queued: the worker stamps its start)
                    work._entry = entry  # type: ignore[attr-defined]  # (the desync check: who waits for it)
                self._queue.append((work, fn, entry))
                self._ensure_worker()
                self._cv.notify()
                return work
        try:
            self._execute(work, fn, entry)
        finally:
            self._lock.release()
        return work

    def _widen(self, entry: tuple[Any, ...]) -> list[Any]:
        rec = self._fr
        return rec.widen(entry) if rec is not None else fr.full(entry, 0)

    def _execute(self, work: Work, fn: Callable[[], list[torch.Tensor]], entry: Entry | None) -> None:
        try:
            result = fn()
        except BaseException as exc:
            verdict = self._verdict
            if verdict is not None and isinstance(exc, DistError) and exc is not verdict:
                exc = verdict  # (the desync check broke the group under this call: say why)
            if isinstance(entry, tuple):
                entry = self._widen(entry)
            if entry is not None:
                Recorder.failed(entry, exc)
            if isinstance(exc, DistError) and self._broken is None and not self._closed:
                if entry is not None:
                    self._explain(entry, exc)
                self._name_global_ranks(exc)
                self._broken = fresh(exc)  # (``exc`` was raised here: see ``fresh``)
                self._abort(f"{work._op} failed on rank {self._rank}: {exc}")
            work._fail(exc)
            return
        if type(entry) is list:  # (its time is discovered when the next one is issued, unless timed;
            entry[DONE] = _time_ns() if self._timed else UNTIMED  # a short entry is done once the lock is free)
        work._complete(result)

    def _name_global_ranks(self, exc: DistError) -> None:
        """In a sub-group, the ranks ``exc`` names are the group's: say which global rank each
        is (``new_group([1, 2])``: its rank 0 is global rank 1), once."""
        rec = self._fr
        if rec is None:
            return
        ranks = rec.ranks
        if ranks == list(range(self._size)) or not exc.args or not isinstance(exc.args[0], str):
            return
        mapping = ", ".join(f"{r} is global rank {g}" for r, g in enumerate(ranks))
        exc.args = (f"{exc.args[0]}\n(the ranks above are those of group {rec.label!r}: {mapping})", *exc.args[1:])

    def _explain(self, entry: list[Any], exc: DistError) -> None:
        """A timeout or a lost peer: add what every rank of the group was doing to ``exc``'s
        message (asked through the store, ``_desync``), and leave every rank's flight-record
        dump (``TDIST_FR_DUMP_ON_FAILURE``). A mismatch found here needs only the dumps: its
        message names both sides already."""
        rec = self._fr
        if rec is None or self._size == 1:
            return
        if isinstance(exc, CollectiveMismatchError):
            if exc is not self._verdict:  # (the desync check had them written)
                self._dump_everywhere()
            # (this rank's own verdict too: its check may still be writing the dumps, before it
            # breaks the other group, when another rank's abort wakes this call)
            self._pass_on_deadlock(str(exc))
            return
        if not isinstance(exc, (DistTimeoutError, PeerError)):
            return
        text = str(exc)
        if any(m in text for m in _QUOTED):  # (a peer's diagnosis or mismatch, quoted in its abort)
            self._pass_on_deadlock(text)
            return
        prefix = fr.dump_prefix() if fr.dump_on_failure() else None
        earlier = self._ep.broken
        if isinstance(exc, PeerError) and earlier is not None and _MARK in str(earlier):
            # a peer failed first and said what every rank was doing then (this rank may since
            # have moved on, as a rank that skipped a collective does): quote it
            said = str(earlier)
            explanation = f"(as the rank that failed first saw it) {said[said.index(_MARK):]}"
            prefix = None  # (that rank had every rank write its dump then)
        else:
            gone = _gone(exc, self._rank) if isinstance(exc, PeerError) else {}
            gone.update(self._local_fates())
            explanation = diagnose(self._store, rec, entry, gone, prefix)
        exc.args = (f"{text}\n{explanation}", *exc.args[1:])
        if prefix is not None:
            try:
                g = rec.global_rank
                fr.write_dump(f"{prefix}{g}", g, failed=rec)
            except OSError as err:
                log.warning("rank %d: writing the flight-recorder dump failed: %s", self._rank, err)

    def _pass_on_deadlock(self, text: str) -> None:
        """A peer's deadlock verdict reached this rank's call (``text`` quotes it): break this
        process's other groups that the verdict names, with it, before the call fails. Ranks of
        a cycle wait in groups that the rank which found it is not a member of; this rank is,
        and its caller, failing, may destroy its groups at once: a rank waiting in one would
        then hear only that this rank left it, not why."""
        found = _DEADLOCK_GROUPS.search(text)
        rec = self._fr
        if found is None or rec is None:
            return
        for g in self._siblings(set(re.findall(r"'([^']*)'", found.group(1)))):
            g._break_with(CollectiveMismatchError(text), dump=False)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work_loop, name=f"tdist-pg-{self._rank}", daemon=True)
            self._worker.start()

    def _work_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait(1.0)
                if not self._queue:
                    return
                work, fn, entry = self._queue[0]
            with self._lock:
                if entry is not None:
                    entry[STARTED] = _time_ns()
                self._execute(work, fn, entry)
                if entry is not None and entry[DONE] == UNTIMED:
                    entry[DONE] = _time_ns()
            with self._cv:
                self._queue.popleft()
                self._cv.notify_all()

    def _all_reduce_schedule(self, nbytes: int) -> S.Schedule:
        """The schedule ``choose_algorithm`` picks for this size and this group's hosts:
        recursive doubling or ring, or hierarchical when ranks share some hosts (only one rank
        per host then crosses the network). Kept per size (a schedule is immutable): a
        training loop reduces the same few sizes again and again."""
        sched = self._schedules.get(nbytes)
        if sched is None:
            if len(self._schedules) >= 64:
                self._schedules.clear()
            sched = self._schedules[nbytes] = self._make_all_reduce_schedule(nbytes)
        return sched

    def _make_all_reduce_schedule(self, nbytes: int) -> S.Schedule:
        topo = self._topology
        n = self._size
        alg = S.choose_algorithm(S.Collective.ALL_REDUCE, nbytes, n, topo, cost=_COST)
        if alg == S.Algorithm.HIERARCHICAL:
            inter = S.choose_algorithm(S.Collective.ALL_REDUCE, nbytes, topo.num_hosts, cost=_COST)
            return S.hierarchical_all_reduce(self._rank, n, topo.hosts, inter=inter)
        if alg == S.Algorithm.RECURSIVE_DOUBLING:
            return S.recursive_doubling_all_reduce(self._rank, n)
        return S.ring_all_reduce(self._rank, n)

    @property
    def _topology(self) -> S.Topology:
        if self._topo is None:
            ep = self._ep
            hosts = [ep.host_id if r == self._rank else ep.peer_host(r) for r in range(self._size)]
            # the arena, when there is one, already took the one-host case
            self._topo = S.Topology.from_hosts(hosts, shm=False)
        return self._topo

    def _next_tag(self) -> int:
        # tag = collective bit | sequence number | step (12 bits) | piece (12 bits)
        self._seq += 1
        if self._arena is None and self._size > 1:
            self._no_stale_messages()
        return _COLL_TAG | (self._seq << 24)

    def _no_stale_messages(self) -> None:
        """Over the transport: a message of an earlier collective that no receive here took
        means that its sender made another call (two ranks that both took themselves for a
        broadcast's root sent and returned; a wrong result otherwise, silently).

        Raises:
            CollectiveMismatchError: naming the sender's call.
        """
        stale = self._ep.stale(_COLL_TAG, self._seq)
        if stale is not None:
            q, meta = stale
            raise CollectiveMismatchError(
                f"rank {self._rank}: mismatched calls: rank {q} sent {meta.decode(errors='replace')}, which "
                "no call of this rank took (it made another call there, or with another root or "
                "size); every rank must call the same collectives in the same order with the same "
                "roots, shapes and dtypes"
            )

    def _fingerprint(self, what: str, dtype: torch.dtype | None = None, numel: int | None = None, detail: str = "") -> bytes:
        """What every message of a collective over the transport carries, and what a receiver
        expects (``mismatched calls`` otherwise): the call, its sequence number, dtype, size
        and ``detail`` (the reduction, the root), so that ranks that disagree on any of them
        fail at the first message, where they would get different results."""
        parts = [f"{what}#{self._seq}"]
        if dtype is not None:
            parts.append(str(dtype).replace("torch.", ""))
        if numel is not None:
            parts.append(f"[{numel}]")
        if detail:
            parts.append(detail)
        return " ".join(parts).encode()

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A reused byte buffer for receives that cannot land in place (faulted in once)."""
        buf = self._stage_buf
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self._stage_buf = buf
        return buf

    def _run(
        self,
        sched: S.Schedule,
        chunks: list[torch.Tensor],
        tagbase: int,
        meta: bytes,
        what: str,
        deadline: float,
        op: RedOpType = RedOpType.SUM,
    ) -> None:
        """Run ``sched`` over the transport. A large single-chunk transfer travels as pieces of
        about ``_PIECE`` bytes, so that reducing what has arrived overlaps with the rest."""
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        # The reductions here are piece-sized; torch's spinning intra-op threads would only
        # take the cores that the sending and receiving threads (and the kernel) need (1 MiB
        # between two processes on 2 cores: 7-8 ms with torch's 2 threads each, 1.5 ms with 1).
        with capped(1 if nbytes > PARALLEL_BYTES else 1 << 30):
            self._run_steps(sched, chunks, tagbase, meta, what, deadline, op)

    def _run_steps(
        self,
        sched: S.Schedule,
        chunks: list[torch.Tensor],
        tagbase: int,
        meta: bytes,
        what: str,
        deadline: float,
        op: RedOpType,
    ) -> None:
        ep = self._ep
        for k, step in enumerate(sched.steps):
            base = tagbase | (k << 12)
            sent_now = {c for s in step.sends for c in s.chunks}
            need = sum(
                _align(sum(chunks[c].numel() * chunks[c].element_size() for c in r.chunks))
                for r in step.recvs
            )
            stage = self._staging(need)
            off = 0
            recvs: list[_StepRecv] = []
            for r in step.recvs:
                first = chunks[r.chunks[0]] if r.chunks else None
                dtype = first.dtype if first is not None else torch.uint8
                itemsize = first.element_size() if first is not None else 1
                total = sum(chunks[c].numel() for c in r.chunks)
                direct = r.action == S.Action.COPY and len(r.chunks) == 1 and r.chunks[0] not in sent_now
                if direct:
                    buf = chunks[r.chunks[0]]
                else:
                    nbytes = total * itemsize
                    buf = stage[off : off + nbytes].view(dtype)
                    off += _align(nbytes)
                bounds = _piece_bounds(total, buf.element_size()) if len(r.chunks) == 1 else [(0, total)]
                handles = [
                    ep.post_recv(r.peer, base | i, bytes_view(buf[a:b]), meta, what)
                    for i, (a, b) in enumerate(bounds)
                ]
                recvs.append(_StepRecv(r, buf, direct, bounds, handles))
            sent_pieces: dict[int, int] = {}
            for snd in step.sends:
                if len(snd.chunks) == 1:
                    c = snd.chunks[0]
                    src = chunks[c]
                    for i, (a, b) in enumerate(_piece_bounds(src.numel(), src.element_size())):
                        ep.send(snd.peer, base | i, [bytes_view(src[a:b])], meta, deadline, what)
                        sent_pieces[c] = i + 1
                        self._apply(recvs, chunks, op, sent_pieces, False, deadline, what)
                else:
                    ep.send(snd.peer, base, [bytes_view(chunks[c]) for c in snd.chunks], meta, deadline, what)
            self._apply(recvs, chunks, op, None, True, deadline, what)

    def _apply(
        self,
        recvs: list[_StepRecv],
        chunks: list[torch.Tensor],
        op: RedOpType,
        sent_pieces: dict[int, int] | None,
        block: bool,
        deadline: float,
        what: str,
    ) -> None:
        """Copy or reduce the received pieces into their chunks, in order. Without ``block``
        only pieces that have arrived, and (for a chunk this step also sends) only ranges
        already sent: sends read the values from before the step. A lower rank's piece is the
        first operand of a reduction (``reduce_into``: the same bits on both sides of an
        exchange)."""
        rank = self.rank()
        for sr in recvs:
            r = sr.recv
            while sr.next < len(sr.handles):
                h = sr.handles[sr.next]
                if not block:
                    if not self._ep.progress(h):
                        break
                    c = r.chunks[0]
                    if sent_pieces is not None and c in sent_pieces and sr.next >= sent_pieces[c]:
                        break
                self._ep.wait(h, deadline, what)
                if not sr.direct:
                    a, b = sr.bounds[sr.next]
                    if len(r.chunks) == 1:
                        dst = chunks[r.chunks[0]][a:b]
                        piece = sr.buf[a:b]
                        if r.action == S.Action.REDUCE:
                            reduce_into(dst, piece, op, r.peer < rank)
                        else:
                            dst.copy_(piece)
                    else:
                        pos = 0
                        for c in r.chunks:
                            dst = chunks[c]
                            n = dst.numel()
                            piece = sr.buf[pos : pos + n]
                            pos += n
                            if r.action == S.Action.REDUCE:
                                reduce_into(dst, piece, op, r.peer < rank)
                            else:
                                dst.copy_(piece)
                sr.next += 1

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None) -> Work:
        opts = opts or AllreduceOptions()
        op = as_red_op(opts.reduceOp)
        for t in tensors:
            dtype = t.dtype
            _check_op(op, dtype, "all_reduce")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            flats = [_Flat(t) for t in tensors]
            # several tensors (the multi-device form): reduce locally first
            lead = flats[0].flat
            for f in flats[1:]:
                reduce_into(lead, f.flat, op)
            tag = self._next_tag()
            n = self._size
            if self._arena is not None:
                self._arena.all_reduce(lead, op, timeout=self._left(deadline))
                for f in flats[1:]:
                    f.flat.copy_(lead)
                for f in flats:
                    f.commit()
                return tensors
            if n > 1 and lead.numel() > 0:
                meta = self._fingerprint("all_reduce", lead.dtype, lead.numel(), f"op={op.name}")
                sched = self._all_reduce_schedule(lead.numel() * lead.element_size())
                if sched.nchunks == 1:
                    chunks = [lead]
                else:
                    chunks = [lead[a:b] for a, b in S.chunk_bounds(lead.numel(), sched.nchunks)]
                self._run(sched, chunks, tag, meta, "all_reduce", deadline, op)
            if op == RedOpType.AVG:
                lead.div_(n)
            for f in flats[1:]:
                f.flat.copy_(lead)
            for f in flats:
                f.commit()
            return tensors

        rec = self._fr
        entry: Entry | None
        if rec is None:
            entry = None
        elif len(tensors) == 1 and rec.short:
            # (Recorder.quick, inlined: a small all_reduce's hot path)
            n = rec.n
            rec.n = n + 1
            rec.ring[n % rec.cap] = entry = (_time_ns(), _get_ident(), rec.p2p_seq, "all_reduce", t.shape, dtype)
        else:
            entry = rec.collective("all_reduce", _shapes(tensors), tensors[0].dtype)
        return self._submit("all_reduce", opts, run, entry)

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None) -> Work:
        opts = opts or BroadcastOptions()
        root = opts.rootRank
        self._check_rank(root, "broadcast", "src")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            flats = [_Flat(t) for t in tensors]
            lead = flats[0].flat if self._rank != root else flats[opts.rootTensor].flat
            tag = self._next_tag()
            n = self._size
            if self._arena is not None:
                self._arena.broadcast(lead, root, timeout=self._left(deadline))
            elif n > 1 and lead.numel() > 0:
                meta = self._fingerprint("broadcast", lead.dtype, lead.numel(), f"root={root}")
                nbytes = lead.numel() * lead.element_size()
                if n > 2 and nbytes >= _CHAIN_MIN:
                    nchunks = max(2, min(64, nbytes // (1 << 20)))
                    sched = S.chain_broadcast(self._rank, n, root, nchunks)
                    chunks = [lead[a:b] for a, b in S.chunk_bounds(lead.numel(), nchunks)]
                else:
                    sched = S.binomial_tree_broadcast(self._rank, n, root)
                    chunks = [lead]
                self._run(sched, chunks, tag, meta, "broadcast", deadline)
            for f in flats:
                if f.flat is not lead:
                    f.flat.copy_(lead)
                f.commit()
            return tensors

        rec = self._fr
        entry = rec.collective("broadcast", _shapes(tensors), tensors[0].dtype, detail=f"root={root}") if rec is not None else None
        return self._submit("broadcast", opts, run, entry)

    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions | None = None) -> Work:
        opts = opts or ReduceOptions()
        op = as_red_op(opts.reduceOp)
        root = opts.rootRank
        self._check_rank(root, "reduce", "dst")
        for t in tensors:
            _check_op(op, t.dtype, "reduce")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            is_root = self._rank == root
            flats = [_Flat(t, copy=not is_root) for t in tensors]
            lead = flats[0].flat
            for f in flats[1:]:
                reduce_into(lead, f.flat, op)
            tag = self._next_tag()
            n = self._size
            arena_avg = False
            if self._arena is not None:
                self._arena.reduce(lead, root, op, timeout=self._left(deadline))
                arena_avg = True  # the arena divides AVG itself
            elif n > 1 and lead.numel() > 0:
                meta = self._fingerprint("reduce", lead.dtype, lead.numel(), f"op={op.name} root={root}")
                sched = S.binomial_tree_reduce(self._rank, n, root)
                self._run(sched, [lead], tag, meta, "reduce", deadline, op)
            if is_root:
                if op == RedOpType.AVG and not arena_avg:
                    lead.div_(n)
                for f in flats:
                    if f.flat is not lead:
                        f.flat.copy_(lead)
                    f.commit()
            return tensors

        rec = self._fr
        entry = rec.collective("reduce", _shapes(tensors), tensors[0].dtype, detail=f"op={op.name} root={root}") if rec is not None else None
        return self._submit("reduce", opts, run, entry)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        opts = opts or AllgatherOptions()
        # (checked here, before anything is sent: gloo's type, RuntimeError, for torch's route too)
        for i, (outs, inp) in enumerate(zip(output_tensors, input_tensors, strict=True)):
            if len(outs) != self._size:
                raise CollectiveArgumentError(
                    f"all_gather: invalid output tensor list at index {i} (expected length "
                    f"{self._size}, got {len(outs)}): one tensor per rank of the group"
                )
            mine = outs[self._rank]
            if mine.numel() != inp.numel():
                raise CollectiveArgumentError(
                    f"all_gather: invalid tensor size at index {self._rank} of the output list: "
                    f"this rank's slot has shape {tuple(mine.shape)} but its input has shape "
                    f"{tuple(inp.shape)} (the slots of the other ranks may differ)"
                )

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            for outs, inp in zip(output_tensors, input_tensors, strict=True):
                self._allgather_one(outs, _apart([inp], outs, {(0, self._rank)})[0], deadline)
            return [t for outs in output_tensors for t in outs]

        rec = self._fr
        entry = None
        if rec is not None and input_tensors:
            entry = rec.collective(
                "all_gather", _shapes(input_tensors), input_tensors[0].dtype,
                _stacked(self._size, input_tensors[0]),
            )
        return self._submit("all_gather", opts, run, entry)

    def _allgather_one(self, outs: list[torch.Tensor], inp: torch.Tensor, deadline: float) -> None:
        flats = [_Flat(t) for t in outs]
        mine = flats[self._rank].flat  # (as many elements as inp: checked before it was queued)
        tag = self._next_tag()
        if self._arena is not None:
            self._arena.all_gather([f.flat for f in flats], inp.reshape(-1), timeout=self._left(deadline))
            for f in flats:
                f.commit()
            return
        mine.copy_(inp.reshape(-1))
        if self._size > 1:
            meta = self._fingerprint("all_gather", inp.dtype)
            sched = S.ring_all_gather(self._rank, self._size)
            self._run(sched, [f.flat for f in flats], tag, meta, "all_gather", deadline)
        for f in flats:
            f.commit()

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None) -> Work:
        opts = opts or AllgatherOptions()
        if output.numel() != input.numel() * self._size:
            raise CollectiveArgumentError(
                f"all_gather_into_tensor: invalid tensor size: output has {output.numel()} "
                f"elements, expected {self._size} x {input.numel()} (the group size times the input's)"
            )

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            inp = _apart_from_part(input, output, self._rank)
            if self._arena is not None:
                self._next_tag()
                self._arena.all_gather_into_tensor(output, inp, timeout=self._left(deadline))
                return per_rank
            out = _Flat(output)
            blocks = list(out.flat.chunk(self._size)) if inp.numel() else [out.flat[:0]] * self._size
            self._allgather_one(blocks, inp, deadline)
            out.commit()
            return per_rank

        # (the work's result, as gloo's: ``output`` cut along its first dimension, one view a rank)
        per_rank = list(output.chunk(self._size)) if output.dim() else [output]

        rec = self._fr
        entry = rec.collective("all_gather_into_tensor", (input.shape,), input.dtype, (output.shape,), output.dtype) if rec is not None else None
        return self._submit("all_gather_into_tensor", opts, run, entry)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: GatherOptions | None = None,
    ) -> Work:
        opts = opts or GatherOptions()
        root = opts.rootRank
        self._check_rank(root, "gather", "dst")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            tag = self._next_tag()
            inp = input_tensors[0].contiguous()
            if self._rank == root and output_tensors and len(output_tensors[0]) == self._size:
                inp = _apart([inp], output_tensors[0], {(0, root)})[0]
            if self._arena is not None:
                outs0 = output_tensors[0] if self._rank == root else None
                if outs0 is not None and len(outs0) != self._size:
                    raise ValueError(f"gather: gather_list has {len(outs0)} tensors for a group of {self._size}")
                self._arena.gather(outs0, inp, root, timeout=self._left(deadline))
                return list(outs0) if outs0 is not None else []
            meta = self._fingerprint("gather", inp.dtype, detail=f"root={root}")
            if self._rank != root:
                self._ep.send(root, tag, [bytes_view(inp)], meta, deadline, "gather")
                return []
            outs = output_tensors[0]
            if len(outs) != self._size:
                raise ValueError(f"gather: gather_list has {len(outs)} tensors for a group of {self._size}")
            flats = [_Flat(t) for t in outs]
            handles = []
            for r in range(self._size):
                if r == root:
                    flats[r].flat.copy_(inp.reshape(-1))
                else:
                    handles.append(self._ep.post_recv(r, tag, bytes_view(flats[r].flat), meta, "gather"))
            for h in handles:
                self._ep.wait(h, deadline, "gather")
            for f in flats:
                f.commit()
            return outs

        rec = self._fr
        entry = None
        if rec is not None and input_tensors:
            inp0 = input_tensors[0]
            outs0 = _stacked(self._size, inp0) if self._rank == root else ()
            entry = rec.collective("gather", (inp0.shape,), inp0.dtype, outs0, detail=f"root={root}")
        return self._submit("gather", opts, run, entry)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ScatterOptions | None = None,
    ) -> Work:
        opts = opts or ScatterOptions()
        root = opts.rootRank
        self._check_rank(root, "scatter", "src")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            tag = self._next_tag()
            if self._arena is not None:
                ins0 = input_tensors[0] if self._rank == root else None
                if ins0 is not None and len(ins0) != self._size:
                    raise ValueError(f"scatter: scatter_list has {len(ins0)} tensors for a group of {self._size}")
                self._arena.scatter(output_tensors[0], ins0, root, timeout=self._left(deadline))
                return [output_tensors[0]]
            out = _Flat(output_tensors[0])
            meta = self._fingerprint("scatter", out.flat.dtype, detail=f"root={root}")
            if self._rank == root:
                ins = input_tensors[0]
                if len(ins) != self._size:
                    raise ValueError(f"scatter: scatter_list has {len(ins)} tensors for a group of {self._size}")
                for r in range(self._size):
                    src = ins[r].contiguous()
                    if r == root:
                        out.flat.copy_(src.reshape(-1))
                    else:
                        self._ep.send(r, tag, [bytes_view(src)], meta, deadline, "scatter")
            else:
                h = self._ep.post_recv(root, tag, bytes_view(out.flat), meta, "scatter")
                self._ep.wait(h, deadline, "scatter")
            out.commit()
            return [output_tensors[0]]

        rec = self._fr
        entry = None
        if rec is not None and output_tensors:
            out0 = output_tensors[0]
            ins0 = _stacked(self._size, out0) if self._rank == root else ()
            entry = rec.collective("scatter", ins0, out0.dtype, (out0.shape,), detail=f"root={root}")
        return self._submit("scatter", opts, run, entry)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        opts = opts or ReduceScatterOptions()
        op = as_red_op(opts.reduceOp)
        ins = input_tensors[0]
        if len(ins) != self._size:
            raise CollectiveArgumentError(
                f"reduce_scatter: invalid input tensor list (expected length {self._size}, got "
                f"{len(ins)}): one tensor per rank of the group"
            )
        if ins[self._rank].numel() != output_tensors[0].numel():
            raise CollectiveArgumentError(
                f"reduce_scatter: invalid tensor size at index {self._rank} of the input list: "
                f"{tuple(ins[self._rank].shape)} for an output of {tuple(output_tensors[0].shape)} "
                "(this rank's entry has the output's size; the others may differ)"
            )
        _check_op(op, output_tensors[0].dtype, "reduce_scatter")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            if self._arena is not None:
                self._next_tag()
                self._arena.reduce_scatter(output_tensors[0], ins, op, timeout=self._left(deadline))
                return [output_tensors[0]]
            self._reduce_scatter_blocks(output_tensors[0], [t.reshape(-1).clone() for t in ins], op, deadline)
            return [output_tensors[0]]

        rec = self._fr
        out0 = output_tensors[0]
        entry = rec.collective("reduce_scatter", _stacked(self._size, out0), out0.dtype, (out0.shape,)) if rec is not None else None
        return self._submit("reduce_scatter", opts, run, entry)

    def _reduce_scatter_blocks(self, output: torch.Tensor, blocks: list[torch.Tensor], op: RedOpType, deadline: float) -> None:
        tag = self._next_tag()
        if self._size > 1:
            meta = self._fingerprint("reduce_scatter", blocks[0].dtype, detail=f"op={op.name}")
            sched = S.ring_reduce_scatter(self._rank, self._size)
            self._run(sched, blocks, tag, meta, "reduce_scatter", deadline, op)
        mine = blocks[self._rank]
        if op == RedOpType.AVG:
            mine.div_(self._size)
        out = _Flat(output)
        if out.flat.numel() != mine.numel():
            raise ValueError(
                f"reduce_scatter: output has {out.flat.numel()} elements but rank {self._rank}'s block has {mine.numel()}"
            )
        out.flat.copy_(mine)
        out.commit()

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None) -> Work:
        opts = opts or ReduceScatterOptions()
        op = as_red_op(opts.reduceOp)
        _check_op(op, input.dtype, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self._size:
            raise CollectiveArgumentError(
                f"reduce_scatter_tensor: invalid tensor size: input has {input.numel()} elements, "
                f"expected {self._size} x {output.numel()} (the group size times the output's)"
            )

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            if self._arena is not None:
                self._next_tag()
                self._arena.reduce_scatter_tensor(output, input, op, timeout=self._left(deadline))
                return [output]
            flat = input.reshape(-1).clone()
            blocks = list(torch.split(flat, output.numel())) if output.numel() else [flat[:0]] * self._size
            self._reduce_scatter_blocks(output, blocks, op, deadline)
            return [output]

        rec = self._fr
        entry = rec.collective("reduce_scatter_tensor", (input.shape,), input.dtype, (output.shape,), output.dtype) if rec is not None else None
        return self._submit("reduce_scatter_tensor", opts, run, entry)

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        opts = opts or AllToAllOptions()
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise CollectiveArgumentError(
                f"all_to_all: needs {self._size} input and output tensors, got "
                f"{len(input_tensors)} and {len(output_tensors)}"
            )
        _check_own_part(output_tensors, input_tensors, self._rank, "all_to_all")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            self._exchange(output_tensors, input_tensors, deadline, "all_to_all")
            return output_tensors

        rec = self._fr
        entry = None
        if rec is not None and input_tensors:
            entry = rec.collective("all_to_all", _shapes(input_tensors), input_tensors[0].dtype, _shapes(output_tensors))
        return self._submit("all_to_all", opts, run, entry)

    def _exchange(self, outs: list[torch.Tensor], ins: list[torch.Tensor], deadline: float, what: str) -> None:
        # (a peer's part may land before this rank has sent the one it lands on, over the
        # connections and, where the splits differ, in the arena: only this rank's own part
        # may be its output part, the in-place call then copying the others)
        ins = _apart(ins, outs, {(self._rank, self._rank)})
        tag = self._next_tag()
        if self._arena is not None:
            self._arena.all_to_all(outs, ins, timeout=self._left(deadline), op=what)
            return
        meta = self._fingerprint(what, ins[0].dtype if ins else None)
        flats = [_Flat(t) for t in outs]
        handles = []
        for r in range(self._size):
            if r != self._rank:
                handles.append(self._ep.post_recv(r, tag, bytes_view(flats[r].flat), meta, what))
        srcs = [t.contiguous() for t in ins]
        flats[self._rank].flat.copy_(srcs[self._rank].reshape(-1))
        for k in range(1, self._size):
            r = (self._rank + k) % self._size
            self._ep.send(r, tag, [bytes_view(srcs[r])], meta, deadline, what)
        for h in handles:
            self._ep.wait(h, deadline, what)
        for f in flats:
            f.commit()

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        opts = opts or AllToAllOptions()
        n = self._size
        if not input.is_contiguous():  # (gloo's check, and its type and words: on the input alone)
            raise ValueError("Tensors must be contiguous")

        def splits(t: torch.Tensor, sizes: list[int], what: str) -> list[torch.Tensor]:
            # (torch's own all_to_all_single and its functional collectives call the backend
            # directly: gloo's type for these, RuntimeError, which CollectiveArgumentError is)
            return list(torch.split(t, check_split_sizes(t, sizes, n, "all_to_all_single", what)))

        outs = splits(output, output_split_sizes, "output")
        ins = splits(input, input_split_sizes, "input")
        _check_own_part(outs, ins, self._rank, "all_to_all_single")

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            self._exchange(outs, ins, deadline, "all_to_all_single")
            return [output]

        rec = self._fr
        entry = rec.collective("all_to_all_single", (input.shape,), input.dtype, (output.shape,), output.dtype) if rec is not None else None
        return self._submit("all_to_all_single", opts, run, entry)

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        opts = opts or BarrierOptions()

        def run() -> list[torch.Tensor]:
            deadline = self._deadline(opts)
            tag = self._next_tag()
            if self._arena is not None:
                self._arena.barrier(timeout=self._left(deadline))
            elif self._size > 1:
                sched = S.dissemination_barrier(self._rank, self._size)
                self._run(sched, [], tag, self._fingerprint("barrier"), "barrier", deadline)
            return []

        rec = self._fr
        entry = rec.collective("barrier", (), None) if rec is not None else None
        return self._submit("barrier", opts, run, entry)

    # -- point to point ------------------------------------------------------------------------
    def _p2p_tag(self, tag: int) -> int:
        if not 0 <= tag < _COLL_TAG:
            raise CollectiveArgumentError(f"tag must be a non-negative integer below 2**62, got {tag}")  # (gloo: a RuntimeError)
        return tag

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        self._check_peer(dst, "send", "dst")
        t = tensors[0].contiguous()
        deadline = time.monotonic() + self._timeout
        rec = self._fr
        entry = rec.p2p("send", t.shape, t.dtype, self._rank, dst) if rec is not None else None
        try:
            self._ep.send(dst, self._p2p_tag(tag), [bytes_view(t)], b"", deadline, f"send to rank {dst}")
        except BaseException as exc:
            if entry is not None:
                Recorder.failed(entry, exc)
            raise
        if entry is not None:
            entry[DONE] = _time_ns()
        return Work.completed([tensors[0]], op="send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        self._check_peer(src, "recv", "src")
        return self._post_recv(tensors[0], src, tag, f"recv from rank {src}")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        return self._post_recv(tensors[0], -1, tag, "recv from any rank")

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a Python object as one message: pickle protocol 5, its tensors and arrays out
        of band (scatter-gather, no copy of their payload)."""
        self._check_peer(dst, "send_object_list", "dst")
        deadline = time.monotonic() + self._timeout
        self._ep.send(dst, self._p2p_tag(tag), dumps(obj), b"", deadline, f"send_object_list to rank {dst}")

    def recv_object(self, src: int, tag: int = 0) -> tuple[Any, int]:
        """Receive an object sent by ``send_object`` from ``src`` (-1: any rank); returns it
        and the sender's rank. Its tensors share the received buffer."""
        if src >= 0:
            self._check_peer(src, "recv_object_list", "src")
        what = "recv_object_list from " + (f"rank {src}" if src >= 0 else "any rank")
        handle = self._ep.post_recv(src, self._p2p_tag(tag), None, None, what)
        self._ep.wait(handle, time.monotonic() + self._timeout, what)
        assert handle.data is not None
        data = handle.data if not isinstance(handle.data, bytes) else bytearray(handle.data)
        return loads(data), handle.source

    def _post_recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> Work:
        flat = _Flat(tensor)
        rec = self._fr
        entry = rec.p2p("recv", tensor.shape, tensor.dtype, src, self._rank) if rec is not None else None
        # (a shorter message fills the tensor's start, as gloo's receive does)
        handle = self._ep.post_recv(src, self._p2p_tag(tag), bytes_view(flat.flat), None, what, at_most=True)
        return _RecvWork(self, handle, flat, what, time.monotonic() + self._timeout, entry)

    # -- lifetime ------------------------------------------------------------------------------
    def _check_rank(self, r: int, what: str, name: str) -> None:
        """A root (a rank of the group).

        Raises:
            CollectiveArgumentError: out of range.
        """
        if not 0 <= r < self._size:
            raise CollectiveArgumentError(f"{what}: {name} rank {r} is out of range for a group of {self._size}")

    def _check_peer(self, r: int, what: str, name: str) -> None:
        """A peer of a point-to-point call: a rank of the group other than this one.

        Raises:
            CollectiveArgumentError: out of range, or this rank (no connection to itself, as
                gloo, whose error is a ``RuntimeError``).
        """
        self._check_rank(r, what, name)
        if r == self._rank:
            raise CollectiveArgumentError(
                f"{what}: {name} rank {r} is this rank; the {self.name()} backend has no connection "
                "to itself (send and receive between two ranks)"
            )

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._responder is not None:
            self._responder.stop()
        if self._fr is not None:
            unwatch(self._fr)
        with self._cv:
            self._cv.notify_all()
        if self._arena is not None:
            self._arena.close()
        self._ep.close()
        pending = list(self._queue)
        for work, _, _ in pending:
            work._fail(DistBackendError(f"rank {self._rank}: the process group was destroyed"))
        # (torch's store: ``TorchStore.release``; torch may shut a group down through its
        # backend, not only through the group that ``_torch_pg`` releases its adapters in)
        release = getattr(self._store, "release", None)
        if release is not None:
            release()

    def abort(self) -> None:
        self._ep.abort("abort() called")
        self.shutdown()


def _create(
    store: Any, rank: int, size: int, timeout: timedelta, name: str = "", gone: Callable[[int], str | None] | None = None
) -> Backend:
    return ProcessGroupTCP(store, rank, size, timeout, name=name, gone=gone)


# (``_lifecycle`` gives it ``gone``: a sub-group's member that its world group knows gone)
_create.takes_gone = True  # type: ignore[attr-defined]


register_backend_creator("tcp", _create)
register_backend_creator("gloo", _create)
