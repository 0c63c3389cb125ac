"""The threads that run distributed autograd's backward passes (``autograd._context._Engine``),
in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

FORK = """
import os, threading
from tdist.autograd._context import _engine

release, started = threading.Event(), threading.Event()

def blocking():
    started.set()
    release.wait(30)

t = threading.Thread(target=_engine.submit, args=(blocking,))  # (runs where submitted)
t.start()
assert started.wait(30)
ran = threading.Event()
_engine.submit(ran.set)  # (a second pending pass: on a pass thread)
assert ran.wait(30)
pid = os.fork()
if pid == 0:
    done = threading.Event()
    _engine.submit(done.set)
    os._exit(0 if done.wait(10) else 1)
_, status = os.waitpid(pid, 0)
release.set()
t.join(30)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_its_passes() -> None:
    # (the child has none of its parent's pass threads; a pass still pending in the parent at
    # the fork left the child queueing its own passes for threads it does not have)
    out = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "child 0", out.stdout + out.stderr
