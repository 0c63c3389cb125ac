"""``tdist run`` and ``tdist store`` as real subprocesses."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pickle
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import tdist
from tdist.testing import free_port

pytestmark = pytest.mark.timeout(30)

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


# -- environment and output --------------------------------------------------------------------
def test_workers_get_torchrun_environment(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--rdzv-id", "job42",
                    "worker.py", "env")
    assert res.returncode == 0, res.stderr
    envs = [json.loads((work / f"env{r}.json").read_text()) for r in range(2)]
    port = envs[0]["MASTER_PORT"]
    assert port != "0" and envs[1]["MASTER_PORT"] == port
    # as torchrun's: MASTER_ADDR:MASTER_PORT is the job's store, every worker its client
    # (TORCHELASTIC_USE_AGENT_STORE=True); tdist's env:// finds it by TDIST_AGENT_STORE too
    agent = envs[0]["TDIST_AGENT_STORE"]
    assert agent == f"127.0.0.1:{port}" and envs[1]["TDIST_AGENT_STORE"] == agent
    secret = envs[0]["TDIST_SECRET"]
    assert secret and len(secret) >= 32 and envs[1]["TDIST_SECRET"] == secret
    for r, env in enumerate(envs):
        assert env.pop("TORCHELASTIC_ERROR_FILE").endswith(f"attempt_0/{r}/error.json")
        assert env.pop("TDIST_AGENT_STORE") == agent
        assert env == {
            "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
            "ROLE_NAME": "default", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1", "TDIST_SECRET": secret,
        }
    # (as torchrun's: the workers' lines as they are, without --tee no prefix)
    assert sorted(res.stdout.splitlines()) == ["out from 0", "out from 1"]
    assert "err from 0" in res.stderr.splitlines()
    # the launcher itself never loads torch (two seconds of start-up saved at every run)
    assert (work / "launcher_has_torch0").read_text() == "False"
    assert "err from 1" in res.stderr.splitlines()
    # torchrun's warning when it gives several workers OMP_NUM_THREADS=1, said once
    assert res.stderr.count("OMP_NUM_THREADS is not set: each of the 2 workers gets OMP_NUM_THREADS=1") == 1


AGENT_STORE_CLIENTS = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
# as programs written for torchrun do: every rank a client of the agent's store
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=20))
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store.set(f"hello/{rank}", f"from {rank}")
store.add("arrived", 1)
store.wait([f"hello/{r}" for r in range(n)])
print(rank, os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_USE_AGENT_STORE"], store.get(f"hello/{(rank + 1) % n}").decode())
dist.init_process_group("gloo")  # (env://: torch's client of the same store)
# (a collective before the end: gloo's init can return on one rank while the other still
# completes its connection, which the first one's exit would then close under it)
dist.barrier()
print(rank, "group of", dist.get_world_size(), int(store.get("arrived")))
dist.destroy_process_group()
"""


def test_torch_programs_are_clients_of_the_job_store_at_master_port(work: Path) -> None:
    # torchrun's agent serves its store at --master-port, and torch's programs connect to it
    # there with torch's own client: so does tdist run's, in torch's protocol
    port = free_port()
    (work / "clients.py").write_text(AGENT_STORE_CLIENTS)
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", str(port), "clients.py", timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        f"0 {port} True from 1", "0 group of 2 2", f"1 {port} True from 0", "1 group of 2 2",
    ]


RESTARTED_TORCH_PROGRAM = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
# (a key of the last group: torch's keys are the same in every group, tdist run clears them)
print("attempt", attempt, "rank", dist.get_rank(), "sees the last group's key:", store.check(["left"]), flush=True)
t = torch.ones(1)
dist.all_reduce(t)
dist.barrier()
if attempt == 0:
    store.set("left", "by attempt 0")
    dist.barrier()
    if dist.get_rank() == 1:
        sys.exit(3)
    dist.barrier()  # (rank 1 is gone: the launcher stops this one)
dist.destroy_process_group()
"""


def test_a_restarted_torch_program_does_not_meet_the_last_groups_keys(work: Path) -> None:
    (work / "again.py").write_text(RESTARTED_TORCH_PROGRAM)
    res = tdist_run(work, "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", "0", "again.py", timeout=90)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("attempt"))
    assert lines == [
        f"attempt {a} rank {r} sees the last group's key: False" for a in (0, 1) for r in (0, 1)
    ], res.stdout


PROMPT = textwrap.dedent(
    """
    import os, sys, time
    out = os.environ["TEST_OUT"]
    def wait_for(name):  # (the test's marks; 20 s at most)
        end = time.monotonic() + 20
        while not os.path.exists(os.path.join(out, name)) and time.monotonic() < end:
            time.sleep(0.01)
    if os.environ["RANK"] == "0":  # an incomplete line that waits: a progress bar, a prompt
        sys.stdout.write("loading\\rstep 1"); sys.stdout.flush()
        wait_for("go0")
        sys.stdout.write("\\n"); sys.stdout.write("done\\n")
    else:  # a line of another rank while rank 0's is open on the console
        wait_for("go1")
        print("line from 1", flush=True)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("teed", [True, False])
def test_an_incomplete_line_is_shown_while_it_waits(work: Path, teed: bool) -> None:
    # (torchrun's workers write to its console directly: pdb's "(Pdb) " prompt, input()'s, and a
    # progress bar that redraws its line with carriage returns show at once; so here, and a
    # teed stream's redrawn line keeps its prefix)
    (work / "prompt.py").write_text(PROMPT)
    tee = ["--tee", "1", "--log-dir", str(work / "logs")] if teed else []
    proc = subprocess.Popen(tdist_cmd("run", "--nproc-per-node", "2", "--quiet", *tee, "prompt.py"), cwd=work,
                            env=launcher_env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p0, p1 = (b"[default0]:", b"[default1]:") if teed else (b"", b"")
    try:
        assert proc.stdout is not None
        seen, deadline = b"", time.monotonic() + 20

        def read_until(text: bytes) -> bytes:
            nonlocal seen
            while text not in seen and time.monotonic() < deadline:
                if select.select([proc.stdout], [], [], 0.2)[0]:
                    seen += os.read(proc.stdout.fileno(), 4096)
            return seen

        assert read_until(b"step 1") == p0 + b"loading\r" + p0 + b"step 1"  # (before the line's end)
        (work / "go1").touch()
        read_until(b"line from 1\n")
        (work / "go0").touch()
        out, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
    assert proc.returncode == 0, err
    # another rank's line ends the open one; its end, said already, adds no empty line
    assert seen + out == p0 + b"loading\r" + p0 + b"step 1\n" + p1 + b"line from 1\n" + p0 + b"done\n"


def test_local_ranks_filter_and_role(work: Path) -> None:
    (work / "r.py").write_text(
        "import os, sys\nprint('out', os.environ['RANK'], os.environ['ROLE_NAME'])\n"
        "print('err', os.environ['RANK'], file=sys.stderr)\n"
    )
    res = tdist_run(work, "--nproc-per-node", "3", "--master-port", "0", "--local-ranks-filter", "0,2",
                    "--role", "trainer", "r.py")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["out 0 trainer", "out 2 trainer"]
    assert sorted(line for line in res.stderr.splitlines() if "err" in line) == ["err 0", "err 2"]
    # teed, a line says its role and local rank, as torchrun's: [<role><local rank>]:
    res = tdist_run(work, "--nproc-per-node", "3", "--master-port", "0", "--local-ranks-filter", "0,2",
                    "--role", "trainer", "--tee", "2", "--log-dir", str(work / "logs"), "r.py")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["out 0 trainer", "out 2 trainer"]
    assert sorted(line for line in res.stderr.splitlines() if "err" in line) == ["[trainer0]:err 0", "[trainer2]:err 2"]


def test_torchrun_spellings_and_given_secret(work: Path) -> None:
    res = tdist_run(work, "--nproc_per_node=1", "--master_addr", "localhost", "--master_port", "0",
                    "--max_restarts", "0", "worker.py", "env", TDIST_SECRET="given", OMP_NUM_THREADS="3")
    assert res.returncode == 0, res.stderr
    env = json.loads((work / "env0.json").read_text())
    assert env["TDIST_SECRET"] == "given"
    assert env["OMP_NUM_THREADS"] == "3" and "OMP_NUM_THREADS is not set" not in res.stderr
    assert env["MASTER_ADDR"] == "localhost"
    assert env["TORCHELASTIC_RUN_ID"] == "none"


def test_standalone_makes_a_run_id_of_its_own(work: Path) -> None:
    # (torchrun's --standalone: a fresh uuid as the run id, whatever --rdzv-id says)
    res = tdist_run(work, "--standalone", "--rdzv-id", "given", "--nproc-per-node", "1", "worker.py", "env")
    assert res.returncode == 0, res.stderr
    run_id = json.loads((work / "env0.json").read_text())["TORCHELASTIC_RUN_ID"]
    assert str(uuid.UUID(run_id)) == run_id


def test_workers_use_the_agent_store(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "3", "--master-port", "0", "worker.py", "store")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"rank {r} of 3 ok" for r in range(3)]


def test_demo_runs(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", str(DEMO))
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert "rank 0: all 2 workers met" in res.stdout
    assert "rank 0: counter = 2" in out
    assert any(line.startswith("rank 1/2: I was number") for line in out)


def test_torchs_module_name_runs_the_launcher(work: Path) -> None:
    # python -m tdist.run, as python -m torch.distributed.run
    res = subprocess.run(
        [sys.executable, "-m", "tdist.run", "--nproc-per-node", "2", "--master-port", "0", "worker.py", "env"],
        cwd=work, env=launcher_env(work), capture_output=True, text=True, timeout=20,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["out from 0", "out from 1"]
    assert (work / "launcher_has_torch0").read_text() == "False"


def test_module_mode(work: Path) -> None:
    (work / "mymod.py").write_text("import os\nprint('module rank', os.environ['RANK'])\n")
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "-m", "mymod",
                    PYTHONPATH=f"{work}{os.pathsep}{ROOT / 'src'}")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["module rank 0", "module rank 1"]


def test_agent_in_process_and_without_pidfd(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.elastic import LaunchConfig, launch

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)  # an old kernel: the agent polls instead
    out, err = io.BytesIO(), io.BytesIO()
    config = LaunchConfig(str(work / "worker.py"), ("fail",), nproc_per_node=2, master_port=0,
                          stop_timeout=2)
    start = time.monotonic()
    code = launch(config, stdout=out, stderr=err, env=launcher_env(work), handle_signals=False)
    assert code == 1
    assert time.monotonic() - start < 20  # the others stopped, not waited for (their 60 s)
    assert b"\nValueError: rank 1 gives up\n" in err.getvalue()
    assert b"worker.py FAILED" in err.getvalue()


# -- failures ----------------------------------------------------------------------------------
def test_failing_worker_stops_the_others_and_sets_the_exit_code(work: Path) -> None:
    start = time.monotonic()
    # (flight records looked for in this test's directory: the default prefix is shared by
    # every process of the host)
    res = tdist_run(
        work, "--nproc-per-node", "3", "--master-port", "0", "worker.py", "fail", TORCH_FR_DUMP_TEMP_FILE=str(work / "fr_")
    )
    assert time.monotonic() - start < 15  # the others stopped, not waited for (their 60 s)
    assert res.returncode == 1  # an uncaught exception
    for pid in pids(work, 3):
        assert wait_gone(pid)
    err = res.stderr
    assert "ValueError: rank 1 gives up" in err.splitlines()
    report = err[err.index("worker.py FAILED"):]
    # the ranks the launcher stopped are listed as torchrun lists them (its SIGTERM ended them)
    failures = report.split("Root Cause")[0]
    for r in (0, 2):
        assert f"rank      : {r} (local_rank: {r})" in failures, report
        pid = (work / f"pid{r}").read_text()
        assert f"exitcode  : -15 (pid: {pid})  (SIGTERM)" in failures, report
        assert f"traceback : Signal 15 (SIGTERM) received by PID {pid}" in failures, report
    root = report.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert f"exitcode  : 1 (pid: {(work / 'pid1').read_text()})" in root
    assert "host      : " in root and "time      : " in root
    assert "Traceback (most recent call last):" in root
    assert "ValueError: rank 1 gives up" in root
    assert "error_file: <N/A>" in root  # (no @record: the traceback is stderr's)
    # the post-mortem: the first failure in a line, what the others were doing, restarts, logs
    post = report.split("Post-mortem:")[1]
    first = next(line for line in post.splitlines() if "first failure" in line)
    assert first.startswith("  first failure : rank 1 (local_rank 1, host ")
    line = line_of(WORKER, 'raise ValueError("rank 1 gives up")')
    assert first.endswith(f"exit code 1, ValueError: rank 1 gives up (raised at {work / 'worker.py'}:{line}, in <module>)")
    lines = post.splitlines()
    for r in (0, 2):
        at = lines.index(f"    rank {r} (local_rank {r}) was running; stopped by the launcher with SIGTERM; its last output:")
        # (its two streams, in the order they were read)
        assert sorted(lines[at + 1:at + 3]) == [f"      | rank {r} step 7", f"      | rank {r} waiting for rank 1"]
    assert "  restarts      : none allowed (--max-restarts 0)" in post
    assert "  logs          : not kept (--log-dir DIR" in post
    assert f"  flight records: none found (looked for {work / 'fr_'}<rank>)" in post
    assert res.stderr.rstrip().endswith("=" * 60)  # one block, the last thing said


RECORDED = textwrap.dedent(
    """
    import os, sys
    from tdist.elastic.multiprocessing.errors import record

    @record
    def main():
        rank = int(os.environ["RANK"])
        if rank == 1:
            os.close(2)  # nothing on stderr: the report can only quote the error file
            raise KeyError(f"rank {rank} recorded this")

    main()
    """
)


def test_a_recorded_exception_is_the_reports_root_cause(work: Path) -> None:
    # torchrun's contract: @record writes the exception to TORCHELASTIC_ERROR_FILE, and the
    # launcher's report quotes it
    (work / "recorded.py").write_text(RECORDED)
    # (a launcher with an error file of its own, as under a scheduler: torchrun's main is
    # @record, so the root cause's error file is copied there, with its exit code)
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "recorded.py",
                    TORCHELASTIC_ERROR_FILE=str(work / "launcher_error.json"))
    assert res.returncode == 1
    root = res.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    error_file = next(line for line in root.splitlines() if line.startswith("  error_file: ")).split(": ", 1)[1]
    assert error_file.endswith("attempt_0/1/error.json")
    assert Path(error_file).exists()  # (the report names it: it stays, as torchrun's)
    assert "KeyError" in json.loads(Path(error_file).read_text())["message"]["message"]
    copied = json.loads((work / "launcher_error.json").read_text())["message"]
    assert copied["errorCode"] == 1 and "KeyError" in copied["message"], copied
    assert "rank 1 recorded this" in copied["extraInfo"]["py_callstack"]
    assert "Traceback (most recent call last):" in root
    assert "KeyError: 'rank 1 recorded this'" in root and "in main" in root
    first = next(line for line in root.splitlines() if "first failure" in line)
    assert first.endswith(
        f"exit code 1, KeyError: 'rank 1 recorded this' (raised at {work / 'recorded.py'}:"
        f"{line_of(RECORDED, 'raise KeyError')}, in main) "
        "(its @record error file)"
    )
    assert "  the others    :\n    rank 0 (local_rank 0) " in root  # (finished, or stopped if still exiting)
    assert "  logs          : not kept but for the error files named above (" in root  # (it stays: see above)


RAISED_FIRST = textwrap.dedent(
    """
    import atexit, os, time
    from tdist.elastic.multiprocessing.errors import record

    @record
    def main():
        rank = int(os.environ["RANK"])
        if rank == 0:
            atexit.register(time.sleep, 60)  # (a clean-up that hangs: still running after its error)
            raise ValueError("rank 0 raised first")
        mine = os.environ["TORCHELASTIC_ERROR_FILE"]
        theirs = os.path.join(os.path.dirname(os.path.dirname(mine)), "0", "error.json")
        end = time.monotonic() + 20
        while not os.path.exists(theirs) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(2.1)  # (error files give whole seconds)
        raise KeyError("rank 1 raised second")

    main()
    """
)


def test_a_rank_that_raised_first_is_the_root_cause_though_it_exited_last(work: Path) -> None:
    """Rank 0 raises, then hangs in its clean-up; rank 1 raises two seconds later and exits:
    the first failure is rank 0's, by its error file's time, as torchrun orders failures,
    though rank 0 was still running when rank 1's exit stopped the group."""
    (work / "raised_first.py").write_text(RAISED_FIRST)
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "raised_first.py")
    assert res.returncode == 1, res.stderr
    root, others = res.stderr.split("Root Cause (first observed failure):")[1].split("Post-mortem:")[0], res.stderr.split("Root Cause")[0]
    assert "rank      : 0 (local_rank: 0)" in root and "ValueError: rank 0 raised first" in root, res.stderr
    assert "rank      : 1 (local_rank: 1)" in others and "rank 1 raised second" in others, res.stderr


@pytest.mark.parametrize("how", ["stall", "silent"])
def test_a_stalled_worker_is_the_root_cause_and_every_failure_is_listed(work: Path, how: str) -> None:
    # stall: stopped (SIGSTOP), seen in its process state; silent: hung, named by the others
    res = tdist_run(work, "--nproc-per-node", "3", "--master-port", "0", "worker.py", how, timeout=25)
    assert res.returncode == 1, res.stderr
    failures, root = res.stderr.split("Failures:")[1].split("Root Cause")
    assert "rank      : 1 (local_rank: 1)" in root and "stalled" in root, res.stderr
    assert "rank      : 0 (local_rank: 0)" in failures, res.stderr  # (not <NO_OTHER_FAILURES>)
    assert "did not stop within" not in res.stderr or how == "silent", res.stderr


def test_exit_code_of_a_failed_job_is_1_as_torchruns(work: Path) -> None:
    # (torchrun's ChildFailedError leaves its main: 1, whatever the worker's code; the report has it)
    (work / "seven.py").write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(7)\n")
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "seven.py")
    assert res.returncode == 1, res.stderr
    assert "exitcode  : 7 (pid: " in res.stderr and "rank      : 1 (local_rank: 1)" in res.stderr


def test_exit_code_of_a_killed_worker(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "worker.py", "kill")
    assert res.returncode == 1  # (torchrun's, whatever the signal: the report says which)
    assert "exitcode  : -9 (pid: " in res.stderr and "traceback : Signal 9 (SIGKILL) received by PID " in res.stderr
    assert "rank      : 0 (local_rank: 0)" in res.stderr
    assert "  first failure : rank 0 (local_rank 0, host " in res.stderr
    first = next(line for line in res.stderr.splitlines() if "first failure" in line)
    assert first.endswith("killed by signal SIGKILL")
    assert "    rank 1 (local_rank 1) was running; stopped by the launcher with SIGTERM; it had printed nothing" in res.stderr
    for pid in pids(work, 2):
        assert wait_gone(pid)


def test_worker_ignoring_sigterm_is_killed(work: Path) -> None:
    start = time.monotonic()
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--stop-timeout", "0.5",
                    "worker.py", "stubborn")
    assert res.returncode == 1
    assert time.monotonic() - start < 15  # killed, not waited for (its 60 s)
    assert "did not stop within 0.5 s of SIGTERM: sending SIGKILL" in res.stderr
    for pid in pids(work, 2):
        assert wait_gone(pid)


def test_restart_after_failure(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1",
                    "worker.py", "restart")
    assert res.returncode == 0, res.stderr
    assert "restarting the worker group (restart 1 of 1)" in res.stderr
    assert "rank 0 attempt 1" in res.stdout.splitlines()
    assert "rank 1 attempt 1" in res.stdout.splitlines()


def test_restarts_exhausted(work: Path) -> None:
    (work / "always.py").write_text("import sys\nsys.exit(4)\n")
    res = tdist_run(work, "--nproc-per-node", "1", "--master-port", "0", "--max-restarts", "2",
                    "always.py")
    assert res.returncode == 1
    assert res.stderr.count("restarting the worker group") == 2
    assert "always.py FAILED" in res.stderr
    assert (
        "  restarts      : 2 of 2 used (--max-restarts)\n"
        "    attempt 0: worker rank 0 failed (exit code 4)\n"
        "    attempt 1: worker rank 0 failed (exit code 4)\n"
    ) in res.stderr


def test_missing_script(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "1", "--master-port", "0", "nope.py")
    assert res.returncode == 1  # (torchrun's; python's own exit code 2 is in the report)
    assert "nope.py FAILED" in res.stderr and "exitcode  : 2 (pid: " in res.stderr
    assert "can't open file" in res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "0", "w.py"], "must be at least 1"),
        (["--master-port", "99999", "w.py"], "port must have value from 0 to 65535"),
        (["--nnodes", "2", "--master-port", "0", "w.py"], "works on one node only"),
        (["--rdzv-backend", "etcd2", "w.py"], "unknown rendezvous backend 'etcd2'"),
        (["--nnodes", "1:2", "w.py"], "elastic node ranges (--nnodes 1:2) need --rdzv-backend c10d or etcd"),
        (["--nnodes", "3:2", "w.py"], "the most nodes (2) must not be fewer than the least (3)"),
        (["--rdzv-backend", "etcd", "w.py"], "--rdzv-backend etcd needs --rdzv-endpoint"),
        (["--rdzv-conf", "read_timeout=0", "w.py"], "read_timeout=0: expected a positive number of seconds"),
        (["--rdzv-conf", "join_timeout", "w.py"], "expected KEY=VALUE pairs"),
        (["--rdzv-conf", "keep_alive_interval=0", "w.py"], "expected a positive number of seconds"),
        (["--redirects", "4", "w.py"], "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--tee", "0:1,x", "w.py"], "per local rank as LOCAL_RANK:VALUE"),
    ],
)
def test_bad_options(work: Path, args: list[str], message: str) -> None:
    res = tdist_run(work, *args)
    assert res.returncode == 2
    assert message in res.stderr


def test_port_in_use(work: Path) -> None:
    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5))
    try:
        res = tdist_run(work, "--master-port", str(server.port), "worker.py", "env")
    finally:
        server.close()
    assert res.returncode == 1
    assert "tdist run: error: cannot start a store server" in res.stderr


# -- logs: torchrun's --log-dir, --redirects, --tee ----------------------------------------------
def run_dir(log_dir: Path) -> Path:
    """The one run directory torchrun's layout makes under ``log_dir``: ``<run id>_<random>``."""
    (found,) = log_dir.iterdir()
    return found


def console(text: str) -> list[str]:
    """The workers' lines (the launcher's own, ``[tdist ...``, left out), sorted."""
    return sorted(line for line in text.splitlines() if not line.startswith("[tdist"))


def test_log_dir_with_redirects_3_writes_every_stream_to_files(work: Path) -> None:
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--rdzv-id", "job9",
                    "--log-dir", str(logs), "--redirects", "3", "worker.py", "env")
    assert res.returncode == 0, res.stderr
    assert console(res.stdout) == [] and console(res.stderr) == []  # nothing on the console
    run = run_dir(logs)
    assert run.name.startswith("job9_")
    assert f"workers' logs: {run}/attempt_<n>/<local rank>/" in res.stderr
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "attempt_0", "attempt_0/0", "attempt_0/0/stderr.log", "attempt_0/0/stdout.log",
        "attempt_0/1", "attempt_0/1/stderr.log", "attempt_0/1/stdout.log",
    ]
    for r in range(2):
        assert (run / f"attempt_0/{r}/stdout.log").read_text() == f"out from {r}\n"  # as written: no prefix
        assert (run / f"attempt_0/{r}/stderr.log").read_text() == f"err from {r}\n"
        env = json.loads((work / f"env{r}.json").read_text())
        assert env["TORCHELASTIC_ERROR_FILE"] == str(run / f"attempt_0/{r}/error.json")


def test_tee_1_copies_stdout_to_the_console_and_a_file(work: Path) -> None:
    logs = work / "logs"
    # (torchrun's --duplicate-std*-filters: the teed lines that hold a filter, prefixed, in the
    # attempt's filtered_<stream>.log; a stream that is not teed has an empty one)
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--log_dir", str(logs),
                    "--tee", "1", "--duplicate-stdout-filters", "nope,from 1", "--duplicate-stderr-filters", "err",
                    "worker.py", "env")
    assert res.returncode == 0, res.stderr
    # (as torchrun's: only the teed stream's lines carry [<role><local rank>]:)
    assert console(res.stdout) == ["[default0]:out from 0", "[default1]:out from 1"]
    assert console(res.stderr) == ["err from 0", "err from 1"]
    run = run_dir(logs)
    assert run.name.startswith("none_")  # (the default run id)
    for r in range(2):
        assert (run / f"attempt_0/{r}/stdout.log").read_text() == f"out from {r}\n"
        assert not (run / f"attempt_0/{r}/stderr.log").exists()
    assert (run / "attempt_0/filtered_stdout.log").read_text() == "[default1]:out from 1\n"
    assert (run / "attempt_0/filtered_stderr.log").read_text() == ""


def test_per_rank_redirect_maps_and_short_forms(work: Path) -> None:
    # -r 0:1,1:2: local rank 0's stdout and local rank 1's stderr to files, the rest on the
    # console; -t 2:3 tees both streams of local rank 2; local rank 3 is named by neither
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "4", "--master-port", "0", "--log-dir", str(logs),
                    "-r", "0:1,1:2", "-t", "2:3", "worker.py", "env")
    assert res.returncode == 0, res.stderr
    assert console(res.stdout) == ["[default2]:out from 2", "out from 1", "out from 3"]
    assert console(res.stderr) == ["[default2]:err from 2", "err from 0", "err from 3"]
    attempt = run_dir(logs) / "attempt_0"
    files = sorted(str(p.relative_to(attempt)) for p in attempt.rglob("*.log"))
    assert files == ["0/stdout.log", "1/stderr.log", "2/stderr.log", "2/stdout.log"]
    assert (attempt / "1/stderr.log").read_text() == "err from 1\n"
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1", "2", "3"]  # (a folder per local rank)


def test_redirects_without_a_log_dir_keep_a_temporary_one(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "1", "--master-port", "0", "-r", "1", "worker.py", "env")
    assert res.returncode == 0, res.stderr
    where = next(line for line in res.stderr.splitlines() if "workers' logs: " in line)
    run = Path(where.split("workers' logs: ")[1].split("/attempt_<n>")[0])
    try:
        assert (run / "attempt_0/0/stdout.log").read_text() == "out from 0\n"
    finally:
        shutil.rmtree(run.parent)


def test_restarts_get_attempt_folders(work: Path) -> None:
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1",
                    "--log-dir", str(logs), "--redirects", "3", "worker.py", "restart")
    assert res.returncode == 0, res.stderr
    run = run_dir(logs)
    assert sorted(p.name for p in run.iterdir()) == ["attempt_0", "attempt_1"]
    for attempt in range(2):
        for r in range(2):
            assert (run / f"attempt_{attempt}/{r}/stdout.log").read_text() == f"rank {r} attempt {attempt}\n"


def test_recorded_exception_in_the_log_dirs_error_json(work: Path) -> None:
    (work / "recorded.py").write_text(RECORDED)
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--log-dir", str(logs),
                    "recorded.py")
    assert res.returncode == 1
    error_json = run_dir(logs) / "attempt_0/1/error.json"
    data = json.loads(error_json.read_text())["message"]
    assert data["message"] == "KeyError: 'rank 1 recorded this'"
    assert "Traceback (most recent call last):" in data["extraInfo"]["py_callstack"]
    assert int(data["extraInfo"]["timestamp"]) > 0
    assert not (run_dir(logs) / "attempt_0/0/error.json").exists()  # (rank 0 succeeded)
    root = res.stderr.split("Root Cause (first observed failure):")[1]
    assert f"error_file: {error_json}" in root  # (kept: --log-dir)


def test_a_worker_stopped_after_it_raised_is_reported_with_its_error_file(work: Path) -> None:
    # rank 1 raises first; rank 0 then raises (its @record error file written, early in a
    # second, so that it is not taken for one raised a second before rank 1's exit) and
    # lingers; rank 1 exits: the launcher stops rank 0, whose entry quotes its error, as
    # torchrun's does
    (work / "raised.py").write_text(
        "import os, time\n"
        "from tdist.elastic.multiprocessing.errors import record\n"
        "rank = os.environ['RANK']\n"
        "mine = os.environ['TORCHELASTIC_ERROR_FILE']\n"
        "other = os.path.join(os.path.dirname(os.path.dirname(mine)), '10'[int(rank)], 'error.json')\n"
        "def until(path):\n"
        "    end = time.monotonic() + 15\n"
        "    while not os.path.exists(path) and time.monotonic() < end:\n"
        "        time.sleep(0.01)\n"
        "@record\n"
        "def work():\n"
        "    raise ValueError(f'rank {rank} gave up')\n"
        "if rank == '0':\n"
        "    until(other)\n"
        "    while time.time() % 1 > 0.2:  # (error files say whole seconds: see raised_before)\n"
        "        time.sleep(0.01)\n"
        "try:\n"
        "    work()\n"
        "except ValueError:\n"
        "    if rank == '0':\n"
        "        time.sleep(60)  # (until stopped)\n"
        "    until(other)\n"
        "    raise SystemExit(1)\n"
    )
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--log-dir", str(logs), "raised.py")
    assert res.returncode == 1, res.stderr
    failures, root = res.stderr.split("Failures:")[1].split("Root Cause")
    error_json = run_dir(logs) / "attempt_0/0/error.json"
    assert "rank      : 1 (local_rank: 1)" in root and "ValueError: rank 1 gave up" in root, res.stderr
    assert "(SIGTERM)" in failures and f"error_file: {error_json}" in failures, res.stderr
    assert "ValueError: rank 0 gave up" in failures, res.stderr


def test_post_mortem_points_to_flight_records_and_logs(work: Path) -> None:
    # with --log-dir, each worker's TORCH_FR_DUMP_TEMP_FILE is in its log folder
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--log-dir", str(logs),
                    "worker.py", "dump", TORCH_FR_DUMP_TEMP_FILE="")
    assert res.returncode == 1, res.stderr
    attempt = run_dir(logs) / "attempt_0"
    assert (attempt / "0/nccl_trace_rank_0").read_bytes() == b"record"
    post = res.stderr.split("Post-mortem:")[1]
    assert f"  flight records:\n    rank 0: {attempt / '0/nccl_trace_rank_0'}\n" in post
    (logs_line,) = [line for line in post.splitlines() if line.startswith("  logs          : ")]
    named = logs_line.split(" (")[1].rstrip(")").split(", ")  # (what is there: no stream went to a file)
    assert logs_line.startswith(f"  logs          : {attempt}/<local rank>/ (") and "stdout.log" not in named
    assert "nccl_trace_rank_0" in named and all(any((attempt / r / n).exists() for r in ("0", "1")) for n in named)
    # a location given by the user is the one looked at (tdist's variable as well as torch's);
    # a dump older than the job is not its
    stale = work / "fr_1"
    stale.write_bytes(b"old")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    (work / "dumped0").unlink()  # (the first run's mark)
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "worker.py", "dump",
                    TORCH_FR_DUMP_TEMP_FILE="", TDIST_FR_DUMP_TEMP_FILE=str(work / "fr_"))
    assert res.returncode == 1, res.stderr
    post = res.stderr.split("Post-mortem:")[1]
    assert f"  flight records:\n    rank 0: {work / 'fr_0'}\n  " in post, post


def test_the_post_mortem_has_the_stacks_of_the_ranks_still_running(work: Path) -> None:
    """Rank 1 fails while rank 0 waits in a function of its own: before stopping rank 0, the
    launcher asks it for its Python stacks, and the post-mortem says where they are. It asks
    without a signal: rank 0's own handlers of SIGUSR1 and SIGUSR2 (a scheduler's "save and
    requeue" hook) never run, as under torchrun, which sends the survivors SIGTERM alone."""
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "worker.py", "snapshot", timeout=40)  # (no logs kept: a folder of its own)
    assert res.returncode == 1, res.stderr
    assert "stacks        :" in res.stderr, res.stderr
    line = next(x for x in res.stderr.splitlines() if x.strip().startswith("rank 0: ") and "stacks_0.txt" in x)
    stacks = Path(line.split(": ", 1)[1].strip()).read_text()
    assert "waiting_in_rank_zero" in stacks, stacks
    assert not (work / "signals0").exists(), (work / "signals0").read_text()


def test_a_job_that_succeeds_after_a_restart_leaves_no_snapshot(work: Path) -> None:
    """The first attempt fails as above, and the launcher takes its snapshot; the second
    succeeds: the report that would have named the snapshot is never printed, so its folder
    (one of its own under $TMPDIR, no logs being kept) does not stay."""
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1", "worker.py", "snapshot_once",
                    timeout=40)
    assert res.returncode == 0, res.stderr
    assert "restarting" in res.stderr, res.stderr
    assert sorted(p.name for p in (work / "tmp").iterdir() if p.name.startswith("tdist_snapshot_")) == []


def test_kept_logs_hold_no_named_pipe_once_the_run_ends(work: Path) -> None:
    # (a worker that imports tdist keeps its status there, and a named pipe that wakes its
    # status thread: ``cat logs/*`` or ``grep -r`` on a pipe nobody writes to waits for good)
    (work / "status.py").write_text(
        "import os, time\n"
        "import tdist\n"
        "pipe = os.path.join(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE']), '.wake')\n"
        "end = time.monotonic() + 15\n"
        "while not os.path.exists(pipe) and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "assert os.path.exists(pipe)\n"
    )
    logs = work / "logs"
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--log-dir", str(logs), "status.py")
    assert res.returncode == 0, res.stderr
    left = [p for p in logs.rglob("*") if not (p.is_file() or p.is_dir())]
    assert left == [] and list(logs.rglob("status.json")), sorted(logs.rglob("*"))


def test_log_dir_devnull_writes_nothing(work: Path) -> None:
    res = tdist_run(work, "--nproc-per-node", "1", "--master-port", "0", "--log-dir", os.devnull,
                    "-r", "3", "worker.py", "env")
    assert res.returncode == 0, res.stderr
    assert console(res.stdout) == ["out from 0"]  # (no files: torchrun prints them, as they are)
    assert json.loads((work / "env0.json").read_text())["TORCHELASTIC_ERROR_FILE"] == ""


def test_start_method_is_accepted(work: Path) -> None:
    res = tdist_run(work, "--master-port", "0", "--start_method", "fork", "worker.py", "env",
                    timeout=20)
    assert res.returncode == 0, res.stderr
    res = tdist_run(work, "--master-port", "0", "--start-method", "thread", "worker.py", "env")
    assert res.returncode == 2 and "invalid choice: 'thread'" in res.stderr


# -- the live status line -----------------------------------------------------------------------
PROGRESS = textwrap.dedent(
    """
    import os, sys, time
    for i in range(4):
        print(f"epoch {i} loss {1 / (i + 1):.2f}", flush=True)
        time.sleep(0.4)
    if os.environ["RANK"] == "1" and sys.argv[1:] == ["fail"]:
        sys.exit(3)
    """
)
STATUS = b"\r\x1b[K[tdist run] "


def tdist_run_on_a_terminal(work: Path, *args: str, columns: int = 100) -> bytes:
    """``tdist run`` with its stdout and stderr on a pseudo-terminal ``columns`` wide; what
    the terminal got."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    try:
        proc = subprocess.Popen(tdist_cmd("run", *args), cwd=work, env=launcher_env(work, TERM="xterm"),
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    finally:
        os.close(slave)
    got = b""
    try:
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # (EIO: every writer of the terminal is gone)
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(master)
        proc.wait(timeout=20)
    return got


def status_lines(terminal: bytes) -> list[str]:
    """The status lines drawn (each ends where the next write erases it)."""
    return [part.split(b"\r")[0].decode() for part in terminal.split(STATUS)[1:]]


def test_status_line_on_a_terminal(work: Path) -> None:
    (work / "progress.py").write_text(PROGRESS)
    got = tdist_run_on_a_terminal(work, "--nproc-per-node", "2", "--master-port", "0", "progress.py", columns=70)
    drawn = status_lines(got)
    assert drawn, got
    assert all(len(line) <= 69 for line in drawn), drawn  # (cut to the terminal's width)
    assert any(line.startswith("2 running, 0 finished, 0 failed | 0:0") for line in drawn), drawn
    assert any("| rank0: epoch" in line or "| rank1: epoch" in line for line in drawn), drawn
    # the workers' lines are whole (each status line is erased before one is written)
    text = got.replace(b"\r\x1b[K", b"\n").decode()
    assert sorted(line for line in text.splitlines() if line.startswith("epoch")) == sorted(
        f"epoch {i} loss {1 / (i + 1):.2f}" for r in range(2) for i in range(4)
    )
    # (the last status line drawn was erased: nothing left under the output; workers' last
    # lines may follow the erasure)
    assert b"\r\x1b[K" in got[got.rindex(STATUS) + len(STATUS):], got[-300:]


def test_status_line_leaves_the_failure_report_alone(work: Path) -> None:
    (work / "progress.py").write_text(PROGRESS)
    got = tdist_run_on_a_terminal(work, "--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1",
                                  "progress.py", "fail")
    assert any(line.startswith("2 running, 0 finished, 0 failed | restart 1/1 | ") for line in status_lines(got))
    report = got[got.index(b"progress.py FAILED"):]
    assert STATUS not in report and b"\x1b" not in report


def test_no_status_line_with_quiet_or_without_a_terminal(work: Path) -> None:
    (work / "progress.py").write_text(PROGRESS)
    got = tdist_run_on_a_terminal(work, "--nproc-per-node", "2", "--master-port", "0", "--quiet", "progress.py")
    assert got.count(b"epoch 3 loss 0.25") == 2
    assert b"\x1b" not in got and b"running," not in got
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "progress.py")
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout + res.stderr and "running," not in res.stdout + res.stderr
    assert len(res.stdout.splitlines()) == 8


TTY = textwrap.dedent(
    """
    import os, sys
    try:
        columns = os.get_terminal_size().columns
    except OSError:
        columns = None
    print("tty", sys.stdout.isatty(), sys.stderr.isatty(), columns, flush=True)
    print("a\\nb", file=sys.stderr, flush=True)
    """
)


def test_workers_write_to_a_terminal_where_the_launcher_does(work: Path) -> None:
    """As torchrun's workers write to its terminal: on a terminal, a worker's streams are
    terminals of the same size (colours, progress bars' width), its bytes unchanged; in a
    pipe, pipes."""
    (work / "tty.py").write_text(TTY)
    got = tdist_run_on_a_terminal(work, "--nproc-per-node", "1", "--master-port", "0", "--quiet", "tty.py", columns=100)
    assert b"tty True True 100" in got, got
    # (one newline each, made \r\n by the launcher's own terminal alone: not \r\r\n; the
    # worker's stdout line may come between the two)
    assert b"a\r\n" in got and b"b\r\n" in got and b"\r\r\n" not in got, got
    res = tdist_run(work, "--nproc-per-node", "1", "--master-port", "0", "tty.py")
    assert res.returncode == 0 and "tty False False None" in res.stdout, res.stdout + res.stderr


# -- signals -----------------------------------------------------------------------------------
def start_hanging(work: Path, n: int, action: str = "hang", port: tuple[str, ...] = ("--master-port", "0")) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        tdist_cmd("run", "--nproc-per-node", str(n), *port, "worker.py", action),
        cwd=work, env=launcher_env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    ready: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for _ in range(n):
            ready.append(proc.stdout.readline())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(15)  # the lines arrive while the workers still run: output is streamed promptly
    assert sorted(ready) == [f"rank {r} ready\n" for r in range(n)]
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_the_workers(work: Path, sig: int) -> None:
    proc = start_hanging(work, 2)
    try:
        worker_pids = pids(work, 2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 1, err  # (torchrun's: its SignalException leaves main)
        assert f"stopped the workers on {signal.Signals(sig).name}" in err
        for pid in worker_pids:
            assert wait_gone(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_the_signal_that_stops_the_launcher_goes_on_to_the_workers(work: Path, sig: int) -> None:
    # (as torchrun's --signals-to-handle: Ctrl-C reaches a worker as SIGINT, its KeyboardInterrupt)
    proc = start_hanging(work, 2, "interrupt")
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 1, err
        assert f"stopped the workers on {signal.Signals(sig).name}" in err
        interrupted = sorted(p.name for p in work.glob("interrupted*"))
        assert interrupted == (["interrupted0", "interrupted1"] if sig == signal.SIGINT else []), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_single_node_jobs_without_a_port_run_side_by_side(work: Path) -> None:
    # (as torchrun's: one node with neither --master-port nor --rdzv-endpoint is --standalone,
    # a free port and a run id of its own)
    first = start_hanging(work, 1, port=())
    try:
        res = tdist_run(work, "--nproc-per-node", "2", "worker.py", "id")
        assert res.returncode == 0, res.stderr
        ids = {line.split(" in ")[1] for line in res.stdout.splitlines()}
        assert len(ids) == 1 and "none" not in ids, res.stdout
        assert sorted(line.split(" in ")[0] for line in res.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]
    finally:
        first.terminate()
        first.communicate(timeout=15)


def test_only_teed_lines_are_prefixed_and_never_twice(work: Path) -> None:
    # as torchrun's: the lines as they are without --tee (torch's excepthook's [rank<N>]: too)
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "worker.py", "prefixed")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank0]: said by torch", "[rank1]: said by torch", "plain", "plain"]
    # teed: torchrun's [<role><local rank>]: before every line
    logs = str(work / "logs")
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--tee", "1", "--log-dir", logs,
                    "worker.py", "prefixed")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        "[default0]:[rank0]: said by torch", "[default0]:plain", "[default1]:[rank1]: said by torch", "[default1]:plain",
    ], res.stdout
    # a template's prefix that a line has already is not written twice
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--tee", "1", "--log-dir", logs,
                    "worker.py", "prefixed", TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank${rank}]:")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        "[rank0]: said by torch", "[rank0]:plain", "[rank1]: said by torch", "[rank1]:plain",
    ], res.stdout


def test_run_path_records_the_scripts_error_as_torchruns(work: Path) -> None:
    """``--run-path``: the script runs under ``@record``, so its exception is the root cause's
    error file (torchrun's), with the script's folder first on ``sys.path`` as for ``python
    script``."""
    (work / "sub").mkdir()
    (work / "sub" / "helper.py").write_text("WORD = 'from the folder'\n")
    (work / "sub" / "job.py").write_text(
        "import os, time\nfrom helper import WORD\nprint(WORD, flush=True)\n"
        "said = os.path.join(os.environ['TEST_OUT'], 'said')\n"
        "if os.environ['RANK'] == '0':\n    open(said, 'w').close()\n"
        "if os.environ['RANK'] == '1':  # (once rank 0 has printed: the launcher then stops it)\n"
        "    end = time.monotonic() + 20\n"
        "    while not os.path.exists(said) and time.monotonic() < end:\n        time.sleep(0.01)\n"
        "    raise ValueError('boom from rank 1')\n"
    )
    res = tdist_run(work, "--nproc-per-node", "2", "--master-port", "0", "--run-path", "sub/job.py")
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines() == ["from the folder"] * 2, res.stdout
    root = res.stderr.split("Root Cause")[1].split("Post-mortem")[0]
    (error_file,) = [line for line in root.splitlines() if line.strip().startswith("error_file:")]
    assert error_file.endswith("/error.json") and "ValueError: boom from rank 1" in root, res.stderr


def test_torchrun_environment_defaults_and_options(work: Path) -> None:
    # PET_<option> (Kubeflow's PyTorchJob sets them), and torchrun's options that change
    # nothing here are accepted; --virtual-local-rank: LOCAL_RANK 0, one device each
    (work / "vl.py").write_text(
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'in', os.environ['TORCHELASTIC_RUN_ID'],"
        " 'local', os.environ['LOCAL_RANK'], 'device', os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    res = tdist_run(
        work, "--run-path", "--shutdown-timeout", "5", "--event-log-handler", "null", "--logs-specs", "x",
        "--duplicate-stdout-filters", "a,b", "--duplicate-stderr-filters", "c", "--virtual-local-rank",
        "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "vl.py", PET_NPROC_PER_NODE="2", PET_RDZV_ID="job9",
        PET_MASTER_PORT="0", CUDA_VISIBLE_DEVICES="5,7",
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        "rank 0 of 2 in job9 local 0 device 5", "rank 1 of 2 in job9 local 0 device 7",
    ], res.stdout
    # an unknown signal is said and left out, as torchrun's; a number is the signal
    odd = tdist_run(work, "--signals-to-handle", "SIGNOPE,15", "--master-port", "0", "worker.py", "id")
    assert odd.returncode == 0 and "unknown signal 'SIGNOPE'" in odd.stderr, odd.stderr
    # --rdzv-backend c10d with no endpoint is this host's port 29400, and --node-rank is the
    # static rendezvous's alone: said and left out (torchrun's warning), not an error
    port = free_port()
    res = tdist_run(work, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--node-rank", "3",
                    "worker.py", "id")
    assert res.returncode == 0 and "--node-rank is only used by the static rendezvous" in res.stderr, res.stderr


def test_kill_9_of_the_launcher_takes_its_workers_along(work: Path) -> None:
    # (it runs no cleanup: the kernel's parent-death signal stops them)
    proc = start_hanging(work, 2)
    worker_pids = pids(work, 2)
    try:
        proc.kill()
        proc.wait(10)
        for pid in worker_pids:
            assert wait_gone(pid, 10), f"worker {pid} outlived the launcher"
    finally:
        for pid in worker_pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_kill_9_of_the_job_store_ends_the_job_with_a_message(work: Path) -> None:
    proc = start_hanging(work, 2)
    worker_pids = pids(work, 2)
    try:
        store_pid = _job_store_pid(proc.pid)
        os.kill(store_pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 1, err
        assert f"the job's store server (pid {store_pid}" in err and "SIGKILL" in err, err
        for pid in worker_pids:
            assert wait_gone(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except FileNotFoundError:
            continue
        out += kids
        todo += kids
    return out


def _job_store_pid(launcher: int) -> int:
    """The process of the job's store server, once it serves: the launcher's child that runs
    the server and holds the job's listening sockets (a thread of the launcher serves until that
    process has taken over, a moment after the launcher's start)."""
    from .._sync import wait_until

    def serving() -> int | None:
        listening = set(_listening_sockets())
        for pid in _descendants(launcher):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"_serve_spawned" in f.read() and _socket_inodes([pid]) & listening:
                    return pid
        return None

    pid: int = wait_until(serving, 10, "the job's store server process serves")
    return pid


def _listening_sockets() -> dict[int, int]:
    """Every listening TCP socket of this host: its inode -> its port."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def _socket_inodes(pids: list[int]) -> set[int]:
    """The inodes of the sockets the processes ``pids`` hold."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(int(link[8:-1]))
    return inodes


@pytest.mark.parametrize("victim", ["launcher", "store", "worker"])
def test_kill_9_of_any_process_of_a_job_leaves_nothing_behind(work: Path, victim: str) -> None:
    # a job whose workers run collectives (shared-memory arena, TCP store, mesh listeners):
    # after kill -9 of any one of its processes the rest ends within seconds, and no process,
    # no /dev/shm entry and no listening socket of it remains
    shm_before = set(os.listdir("/dev/shm"))
    proc = start_hanging(work, 2, "group")
    try:
        worker_pids = pids(work, 2)
        store_pid = _job_store_pid(proc.pid)
        job = _descendants(proc.pid)
        # (the job's own listening sockets, by inode: other jobs on this host may listen too)
        job_sockets = set(_listening_sockets()) & _socket_inodes([proc.pid, *job])
        assert job_sockets, "the job listens on nothing?"
        target = {"launcher": proc.pid, "store": store_pid, "worker": worker_pids[1]}[victim]
        os.kill(target, signal.SIGKILL)
        proc.communicate(timeout=20)
        if victim != "launcher":
            assert proc.returncode != 0
        for pid in job:
            assert wait_gone(pid, 10), f"process {pid} of the job outlived the kill -9 of its {victim}"
        # (other programs on this host, the suite's other streams among them, make entries
        # meanwhile; the job's name the process that made them, as tdist's and torch's do)
        ours = {proc.pid, store_pid, *worker_pids, *job}
        left = [
            n for n in set(os.listdir("/dev/shm")) - shm_before
            if any(part.isdigit() and int(part) in ours for part in re.split(r"[-_.]", n))
        ]
        assert not left, f"the job left /dev/shm entries: {left}"
        assert not (set(_listening_sockets()) & job_sockets), "a socket of the job still listens"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _descendants(proc.pid) + pids(work, 2):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_LEAVER = """
import os, signal, subprocess, sys, time
out, rank = os.environ["TEST_OUT"], int(os.environ["RANK"])
own = subprocess.Popen(["sleep", "60"], start_new_session=True)  # (a session of its own)
plain = subprocess.Popen(["sleep", "61"])  # (in the worker's session)
with open(os.path.join(out, f"left{rank}.tmp"), "w") as f:
    f.write(f"{own.pid} {plain.pid}")
os.rename(os.path.join(out, f"left{rank}.tmp"), os.path.join(out, f"left{rank}"))
if sys.argv[1] == "killed":  # rank 0 dies of SIGKILL once rank 1 has started its children
    if rank == 0:
        end = time.monotonic() + 20
        while not os.path.exists(os.path.join(out, "left1")) and time.monotonic() < end:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""


@pytest.mark.parametrize("how", ["killed", "succeeded"])
def test_what_the_workers_left_running_goes_with_a_group_that_was_stopped(work: Path, how: str) -> None:
    # a worker killed with -9 leaves its children (a data loader's, a subprocess, one in a
    # session of its own) running; the launcher stops the group and kills them too. A group
    # whose workers all exited 0 is left alone, as torchrun leaves it.
    (work / "leaver.py").write_text(_LEAVER)
    r = tdist_run(work, "--nproc-per-node", "2", "--monitor-interval", "0.1", "--stop-timeout", "2", "leaver.py", how, timeout=60)
    left = [int(p) for k in (0, 1) if (work / f"left{k}").exists() for p in (work / f"left{k}").read_text().split()]
    try:
        assert len(left) == 4, (left, r.stderr)
        if how == "killed":
            assert r.returncode != 0 and "SIGKILL" in r.stderr, r.stderr
            for pid in left:
                assert wait_gone(pid, 10), f"process {pid}, started by a worker, outlived its stopped group"
            # (rank 1's plain child went with the stop signal to its process group already)
            assert re.search(r"killed [34] processes that the stopped workers had left running", r.stderr), r.stderr
        else:
            assert r.returncode == 0, r.stderr
            assert not any(gone(pid) for pid in left)
    finally:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- several nodes on this host ----------------------------------------------------------------
@pytest.fixture
def two_nodes(work: Path) -> Iterator[tuple[Path, int]]:
    yield work, free_port()


def start_node(work: Path, port: int, rank: int, *args: str) -> subprocess.Popen[str]:
    return start_launcher(work, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2",
                          "--master-port", str(port), "--monitor-interval", "0.1", "--stop-timeout", "2", *args)


def start_launcher(work: Path, *args: str) -> subprocess.Popen[str]:
    """``tdist run *args`` as one node of a multi-node job (they share the job's secret)."""
    return subprocess.Popen(
        tdist_cmd("run", *args), cwd=work, env=launcher_env(work, TDIST_SECRET="multi-node-secret"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def outputs(nodes: list[subprocess.Popen[str]], timeout: float = 20) -> list[tuple[str, str]]:
    """Each node's (stdout, stderr) once it exits; a node still running at the end is killed.

    Raises:
        AssertionError: a node ran past ``timeout`` (with every node's output so far, and the
            processes still there: a hang is not a bare timeout).
    """
    deadline = time.monotonic() + timeout
    try:
        return [p.communicate(timeout=max(0.1, deadline - time.monotonic())) for p in nodes]
    except subprocess.TimeoutExpired:
        left = subprocess.run(["ps", "-eo", "pid,ppid,stat,etime,args"], capture_output=True, text=True, timeout=10).stdout
        left = "\n".join(line[:200] for line in left.splitlines() if "tdist" in line)
        for p in nodes:
            p.kill()
        said = [f"node {k} (exit {p.wait(10)}):\n{p.communicate(timeout=10)[1][-3000:]}" for k, p in enumerate(nodes)]
        raise AssertionError(f"a node ran past {timeout:g} s; processes:\n{left}\n" + "\n".join(said)) from None
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_nodes_share_one_store(two_nodes: tuple[Path, int]) -> None:
    work, port = two_nodes
    nodes = [start_node(work, port, k, "worker.py", "store") for k in (1, 0)]
    outs = outputs(nodes)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} of 4 ok" for r in range(4)]


_SIZES = (
    "import os\nimport tdist as dist\nimport torch\n"
    "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'local', os.environ['LOCAL_RANK'], "
    "'sum', int(t.item()))\ndist.destroy_process_group()\n"
)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_nodes_with_different_numbers_of_workers_rank_them_as_torchrun(work: Path, backend: str) -> None:
    """Node 0 with 2 workers, node 1 with 1: ranks 0, 1 and 2 of 3, as torchrun's (each node
    counted with its own --nproc-per-node: two workers got rank 1, and the group waited its
    whole timeout)."""
    (work / "sizes.py").write_text(_SIZES)
    port = free_port()
    common = ["--nnodes", "2", "--master-port", str(port), "--monitor-interval", "0.1", "--stop-timeout", "2"]
    if backend == "c10d":
        common = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", "sizes", "--local-addr", "127.0.0.1"]
    nodes = [
        start_launcher(work, *common, *([] if backend == "c10d" else ["--node-rank", str(k)]),
                       "--nproc-per-node", str(n), "sizes.py")
        for k, n in ((0, 2), (1, 1))
    ]
    outs = outputs(nodes, timeout=60)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert [line.split(" local ")[0] for line in lines] == [f"rank {r} of 3" for r in range(3)], lines
    assert all(line.endswith("sum 3") for line in lines), lines


_LOOP = (
    "import os, time\nimport tdist as dist\nimport torch\n"
    "dist.init_process_group('gloo')\n"
    "open(os.path.join(os.environ['TEST_OUT'], 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
    "while True:\n    dist.all_reduce(torch.ones(1))\n    time.sleep(0.01)\n"
)


def test_the_store_host_leaves_soon_after_a_failure_though_a_node_is_cut_off(work: Path) -> None:
    """Node 1 is cut off (its launcher and worker stopped, as a lost link leaves them: no
    connection closes). Node 0's worker fails naming it; node 0 ends the job and, hosting the
    job's store, waited the whole exit barrier (300 s) for node 1 to say it finished. It now
    waits --stop-timeout and 10 s more."""
    (work / "loop.py").write_text(_LOOP)
    port = free_port()
    nodes = [
        subprocess.Popen(
            tdist_cmd("run", "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1", "--master-port", str(port),
                      "--monitor-interval", "0.1", "--stop-timeout", "2", "loop.py"),
            cwd=work, env=launcher_env(work, TDIST_SECRET="multi-node-secret", TDIST_HEARTBEAT_TIMEOUT="2"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 30
        while not (work / "pid1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        cut = [nodes[1].pid, int((work / "pid1").read_text())]
        for pid in cut:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        _, err = nodes[0].communicate(timeout=120)
        took = time.monotonic() - start
        assert nodes[0].returncode == 1, err
        assert "loop.py FAILED" in err and "stalled" in err, err
        assert took < 60, (took, err)  # (the exit barrier's own limit is 300 s)
    finally:
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
            pid1 = int((work / "pid1").read_text())
            os.kill(pid1, signal.SIGCONT)
            os.kill(pid1, signal.SIGKILL)


TORCH_PROGRAM = """
import sys, torch, torch.distributed as dist
import tdist  # (registers the "tdist" backend)
dist.init_process_group(sys.argv[1])
t = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), dist.get_backend(), t.tolist())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["tdist", "gloo"])
def test_two_nodes_run_a_program_that_calls_torchs_init_process_group(two_nodes: tuple[Path, int], backend: str) -> None:
    # as under torchrun: MASTER_ADDR:MASTER_PORT is the job's store, on node 0, and torch's
    # env:// makes every rank its client (torch's protocol: TORCHELASTIC_USE_AGENT_STORE=True)
    work, port = two_nodes
    (work / "t.py").write_text(TORCH_PROGRAM)
    nodes = [start_node(work, port, k, "t.py", backend) for k in (1, 0)]
    outs = outputs(nodes, timeout=60)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} of 4 {backend} [10.0, 10.0, 10.0]" for r in range(4)]


def test_c10d_rendezvous_numbers_the_nodes(two_nodes: tuple[Path, int]) -> None:
    # torchrun's multi-node form: no --node-rank; the node that hosts the endpoint is node 0
    work, port = two_nodes
    (work / "c.py").write_text(
        "import os\nprint('rank', os.environ['RANK'], 'group', os.environ['GROUP_RANK'], os.environ['WORLD_SIZE'])\n"
    )
    nodes = [
        start_launcher(work, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job", "--rdzv-conf",
                      "join_timeout=20", "c.py")
        for _ in range(2)
    ]
    outs = outputs(nodes)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} group {r // 2} 4" for r in range(4)]
    assert {frozenset(line.split(" group ")[1][0] for line in o[0].splitlines()) for o in outs} == {
        frozenset("0"), frozenset("1")
    }


def test_etcd_rendezvous(work: Path, etcd_endpoint: tuple[str, int]) -> None:
    # torchrun's etcd form: the nodes meet in etcd, numbered as they come; node 0 hosts the store
    from tdist.store._etcd import EtcdStore

    host, port = etcd_endpoint
    (work / "e.py").write_text(
        "import os\nimport tdist as dist\nimport torch\n"
        "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        "print('rank', os.environ['RANK'], 'group', os.environ['GROUP_RANK'], 'sum', int(t.item()))\n"
        "dist.destroy_process_group()\n"
    )
    nodes = [
        start_launcher(work, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v2",
                      "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", "etcd/job", "--local-addr", "127.0.0.1",
                      "--join-timeout", "20", "e.py")
        for _ in range(2)
    ]
    outs = outputs(nodes, timeout=40)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} group {r // 2} sum 4" for r in range(4)]
    assert EtcdStore(host, port, prefix="/tdist/etcd%2Fjob").num_keys() == 0  # the job left etcd clean
    assert EtcdStore(host, port, prefix="/tdist/etcd").num_keys() == 0  # (and nested no other job's)


@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_a_failure_on_one_node_restarts_every_node(two_nodes: tuple[Path, int], rdzv: str) -> None:
    # torchrun's fault-tolerant form: --max-restarts with several nodes; rank 3 (node 1) fails in
    # the first attempt while the others wait; every node restarts its group, and the second
    # attempt's workers form a group across the nodes (static: a torch program, whose keys
    # node 0 clears between the attempts, and never the launchers' own)
    work, port = two_nodes
    (work / "ft.py").write_text(
        "import os, sys, time\n"
        "attempt, rank = int(os.environ['TORCHELASTIC_RESTART_COUNT']), int(os.environ['RANK'])\n"
        "if attempt == 0:\n"
        "    open(f'up{rank}', 'w').close()\n"
        "    if rank == 3:  # (fails once the others wait)\n"
        "        end = time.monotonic() + 20\n"
        "        while not all(os.path.exists(f'up{r}') for r in range(3)) and time.monotonic() < end:\n"
        "            time.sleep(0.01)\n"
        "        sys.exit(9)\n"
        "    time.sleep(60)\n"
        "import torch\n"
        "dist = __import__('tdist') if sys.argv[1] == 'tdist' else __import__('torch.distributed').distributed\n"
        "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        "print('rank', rank, 'attempt', attempt, 'sum', int(t.item()))\ndist.destroy_process_group()\n"
    )
    if rdzv == "c10d":
        nodes = [
            start_launcher(work, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1", "--monitor-interval", "0.1",
                          "--stop-timeout", "2", "ft.py", "tdist")
            for _ in range(2)
        ]
    else:
        nodes = [start_node(work, port, k, "--max-restarts", "1", "ft.py", "torch") for k in (1, 0)]
    outs = outputs(nodes, timeout=40)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} attempt 1 sum 4" for r in range(4)]
    said = outs[0][1] + outs[1][1]
    assert "worker rank 3 failed (exit code 9); restarting the worker group (restart 1 of 1)" in said
    assert "rank 3 exited with code 9; restarting the worker group (restart 1 of 1)" in said


def test_a_node_whose_workers_finished_restarts_with_a_node_whose_worker_failed(two_nodes: tuple[Path, int]) -> None:
    # node 0's workers succeed; then rank 3, on node 1, fails: the attempt failed, and both
    # nodes restart their groups (node 0 had waited for the others' workers in its exit
    # barrier, node 1 for node 0 to come back for the restart: each until its timeout)
    work, port = two_nodes
    (work / "late.py").write_text(
        "import os, sys, time\n"
        "attempt, rank = int(os.environ['TORCHELASTIC_RESTART_COUNT']), int(os.environ['RANK'])\n"
        "open(f'pid{rank}.{attempt}', 'w').write(str(os.getpid()))\n"
        "if attempt == 0 and rank == 3:  # (fails once node 0's workers have exited)\n"
        "    end = time.monotonic() + 20\n"
        "    def gone(r):  # (exited, and reaped by its launcher)\n"
        "        try:\n"
        "            pid = int(open(f'pid{r}.0').read())\n"
        "        except (OSError, ValueError):\n"
        "            return False\n"
        "        try:\n"
        "            os.kill(pid, 0)\n"
        "        except OSError:\n"
        "            return True\n"
        "        return False\n"
        "    while not (gone(0) and gone(1)) and time.monotonic() < end:\n"
        "        time.sleep(0.01)\n"
        "    sys.exit(3)\n"
        "print('rank', rank, 'attempt', attempt)\n"
    )
    nodes = [start_node(work, port, k, "--max-restarts", "1", "late.py") for k in (1, 0)]
    outs = outputs(nodes, timeout=40)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == sorted([f"rank {r} attempt 0" for r in range(3)] + [f"rank {r} attempt 1" for r in range(4)])


@pytest.mark.timeout(60)  # (past the nodes' 40 s: a hang shows their output)
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_elastic_node_range(work: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # --nnodes 1:3: two nodes come; after the last call they run as a job of two nodes
    if backend == "etcd":
        host, port = request.getfixturevalue("etcd_endpoint")
    else:
        host, port = "127.0.0.1", free_port()
    (work / "el.py").write_text(
        "import os\nimport tdist as dist\nimport torch\n"
        "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'sum', int(t.item()))\n"
        "dist.destroy_process_group()\n"
    )
    args = ["--nnodes", "1:3", "--nproc-per-node", "2", "--rdzv-backend", backend, "--rdzv-endpoint",
            f"{host}:{port}", "--rdzv-id", f"elastic-{backend}", "--rdzv-conf", "last_call_timeout=1",
            "--local-addr", "127.0.0.1", "el.py"]
    outs = outputs([start_launcher(work, *args) for _ in range(2)], timeout=40)
    assert all("rank" in o[0] for o in outs), [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} of 4 sum 4" for r in range(4)]


def test_a_node_that_comes_later_joins_a_running_elastic_job(work: Path) -> None:
    # --nnodes 1:2: the first node runs alone; when the second comes, the first's group stops
    # and both start again as one job (a change of membership: no restart spent). The first
    # node's workers formed a group of their own: the new group's keys must not meet its keys
    # (the count of restarts is the same), whatever each rank counted before
    (work / "sc.py").write_text(
        "import os, sys, time, datetime\n"
        "import tdist as dist, torch\n"
        "ws = int(os.environ['WORLD_SIZE'])\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=20))\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\n"
        "print('start', os.environ['RANK'], 'of', ws, flush=True)\n"
        "if ws == 2:\n    time.sleep(30); sys.exit(3)  # (alone: wait to be joined)\n"
        "print('rank', os.environ['RANK'], 'of', ws, 'sum', int(t.item()))\ndist.destroy_process_group()\n"
    )
    args = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=0.5", "--monitor-interval", "0.2",
            "--stop-timeout", "2", "sc.py"]
    first = start_launcher(work, *args)
    assert first.stdout is not None
    assert first.stdout.readline().startswith("start ")  # (running alone)
    second = start_launcher(work, *args)
    (out1, err1), (out2, err2) = outputs([first, second], timeout=40)
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    assert "nodes wait to join the job: restarting the worker group with them" in err1
    lines = sorted(line for line in (out1 + out2).splitlines() if " sum " in line)
    assert lines == [f"rank {r} of 4 sum 4" for r in range(4)]


def test_a_signal_ends_a_wait_in_the_elastic_rendezvous(work: Path) -> None:
    # two nodes at least, one comes: it waits in the rendezvous until Ctrl-C, not for join_timeout
    port = free_port()
    proc = start_launcher(work, "--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          f"127.0.0.1:{port}", "worker.py", "env")
    # it has joined once the rendezvous's state is in the store it hosts: it waits from then on
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20), secret="multi-node-secret")
    try:
        store.wait(["torch.rendezvous.none/state"])
    finally:
        store.close()
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, err = outputs([proc])[0]
    assert time.monotonic() - start < 15  # at the signal, not at the join timeout (600 s)
    assert proc.returncode != 0 and "c10d rendezvous of 'none': interrupted" in err, err


def test_c10d_rendezvous_on_one_node_with_a_free_port(work: Path) -> None:
    # torchrun's "stacked single-node" form
    res = tdist_run(work, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1",
                    "--nproc-per-node=2", "worker.py", "env")
    assert res.returncode == 0, res.stderr
    envs = [json.loads((work / f"env{r}.json").read_text()) for r in range(2)]
    assert {e["MASTER_ADDR"] for e in envs} == {"localhost"} and envs[0]["MASTER_PORT"] != "0"


def test_failure_on_one_node_stops_the_other(two_nodes: tuple[Path, int]) -> None:
    work, port = two_nodes
    # node 1 runs ranks 2 and 3: rank 3 fails (exit 9) once the others run; node 0's ranks hang
    (work / "n.py").write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "open(f'up{rank}', 'w').close()\n"
        "if rank == 3:\n"
        "    end = time.monotonic() + 20\n"
        "    while not all(os.path.exists(f'up{r}') for r in range(3)) and time.monotonic() < end:\n"
        "        time.sleep(0.01)\n"
        "    sys.exit(9)\n"
        "time.sleep(60)\n"
    )
    nodes = [start_node(work, port, k, "n.py") for k in (0, 1)]
    outs = outputs(nodes)
    assert nodes[1].returncode == 1, outs[1][1]  # (torchrun's; the report says 9)
    assert "rank      : 3 (local_rank: 1)" in outs[1][1]
    assert nodes[0].returncode == 1, outs[0][1]
    assert "node 1: rank 3 exited with code 9" in outs[0][1]


@pytest.mark.parametrize("node_rank", [0, 1])
def test_missing_node_fails_the_join(work: Path, node_rank: int) -> None:
    start = time.monotonic()
    res = tdist_run(work, "--nnodes", "2", "--node-rank", str(node_rank), "--master-port",
                    str(free_port()), "--join-timeout", "1", "worker.py", "env", TDIST_SECRET="s")
    assert res.returncode == 1
    assert time.monotonic() - start < 15  # no exit barrier (300 s) for a job that never formed
    if node_rank == 0:
        assert "node 0: nodes [1] of 2 did not join within 1 s" in res.stderr
    else:
        assert "node 1: cannot reach the job store at 127.0.0.1:" in res.stderr
    assert not (work / "env0.json").exists()


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_torchs_rendezvous_timeouts_bound_the_wait_for_the_other_nodes(work: Path, backend: str) -> None:
    """torchrun's ``--rdzv-conf``: the static rendezvous's ``timeout`` (how long the nodes may
    take to come), c10d's ``read_timeout`` (how long a node tries to reach the store): a
    missing node fails the job in that time, where it waited for the 600 s default before."""
    port = str(free_port())
    if backend == "static":
        args = ["--nnodes", "2", "--node-rank", "0", "--master-port", port, "--rdzv-conf", "timeout=1"]
        said = "node 0: nodes [1] of 2 did not join within 1 s"
    else:  # (a node that does not host the store, and nobody does)
        args = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-conf", "is_host=false,read_timeout=1"]
        said = f"c10d rendezvous: the store at 127.0.0.1:{port} cannot be reached"
    res = tdist_run(work, *args, "worker.py", "env", TDIST_SECRET="s", timeout=15)
    assert res.returncode == 1, res.stderr
    assert said in res.stderr and "ignored" not in res.stderr, res.stderr
    assert not (work / "env0.json").exists()


def test_nodes_need_a_shared_secret(work: Path) -> None:
    res = tdist_run(work, "--nnodes", "2", "--master-port", str(free_port()), "worker.py", "env")
    assert res.returncode == 1
    assert "set TDIST_SECRET to the same value on every node" in res.stderr


# -- tdist store -------------------------------------------------------------------------------
def test_store_command_serves_until_interrupted(work: Path) -> None:
    proc = subprocess.Popen(
        tdist_cmd("store", "--port", "0"), env=launcher_env(work, TDIST_SECRET="st"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("tdist store: serving on 127.0.0.1:")
        assert "clients must prove TDIST_SECRET" in line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        client = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5), secret="st")
        client.set("a", "b")
        assert client.get("a") == b"b"
        client.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "tdist store: stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "tdist"
    assert script.exists(), "scripts/setup.sh installs the tdist console script into .venv/bin"
    res = subprocess.run([str(script), "run", "--help"], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0
    assert "--nproc-per-node" in res.stdout


_RESIZE = (
    "import os, sys, time\n"
    "ws = int(os.environ['WORLD_SIZE'])\n"
    "print('start', os.environ['RANK'], 'of', ws, flush=True)\n"
    "if ws == 3:\n    time.sleep(60); sys.exit(3)  # (three nodes: wait to lose one)\n"
    "import tdist as dist, torch\n"
    "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    "print('rank', os.environ['RANK'], 'of', ws, 'sum', int(t.item()), flush=True)\ndist.destroy_process_group()\n"
)


# the same, with workers at work in a group of three (all_reduce after all_reduce) when one node
# is lost: theirs fails, naming the lost rank
_RESIZE_BUSY = (
    "import os, sys, time\n"
    "import tdist as dist, torch\n"
    "ws = int(os.environ['WORLD_SIZE'])\n"
    "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    "print('start', os.environ['RANK'], 'of', ws, flush=True)\n"
    "if ws == 3:\n"
    "    end = time.monotonic() + 60\n"
    "    while time.monotonic() < end:  # (until a node is lost: all_reduce raises, naming it)\n"
    "        t.fill_(1); dist.all_reduce(t); time.sleep(0.02)\n"
    "    sys.exit(3)\n"
    "t.fill_(1); dist.all_reduce(t)\n"
    "print('rank', os.environ['RANK'], 'of', ws, 'sum', int(t.item()), flush=True)\ndist.destroy_process_group()\n"
)


def _three_nodes(work: Path, script: str = _RESIZE, keep_alive: int = 1) -> tuple[list[subprocess.Popen[str]], list[list[str]]]:
    """Three launchers of one ``--nnodes 2:3`` job, one worker each, once all three workers run
    as one group of three (each launcher's stdout so far, by launcher)."""
    (work / "resize.py").write_text(script)
    args = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}", "--rdzv-conf", f"last_call_timeout=2,keep_alive_interval={keep_alive}",
            "--monitor-interval", "0.2", "--stop-timeout", "2", "resize.py"]
    nodes = [start_launcher(work, *args) for _ in range(3)]
    seen: list[list[str]] = [[] for _ in nodes]
    for k, node in enumerate(nodes):
        assert node.stdout is not None
        while not any(line.endswith("of 3") for line in seen[k]):
            line = node.stdout.readline()
            assert line, f"launcher {k} ended before its worker ran in a group of three"
            seen[k].append(line.rstrip("\n"))
    return nodes, seen


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigterm_to_a_node_of_an_elastic_job_is_a_scale_down(work: Path) -> None:
    """SIGTERM to one node of a 2:3 job: it leaves and exits 0; the two others re-form as a
    job of two and finish, without counting a failure."""
    nodes, seen = _three_nodes(work)
    victim = next(k for k, lines in enumerate(seen) if not any("rank 0 of" in line or "start 0 of" in line for line in lines))
    nodes[victim].send_signal(signal.SIGTERM)
    results = outputs(nodes, timeout=60)
    _, err_v = results[victim]
    assert nodes[victim].returncode == 0, err_v
    assert "left the job on SIGTERM" in err_v
    sums = []
    for k, (out, err) in enumerate(results):
        if k == victim:
            continue
        assert nodes[k].returncode == 0, err
        assert "a node left the job" in err and "restart 1 of" not in err, err
        sums += [line for line in out.splitlines() if " sum " in line]
    assert sorted(sums) == ["rank 0 of 2 sum 2", "rank 1 of 2 sum 2"]


@pytest.mark.timeout(90)
def test_sigterm_to_the_only_node_of_an_elastic_job_stops_the_job(work: Path) -> None:
    """No other node goes on: SIGTERM to the one node of a 1:2 job is an interruption, exit 1
    (as torchrun), not a scale-down's 0."""
    (work / "wait.py").write_text("import time\nprint('running', flush=True)\ntime.sleep(60)\n")
    node = start_launcher(work, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=1",
                          "--monitor-interval", "0.2", "wait.py")
    assert node.stdout is not None
    while "running" not in (line := node.stdout.readline()):
        assert line, "the launcher ended before its worker ran"
    node.send_signal(signal.SIGTERM)
    ((_, err),) = outputs([node], timeout=60)
    assert node.returncode == 1, err
    assert "stopped the workers on SIGTERM" in err and "left the job" not in err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_node_whose_agent_stops_is_dropped_and_the_others_re_form(work: Path) -> None:
    """SIGSTOP to one node's launcher: its heartbeat stands still, the others drop it within
    seconds (keep_alive_interval=1, 3 attempts) and re-form as a job of two."""
    nodes, seen = _three_nodes(work)
    victim = next(k for k, lines in enumerate(seen) if not any("start 0 of" in line for line in lines))
    os.kill(nodes[victim].pid, signal.SIGSTOP)
    try:
        others = [n for k, n in enumerate(nodes) if k != victim]
        t0 = time.monotonic()
        results = outputs(others, timeout=60)
        took = time.monotonic() - t0
    finally:
        os.kill(nodes[victim].pid, signal.SIGKILL)
        os.kill(nodes[victim].pid, signal.SIGCONT)
        nodes[victim].wait(10)
    sums = []
    for node, (out, err) in zip(others, results, strict=True):
        assert node.returncode == 0, err
        assert "a node left the job (or its agent stopped beating)" in err, err
        sums += [line for line in out.splitlines() if " sum " in line]
    assert sorted(sums) == ["rank 0 of 2 sum 2", "rank 1 of 2 sum 2"]
    assert took < 30  # (dropped after 3 s of silence, then a new round: far below the workers' 60 s)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_kill_9_of_the_node_that_hosts_the_rendezvous_store_leaves_a_job_that_goes_on(work: Path) -> None:
    """The node at the rendezvous endpoint hosts the store; another node keeps its standby.
    SIGKILL to the host's launcher (its worker goes with it) while the workers run collectives:
    the standby takes over, the other two nodes' agents fail over to it; their workers fail
    naming the lost rank, and the agents wait for the rendezvous to drop the dead node, then
    re-form as a job of two (a re-form, not a failure). (Heartbeats every 2 s: the node is
    dropped 4-6 s after its death, well after the workers failed, so the agents do wait.)"""
    nodes, seen = _three_nodes(work, _RESIZE_BUSY, keep_alive=2)
    victim = next(k for k, lines in enumerate(seen) if any("start 0 of 3" in line for line in lines))
    os.kill(nodes[victim].pid, signal.SIGKILL)
    nodes[victim].wait(10)
    others = [n for k, n in enumerate(nodes) if k != victim]
    results = outputs(others, timeout=60)
    sums = []
    for node, (out, err) in zip(others, results, strict=True):
        assert node.returncode == 0, err
        assert "a node left the job (or its agent stopped beating)" in err, err
        assert "restart 1 of" not in err and "a worker failed naming rank 0 of another node" in err, err
        sums += [line for line in out.splitlines() if " sum " in line]
    assert sorted(sums) == ["rank 0 of 2 sum 2", "rank 1 of 2 sum 2"]
    # (and when the node that took over leaves at the end, the other one's standby of it serves on)
    assert any("store standby: the store server at" in err for _, err in results), [err for _, err in results]


_FT_PROGRAM = """
import hashlib, os, signal, time
import torch
import tdist as dist
from tdist.elastic import ft

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
marker = os.path.join(os.environ["TEST_OUT"], "killed")
mgr = ft.Manager(ft.job_store(), min_size=1, max_size=3, initial_size=3, timeout=20, grace=1.0, rejoin_timeout=10,
                 state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()},
                 load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), opt.load_state_dict(sd["o"])))
mgr.start()
print("start", os.environ["RANK"], "restart", os.environ["TORCHELASTIC_RESTART_COUNT"], "step", mgr.current_step, flush=True)
first = True  # (a joiner takes part in the step at which it was let in)
while first or mgr.current_step < 30 or (mgr.world_size < 3 and mgr.current_step < 1000):
    first = False  # (the survivors go on until the restarted rank is back: no race with its start)
    with mgr.step():
        step = mgr.current_step
        if os.environ["RANK"] == "1" and step == 10 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # (once: its restart joins the running job)
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= mgr.world_size
        opt.step()
    time.sleep(0.03)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
print("done", os.environ["RANK"], "step", mgr.current_step, "digest", digest, flush=True)
mgr.shutdown()
"""


@pytest.mark.timeout(90)
def test_ft_restarts_a_failed_worker_alone_and_it_joins_the_running_job(work: Path) -> None:
    """``tdist run --ft``: rank 1 dies of SIGKILL at step 10; the launcher starts it again alone
    (the others re-form without it and go on, past step 30 until it is back), it joins the
    running job at a step boundary, receives the state from a peer, and all three finish at one
    step with one state; exit 0."""
    (work / "ftrun.py").write_text(_FT_PROGRAM)
    res = tdist_run(work, "--ft", "--max-restarts", "1", "--nproc-per-node", "3", "--master-port", "0", "ftrun.py", timeout=80)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "worker rank 1 failed (exit code -9 (SIGKILL)); restarting it alone, the others go on (restart 1 of 1)" in res.stderr
    joined = [line for line in res.stdout.splitlines() if "start 1 restart 1 step" in line]
    assert joined and int(joined[0].rsplit(" ", 1)[1]) >= 10, res.stdout  # (it joined the running job)
    done = [line for line in res.stdout.splitlines() if " digest " in line]
    assert len(done) == 3 and len({line.rsplit(" ", 1)[1] for line in done}) == 1, res.stdout
    steps = {int(line.split(" step ", 1)[1].split()[0]) for line in done}
    assert len(steps) == 1 and 30 <= steps.pop() < 1000, res.stdout


_FT_LEAVER = """
import os, subprocess, sys, time
out, rank = os.environ["TEST_OUT"], int(os.environ["RANK"])
if rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":  # (fails, leaving a child)
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    with open(os.path.join(out, "child.tmp"), "w") as f:
        f.write(str(child.pid))
    os.rename(os.path.join(out, "child.tmp"), os.path.join(out, "child"))
    sys.exit(3)
if rank == 0:  # (started again)
    open(os.path.join(out, "back"), "w").close()
end = time.monotonic() + 30
while not os.path.exists(os.path.join(out, "back")) and time.monotonic() < end:
    time.sleep(0.02)
"""


def test_ft_a_worker_restarted_alone_first_loses_what_it_left_running(work: Path) -> None:
    # --ft: rank 0 fails, leaving a child in a session of its own; before it is started again
    # alone, that child is killed (the others, and the job, go on and succeed)
    (work / "ftleaver.py").write_text(_FT_LEAVER)
    res = tdist_run(work, "--ft", "--max-restarts", "1", "--nproc-per-node", "2", "--monitor-interval", "0.1",
                    "ftleaver.py", timeout=60)
    child = int((work / "child").read_text()) if (work / "child").exists() else None
    try:
        assert res.returncode == 0 and child is not None, res.stderr[-3000:]
        assert "restarting it alone" in res.stderr and "killed 1 process that worker rank 0 had left running" in res.stderr, res.stderr
        assert wait_gone(child, 10), "the failed worker's child outlived its restart"
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


_FT_LATE = """
import os, signal, time
import tdist as dist
from tdist.elastic import ft

out, rank = os.environ["TEST_OUT"], os.environ["RANK"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":  # (the replacement comes once the job is over)
    for r in ("0", "2"):
        while not os.path.exists(os.path.join(out, "gone" + r)):
            time.sleep(0.01)
mgr = ft.Manager(ft.job_store(), min_size=1, max_size=3, initial_size=3, timeout=20, grace=1.0, rejoin_timeout=10,
                 state_dict=lambda: {}, load_state_dict=lambda sd: None)
mgr.start()
while mgr.current_step < 5:
    with mgr.step():
        if rank == "1" and mgr.current_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
print("done", rank, "step", mgr.current_step, flush=True)
mgr.shutdown()
open(os.path.join(out, "gone" + rank), "w").close()
"""


@pytest.mark.timeout(90)
def test_ft_a_worker_restarted_after_the_job_finished_is_no_failure(work: Path) -> None:
    """``tdist run --ft``: rank 1 dies near the end; the others finish the job without it; its
    restart comes after they left and finds the job over (``QuorumError``): the job succeeded,
    and the launcher says so (exit 0), where it reported the job FAILED."""
    (work / "late.py").write_text(_FT_LATE)
    res = tdist_run(work, "--ft", "--max-restarts", "1", "--nproc-per-node", "3", "--master-port", "0", "late.py", timeout=80)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("done")) == ["done 0 step 5", "done 2 step 5"]
    assert "cannot join: the job is over" in res.stderr
    assert "worker rank 1, started again, came after the job had finished without it: nothing left to do" in res.stderr
    assert "FAILED" not in res.stderr


_PROGRESS = (
    "import time, tdist, torch\n"
    "from tdist.elastic import report_progress\n"
    "tdist.init_process_group('gloo')\n"
    "for step in range(100000):\n"
    "    t = torch.ones(4)\n    tdist.all_reduce(t)\n    report_progress(step)\n    time.sleep(0.02)\n"
)


def _running_job(work: Path) -> subprocess.Popen[str]:
    """A job of two workers that report progress, once both have written their status."""
    (work / "progress.py").write_text(_PROGRESS)
    proc = subprocess.Popen(tdist_cmd("run", "--nproc-per-node", "2", "--master-port", "0", "progress.py"), cwd=work,
                            env=launcher_env(work), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        res = subprocess.run(tdist_cmd("status", "--once", "--pid", str(proc.pid)), cwd=work, env=launcher_env(work),
                             capture_output=True, text=True, timeout=20)
        rows = [line.split() for line in res.stdout.splitlines()[2:]]
        if len(rows) == 2 and all(r[6] != "-" for r in rows):  # (both report steps)
            return proc
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the job's workers never reported: {res.stdout} {res.stderr}")


_STUCK = """
import os, sys, threading
import tdist  # (its status thread and its handler of SIGUSR2)

def churn():
    while True:
        sum(range(100))

threading.Thread(target=churn, name="churner", daemon=True).start()
r, w = os.pipe()
print("ready", flush=True)

def stuck_in_a_system_call():
    os.read(r, 1)  # (restarted after a signal: no Python signal handler runs meanwhile)

stuck_in_a_system_call()
"""


def test_dump_takes_the_stacks_of_a_worker_stuck_in_a_system_call(work: Path) -> None:
    # Every thread's stack comes from the worker's status thread (faulthandler's dump from the
    # signal handler crashed workers whose other threads ran): a main thread that never gets
    # back to Python to run a signal handler is still looked into (the request file).
    (work / "stuck.py").write_text(_STUCK)
    proc = subprocess.Popen(tdist_cmd("run", "--nproc-per-node", "1", "--master-port", "0", "stuck.py"), cwd=work,
                            env=launcher_env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        res = subprocess.run(tdist_cmd("dump", "--out", str(work / "d")), cwd=work, env=launcher_env(work),
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        stacks = (work / "d" / "stacks_0.txt").read_text()
        assert '"MainThread" (most recent call first):' in stacks and "in stuck_in_a_system_call" in stacks, stacks
        assert '"churner" (most recent call first):' in stacks and "in churn" in stacks, stacks
        assert not list((work / "tmp").rglob("stacks.request"))  # (taken)
        assert proc.poll() is None  # (the job goes on)
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_status_of_a_job_of_two_nodes_through_its_rendezvous_endpoint(work: Path) -> None:
    """Two nodes (c10d), two workers each, progress reported: `tdist status --rdzv-endpoint`
    shows all four ranks from the job's store, whichever host it runs on; and says so when no
    job is there."""
    (work / "progress.py").write_text(_PROGRESS)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_launcher(work, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            endpoint, "--rdzv-id", "job7", "--monitor-interval", "0.1", "--stop-timeout", "2", "progress.py")
             for _ in range(2)]
    try:
        env = launcher_env(work, TDIST_SECRET="multi-node-secret")
        deadline = time.monotonic() + 40
        while True:
            res = subprocess.run(tdist_cmd("status", "--once", "--rdzv-endpoint", endpoint, "--rdzv-id", "job7"),
                                 cwd=work, env=env, capture_output=True, text=True, timeout=20)
            rows = [line.split() for line in res.stdout.splitlines()[2:]]
            if len(rows) == 4 and all(r[6] != "-" for r in rows):  # (every rank reported steps)
                break
            assert time.monotonic() < deadline, (res.stdout, res.stderr)
            assert all(n.poll() is None for n in nodes), [n.communicate()[1] for n in nodes]
            time.sleep(0.2)
        lines = res.stdout.splitlines()
        assert lines[0].startswith("job job7: progress.py | 2 nodes") and f"via {endpoint}" in lines[0], lines
        assert [r[0] for r in rows] == ["0", "1", "2", "3"]
        assert {r[3] for r in rows} <= {"running", "sleeping"}
        res = subprocess.run(tdist_cmd("status", "--once", "--rdzv-endpoint", endpoint, "--rdzv-id", "other"),
                             cwd=work, env=env, capture_output=True, text=True, timeout=20)
        assert res.returncode == 1 and "no node of job 'other' publishes its status" in res.stderr
        # every rank's stacks and flight record, from both nodes, into one folder
        res = subprocess.run(tdist_cmd("dump", "--rdzv-endpoint", endpoint, "--rdzv-id", "job7", "--out", str(work / "d")),
                             cwd=work, env=env, capture_output=True, text=True, timeout=40)
        assert res.returncode == 0, res.stderr
        assert "from 2 nodes" in res.stderr, res.stderr
        names = sorted(p.name for p in (work / "d").iterdir())
        assert names == sorted([f"rank_{r}" for r in range(4)] + [f"stacks_{r}.txt" for r in range(4)]), names
        assert "progress.py" in (work / "d" / "stacks_3.txt").read_text()
    finally:
        for n in nodes:
            n.send_signal(signal.SIGTERM)
        outputs(nodes, timeout=30)


def test_status_and_dump_look_into_a_running_job(work: Path) -> None:
    proc = _running_job(work)
    try:
        res = subprocess.run(tdist_cmd("status", "--once"), cwd=work, env=launcher_env(work),
                             capture_output=True, text=True, timeout=20)
        lines = res.stdout.splitlines()
        assert lines[0].startswith("job ") and f"launcher pid {proc.pid}" in lines[0] and "progress.py" in lines[0]
        assert lines[1].split()[:4] == ["rank", "pid", "host", "state"]
        rows = [line.split() for line in lines[2:]]
        assert [r[0] for r in rows] == ["0", "1"]
        for r in rows:
            assert r[3] in ("running", "sleeping") and int(r[6]) >= 0 and float(r[7]) > 0  # (step, steps/s)
            assert "ago" in lines[2 + rows.index(r)] and "MB" in lines[2 + rows.index(r)]
        out = work / "dumped"
        res = subprocess.run(tdist_cmd("dump", "--out", str(out)), cwd=work, env=launcher_env(work),
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        for rank in (0, 1):
            stacks = (out / f"stacks_{rank}.txt").read_text()
            assert "progress.py" in stacks and "Thread" in stacks  # (every thread's Python stack)
            with open(out / f"rank_{rank}", "rb") as f:  # (its flight record, in torch's format)
                record = pickle.load(f)
            assert any(e["profiling_name"].endswith("all_reduce") for e in record["entries"])
        # torch's own reader takes the folder as it is
        trace = subprocess.run([str(Path(sys.executable).parent / "torchfrtrace"), str(out)],
                               capture_output=True, text=True, timeout=60)
        assert trace.returncode == 0, trace.stderr[-2000:]
        assert proc.poll() is None  # (the job goes on)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_status_redraws_live_on_a_terminal(work: Path) -> None:
    proc = _running_job(work)
    master, slave = os.openpty()
    try:
        viewer = subprocess.Popen(tdist_cmd("status", "--interval", "0.2"), cwd=work, env=launcher_env(work),
                                  stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        got = b""
        # (three redraws in place: each erases the table before it, then writes the next one,
        # which may come in a read of its own)
        while got.count(b"\x1b[J") < 3 or got.count(b"steps/s") < 4:
            ready, _, _ = select.select([master], [], [], 20)
            assert ready, got
            got += os.read(master, 1 << 16)
        viewer.terminate()
        viewer.wait(10)
    finally:
        os.close(master)
        proc.terminate()
        proc.communicate(timeout=30)
    # the job is gone: nothing to look at
    res = subprocess.run(tdist_cmd("status", "--once", "--pid", str(proc.pid)), cwd=work, env=launcher_env(work),
                         capture_output=True, text=True, timeout=20)
    assert res.returncode == 1 and f"no tdist run job with launcher pid {proc.pid}" in res.stderr
