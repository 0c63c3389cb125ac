"""``_core.floods.FailureLog``: failed connections are logged one by one, then counted, and the
count is said once its span has ended (a clock of the test's: no waiting)."""

from __future__ import annotations

import logging

import pytest

from tdist._core.floods import FailureLog

pytestmark = pytest.mark.timeout(30)


def test_a_few_one_by_one_then_a_count_said_after_the_span(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="test.failures")
    now = [100.0]
    failures = FailureLog("door", logging.getLogger("test.failures"), one_by_one=3, span=60.0, clock=lambda: now[0])
    for i in range(10):
        failures.warn("door: stranger %d", i)
    said = [r.getMessage() for r in caplog.records]
    assert said[:3] == ["door: stranger 0", "door: stranger 1", "door: stranger 2"]
    assert len(said) == 4 and "the next ones for 60 s are counted" in said[3]
    assert failures.due == 160.0
    now[0] = 130.0
    failures.warn("door: stranger %d", 10)  # (within the span: counted)
    assert len(caplog.records) == 4
    now[0] = 161.0  # the span is over: the next failure says the count, then is logged itself
    failures.warn("door: stranger %d", 11)
    said = [r.getMessage() for r in caplog.records]
    assert said[4:] == ["door: 8 more connections failed (not logged one by one)", "door: stranger 11"]
    assert failures.due == float("inf")  # (nothing counted in the new span)
    failures.flush()
    assert len(caplog.records) == 6


def test_flush_says_the_count_at_once_and_only_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="test.failures")
    failures = FailureLog("door", logging.getLogger("test.failures"), one_by_one=1, span=60.0, clock=lambda: 0.0)
    for _ in range(3):
        failures.warn("door: stranger")
    failures.flush()
    failures.flush()
    said = [r.getMessage() for r in caplog.records]
    assert said[-1] == "door: 2 more connections failed (not logged one by one)" and len(said) == 3
