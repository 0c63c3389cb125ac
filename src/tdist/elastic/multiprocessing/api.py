"""``torch.distributed.elastic.multiprocessing.api`` under tdist's name: the process contexts
of ``start_processes`` and where their logs go (see ``tdist.elastic.multiprocessing``)."""

from __future__ import annotations

from typing import Any

from .._policy import Std, to_map
from ._api import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SubprocessContext,
)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SignalException",  # noqa: F822 (torch's, from __getattr__)
    "Std",
    "SubprocessContext",
    "to_map",
]


def __getattr__(name: str) -> Any:
    if name == "SignalException":  # (torch's class, loaded on first use)
        from torch.distributed.elastic.multiprocessing.api import SignalException

        return SignalException
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
