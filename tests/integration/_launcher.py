"""What the launcher's tests share: the worker script whose arguments say what it does, the
test's folder with it (``work``), and ``tdist run`` as a subprocess with the test's
environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "store_demo.py"

# One worker script for every test; what it does is chosen by its arguments.
WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    action = sys.argv[1]
    rank = int(os.environ["RANK"])
    out = os.environ["TEST_OUT"]
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))

    def wait_for(ready, within=20):
        end = time.monotonic() + within
        while not ready() and time.monotonic() < end:
            time.sleep(0.01)

    def mark(name):
        open(os.path.join(out, name), "w").close()

    def marked(name):
        return lambda: os.path.exists(os.path.join(out, name))

    def stopped(rank):  # (its process state: T, stopped by a signal)
        try:
            with open(os.path.join(out, f"pid{rank}")) as f:
                pid = int(f.read())
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, ValueError):
            return False
    if action == "env":
        keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
                "TDIST_SECRET", "TORCHELASTIC_ERROR_FILE", "TDIST_AGENT_STORE"]
        with open(os.path.join(out, f"env{rank}.json"), "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
        with open(f"/proc/{os.getppid()}/maps") as f:  # the launcher's memory map
            launcher_maps = f.read()
        with open(os.path.join(out, f"launcher_has_torch{rank}"), "w") as f:
            f.write(str("libtorch" in launcher_maps))
        print(f"out from {rank}")
        print(f"err from {rank}", file=sys.stderr)
    elif action == "fail":  # rank 1 raises (exit code 1) once the others said something and hang
        if rank == 1:
            others = [os.path.join(out, f"said{r}") for r in range(int(os.environ["WORLD_SIZE"])) if r != 1]
            end = time.monotonic() + 10
            while not all(map(os.path.exists, others)) and time.monotonic() < end:
                time.sleep(0.05)
            raise ValueError("rank 1 gives up")
        print(f"rank {rank} step 7", flush=True)
        print(f"rank {rank} waiting for rank 1", file=sys.stderr, flush=True)
        open(os.path.join(out, f"said{rank}"), "w").close()
        time.sleep(60)
    elif action == "dump":  # rank 0 dumps a flight record and hangs, rank 1 fails then
        if rank == 0:
            from tdist.c10d._flight_recorder import dump_prefix  # (where tdist's recorder writes)

            with open(dump_prefix() + "0", "wb") as f:
                f.write(b"record")
            mark("dumped0")
            time.sleep(60)
        wait_for(marked("dumped0"))
        sys.exit(3)
    elif action == "kill":  # rank 0 dies of SIGKILL, the others hang
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    elif action == "stubborn":  # rank 0 fails once rank 1 ignores SIGTERM
        if rank == 0:
            wait_for(marked("ignoring1"))
            sys.exit(5)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        mark("ignoring1")
        time.sleep(60)
    elif action == "hang":
        print(f"rank {rank} ready", flush=True)
        time.sleep(60)
    elif action == "interrupt":  # what a worker's Ctrl-C handler sees
        try:
            print(f"rank {rank} ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            mark(f"interrupted{rank}")
    elif action == "prefixed":  # a line that says its rank already (torch's traceback hook)
        print(f"[rank{rank}]: said by torch")
        print("plain")
    elif action == "id":
        print(f"rank {rank} of {os.environ['WORLD_SIZE']} in {os.environ['TORCHELASTIC_RUN_ID']}")
    elif action == "snapshot":  # rank 0 waits in a function of its own; rank 1 fails
        import tdist  # (its status thread)
        if rank == 0:
            def own_handler(signum, frame):  # (a scheduler's "save and requeue" hook, say)
                with open(os.path.join(out, "signals0"), "a") as f:
                    f.write(signal.Signals(signum).name + "\\n")
            for sig in (signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, own_handler)

            def waiting_in_rank_zero():
                open(os.path.join(out, "ready0"), "w").close()
                time.sleep(60)
            waiting_in_rank_zero()
        end = time.monotonic() + 20
        while not os.path.exists(os.path.join(out, "ready0")) and time.monotonic() < end:
            time.sleep(0.02)
        sys.exit(4)
    elif action == "snapshot_once":  # as "snapshot" in the first attempt; the second succeeds
        import tdist  # (its handlers of SIGUSR1 and SIGUSR2)
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if rank == 0:
                open(os.path.join(out, "ready0"), "w").close()
                time.sleep(60)
            end = time.monotonic() + 20
            while not os.path.exists(os.path.join(out, "ready0")) and time.monotonic() < end:
                time.sleep(0.02)
            sys.exit(4)
    elif action == "group":  # a process group (the shared-memory arena) at work
        import torch, tdist
        tdist.init_process_group("gloo")
        t = torch.ones(4)
        tdist.all_reduce(t)
        print(f"rank {rank} ready", flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            tdist.all_reduce(t)
            time.sleep(0.02)
    elif action in ("stall", "silent"):  # rank 1 stops (or hangs); rank 0 says so and fails
        if rank == 1:
            if action == "stall":
                os.kill(os.getpid(), signal.SIGSTOP)
            mark("hangs1")
            time.sleep(60)
        if rank == 0:  # once rank 1 is stopped (or hangs)
            wait_for((lambda: stopped(1)) if action == "stall" else marked("hangs1"))
            print("tdist._core.errors.PeerError: rank 0: peer rank 1 (pid 1) stalled during "
                  "all_reduce: no heartbeat for 10.0 s", file=sys.stderr)
            sys.exit(1)
        time.sleep(60)
    elif action == "restart":  # fail on the first attempt only
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"rank {rank} attempt {attempt}", flush=True)
        if attempt == 0 and rank == 0:
            mark("printed0")
        if attempt == 0 and rank == 1:  # (once rank 0 has printed: the launcher then stops it)
            wait_for(marked("printed0"))
            sys.exit(7)
    elif action == "store":  # use the job's store through env://
        import tdist
        store, r, ws = next(tdist.rendezvous("env://"))
        store.set(f"k{r}", str(r))
        total = store.add("total", r + 1)
        store.wait([f"k{i}" for i in range(ws)])
        store.barrier("end", ws)
        print(f"rank {r} of {ws} ok")
    """
)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "worker.py").write_text(WORKER)
    return tmp_path


def launcher_env(work: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("TDIST_SECRET", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCH_FR_DUMP_TEMP_FILE"):
        env.pop(var, None)
    # (the flight records that ranks dump when a peer dies go to the test's folder, not /tmp;
    # TORCH_FR_DUMP_TEMP_FILE="" leaves torch's default, for the tests that look at it)
    env["TORCH_FR_DUMP_TEMP_FILE"] = str(work / "nccl_trace_rank_")
    env["TEST_OUT"] = str(work)
    # (the registry of running jobs is under $TMPDIR: `tdist status` sees this test's jobs only)
    (work / "tmp").mkdir(exist_ok=True)
    env["TMPDIR"] = str(work / "tmp")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    if not env["TORCH_FR_DUMP_TEMP_FILE"]:
        del env["TORCH_FR_DUMP_TEMP_FILE"]
    return env


def tdist_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tdist.cli", *args]


def tdist_run(work: Path, *args: str, timeout: float = 20, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        tdist_cmd("run", *args), cwd=work, env=launcher_env(work, **env), capture_output=True,
        text=True, timeout=timeout,
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone too, for our purposes (it no longer runs)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.02)
    return False


def line_of(script: str, text: str) -> int:
    """The number of the line of ``script`` that holds ``text``."""
    return next(i for i, line in enumerate(script.splitlines(), 1) if text in line)


def pids(work: Path, n: int) -> list[int]:
    """The pids the workers wrote (a worker stopped before it got that far wrote none, or an
    empty file: stopped between creating it and writing it)."""
    texts = [(work / f"pid{r}").read_text() for r in range(n) if (work / f"pid{r}").exists()]
    return [int(t) for t in texts if t.strip()]
