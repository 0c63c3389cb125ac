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

And one rule for what they say: a connection that fails (a stranger, a wrong secret, garbage)
is logged, but whoever can connect must not flood the log with them (``FailureLog``: a few one
by one, then a count).
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Callable

__all__ = ["FailureLog", "Starvation"]

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


class FailureLog:
    """Warnings about failed connections, bounded: logged one by one up to ``one_by_one`` in a
    span of ``span`` seconds, then counted; the count is said when the span has ended, at the
    next failure or ``flush`` (which the owner calls when ``due`` has come, and at its close).

    Not thread-safe: one per listener loop, or guarded by the caller.
    """

    def __init__(
        self, label: str, logger: logging.Logger, one_by_one: int = 5, span: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.one_by_one = one_by_one
        self.span = span
        self._log = logger
        self._clock = clock
        self._end = -math.inf  # the span the count is of
        self._said = 0
        self._muted = 0

    def warn(self, fmt: str, *args: object) -> None:
        now = self._clock()
        if now >= self._end:
            self.flush()
            self._end, self._said = now + self.span, 0
        self._said += 1
        if self._said <= self.one_by_one:
            self._log.warning(fmt, *args)
            if self._said == self.one_by_one:
                self._log.warning(
                    "%s: %d failed connections in a row; the next ones for %g s are counted, not logged one by one",
                    self.label, self.one_by_one, self._end - now,
                )
        else:
            self._muted += 1

    @property
    def due(self) -> float:
        """When ``flush`` has a count to say (``inf``: none)."""
        return self._end if self._muted else math.inf

    def flush(self) -> None:
        """Say how many failures were counted, if any."""
        if self._muted:
            self._log.warning("%s: %d more connections failed (not logged one by one)", self.label, self._muted)
            self._muted = 0
