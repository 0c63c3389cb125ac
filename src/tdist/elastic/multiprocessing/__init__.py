"""``tdist.elastic.multiprocessing``: the module path of ``torch.distributed.elastic.multiprocessing``.

``start_processes`` starts ``n`` copies of a Python function or a program, one per local rank,
and returns a ``PContext`` (``MultiprocessContext``, ``SubprocessContext``) whose ``wait``
gives a ``RunProcsResult``: each function's return value, or the failures (torch's
``ProcessFailure``, with what the process's ``@record`` wrote to its error file). Where each
rank's streams go (the console, a file, or both: ``Std``, ``redirects`` and ``tee``) and where
its error file is are ``LogsSpecs.reify``'s ``LogsDest``; ``DefaultLogsSpecs`` lays them out as
torch's does: ``<log_dir>/<run id>_<random>/attempt_<n>/<local rank>/`` with ``stdout.log``,
``stderr.log`` and ``error.json``. ``tdist.launcher.api.LaunchConfig(logs_specs=...)`` reads the
same specs. ``errors.record`` is what workers under ``tdist run`` use as under torchrun.

``ProcessFailure`` and ``SignalException`` are torch's classes (loaded on first use: the
launcher imports this package without torch), so code that catches torch's catches these.
"""

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
    start_processes,
)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "start_processes",
    "to_map",
]


def __getattr__(name: str) -> Any:
    if name == "ProcessFailure":
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        return ProcessFailure
    if name == "SignalException":
        from torch.distributed.elastic.multiprocessing.api import SignalException

        return SignalException
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
