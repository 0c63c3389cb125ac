"""``tdist run`` and ``tdist store`` as real subprocesses."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
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
from datetime import timedelta
from pathlib import Path

import pytest

import tdist
from tdist.testing import free_port

from ._launcher import (
    DEMO,
    ROOT,
    WORKER,
    gone,
    launcher_env,
    line_of,
    pids,
    tdist_cmd,
    tdist_run,
    wait_gone,
)
from ._launcher import work as work  # (the fixture: used by name only)

pytestmark = pytest.mark.timeout(30)



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

