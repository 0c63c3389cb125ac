"""Desync diagnosis: when a collective times out or loses a peer, the error on every rank says
what each rank of the group was doing, read through the group's store.

Theory of operation. Every backend that keeps a flight record runs a ``Responder``: a daemon
thread on a connection of its own to the group's store (a ``clone()``; a blocking ``wait`` on
the shared one would hold it for everyone), blocked in ``wait`` on the key
``fr/ask/<rank>/<k>`` for the next request number ``k``. While nobody asks it costs a store
request every 10 s.

A rank whose operation fails (``diagnose``) takes a request number (``add("fr/asks", 1)``),
sets ``fr/ask/<q>/<k>`` for every member ``q`` (itself included, so that every responder sees
every number in turn; a number that a later one has overtaken for a second is given up: its
asker died, or its store calls failed, and it would hold up every later request. A responder
on torch's store notices at its next look, one on tdist's when its wait, 10 s at a time, ends),
and waits a short grace for the answers ``fr/head/<k>/<q>``: each rank's ``head``, the last few
entries of the group's record, its last completed collective, and what its process is doing in
other groups (a rank stuck in another group's collective is a classic deadlock). Ranks the
transport already knows to be gone are not waited for; a rank that does not answer in time
(stopped by ``SIGSTOP``, hung holding the GIL, or without a responder) is named as such.
``explain``, a pure function of the answers, turns them into one sentence per kind of
behaviour, culprits first: "rank 2 never entered all_reduce #412 (float32[1024]); its
last op is broadcast #411 (float32[10], completed 31.0 s ago) at train.py:88; ranks 0, 1, 3 are
waiting in all_reduce #412 (float32[1024])". The request may also ask every rank to write its
flight-recorder dump, so that a failure leaves the dumps of the whole group, the healthy ranks'
included, for ``torchfrtrace``.

The asking runs in a helper thread, on a clone of the store where the store can be cloned, and
is abandoned after the grace and a second: a store whose host is stopped must not turn a
diagnosed timeout into a hang. Values are JSON (the store may be shared; never pickle).

The same answers make the cheap desync check. Ranks that call different collectives at one
sequence number are caught when a message of one reaches the other (its fingerprint is compared
on arrival) or, in the shared-memory arena, at arrival; but two different calls may never
exchange a message at all (a broadcast from rank 0 and an all-reduce that first waits for rank
2) and would hang until the timeout. So one watchdog thread per process looks at the rings twice
a second, and a collective blocked for ``check_after()`` seconds is compared with what the other
ranks recorded at its sequence number (``mismatch``, by the rules of ``compatible``); its
backend turns a mismatch into a ``CollectiveMismatchError`` naming both sides and breaks the
group, so every rank hears of it. Operations pay nothing for it.

Thread-safety: a responder serves one recorder; ``diagnose`` may run on several ranks' threads
at once (each gets its own request number).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from .._core.errors import fresh
from ..store import FileStore, PrefixStore, Store
from . import _flight_recorder as fr

__all__ = [
    "GRACE", "Responder", "ask_all", "check_after", "compatible", "crossed", "cycle", "describe_call", "diagnose", "entered", "explain", "frames_of",
    "head", "long_wait", "mismatch", "now_at", "request_dumps", "say_long_wait", "stuck", "unwatch", "watch",
]

log = logging.getLogger(__name__)

GRACE = 2.0  # seconds the asking rank waits for the others' answers
# one blocking wait of a responder on tdist's store (it looks for a lost request number, and
# waits again, after it); a shorter one while a later request is there (``_overtaken``)
_WAIT = timedelta(seconds=10)
_WAIT_OVERTAKEN = timedelta(seconds=1.5)
# a responder connects this long after its group forms: the connection (a new client of the
# store, with its handshake) would otherwise compete with the group's own set-up, and a group
# that fails at once leaves with no responder to stop
_DEFER = 0.2
_DEFERRING, _CONNECTING, _CONNECTED = 0, 1, 2
_RECENT = 4
_POLL = 0.01  # seconds between two looks at the answers
_POLL_EVERY = 0.5  # seconds between two looks of a responder on torch's store (see Responder)
# a request number that a later one has overtaken for this long is taken as lost (its asker took
# the number, and its request never came: the asker died, or its store calls timed out)
_LOST_AFTER = 1.0


def clone_store(store: Any) -> Any:
    """A new connection to ``store`` for another thread, or ``None`` where there is none to be
    had (a ``FileStore``, whose clones count as handles of the job)."""
    root = store
    while isinstance(root, PrefixStore):
        root = root.underlying_store
    if isinstance(root, FileStore):
        return None
    try:
        clone = store.clone()
        clone.check(["fr/asks"])  # (torch's clone of a store written in Python fails only here)
    except Exception:
        return None
    return clone


def _server_of(torch_store: Any) -> tuple[str, int] | None:
    """The address of the server of torch's ``torch_store`` (under its prefixes), if it is a
    ``TCPStore``."""
    base = torch_store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    return (host, port) if isinstance(host, str) and isinstance(port, int) else None


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


def head(rec: fr.Recorder) -> dict[str, Any]:
    """What this rank is doing in ``rec``'s group, and in flight elsewhere in its process."""
    now = time.time_ns()
    es = rec.entries()
    colls = [e for e in es if e[fr.PEER] is None]
    done = [e for e in colls if e[fr.DONE]]
    elsewhere = []
    me = rec.global_rank
    for other in fr.recorders():
        if other is rec or other.global_rank != me:
            continue
        for e in other.entries()[-_RECENT:]:
            if not e[fr.DONE] and not e[fr.ERROR]:
                elsewhere.append({"group": other.label, "ranks": other.ranks, **fr.brief(e, now)})
    return {
        "rank": rec.rank,
        "global_rank": me,
        "group": rec.label,
        "ranks": rec.ranks,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "recent": [fr.brief(e, now) for e in es[-_RECENT:]],
        "last_completed": fr.brief(done[-1], now) if done else None,
        "last_seq": colls[-1][fr.CSEQ] if colls else 0,
        "elsewhere": elsewhere,
        "entered": entered(me),
        "stuck": stuck(me) is not None,
        # (where the thread that issued its last operation here is now: the main one, before any)
        "now_at": now_at(es[-1][fr.THREAD] if es else threading.main_thread().ident or 0),
    }


_TDIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # (the tdist package)
_THREADING = os.path.abspath(threading.__file__)


def now_at(thread: int) -> str | None:
    """``train.py:57 in evaluate``: where thread ``thread`` (an ident) is now, its innermost
    frame outside tdist, torch and ``threading`` (the program's own code, or its call into one
    of them); None where the thread is gone. Read at a diagnosis only."""
    for frame in frames_of(thread):
        name = frame.f_code.co_filename
        if not name.startswith((_TDIST, fr.TORCH_DIR)) and os.path.abspath(name) != _THREADING:
            return f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
    return None


def entered(global_rank: int) -> dict[str, int]:
    """The number of the last collective issued in each group of ``global_rank`` in this
    process, by group label (0: none yet): how far this rank has entered each."""
    out = {}
    for rec in fr.recorders():
        if rec.global_rank == global_rank:
            colls = [e for e in rec.entries() if e[fr.PEER] is None]
            out[rec.label] = colls[-1][fr.CSEQ] if colls else 0
    return out


def stuck(global_rank: int) -> int | None:
    """The one thread that issues the operations of ``global_rank`` in this process, where it is
    blocked in one of them now and no other thread could issue the next (no thread lives here
    but it and tdist's own): None where that is not certain. Read at a diagnosis only."""
    issuers: set[int] = set()
    for rec in fr.recorders():
        if rec.global_rank == global_rank:
            issuers.update(e[fr.THREAD] for e in rec.entries())
    if len(issuers) != 1:
        return None
    issuer: int = next(iter(issuers))
    if any(t.ident != issuer and not t.name.startswith("tdist") for t in threading.enumerate()):
        return None
    for frame in frames_of(issuer):
        code = frame.f_code
        if code.co_name in ("_execute", "wait") and code.co_filename.startswith(_C10D):
            return issuer
    return None


def frames_of(thread: int) -> Iterator[types.FrameType]:
    """The Python frames of thread ``thread`` (an ident), innermost first (none if it is gone)."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        yield frame
        frame = frame.f_back


_C10D = os.path.dirname(os.path.abspath(__file__)) + os.sep  # (the backends' files: where they wait)


class Responder:
    """Answers the group's diagnosis requests for one rank (see the module docstring).

    On torch's store (a group that torch made, or a store handed from torch) it looks for its
    key every ``_POLL_EVERY`` seconds instead of waiting on it, as torch's own watchdog looks
    at its store, and it leaves once the store's server has gone (an idle plain connection to
    it, ``_torch_pg._ServerWatch``): that server lives in rank 0's process, and a responder of
    another rank still in torch's ``wait`` when it went had torch's client print a warning
    with a C++ stack (36 at the exit of a 2 x 2 device mesh whose rank 0 left first), and a
    thread still inside torch's C++ call as its own interpreter ended aborted the process
    ("terminate called without an active exception").

    Args:
        store: the group's store (cloned for the responder's thread).
        rec: this rank's recorder of the group.
        start: start its thread now (it connects after a short deferral); ``False``: the owner
            calls ``start()`` later, from a thread of its own (the ``tcp`` backend: on its
            endpoint's first heartbeat round, so that forming the group starts a thread fewer).
    """

    def __init__(self, store: Any, rec: fr.Recorder, start: bool = True) -> None:
        self._store = store
        self._rec = rec
        self._next = 1
        self._overtaken_at: float | None = None  # (since when a later request is there: ``_overtaken``)
        self._stopped = False
        self._started = False
        self._start_lock = threading.Lock()
        self._go = threading.Event()  # (set: stop waiting to connect)
        self._state = _DEFERRING
        root = store
        while isinstance(root, PrefixStore):
            root = root.underlying_store
        torch_store = root._torch_store() if isinstance(root, Store) else root
        self._ours = torch_store is None  # (tdist's store: its client is Python through and through)
        self._server = None if self._ours else _server_of(torch_store)
        self._thread = threading.Thread(target=self._run, args=(_DEFER if start else 0.0,), name=f"tdist-fr-{rec.rank}", daemon=True)
        _responders.add(self)
        if start:
            self.start()

    def start(self) -> None:
        """Start answering (once; not after ``stop``). Never raises."""
        with self._start_lock:
            if self._started or self._stopped:
                return
            self._started = True
        with contextlib.suppress(RuntimeError):  # (the interpreter is shutting down)
            self._thread.start()

    def _run(self, defer: float) -> None:
        if defer:
            self._go.wait(defer)
        if self._stopped:
            return
        self._state = _CONNECTING
        watch = None
        if self._server is not None:
            from ._torch_pg import _ServerWatch

            try:
                watch = _ServerWatch(*self._server)
            except OSError:  # (its server has gone already)
                return
        store = clone_store(self._store)
        if store is None:
            if watch is not None:
                watch.close()
            return
        self._state = _CONNECTED
        rank = self._rec.rank
        failures = 0
        unread = 0  # failed reads of the request that is there
        try:
            while not self._stopped:
                key = f"fr/ask/{rank}/{self._next}"
                t0 = time.monotonic()
                try:
                    if self._ours:
                        store.wait([key], _WAIT if self._overtaken_at is None else _WAIT_OVERTAKEN)
                    elif not store.check([key]):
                        if self._overtaken(store):
                            continue
                        if self._rest(watch):
                            return
                        continue
                except Exception:
                    # a timeout waits again; a store that is gone ends the responder
                    failures = failures + 1 if time.monotonic() - t0 < 1.0 else 0
                    if failures >= 3 or (not self._ours and self._rest(watch)):
                        return
                    if self._ours and not failures:  # (a wait that timed out)
                        with contextlib.suppress(Exception):
                            self._overtaken(store)
                    continue
                if self._stopped:
                    return
                request: bytes | None = None
                try:
                    request = store.get(key)
                except Exception as exc:  # (read again: a store slow for a while must not lose it)
                    log.debug("rank %d: flight-recorder responder of group %s: %s", rank, self._rec.label, exc)
                    unread += 1
                    if unread < 3:
                        continue
                unread = 0  # (read, or given up after three tries)
                try:
                    store.delete_key(key)
                    if request is not None:
                        self._answer(store, request)
                except Exception as exc:
                    log.debug("rank %d: flight-recorder responder of group %s: %s", rank, self._rec.label, exc)
                self._next += 1
                self._overtaken_at = None
        finally:
            _close(store)
            if watch is not None:
                watch.close()

    def _overtaken(self, store: Any) -> bool:
        """Whether the awaited request number is lost, and the responder moves on to the next
        (on torch's store, at each look that finds it absent; on tdist's, when a wait for it
        times out). The request numbers come in turn, and one that never comes would leave every
        later request of the group unanswered: so once the next one has been there for
        ``_LOST_AFTER`` seconds while this one is not, this one is given up (the asks of two
        ranks that fail at once land within milliseconds of each other, in either order)."""
        if not store.check([f"fr/ask/{self._rec.rank}/{self._next + 1}"]):
            self._overtaken_at = None
            return False
        now = time.monotonic()
        if self._overtaken_at is None:
            self._overtaken_at = now
        if now - self._overtaken_at < _LOST_AFTER:
            return False
        log.debug("rank %d: request %d of group %s never came; on to the next", self._rec.rank, self._next, self._rec.label)
        self._next += 1
        self._overtaken_at = None
        return True

    def _rest(self, watch: Any) -> bool:
        """Between two looks at torch's store: whether to leave (stopped meanwhile, or the
        store's server has gone)."""
        return self._go.wait(_POLL_EVERY) or (watch is not None and watch.gone())

    def _answer(self, store: Store, request: bytes) -> None:
        if request == b"quit":
            return
        req = json.loads(request)
        rec = self._rec
        prefix = req.get("dump")
        if prefix and req.get("from") != rec.rank:
            try:
                g = rec.global_rank
                fr.write_dump(f"{prefix}{g}", g, failed=rec if req.get("first") else None)
            except Exception as exc:
                log.warning("rank %d: flight-recorder dump failed: %s", rec.rank, exc)
        store.set(f"fr/head/{req['k']}/{rec.rank}", json.dumps(head(rec)))

    def stop(self) -> None:
        """Stop answering (the group is being destroyed): wake the thread, which then closes
        its connection."""
        with self._start_lock:
            if self._stopped:
                return
            self._stopped = True
        self._go.set()
        if self._ours and self._state == _CONNECTED and self._thread.is_alive():
            # (from a thread: a store whose host is stopped must not hold up destroy_process_group)
            threading.Thread(target=self._wake, name=f"tdist-fr-stop-{self._rec.rank}", daemon=True).start()

    def _wake(self) -> None:
        try:
            self._store.set(f"fr/ask/{self._rec.rank}/{self._next}", b"quit")
        except Exception:
            pass

    def join(self, timeout: float) -> None:
        if self._started:
            self._thread.join(timeout)


_responders: weakref.WeakSet[Responder] = weakref.WeakSet()


def _stop_responders_at_exit() -> None:
    """Let every responder leave its store's wait before the interpreter ends: a thread still
    blocked in a C++ store's wait (torch's TCPStore, for groups torch made) when the process
    tears its objects down aborts it ("terminate called without an active exception")."""
    live = [r for r in list(_responders) if r._thread.is_alive()]
    for r in live:
        if not r._stopped:
            r._stopped = True
            r._go.set()  # (one still deferring, or polling torch's store, leaves at once)
            if r._ours and r._state == _CONNECTED:
                r._wake()
    deadline = time.monotonic() + 2.0
    for r in live:
        if r._state == _CONNECTING and r._ours:
            # (still connecting, perhaps to a store that is gone: tdist's client has nothing to
            # abort at teardown, and waiting for its connect would hold up the exit)
            continue
        r.join(max(0.0, deadline - time.monotonic()))


atexit.register(_stop_responders_at_exit)


def request_dumps(store: Any, rec: fr.Recorder, prefix: str, timeout: float, first: bool = False) -> list[str]:
    """Have every rank of ``rec``'s group write its dump to ``<prefix><global rank>`` (this rank
    first, then the others through their responders); returns the paths of the ranks that did
    within ``timeout``. ``first``: the group's failure has them written, and a later failure of
    it does not replace them (``fr.write_dump``)."""
    mine = rec.global_rank
    fr.write_dump(f"{prefix}{mine}", mine, failed=rec if first else None)
    heads, _ = ask_all(store, rec, {}, prefix, timeout, first=first)
    return sorted(f"{prefix}{h['global_rank']}" for h in heads.values() if h is not None)


def _ask(
    store: Any, rec: fr.Recorder, gone: Mapping[int, str], dump: str | None, grace: float, first: bool
) -> tuple[dict[int, dict[str, Any] | None], str | None]:
    """Ask every member for its head (the executor of ``diagnose``); returns the answers and,
    if the store failed meanwhile, why."""
    rank, size = rec.rank, rec.size
    deadline = time.monotonic() + grace
    k = store.add("fr/asks", 1)
    payload = json.dumps({"k": k, "from": rank, "dump": dump, **({"first": True} if first else {})}).encode()
    for tries in range(1, 4):  # (written again: a store slow for a while must not lose the ask)
        try:
            store.multi_set([f"fr/ask/{q}/{k}" for q in range(size)], [payload] * size)
            break
        except Exception as exc:
            log.debug("rank %d: writing request %d: %r", rank, k, exc)
            if tries == 3 or time.monotonic() >= deadline:
                raise
    keys = {q: f"fr/head/{k}/{q}" for q in range(size) if q != rank and q not in gone}
    heads: dict[int, dict[str, Any] | None] = dict.fromkeys(keys)
    broke = None
    # (each answer is read as soon as it is there: the store's host may be one of the ranks,
    # and leave once it has its own answers)
    pending = dict(keys)
    while pending:
        try:
            for q, key in list(pending.items()):
                if store.check([key]):
                    heads[q] = json.loads(store.get(key))
                    del pending[q]
        except Exception as exc:
            log.debug("rank %d: reading the answers to request %d: %r", rank, k, exc)
            broke = f"{type(exc).__name__}: {exc}"
            break
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(_POLL)
    return heads, broke


def diagnose(
    store: Any,
    rec: fr.Recorder,
    failed: Sequence[Any],
    gone: Mapping[int, str],
    dump: str | None = None,
    grace: float = GRACE,
) -> str:
    """What every rank of ``rec``'s group was doing when ``failed`` (an entry of ``rec``) went
    wrong: asks them through ``store`` (see the module docstring) and explains.

    Args:
        store: the group's store.
        rec: this rank's recorder.
        failed: the (live) entry of the operation that failed.
        gone: ranks known to be gone, with why (not asked).
        dump: ask every rank to write its dump to ``<dump><global rank>``.
        grace: seconds to wait for answers.

    Returns:
        The explanation (never raises: a store that cannot be asked is said so).
    """
    mine = fr.brief(fr.normalized(rec, failed), time.time_ns())
    heads, unanswered = ask_all(store, rec, gone, dump, grace, first=True)
    return explain(rec.rank, rec.size, mine, heads, gone, rec.label, unanswered)


def ask_all(
    store: Any, rec: fr.Recorder, gone: Mapping[int, str], dump: str | None = None, grace: float = GRACE,
    first: bool = False,
) -> tuple[dict[int, dict[str, Any] | None], str]:
    """Every member's ``head`` (``None`` for those that did not answer within ``grace``; this
    rank's own, read here), and what to say of a rank that did not answer. Asks from a helper
    thread on a clone of ``store``, given up a second after ``grace``."""
    box: list[Any] = []

    def run() -> None:
        s = clone_store(store)
        try:
            box.append(_ask(s if s is not None else store, rec, gone, dump, grace, first))
        except Exception as exc:
            box.append(fresh(exc))  # (the box, which this frame holds, keeps it: see ``fresh``)
        finally:
            if s is not None:
                _close(s)

    t = threading.Thread(target=run, name=f"tdist-fr-ask-{rec.rank}", daemon=True)
    t.start()
    t.join(grace + 1.0)
    heads: dict[int, dict[str, Any] | None] = {}
    unanswered = f"did not answer within {grace:g} s (stopped, e.g. by SIGSTOP, hung holding the GIL, or unreachable)"
    if not box or isinstance(box[0], BaseException):
        why = "the store did not answer" if not box else f"{type(box[0]).__name__}: {box[0]}"
        unanswered = f"could not be asked ({why}{_store_host_gone(rec, gone)})"
    else:
        heads, broke = box[0]
        if broke is not None:
            unanswered = f"did not answer before the store failed ({broke}{_store_host_gone(rec, gone)})"
    heads[rec.rank] = head(rec)
    return heads, unanswered


def _store_host_gone(rec: fr.Recorder, gone: Mapping[int, str]) -> str:
    """Why the store may have failed, where the failure says it: global rank 0's process, which
    ``env://`` and ``tcp://`` make the store's host, is gone (under ``tdist run`` the launcher
    hosts it, and it outlives a rank)."""
    ranks = rec.ranks
    return "; global rank 0, which is gone, hosted it under env:// or tcp://" if 0 in ranks and ranks.index(0) in gone else ""


# -- the watchdog: a collective that blocks is checked against the other ranks' calls ------------
def check_after() -> float:
    """Seconds a collective may block before the desync check asks the other ranks what they
    called (``TDIST_FR_CHECK_AFTER``, 2; then again after twice as long, up to a minute apart;
    0: never)."""
    try:
        return max(0.0, float(os.environ.get("TDIST_FR_CHECK_AFTER", "2")))
    except ValueError:
        return 2.0


def long_wait() -> float:
    """Seconds after which a collective that the desync check finds blocked, with nothing
    wrong, is reported in a warning at each check (15 times ``check_after()``: 30 s)."""
    return 15 * check_after()


def say_long_wait(
    rank: int, size: int, group: str, mine: Mapping[str, Any], heads: Mapping[int, Mapping[str, Any] | None],
    unanswered: str, age: float, timeout: float, backend: str = "",
) -> None:
    """The warning of a wait past ``long_wait()`` that nothing explains as wrong: what it is,
    how long it has waited, and what every rank of the group is doing (``explain``)."""
    log.warning(
        "rank %d: %s of group %r has waited %.0f s%s, and waits on until the group's timeout (%s). %s",
        rank, describe_call(mine), group, age, f" on the {backend} backend" if backend else "",
        timedelta(seconds=round(timeout)), explain(rank, size, mine, heads, {}, group, unanswered),
    )


class _Watchdog:
    """One daemon thread per process that looks at every watched recorder twice a second; a
    collective running for ``check_after()`` seconds is handed to its backend's check (which
    asks the other ranks through the store, and breaks the group on a mismatch). It costs the
    operations nothing: it reads the rings."""

    _PERIOD = 0.5
    _MAX_GAP = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[weakref.ref[fr.Recorder], weakref.WeakMethod[Callable[[list[Any]], None]]]] = {}
        self._due: dict[tuple[int, int, int], float] = {}
        self._thread: threading.Thread | None = None

    def watch(self, rec: fr.Recorder, check: Callable[[list[Any]], None]) -> None:
        after = check_after()
        if after <= 0:
            return
        with self._lock:
            self._watched[rec.pg_id] = (weakref.ref(rec), weakref.WeakMethod(check))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tdist-fr-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self._PERIOD)
            with self._lock:
                items = list(self._watched.items())
                if not items:  # (every group is gone: the next one starts a new thread)
                    self._thread = None
                    return
            # (read each round: the thread outlives the group that started it, and the setting
            # may change in between)
            after = check_after() or float("inf")
            now = time.time_ns()
            for pg_id, (rref, mref) in items:
                rec, check = rref(), mref()
                if rec is None or check is None:
                    with self._lock:
                        self._watched.pop(pg_id, None)
                    continue
                for e in rec.live(_RECENT):
                    # (collectives, and receives: two ranks that both receive first wait forever)
                    if (e[fr.PEER] is not None and e[fr.OP] != "recv") or e[fr.DONE] or e[fr.ERROR]:
                        continue
                    if e[fr.STARTED]:  # (the oldest running operation: what the group waits on)
                        key = (pg_id, e[fr.CREATED], e[fr.OP])  # (a short entry's full form is a new list each time)
                        due = self._due.get(key, after)
                        if (now - e[fr.STARTED]) / 1e9 >= due:
                            if len(self._due) > 1000:
                                self._due.clear()
                            # (the next look after twice as long, at most a minute later: an
                            # age capped at a minute had every later look come at once)
                            self._due[key] = min(due * 2, due + self._MAX_GAP)
                            try:
                                check(e)
                            except Exception as exc:
                                log.debug("flight recorder: desync check of group %s: %s", rec.label, exc)
                    break

    def unwatch(self, rec: fr.Recorder) -> None:
        with self._lock:
            self._watched.pop(rec.pg_id, None)

    def forget(self) -> None:
        """In a forked child: the parent's groups are not this process's."""
        self._lock = threading.Lock()
        self._watched.clear()
        self._due.clear()
        self._thread = None


_watchdog = _Watchdog()
os.register_at_fork(after_in_child=_watchdog.forget)


def watch(rec: fr.Recorder, check: Callable[[list[Any]], None]) -> None:
    """Have ``check(entry)`` (a bound method of the group's backend, held weakly) run when a
    collective of ``rec`` blocks for ``check_after()`` seconds, then at growing intervals."""
    _watchdog.watch(rec, check)


def unwatch(rec: fr.Recorder) -> None:
    """Stop watching ``rec`` (its group is being destroyed)."""
    _watchdog.unwatch(rec)


# -- the explanation (pure) ----------------------------------------------------------------------
# collectives whose every rank passes the same shapes (the others may differ by rank: uneven
# all_gather, all_to_all splits, the root's lists of gather and scatter)
_SAME_SHAPES = frozenset({
    "all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier",
})


def compatible(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two ranks' entries of one sequence number are the same call."""
    if a.get("op") != b.get("op"):
        return False
    if a.get("detail") and b.get("detail") and a["detail"] != b["detail"]:  # (another root, another reduction)
        return False
    if a.get("op") in _SAME_SHAPES:
        return bool(a.get("sig") == b.get("sig"))
    return not a.get("dtype") or not b.get("dtype") or a.get("dtype") == b.get("dtype")


def mismatch(failed: Mapping[str, Any], heads: Mapping[int, Mapping[str, Any] | None]) -> list[int]:
    """The ranks whose entry of ``failed``'s sequence number is another call (``[]``: none
    found; a rank that has not reached it yet is no mismatch)."""
    if failed.get("p2p"):
        return []
    out = []
    for q, h in sorted(heads.items()):
        if h is None:
            continue
        for b in h.get("recent") or []:
            if not b.get("p2p") and b.get("seq") == failed["seq"] and not compatible(b, failed):
                out.append(q)
                break
    return out


def crossed(
    failed: Mapping[str, Any], heads: Mapping[int, Mapping[str, Any] | None], me: int, entered: Mapping[str, int]
) -> tuple[int, Mapping[str, Any]] | None:
    """A rank that ``failed``'s call waits for, blocked in another group's collective that this
    rank has not entered: ``(rank, its entry there)``, or None. The two ranks wait for each
    other: a deadlock that no message shows (each group's calls match), classically two groups'
    collectives called in a different order on two ranks.

    ``entered``: for each other group of which this rank is a member, the sequence number of its
    last collective issued there; given only where this rank cannot issue another before
    ``failed`` returns (``stuck``: its one issuing thread is blocked in it). The other rank must
    be as certain (its head's ``stuck``), with the other group's collective the only operation
    it has in flight: it cannot come to ``failed``'s call before that one returns.
    """
    if failed.get("p2p"):
        return None
    seq = failed["seq"]
    for q, h in sorted(heads.items()):
        if q == me or h is None or not h.get("stuck"):
            continue
        if int(h.get("last_seq") or 0) >= seq:  # (entered it: not what this call waits for)
            continue
        here = [b for b in h.get("recent") or [] if b.get("state") != "completed" and not b.get("error")]
        there = h.get("elsewhere") or []
        if here or len(there) != 1:
            continue
        b = there[0]
        group = b.get("group")
        if not b.get("p2p") and group in entered and entered[group] < int(b.get("seq") or 0):
            return q, b
    return None


def cycle(
    me: int, mine: Mapping[str, Any], group: str, ranks: Sequence[int], heads: Mapping[int, Mapping[str, Any] | None],
    entered: Mapping[str, int],
) -> list[tuple[int, Mapping[str, Any], int]] | None:
    """A cycle of waits through several groups back to this rank: ``mine``, this rank's blocked
    collective in group ``group`` (global ranks ``ranks``), waits for a rank blocked in another
    group's collective, which waits for a third, and so on, until one waits for this rank in a
    group whose collective this rank has not entered (``entered``: this rank's last collective
    in each of its groups) and cannot enter before ``mine`` returns. Returns the hops, each
    ``(global rank waited for, the call it is in, global rank that call waits for)``, the last
    waiting for ``me``; or None. (``crossed`` finds two ranks that wait for each other with the
    answers of this call's group alone.)

    ``heads``: every rank's ``head`` in a group of them all (the default group), by global rank.
    A rank is followed only where it is certain of its wait (its head's ``stuck``) and its one
    operation in flight is that collective; a rank waits for the members of its call's group
    that have not entered it. Ranks that did not answer are not followed.
    """
    if mine.get("p2p"):
        return None

    def call_of(h: Mapping[str, Any] | None) -> tuple[Mapping[str, Any], Sequence[int], str] | None:
        if h is None or not h.get("stuck"):
            return None
        busy = [b for b in h.get("recent") or [] if b.get("state") != "completed" and not b.get("error")]
        there = h.get("elsewhere") or []
        if len(busy) + len(there) != 1:
            return None
        if busy:
            return busy[0], h.get("ranks") or [], str(h.get("group") or "")
        return there[0], there[0].get("ranks") or [], str(there[0].get("group") or "")

    def waits_for(call: Mapping[str, Any], members: Sequence[int], group: str, who: int) -> list[int]:
        seq = int(call.get("seq") or 0)
        out = []
        for m in members:
            if m == who:
                continue
            if m == me:
                if entered.get(group, 0) < seq:
                    out.append(m)
                continue
            h = heads.get(m)
            if h is not None and int((h.get("entered") or {}).get(group, 0)) < seq:
                out.append(m)
        return out

    calls = {g: c for g, h in heads.items() if g != me and (c := call_of(h)) is not None and not c[0].get("p2p")}
    start = waits_for(mine, ranks, group, me)
    # depth-first from the ranks this call waits for, each rank visited once: a path back here
    path: list[tuple[int, Mapping[str, Any], int]] = []
    seen: set[int] = set()

    def visit(r: int) -> bool:
        if r in seen or r not in calls:
            return False
        seen.add(r)
        call, members, group = calls[r]
        for nxt in waits_for(call, members, group, r):
            path.append((r, {**call, "group": group}, nxt))
            if nxt == me or visit(nxt):
                return True
            path.pop()
        return False

    for r in start:
        if visit(r):
            return path
    return None


def receives_crossed(failed: Mapping[str, Any], heads: Mapping[int, Mapping[str, Any] | None], me: int) -> int | None:
    """The rank that ``failed``, a receive from it, waits for, where that rank is blocked in a
    receive from this rank: neither can send what the other waits for before its own receive
    returns (a deadlock that no message shows: both ranks called ``recv`` first). None unless
    the other rank is certain of it (its head's ``stuck``), with that receive, in this group,
    its only operation in flight; the caller is as certain of its own side.
    """
    p2p = failed.get("p2p")
    if not p2p or failed.get("op") != "recv" or p2p[1] != me or p2p[0] < 0:
        return None
    q = int(p2p[0])
    h = heads.get(q)
    if h is None or not h.get("stuck") or h.get("elsewhere"):
        return None
    busy = [b for b in h.get("recent") or [] if b.get("state") != "completed" and not b.get("error")]
    if len(busy) == 1 and busy[0].get("op") == "recv" and list(busy[0].get("p2p") or ()) == [me, q]:
        return q
    return None


def describe_call(b: Mapping[str, Any]) -> str:
    """An entry of the diagnosis as a call: ``all_reduce #3 (float32[4], op=SUM)``."""
    if b.get("p2p"):
        src, dst = b["p2p"]
        text = f"{b['op']} {_end(src)}->{dst} (p2p #{b['seq']})"
    else:
        text = f"{b['op']} #{b['seq']}"
    shown = ", ".join(x for x in (b.get("sig"), b.get("detail")) if x)
    return text + (f" ({shown})" if shown else "")


def _op(b: Mapping[str, Any]) -> str:
    """An entry with its state: ``broadcast #411 (float32[10], completed 31.0 s ago) at x.py:8``."""
    if b.get("p2p"):
        src, dst = b["p2p"]
        name = f"{b['op']} {_end(src)}->{dst} (p2p #{b['seq']}"
    else:
        name = f"{b['op']} #{b['seq']} ("
    sig = b.get("sig")
    parts = [sig] if sig else []
    state = b.get("state", "?")
    since = b.get("since_s")
    if state == "completed":
        parts.append(f"completed {since:.1f} s ago" if since is not None else "completed")
    elif state == "started":
        parts.append(f"running for {since:.1f} s" if since is not None else "running")
    else:
        parts.append(f"queued for {since:.1f} s" if since is not None else "queued")
    if b.get("p2p"):
        text = f"{name}, {', '.join(parts)})"
    else:
        text = f"{name}{', '.join(parts)})"
    if b.get("where"):
        text += f" at {b['where']}"
    return text


def _end(rank: int) -> str:
    """A point-to-point operation's end: ``"any"`` for a receive from any rank."""
    return "any" if rank < 0 else str(rank)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _status(
    q: int, failed: Mapping[str, Any], h: Mapping[str, Any] | None, gone: Mapping[int, str], unanswered: str,
    known: str,
) -> tuple[str, bool]:
    """Rank ``q``'s behaviour in one phrase, and whether it waits in the failed call as this
    rank does."""
    call = describe_call(failed)
    if q in gone:
        return f"{gone[q]}{known}", False
    if h is None:
        return f"{unanswered}{known}", False
    seq = failed["seq"]
    recent = h.get("recent") or []
    same = [b for b in recent if not b.get("p2p") and b.get("seq") == seq] if not failed.get("p2p") else []
    elsewhere = "".join(
        f"; it is in {describe_call(b)} of group {b['group']!r} ({b.get('state')} for {b.get('since_s', 0):.1f} s)"
        for b in h.get("elsewhere") or []
    )
    if same:
        b = same[-1]
        if compatible(b, failed):
            if b.get("state") == "completed":
                return f"completed {call}{elsewhere}", False
            return "", True
        return f"called {describe_call(b)} where others called {call}{elsewhere}", False
    last = recent[-1] if recent else None
    tail = f"its last op is {_op(last)}" if last else "it has recorded no operation in this group"
    if h.get("now_at") and not elsewhere:
        tail += f"; its thread is now at {h['now_at']}"
    if int(h.get("last_seq") or 0) < seq or failed.get("p2p"):
        return f"never entered {call}; {tail}{elsewhere}", False
    return f"is past {call}; {tail}{elsewhere}", False


def explain(
    me: int,
    size: int,
    failed: Mapping[str, Any],
    heads: Mapping[int, Mapping[str, Any] | None],
    gone: Mapping[int, str],
    group: str,
    unanswered: str = "did not answer",
) -> str:
    """One sentence per behaviour, culprits first (see the module docstring).

    Args:
        me: the rank that explains (its failed call is the reference).
        size: the group's size.
        failed: ``brief`` of the failed entry.
        heads: each rank's ``head``, ``None`` for one that did not answer.
        gone: ranks known to be gone, with what happened to them (``"is stalled (...)"``).
        group: the group's name.
        unanswered: what to say of a rank that did not answer.
    """
    if failed.get("p2p"):
        return _explain_p2p(me, failed, heads, gone, group, unanswered)
    by_status: dict[str, list[int]] = {}
    waiting: list[int] = []
    mine = heads.get(me) or {}
    last = mine.get("last_completed")
    known = f"; it took part in {describe_call(last)}, the last collective completed here" if last else ""
    for q in range(size):
        status, waits = _status(q, failed, heads.get(q), gone, unanswered, known)
        if waits:
            waiting.append(q)
        else:
            by_status.setdefault(status, []).append(q)
    parts = [f"{_ranks(ranks)} {status}" for status, ranks in by_status.items()]
    if waiting:
        verb = "is" if len(waiting) == 1 else "are"
        parts.append(f"{_ranks(waiting)} {verb} waiting in {describe_call(failed)}")
    if not by_status:
        parts.append("no rank is missing (every rank was in this call: a slow rank, or a network stall)")
    return f"What the ranks of group {group!r} were doing: " + "; ".join(parts) + "."


def _explain_p2p(
    me: int, failed: Mapping[str, Any], heads: Mapping[int, Mapping[str, Any] | None], gone: Mapping[int, str],
    group: str, unanswered: str,
) -> str:
    """``explain`` of a point-to-point operation: what the other side was doing (every other
    rank, for a receive from any rank)."""
    src, dst = failed["p2p"]
    peer = src if me == dst else dst
    if peer < 0:  # (``recv`` from any rank: any of them could send it)
        others = "; ".join(f"rank {q} {_doing(q, heads, gone, unanswered)}" for q in sorted(heads) if q != me)
        return (
            f"What the ranks of group {group!r} were doing: {others or 'no other rank answered'}; "
            f"rank {me} is waiting in {describe_call(failed)}, from any rank."
        )
    role = "send" if peer == src else "receive"
    return (
        f"What the ranks of group {group!r} were doing: rank {peer}, which was to {role} it, "
        f"{_doing(peer, heads, gone, unanswered)}; rank {me} is waiting in {describe_call(failed)}."
    )


def _doing(peer: int, heads: Mapping[int, Mapping[str, Any] | None], gone: Mapping[int, str], unanswered: str) -> str:
    """What rank ``peer`` is doing, in a phrase (``_explain_p2p``)."""
    h = heads.get(peer)
    if peer in gone:
        return gone[peer]
    if h is None:
        return unanswered
    busy = [(b, None) for b in h.get("recent") or [] if b.get("state") != "completed"]
    busy += [(b, b.get("group")) for b in h.get("elsewhere") or []]
    if busy:
        b, other = busy[-1]
        doing = f"is in {_op(b)}" + (f" of group {other!r}" if other else "")
    elif h.get("recent"):
        doing = f"is in no operation of this group; its last is {_op(h['recent'][-1])}"
    else:
        doing = "has recorded no operation in this group"
    if not busy and h.get("now_at"):
        doing += f"; its thread is now at {h['now_at']}"
    return doing
