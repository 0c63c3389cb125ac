"""A worker's handler of ``SIGUSR2`` (``tdist.elastic._inspect``): what it may do when a second
signal comes while it runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# A second SIGUSR2 raised at every call the handler makes, while it runs (as a burst of signals
# lands: the handler runs between two bytecodes of the main thread, and again inside itself).
# A handler that took a lock (an Event's) deadlocked the main thread there for good.
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    os.environ["TDIST_STATUS_DIR"] = sys.argv[1]
    from tdist.elastic import _inspect
    _inspect.worker_side()
    handler = signal.getsignal(signal.SIGUSR2)
    assert handler is _inspect._on_stacks_signal, handler
    nested = [0]

    def inside(frame, event, arg):
        f = frame
        while f is not None and f.f_code is not handler.__code__:
            f = f.f_back
        if f is not None and nested[0] < 50 and event in ("call", "c_call"):
            nested[0] += 1
            signal.raise_signal(signal.SIGUSR2)

    sys.setprofile(inside)
    signal.raise_signal(signal.SIGUSR2)
    for _ in range(100):  # (bytecodes: every signal pending is handled)
        pass
    sys.setprofile(None)
    print("handled", nested[0], flush=True)
    """
)


def test_a_signal_that_comes_while_the_handler_runs_does_not_deadlock_it(tmp_path: Path) -> None:
    (tmp_path / "status").mkdir()
    res = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "status")], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("handled ") and int(res.stdout.split()[1]) > 0, res.stdout


def test_the_steps_per_second_drop_while_no_step_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tdist status``'s steps/s: a rank that stops making progress shows it, where the rate
    of its last two steps stood for ever."""
    from tdist.elastic import _inspect

    clock = [100.0]
    monkeypatch.setattr(_inspect.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(_inspect, "_progress", [])
    _inspect.report_progress(10)
    clock[0] = 101.0
    _inspect.report_progress(20)
    assert _inspect._steps() == (20, 10.0)
    clock[0] = 101.5  # (sooner than the next step is due: the same rate)
    assert _inspect._steps() == (20, 10.0)
    clock[0] = 111.0  # (10 s without a step)
    assert _inspect._steps() == (20, 1.0)
