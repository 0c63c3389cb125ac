"""torch 0.3's master-worker mode (``tdist.init_master_worker``, ``tdist.master_worker``) on
real processes: a master and two workers run ``master_worker_prog.py``; the master reports what
it saw, and every process's exit is checked."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tdist
import tdist.master_worker as mw
from tdist.testing import free_port

pytestmark = pytest.mark.timeout(120)

PROG = Path(__file__).with_name("master_worker_prog.py")
ROOT = Path(__file__).resolve().parents[2]
WARNING = "Master-worker mode is still experimental."


def launch(scenario: str, timeout: float = 90) -> list[tuple[int, str, str]]:
    """Run the scenario on ranks 0 (master), 1 and 2; each rank's (exit code, stdout, stderr).
    Every process is killed and reaped if the run outlives ``timeout``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "MASTER_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROG), scenario, str(rank), str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        for rank in range(3)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(Exception):
                p.communicate(timeout=10)


def result(run: list[tuple[int, str, str]]) -> dict[str, Any]:
    code, out, err = run[0]
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the master reported nothing (exit {code}):\n{out}\n{err}"
    value: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return value


def exits(run: list[tuple[int, str, str]]) -> list[int]:
    return [code for code, _, _ in run]


def test_init_warns_and_refuses_what_it_cannot_run_in_process() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.warns(UserWarning, match=WARNING), pytest.raises(RuntimeError, match="NCCL"):
        tdist.init_master_worker("nccl", url, world_size=3, rank=0)  # (before any rendezvous)
    with pytest.warns(UserWarning, match=WARNING), pytest.raises(ValueError, match="at least one worker"):
        tdist.init_master_worker("tcp", url, world_size=1, rank=0)
    with pytest.raises(RuntimeError, match="master-worker mode is not running"):
        mw.workers()
    mw.shutdown()  # (nothing to shut down: nothing happens)


def test_master_creates_computes_fetches_and_runs_collectives_on_the_workers() -> None:
    run = launch("basic")
    r = result(run)
    assert exits(run) == [0, 0, 0], run
    assert r["workers"] == [1, 2] and r["pids_distinct"]
    assert r["a_where"] == "worker1" and r["b_where"] == 2
    # methods run on the worker; an in-place one returns the same handle
    assert r["inplace_same_handle"] is True
    assert r["a"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert r["a_shape"] == [6] and r["a_dtype"] == "torch.float32"
    assert r["a_sum"] == 21.0 and r["a_sum_is_remote"] is True
    assert r["a_after_view_mul"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]  # the view shares storage
    assert r["m_row"] == [8.0, 10.0, 12.0]
    assert r["ops"] == [[4.0, 6.0, 8.0], [10.0, 12.0, 14.0]]
    # torch functions: where the first operand lives, the other copied there
    want = [[44.0, 56.0], [98.0, 128.0]]
    assert r["matmul"] == want and r["matmul_operator"] == want and r["matmul_where"] == "worker1"
    assert r["functional_relu"] == [[0.0, 0.0, 0.0], [2.0, 4.0, 6.0]]
    assert r["max"] == [[6.0, 12.0], [2, 2], "max"]
    assert r["run_scaled"] == [[0.5, 1.0], [1.5, 2.0], [2.5, 3.0]]
    assert r["run_stats"] == [21.0, 6, True]
    assert r["len_and_float"] == [3, 21.0]
    assert r["remote_error"]["type"] == "RuntimeError" and "mat1 and mat2" in r["remote_error"]["text"]
    assert r["no_worker"]["type"] == "ValueError" and "worker=" in r["no_worker"]["text"]
    assert r["master_rank"]["type"] == "ValueError" and "rank 0 is the master" in r["master_rank"]["text"]
    # collectives among the workers, on their own process group
    assert r["spread_where"] == ["worker1", "worker2"]
    assert r["all_reduce_sum"] == [[4.0, 6.0, 8.0, 10.0]] * 2
    assert r["all_reduce_max"] == [[4.0, 6.0, 8.0, 10.0]] * 2
    assert r["all_reduce_product"] == [6.0] * 6
    assert r["broadcast"] == [[6.0] * 3, [7.0] * 3]
    assert r["reduce"] == [13.0] * 3
    assert r["all_gather"] == [[4.0, 6.0, 8.0, 10.0] * 2] * 2
    assert r["subgroup"] == [5.0]
    assert r["two_on_one"]["type"] == "ValueError" and "two tensors on worker1" in r["two_on_one"]["text"]
    assert r["twice"]["type"] == "RuntimeError"
    assert "trying to initialize torch.distributed twice!" in r["twice"]["text"]
    # torch 0.3's warning, on every rank
    assert [c for c, m in r["warning"] if WARNING in m] == ["UserWarning"], r["warning"]
    for _, _, err in run[1:]:
        assert WARNING in err


def test_a_killed_worker_raises_on_the_master_naming_it() -> None:
    run = launch("kill_worker")
    r = result(run)
    for what in ("call", "fetch"):
        assert r[what]["type"] == "PeerError", r
        assert "worker2" in r[what]["text"], r
        assert r[f"{what}_s"] < 5, r
    assert r["other_still_serves"] == 4.0
    assert r["shutdown"]["type"] == "PeerError" and "worker2" in r["shutdown"]["text"], r
    assert r["shutdown_s"] < 10, r
    assert exits(run)[2] == -9
    # worker1 ends too, saying why (worker2 is gone)
    assert exits(run)[1] == 1, run[1]
    assert "worker1 (rank 1) ends: the master (rank 0) or another worker was lost" in run[1][2], run[1]
    assert "worker2" in run[1][2], run[1]


def test_workers_exit_when_the_master_ends_without_shutdown() -> None:
    run = launch("at_exit")
    assert result(run)["sum"] == 2.0
    assert exits(run) == [0, 0, 0], run


def test_workers_end_when_the_master_dies() -> None:
    run = launch("master_dies", timeout=40)
    assert exits(run)[0] == -9
    for rank, (code, _, err) in enumerate(run[1:], start=1):
        assert code == 1, err
        assert f"worker{rank} (rank {rank}) ends: the master (rank 0) or another worker was lost" in err


def test_the_readme_example_under_tdist_run() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "MASTER_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "tdist.cli", "run", "--nproc-per-node", "3", "--master-port", "0",
         "--local-ranks-filter", "0", str(ROOT / "examples" / "master_worker.py")],
        capture_output=True, text=True, timeout=90, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [  # (rank 0's alone: --local-ranks-filter 0)
        "master of workers [1, 2]",
        "a @ b = [[18.0, 24.0], [18.0, 24.0]] on worker1",
        "sum of b: 21.0 shape of c: (2, 2)",
        "all-reduced shards: [[4.0, 6.0, 8.0, 10.0], [4.0, 6.0, 8.0, 10.0]]",
    ], proc.stdout
