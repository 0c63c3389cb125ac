"""A job's metrics: what each worker of ``tdist run --metrics-port`` counts, how its counts reach
the launcher, and how the launcher adds them up (its endpoint: ``_metrics_server``).

Theory of operation. Metrics add nothing to an operation's path: a worker's collective and
point-to-point counts, bytes and latencies are read from its process groups' flight records
(``c10d._flight_recorder``), which hold every operation's name, shapes, dtype and times
already, and its RPC counts from ``rpc._calls.call_counts``. The one change on the path is
that the launcher sets ``TDIST_FR_TIMED=1`` for its workers, so that an operation that
completes where it was issued gets its true completion time (one clock read) rather than the
next operation's issue time.

The launcher gives each worker one end of a socket pair (its descriptor in
``TDIST_METRICS_FD``). A worker that imports tdist (``worker_side``) runs one daemon thread,
the ``Reporter``, which

- reads the new entries of every group's ring (``Tally.poll``): an operation's count and bytes
  (of its input tensors; a receive's: the tensor received into) when it is issued, its latency
  (issue to completion, queueing included) into a histogram when it completes, an error when
  it failed. It reads often enough that a ring never laps it: every second, or sooner when a
  group issues operations fast (a quarter of the ring between two reads, down to 10 ms); what
  a ring dropped before it was read is counted as missed;
- writes its totals, cumulative since the process started, as one JSON line: when the launcher
  asks (a scrape: the launcher writes the request's number, the answer names it), every second
  while they change, and once more at exit.

The launcher's ``Aggregate`` (pure, no I/O) keeps each worker's latest totals; when a worker is
gone its last totals join its rank's base, so that a rank's counters only grow across restarts.
Without ``--metrics-port`` a worker has no thread, no socket and no clock read more; with it, the
reporter's reading costs about a microsecond per operation, off the operation's path (but under
the GIL). With the recorder off (``TDIST_FR_BUFFER_SIZE=0``) collectives are not counted.

Wire format (worker -> launcher, one JSON object per line)::

    {"pid": 123, "reply": 7 | null, "step": 41 | null, "missed": 0,
     "ops": {"all_reduce": [count, bytes, errors, latency sum (s), [count per bucket, +Inf last]]},
     "rpc": {"call": [sent, failed]}}

Thread-safety: a ``Tally`` is used by one thread at a time (the reporter's lock); an
``Aggregate`` is guarded by its owner (the server's lock).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import json
import logging
import math
import os
import select
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._inspect import _steps

__all__ = [
    "LATENCY_BUCKETS",
    "METRICS_FD_ENV",
    "PORT_ENV",
    "Aggregate",
    "Reporter",
    "Tally",
    "merge_nodes",
    "worker_side",
]

log = logging.getLogger(__name__)

METRICS_FD_ENV = "TDIST_METRICS_FD"  # (set by the launcher: the worker's end of its socket pair)
PORT_ENV = "TDIST_METRICS_PORT"  # (the launcher's: --metrics-port when the flag is not given)
TIMED_ENV = "TDIST_FR_TIMED"

#: upper bounds (seconds) of the latency histograms' buckets; +Inf follows
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
_PUSH_EVERY = 1.0  # seconds between two unasked writes of a worker's changed totals
_POLL_MAX = 1.0  # seconds between two readings of the rings, at most
_POLL_MIN = 0.01  # ... at least
_SEND_TIMEOUT = 1.0  # seconds a write to the launcher may block (it reads all the time)
_FR_MODULE = "tdist.c10d._flight_recorder"
_RPC_MODULE = "tdist.rpc._calls"

# an operation's totals: [count, bytes, errors, latency sum, [count per bucket]]
COUNT, BYTES, ERRORS, LATENCY_SUM, BUCKETS = range(5)


def _new_op() -> list[Any]:
    return [0, 0, 0, 0.0, [0] * (len(LATENCY_BUCKETS) + 1)]


# -- the worker's side ---------------------------------------------------------------------------
class _Walk:
    """How far one group's ring has been read."""

    __slots__ = ("cap", "next", "pending", "rec", "ring", "seen", "since")

    def __init__(self, rec: Any, now: float) -> None:
        self.rec = weakref.ref(rec)
        self.ring: list[Any] = rec.ring  # (kept: entries written just before the group went are read)
        self.cap: int = rec.cap
        self.next = 0  # the index of the first entry not read yet
        self.seen: list[Any] = [None] * self.cap  # the entry last read from each slot
        self.pending: list[list[Any]] = []  # issued, not completed yet
        self.since = now  # when the ring was last read


class Tally:
    """A worker's totals, read from its groups' flight records (see the module docstring).

    Args:
        clock: the monotonic clock (for the pace of the readings).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.ops: dict[str, list[Any]] = {}
        self.missed = 0
        self._walks: dict[int, _Walk] = {}
        self._clock = clock
        self._sizes: dict[tuple[Any, Any], int] = {}  # (shapes, dtype) -> bytes: a loop repeats them

    def poll(self, recorders: Iterable[Any] | None = None) -> float:
        """Read what the rings gained since the last call (``recorders``: the live ones, default
        every recorder of this process). Returns the seconds until the next reading should
        be, so that no ring laps it."""
        fr = sys.modules.get(_FR_MODULE)
        if fr is None:  # (no process group was ever made here)
            return _POLL_MAX
        if recorders is None:
            try:
                recorders = fr.recorders()
            except RuntimeError:  # (a group made while the set was walked: next time)
                return _POLL_MIN
        now = self._clock()
        for rec in recorders:
            if rec.pg_id not in self._walks:
                self._walks[rec.pg_id] = _Walk(rec, now)
        wait = _POLL_MAX
        for pg_id, walk in list(self._walks.items()):
            got = self._read(fr, walk)
            if got:
                rate = got / max(now - walk.since, 1e-3)
                wait = min(wait, max(_POLL_MIN, walk.cap / 4 / rate))
            walk.since = now
            self._settle(fr, walk)
            if walk.rec() is None and not walk.pending:
                del self._walks[pg_id]
        return wait

    def _read(self, fr: Any, walk: _Walk) -> int:
        """Count the entries issued since the last reading; returns how many."""
        rec, ring, cap = walk.rec(), walk.ring, walk.cap
        i = walk.next
        n = rec.n if rec is not None else None  # (a group gone: read on while the slots are new)
        if n is not None and n - i > cap:  # (lapped: those entries are gone)
            self.missed += n - cap - i
            i = n - cap
        first = i
        end = n if n is not None else i + cap
        while i < end:
            slot = i % cap
            e = ring[slot]
            # an entry not read yet is a new list; None or the one read last from this slot
            # means the ring ends here (its writer counts an entry just before it stores it)
            if e is None or e is walk.seen[slot]:
                break
            walk.seen[slot] = e
            stats = self.ops.get(e[fr.OP])
            if stats is None:
                stats = self.ops[e[fr.OP]] = _new_op()
            stats[COUNT] += 1
            stats[BYTES] += self._nbytes(fr, e)
            if len(e) != fr.SHORT:  # (a short entry has no times to settle: TDIST_FR_TIMED is off)
                walk.pending.append(e)
            i += 1
        walk.next = i
        return i - first

    def _nbytes(self, fr: Any, e: list[Any]) -> int:
        key = (e[fr.INS], e[fr.INDT])
        try:
            nbytes = self._sizes.get(key)
        except TypeError:  # (shapes that are not hashable: counted without the cache)
            return _nbytes(fr, e)
        if nbytes is None:
            if len(self._sizes) >= 4096:
                self._sizes.clear()
            nbytes = self._sizes[key] = _nbytes(fr, e)
        return nbytes

    def _settle(self, fr: Any, walk: _Walk) -> None:
        """Latencies and errors of the operations that ended since the last reading."""
        still = []
        untimed, done_at, error, op, created = fr.UNTIMED, fr.DONE, fr.ERROR, fr.OP, fr.CREATED
        for e in walk.pending:
            if e[error] is not None:
                self.ops[e[op]][ERRORS] += 1
            elif e[done_at] == untimed:
                pass  # (completed, its time unknown: TDIST_FR_TIMED is off)
            elif e[done_at]:
                stats = self.ops[e[op]]
                seconds = max(0.0, (e[done_at] - e[created]) / 1e9)
                stats[LATENCY_SUM] += seconds
                stats[BUCKETS][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            else:
                still.append(e)
        walk.pending = still[-walk.cap:]  # (never more than a ring's worth waits)

    def totals(self) -> dict[str, Any]:
        """The totals as the wire format has them (``ops`` and ``missed``)."""
        return {"ops": {op: [s[0], s[1], s[2], s[3], list(s[4])] for op, s in self.ops.items()}, "missed": self.missed}


def _nbytes(fr: Any, e: list[Any]) -> int:
    dtype = e[fr.INDT]
    if dtype is None:
        return 0
    try:
        elements: int = sum(math.prod(s) for s in fr.shapes_of(e[fr.INS]))
        return elements * int(dtype.itemsize)
    except (TypeError, AttributeError):  # (an entry of a shape this does not know: no bytes)
        return 0


def _rpc_counts() -> dict[str, list[int]]:
    calls = sys.modules.get(_RPC_MODULE)
    if calls is None:
        return {}
    return {kind: [sent, failed] for kind, (sent, failed) in calls.call_counts().items()}


def _step() -> int | None:
    return _steps()[0]


class Reporter:
    """The worker's thread that reads its rings and answers the launcher (see the module
    docstring).

    Args:
        sock: the worker's end of its socket pair with the launcher.
        clock: the monotonic clock.
    """

    def __init__(self, sock: socket.socket, clock: Callable[[], float] = time.monotonic) -> None:
        self._sock = sock
        self._clock = clock
        self._tally = Tally(clock)
        self._lock = threading.Lock()  # (the thread and the exit hook)
        self._pid = os.getpid()
        self._last: dict[str, Any] | None = None
        self._last_at = -math.inf
        self._closed = False

    def start(self) -> None:
        """The thread, and the last write at exit."""
        threading.Thread(target=self._run, name="tdist-metrics", daemon=True).start()
        atexit.register(self.final)

    def snapshot(self, reply: int | None = None) -> dict[str, Any]:
        """Read the rings and return the totals in the wire format."""
        out = {"pid": self._pid, "reply": reply, "step": _step(), "rpc": _rpc_counts()}
        out.update(self._tally.totals())
        return out

    def _send(self, snap: dict[str, Any]) -> bool:
        try:
            self._sock.sendall(json.dumps(snap, separators=(",", ":")).encode() + b"\n")
        except TimeoutError:  # (the launcher is stuck: this line is lost, the next one will do)
            return False
        except OSError:  # (the launcher is gone)
            self._closed = True
            return False
        return True

    def _run(self) -> None:
        buf = b""
        wait = 0.0
        with self._lock:  # (hello: the launcher waits for this worker's answers from now on)
            self._send({"pid": self._pid, "reply": None, "step": None, "rpc": {}, "ops": {}, "missed": 0})
        while not self._closed:
            try:
                ready, _, _ = select.select([self._sock], [], [], wait)
                data = self._sock.recv(4096) if ready else b""
            except OSError:
                return
            if ready and not data:  # (the launcher closed its end)
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            reply = None
            for line in lines:
                with contextlib.suppress(ValueError):
                    reply = int(line)
            with self._lock:
                try:
                    wait = self._tally.poll()
                    snap = self.snapshot(reply)
                except Exception as exc:  # (never the end of the reporter: the next reading may do)
                    log.debug("metrics: reading the flight records failed: %s", exc)
                    wait = _POLL_MAX
                    continue
                now = self._clock()
                unasked = dict(snap, reply=None)
                if reply is not None or (unasked != self._last and now - self._last_at >= _PUSH_EVERY):
                    if self._send(snap):
                        self._last, self._last_at = unasked, now
                if reply is None and unasked != self._last:
                    wait = min(wait, max(0.0, self._last_at + _PUSH_EVERY - now))

    def final(self) -> None:
        """At exit: the last totals (this process only, not a forked child)."""
        if os.getpid() != self._pid or self._closed:
            return
        if self._lock.acquire(timeout=_SEND_TIMEOUT):
            try:
                self._tally.poll()
                self._send(self.snapshot())
            except Exception as exc:
                log.debug("metrics: the last totals were not sent: %s", exc)
            finally:
                self._lock.release()


_reporter: Reporter | None = None


def worker_side() -> Reporter | None:
    """In a worker of ``tdist run --metrics-port`` (``TDIST_METRICS_FD`` set): start the
    reporter. Once per process; never raises (a worker runs on without metrics)."""
    global _reporter
    fd_text = os.environ.pop(METRICS_FD_ENV, None)  # (the worker's own: not its children's)
    if _reporter is not None or not fd_text:
        return _reporter
    try:
        sock = socket.socket(fileno=int(fd_text))
        sock.set_inheritable(False)
        sock.settimeout(_SEND_TIMEOUT)
        _reporter = Reporter(sock)
        _reporter.start()
    except (OSError, ValueError):
        return None
    return _reporter


# -- the launcher's side -------------------------------------------------------------------------
def _add(into: dict[str, Any], snap: Mapping[str, Any]) -> None:
    """Add totals ``snap`` into ``into`` (both in the wire format)."""
    ops = into.setdefault("ops", {})
    for op, s in snap.get("ops", {}).items():
        t = ops.setdefault(op, _new_op())
        for k in (COUNT, BYTES, ERRORS, LATENCY_SUM):
            t[k] += s[k]
        t[BUCKETS] = [a + b for a, b in zip(t[BUCKETS], s[BUCKETS], strict=False)]
    rpc = into.setdefault("rpc", {})
    for kind, (sent, failed) in snap.get("rpc", {}).items():
        t = rpc.setdefault(kind, [0, 0])
        t[0] += sent
        t[1] += failed
    into["missed"] = into.get("missed", 0) + snap.get("missed", 0)


class Aggregate:
    """The job's counters by rank (pure): each worker's latest totals, and for each rank what
    its earlier processes counted (a worker that is gone leaves its last totals to the base),
    so that a rank's counters only grow across restarts."""

    def __init__(self) -> None:
        self._base: dict[int, dict[str, Any]] = {}
        self._live: dict[int, tuple[int, dict[str, Any]]] = {}  # worker id -> (rank, totals)
        self._gone: set[int] = set()
        self._steps: dict[int, int | None] = {}

    def update(self, worker: int, rank: int, snap: Mapping[str, Any]) -> None:
        """Worker ``worker`` (of ``rank``) says its totals are ``snap``."""
        if worker in self._gone:
            return
        self._live[worker] = (rank, dict(snap))
        self._steps[rank] = snap.get("step")

    def retire(self, worker: int) -> None:
        """Worker ``worker`` is gone: its last totals join its rank's base."""
        if worker in self._gone:
            return
        self._gone.add(worker)
        live = self._live.pop(worker, None)
        if live is not None:
            rank, snap = live
            _add(self._base.setdefault(rank, {}), snap)

    def by_rank(self) -> dict[int, dict[str, Any]]:
        """Every rank's totals (the wire format's ``ops``, ``rpc``, ``missed``, and ``step``:
        the last one its workers reported)."""
        out: dict[int, dict[str, Any]] = {}
        for rank, base in self._base.items():
            _add(out.setdefault(rank, {}), base)
        for rank, snap in self._live.values():
            _add(out.setdefault(rank, {}), snap)
        for rank, totals in out.items():
            totals["step"] = self._steps.get(rank)
        return out


def merge_nodes(
    totals: Mapping[int, Mapping[str, Any]], others: Iterable[Mapping[str, Any]]
) -> dict[int, dict[str, Any]]:
    """This node's totals by rank and other nodes' published ones (``{"totals": {rank: ...}}``,
    as ``MetricsServer.snapshot`` makes them) added up by rank: a rank that ran on one node in
    one round and on another after a re-rendezvous counts what both saw of it. A rank's step
    is this node's, else the highest another node reported."""
    out: dict[int, dict[str, Any]] = {}
    steps: dict[int, Any] = {}
    for rank, t in totals.items():
        _add(out.setdefault(int(rank), {}), t)
        steps[int(rank)] = t.get("step")
    for snap in others:
        for key, t in snap.get("totals", {}).items():
            rank = int(key)
            _add(out.setdefault(rank, {}), t)
            theirs = t.get("step")
            if steps.get(rank) is None or (theirs is not None and rank not in totals and theirs > steps[rank]):
                steps[rank] = theirs
    for rank, t in out.items():
        t["step"] = steps.get(rank)
    return out
