"""The pickled call of a Python function that a new process runs (``_worker``), for
``start_processes`` and ``elastic_launch``.

A call file holds two pickles (``write_call``): the launching program's ``multiprocessing``
preparation data (its main module, path and working directory, as ``spawn`` gives its children:
a function of the launching script is found in its ``__mp_main__``), then ``(function, args,
macros)``: with ``macros`` (a launcher's worker, as torch's agent does), ``${local_rank}`` in a
``str`` argument becomes the worker's ``LOCAL_RANK``. The worker writes the function's return
value, pickled, to a value file (``read_result``). ``start_processes`` keeps both in files of memory
(``memfd``) that the worker inherits and opens by ``fd_path``: a kill -9 of the launching process
leaves no file behind.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "WORKER_MODULE", "fd_path", "is_fd_path", "launcher_call", "launcher_values", "read_result", "worker_command", "write_call",
]

#: The worker's module, as its ``python -m`` runs it (imported by nothing else: ``runpy``
#: warns about a module that its package imported before it ran).
WORKER_MODULE = "tdist.elastic.multiprocessing._worker"

_FD_DIR = "/proc/self/fd/"


def write_call(path: str, fn: Callable[..., Any], args: Sequence[Any], macros: bool = False) -> None:
    """Write the call of ``fn(*args)`` to ``path`` for a worker (``macros``: its ``str``
    arguments' ``${local_rank}`` is substituted there).

    Raises:
        pickle.PicklingError, AttributeError, TypeError: ``fn`` or ``args`` cannot be pickled
            (the function must be importable by name, as for ``multiprocessing``'s spawn).
    """
    prep = multiprocessing.spawn.get_preparation_data("tdist-worker")
    prep.pop("authkey", None)  # (multiprocessing's own secret: not the workers' business)
    with open(path, "wb") as f:  # (the launching program's main module and path first)
        pickle.dump(prep, f)
        pickle.dump((fn, tuple(args), macros), f)


def worker_command(python: str, call: str, result: str) -> list[str]:
    """The argv of a worker that runs the call in ``call`` and writes its value to ``result``."""
    return [python, "-u", "-m", WORKER_MODULE, call, result]


def fd_path(fd: int) -> str:
    """The name by which a process that inherited descriptor ``fd`` opens its file anew (a
    file of memory, ``memfd``: a call or value file that is on no disk)."""
    return f"{_FD_DIR}{fd}"


def is_fd_path(path: str) -> bool:
    return path.startswith(_FD_DIR)


def read_result(path: str) -> Any:
    """The value a worker wrote to ``path``; None if it wrote none (it ended its process
    itself with exit code 0, ``os._exit(0)``)."""
    try:
        with open(path, "rb") as f:
            if is_fd_path(path) and not f.peek(1):  # (an inherited file: empty until written)
                return None
            return pickle.load(f)
    except FileNotFoundError:
        return None


def launcher_call(results: str, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[str, str]:
    """A launcher's workers that run ``fn(*args)`` (``elastic_launch``, ``LocalElasticAgent``):
    the call file, written in the directory ``results``, and the value file, whose name holds
    torchrun's ``${local_rank}`` macro for the launcher to fill in for each worker; the worker
    module's two arguments."""
    from .._policy import LOCAL_RANK_MACRO

    payload = os.path.join(results, "call.pkl")
    write_call(payload, fn, args, macros=True)
    return payload, os.path.join(results, f"{LOCAL_RANK_MACRO}.pkl")


def launcher_values(results: str, exits: Iterable[Any]) -> dict[int, Any]:
    """The values of a launcher's workers (``launcher_call``) by global rank, from their exits
    (``rank``, ``local_rank``)."""
    return {e.rank: read_result(os.path.join(results, f"{e.local_rank}.pkl")) for e in sorted(exits, key=lambda e: e.rank)}
