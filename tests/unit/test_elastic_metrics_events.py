"""``tdist.elastic.metrics`` and ``tdist.elastic.events``: torch's APIs, checked beside torch's
own modules (the same metric names and values from the same calls, the same event JSON both
ways)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed.elastic.events as torch_events
import torch.distributed.elastic.metrics as torch_metrics

from tdist.elastic import events, metrics
from tdist.elastic.events import _api as events_api
from tdist.elastic.metrics import _api as metrics_api

pytestmark = pytest.mark.timeout(30)


class Collect(metrics.MetricHandler):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def emit(self, metric_data: Any) -> None:
        self.seen.append((metric_data.group_name, metric_data.name, metric_data.value))


class TorchCollect(torch_metrics.MetricHandler):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def emit(self, metric_data: Any) -> None:
        self.seen.append((metric_data.group_name, metric_data.name, metric_data.value))


@pytest.fixture(autouse=True)
def _fresh_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(metrics_api, "_metrics_map", {})
    monkeypatch.setattr(metrics_api, "_default_metrics_handler", metrics.NullMetricHandler())
    monkeypatch.setattr(torch_metrics.api, "_metrics_map", {})
    monkeypatch.setattr(torch_metrics.api, "_default_metrics_handler", torch_metrics.NullMetricHandler())
    monkeypatch.setattr(events_api, "_events_loggers", {})
    yield
    for destination in ("console", "null", "dynamic_rendezvous", "test"):
        logging.getLogger(f"tdist-events-{destination}").handlers.clear()


# -- metrics -------------------------------------------------------------------------------------
def _module_level() -> int:
    return 2


def _workload(m: Any) -> None:
    """The same calls on torch's module or ours."""
    m.put_metric("plain", 3)  # (group torchelastic)
    m.put_metric("mine", 7, "app")
    m.getStream("other").add_value("streamed", 1)

    @m.prof
    def step() -> int:
        return 1

    @m.prof(group="app")
    def broken() -> None:
        raise ValueError("no")

    class Trainer:
        @m.prof(group="app")
        def fit(self) -> None:
            pass

    step()
    assert m.prof(_module_level)() == 2
    with pytest.raises(ValueError):
        broken()
    Trainer().fit()


def test_metrics_go_to_their_groups_handlers_with_torchs_names_and_values() -> None:
    ours, default, theirs, their_default = Collect(), Collect(), TorchCollect(), TorchCollect()
    metrics.configure(default)
    metrics.configure(ours, group="app")
    torch_metrics.configure(their_default)
    torch_metrics.configure(theirs, group="app")
    _workload(metrics)
    _workload(torch_metrics)

    def timeless(seen: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
        return [(g, n, "ms" if n.endswith(".duration.ms") else v) for g, n, v in seen]

    assert timeless(ours.seen) == timeless(theirs.seen)
    assert timeless(default.seen) == timeless(their_default.seen)
    assert timeless(ours.seen) == [
        ("app", "mine", 7),
        ("app", "_workload.<locals>.broken.failure", 1),
        ("app", "_workload.<locals>.broken.duration.ms", "ms"),
        ("app", "_workload.<locals>.Trainer.fit.success", 1),
        ("app", "_workload.<locals>.Trainer.fit.duration.ms", "ms"),
    ]
    assert timeless(default.seen) == [
        ("torchelastic", "plain", 3),
        ("other", "streamed", 1),
        ("torchelastic", "_workload.<locals>.step.success", 1),
        ("torchelastic", "_workload.<locals>.step.duration.ms", "ms"),
        ("torchelastic", "test_elastic_metrics_events._module_level.success", 1),  # (leaf module.function)
        ("torchelastic", "test_elastic_metrics_events._module_level.duration.ms", "ms"),
    ]


def test_by_default_metrics_are_dropped_and_the_console_handler_prints_torchs_line(capsys: pytest.CaptureFixture[str]) -> None:
    metrics.put_metric("dropped", 1)
    assert capsys.readouterr().out == ""
    metrics.configure(metrics.ConsoleMetricHandler(), group="app")
    torch_metrics.configure(torch_metrics.ConsoleMetricHandler(), group="app")
    data = metrics.MetricData(12.5, "app", "loss", 3)
    metrics.ConsoleMetricHandler().emit(data)
    torch_metrics.ConsoleMetricHandler().emit(torch_metrics.MetricData(12.5, "app", "loss", 3))
    first, second = capsys.readouterr().out.splitlines()
    assert first == second == "[12.5][app]: loss=3"
    assert tuple(data) == (12.5, "app", "loss", 3) and data.group_name == "app"


def test_the_deprecated_helpers_warn_and_still_work() -> None:
    seen = Collect()
    metrics.configure(seen, group="old")
    with pytest.warns(FutureWarning):
        metrics.publish_metric("old", "n", 2)
    with pytest.warns(FutureWarning):
        deco = metrics.profile("old")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert deco(lambda: 5)() == 5
    assert seen.seen[0] == ("old", "n", 2) and seen.seen[1] == ("old", "<lambda>.success", 1)
    assert metrics.get_elapsed_time_ms(0) > 0 and metrics.MetricsConfig().params == {}


# -- events --------------------------------------------------------------------------------------
class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_events_json_is_torchs_both_ways() -> None:
    ours = events.Event("ckpt", events.EventSource.WORKER, timestamp=5, metadata={"step": 10, "ok": True, "x": None})
    theirs = torch_events.Event("ckpt", torch_events.EventSource.WORKER, timestamp=5, metadata={"step": 10, "ok": True, "x": None})
    assert ours.serialize() == theirs.serialize() == str(ours)
    assert events.Event.deserialize(theirs.serialize()) == ours
    assert torch_events.Event.deserialize(ours.serialize()) == theirs
    assert events.Event.deserialize(ours) is ours
    rdzv = events.RdzvEvent("n", "run", "m", "host", 7, events.NodeState.RUNNING, rank=1)
    assert rdzv.serialize() == torch_events.RdzvEvent("n", "run", "m", "host", 7, torch_events.NodeState.RUNNING, rank=1).serialize()
    assert events.RdzvEvent.deserialize(rdzv.serialize()) == rdzv


def test_record_sends_the_json_to_its_destinations_handler_only(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    got = Lines()
    monkeypatch.setitem(events_api._log_handlers, "test", got)
    event = events.Event("e", events.EventSource.AGENT)
    with caplog.at_level(logging.DEBUG):
        events.record(event, destination="test")
        events.record(event)  # (null: dropped)
    assert got.lines == [event.serialize()]
    for destination in ("test", "null"):  # (no propagation; pytest's own capture handler, which
        # it attaches to every non-propagating logger that exists as a test starts, aside)
        logger = logging.getLogger(f"tdist-events-{destination}")
        assert not logger.propagate and events_api._log_handlers[destination] in logger.handlers
    assert events.get_logging_handler() is events.handlers.get_logging_handler("null")
    with pytest.raises(KeyError):
        events.record(event, destination="nowhere")


def test_a_rendezvous_event_is_built_only_for_a_real_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    events.construct_and_record_rdzv_event("run", "not recorded", events.NodeState.INIT)  # (null: returns)
    got = Lines()
    monkeypatch.setitem(events_api._log_handlers, "dynamic_rendezvous", got)
    events.construct_and_record_rdzv_event("run", "joined", events.NodeState.RUNNING, rank=2)
    try:
        raise RuntimeError("lost")
    except RuntimeError:
        events.construct_and_record_rdzv_event("run", "failed", events.NodeState.FAILED, name="step", pid=42)
    first, second = (events.RdzvEvent.deserialize(line) for line in got.lines)
    here = "test_elastic_metrics_events.py"
    assert (first.name, first.message, first.rank, first.error_trace) == (
        f"{here}:test_a_rendezvous_event_is_built_only_for_a_real_handler", "joined", 2, "",
    )
    assert first.hostname and first.pid > 0
    assert second.name == f"{here}:step" and second.pid == 42 and "RuntimeError: lost" in second.error_trace


def test_events_stay_out_of_the_programs_logs_after_a_logging_config() -> None:
    import logging.config

    event = events.Event("e", events.EventSource.AGENT)
    events.record(event)  # (its logger made)
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False, "loggers": {"tdist-events-null": {"propagate": True}}})
    logger = logging.getLogger("tdist-events-null")
    assert logger.propagate and not logger.handlers  # (what a program's logging configuration did)
    events.record(event)
    assert not logger.propagate and logger.handlers == [events.get_logging_handler("null")]
