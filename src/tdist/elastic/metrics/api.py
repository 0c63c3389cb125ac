"""``torch.distributed.elastic.metrics.api``'s names (implemented in ``_api``)."""

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
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]
