"""Accepting connections when something floods the listener: out of file descriptors, or
more strangers than handshakes we are willing to hold open.

Two rules every listener of tdist follows (store server, process-group mesh, RPC):

* ``accept`` failing for want of descriptors (``EMFILE``, ``ENFILE``, ...) is an *episode*:
  one log line when it starts and one when it ends, and meanwhile the listener is not watched
  for a while (``Starvation.backoff``: 50 ms, doubling to 1 s), so a listener that stays
  readable (its backlog is full) does not spin a core. The caller sheds a connection that has
  not authenticated yet, which frees a descriptor for whoever comes next.
* The handshakes of accepted connections run side by side, each within a deadline, and at most
  ``limit`` at once (``Admission``): when one more comes, the oldest pending one is dropped, so
  silent or slow strangers cannot hold the door for others or fill the process with threads. A
  peer of the job finishes its handshake in milliseconds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["Admission", "Starvation"]

log = logging.getLogger(__name__)

# accept() failures that mean "no descriptor or memory for a new connection right now"
_STARVED = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


class Starvation:
    """One listener's episodes of running out of descriptors (see the module docstring). An
    episode ends after ``quiet`` seconds without a failure (a shed connection lets one accept
    through, then the next fails: that is still the same episode).

    Not thread-safe: one per listener loop, or guarded by the caller.
    """

    def __init__(self, label: str, quiet: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.quiet = quiet
        self.starved = False
        self.failures = 0
        self._clock = clock
        self._delay = 0.0
        self._last = 0.0

    def backoff(self, exc: OSError) -> float | None:
        """After ``accept`` raised ``exc``: seconds to leave the listener alone (logged once
        per episode), or None when ``exc`` is not about running out of descriptors."""
        if exc.errno not in _STARVED:
            return None
        self.failures += 1
        self._last = self._clock()
        if not self.starved:
            self.starved = True
            self._delay = 0.05
            log.warning(
                "%s: cannot accept connections: %s (out of descriptors); shedding connections "
                "that have not authenticated and retrying, quietly, until this ends",
                self.label, exc.strerror or exc,
            )
        else:
            self._delay = min(1.0, self._delay * 2)
        return self._delay

    def accepted(self) -> None:
        """An ``accept`` succeeded: an episode, if any, is over once failures stopped for
        ``quiet`` seconds."""
        if self.starved and self._clock() - self._last >= self.quiet:
            self.starved = False
            log.warning("%s: accepting connections again (%d attempts failed meanwhile)", self.label, self.failures)
            self.failures = 0


class Admission:
    """Runs the handshakes of accepted connections side by side (a thread each), at most
    ``limit`` at once: a new connection over the limit sheds the oldest pending one (its
    socket is shut down, which ends its handshake). ``run(sock, addr)`` does one handshake
    (with its own deadline) and registers the connection or closes it.
    """

    def __init__(
        self, label: str, run: Callable[[socket.socket, object], None], limit: int = 64, done: Callable[[], None] | None = None
    ) -> None:
        self.label = label
        self.limit = limit
        self._run = run
        self._done = done  # called after each handshake has ended and left the pending set
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, None] = OrderedDict()
        self._shed = 0
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    def admit(self, sock: socket.socket, addr: object) -> None:
        """Start ``sock``'s handshake (shedding the oldest pending one when over the limit)."""
        shed: socket.socket | None = None
        with self._lock:
            if self._closed:
                sock.close()
                return
            if len(self._pending) >= self.limit:
                shed, _ = self._pending.popitem(last=False)
                self._shed += 1
                if self._shed == 1:
                    log.warning(
                        "%s: more than %d connections are in their handshake at once; dropping "
                        "the oldest (said once per episode)", self.label, self.limit,
                    )
            self._pending[sock] = None
        if shed is not None:
            _drop(shed)
        threading.Thread(target=self._handshake, args=(sock, addr), name=f"{self.label}-admit", daemon=True).start()

    def _handshake(self, sock: socket.socket, addr: object) -> None:
        try:
            self._run(sock, addr)
        finally:
            with self._lock:
                self._pending.pop(sock, None)
                if not self._pending and self._shed:
                    log.warning("%s: handshakes back to normal (%d connections dropped)", self.label, self._shed)
                    self._shed = 0
            if self._done is not None:
                self._done()

    def keep(self, sock: socket.socket) -> None:
        """``sock``'s handshake succeeded: it is no longer pending (never shed or dropped by
        ``close``). Call it before the connection is published."""
        with self._lock:
            self._pending.pop(sock, None)

    def shed_one(self) -> bool:
        """Drop the oldest pending handshake (to free its descriptor); False if none."""
        with self._lock:
            if not self._pending:
                return False
            sock, _ = self._pending.popitem(last=False)
        _drop(sock)
        return True

    def close(self) -> None:
        """Drop every pending handshake (their threads end at once)."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
        for sock in pending:
            _drop(sock)


def _drop(sock: socket.socket) -> None:
    # shutdown, not close: the handshake's thread is blocked in recv on it and must wake up
    # (and close it itself); a close under it would let the descriptor be reused meanwhile
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
