"""The one spin policy's budget (``_core.spin.Budget``): where answers land decides how it polls."""

from __future__ import annotations

from tdist._core import spin
from tdist._core.spin import RETRY_AFTER, WINDOW, Budget


def test_polls_half_without_yielding_while_answers_come_early() -> None:
    b = Budget(100e-6)
    for _ in range(3 * WINDOW):
        b.caught()
    assert b.seconds() == 100e-6 and b.pure() == 50e-6
    for _ in range(WINDOW // 2):
        b.caught(after_yield=True)  # (half the window after a yield: it still polls first)
    assert b.pure() == 50e-6


def test_a_run_of_misses_pauses_spinning_then_it_tries_again() -> None:
    b = Budget(100e-6)
    for _ in range(WINDOW - 1):
        b.missed()
    b.caught()  # (a catch ends the run)
    for _ in range(WINDOW - 1):
        b.missed()
    assert b.seconds() == 100e-6
    b.missed()
    assert b.seconds() == 0.0 and b.pure() == 0.0  # (a waiter that asks pure() first sleeps too)
    for _ in range(RETRY_AFTER - 1):
        b.missed()  # (every wait while paused sleeps at once)
    assert b.seconds() == 0.0
    b.missed()
    assert b.seconds() == 100e-6


def test_a_slow_wait_that_slept_while_paused_tells_nothing_a_quick_one_counts() -> None:
    b = Budget(100e-6)
    for _ in range(WINDOW):
        b.missed()
    assert b.seconds() == 0.0
    for _ in range(RETRY_AFTER - 1):
        b.ended(1e-3)  # (a sleeper's wake-up may have made it late: no evidence either way)
    assert b.seconds() == 0.0 and b.paused == RETRY_AFTER - 1
    b.ended(20e-6)  # a wait that slept but took less than the budget: polling would have caught it
    assert b.seconds() == 100e-6 and b.misses == 0 and b.paused == 0
    for _ in range(WINDOW):
        b.missed()
    assert b.seconds() == 0.0
    for _ in range(RETRY_AFTER):
        b.ended(1e-3)
    assert b.seconds() == 100e-6 and b.misses == 0  # (after RETRY_AFTER of them: tried again)


def test_answers_that_come_mostly_after_a_yield_make_it_yield_at_once() -> None:
    b = Budget(100e-6)
    for _ in range(WINDOW // 2):
        b.caught(after_yield=True)
    assert b.pure() == 50e-6  # (half of the window: not yet)
    b.caught()  # an early answer now and then (the scheduler's tick let the peer run)...
    b.caught(after_yield=True)
    assert b.pure() == 0.0 and b.seconds() == 100e-6  # ...does not keep it from learning
    for _ in range(RETRY_AFTER - 2):
        b.caught(after_yield=True)  # (no early answer is possible then: it keeps yielding at once...)
    assert b.pure() == 0.0
    b.caught(after_yield=True)
    assert b.pure() == 50e-6  # (...until it tries polling first again)


def test_no_budget_never_counts() -> None:
    b = Budget(0.0)
    for _ in range(2 * WINDOW):
        b.missed()
        b.ended(1e-6)
    assert b.seconds() == 0.0 and b.misses == 0 and b.paused == 0
    assert spin.YIELDS >= 1


def test_poll_calls_until_true_and_learns_a_miss_when_the_budget_runs_out() -> None:
    b = Budget(200e-6)
    calls = iter([False, False, True])
    assert b.poll(lambda: next(calls)) and b.misses == 0
    assert not b.poll(lambda: False) and b.misses == 1
    paused = Budget(0.0)  # (no budget: it does not poll at all)
    assert not paused.poll(lambda: True)
