"""The launcher's metrics endpoint (``tdist run --metrics-port``): Prometheus's text format and
OpenMetrics at ``http://HOST:PORT/metrics``, served with the Prometheus client library
(``prometheus_client``, the optional extra ``tdist[metrics]``; the workers never need it).

Theory of operation. The agent makes a socket pair per worker it starts (``connect``): one end
goes to the worker (``TDIST_METRICS_FD``), where ``_metrics.Reporter`` writes its totals; this
side's end is read by one thread of ours, which feeds an ``_metrics.Aggregate``. A scrape
(``collect``, in the HTTP server's thread) first asks every worker that has said hello for its
totals as of now (a request number on its socket) and waits for their answers, up to
``_ANSWER_WAIT`` seconds (a stopped worker's last totals serve then), so that a scrape sees every
operation issued before it. When a worker exits (``exited``), what it wrote last is read and
its totals join its rank's base: counters only grow across restarts. The agent also says which
attempt runs (``attempt``: ``tdist_restarts_total``) and each worker's fate (the up and state
gauges).

A job of several nodes has one view: each node's launcher publishes its part (``snapshot``:
its ranks' totals, workers and restarts) in the job's store once a second, beside its status
rows, and once more as it leaves; it reads the other nodes' parts from there and hands them to
its endpoint (``set_others``). Every node's endpoint then serves the whole job, its own ranks
fresh as of the scrape and the other nodes' as of their last publication (at most about a second
old); scrape one of them (a rank's series would come once from each node scraped).
``_metrics.merge_nodes`` adds the parts up by rank. A node that left keeps its counts in the
job's (counters never go down); its workers are not shown once its part is ``_STALE``.

Thread-safety: the agent's thread calls ``connect``/``started``/``exited``/``attempt``/
``snapshot``/``set_others``/``close``; the reader and the HTTP threads share the state under
``_lock``.

Open to whoever can connect (no secret: a scraper has none), so what a client can hold is
bounded: at most ``_CLIENTS`` connections are served at once (one thread each; a new one sheds
the oldest), and each has ``_IDLE_LIMIT`` seconds for every read and write of its exchange.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ._agent import LaunchError
from ._inspect import STALE as _STALE  # (a node's part older than this: its workers are not shown)
from ._metrics import (
    BUCKETS,
    BYTES,
    COUNT,
    ERRORS,
    LATENCY_BUCKETS,
    LATENCY_SUM,
    Aggregate,
    merge_nodes,
)

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = ["MetricsServer"]

log = logging.getLogger(__name__)

_ANSWER_WAIT = 1.0  # seconds a scrape waits for the workers' fresh totals
_READ_CHUNK = 1 << 16
_STATES = ("running", "succeeded", "failed", "stopped")
_CLIENTS = 16  # connections served at once (a scraper keeps one); a new one sheds the oldest
_IDLE_LIMIT = 10.0  # seconds a client has for each read and write (its request, our answer)


@dataclass
class _Conn:
    """One worker's socket and what it said."""

    worker: int
    rank: int
    local_rank: int
    sock: socket.socket
    child: socket.socket | None  # (the worker's end, until it started)
    pid: int | None = None
    state: str = "running"
    hello: bool = False  # (it answers requests: it imported tdist)
    answered: int = 0  # the last request it answered
    buf: bytearray = field(default_factory=bytearray)
    closed: bool = False


class _Server(ThreadingMixIn, WSGIServer):
    """One thread a connection, at most ``_CLIENTS`` connections: a new one past that sheds the
    oldest (as the store sheds its oldest idle connection), so a client that keeps connections
    open cannot keep a scraper out, and idle connections cannot pile up threads."""

    daemon_threads = True
    request_queue_size = 64  # (the listen backlog; socketserver's 5 drops a burst's connections for 1 s)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._live: dict[Any, None] = {}  # the connections being served, oldest first
        self._live_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._live_lock:
            if len(self._live) >= _CLIENTS:
                oldest = next(iter(self._live))
                del self._live[oldest]
                with contextlib.suppress(OSError):  # (its thread ends as its socket does)
                    oldest.shutdown(socket.SHUT_RDWR)
            self._live[request] = None
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._live_lock:
                self._live.pop(request, None)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    timeout = _IDLE_LIMIT  # (the socket's: a silent client's thread ends, its connection closed)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """The endpoint and the workers' channels (see the module docstring).

    Args:
        addr: the address to listen on (``""`` or ``0.0.0.0``: every IPv4 interface).
        port: the port (0: a free one; see ``port``).
        job: constant labels of ``tdist_job_info`` (run id, entrypoint, node rank).

    Raises:
        LaunchError: ``prometheus_client`` is not installed, or the port cannot be listened on.
    """

    def __init__(self, addr: str, port: int, job: dict[str, str]) -> None:
        try:
            from prometheus_client import CollectorRegistry, make_wsgi_app
        except ImportError as exc:
            raise LaunchError(
                "--metrics-port needs the Prometheus client library: pip install 'tdist[metrics]' "
                "(or prometheus-client)"
            ) from exc
        self._job = job
        self._lock = threading.Lock()
        self._answers = threading.Condition(self._lock)
        self._agg = Aggregate()
        self._conns: dict[int, _Conn] = {}
        self._current: dict[int, int] = {}  # rank -> its newest worker
        self._ids = itertools.count(1)
        self._requests = itertools.count(1)
        self._restarts = 0
        self._others: list[dict[str, Any]] = []  # the other nodes' parts of the job (``set_others``)
        self._closed = False
        self._commands: deque[tuple[str, int]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(cast("Collector", self))  # (a collector: it has ``collect``)
        try:
            server_class = _Server6 if ":" in addr else _Server
            self._httpd = make_server(addr or "0.0.0.0", port, make_wsgi_app(registry), server_class, _Quiet)
        except OSError as exc:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise LaunchError(f"--metrics-port {port}: cannot listen on {addr or '0.0.0.0'}:{port}: {exc}") from exc
        self.port: int = self._httpd.server_port
        self._http = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="tdist-metrics-http", daemon=True,
        )
        self._http.start()
        self._reader = threading.Thread(target=self._read_loop, name="tdist-metrics-reader", daemon=True)
        self._reader.start()

    # -- the agent's calls ---------------------------------------------------------------------
    def connect(self, rank: int, local_rank: int) -> tuple[int, int]:
        """A channel for a worker about to start: its id and the descriptor the worker gets
        (``TDIST_METRICS_FD``; pass it to the process, then call ``started``)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.setblocking(False)
        worker = next(self._ids)
        with self._lock:
            previous = self._conns.get(self._current.get(rank, 0))
            if previous is not None and previous.closed:  # (retired already: no longer shown)
                del self._conns[previous.worker]
            self._conns[worker] = _Conn(worker, rank, local_rank, mine, theirs)
            self._current[rank] = worker
        self._command("add", worker)
        return worker, theirs.fileno()

    def started(self, worker: int, pid: int | None) -> None:
        """Worker ``worker`` runs as ``pid`` (None: it could not start)."""
        with self._lock:
            conn = self._conns.get(worker)
            if conn is None:
                return
            if conn.child is not None:
                conn.child.close()
                conn.child = None
            conn.pid = pid
            conn.state = "running" if pid is not None else "failed"
        if pid is None:
            self._command("retire", worker)

    def exited(self, worker: int, returncode: int, stopped_by_agent: bool) -> None:
        """Worker ``worker`` exited: its last totals join its rank's."""
        with self._lock:
            conn = self._conns.get(worker)
            if conn is not None:
                conn.state = "succeeded" if returncode == 0 else "stopped" if stopped_by_agent else "failed"
        self._command("retire", worker)

    def attempt(self, restarts: int, node_rank: int) -> None:
        """The worker group's attempt now starting: the restarts so far, and this node's rank
        (a rendezvous may give another one each round)."""
        with self._lock:
            self._restarts = restarts
            self._job = dict(self._job, node=str(node_rank))

    def snapshot(self) -> dict[str, Any]:
        """This node's part of the job, for the other nodes' endpoints (JSON-able): its ranks'
        totals as its workers last wrote them, its workers' states and its restarts."""
        with self._lock:
            return {
                "restarts": self._restarts,
                "workers": [[c.rank, c.local_rank, c.state] for c in self._current_conns()],
                "totals": {str(rank): t for rank, t in self._agg.by_rank().items()},
            }

    def set_others(self, parts: list[dict[str, Any]]) -> None:
        """The other nodes' parts (their ``snapshot``s with their ``time``), served with ours:
        every part's counts, the workers of the fresh ones only."""
        with self._lock:
            self._others = list(parts)

    def _current_conns(self) -> list[_Conn]:
        """(``_lock`` held.) Each rank's newest worker here, by rank."""
        return [self._conns[w] for _, w in sorted(self._current.items())]

    def close(self) -> None:
        """Stop serving and reading."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._answers.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._wake()
        self._reader.join(2.0)
        with self._lock:
            for conn in self._conns.values():
                for s in (conn.sock, conn.child):
                    if s is not None:
                        s.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the reader thread ---------------------------------------------------------------------
    def _command(self, what: str, worker: int) -> None:
        with self._lock:
            self._commands.append((what, worker))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _read_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    if key.fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self._wake_r, 256):
                                pass
                    else:
                        self._receive(key.data, sel)
                with self._lock:
                    if self._closed:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for what, worker in commands:
                    conn = self._conns.get(worker)
                    if conn is None:
                        continue
                    if what == "add":
                        if not conn.closed:
                            sel.register(conn.sock, selectors.EVENT_READ, conn)
                    else:  # (retire: the process is gone, so all it wrote is here)
                        if not conn.closed:
                            self._receive(conn, sel)
                        with self._lock:
                            self._agg.retire(worker)
                            self._close_conn(conn, sel)
                            if self._current.get(conn.rank) != worker:  # (its rank has a newer worker)
                                del self._conns[worker]
        finally:
            sel.close()

    def _receive(self, conn: _Conn, sel: selectors.BaseSelector) -> None:
        """Read what worker ``conn`` wrote and take its lines in."""
        eof = False
        while True:
            try:
                data = conn.sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if not data:
                eof = True
                break
            conn.buf += data
        *lines, rest = bytes(conn.buf).split(b"\n")
        conn.buf = bytearray(rest)
        with self._lock:
            for line in lines:
                try:
                    snap = json.loads(line)
                except ValueError:
                    log.warning("rank %d: an unreadable metrics line: %r", conn.rank, line[:200])
                    continue
                if conn.pid is not None and snap.get("pid") not in (None, conn.pid):
                    continue  # (a child the worker forked, which inherited the socket)
                self._agg.update(conn.worker, conn.rank, snap)
                conn.hello = True
                if snap.get("reply"):
                    conn.answered = max(conn.answered, int(snap["reply"]))
            if eof:
                self._close_conn(conn, sel)
            self._answers.notify_all()

    def _close_conn(self, conn: _Conn, sel: selectors.BaseSelector) -> None:
        """(``_lock`` held.)"""
        if conn.closed:
            return
        conn.closed = True
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)
        conn.sock.close()

    # -- a scrape ------------------------------------------------------------------------------
    def _fresh(self) -> None:
        """Ask every worker that answers for its totals as of now, and wait for them."""
        with self._lock:
            request = next(self._requests)
            asked = []
            for conn in self._conns.values():
                if conn.hello and not conn.closed:
                    try:
                        conn.sock.send(b"%d\n" % request)
                        asked.append(conn)
                    except OSError:
                        pass
            deadline = time.monotonic() + _ANSWER_WAIT
            while not self._closed and any(c.answered < request and not c.closed for c in asked):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [c.rank for c in asked if c.answered < request and not c.closed]
                    log.info("metrics: ranks %s did not answer within %g s; their last totals serve", late, _ANSWER_WAIT)
                    break
                self._answers.wait(left)

    def collect(self) -> Iterator[Any]:
        """The metrics, as ``prometheus_client`` asks a collector for them."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        self._fresh()
        with self._lock:
            others = self._others  # (every node's counts stay in the job's, a node gone too)
            totals = merge_nodes(self._agg.by_rank(), others)
            restarts, job = max([self._restarts, *(int(o.get("restarts", 0)) for o in others)]), self._job
            states = {c.rank: (c.local_rank, c.state) for c in self._current_conns()}
        now = time.time()  # (the workers of a node that no longer publishes are not shown)
        for part in (o for o in others if now - float(o.get("time", 0.0)) <= _STALE):
            for rank, local_rank, st in part.get("workers", []):
                if int(rank) not in states or (st == "running" and states[int(rank)][1] != "running"):
                    states[int(rank)] = (int(local_rank), str(st))
        workers = [(rank, local_rank, st) for rank, (local_rank, st) in sorted(states.items())]
        yield InfoMetricFamily("tdist_job", "The job this launcher runs", value=job)
        restarts_metric = CounterMetricFamily(
            "tdist_restarts", "Restarts of the worker group after a failure (tdist run --max-restarts)",
        )
        restarts_metric.add_metric([], restarts)
        yield restarts_metric
        up = GaugeMetricFamily("tdist_worker_up", "Whether the rank's worker process runs", labels=["rank", "local_rank"])
        state = GaugeMetricFamily(
            "tdist_worker_state", "The rank's worker: 1 for its state (running, succeeded, failed, stopped by "
            "the launcher), 0 for the others", labels=["rank", "state"],
        )
        for rank, local_rank, st in workers:
            up.add_metric([str(rank), str(local_rank)], 1.0 if st == "running" else 0.0)
            for s in _STATES:
                state.add_metric([str(rank), s], 1.0 if s == st else 0.0)
        yield up
        yield state
        ops = CounterMetricFamily(
            "tdist_collective_ops", "Collective and point-to-point operations issued", labels=["rank", "op"],
        )
        nbytes = CounterMetricFamily(
            "tdist_collective_bytes", "Bytes of the operations' input tensors (a receive's: the tensor received into)",
            labels=["rank", "op"],
        )
        errors = CounterMetricFamily("tdist_collective_errors", "Operations that failed", labels=["rank", "op"])
        latency = HistogramMetricFamily(
            "tdist_collective_latency_seconds", "Operations' time from issue to completion (queueing included)",
            labels=["rank", "op"],
        )
        missed = CounterMetricFamily(
            "tdist_collective_unread",
            "Operations the metrics could not read: their flight-record ring lapped the reader",
            labels=["rank"],
        )
        calls = CounterMetricFamily(
            "tdist_rpc_calls", "RPC requests sent (call: rpc_sync/rpc_async, remote, fetch: to_here, join)",
            labels=["rank", "kind"],
        )
        rpc_errors = CounterMetricFamily(
            "tdist_rpc_errors", "RPC requests that ended with an error (the callee's exception, a timeout, "
            "a lost peer)", labels=["rank", "kind"],
        )
        step = GaugeMetricFamily(
            "tdist_progress_step", "The last step the rank reported (tdist.elastic.report_progress)", labels=["rank"],
        )
        bounds = [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]  # (as Prometheus's Go writes them)
        for rank, t in sorted(totals.items()):
            r = str(rank)
            for op, s in sorted(t.get("ops", {}).items()):
                ops.add_metric([r, op], s[COUNT])
                nbytes.add_metric([r, op], s[BYTES])
                errors.add_metric([r, op], s[ERRORS])
                cumulative = list(itertools.accumulate(s[BUCKETS]))
                latency.add_metric([r, op], list(zip(bounds, cumulative, strict=True)), s[LATENCY_SUM])
            missed.add_metric([r], t.get("missed", 0))
            for kind, (sent, failed) in sorted(t.get("rpc", {}).items()):
                calls.add_metric([r, kind], sent)
                rpc_errors.add_metric([r, kind], failed)
            if t.get("step") is not None:
                step.add_metric([r], float(t["step"]))
        yield from (ops, nbytes, errors, latency, missed, calls, rpc_errors, step)
