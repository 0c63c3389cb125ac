"""Accepting connections when something floods the listener: out of file descriptors, or
more strangers than handshakes we are willing to hold open.

Two rules every listener of tdist follows (store server, process-group mesh, RPC):

* ``accept`` failing for want of descriptors (``EMFILE``, ``ENFILE``, ...) is an *episode*:
  one log line when it starts and one when it ends, and meanwhile the listener is not watched
  for a while (``Starvation.backoff``: 50 ms, doubling to 1 s), so a listener that stays
  readable (its backlog is full) does not spin a core. The caller sheds a connection that has
  not authenticated yet, which frees a descriptor for whoever comes next.
* The handshakes of accepted connections run side by side, each within a deadline, and at most
  ``limit`` at once (``transport._dial.Doorway``; the store server's own loop does the same):
  when one more comes, the oldest pending one is dropped, so silent or slow strangers cannot
  hold the door for others. Neither runs a thread per handshake. A peer of the job finishes its
  handshake in milliseconds.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

__all__ = ["Starvation"]

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
