"""``QuickThread``: a thread whose start does not wait for it to run, and that otherwise behaves
as a started thread (join, is_alive, enumerate, a second start)."""

from __future__ import annotations

import sys
import threading

import pytest

from tdist._core.threads import QuickThread

pytestmark = pytest.mark.timeout(30)


def test_start_returns_before_the_thread_runs_and_join_waits_for_it() -> None:
    gate = threading.Event()
    ran: list[str] = []

    def body() -> None:
        gate.wait(10)
        ran.append(threading.current_thread().name)

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # (this thread keeps the interpreter lock until it blocks)
    try:
        t = QuickThread(body, "tdist-test-quick")
        t.start()
        running = vars(t)["_started"].is_set()  # (set by the new thread's first lines)
        alive = t.is_alive()
    finally:
        sys.setswitchinterval(old)
    assert not running and alive and t.daemon  # (threading.Thread.start returns with it set)
    assert vars(t)["_started"].wait(10) and t in threading.enumerate()
    t.join(0.05)  # (a join that times out: still alive)
    assert t.is_alive()
    gate.set()
    t.join(10)
    assert not t.is_alive() and ran == ["tdist-test-quick"]


def test_a_join_right_after_start_waits_for_the_thread_instead_of_raising() -> None:
    done = threading.Event()
    t = QuickThread(done.set, "tdist-test-join")
    t.start()
    t.join(10)  # (Thread.join raises "cannot join thread before it is started" where not started)
    assert done.is_set() and not t.is_alive()


def test_a_second_start_raises_as_threadings() -> None:
    t = QuickThread(lambda: None, "tdist-test-twice")
    t.start()
    with pytest.raises(RuntimeError, match="only be started once"):
        t.start()
    t.join(10)
    with pytest.raises(RuntimeError, match="only be started once"):
        t.start()


def test_arguments_reach_the_target() -> None:
    got: list[tuple[int, str]] = []
    t = QuickThread(lambda a, b: got.append((a, b)), "tdist-test-args", (1, "x"))
    t.start()
    t.join(10)
    assert got == [(1, "x")]


def test_a_child_forked_before_the_thread_ran_sees_it_stopped() -> None:
    import os

    gate = threading.Event()
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # (the thread cannot run before the fork: this one holds the lock)
    try:
        t = QuickThread(gate.wait, "tdist-test-fork", (10,))
        t.start()
        pid = os.fork()
        if pid == 0:  # (the child: no such thread here; is_alive and join must say so at once)
            code = 0 if not t.is_alive() else 1
            t.join(5)
            os._exit(code)
    finally:
        sys.setswitchinterval(old)
    gate.set()
    t.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
