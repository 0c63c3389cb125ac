"""``tdist.flight_recorder``: what every process group did last, in torch's flight-recorder
format.

Every process group (tdist's API, and torch's groups on the ``"tdist"`` backend) keeps a ring of
its last operations per rank (``TDIST_FR_BUFFER_SIZE`` or torch's ``TORCH_FR_BUFFER_SIZE``,
2000 by default, 0 turns it off): sequence numbers, operation, group, sizes, dtypes, state and
times, and with ``TDIST_FR_STACK=1`` the Python stack of each call. RPC adds its calls in
flight (callee, call, age). Dumps are pickled dicts in the format of torch's own recorder, one
file per rank (``<prefix><global rank>``, the prefix from ``TDIST_FR_DUMP_TEMP_FILE`` or
``TORCH_FR_DUMP_TEMP_FILE``), so that torch's analyzer reads them::

    torchfrtrace /tmp/fr -p rank_        # (python -m torch.distributed.flight_recorder.fr_trace)

They are written on a collective's timeout and on a lost peer (by every rank of the group), on
``SIGUSR1`` (where the program has no handler of its own), and on demand: ``dump()`` writes this
process's, ``dump_all(path)`` asks every rank of a group to write its own. See
``tdist.c10d._flight_recorder`` and ``tdist.c10d._desync``.
"""

from __future__ import annotations

import os
from typing import Any

from .c10d import _flight_recorder as _fr

__all__ = ["dump", "dump_all", "dump_dict", "install_signal_handler"]

# (a package, for torch's analyzer under this path: ``tdist.flight_recorder.fr_trace`` and
# ``.components`` are torch's modules, ``_aliases``)
__path__: list[str] = []


def dump_dict(rank: int | None = None) -> dict[str, Any]:
    """This process's flight record in torch's format (``version``, ``pg_config``,
    ``pg_status``, ``entries``; ``rpc_in_flight`` while RPC runs).

    Args:
        rank: only the groups of this global rank (where ranks run as threads of one
            process); ``None``: every group.
    """
    return _fr.dump_dict(rank)


def dump(prefix: str | None = None) -> list[str]:
    """Write this process's flight record: one file per global rank it holds groups of.

    Args:
        prefix: files are ``<prefix><global rank>`` (default ``TDIST_FR_DUMP_TEMP_FILE``, then
            ``TORCH_FR_DUMP_TEMP_FILE``, then ``/tmp/nccl_trace_rank_``).

    Returns:
        The paths written.
    """
    return _fr.write_dumps(prefix)


def _prefix_for(path: str) -> str:
    if path.endswith(os.sep) or os.path.isdir(path):
        return os.path.join(path, "rank_")
    return path


def _backend_of(group: Any) -> Any:
    if group is None:
        from .c10d._group import current_world

        world = current_world()
        if world is None or world.default_pg is None:
            raise ValueError("dump_all: no default process group; call init_process_group first or pass group=")
        group = world.default_pg
    from .c10d._group import is_ours

    backend = group._get_backend() if is_ours(group) else getattr(group, "backend", None)
    if backend is None:
        raise ValueError(f"dump_all: {group!r} is not a process group of tdist's")
    return backend


def dump_all(path: str, group: Any = None, timeout: float = 10.0) -> list[str]:
    """Have every rank of ``group`` write its flight record, through the group's store (each
    rank's recorder answers from a thread of its own, whatever the rank is doing).

    Args:
        path: a directory (files ``<path>/rank_<global rank>``, what ``torchfrtrace <path>``
            reads) or a file prefix (``<path><global rank>``).
        group: a process group (tdist's, or torch's on the ``"tdist"`` backend); default: the
            default group.
        timeout: seconds to wait for the other ranks.

    Returns:
        The paths written (this rank's, and those of the ranks that answered in time).

    Raises:
        ValueError: no such group, or its recorder is off (``TDIST_FR_BUFFER_SIZE=0``).
    """
    backend = _backend_of(group)
    request = getattr(backend, "request_dumps", None)
    if request is None or getattr(backend, "flight_recorder", None) is None:
        raise ValueError("dump_all: the group keeps no flight record (TDIST_FR_BUFFER_SIZE=0, or its backend has none)")
    paths: list[str] = request(_prefix_for(path), timeout)
    return paths


def install_signal_handler() -> bool:
    """Dump on ``SIGUSR1`` (done by the first process group; call it from the main thread where
    groups are made elsewhere). Only where the program has no ``SIGUSR1`` handler of its own
    and ``TDIST_FR_SIGNAL`` is not 0. Returns whether tdist's handler is installed."""
    return _fr.install_signal_handler()
