"""Timers over a ``multiprocessing`` queue: ``LocalTimerServer`` in the parent process,
``LocalTimerClient`` in the workers it started (the queue is passed to them), pids as worker
ids, and SIGKILL for a worker whose timer expired."""

from __future__ import annotations

import logging
import multiprocessing.queues
import os
import queue
import signal
import time
from typing import Any

from ._api import RequestQueue, TimerClient, TimerRequest, TimerServer

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]

log = logging.getLogger(__name__)

# seconds a client's put may wait for room in a bounded queue before it raises ``queue.Full``
_PUT_TIMEOUT = 30.0
_WAKE = None  # what ``LocalTimerServer.stop`` puts in the queue to end the watchdog's wait


class LocalTimerClient(TimerClient):
    """The client of a ``LocalTimerServer`` on this host: the worker is its process id.

    Args:
        mp_queue: the server's ``multiprocessing`` queue.
    """

    def __init__(self, mp_queue: multiprocessing.queues.Queue[Any]) -> None:
        super().__init__()
        self._mp_queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm the timer ``scope_id`` of this process.

        Raises:
            queue.Full: a bounded queue had no room for ``_PUT_TIMEOUT`` seconds.
        """
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, expiration_time), timeout=_PUT_TIMEOUT)

    def release(self, scope_id: str) -> None:
        """Disarm the timer ``scope_id`` of this process.

        Raises:
            queue.Full: a bounded queue had no room for ``_PUT_TIMEOUT`` seconds.
        """
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, -1), timeout=_PUT_TIMEOUT)


class MultiprocessingRequestQueue(RequestQueue):
    """A ``RequestQueue`` over a ``multiprocessing`` queue (a ``None`` in it only wakes the
    reader)."""

    def __init__(self, mp_queue: multiprocessing.queues.Queue[Any]) -> None:
        super().__init__()
        self._mp_queue = mp_queue

    def size(self) -> int:
        return self._mp_queue.qsize()

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to ``size`` requests, waiting at most ``timeout`` seconds in all (a wake-up ends
        the wait with what came so far)."""
        deadline = time.monotonic() + timeout
        requests: list[TimerRequest] = []
        while len(requests) < size:
            remaining = deadline - time.monotonic()
            try:
                item = self._mp_queue.get(timeout=remaining) if remaining > 0 else self._mp_queue.get_nowait()
            except queue.Empty:
                break
            if item is _WAKE:
                break
            requests.append(item)
        return requests


class LocalTimerServer(TimerServer):
    """The server of ``LocalTimerClient``s: the workers are processes of this host (usually its
    children); one whose timer expires is killed with SIGKILL.

    Args:
        mp_queue: the queue the clients write to.
        max_interval: the most seconds between two looks at the timers.
        daemon: whether the watchdog thread is a daemon thread.
    """

    def __init__(self, mp_queue: multiprocessing.queues.Queue[Any], max_interval: float = 60, daemon: bool = True) -> None:
        super().__init__(MultiprocessingRequestQueue(mp_queue), max_interval, daemon)
        self._mp_queue = mp_queue
        self._timers: dict[tuple[Any, str], TimerRequest] = {}

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        for request in timer_requests:
            key = (request.worker_id, request.scope_id)
            if request.expiration_time < 0:
                self._timers.pop(key, None)
            else:
                self._timers[key] = request

    def clear_timers(self, worker_ids: set[Any]) -> None:
        for key in [k for k in self._timers if k[0] in worker_ids]:
            del self._timers[key]

    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        expired: dict[Any, list[TimerRequest]] = {}
        for request in self._timers.values():
            if request.expiration_time <= deadline:
                expired.setdefault(request.worker_id, []).append(request)
        return expired

    def _next_expiration(self) -> float | None:
        return min((r.expiration_time for r in self._timers.values()), default=None)

    def _reap_worker(self, worker_id: Any) -> bool:
        try:
            os.kill(worker_id, signal.SIGKILL)
        except ProcessLookupError:
            log.info("worker pid %s is gone already", worker_id)
        except Exception:
            log.exception("could not kill worker pid %s", worker_id)
            return False
        return True

    def _wake(self) -> None:
        try:
            self._mp_queue.put_nowait(_WAKE)
        except (queue.Full, ValueError, OSError):  # (full: the watchdog wakes anyway; closed)
            pass
