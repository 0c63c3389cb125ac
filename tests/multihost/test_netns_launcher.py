"""``tdist run`` across hosts (network namespaces): a job that loses the host of its store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_launcher_nodes import _RESIZE_BUSY
from tests.multihost import _netns

from .._sync import read_line

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

# three nodes: all_reduce after all_reduce until one is lost (it raises, naming the lost rank);
# then, two nodes: one all_reduce
_RESIZE = _RESIZE_BUSY


def test_kill_9_of_the_host_of_the_rendezvous_store_on_another_host(tmp_path: Path) -> None:
    """Three hosts, one ``tdist run`` each, a ``--nnodes 2:3`` job whose rendezvous endpoint is
    host 0 (which hosts the store), its workers at work in collectives. SIGKILL to host 0's
    launcher (its worker goes with it): the standby on another host takes over; the other
    hosts' workers fail naming the lost rank, their agents wait until the rendezvous drops host
    0, and re-form as a job of two that finishes (a re-form: no restart counted)."""
    script = tmp_path / "resize.py"
    script.write_text(_RESIZE)
    env = dict(os.environ, TDIST_SECRET="netns-launcher-secret",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with _netns.hosts(3) as hosts:
        nodes = []
        for h in hosts:
            argv = [sys.executable, "-m", "tdist.cli", "run", "--nnodes", "2:3", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].addr}:29631", "--local-addr", h.addr,
                    "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=2", "--monitor-interval", "0.2",
                    "--stop-timeout", "2", str(script)]
            nodes.append(subprocess.Popen(_netns.command(h, argv), cwd=tmp_path, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        try:
            for k, node in enumerate(nodes):
                assert node.stdout is not None
                while True:
                    line = read_line(node.stdout, 90, f"host {k}'s worker in a job of three")
                    assert line, f"host {k}'s launcher ended before its worker ran in a job of three: {node.communicate()[1][-3000:]}"
                    if line.rstrip().endswith("of 3"):
                        break
            os.kill(nodes[0].pid, signal.SIGKILL)  # (host 0 hosts the store: the endpoint is its)
            nodes[0].wait(10)
            results = [node.communicate(timeout=60) for node in nodes[1:]]
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                node.wait(10)
    sums = []
    for node, (out, err) in zip(nodes[1:], results, strict=True):
        assert node.returncode == 0, err[-3000:]
        assert "a node left the job (or its agent stopped beating)" in err, err[-3000:]
        assert "a worker failed naming rank 0 of another node" in err and "restart 1 of" not in err, err[-3000:]
        sums += [line for line in out.splitlines() if " sum " in line]
    assert sorted(sums) == ["rank 0 of 2 sum 2", "rank 1 of 2 sum 2"]
    assert any(f"the store server at {hosts[0].addr}:29631 was lost" in err for _, err in results), results
