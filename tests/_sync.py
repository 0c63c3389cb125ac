"""Waiting in tests for what the code under test does, not for time to pass.

A test that needs "the other side has got there" waits for a condition it can observe, with a
deadline, and fails naming what never happened:

- ``wait_until(pred, timeout, what)``: poll a condition;
- ``inside(thread, name)``: the condition that ``thread`` is in a call of a function ``name``
  (its Python stack holds that frame): a reader blocked in ``get``, a rank blocked in a wait.
  Used where the code under test offers nothing else that shows it is waiting; it reads the
  thread's stack (``sys._current_frames``), so it sees only Python frames: to watch a call into
  C (torch's stores), call it from a small function of the test's own and watch that one;
- ``when_inside(name, fn)``: call ``fn`` on a new thread once the calling thread is inside
  ``name``: a writer that must come only while its reader waits; across processes, a watcher
  in the process that will block, which tells the test (a store key, a line of output).

A claim that something must *not* happen can only be watched for a while: those tests keep a
bounded window that ends early when the claim breaks (``holds_for(pred, window, what)``,
``Event.wait(window)``, ``Thread.join(window)``).

A test's processes are reaped, whatever happened, with ``join_or_kill(procs)``: each gets a
while to end on its own, then is killed.

A line that a test's subprocess prints is read with ``read_line(stream, timeout, what)``, not
``stream.readline()``, which blocks for good where the process hangs without a word (and
pytest-timeout then ends the whole xdist worker, with its tests still to run).
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any


def read_line(stream: IO[Any], timeout: float, what: str) -> str:
    """The next line of a subprocess's pipe ``stream`` (text or bytes), ``""`` at its end; fail
    naming ``what`` after ``timeout`` seconds. It reads the pipe's descriptor a byte at a time,
    so that nothing past the line leaves the pipe (a later ``communicate()`` gets the rest); so
    ``stream`` must not have been read through its own buffer before."""
    fd = stream.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"{what}: no line within {timeout:g} s (so far {bytes(line)!r})")
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace")


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll ``pred`` until it is true and return its value; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {timeout:g} s")
        time.sleep(interval)


def holds_for(pred: Callable[[], Any], seconds: float, what: str, interval: float = 0.01) -> None:
    """A claim that must not break: poll ``pred`` for ``seconds`` and fail naming ``what`` as
    soon as it is false (a window for a wrong change to show, ended early when one does)."""
    deadline = time.monotonic() + seconds
    while True:
        if not pred():
            raise AssertionError(f"{what}: no longer true")
        if time.monotonic() > deadline:
            return
        time.sleep(interval)


def inside(thread: threading.Thread | int, name: str, file: str = "") -> bool:
    """Whether ``thread`` (or the thread of that ident) is now in a call of a function called
    ``name`` (defined in a file whose path ends with ``file``, when given)."""
    ident = thread if isinstance(thread, int) else thread.ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and code.co_filename.endswith(file):
            return True
        frame = frame.f_back
    return False


def wait_inside(thread: threading.Thread | int, name: str, file: str = "", timeout: float = 20.0) -> None:
    """Until ``thread`` is in a call of ``name`` (see ``inside``); fails after ``timeout``."""
    where = f"{name} ({file})" if file else name
    wait_until(lambda: inside(thread, name, file), timeout, f"the thread never got inside {where}")


def when_inside(name: str, fn: Callable[[], object], file: str = "", timeout: float = 20.0) -> threading.Thread:
    """Call ``fn()`` on a new daemon thread once the calling thread is in a call of ``name``
    (see ``inside``); the caller joins the thread. When that does not happen within
    ``timeout`` seconds, ``fn`` is not called and the thread says why on stderr (the caller's
    own blocking call then fails at its deadline).

    A writer that must come only while its reader waits, or a process whose main thread is
    about to block telling the test (a store key, a line of output) that it waits now."""
    me = threading.get_ident()
    armed = threading.Event()  # (not before start() returned: it waits in threading.py itself)

    def watch() -> None:
        armed.wait()
        try:
            wait_inside(me, name, file, timeout)
        except AssertionError as exc:
            print(f"when_inside: {exc}", file=sys.stderr, flush=True)
            return
        fn()

    t = threading.Thread(target=watch, name=f"when-inside-{name}", daemon=True)
    t.start()
    armed.set()
    return t


def join_or_kill(procs: list[Any], wait: float = 10.0) -> None:
    """Let each of ``procs`` (``multiprocessing`` processes) end within ``wait`` seconds, and
    kill the ones that do not."""
    for p in procs:
        p.join(wait)
        if p.is_alive():
            p.kill()
            p.join(5)
