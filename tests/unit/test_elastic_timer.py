"""``tdist.elastic.timer``: torch's expiration timers, with real worker processes killed by
real servers (a multiprocessing queue, a named pipe), and torch's own module beside ours: the
same tables from the same requests, the same wire format (torch's client reaches our server)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.elastic.timer as torch_timer

from tdist.elastic import timer

pytestmark = pytest.mark.timeout(60)

FORK = mp.get_context("fork")  # (the children run a few lines of this module)


class Recorder(timer.TimerClient):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id, None))


@pytest.fixture(autouse=True)
def _no_configured_client() -> Iterator[None]:
    timer.configure(None)
    yield
    timer.configure(None)


@pytest.fixture
def fifo(tmp_path: Path) -> str:
    return str(tmp_path / "timer.fifo")


# -- expires -------------------------------------------------------------------------------------
def test_expires_without_a_client_raises_runtime_error_as_torchs() -> None:
    with pytest.raises(RuntimeError, match="Configure timer client"):
        with timer.expires(after=1):
            pass
    torch_timer.configure(None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        with torch_timer.expires(after=1):
            pass


def test_expires_arms_then_releases_even_on_an_exception_and_names_the_callers_line() -> None:
    client = Recorder()
    timer.configure(client)
    before = time.time()
    with pytest.raises(ValueError, match="boom"):
        with timer.expires(after=5):
            line = sys._getframe().f_lineno - 1
            raise ValueError("boom")
    scope = f"{__file__}#{line}"
    (kind, armed, when), released = client.calls
    assert (kind, armed, released) == ("acquire", scope, ("release", scope, None))
    assert when is not None and before + 5 <= when <= time.time() + 5
    other = Recorder()
    with timer.expires(after=1, scope="step", client=other):  # (the given client, not the configured)
        pass
    assert [c[:2] for c in other.calls] == [("acquire", "step"), ("release", "step")] and len(client.calls) == 2


# -- the servers' tables, against torch's --------------------------------------------------------
def _requests(cls: Any, now: float) -> list[Any]:
    if cls in (timer.FileTimerRequest, torch_timer.FileTimerRequest):
        return [
            cls(11, "a", now - 5, signal.SIGKILL), cls(11, "b", now + 60, signal.SIGKILL), cls(12, "a", now - 1, 0),
            cls(13, "a", now - 9, signal.SIGTERM), cls(13, "a", -1), cls(14, "x", now - 2, signal.SIGKILL),
            cls(14, "x", now - 3, signal.SIGUSR1),  # (re-armed: the last acquire counts)
        ]
    return [cls(11, "a", now - 5), cls(11, "b", now + 60), cls(13, "a", now - 9), cls(13, "a", -1), cls(12, "z", now)]


def _table(expired: dict[Any, list[Any]]) -> dict[Any, list[tuple[Any, ...]]]:
    return {
        k: sorted((r.worker_id, r.scope_id, r.expiration_time, getattr(r, "signal", None)) for r in v)
        for k, v in expired.items()
    }


def test_the_local_servers_table_is_torchs() -> None:
    now = time.time()
    ours, theirs = timer.LocalTimerServer(FORK.Queue()), torch_timer.LocalTimerServer(FORK.Queue())
    ours.register_timers(_requests(timer.TimerRequest, now))
    theirs.register_timers(_requests(torch_timer.TimerRequest, now))
    for deadline in (now - 10, now - 5, now, now + 100):
        assert _table(ours.get_expired_timers(deadline)) == _table(theirs.get_expired_timers(deadline))
    ours.clear_timers({11})
    theirs.clear_timers({11})
    assert _table(ours.get_expired_timers(now + 100)) == _table(theirs.get_expired_timers(now + 100)) == {
        12: [(12, "z", now, None)]
    }


def test_the_file_servers_table_and_wire_format_are_torchs(tmp_path: Path) -> None:
    now = time.time()
    ours = timer.FileTimerServer(str(tmp_path / "ours"), "run")
    theirs = torch_timer.FileTimerServer(str(tmp_path / "theirs"), "run")
    try:
        ours.register_timers(_requests(timer.FileTimerRequest, now))
        theirs.register_timers(_requests(torch_timer.FileTimerRequest, now))
        assert ours._request_count == theirs._request_count == 7
        for deadline in (now - 10, now - 4, now, now + 100):
            assert _table(ours.get_expired_timers(deadline)) == _table(theirs.get_expired_timers(deadline))
        for mine, torchs in zip(_requests(timer.FileTimerRequest, now), _requests(torch_timer.FileTimerRequest, now), strict=True):
            assert mine.to_json() == torchs.to_json()
        assert timer.FileTimerRequest(5, "s", 1.5, 9) == timer.FileTimerRequest(5, "s", 1.5, 9) != timer.FileTimerRequest(5, "s", 1.5, 15)
    finally:
        ours.stop()
        theirs.stop()
    assert not os.path.exists(tmp_path / "ours")


# -- real workers --------------------------------------------------------------------------------
def _overrun(client: timer.TimerClient, after: float) -> None:
    timer.configure(client)
    with timer.expires(after=after):
        threading.Event().wait(30)  # (hangs: the server's kill ends it)


def _in_time(client: timer.TimerClient) -> None:
    timer.configure(client)
    for _ in range(3):
        with timer.expires(after=30):
            pass


def _overrun_with_torchs_client(path: str) -> None:
    torch_timer.configure(torch_timer.FileTimerClient(path))
    with torch_timer.expires(after=0.2, scope="torch's"):
        threading.Event().wait(30)


def _run(target: Any, *args: Any) -> int | None:
    p = FORK.Process(target=target, args=args)
    p.start()
    p.join(30)
    if p.exitcode is None:
        p.kill()
        p.join(5)
        raise AssertionError(f"{target.__name__} still ran after 30 s")
    return p.exitcode


def test_a_local_server_kills_the_worker_that_overruns_at_its_expiry_not_its_interval() -> None:
    q = FORK.Queue()
    server = timer.LocalTimerServer(q, max_interval=60)  # (it wakes for the expiry, not after 60 s)
    server.start()
    thread = server._watchdog_thread
    try:
        assert _run(_in_time, timer.LocalTimerClient(q)) == 0
        started = time.monotonic()
        assert _run(_overrun, timer.LocalTimerClient(q), 0.3) == -signal.SIGKILL
        assert time.monotonic() - started < 20
    finally:
        server.stop()  # (woken at once: the join does not wait out the 60 s)
    assert thread is not None and not thread.is_alive()


def test_a_file_server_kills_the_worker_that_overruns_and_removes_its_pipe(fifo: str) -> None:
    events: list[tuple[str, int | None]] = []
    server = timer.FileTimerServer(fifo, "run", max_interval=30, log_event=lambda n, r: events.append((n, r and r.worker_pid)))
    server.start()
    thread = server._watchdog_thread
    try:
        assert _run(_in_time, timer.FileTimerClient(fifo)) == 0
        assert _run(_overrun, timer.FileTimerClient(fifo), 0.2) == -signal.SIGKILL
    finally:
        server.stop()
    assert thread is not None and not thread.is_alive()
    assert not os.path.exists(fifo)
    names = [n for n, _ in events]
    assert names[0] == "watchdog started" and names[-1] == "watchdog stopped"
    assert names[1:-1] == ["timer expired", "kill worker process"]


def test_torchs_client_reaches_our_server(fifo: str) -> None:
    server = timer.FileTimerServer(fifo, "run", max_interval=30)
    server.start()
    try:
        assert _run(_overrun_with_torchs_client, fifo) == -signal.SIGKILL
    finally:
        server.stop()


def _wait_released(path: str, armed: Any, go: Any) -> None:
    client = timer.FileTimerClient(path, signal=0)  # (its timers expire without a kill)
    with timer.expires(after=0.1, scope="no-kill", client=client):
        armed.set()
        go.wait(30)


def test_a_timer_without_a_signal_expires_and_leaves_the_worker(fifo: str) -> None:
    expired = threading.Event()
    server = timer.FileTimerServer(fifo, "run", max_interval=30, log_event=lambda n, r: n == "timer expired" and expired.set())
    server.start()
    armed, go = FORK.Event(), FORK.Event()
    p = FORK.Process(target=_wait_released, args=(fifo, armed, go))
    p.start()
    try:
        assert expired.wait(20), "the timer never expired"
        assert p.is_alive() and not server._timers  # (dropped, not killed)
    finally:
        go.set()
        p.join(20)
        server.stop()
    assert p.exitcode == 0


def test_run_once_handles_every_request_written_and_forgets_the_timers_of_the_dead(fifo: str) -> None:
    server = timer.FileTimerServer(fifo, "run", max_interval=30)
    server.start()
    clients = [threading.Thread(target=_in_time, args=(timer.FileTimerClient(fifo),)) for _ in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(20)
    # a worker that armed a timer and exited without releasing it: no one to kill
    assert _run(_acquire_and_exit, fifo) == 0
    server.run_once()
    assert server._request_count == 4 * 3 * 2 + 1
    assert server._timers == {} and not os.path.exists(fifo)


def _acquire_and_exit(path: str) -> None:
    timer.FileTimerClient(path).acquire("left", time.time() + 60)


def test_a_client_without_a_server_fails_with_broken_pipe_in_bounded_time(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(BrokenPipeError, match="not available"):
        with timer.expires(after=1, client=timer.FileTimerClient(str(tmp_path / "none"))):
            pass
    (tmp_path / "plain").write_text("")
    with pytest.raises(BrokenPipeError, match="not a FIFO"):
        timer.FileTimerClient(str(tmp_path / "plain")).acquire("s", 1.0)
    assert time.monotonic() - started < 10
    with pytest.raises(BrokenPipeError):  # (torch's: the same error)
        with torch_timer.expires(after=1, client=torch_timer.FileTimerClient(str(tmp_path / "none"))):
            pass


def test_a_request_longer_than_pipe_buf_is_refused(fifo: str) -> None:
    server = timer.FileTimerServer(fifo, "run")
    try:
        with pytest.raises(RuntimeError, match="larger than"):
            timer.FileTimerClient(fifo).acquire("x" * 10000, time.time() + 5)
    finally:
        server.stop()


def test_a_server_replaces_a_stale_file_and_one_never_stopped_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "stale"
    path.write_text("old")
    code = (
        "import sys; from tdist.elastic import timer\n"
        f"s = timer.FileTimerServer({str(path)!r}, 'run', max_interval=30); s.start()\n"
        "import os, stat; print('fifo', stat.S_ISFIFO(os.stat(s._file_path).st_mode))\n"
        "timer.FileTimerClient(s._file_path).acquire('x', 1e12)\n"
        "raise RuntimeError('the agent crashed')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(timer.__file__).parents[3]), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert "the agent crashed" in res.stderr and res.returncode == 1 and "fifo True" in res.stdout
    assert not path.exists()  # (the pipe that replaced the stale file went with the process)
