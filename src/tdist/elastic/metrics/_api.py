"""torchelastic's metrics API: named values in groups, each group sent to its handler.

Theory of operation. ``put_metric(name, value, group)`` makes a ``MetricData`` (a wall-clock
timestamp, the group, the name, the value) and hands it to the handler configured for the group,
or else to the default handler, which is ``NullMetricHandler`` until ``configure(handler)``
replaces it: unless a program asks for metrics, a metric costs one dictionary look-up and a
call that does nothing. ``@prof`` times a function and puts ``<name>.success`` or
``<name>.failure`` and ``<name>.duration.ms``. The group ``torchelastic`` is the launcher's.

This is torch's API, not tdist's Prometheus endpoint (``tdist run --metrics-port``, in
``tdist.elastic._metrics``): that one counts what the process groups do; this one carries what a
program, or the launcher, chooses to put. A handler may forward to anything.

Thread safety: ``configure`` and ``put_metric`` may be called from any thread; a handler is
called in the thread that puts the metric, and must be thread-safe if metrics are put from
several.
"""

from __future__ import annotations

import abc
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, ParamSpec, TypeVar, overload

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

_P = ParamSpec("_P")
_R = TypeVar("_R")


class MetricData(NamedTuple):
    """One value of a metric: ``timestamp`` (seconds since the epoch), ``group_name``, ``name``,
    ``value``."""

    timestamp: float
    group_name: str
    name: str
    value: Any


class MetricsConfig:
    """Parameters of a metrics set-up (torch's placeholder: ``initialize_metrics`` takes one).

    Args:
        params: the parameters (default: none).
    """

    __slots__ = ("params",)

    def __init__(self, params: dict[str, str] | None = None) -> None:
        self.params = {} if params is None else params


class MetricHandler(abc.ABC):
    """Where the values of a group of metrics go."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None:
        """Take one value."""


class ConsoleMetricHandler(MetricHandler):
    """Prints each value to stdout as ``[<timestamp>][<group>]: <name>=<value>``."""

    def emit(self, metric_data: MetricData) -> None:
        print(f"[{metric_data.timestamp}][{metric_data.group_name}]: {metric_data.name}={metric_data.value}")


class NullMetricHandler(MetricHandler):
    """Drops every value (the default handler)."""

    def emit(self, metric_data: MetricData) -> None:
        pass


class MetricStream:
    """The metrics of one group, bound to the handler configured for it when it was made.

    Args:
        group_name: the group.
        handler: its handler.
    """

    def __init__(self, group_name: str, handler: MetricHandler) -> None:
        self.group_name = group_name
        self.handler = handler

    def add_value(self, metric_name: str, metric_value: Any) -> None:
        """Send one value of ``metric_name``, stamped now, to the handler."""
        self.handler.emit(MetricData(time.time(), self.group_name, metric_name, metric_value))


_metrics_map: dict[str, MetricHandler] = {}
_default_metrics_handler: MetricHandler = NullMetricHandler()


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Send the metrics of ``group`` to ``handler`` (no group: every group without a handler
    of its own).

    Args:
        handler: the handler.
        group: the group, or None for the default.
    """
    global _default_metrics_handler
    if group is None:
        _default_metrics_handler = handler
    else:
        _metrics_map[group] = handler


def getStream(group: str) -> MetricStream:  # (torch's name)
    """The stream of ``group``, with the handler configured for it now.

    Args:
        group: the group.

    Returns:
        Its stream.
    """
    return MetricStream(group, _metrics_map.get(group, _default_metrics_handler))


def put_metric(metric_name: str, metric_value: Any, metric_group: str = "torchelastic") -> None:
    """Put one value of a metric.

    Args:
        metric_name: the metric.
        metric_value: its value (torch's handlers expect an int).
        metric_group: its group (``torchelastic``: the launcher's).
    """
    getStream(metric_group).add_value(metric_name, metric_value)


def get_elapsed_time_ms(start_time_in_seconds: float) -> int:
    """Milliseconds since ``start_time_in_seconds`` (a ``time.time()``), as an int.

    Args:
        start_time_in_seconds: the start, in seconds since the epoch.

    Returns:
        The elapsed milliseconds, truncated.
    """
    return int((time.time() - start_time_in_seconds) * 1000)


def _metric_name(fn: Callable[..., Any]) -> str:
    """``Class.method`` (the qualified name) for a method, ``<leaf module>.<function>`` for a
    function of a module."""
    qualname: str = fn.__qualname__
    if "." in qualname:
        return qualname
    module = getattr(fn, "__module__", None)
    return f"{module.rsplit('.', 1)[-1]}.{qualname}" if module else qualname


def _timed(fn: Callable[_P, _R], name: str, group: str) -> Callable[_P, _R]:
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        start = time.perf_counter()  # (a duration: the monotonic clock)
        try:
            result = fn(*args, **kwargs)
            put_metric(f"{name}.success", 1, group)
        except Exception:
            put_metric(f"{name}.failure", 1, group)
            raise
        finally:
            put_metric(f"{name}.duration.ms", int((time.perf_counter() - start) * 1000), group)
        return result

    return wrapper


@overload
def prof(fn: Callable[_P, _R], group: str = "torchelastic") -> Callable[_P, _R]: ...
@overload
def prof(fn: None = None, group: str = "torchelastic") -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...
def prof(
    fn: Callable[_P, _R] | None = None, group: str = "torchelastic"
) -> Callable[_P, _R] | Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorator: each call puts ``<name>.success`` (1) or ``<name>.failure`` (1, the exception
    propagating) and ``<name>.duration.ms`` in ``group``. The name is the function's qualified
    name (``Class.method``), or ``<leaf module>.<function>`` for a module's function.

    Usage: ``@prof`` or ``@prof(group="agent")``.

    Args:
        fn: the function (None: returns the decorator, with ``group``).
        group: the metrics' group.

    Returns:
        The wrapped function, or the decorator.
    """

    def wrap(f: Callable[_P, _R]) -> Callable[_P, _R]:
        return _timed(f, _metric_name(f), group)

    return wrap(fn) if fn is not None else wrap


def profile(group: str | None = None) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Deprecated (use ``prof``): a decorator putting ``<function>.success``/``.failure`` and
    ``<function>.duration.ms`` (the bare function name) in ``group``.

    Args:
        group: the metrics' group.

    Returns:
        The decorator.
    """
    warnings.warn("Deprecated, use `@prof` instead", FutureWarning, stacklevel=2)

    def wrap(f: Callable[_P, _R]) -> Callable[_P, _R]:
        return _timed(f, f.__name__, str(group))

    return wrap


def publish_metric(metric_group: str, metric_name: str, metric_value: Any) -> None:
    """Deprecated (use ``put_metric``): put one value of ``metric_name`` in ``metric_group``.

    Args:
        metric_group: the group.
        metric_name: the metric.
        metric_value: its value.
    """
    warnings.warn(
        "Deprecated, use `put_metric(metric_group)(metric_name, metric_value)` instead", FutureWarning, stacklevel=2
    )
    getStream(metric_group).add_value(metric_name, metric_value)
