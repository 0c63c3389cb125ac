"""Expiration timers: the request, the client and server bases, ``configure`` and ``expires``.

Theory of operation. A worker about to run code that may hang says so: ``with expires(after=60):``
sends an *acquire* request (its pid, a scope name, an absolute expiration time) to a timer server
in another process of the same host, and a *release* request (expiration time ``-1``) when the
block ends, whichever way it ends. The server keeps one timer per ``(worker, scope)``; a second
acquire of a scope replaces the first (a recursive function re-arms its one timer). A watchdog
thread reads requests, and whenever a worker holds a timer past its expiration it reaps the
worker (a local server kills its pid) and forgets its timers.

Expiration times are wall-clock seconds since the epoch (``time.time()``), not monotonic: they
are torch's wire format, written by one process and compared by another, and torch's clients
and servers must interoperate with ours. Only that comparison uses the wall clock; every wait
of ours is a duration.

The server's decisions are pure functions of its table and a deadline (``register_timers``,
``get_expired_timers(deadline)``), so tests drive them without a thread. The watchdog sleeps
until a request comes, the earliest timer expires, or ``max_interval`` passes, whichever is
first (torch's waits ``max_interval`` whatever the timers say), and ``stop()`` wakes it where
the queue can be woken.

Thread safety: a server's table belongs to its watchdog thread once ``start()`` ran; clients
may be shared by the threads of a worker (each request is one message).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["RequestQueue", "TimerClient", "TimerRequest", "TimerServer", "configure", "expires"]

log = logging.getLogger(__name__)

# how long ``stop()`` waits for the watchdog beyond one of its waits
_STOP_GRACE = 1.0


class TimerRequest:
    """One acquire or release of a countdown timer, from a ``TimerClient`` to a ``TimerServer``.

    Args:
        worker_id: who holds the timer (what identifies a worker is the implementation's:
            the local timers use the pid).
        scope_id: which of the worker's timers.
        expiration_time: when it expires, in seconds since the epoch; a negative value
            releases the timer.
    """

    __slots__ = ("expiration_time", "scope_id", "worker_id")

    def __init__(self, worker_id: Any, scope_id: str, expiration_time: float) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TimerRequest):
            return False
        return (self.worker_id, self.scope_id, self.expiration_time) == (
            other.worker_id, other.scope_id, other.expiration_time,
        )

    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by value: as torch's)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(worker_id={self.worker_id!r}, scope_id={self.scope_id!r}, "
            f"expiration_time={self.expiration_time!r})"
        )


class TimerClient(abc.ABC):
    """Acquires and releases the timers of the worker that holds it, by asking a ``TimerServer``."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm the timer ``scope_id`` of this worker to expire at ``expiration_time`` (seconds
        since the epoch), replacing one of the same scope."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Disarm the timer ``scope_id`` of this worker (nothing happens if it is not armed)."""


class RequestQueue(abc.ABC):
    """Where a ``TimerServer`` reads its requests from."""

    @abc.abstractmethod
    def size(self) -> int:
        """How many requests wait now (it may grow, but not shrink, until ``get`` is called)."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to ``size`` requests, waiting at most ``timeout`` seconds for them."""


class TimerServer(abc.ABC):
    """Watches the timers of the workers of one host and reaps a worker whose timer expired.

    Args:
        request_queue: where requests come from.
        max_interval: the most seconds the watchdog waits for a request before it looks at the
            timers again (it also wakes when the earliest timer expires).
        daemon: whether the watchdog thread is a daemon thread (it does not keep the process).
    """

    def __init__(self, request_queue: RequestQueue, max_interval: float, daemon: bool = True) -> None:
        super().__init__()
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._watchdog_thread: threading.Thread | None = None
        self._stop_event = threading.Event()

    @property
    def _stop_signaled(self) -> bool:  # (torch's attribute name; its subclasses may set it)
        return self._stop_event.is_set()

    @_stop_signaled.setter
    def _stop_signaled(self, value: bool) -> None:
        if value:
            self._stop_event.set()
        else:
            self._stop_event.clear()

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply ``timer_requests`` to the table: an acquire arms a timer, a release (a negative
        expiration time) disarms it."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Forget every timer of ``worker_ids``."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """The timers that expire at or before ``deadline`` (seconds since the epoch), by
        worker id."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Any) -> bool:
        """Reap ``worker_id``. Returns whether it is gone (False: try again on the next pass).
        An exception counts as reaped."""

    def _reap_worker_no_throw(self, worker_id: Any) -> bool:
        try:
            return self._reap_worker(worker_id)
        except Exception:
            log.exception("reaping worker %s raised: counted as reaped", worker_id)
            return True

    def _next_expiration(self) -> float | None:
        """The earliest armed expiration time, for the watchdog's wait (None: unknown)."""
        return None

    def _wait_time(self) -> float:
        """How long the watchdog may wait for requests: until the earliest timer expires, at
        most ``max_interval``."""
        wait = self._max_interval
        earliest = self._next_expiration()
        if earliest is not None:
            wait = min(wait, max(0.0, earliest - time.time()))
        return wait

    def _run_watchdog(self) -> None:
        """One pass: read what came (waiting at most ``_wait_time()``), reap the expired."""
        batch = max(1, self._request_queue.size())
        self.register_timers(self._request_queue.get(batch, self._wait_time()))
        reaped: set[Any] = set()
        for worker_id, expired in self.get_expired_timers(time.time()).items():
            scopes = [r.scope_id for r in expired]
            log.info("worker %s: timers %s expired: reaping it", worker_id, scopes)
            if self._reap_worker_no_throw(worker_id):
                reaped.add(worker_id)
            else:
                log.error("worker %s: could not reap it (timers %s): trying again on the next pass", worker_id, scopes)
        self.clear_timers(reaped)

    def _watchdog_loop(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._run_watchdog()
            except Exception:
                log.exception("%s: a watchdog pass failed", type(self).__name__)
                self._stop_event.wait(min(self._max_interval, _STOP_GRACE))  # (no busy loop)

    def _wake(self) -> None:
        """Wake the watchdog from its wait (``stop``); a queue that cannot be woken is left."""
        return

    def start(self) -> None:
        """Start the watchdog thread (returns at once)."""
        log.info("starting %s (max_interval=%s, daemon=%s)", type(self).__name__, self._max_interval, self._daemon)
        self._stop_event.clear()
        self._watchdog_thread = threading.Thread(
            target=self._watchdog_loop, name=f"tdist-{type(self).__name__}", daemon=self._daemon
        )
        self._watchdog_thread.start()

    def stop(self) -> None:
        """Stop the watchdog thread: it ends its pass, and is waited for a bounded time (its
        wait, at most ``max_interval``, when the queue cannot be woken)."""
        log.info("stopping %s", type(self).__name__)
        self._stop_event.set()
        thread, self._watchdog_thread = self._watchdog_thread, None
        if thread is None:
            return
        self._wake()
        thread.join(self._max_interval + _STOP_GRACE)
        if thread.is_alive():
            log.warning("%s: the watchdog thread did not stop within %g s", type(self).__name__, self._max_interval + _STOP_GRACE)


_timer_client: TimerClient | None = None


def configure(timer_client: TimerClient | None) -> None:
    """Set the client that ``expires`` uses when it is given none (None: unset it).

    Args:
        timer_client: the client.
    """
    global _timer_client
    _timer_client = timer_client
    log.info("timer client configured: %s", type(timer_client).__name__)


def expires(after: float, scope: str | None = None, client: TimerClient | None = None) -> contextlib.AbstractContextManager[None]:
    """A context manager that arms a countdown timer of ``after`` seconds for the block it wraps
    and disarms it when the block ends (also by an exception).

    Past the expiration the worker is eligible to be reaped; when (and how) is the timer
    server's call: a local server kills the worker's process on its next pass.

    Args:
        after: seconds from entering the block.
        scope: the timer's name (default: the caller's ``<file>#<line>``, so a recursive call
            re-arms the one timer of that line; torch means the same, though its default
            names the line of ``contextlib`` instead, one scope for every block).
        client: the client to use (default: the one given to ``configure``).

    Returns:
        The context manager.

    Raises:
        RuntimeError: on entering, no client was given or configured.
    """
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    return _expires(after, scope, client)


@contextlib.contextmanager
def _expires(after: float, scope: str, client: TimerClient | None) -> Iterator[None]:
    if client is None:
        if _timer_client is None:
            raise RuntimeError("Configure timer client before using countdown timers (tdist.elastic.timer.configure)")
        client = _timer_client
    client.acquire(scope, time.time() + after)
    try:
        yield
    finally:
        client.release(scope)
