"""A thread whose ``start()`` does not wait for it to run.

``threading.Thread.start`` waits until the new thread has run its first lines (it sets the
thread's "started" event), and the new thread first needs the interpreter lock, which the
caller holds until it waits, then runs on until it blocks: the caller gets the lock back only
then. On this project's 2-core virtual machine that wait took 130-700 us a thread (the new thread
starting alone took 20-50 us): the store server's thread and a group's reader thread, started
while a group forms, cost that on the path every rank waits on.

``QuickThread.start`` returns once the thread exists; the thread runs when the caller lets go of
the interpreter lock, which it does in its next wait (for the store's or the peers' replies),
where the new thread's first lines cost no one anything. ``join`` and ``is_alive`` behave as for a
thread that started: ``join`` first waits for the start (within its timeout), and a thread
launched but not yet running is alive.

Built on CPython's own ``Thread.start`` of 3.11 and 3.12 (the same steps, without the last wait:
the thread is registered as starting in ``threading._limbo``, as ``threading.enumerate`` and a
fork expect). Where those internals differ (3.13 starts a thread through a handle), ``start`` is
``Thread.start``: slower, never wrong.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_limbo: dict[threading.Thread, threading.Thread] | None = getattr(threading, "_limbo", None)
_limbo_lock: Any = getattr(threading, "_active_limbo_lock", None)
_start_new_thread: Any = getattr(threading, "_start_new_thread", None)
_QUICK = (
    _limbo is not None
    and _limbo_lock is not None
    and _start_new_thread is not None
    and not hasattr(threading, "_start_joinable_thread")  # (3.13: threads start through handles)
)
_bootstrap: Any = vars(threading.Thread).get("_bootstrap")  # (runs the thread, as ``start`` has it run)


class QuickThread(threading.Thread):
    """A daemon thread whose ``start()`` returns without waiting for it to run (see above)."""

    def __init__(self, target: Any, name: str, args: tuple[Any, ...] = ()) -> None:
        super().__init__(target=target, name=name, args=args, daemon=True)
        self._launched = False
        started = vars(self).get("_started")  # (set by the thread as it begins, in ``_bootstrap``)
        self._running: threading.Event | None = started if isinstance(started, threading.Event) else None

    def start(self) -> None:
        if self._launched:
            raise RuntimeError("threads can only be started once")
        if not _QUICK or _bootstrap is None or self._running is None:
            super().start()
            return
        assert _limbo is not None and _start_new_thread is not None
        with _limbo_lock:
            _limbo[self] = self
        try:
            _start_new_thread(_bootstrap, (self,))
        except Exception:
            with _limbo_lock:
                del _limbo[self]
            raise
        self._launched = True

    def _unrun(self) -> bool:
        """Launched, its first line not run."""
        return self._launched and self._running is not None and not self._running.is_set()

    def _starting(self) -> bool:
        """Launched, its first line still to run (not in a child forked meanwhile, where it
        never will: threading stops there the threads that the fork did not copy)."""
        return self._unrun() and not vars(self).get("_is_stopped", False)

    def join(self, timeout: float | None = None) -> None:
        if self._unrun() and not self._starting():
            return  # (a forked child's copy: no such thread here)
        if self._starting():
            assert self._running is not None
            start = time.monotonic()
            if not self._running.wait(timeout):
                return  # (not running yet at the timeout: as a join that timed out)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        super().join(timeout)

    def is_alive(self) -> bool:
        return self._starting() or super().is_alive()
