"""The metrics of ``tdist run --metrics-port`` without processes: a worker's tally read from
real flight-recorder rings, the launcher's aggregate across restarts, the missing library, the
flag and its variable, and what ``tdist status`` shows as a worker's operation."""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
import torch

from tdist.c10d import _flight_recorder as F
from tdist.elastic import _metrics as M
from tdist.rpc import _calls

pytestmark = pytest.mark.timeout(30)


def _rec(cap: int = 8) -> F.Recorder:
    return F.Recorder(0, 2, cap, timeout_s=3.0)


def _done(e: list[Any], seconds: float) -> list[Any]:
    e[F.DONE] = e[F.CREATED] + int(seconds * 1e9)
    return e


def _bucket(seconds: float) -> int:
    return next(i for i, b in enumerate(M.LATENCY_BUCKETS) if seconds <= b)


def test_tally_counts_operations_bytes_latencies_and_errors() -> None:
    rec, tally = _rec(), M.Tally()
    _done(rec.collective("all_reduce", (torch.Size([4]),), torch.float32), 3e-6)
    waiting = rec.one("broadcast", torch.ones(2, 3, dtype=torch.float64))
    failed = rec.p2p("send", torch.Size([10]), torch.int8, 0, 1)
    F.Recorder.failed(failed, RuntimeError("peer lost"))
    rec.collective("barrier", (), None)
    tally.poll([rec])
    ops = tally.ops
    assert ops["all_reduce"][M.COUNT] == 1 and ops["all_reduce"][M.BYTES] == 16
    assert ops["all_reduce"][M.BUCKETS][0] == 1 and ops["all_reduce"][M.LATENCY_SUM] == pytest.approx(3e-6)
    assert ops["broadcast"][M.COUNT] == 1 and ops["broadcast"][M.BYTES] == 48
    assert sum(ops["broadcast"][M.BUCKETS]) == 0  # (not completed yet)
    assert ops["send"][M.ERRORS] == 1 and sum(ops["send"][M.BUCKETS]) == 0
    assert ops["barrier"][M.COUNT] == 1 and ops["barrier"][M.BYTES] == 0
    _done(waiting, 0.2)
    tally.poll([rec])
    assert ops["broadcast"][M.COUNT] == 1  # (counted once: when issued)
    assert ops["broadcast"][M.BUCKETS][_bucket(0.2)] == 1
    assert tally.totals()["ops"]["broadcast"][M.LATENCY_SUM] == pytest.approx(0.2)


def test_tally_stops_where_the_writer_has_not_stored_its_entry_yet() -> None:
    rec, tally = _rec(cap=4), M.Tally()
    for _ in range(5):  # (a second lap: the slots hold entries read before)
        _done(rec.one("all_reduce", torch.ones(1)), 1e-4)
        tally.poll([rec])
    rec.n += 1  # (the writer counted its entry and was preempted before storing it)
    tally.poll([rec])
    assert tally.ops["all_reduce"][M.COUNT] == 5
    rec.n -= 1
    _done(rec.one("all_reduce", torch.ones(1)), 1e-4)
    tally.poll([rec])
    assert tally.ops["all_reduce"][M.COUNT] == 6 and tally.missed == 0


def test_tally_counts_what_a_ring_dropped_and_paces_itself() -> None:
    rec, tally = _rec(cap=4), M.Tally()
    for _ in range(10):
        _done(rec.one("all_reduce", torch.ones(1)), 1e-4)
    wait = tally.poll([rec])
    assert tally.ops["all_reduce"][M.COUNT] == 4 and tally.missed == 6
    assert wait < 1.0  # (a busy ring is read sooner)
    assert M.Tally().poll([]) == 1.0  # (an idle one once a second)


def test_tally_reads_the_last_entries_of_a_destroyed_group() -> None:
    rec, tally = _rec(), M.Tally()
    tally.poll([rec])
    _done(rec.one("all_reduce", torch.ones(3)), 1e-4)
    del rec
    gc.collect()
    tally.poll([])
    assert tally.ops["all_reduce"][M.COUNT] == 1 and tally.ops["all_reduce"][M.BYTES] == 12
    assert tally._walks == {}  # (done with it)


def test_aggregate_keeps_a_ranks_counts_across_its_processes() -> None:
    agg = M.Aggregate()

    def snap(n: int, calls: int, step: int) -> dict[str, Any]:
        op = M._new_op()
        op[M.COUNT], op[M.BYTES], op[M.BUCKETS][2] = n, 4 * n, n
        return {"ops": {"all_reduce": op}, "rpc": {"call": [calls, 1]}, "missed": 0, "step": step}

    agg.update(1, 0, snap(5, 4, 7))
    agg.update(2, 1, snap(5, 4, 7))
    agg.retire(1)  # (rank 0's process is gone: its totals stay)
    agg.update(1, 0, snap(99, 99, 99))  # (a late line of the gone process: ignored)
    agg.update(3, 0, snap(2, 1, 3))  # (rank 0's next process)
    totals = agg.by_rank()
    assert totals[0]["ops"]["all_reduce"][M.COUNT] == 7 and totals[0]["ops"]["all_reduce"][M.BYTES] == 28
    assert totals[0]["ops"]["all_reduce"][M.BUCKETS][2] == 7
    assert totals[0]["rpc"]["call"] == [5, 2] and totals[0]["step"] == 3
    assert totals[1]["ops"]["all_reduce"][M.COUNT] == 5
    agg.retire(3)
    agg.retire(3)  # (once only)
    assert agg.by_rank()[0]["ops"]["all_reduce"][M.COUNT] == 7


def test_nodes_parts_add_up_by_rank() -> None:
    def totals(n: int, step: int | None) -> dict[str, Any]:
        op = M._new_op()
        op[M.COUNT], op[M.BYTES], op[M.BUCKETS][1] = n, 4 * n, n
        return {"ops": {"all_reduce": op}, "rpc": {"call": [n, 0]}, "missed": 1, "step": step}

    mine = {0: totals(5, 7), 1: totals(5, 7)}
    # another node: ranks 2 and 3, and what it saw of rank 1 before a re-rendezvous moved it here
    other = {"restarts": 1, "totals": {"1": totals(2, 3), "2": totals(4, 6), "3": totals(4, None)}}
    merged = M.merge_nodes(mine, [other, {"totals": {}}])
    assert sorted(merged) == [0, 1, 2, 3]
    assert merged[1]["ops"]["all_reduce"][M.COUNT] == 7 and merged[1]["ops"]["all_reduce"][M.BUCKETS][1] == 7
    assert merged[1]["rpc"]["call"] == [7, 0] and merged[1]["missed"] == 2
    assert merged[1]["step"] == 7  # (this node runs it: its step)
    assert merged[2]["step"] == 6 and merged[3]["step"] is None
    assert merged[0]["ops"]["all_reduce"][M.BYTES] == 20
    assert mine[0]["ops"]["all_reduce"][M.COUNT] == 5  # (the inputs are left alone)


def test_rpc_counts_requests_by_kind() -> None:
    from tdist.rpc._message import MsgKind

    before = _calls.call_counts().get("fetch", (0, 0))
    _calls.count_sent(MsgKind.FETCH)
    _calls.count_sent(MsgKind.FETCH)
    _calls.count_failed(MsgKind.FETCH)
    assert _calls.call_counts()["fetch"] == (before[0] + 2, before[1] + 1)


def test_metrics_port_without_the_library_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.elastic import LaunchError
    from tdist.elastic._metrics_server import MetricsServer

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (import raises ImportError)
    with pytest.raises(LaunchError, match=r"pip install 'tdist\[metrics\]'"):
        MetricsServer("127.0.0.1", 0, {})


def test_metrics_port_flag_and_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tdist.cli import build_parser

    monkeypatch.delenv("TDIST_METRICS_PORT", raising=False)
    ns = build_parser().parse_args(["run", "x.py"])
    assert ns.metrics_port is None and ns.metrics_addr == "0.0.0.0"
    assert build_parser().parse_args(["run", "--metrics-port", "9400", "x.py"]).metrics_port == 9400
    monkeypatch.setenv("TDIST_METRICS_PORT", "0")
    assert build_parser().parse_args(["run", "x.py"]).metrics_port == 0
    assert build_parser().parse_args(["run", "--metrics_port", "9401", "x.py"]).metrics_port == 9401
    monkeypatch.setenv("TDIST_METRICS_PORT", "http")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "x.py"])
    assert "expected a port number, got 'http'" in capsys.readouterr().err


def test_current_op_is_the_oldest_operation_in_flight() -> None:
    a, b = _rec(), _rec()
    a.identify(name="pg_a")
    b.identify(name="pg_b")
    _done(a.one("all_reduce", torch.ones(1)), 1e-4)
    assert F.current_op([a, b]) is None
    waiting = b.one("broadcast", torch.ones(1))
    a.one("all_reduce", torch.ones(1))  # (in flight too, but issued later)
    assert F.current_op([a, b]) == {"name": "broadcast", "group": "pg_b", "since": waiting[F.CREATED] / 1e9}
    _done(waiting, 1e-3)
    op = F.current_op([a, b])
    assert op is not None and op["group"] == "pg_a"
    F.Recorder.failed(a.live(1)[0], RuntimeError("lost"))  # (a failed one is not in flight)
    assert F.current_op([a, b]) is None


def test_the_endpoint_sheds_its_oldest_connections_and_drops_silent_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # the endpoint is open to whoever can connect: connections that stay open (half a request,
    # then nothing) cannot pile up threads nor keep a scraper out
    import socket
    import threading
    import time
    import urllib.request

    from tdist.elastic import _metrics_server as S

    assert S._Quiet.timeout is not None and S._Quiet.timeout <= 30  # (a silent client's read limit)
    server = S.MetricsServer("127.0.0.1", 0, {"run_id": "t"})
    idle: list[socket.socket] = []
    try:
        base = threading.active_count()
        for _ in range(3 * S._CLIENTS):
            c = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # (< the read limit)
            c.sendall(b"GET /metr")
            idle.append(c)
        for c in idle[: 2 * S._CLIENTS]:  # shed by the newer ones: closed unanswered, at once
            assert c.recv(1) == b""
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=20).read()
        assert b"tdist_job_info" in body  # (a scrape sheds the oldest idle one: it gets in)
        deadline = time.monotonic() + 10
        while threading.active_count() > base + S._CLIENTS:  # (a shed one's thread ends with it)
            assert time.monotonic() < deadline, threading.active_count() - base
            time.sleep(0.02)
        # silent past the read limit: closed (1 s here)
        monkeypatch.setattr(S._Quiet, "timeout", 1.0)
        late = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        idle.append(late)
        late.sendall(b"GET /metr")
        assert late.recv(1) == b""
    finally:
        for c in idle:
            c.close()
        server.close()
