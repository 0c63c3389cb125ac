"""One spin policy for every tdist waiter whose answer is due within microseconds: a store client
waiting for its reply, the store server waiting for the next request, a rank waiting in the
shared-memory arena, a receive waiting on a shared-memory lane, an RPC caller waiting for its
reply, an RPC poller waiting for a caller's next request.

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

- answers that come after its spin (it slept): after ``WINDOW`` in a row it sleeps at once, and
  tries again after ``RETRY_AFTER`` waits. Spinning that never catches only burns CPU the peer
  may need (a loaded machine, many clients of one server). A wait that slept but ended within
  the budget counts as a catch (``ended``), so a waiter comes back to polling as soon as its
  answers are quick again; one that ended after it says no more than that it slept (a sleeper's
  wake-up, 5-200 us on a loaded VM, may have made a quick answer late: counting those as
  evidence kept both sides of an RPC asleep, each making the other late). Where answers of
  different kinds come to one place, a budget per kind learns better: RPC keeps one per callee
  and function (a parameter server's forward and backward compute for long, its optimizer's
  step does not);
- answers that come only once it yielded: its peer shares its core, and polling without
  yielding only kept the peer from answering (the scheduler puts a waker and its wakee on one
  core where the other cores run other work: a socket's wake-up is a "sync" one, which places
  the wakee on the waker's core). While more than half of its last ``WINDOW`` catches came only
  after a yield, it skips step 1: it yields at once, which hands the peer the core; after
  ``RETRY_AFTER`` such waits it tries polling first again. (A run of such catches in a row was
  the rule before: the scheduler's tick now and then let the peer answer during step 1, which
  broke the run, and a store client sharing its server's core took its first 3,000 requests at
  11k/s, against 60k/s once it had learnt.)

The one knob is ``TDIST_SPIN_US``, the budget in microseconds (150; 0 turns polling off).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["RETRY_AFTER", "SPIN", "WINDOW", "YIELDS", "Budget"]

SPIN = float(os.environ.get("TDIST_SPIN_US", "150")) * 1e-6
YIELDS = 2
WINDOW = 8  # misses in a row that pause spinning; the catches whose majority says "yield at once"
RETRY_AFTER = 256
_FULL = (1 << WINDOW) - 1  # (the window of catches)


class Budget:
    """One waiter's spin budget, which adapts to where its answers land (see the module
    docstring): ``seconds()`` to poll in all, the first ``pure()`` of them without yielding.

    Its updates are not atomic: where several threads wait by one budget (an RPC call site),
    an outcome may be lost now and then, which only blurs what it learns.
    """

    __slots__ = ("misses", "paused", "shared", "spin", "yielded")

    def __init__(self, spin: float = SPIN) -> None:
        self.spin = spin
        self.misses = 0  # waits in a row that ended after the budget (WINDOW: paused)
        self.paused = 0  # waits since spinning paused that could not tell how long they took
        self.yielded = 0  # the last WINDOW catches, newest in bit 0: 1 where it came only after a yield
        self.shared = 0  # waits since it took its peer to share its core (it yields at once)

    def seconds(self) -> float:
        """How long to poll this time: the budget, or 0 while paused."""
        return self.spin if self.misses < WINDOW else 0.0

    def pure(self) -> float:
        """How much of it to poll without yielding: half, or none while the peer seems to
        share this core or while spinning is paused (a waiter that tests ``pure()`` before
        ``seconds()``, as the store server's loop does, polled through a pause before)."""
        if self.misses >= WINDOW or self.yielded.bit_count() > WINDOW // 2:
            return 0.0
        return self.spin * 0.5

    def caught(self, after_yield: bool = False) -> None:
        """The answer came while polling (``after_yield``: only once this waiter yielded)."""
        self._outcome(False)
        self.yielded = ((self.yielded << 1) | after_yield) & _FULL
        if self.yielded.bit_count() > WINDOW // 2:  # yielding at once: now and then try polling first
            self.shared += 1
            if self.shared >= RETRY_AFTER:
                self.yielded = 0
                self.shared = 0
        else:
            self.shared = 0

    def ended(self, seconds: float) -> None:
        """A wait that slept took ``seconds`` in all: within the budget it counts as a catch
        (polling would have caught it); after it, as ``missed`` (a sleeper's wake-up may have
        made a quick answer late, so a paused budget cannot learn from it)."""
        if self.spin and seconds <= self.spin:
            self._outcome(False)
        else:
            self.missed()

    def missed(self) -> None:
        """The waiter went to sleep, and cannot tell how long the answer then took."""
        if not self.spin:
            return
        if self.misses >= WINDOW:  # paused already: try again after a while
            self.paused += 1
            if self.paused >= RETRY_AFTER:
                self.misses = self.paused = 0
            return
        self.misses += 1

    def _outcome(self, miss: bool) -> None:
        self.misses = self.misses + 1 if miss else 0
        self.paused = 0

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
