"""The launcher's torchrun metrics and worker events (``tdist.elastic.metrics``/``.events``)
reach the handlers a program configured, in a real ``elastic_launch`` of a real worker."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tdist.elastic import events, metrics
from tdist.elastic.events import _api as events_api
from tdist.elastic.metrics import _api as metrics_api
from tdist.launcher.api import LaunchConfig, elastic_launch

pytestmark = pytest.mark.timeout(60)


class Collect(metrics.MetricHandler):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def emit(self, metric_data: Any) -> None:
        self.seen[metric_data.name] = metric_data.value


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[events.Event] = []
        self.rdzv: list[events.RdzvEvent] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.endswith("dynamic_rendezvous"):
            self.rdzv.append(events.RdzvEvent.deserialize(record.getMessage()))
        else:
            self.events.append(events.Event.deserialize(record.getMessage()))


@pytest.fixture
def collected(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Collect, Lines]]:
    seen, lines = Collect(), Lines()
    monkeypatch.setattr(metrics_api, "_metrics_map", {"torchelastic": seen})
    monkeypatch.setattr(events_api, "_events_loggers", {})
    monkeypatch.setitem(events_api._log_handlers, "test", lines)
    monkeypatch.setitem(events_api._log_handlers, "dynamic_rendezvous", lines)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")  # (launch_agent sets it)
    yield seen, lines
    for name in ("test", "dynamic_rendezvous"):
        logging.getLogger(f"tdist-events-{name}").handlers.clear()


def test_a_launch_puts_torchruns_metrics_and_records_each_workers_and_the_rendezvous_events(collected: tuple[Collect, Lines]) -> None:
    seen, lines = collected
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="metrics", rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", max_restarts=2, event_log_handler="test",
    )
    elastic_launch(config, sys.executable)("-c", "pass")
    role = "workers.default_role"
    assert {k: v for k, v in seen.seen.items() if k.startswith(role)} == {
        f"{role}.remaining_restarts": 2, f"{role}.succeeded": 1, f"{role}.flakiness": 0, f"{role}.run_total": 1,
        f"{role}.run_success_with_retries": 0, f"{role}.run_success_no_retries": 1,
        f"{role}.run_failed_with_retries": 0, f"{role}.run_failed_no_retries": 0,
    }
    agent = [(e.name, e.source) for e in lines.events[:2]]  # (the agent's own first, as torch's)
    assert agent == [
        ("torchelastic.worker.status.RENDEZVOUS", events.EventSource.AGENT),
        ("torchelastic.worker.status.ASSIGN_WORKER_RANKS", events.EventSource.AGENT),
    ]
    got = sorted((e.name, e.metadata["global_rank"]) for e in lines.events[2:])
    assert got == [
        ("torchelastic.worker.status.START", 0), ("torchelastic.worker.status.START", 1),
        ("torchelastic.worker.status.SUCCEEDED", 0), ("torchelastic.worker.status.SUCCEEDED", 1),
    ]
    first = lines.events[2]
    assert first.source is events.EventSource.WORKER and first.metadata["run_id"] == "metrics"
    assert first.metadata["role"] == "default_role" and json.loads(str(first.metadata["metadata"]))["local_rank"] in (0, 1)
    (joined,) = lines.rdzv  # (the c10d rendezvous's round, one node)
    assert joined.node_state is events.NodeState.SUCCEEDED and joined.run_id == "metrics" and joined.rank == 0
    assert joined.name == "_dynamic.py:next_rendezvous" and "joined round" in joined.message
