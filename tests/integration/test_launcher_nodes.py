"""``tdist run`` as real subprocesses: several nodes on this host (static, c10d and etcd
rendezvous, elastic ranges, scale-down, fault tolerance, the job's status and dumps)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import tdist
from tdist.testing import free_port

from .._sync import read_line
from ._launcher import (
    launcher_env,
    tdist_cmd,
    tdist_run,
    wait_gone,
)
from ._launcher import work as work  # (the fixture: used by name only)

pytestmark = pytest.mark.timeout(30)


# -- several nodes on this host ----------------------------------------------------------------
@pytest.fixture
def two_nodes(work: Path) -> Iterator[tuple[Path, int]]:
    yield work, free_port()


def start_node(work: Path, port: int, rank: int, *args: str, nproc: int = 2) -> subprocess.Popen[str]:
    return start_launcher(work, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", str(nproc),
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
        start_launcher(work, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
                      "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", "etcd/job", "--local-addr", "127.0.0.1",
                      "--join-timeout", "20", "e.py")
        for _ in range(2)
    ]
    outs = outputs(nodes, timeout=40)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} group {r} sum 2" for r in range(2)]
    assert EtcdStore(host, port, prefix="/tdist/etcd%2Fjob").num_keys() == 0  # the job left etcd clean
    assert EtcdStore(host, port, prefix="/tdist/etcd").num_keys() == 0  # (and nested no other job's)


@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_a_failure_on_one_node_restarts_every_node(two_nodes: tuple[Path, int], rdzv: str) -> None:
    # torchrun's fault-tolerant form: --max-restarts with several nodes; rank 1 (node 1) fails in
    # the first attempt while rank 0 waits; every node restarts its group, and the second
    # attempt's workers form a group across the nodes (static: a torch program, whose keys
    # node 0 clears between the attempts, and never the launchers' own)
    work, port = two_nodes
    (work / "ft.py").write_text(
        "import os, sys, time\n"
        "attempt, rank = int(os.environ['TORCHELASTIC_RESTART_COUNT']), int(os.environ['RANK'])\n"
        "if attempt == 0:\n"
        "    open(f'up{rank}', 'w').close()\n"
        "    if rank == 1:  # (fails once the other waits)\n"
        "        end = time.monotonic() + 20\n"
        "        while not os.path.exists('up0') and time.monotonic() < end:\n"
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
            start_launcher(work, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1", "--monitor-interval", "0.1",
                          "--stop-timeout", "2", "ft.py", "tdist")
            for _ in range(2)
        ]
    else:
        nodes = [start_node(work, port, k, "--max-restarts", "1", "ft.py", "torch", nproc=1) for k in (1, 0)]
    outs = outputs(nodes, timeout=40)
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} attempt 1 sum 2" for r in range(2)]
    said = outs[0][1] + outs[1][1]
    assert "worker rank 1 failed (exit code 9); restarting the worker group (restart 1 of 1)" in said
    assert "rank 1 exited with code 9; restarting the worker group (restart 1 of 1)" in said


def test_a_node_whose_workers_finished_restarts_with_a_node_whose_worker_failed(two_nodes: tuple[Path, int]) -> None:
    # node 0's workers succeed; then rank 3, on node 1, fails: the attempt failed, and both
    # nodes restart their groups (node 0 had waited for the others' workers in its exit
    # barrier, node 1 for node 0 to come back for the restart: each until its timeout)
    work, port = two_nodes
    (work / "late.py").write_text(
        "import os, sys, time\n"
        "attempt, rank = int(os.environ['TORCHELASTIC_RESTART_COUNT']), int(os.environ['RANK'])\n"
        "open(f'pid{rank}.{attempt}', 'w').write(str(os.getpid()))\n"
        "if attempt == 0 and rank == 3:  # (fails once node 0's workers have exited, and rank 2 has said its line)\n"
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
        "    while not (gone(0) and gone(1) and os.path.exists('said2.0')) and time.monotonic() < end:\n"
        "        time.sleep(0.01)\n"
        "    sys.exit(3)\n"
        "print('rank', rank, 'attempt', attempt, flush=True)\n"
        "open(f'said{rank}.{attempt}', 'w').close()\n"
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
    args = ["--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", backend, "--rdzv-endpoint",
            f"{host}:{port}", "--rdzv-id", f"elastic-{backend}", "--rdzv-conf", "last_call_timeout=1",
            "--local-addr", "127.0.0.1", "el.py"]
    outs = outputs([start_launcher(work, *args) for _ in range(2)], timeout=40)
    assert all("rank" in o[0] for o in outs), [o[1] for o in outs]
    lines = sorted(outs[0][0].splitlines() + outs[1][0].splitlines())
    assert lines == [f"rank {r} of 2 sum 2" for r in range(2)]


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
    assert read_line(first.stdout, 25, "the first node's start").startswith("start ")  # (running alone)
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
        line = read_line(proc.stdout, 25, "tdist store's address")
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
            line = read_line(node.stdout, 60, f"launcher {k}'s worker in a group of three")
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
    while "running" not in (line := read_line(node.stdout, 60, "the worker's running")):
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
        assert proc.stdout is not None and "ready" in read_line(proc.stdout, 25, "the worker's ready")
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
