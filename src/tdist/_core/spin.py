"""One spin policy for every tdist waiter whose answer is due within microseconds: a store client
waiting for its reply, the store server waiting for the next request, a rank waiting in the
shared-memory arena, a receive waiting on a shared-memory lane.

Theory of operation. Sleeping in the kernel and being woken costs a waiter 5-50 us and its
waker a system call; polling first catches an answer that a peer on another core gives within
microseconds, for the price of the poll. Polling costs where it takes a core from someone who
needs it, so the policy is, for a wait of budget ``SPIN`` seconds:

1. poll without yielding for the first half of ``SPIN``: a peer on another core answers then;
2. then poll with at most ``YIELDS`` ``sched_yield`` calls, for a peer that shares this core
   (more ranks than cores): each hands it the core at once;
3. then sleep in the kernel, whose wake-up preempts whatever else runs on the core.

Yields are few on purpose. On a busy host (a training job leaves every core busy; the
benchmarks' ``--busy`` mode runs one low-priority loop per core) a yield hands the core to
that other work for its whole time slice, up to milliseconds: a store client that yielded all
through its spin ran at a quarter of its idle speed there, and below torch's.

A waiter learns from where its answers land (``Budget``):

- answers that come only after its spin (it slept): after ``MISS_LIMIT`` in a row it sleeps at
  once for the next ``RETRY_AFTER`` waits, then tries again. Spinning that never catches only
  burns CPU the peer may need (a loaded machine, many clients of one server);
- answers that come only once it yielded: its peer shares its core, and polling without
  yielding only kept the peer from answering (the scheduler puts a waker and its wakee on one
  core where the other cores run other work). After ``MISS_LIMIT`` in a row it skips step 1 for
  the next ``RETRY_AFTER`` waits: it yields at once, which hands the peer the core.

The one knob is ``TDIST_SPIN_US``, the budget in microseconds (150; 0 turns polling off).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["MISS_LIMIT", "RETRY_AFTER", "SPIN", "YIELDS", "Budget"]

SPIN = float(os.environ.get("TDIST_SPIN_US", "150")) * 1e-6
YIELDS = 2
MISS_LIMIT = 8
RETRY_AFTER = 256


class Budget:
    """One waiter's spin budget, which adapts to where its answers land (see the module
    docstring): ``seconds()`` to poll in all, the first ``pure()`` of them without yielding.

    Not thread-safe: one per connection or waiter, used by the thread that waits.
    """

    __slots__ = ("late", "misses", "spin")

    def __init__(self, spin: float = SPIN) -> None:
        self.spin = spin
        self.misses = 0  # answers in a row that came after the spin
        self.late = 0  # answers in a row that came only after a yield

    def seconds(self) -> float:
        """How long to poll this time: the budget, or 0 while paused."""
        return self.spin if self.misses < MISS_LIMIT else 0.0

    def pure(self) -> float:
        """How much of it to poll without yielding: half, or none while the peer seems to
        share this core."""
        return self.spin * 0.5 if self.late < MISS_LIMIT else 0.0

    def caught(self, after_yield: bool = False) -> None:
        """The answer came while polling (``after_yield``: only once this waiter yielded)."""
        self.misses = 0
        if after_yield:
            self._late()
        elif self.late < MISS_LIMIT:
            self.late = 0

    def _late(self) -> None:
        self.late += 1
        if self.late >= MISS_LIMIT + RETRY_AFTER:
            self.late = 0

    def poll(self, check: Callable[[], bool]) -> bool:
        """Call ``check()`` by this policy until it is true (True) or the budget is spent
        (False), and learn from it. For waiters whose poll is a call anyway; the hot loops of
        the store and the arena inline the same steps."""
        total = self.seconds()
        if not total:  # (paused: this wait sleeps, and counts towards the next try)
            self.missed()
            return False
        pure = self.pure()
        clock = time.perf_counter
        start = clock()
        yields = 0
        while True:
            if check():
                self.caught(yields > 0)
                return True
            elapsed = clock() - start
            if elapsed >= total:
                self.missed()
                return False
            if elapsed >= pure and yields < YIELDS:
                yields += 1
                os.sched_yield()

    def missed(self) -> None:
        """The waiter went to sleep: the answer came after the spin (or there was none)."""
        if self.spin:
            self.misses += 1
            if self.misses >= MISS_LIMIT + RETRY_AFTER:
                self.misses = 0
