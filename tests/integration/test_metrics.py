"""``tdist run --metrics-port``: a real job scraped over HTTP while it runs, before and after a
forced restart, its answers parsed by the Prometheus client library's own parsers (the extra
``tdist[metrics]``, which scripts/setup.sh installs)."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

import pytest
from prometheus_client import parser as prometheus_parser
from prometheus_client.openmetrics import parser as openmetrics_parser

ROOT = Path(__file__).resolve().parents[2]

# 5 all_reduce and 3 broadcast of 256 float32 (1 KiB), 3 RPCs and a failing one per rank, per
# attempt; then the step reported, "ready", and a wait for the test's gate. On attempt 0 rank 1
# fails after the gate (a restart) while rank 0 waits to be stopped; attempt 1 ends cleanly.
JOB = textwrap.dedent(
    """
    import os, sys, time, torch, tdist
    import tdist.rpc as rpc
    from tdist.elastic import report_progress

    def fail():
        raise ValueError("on purpose")

    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    tdist.init_process_group("gloo")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    t = torch.ones(256)
    for _ in range(5):
        tdist.all_reduce(t)
    for _ in range(3):
        tdist.broadcast(t, src=0)
    peer = f"w{1 - rank}"
    for _ in range(3):
        rpc.rpc_sync(peer, torch.add, args=(t, 1))
    try:
        rpc.rpc_sync(peer, fail)
    except ValueError:
        pass
    report_progress(7 + attempt)
    print(f"ready {attempt}", flush=True)
    gate = os.path.join(os.environ["TEST_OUT"], f"gate{attempt}")
    while not os.path.exists(gate):
        time.sleep(0.01)
    if attempt == 0:
        if rank == 1:
            sys.exit(3)
        time.sleep(60)
    rpc.shutdown()
    tdist.destroy_process_group()
    """
)


def _lines(stream: IO[str], into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line.rstrip("\n"))
    into.put(None)


def _next_match(lines: queue.Queue[str | None], pattern: str, seen: list[str], timeout: float = 60) -> re.Match[str]:
    """The next line that matches ``pattern`` (lines are events: no polling)."""
    while True:
        line = lines.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"the stream ended before {pattern!r}: {seen}")
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found


def _scrape(port: int, openmetrics: bool = False) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value, through the library's parser."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if openmetrics:
        request.add_header("Accept", "application/openmetrics-text; version=1.0.0; charset=utf-8")
    with urllib.request.urlopen(request, timeout=20) as reply:
        kind = reply.headers["Content-Type"]
        text = reply.read().decode()
    assert kind.startswith("application/openmetrics-text" if openmetrics else "text/plain"), kind
    parser: Any = openmetrics_parser if openmetrics else prometheus_parser
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _check_totals(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], attempts: int, restarts: int) -> None:
    """What ``attempts`` runs of JOB add up to."""
    assert _value(m, "tdist_restarts_total") == restarts
    for r in ("0", "1"):
        assert _value(m, "tdist_collective_ops_total", rank=r, op="all_reduce") == 5 * attempts
        assert _value(m, "tdist_collective_ops_total", rank=r, op="broadcast") == 3 * attempts
        assert _value(m, "tdist_collective_bytes_total", rank=r, op="all_reduce") == 5 * 1024 * attempts
        assert _value(m, "tdist_collective_bytes_total", rank=r, op="broadcast") == 3 * 1024 * attempts
        assert _value(m, "tdist_collective_errors_total", rank=r, op="all_reduce") == 0
        for op, n in (("all_reduce", 5), ("broadcast", 3)):  # (every operation's latency, once)
            assert _value(m, "tdist_collective_latency_seconds_count", rank=r, op=op) == n * attempts
            assert _value(m, "tdist_collective_latency_seconds_bucket", rank=r, op=op, le="+Inf") == n * attempts
            assert 0 < _value(m, "tdist_collective_latency_seconds_sum", rank=r, op=op) < 30 * attempts
        assert _value(m, "tdist_rpc_calls_total", rank=r, kind="call") == 4 * attempts
        assert _value(m, "tdist_rpc_errors_total", rank=r, kind="call") == 1 * attempts
        assert _value(m, "tdist_progress_step", rank=r) == 7 + attempts - 1
        assert _value(m, "tdist_worker_up", rank=r, local_rank=r) == 1
        assert _value(m, "tdist_worker_state", rank=r, state="running") == 1
        assert _value(m, "tdist_collective_unread_total", rank=r) == 0


@pytest.mark.timeout(90)
def test_metrics_endpoint_counts_a_job_across_a_restart(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ)
    for var in ("TDIST_SECRET", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TDIST_METRICS_PORT"):
        env.pop(var, None)
    env["TEST_OUT"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdist.cli", "run", "--nproc-per-node", "2", "--master-port", "0",
         "--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--max-restarts", "1", "job.py"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out: queue.Queue[str | None] = queue.Queue()
    err: queue.Queue[str | None] = queue.Queue()
    readers = [threading.Thread(target=_lines, args=(s, q), daemon=True) for s, q in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    said: list[str] = []
    seen: list[str] = []
    try:
        port = int(_next_match(err, r"metrics: http://127\.0\.0\.1:(\d+)/metrics", said).group(1))
        for _ in range(2):
            _next_match(out, r"^ready 0$", seen)
        first = _scrape(port)
        _check_totals(first, attempts=1, restarts=0)
        assert _value(first, "tdist_job_info", entrypoint="job.py", node="0", run_id="none") == 1
        # OpenMetrics, asked for by the Accept header, says the same
        again = _scrape(port, openmetrics=True)
        assert _value(again, "tdist_collective_ops_total", rank="0", op="all_reduce") == 5
        assert _value(again, "tdist_rpc_errors_total", rank="1", kind="call") == 1

        (tmp_path / "gate0").touch()  # rank 1 fails: the group restarts
        _next_match(err, r"restarting the worker group \(restart 1 of 1\)", said)
        for _ in range(2):
            _next_match(out, r"^ready 1$", seen)
        second = _scrape(port)
        _check_totals(second, attempts=2, restarts=1)  # (the first attempt's counts stay)
        for key, value in first.items():  # counters never go down
            if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
                assert second[key] >= value, key

        (tmp_path / "gate1").touch()
        assert proc.wait(timeout=30) == 0, (said, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(5)


# 4 all_reduce per rank (256 float32), the step reported, "ready", then a wait for the gate
TWO_NODES_JOB = textwrap.dedent(
    """
    import os, time, torch, tdist
    from tdist.elastic import report_progress

    tdist.init_process_group("gloo")
    t = torch.ones(256)
    for _ in range(4):
        tdist.all_reduce(t)
    report_progress(3)
    print("ready", flush=True)
    while not os.path.exists(os.path.join(os.environ["TEST_OUT"], "gate")):
        time.sleep(0.01)
    tdist.destroy_process_group()
    """
)


def _launcher(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], queue.Queue[str | None], queue.Queue[str | None]]:
    env = dict(os.environ)
    for var in ("TDIST_SECRET", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TDIST_METRICS_PORT"):
        env.pop(var, None)
    env["TDIST_SECRET"] = "two-nodes-secret"  # (a job of several nodes needs one)
    env["TEST_OUT"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdist.cli", "run", *args], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out: queue.Queue[str | None] = queue.Queue()
    err: queue.Queue[str | None] = queue.Queue()
    for s, q in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=_lines, args=(s, q), daemon=True).start()
    return proc, out, err


@pytest.mark.timeout(120)
def test_each_node_of_a_job_of_two_serves_the_whole_jobs_metrics(tmp_path: Path) -> None:
    """Two nodes (c10d rendezvous), two workers each, each node with its own endpoint: either
    endpoint serves all four ranks (the other node's part comes through the job's store)."""
    from tdist.testing import free_port

    (tmp_path / "job.py").write_text(TWO_NODES_JOB)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        _launcher(tmp_path, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                  "--rdzv-id", "job9", "--monitor-interval", "0.1", "--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                  "job.py")
        for _ in range(2)
    ]
    said: list[str] = []
    seen: list[str] = []
    try:
        ports = [int(_next_match(err, r"metrics: http://127\.0\.0\.1:(\d+)/metrics", said).group(1)) for _, _, err in nodes]
        for _, out, _ in nodes:
            for _ in range(2):
                _next_match(out, r"^ready$", seen)
        for port in ports:
            # (the other node's part is at most about a second old: wait for it to show)
            deadline = time.monotonic() + 30
            while True:
                m = _scrape(port)
                ranks = {dict(k[1]).get("rank") for k in m if k[0] == "tdist_collective_ops_total"}
                if ranks == {"0", "1", "2", "3"} and all(
                    _value(m, "tdist_progress_step", rank=str(r)) == 3 for r in range(4)
                ):
                    break
                assert time.monotonic() < deadline, (port, sorted(ranks), said)
                time.sleep(0.1)
            for r in range(4):
                assert _value(m, "tdist_collective_ops_total", rank=str(r), op="all_reduce") == 4
                assert _value(m, "tdist_collective_bytes_total", rank=str(r), op="all_reduce") == 4 * 1024
                assert _value(m, "tdist_collective_latency_seconds_count", rank=str(r), op="all_reduce") == 4
                assert _value(m, "tdist_worker_state", rank=str(r), state="running") == 1
            assert _value(m, "tdist_restarts_total") == 0
        (tmp_path / "gate").touch()
        for proc, _, _ in nodes:
            assert proc.wait(timeout=40) == 0, said
    finally:
        for proc, _, _ in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
