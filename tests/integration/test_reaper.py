"""kill -9 of a launcher (``tdist run``, a program that called ``start_processes``) takes along
what its workers started themselves, not only the workers: the job reaper
(``tdist._core._reaper``). Every process of a test carries a marker in its command line, so
that a survivor is found in ``/proc`` whoever its parent is now."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .._sync import read_line, wait_until

pytestmark = pytest.mark.timeout(60)

_GONE_WITHIN = 10.0  # seconds the job's processes may take to go after the kill

# A worker that starts what outlives a parent-death signal: a subprocess, a forked child that
# ignores its parent and SIGTERM/SIGHUP, one in a session of its own, one without the
# environment; then "ready" on stdout, and it waits.
WORKER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    mark = sys.argv[1]
    sleeper = [sys.executable, "-c", "import signal; signal.pause()", mark]
    subprocess.Popen(sleeper, stdout=subprocess.DEVNULL)
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.pause()
        os._exit(0)
    subprocess.Popen(sleeper, stdout=subprocess.DEVNULL, start_new_session=True)
    subprocess.Popen(sleeper, stdout=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "")})
    # (one write: under python -u, print writes "ready" and its newline apart, and two workers'
    # lines on one pipe came out as "readyready\\n\\n", one line)
    if len(sys.argv) > 2 and sys.argv[2] == "exit":
        os.write(1, b"ready\\n")
        sys.exit(0)
    os.write(1, b"ready\\n")
    signal.pause()
    """
)

# A program that runs the worker through start_processes, says its pid, and waits.
STARTER = textwrap.dedent(
    """
    import os, signal, sys
    from tdist.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    worker, mark, logs = sys.argv[1:4]
    ctx = start_processes("w", sys.executable, {0: ("-u", worker, mark), 1: ("-u", worker, mark)},
                          {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=logs, tee=Std.OUT))
    ctx.wait(60)
    """
)

# A program whose ranks (tdist.testing.run_processes) say "ready" and wait.
RANKS = textwrap.dedent(
    """
    import os, signal, sys
    from tdist.testing import run_processes

    def body(rank, world_size, mark):
        os.write(1, f"ready {os.getpid()}\\n".encode())  # (one write: see WORKER)
        signal.pause()

    if __name__ == "__main__":
        run_processes(body, 2, sys.argv[1], start_method=sys.argv[2], timeout=120)
    """
)


def _marked(mark: str) -> list[int]:
    """The pids of the processes whose command line holds ``mark`` (zombies left out)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if mark.encode() in cmdline and stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X"):
            found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def _reapers_of(pid: int) -> list[int]:
    """The reapers (running) whose parent was process ``pid``."""
    return _marked(f"_reaper.py\0{pid}\0")


def _all_gone(find: Callable[[], list[int]], within: float = _GONE_WITHIN) -> list[int]:
    """Wait until ``find()`` finds nothing; what it still finds after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = find()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def mark(tmp_path: Path) -> Iterator[str]:
    m = f"reaper-test-{uuid.uuid4().hex}"
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "starter.py").write_text(STARTER)
    (tmp_path / "ranks.py").write_text(RANKS)
    yield m
    for pid in _marked(m):  # (whatever a failed test left)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("TDIST_SECRET", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TDIST_JOB_TOKENS"):
        env.pop(var, None)
    return env


def _start_launcher(tmp_path: Path, mark: str, *args: str) -> subprocess.Popen[str]:
    """``tdist run`` of two workers, with a temporary directory of its own (``tmp_path/tmp``)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "tdist.cli", "run", "--nproc-per-node", "2", "--master-port", "0",
         "worker.py", mark, *args],
        cwd=tmp_path, env={**_env(), "TMPDIR": str(tmp_path / "tmp")}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def _files_left(tmp: Path) -> list[str]:
    """What is in the temporary directory ``tmp``, but for the host's job registry directory."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not p.name.startswith("tdist-jobs-"))


def _wait_ready(proc: subprocess.Popen[str], n: int = 2, within: float = 30.0) -> list[str]:
    """Read ``proc``'s output until ``n`` lines said "ready" (within ``within`` seconds: else
    fail, saying where its processes are, not hang to the test's timeout); those lines."""
    assert proc.stdout is not None
    deadline = time.monotonic() + within
    seen: list[str] = []
    while len(seen) < n:
        try:
            line = read_line(proc.stdout, max(0.0, deadline - time.monotonic()), f"{n} processes' ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; ready: {seen}; the launcher's processes:\n{_where(proc.pid)}") from None
        assert line, f"the launcher ended before its workers were ready: {proc.wait()} {proc.stderr and proc.stderr.read()}"
        if "ready" in line:
            seen.append(line)
    return seen


def _where(pid: int) -> str:
    """Process ``pid`` and its descendants: pid, state, the kernel function each waits in and
    its command line."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,wchan:32=,args="], capture_output=True, text=True, timeout=10)
    rows = [line.split(None, 4) for line in out.stdout.splitlines()]
    family, found = {pid}, True
    while found:
        found = False
        for row in rows:
            if len(row) == 5 and int(row[1]) in family and int(row[0]) not in family:
                family.add(int(row[0]))
                found = True
    return "\n".join(" ".join(row)[:300] for row in rows if len(row) == 5 and int(row[0]) in family)


def _kill_9_and_find_nothing_left(proc: subprocess.Popen[str], mark: str, whom: str) -> None:
    """SIGKILL ``proc``; then no process of its job (``mark``) and no reaper of it may be left."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=20)
    left = _all_gone(lambda: _marked(mark))
    assert not left, f"processes of the job outlived the kill -9 of {whom}: {left}"
    assert not _all_gone(lambda: _reapers_of(proc.pid)), "the reaper outlived its work"


def test_kill_9_of_tdist_run_takes_what_the_workers_started(tmp_path: Path, mark: str) -> None:
    proc = _start_launcher(tmp_path, mark)
    try:
        _wait_ready(proc)
        # the two workers, each with its four
        # (a child's descendants may still be starting when it says it is ready)
        wait_until(lambda: len(set(_marked(mark)) - {proc.pid}) == 10, 20, "the workers' ten descendants run")
        reapers = _reapers_of(proc.pid)
        assert len(reapers) == 1
        assert _files_left(tmp_path / "tmp"), "the launcher made no run directory"
        _kill_9_and_find_nothing_left(proc, mark, "its launcher")
        # nor any file: its run directory, its entry in the registry of jobs (the registry's
        # own directory stays, as /tmp)
        assert _files_left(tmp_path / "tmp") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_kill_9_of_a_start_processes_caller_takes_what_its_children_started(tmp_path: Path, mark: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", "starter.py", str(tmp_path / "worker.py"), mark, str(tmp_path / "logs")],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_ready(proc)
        # (a child's descendants may still be starting when it says it is ready)
        wait_until(lambda: len(set(_marked(mark)) - {proc.pid}) == 10, 20, "the workers' ten descendants run")
        _kill_9_and_find_nothing_left(proc, mark, "start_processes' caller")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("end", ["exit", "sigterm"])
def test_an_orderly_end_leaves_no_reaper(tmp_path: Path, mark: str, end: str) -> None:
    # a job that ends (its workers exit 0), or a launcher stopped by SIGTERM, ends as before,
    # and its reaper exits with it (it touches nothing then)
    proc = _start_launcher(tmp_path, mark, *(["exit"] if end == "exit" else []))
    try:
        _wait_ready(proc)
        reapers = _reapers_of(proc.pid)
        assert len(reapers) == 1
        if end == "sigterm":
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == (0 if end == "exit" else 1), err  # (torchrun's 1 after a signal)
        assert not _all_gone(lambda: _reapers_of(proc.pid)), "the reaper outlived its launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_kill_9_of_a_run_processes_caller_takes_its_ranks(tmp_path: Path, mark: str, start_method: str) -> None:
    # (pytest-timeout's thread method ends a test's process with os._exit: its ranks go with it;
    # TMPDIR: Python's forkserver leaves its socket's directory, pymp-*, when its caller is killed)
    proc = subprocess.Popen(
        [sys.executable, "-u", "ranks.py", mark, start_method],
        cwd=tmp_path, env={**_env(), "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ranks: list[int] = []
    try:
        ranks = [int(line.split()[-1]) for line in _wait_ready(proc)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=20)  # (also: nothing holds its stdout any more)
        left = _all_gone(lambda: [p for p in ranks if _alive(p)])
        assert not left, f"ranks outlived the kill -9 of run_processes' caller: {left}"
    except BaseException:
        for p in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
