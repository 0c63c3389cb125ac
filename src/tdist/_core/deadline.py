"""Timeouts as one concept: user-facing timeouts in, absolute monotonic deadlines inside."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

__all__ = ["Clock", "Deadline", "to_seconds"]

Clock = Callable[[], float]


#: the longest timeout, in seconds (about 31 years): a longer one (``timedelta.max``) is this,
#: which the clock, ``poll`` and ``settimeout`` all take
FOREVER = 1e9


def to_seconds(timeout: timedelta | float | int | None, default: float | None = None) -> float | None:
    """Turn a user timeout (timedelta or seconds) into seconds, at most ``FOREVER``; ``None``
    gives ``default``.

    Raises:
        TypeError: for anything else.
        ValueError: for a negative timeout.
    """
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}")
    if seconds < 0:
        raise ValueError(f"timeout must not be negative, got {seconds} s")
    return min(seconds, FOREVER)


class Deadline:
    """An absolute point on the monotonic clock; ``None`` seconds means never."""

    __slots__ = ("_at", "_clock", "seconds")

    def __init__(self, seconds: float | None, clock: Clock = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._at = None if seconds is None else clock() + seconds

    @property
    def at(self) -> float | None:
        return self._at

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        if self._at is None:
            return None
        return max(0.0, self._at - self._clock())

    def expired(self) -> bool:
        return self._at is not None and self._clock() >= self._at
