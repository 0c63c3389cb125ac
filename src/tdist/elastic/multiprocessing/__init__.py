"""``tdist.elastic.multiprocessing``: the module path of ``torch.distributed.elastic.multiprocessing``.

Its ``errors.record`` (which workers under ``tdist run`` use as under torchrun), ``Std`` (which
of a worker's streams), and ``DefaultLogsSpecs``, where a launch's logs go (its directory,
redirects, tee and local ranks filter), for ``tdist.launcher.api.LaunchConfig(logs_specs=...)``.
tdist's launcher lays the directory out as torch's does: ``<log_dir>/<run id>_<random>/
attempt_<n>/<local rank>/`` with ``stdout.log``, ``stderr.log`` and ``error.json``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

from .._policy import Std, to_map

__all__ = ["DefaultLogsSpecs", "LogsSpecs", "Std", "to_map"]


class LogsSpecs:
    """Where a launch's worker logs go (torch's base class)."""

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)


class DefaultLogsSpecs(LogsSpecs):
    """torch's default: ``log_dir`` made if missing (a new temporary one when not given;
    ``os.devnull``: no files at all)."""

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if log_dir != os.devnull:
            if not log_dir:
                log_dir = tempfile.mkdtemp(prefix="torchelastic_")
            elif os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir: {log_dir} is a file")
            else:
                os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
