"""The ``mpi`` backend on a real MPI (MPICH's wheel, through mpi4py), jobs started by mpiexec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

WORKER = str(Path(__file__).with_name("mpi_worker.py"))
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


def _mpiexec(
    n: int, case: str, extra_env: dict[str, str] | None = None, timeout: float = 90, flags: tuple[str, ...] = (),
    survivors: int | None = None,
) -> list[dict[str, Any]]:
    """Run ``case`` on ``n`` ranks; the results of the ranks that wrote one (all, unless
    ``survivors`` says how many), by rank."""
    shm_before = set(Path("/dev/shm").glob("mpich_shm_*"))
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MPI_TEST_OUT=out)
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
        env.update(extra_env or {})
        try:
            proc = subprocess.run(
                [MPIEXEC, *flags, "-n", str(n), sys.executable, WORKER, case],
                env=env, capture_output=True, text=True, timeout=timeout,
            )
        finally:
            _remove_unmapped(set(Path("/dev/shm").glob("mpich_shm_*")) - shm_before)
        files = sorted(Path(out).glob("*.json"), key=lambda p: int(p.stem))
        results = [json.loads(p.read_text()) for p in files]
    ok = len(results) == survivors if survivors is not None else proc.returncode == 0 and len(results) == n
    assert ok, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return results


def _remove_unmapped(segments: set[Path]) -> None:
    """Remove those of ``segments`` that no process maps: MPICH leaves its shared-memory
    segment when a rank of the job dies or leaves without finalizing, as the fault cases' ranks
    do on purpose. (A segment another test's job still uses is mapped by its ranks.)"""
    if not segments:
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # (gone meanwhile, or not ours to read)
            continue
        mapped.update(str(seg) for seg in segments if str(seg) in text)
    for seg in segments:
        if str(seg) not in mapped:
            seg.unlink(missing_ok=True)


def test_mpiexec_runs_every_op_with_torchs_results() -> None:
    res = _mpiexec(3, "ops")
    check_ops(res)
    # the job's secret came over MPI: one, on every rank; without it the store refuses
    assert len({got["secret"] for got in res}) == 1 and len(res[0]["secret"]) >= 32
    assert "requires a secret" in res[0]["open"] and not res[0]["reachable_elsewhere"]


def check_ops(res: list[dict[str, Any]]) -> None:
    """The results of mpi_worker.py's ``ops`` case on 3 ranks (also run under srun, in
    test_srun.py) against torch's."""
    n = 3
    assert len(res) == n
    for r, got in enumerate(res):
        assert got["rank"] == r and got["size"] == n and got["backend"] == "mpi" and got["avail"]
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
            parts = [(torch.arange(5) % 3 + k + 1).to(dtype) for k in range(n)]
            want = {
                "SUM": sum(parts[1:], parts[0].clone()),
                "PRODUCT": parts[0] * parts[1] * parts[2],
                "MIN": torch.minimum(torch.minimum(parts[0], parts[1]), parts[2]),
                "MAX": torch.maximum(torch.maximum(parts[0], parts[1]), parts[2]),
            }
            for op, w in want.items():
                assert got[f"all_reduce/{dtype}/{op}"] == w.tolist(), (dtype, op)
        assert got["avg"] == [2.0] * 4
        assert got["bxor"] == [1 ^ 2 ^ 3] * 6
        assert got["noncontig"] == [[6.0] * 3] * 4
        assert got["expanded"] == [[6.0] * 3, [[7.0] * 2] * 2]
        assert got["bcast_bf16"] == [0.0, 1.5, 3.0, 4.5]
        assert got["all_gather"] == [[float(k)] * (k + 1) for k in range(n)]
        assert got["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
        assert got["scatter"] == [float(r)] * 2
        assert got["reduce_scatter"] == [float(sum(r + k for k in range(n)))] * 2
        assert got["reduce_scatter_uneven"] == [float(n * j + sum(range(n))) for j in range(r + 1)]
        assert got["reduce_scatter_tensor"] == [float(n * 2 * r), float(n * (2 * r + 1))]
        assert got["all_to_all"] == [[float(10 * k + r)] * (r + 1) for k in range(n)]
        assert got["all_to_all_single"] == [float(100 * k + r) for k in range(n)]
        assert got["objects"] == [{"rank": k, "word": "x" * k} for k in range(n)]
        assert got["broadcast_object"] == {"from": 0}
        assert got["async"] == [True, True]
        assert got["chained"] == [[6.0, 6.0], [[3.0], [3.0, 3.0]], 0]
        assert got["bf16_error"][0] == "CollectiveArgumentError" and got["bf16_error"][1]
        assert "bfloat16" in got["bf16_error"][2]
    assert res[0]["reduce"] == [6.0] * 3
    assert res[0]["gather"] == [[float(k)] * 2 for k in range(n)]
    assert res[1]["recv_any"] == [0, [5.0, 6.0]]
    assert res[2]["recv"] == [0, 1, 2]
    assert res[0]["sub"] == [2.0, 0, 2] and res[2]["sub"] == [2.0, 1, 2] and "sub" not in res[1]


def test_a_stuck_collective_raises_naming_the_rank_that_never_reached_it() -> None:
    res = _mpiexec(3, "stuck")
    assert res[2]["skipped"]
    for r in (0, 1):
        kind, msg, waited = res[r]["error"]
        assert kind == "CollectiveTimeoutError", msg
        assert "all_reduce #2" in msg and "rank 2 never entered all_reduce #2" in msg, msg
        assert "ranks 0, 1 are waiting in all_reduce #2" in msg, msg
        assert waited < 30


def test_a_collective_that_waits_long_for_a_busy_rank_warns_naming_it() -> None:
    res = _mpiexec(3, "late", {"TDIST_FR_CHECK_AFTER": "0.1", "TDIST_FR_STACK": "1"})
    assert [got["sum"] for got in res] == [[3.0] * 3] * 3, res
    assert res[2]["said"] == [], res
    for r in (0, 1):
        (m,) = res[r]["said"]
        assert m.startswith(f"rank {r}: all_reduce #2 (float32[3]) of group") and "on the mpi backend" in m, m
        assert "rank 2 never entered all_reduce #2 (float32[3]); its last op is barrier #1" in m, m
        assert "its thread is now at mpi_worker.py:" in m and "in _late" in m, m


def test_split_group_works_on_the_mpi_backend() -> None:
    """(new_group's ``use_local_synchronization=True`` is refused on MPI, as torch's; a split,
    which is made by its members alone, said so though the program never asked for it)"""
    res = _mpiexec(3, "split")
    assert [(g["ranks"], g["sum"]) for g in res] == [([0, 2], 4.0), ([1], 2.0), ([0, 2], 4.0)], res


def test_a_collective_that_another_rank_destroyed_its_group_under_fails_not_garbage() -> None:
    """The destroy's wait for the other ranks (a barrier) ran on the group's communicator, where
    MPI paired it with rank 0's all_reduce: that returned at once, with garbage."""
    res = _mpiexec(2, "destroyed")
    kind, msg = res[0]["error"]
    assert kind == "CollectiveTimeoutError" and "all_reduce #1 timed out" in msg, res[0]


def test_a_rank_that_dies_is_named_by_the_others_when_mpiexec_lets_them_live() -> None:
    """MPICH's mpiexec ends the job when a rank dies; with ``-disable-auto-cleanup`` the others
    live on, and their collective fails within its timeout, naming the dead rank."""
    res = _mpiexec(3, "dies", flags=("-disable-auto-cleanup",), survivors=2)
    assert [r["rank"] for r in res] == [0, 2]
    for got in res:
        kind, msg, waited = got["error"]
        assert kind == "CollectiveTimeoutError" and "rank 1 did not answer" in msg, msg
        assert waited < 30


@pytest.mark.slow
def test_two_hosts_over_mpis_tcp_transport() -> None:
    """Two ranks in two network namespaces (mpiexec starts each through ``ip netns exec``): the
    data crosses the veth. The namespaces share a kernel, so MPICH (``MPIR_CVAR_NOLOCAL``) and
    its UCX and libfabric transports (``UCX_TLS``, ``FI_PROVIDER``) are told to keep off shared
    memory, as on two real hosts."""
    from tests.multihost import _netns

    with _netns.hosts(2) as hosts, tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MPI_TEST_OUT=out, MPIR_CVAR_NOLOCAL="1", UCX_TLS="tcp,self", FI_PROVIDER="tcp")
        env.pop("MASTER_ADDR", None)
        cmd = [MPIEXEC]
        for i, host in enumerate(hosts):
            cmd += [":"] if i else []
            cmd += ["-n", "1", *_netns.command(host, [sys.executable, WORKER, "hosts"])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
        res = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    assert proc.returncode == 0 and len(res) == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    for got in res:
        assert got["big_ok"] and got["small"] == 3.0
        assert got["hosts"][0] != got["hosts"][1]  # (two network namespaces)
        assert got["wire"] >= 2 << 20  # (half of 4 MiB at least, each way, over the veth)


def test_rank_and_world_size_come_from_mpi_and_given_ones_are_ignored_with_torchs_warning() -> None:
    res = _mpiexec(2, "args", {"MASTER_ADDR": "127.0.0.1"})
    for r, got in enumerate(res):
        assert any("world_size (9) and rank (7) are ignored" in w for w in got["warnings"]), got["warnings"]
        assert got["rank"] == r and got["all_reduce"] == 2.0


def test_a_process_that_mpi_sees_alone_in_a_larger_job_is_refused(tmp_path: Path) -> None:
    """``"mpi" if is_mpi_available() else "gloo"`` under torchrun: each worker is an MPI world
    of its own, and would train alone as rank 0 of 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MPI_TEST_OUT=str(tmp_path), PMI_RANK="0",
               WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = subprocess.run([sys.executable, WORKER, "alone"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "0.json").read_text())
    assert got["error"] and "not started by an MPI launcher" in got["error"] and "WORLD_SIZE=2" in got["error"], got
    # (finalized before the error is raised: a task of a refused job killed before its exit
    # handlers ran, as srun's --kill-on-bad-exit does, left MPICH's file of it in /dev/shm)
    assert got["finalized"] and not got["segment_left"], got


def test_rpc_runs_beside_an_mpi_process_group() -> None:
    from tdist.testing import free_port

    res = _mpiexec(2, "rpc", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    for r, got in enumerate(res):
        assert got["rpc"] == [1.0 + r] * 2
        assert got["all_reduce"] == 2.0
