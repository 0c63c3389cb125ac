"""Metrics (``torch.distributed.elastic.metrics`` under tdist's name): a program, or the
launcher, puts named values in groups, and each group goes to the handler configured for it
(by default none: values are dropped)::

    from tdist.elastic import metrics

    metrics.configure(metrics.ConsoleMetricHandler(), group="my_app")
    metrics.put_metric("batches", 1, "my_app")   # [1718000000.1][my_app]: batches=1

    @metrics.prof(group="my_app")                # my_app: train.success, train.duration.ms
    def train(): ...

``tdist run`` puts torchrun's launcher metrics in the group ``torchelastic``
(``workers.<role>.remaining_restarts``, ``.run_total``, ``.run_success_no_retries``, ...),
which a program launched with ``tdist.launcher.elastic_launch`` sees with its handler. This is
not the Prometheus endpoint of ``tdist run --metrics-port`` (the process groups' counts).
"""

from __future__ import annotations

from . import api
from ._api import (
    ConsoleMetricHandler,
    MetricData,
    MetricHandler,
    MetricsConfig,
    MetricStream,
    NullMetricHandler,
    configure,
    get_elapsed_time_ms,
    getStream,
    prof,
    profile,
    publish_metric,
    put_metric,
)

__all__ = [
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "MetricStream",
    "MetricsConfig",
    "NullMetricHandler",
    "api",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]


def initialize_metrics(cfg: MetricsConfig | None = None) -> None:
    """Torch's hook for a site's metrics set-up: does nothing (``configure`` sets handlers).

    Args:
        cfg: ignored.
    """
