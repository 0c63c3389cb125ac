"""The flight recorder: each process group's ring of its last operations, dumped in the format
of torch's own flight recorder so that torch's analyzer (``torchfrtrace``) reads tdist's dumps.

Theory of operation. Every backend instance (one per process group and rank; tdist's API and
torch's ``"tdist"`` groups share it) owns a ``Recorder``: a preallocated ring of ``capacity``
slots. An operation takes one slot when it is issued: a small list holding its point-to-point
sequence number, its name, the shapes (``torch.Size`` objects, kept as they are) and dtypes of
its inputs and outputs, and the wall-clock time; the backend writes the start and completion
into the same list as they happen. Nothing is formatted, copied or locked on that path: the ring
never holds a tensor, only its shape, and turning shapes into lists, dtypes into torch's names
and times into states waits for a reader. The cost is about 0.6 microseconds per operation (see
``benchmarks/bench_flight_recorder.py``), which is why an entry is a plain list built in one go,
a single tensor's shape is kept without a tuple around it, an operation that runs as it is
issued shares its creation time as its start, what can be worked out later is (the collective
sequence number is the entry's index in the group less the point-to-point operations before
it; the record id, torch's count across the process's groups, is given at a dump by creation
time), and an operation that completes where it was issued is only marked done (``UNTIMED``):
its completion is "discovered" when the group's next operation is issued (torch's
``time_discovered_completed_ns`` is a discovery time too), and readers (``entries``) fill the
time in. With ``TDIST_FR_TIMED=1`` (``tdist run --metrics-port`` sets it for its workers, whose
latency histograms need it) such an operation is stamped with its true completion time instead,
one clock read more. The Python stack of each call is recorded only with ``TDIST_FR_STACK=1``.

Short entries. The tcp backend's all_reduce of one tensor, the op a training loop issues most,
takes a short entry: a tuple (``SHORT`` slots), which costs a third of the list's time to make
and to free when its slot is reused (2.5-3.0% against 3.6-4.6% of a 4-byte all_reduce). A
tuple cannot be written into, so the state of a short entry is worked out by readers instead:
such an operation runs in the thread that issued it, under its group's lock, the group's
operations one at a time; it is running while it is the group's newest entry and the lock is
held (``busy``), completed otherwise (its time discovered as above). Readers (``entries``,
``live``, ``normalized``) hand out the full form (``full``); a backend that must write into a
short entry (it queued the operation, or the operation failed) puts the full form in its slot
first (``widen``).

States are torch's: ``scheduled`` (issued, queued behind earlier work), ``started`` (running, or
a receive posted), ``completed``. An operation that failed stays ``started`` and keeps the
error's text.

Dumps (``dump_dict``, ``write_dump``) follow torch's format, version ``"2.10"``: a pickled dict
with ``version``, ``pg_config`` (group name -> name, description, global ranks),
``pg_status`` (per group: last enqueued, started and completed collective) and ``entries``
sorted by ``record_id``, one file per rank named ``<prefix><global rank>``. Operation names are
gloo's (``"gloo:all_reduce"``, ``"gloo:send 0->1"``): the analyzer knows a closed list of
backends, and tdist's tcp backend stands in for gloo. Dumps are written on a collective's
timeout or a lost peer (by every rank of the group, see ``_desync``), on ``SIGUSR1`` (a handler
is installed only where the program has none), and on demand (``tdist.flight_recorder``).

Thread-safety: a recorder is written by the threads that issue and run its group's operations
(as the group's operations are issued in one order, so are its entries); readers (dumps, the
diagnosis) copy the ring first and tolerate a slot written under them. No lock is taken on any
path, so a dump may run in a signal handler.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "FR_VERSION",
    "UNTIMED",
    "Recorder",
    "add_dump_section",
    "brief",
    "buffer_size",
    "current_op",
    "dump_dict",
    "dump_on_failure",
    "dump_prefix",
    "full",
    "install_signal_handler",
    "make_recorder",
    "normalized",
    "recorders",
    "shapes_of",
    "write_dump",
    "write_dumps",
]

log = logging.getLogger(__name__)

FR_VERSION = "2.10"  # (what torch 2.13's own recorder writes; the analyzer checks it)
_DEFAULT_SIZE = 2000
_DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"
_MAX_FRAMES = 32

# an entry is a list; these are its slots. As the hot path writes it (a "live" entry), ID and
# CSEQ are not filled in (the record id, one count across the process's groups as torch's, is
# given at a dump, ``_numbered``; the slot in the ring tells the operation's index in the group), INS holds one
# torch.Size or a tuple of them, DONE a time or UNTIMED; ``entries`` (and ``normalized``) set CSEQ
# to the collective sequence number (index + 1 - PSEQ: the collectives among the group's
# operations so far) and INS to a tuple. torch's op_id, the group's count of operations, is
# CSEQ + PSEQ.
ID, CSEQ, PSEQ, OP, INS, INDT, OUTS, OUTDT, PEER, CREATED, STARTED, DONE, FRAMES, ERROR, THREAD, DETAIL = range(16)
# DETAIL: what else the ranks must agree on, where a backend says (``"root=0"``,
# ``"op=SUM root=1"``; None: nothing), which the desync check compares with theirs
UNTIMED = 1  # DONE: completed, the time to be discovered (see the module docstring)
# THREAD is the ident (``threading.get_ident()``) of the thread that issued the operation, its
# name looked up at a dump. A short entry (the hot path's: see the module docstring) is the tuple
# (CREATED, THREAD, PSEQ, OP, INS, INDT): PSEQ, OP, INS and INDT in their slots of a full entry.
SHORT = 6

_pg_ids = itertools.count()
_time_ns = time.time_ns
_get_ident = threading.get_ident
_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
_sections: dict[str, Callable[[], Any]] = {}

# tdist's collective names -> the analyzer's (``flight_recorder.components.types.COLLECTIVES``)
_FR_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
# torch's ScalarType names, as its recorder writes dtypes
_SCALAR_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
    torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tdist package
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
TORCH_DIR = _TORCH + os.sep  # (torch's package: frames there are not the program's)


# torch's older names of its flight-recorder variables, which torch still reads (saying they are
# deprecated) where the new name is not set
_OLD_NAMES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}
_warned_old: set[str] = set()


def _env(names: Sequence[str]) -> tuple[str, str] | None:
    """The first of ``names`` (or of torch's older names of them) that is set and not empty,
    with its value."""
    for name in names:
        old = _OLD_NAMES.get(name)
        for var in (name,) if old is None else (name, old):
            value = os.environ.get(var)
            if value is not None and value.strip():
                if var != name and var not in _warned_old:
                    _warned_old.add(var)
                    log.warning("Environment variable %s is deprecated; use %s instead", var, name)
                return var, value
    return None


def _env_int(names: Sequence[str], default: int) -> int:
    found = _env(names)
    if found is None:
        return default
    name, value = found
    try:
        return int(value)
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, value, default)
        return default


def buffer_size() -> int:
    """Slots per group: ``TDIST_FR_BUFFER_SIZE``, else ``TORCH_FR_BUFFER_SIZE`` (or its older
    name ``TORCH_NCCL_TRACE_BUFFER_SIZE``) (2000; 0: off)."""
    return max(0, _env_int(("TDIST_FR_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), _DEFAULT_SIZE))


def dump_prefix() -> str:
    """Where dumps go: ``<prefix><global rank>``, the prefix from ``TDIST_FR_DUMP_TEMP_FILE``,
    else ``TORCH_FR_DUMP_TEMP_FILE`` (or its older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``),
    else ``/tmp/nccl_trace_rank_``."""
    found = _env(("TDIST_FR_DUMP_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"))
    return _DEFAULT_PREFIX if found is None else found[1]


def dump_on_failure() -> bool:
    """Whether a timeout or a lost peer writes every rank's dump (``TDIST_FR_DUMP_ON_FAILURE``,
    else torch's ``TORCH_NCCL_DUMP_ON_TIMEOUT``, as its NCCL backend reads it; default 1)."""
    value = os.environ.get("TDIST_FR_DUMP_ON_FAILURE") or os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") or "1"
    return value.strip().lower() not in ("0", "false", "no", "off")


def _stack_on() -> bool:
    return os.environ.get("TDIST_FR_STACK", "0").strip().lower() in ("1", "true", "yes", "on")


def _timed_on() -> bool:
    return os.environ.get("TDIST_FR_TIMED", "0").strip().lower() in ("1", "true", "yes", "on")


def capture() -> tuple[tuple[str, int, str], ...]:
    """The caller's Python stack, innermost first, from the first frame outside tdist."""
    f: Any = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
    out: list[tuple[str, int, str]] = []
    while f is not None and len(out) < _MAX_FRAMES:
        code = f.f_code
        out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    return tuple(out)


class Recorder:
    """One group's ring of operations (see the module docstring).

    Args:
        rank: this rank in the group.
        size: the group's size.
        capacity: slots in the ring (positive).
        timeout_s: the group's timeout, for the dump's ``timeout_ms``.
    """

    __slots__ = (
        "__weakref__", "_ranks", "busy", "cap", "desc", "failure_dumps", "n", "name", "p2p_seq", "pg_id",
        "pid", "rank", "ranks_fn", "ring", "short", "size", "stack", "timed", "timeout_ms",
    )

    def __init__(self, rank: int, size: int, capacity: int, timeout_s: float = 1800.0) -> None:
        # (ring, n, cap: the slots, the count of entries ever made, the slot count; public for
        # the tcp backend's all_reduce, which makes its entry inline, as ``one`` does)
        self.cap = capacity
        self.ring: list[list[Any] | tuple[Any, ...] | None] = [None] * capacity
        self.n = 0
        # (whether the group runs an operation now, where its backend makes short entries)
        self.busy: Callable[[], bool] | None = None
        self.p2p_seq = 0
        self.pg_id = next(_pg_ids)
        self.rank = rank
        self.size = size
        self.name = ""
        self.desc = "undefined"
        self._ranks: list[int] | None = None
        self.ranks_fn: Callable[[], Sequence[int]] | None = None
        self.timeout_ms = int(timeout_s * 1000)
        self.stack = _stack_on()
        # (whether the backend stamps an operation that completes where it was issued, rather
        # than leaving its time to be discovered: TDIST_FR_TIMED)
        self.timed = _timed_on()
        # (whether a backend may make short entries: neither stacks nor true completion times)
        self.short = not (self.stack or self.timed)
        self.pid = os.getpid()
        # (the dumps a failure of this group had this process write: ``write_dump``)
        self.failure_dumps: set[str] = set()
        _recorders.add(self)

    # -- identity ------------------------------------------------------------------------------
    def identify(self, name: str | None = None, desc: str | None = None, ranks: Sequence[int] | None = None) -> None:
        """Name the group as its process group does (name, description, global ranks)."""
        if name is not None:
            self.name = name
        if desc is not None:
            self.desc = desc
        if ranks is not None:
            self._ranks = list(ranks)

    @property
    def ranks(self) -> list[int]:
        """The members' global ranks (group rank order)."""
        if self._ranks is None and self.ranks_fn is not None:
            try:
                self._ranks = [int(r) for r in self.ranks_fn()]
            except Exception:  # (torch no longer knows the group)
                pass
        return self._ranks if self._ranks is not None else list(range(self.size))

    @property
    def global_rank(self) -> int:
        ranks = self.ranks
        return ranks[self.rank] if self.rank < len(ranks) else self.rank

    @property
    def coll_seq(self) -> int:
        """Collectives issued so far in the group."""
        return self.n - self.p2p_seq

    @property
    def label(self) -> str:
        return self.name or f"pg{self.pg_id}"

    # -- the hot path --------------------------------------------------------------------------
    def one(
        self, op: str, t: torch.Tensor, _now: Callable[[], int] = _time_ns, _ident: Callable[[], int] = _get_ident
    ) -> list[Any]:
        """``collective(op, (t.shape,), t.dtype)``, the common case, at the least cost. Entries
        start as running (their start is their creation): a backend that queues one sets
        ``STARTED`` to 0 until it runs."""
        n = self.n
        self.n = n + 1
        now = _now()
        e = [0, 0, self.p2p_seq, op, t.shape, t.dtype, None, None, None, now, now, 0,
             capture() if self.stack else None, None, _ident(), None]
        self.ring[n % self.cap] = e
        return e

    def quick(self, op: str, t: torch.Tensor) -> tuple[Any, ...]:
        """A short entry (see the module docstring) for ``op`` on ``t``, running where it
        was issued, under the group's lock (``busy``); only where ``short``. The tcp backend's
        all_reduce makes the same entry inline."""
        n = self.n
        self.n = n + 1
        self.ring[n % self.cap] = e = (_time_ns(), _get_ident(), self.p2p_seq, op, t.shape, t.dtype)
        return e

    def collective(
        self,
        op: str,
        ins: tuple[Any, ...],
        in_dtype: torch.dtype | None,
        outs: tuple[Any, ...] | None = None,
        out_dtype: torch.dtype | None = None,
        detail: str | None = None,
    ) -> list[Any]:
        """Record a collective as issued (and running, as ``one``); returns its entry (the
        backend writes ``STARTED`` and ``DONE`` into it). ``outs``/``out_dtype`` ``None``: as
        the inputs; ``detail``: see ``DETAIL``."""
        n = self.n
        self.n = n + 1
        now = _time_ns()
        e = [0, 0, self.p2p_seq, op, ins, in_dtype, outs, out_dtype, None, now, now, 0,
             capture() if self.stack else None, None, _get_ident(), detail]
        self.ring[n % self.cap] = e
        return e

    def p2p(self, op: str, shape: Any, dtype: torch.dtype, src: int, dst: int) -> list[Any]:
        """Record a send or a receive, as started (``op``: ``"send"``/``"recv"``; group
        ranks)."""
        self.p2p_seq = seq = self.p2p_seq + 1
        n = self.n
        self.n = n + 1
        now = _time_ns()
        e = [0, 0, seq, op, shape, dtype, None, None, (src, dst), now, now, 0,
             capture() if self.stack else None, None, _get_ident(), None]
        self.ring[n % self.cap] = e
        return e

    def widen(self, e: tuple[Any, ...]) -> list[Any]:
        """Replace the short entry ``e`` with its full form, as running (a backend that must
        write into it: it queued the operation, or the operation failed); returns the full
        entry, which takes ``e``'s slot if it still has it."""
        wide = full(e, 0)
        n, cap, ring = self.n, self.cap, self.ring
        for i in range(n - 1, max(0, n - cap) - 1, -1):
            if ring[i % cap] is e:
                ring[i % cap] = wide
                break
        return wide

    @staticmethod
    def failed(e: list[Any], exc: BaseException) -> None:
        """Note why ``e`` failed (it stays ``started``)."""
        if not e[STARTED]:
            e[STARTED] = _time_ns()
        e[DONE] = 0
        e[ERROR] = f"{type(exc).__name__}: {exc}"[:2000]

    # -- reading -------------------------------------------------------------------------------
    def latest(self, k: int) -> list[list[Any]]:
        """The last ``k`` entries, oldest first (copies, as ``entries``)."""
        return self._read(k)

    def live(self, k: int) -> list[list[Any]]:
        """The last ``k`` entries themselves, oldest first (not copies: what their backend
        writes shows; ``INS`` and ``DONE`` as the hot path left them), short ones in their full
        form (copies, which ``index_of`` still finds)."""
        n, cap, ring = self.n, self.cap, self.ring
        out = [ring[i % cap] for i in range(max(0, n - min(k, cap)), n)]
        return self._full([e for e in out if e is not None])

    def _full(self, out: list[Any], newest: bool = True) -> list[list[Any]]:
        """``out`` (the ring's last entries, in its order) with its short entries in full form:
        completed, but for the newest entry of the group while its backend runs an operation
        (``busy``; ``newest``: whether ``out`` ends with the group's newest entry). A short
        entry runs where it was issued, the group's operations one at a time: the next
        operation is issued after it ended, in a program that issues the group's operations in
        one order on every rank."""
        last = len(out) - 1 if newest else -1
        for j, e in enumerate(out):
            if type(e) is tuple:
                running = j == last and (self.busy is None or self.busy())
                out[j] = full(e, 0 if running else UNTIMED)
        return out

    def entries(self) -> list[list[Any]]:
        """The recorded entries, oldest first: copies of the ring's lists, with ``INS`` always
        a tuple of shapes and the discovered completion times filled in (``UNTIMED`` stays
        only on the last entry completed without a time)."""
        return self._read(self.cap)

    def _read(self, k: int) -> list[list[Any]]:
        n, cap = self.n, self.cap
        ring = list(self.ring)
        picked = [(i, ring[i % cap]) for i in range(max(0, n - min(k, cap)), n)]
        picked = [(i, e) for i, e in picked if e is not None]
        out = self._full([e for _, e in picked])
        for j, (i, e) in enumerate(picked):
            if out[j] is e:
                out[j] = list(e)
            _normalize(out[j], i)
        for i in range(len(out) - 1):
            if out[i][DONE] == UNTIMED:
                out[i][DONE] = out[i + 1][CREATED]
        return out

    def index_of(self, e: Sequence[Any]) -> int:
        """A live entry's index in the group (``-1``: no longer in the ring); a short entry's
        full form (``live``) is found by its creation time."""
        n, cap, ring = self.n, self.cap, self.ring
        for i in range(n - 1, max(0, n - cap) - 1, -1):
            x = ring[i % cap]
            if x is e or (type(x) is tuple and len(e) > SHORT and x[0] == e[CREATED] and x[OP] == e[OP]):
                return i
        return -1


def full(e: Sequence[Any], done: int) -> list[Any]:
    """A short entry's full form (``done``: its ``DONE``); a full entry as a new list."""
    if len(e) != SHORT:
        return list(e)
    created, thread, pseq, op, ins, dtype = e
    return [0, 0, pseq, op, ins, dtype, None, None, None, created, created, done, None, None, thread, None]


def _normalize(e: list[Any], index: int) -> None:
    e[CSEQ] = index + 1 - e[PSEQ]
    if isinstance(e[INS], torch.Size):
        e[INS] = (e[INS],)


def normalized(rec: Recorder, e: Sequence[Any]) -> list[Any]:
    """A live entry of ``rec`` (as a backend holds it) in the readers' form (see the slots)."""
    index = rec.index_of(e)
    out = rec._full([e], index == rec.n - 1)[0] if type(e) is tuple else list(e)
    _normalize(out, index)
    return out


def make_recorder(rank: int, size: int, timeout_s: float = 1800.0) -> Recorder | None:
    """A recorder for a new group, or ``None`` when ``TDIST_FR_BUFFER_SIZE=0``. Installs the
    ``SIGUSR1`` handler on the first call (``install_signal_handler``)."""
    cap = buffer_size()
    if cap <= 0:
        return None
    install_signal_handler()
    return Recorder(rank, size, cap, timeout_s)


def recorders() -> list[Recorder]:
    """Every live recorder of this process (not a forked parent's), oldest group first."""
    pid = os.getpid()
    return sorted((r for r in list(_recorders) if r.pid == pid), key=lambda r: r.pg_id)


def add_dump_section(name: str, fn: Callable[[], Any]) -> None:
    """Add ``name: fn()`` to every dump (RPC adds its calls in flight); ``fn`` must not block."""
    _sections[name] = fn


def current_op(recs: Sequence[Recorder] | None = None) -> dict[str, Any] | None:
    """The operation this process's groups (or ``recs``) have been in longest, for ``tdist
    status``: ``{"name": "all_reduce", "group": label, "since": wall-clock seconds}`` (issued,
    neither completed nor failed), or ``None`` when none is in flight."""
    oldest: tuple[Recorder, list[Any]] | None = None
    for rec in recorders() if recs is None else recs:
        for e in rec.live(8):  # (what is in flight is among a group's last operations)
            if not e[DONE] and e[ERROR] is None:
                if oldest is None or e[CREATED] < oldest[1][CREATED]:
                    oldest = (rec, e)
                break
    if oldest is None:
        return None
    rec, e = oldest
    return {"name": e[OP], "group": rec.label, "since": e[CREATED] / 1e9}


# -- describing entries --------------------------------------------------------------------------
def state_of(e: Sequence[Any]) -> str:
    return "completed" if e[DONE] else "started" if e[STARTED] else "scheduled"


def _dtype_short(dt: torch.dtype | None) -> str:
    return str(dt).removeprefix("torch.") if dt is not None else ""


def shapes_of(ins: Any) -> tuple[Any, ...]:
    """An entry's ``INS`` (or ``OUTS``) as a tuple of shapes (a lone ``torch.Size`` is one)."""
    if ins is None:
        return ()
    return (ins,) if isinstance(ins, torch.Size) else tuple(ins)


def signature(e: Sequence[Any]) -> str:
    """``float32[1024]``: the dtype and input shapes of an entry (``""`` for a barrier)."""
    ins = shapes_of(e[INS])
    if not ins:
        return ""
    shapes = ", ".join(str(list(s)) for s in ins[:4]) + (", ..." if len(ins) > 4 else "")
    return f"{_dtype_short(e[INDT])}{shapes}"


def where(e: Sequence[Any]) -> str | None:
    """``train.py:88``: the first recorded frame outside tdist and torch, if stacks are on."""
    frames = e[FRAMES]
    if not frames:
        return None
    for filename, line, _name in frames:
        if not filename.startswith(_TORCH):
            return f"{os.path.basename(filename)}:{line}"
    filename, line, _name = frames[0]
    return f"{os.path.basename(filename)}:{line}"


def brief(e: Sequence[Any], now_ns: int) -> dict[str, Any]:
    """An entry as the diagnosis sends it (JSON-able)."""
    since = e[DONE] if e[DONE] != UNTIMED else 0
    since = since or e[STARTED] or e[CREATED]
    peer = e[PEER]
    return {
        "seq": e[CSEQ] if peer is None else e[PSEQ],
        "op": e[OP],
        "p2p": None if peer is None else list(peer),
        "sig": signature(e),
        "detail": e[DETAIL] if len(e) > DETAIL else None,
        "dtype": _dtype_short(e[INDT] if e[INDT] is not None else e[OUTDT]),
        "state": state_of(e),
        "since_s": round(max(0, now_ns - since) / 1e9, 3),
        "where": where(e),
        "error": e[ERROR],
    }


# -- dumps ---------------------------------------------------------------------------------------
def _sizes(shapes: Any) -> list[list[int]]:
    return [[int(x) for x in s] for s in shapes_of(shapes)]


def _profiling_name(e: Sequence[Any]) -> str:
    peer = e[PEER]
    if peer is None:
        op = e[OP]
        return f"gloo:{_FR_NAMES.get(op, op)}"
    src, dst = peer
    return f"gloo:send {src}->{dst}" if e[OP] == "send" else f"gloo:recv {dst}<-{src}"


def _thread_names() -> dict[int, str]:
    """The names of this process's live Python threads by ident, read without a lock (a dump
    may run in a signal handler; ``threading.enumerate`` takes one)."""
    active: dict[int, threading.Thread] = getattr(threading, "_active", {})
    try:
        return {ident: t.name for ident, t in list(active.items())}
    except Exception:  # (changed under us, or another threading)
        return {}


def entry_dict(rec: Recorder, e: Sequence[Any], names: dict[int, str] | None = None) -> dict[str, Any]:
    """One entry in torch's dump format (``names``: thread names by ident, ``_thread_names()``:
    a thread that has ended has the name ``""``)."""
    ins = _sizes(e[INS])
    outs = ins if e[OUTS] is None else _sizes(e[OUTS])
    in_dt = _SCALAR_NAMES.get(e[INDT], _dtype_short(e[INDT])) if e[INDT] is not None else None
    out_dt_raw = e[OUTDT] if e[OUTDT] is not None else e[INDT]
    out_dt = _SCALAR_NAMES.get(out_dt_raw, _dtype_short(out_dt_raw)) if out_dt_raw is not None else None
    frames = [{"name": n, "filename": f, "line": ln} for f, ln, n in (e[FRAMES] or ())]
    thread = e[THREAD]
    d: dict[str, Any] = {
        "record_id": e[ID],
        "pg_id": rec.pg_id,
        "process_group": (rec.label, rec.desc),
        "collective_seq_id": e[CSEQ],
        "p2p_seq_id": e[PSEQ],
        "op_id": e[CSEQ] + e[PSEQ],
        "profiling_name": _profiling_name(e),
        "time_created_ns": e[CREATED],
        "input_sizes": ins,
        "input_dtypes": [in_dt] * len(ins) if in_dt else [],
        "output_sizes": outs,
        "output_dtypes": [out_dt] * len(outs) if out_dt else [],
        "state": state_of(e),
        "time_discovered_started_ns": e[STARTED] or None,
        "time_discovered_completed_ns": e[DONE] if e[DONE] != UNTIMED else None,
        "retired": bool(e[DONE]),
        "timeout_ms": rec.timeout_ms,
        "is_p2p": e[PEER] is not None,
        "frames": frames,
        "thread_id": str(thread) if thread else "",
        "thread_name": (names if names is not None else _thread_names()).get(thread, "") if thread else "",
    }
    if e[ERROR]:
        d["tdist_error"] = e[ERROR]
    return d


def _numbered(groups: Sequence[tuple[Recorder, list[list[Any]]]]) -> list[tuple[Recorder, list[Any]]]:
    """The groups' entries in the order they were made, with their record ids (``ID``): the
    count of operations the process made before each, in all these groups (torch numbers the
    entries of its one ring so). An entry older than the oldest one another group still holds,
    where that group has dropped some, cannot be numbered for sure, and is left out."""
    items = []
    for g, (_, es) in enumerate(groups):
        for e in es:
            items.append((e[CREATED], g, e[CSEQ] + e[PSEQ], e))
    items.sort(key=lambda x: (x[0], x[1], x[2]))
    dropped = [rec.n - len(es) for rec, es in groups]  # (the oldest entries, gone from the ring)
    oldest = [es[0][CREATED] if es else None for _, es in groups]
    seen = [0] * len(groups)
    out = []
    for created, g, _, e in items:
        seen[g] += 1
        if any(dropped[h] and h != g and (oldest[h] is None or created < oldest[h]) for h in range(len(groups))):
            continue
        e[ID] = sum(dropped) + sum(seen) - 1
        out.append((groups[g][0], e))
    return out


def dump_dict(global_rank: int | None = None) -> dict[str, Any]:
    """This process's flight record (the groups of ``global_rank``; ``None``: every group) in
    torch's format."""
    recs = [r for r in recorders() if global_rank is None or r.global_rank == global_rank]
    pg_config: dict[str, dict[str, str]] = {}
    pg_status: dict[str, dict[str, int]] = {}
    groups = []
    for rec in recs:
        es = rec.entries()
        groups.append((rec, es))
        pg_config[rec.label] = {"name": rec.label, "desc": rec.desc, "ranks": str(rec.ranks)}
        colls = [e for e in es if e[PEER] is None]
        pg_status[str(rec.pg_id)] = {
            "last_enqueued_collective": rec.coll_seq or -1,
            "last_started_collective": max((e[CSEQ] for e in colls if e[STARTED]), default=-1),
            "last_completed_collective": max((e[CSEQ] for e in colls if e[DONE]), default=-1),
        }
    names = _thread_names()
    entries = [entry_dict(rec, e, names) for rec, e in _numbered(groups)]
    out: dict[str, Any] = {
        "version": FR_VERSION,
        "comm_lib_version": "tdist",
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": entries,
    }
    for name, fn in list(_sections.items()):
        try:
            out[name] = fn()
        except Exception as exc:  # (a section must never spoil the dump)
            out[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def write_dump(path: str, global_rank: int | None = None, failed: Recorder | None = None) -> str:
    """Write ``dump_dict(global_rank)`` to ``path`` (pickled, as torch's; atomically); returns
    ``path``. ``failed``: the group whose failure has it written, once per path: what the ranks
    did when the group first failed, which a later failure of the group (a rank that carried
    on, and failed at its next call) must not replace with what it did since (the collective it
    never reached, recorded after all, hid the hang from torch's analyzer). A new group's
    failure writes it again."""
    if failed is not None and path in failed.failure_dumps:
        return path
    data = pickle.dumps(dump_dict(global_rank))
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    # (a name without the dump's: torch's analyzer, reading the folder meanwhile, takes every
    # file whose name contains the prefix anywhere for a rank's dump)
    tmp = os.path.join(directory, f".tdist-fr-partial.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    if failed is not None:
        failed.failure_dumps.add(path)
    return path


def write_dumps(prefix: str | None = None) -> list[str]:
    """One dump per global rank this process holds groups of, to ``<prefix><rank>`` (default
    prefix: ``dump_prefix()``); returns the paths."""
    prefix = dump_prefix() if prefix is None else prefix
    ranks = sorted({r.global_rank for r in recorders()})
    return [write_dump(f"{prefix}{g}", g) for g in ranks]


# -- SIGUSR1 -------------------------------------------------------------------------------------
_signal_done = False


def _on_signal(signum: int, frame: Any) -> None:
    try:
        paths = write_dumps()
        log.warning("flight recorder: dumped to %s on signal %d", ", ".join(paths), signum)
    except Exception as exc:
        log.warning("flight recorder: dump on signal %d failed: %s", signum, exc)


def install_signal_handler() -> bool:
    """Dump on ``SIGUSR1`` (``kill -USR1 <pid>``): installed once, from the main thread, only
    where the program has no handler of its own and ``TDIST_FR_SIGNAL`` is not 0. Returns
    whether tdist's handler is the one installed."""
    global _signal_done
    if _signal_done:
        return signal.getsignal(signal.SIGUSR1) is _on_signal
    if threading.current_thread() is not threading.main_thread():
        return False
    _signal_done = True
    if os.environ.get("TDIST_FR_SIGNAL", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return False
    signal.signal(signal.SIGUSR1, _on_signal)
    return True


def _forget_after_fork() -> None:
    global _signal_done
    _signal_done = signal.getsignal(signal.SIGUSR1) is _on_signal


os.register_at_fork(after_in_child=_forget_after_fork)
