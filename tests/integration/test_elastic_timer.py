"""``tdist run`` with torchrun's expiration timers (``TORCHELASTIC_ENABLE_FILE_TIMER=1``): real
launchers, real workers; a worker that overruns its ``expires`` block is killed by the
launcher's timer server and counts as a failed worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .._sync import read_line, wait_until

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import os, sys, threading
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print("timer file", os.environ.get("TORCHELASTIC_TIMER_FILE"), flush=True)
    if sys.argv[1] == "env":
        sys.exit(0)
    if sys.argv[1] == "wait":
        threading.Event().wait(60)
    from tdist.elastic import timer
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=30, scope="warm-up"):  # (in time: released)
        pass
    if rank == 0 and (sys.argv[1] == "overrun" or attempt == 0):
        with timer.expires(after=0.5, scope="step"):
            threading.Event().wait(60)  # (hangs: only the timer ends it)
    elif sys.argv[1] == "overrun":
        threading.Event().wait(60)  # (no timer: stopped by the launcher when rank 0 fails)
    print("done", flush=True)
    """
)


def _command(work: Path, *args: str, action: str, **extra: str) -> tuple[list[str], dict[str, str]]:
    (work / "worker.py").write_text(WORKER)
    (work / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "TDIST_"))}
    env.update(
        TMPDIR=str(work / "tmp"),  # (where the launcher makes up its pipe's path)
        TORCH_FR_DUMP_TEMP_FILE=str(work / "fr_"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    cmd = [sys.executable, "-m", "tdist.cli", "run", "--master-port", "0", "--stop-timeout", "5", *args, "worker.py", action]
    return cmd, env


def _tdist_run(work: Path, *args: str, action: str, **extra: str) -> subprocess.CompletedProcess[str]:
    cmd, env = _command(work, *args, action=action, **extra)
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=80)


def test_a_worker_that_overruns_its_timer_is_killed_and_reported_as_the_failure(tmp_path: Path) -> None:
    res = _tdist_run(tmp_path, "--nproc-per-node", "2", action="overrun", TORCHELASTIC_ENABLE_FILE_TIMER="1")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out  # (torchrun's for a failure; the report has the worker's SIGKILL)
    pipe = str(tmp_path / "tmp" / "watchdog_timer_")
    assert res.stdout.count(f"timer file {pipe}") == 2, res.stdout  # (each worker's)
    assert "worker rank 0" in res.stderr and "expiration timer 'step' expired" in res.stderr
    assert "killed it with SIGKILL" in res.stderr
    root = res.stderr.split("Root Cause", 1)[1]
    assert "rank      : 0" in root and "exitcode  : -9 (pid: " in root and "Signal 9 (SIGKILL)" in root and "'step'" in root
    # (rank 1, stopped by the launcher, is listed as torchrun lists it: its SIGTERM ended it)
    assert "rank      : 1 (local_rank: 1)" in res.stderr.split("Root Cause")[0], res.stderr
    assert "done" not in res.stdout
    assert not list((tmp_path / "tmp").glob("watchdog_timer_*"))  # (the pipe went with the run)


def test_a_timer_kill_restarts_the_group_on_the_given_pipe(tmp_path: Path) -> None:
    pipe = tmp_path / "timers.fifo"
    res = _tdist_run(
        tmp_path, "--nproc-per-node", "1", "--max-restarts", "1", action="once",
        TORCHELASTIC_ENABLE_FILE_TIMER="1", TORCHELASTIC_TIMER_FILE=str(pipe),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"timer file {pipe}") == 2  # (both attempts)
    assert "expiration timer 'step' expired" in res.stderr and "restarting the worker group" in res.stderr
    assert res.stdout.splitlines().count("done") == 1
    assert not pipe.exists()


def test_without_the_switch_no_timer_server_runs(tmp_path: Path) -> None:
    res = _tdist_run(tmp_path, "--nproc-per-node", "1", action="env")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "timer file None" in res.stdout.splitlines()
    assert not list((tmp_path / "tmp").glob("watchdog_timer_*"))


def test_kill_9_of_the_launcher_leaves_no_pipe(tmp_path: Path) -> None:
    # the pipe whose path the launcher made up goes with the rest of the job (its reaper's)
    cmd, env = _command(tmp_path, "--nproc-per-node", "1", action="wait", TORCHELASTIC_ENABLE_FILE_TIMER="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        assert read_line(proc.stdout, 60, "the worker's start").startswith("timer file ")
        (pipe,) = (tmp_path / "tmp").glob("watchdog_timer_*")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not pipe.exists(), 20, "the launcher's pipe to go")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
