"""Ranks on separate hosts (network namespaces joined by a bridge): the TCP path for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost import _netns

from .._sync import read_line

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WORKER = str(Path(__file__).with_name("netns_worker.py"))


def launch(hosts: list[_netns.Host], placement: list[int], case: str, port: int) -> list[subprocess.Popen[str]]:
    procs = []
    world = len(placement)
    for rank, h in enumerate(placement):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=hosts[0].addr, MASTER_PORT=str(port),
            TDIST_SECRET="netns-test-secret", PYTHONPATH=os.pathsep.join(sys.path),
        )
        procs.append(subprocess.Popen(
            _netns.command(hosts[h], [sys.executable, WORKER, case]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ))
    return procs


def collect(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, object]]:
    results = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_collectives_across_three_hosts() -> None:
    with _netns.hosts(3) as hosts:
        placement = [0, 0, 1, 2]  # two ranks share host 0, the others are alone
        results = collect(launch(hosts, placement, "collectives", 29611), timeout=100)
    world = len(placement)
    for r in results:
        assert r["sum"] == sum(range(1, world + 1))
        assert r["max"] == world - 1
        assert r["bcast"] == 45.0
        assert r["gather"] == [float(i) for i in range(world)]
    assert results[world - 1]["p2p_ok"] is True
    # topology: ranks 0 and 1 share a host and talk over a Unix socket; everyone else over TCP
    assert results[0]["same_host"] == [True, False, False]
    assert results[2]["same_host"] == [False, False, False]
    assert "unix" in results[0]["paths"] and any(p.startswith("10.77.0.") for p in results[0]["paths"])
    assert results[3]["paths"] == ["10.77.0.1", "10.77.0.2"]


def _results_of(procs: list[subprocess.Popen[str]], ranks: tuple[int, ...], timeout: float) -> list[dict[str, object]]:
    """The last JSON line of each of ``ranks`` (which must exit 0 within ``timeout``); every
    process still running then is killed."""
    try:
        results = []
        for rank in ranks:
            out, err = procs[rank].communicate(timeout=timeout)
            assert procs[rank].returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_a_rank_on_another_host_that_dies_while_the_group_forms_is_named_in_seconds() -> None:
    """gloo waits for its timeout (30 minutes by default). tdist's ranks name it, by its pid,
    which means its process here (another network namespace, the same pid namespace)."""
    with _netns.hosts(2) as hosts:
        procs = launch(hosts, [0, 0, 1], "dies", 29622)
        results = _results_of(procs, (0, 1), 50)
    for r in results:
        assert r["error"] is not None and "rank 2 has not connected, and it is gone: its process, pid " in r["error"], r
        assert r["elapsed"] < 20, r


def test_rank_killed_on_another_host() -> None:
    with _netns.hosts(2) as hosts:
        procs = launch(hosts, [0, 1, 0], "kill", 29621)
        try:
            assert procs[1].stdout is not None
            line = read_line(procs[1].stdout, 60, "rank 1's victim")  # rank 1 (on host 1) says who it is, then hangs
            victim = int(json.loads(line)["victim"])
            for rank in (0, 2):  # they say when they wait on it in the all_reduce
                assert procs[rank].stdout is not None
                assert json.loads(read_line(procs[rank].stdout, 60, f"rank {rank} inside")) == {"inside": rank}
            os.kill(victim, signal.SIGKILL)
        except BaseException:
            for p in procs:
                p.kill()
                p.wait(10)
            raise
        results = _results_of(procs, (0, 2), 30)
    for r in results:
        assert r["error"] is not None and "rank 1" in r["error"], r
        assert r["elapsed"] < 5, r
