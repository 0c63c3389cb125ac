"""The pickled call of a Python function that a new process runs (``_worker``), for
``start_processes`` and ``elastic_launch``.

A call file holds two pickles (``write_call``): the launching program's ``multiprocessing``
preparation data (its main module, path and working directory, as ``spawn`` gives its children:
a function of the launching script is found in its ``__mp_main__``), then ``(function, args)``.
The worker writes the function's return value, pickled, to a value file (``read_result``).
"""

from __future__ import annotations

import multiprocessing.spawn
import pickle
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["WORKER_MODULE", "read_result", "worker_command", "write_call"]

#: The worker's module, as its ``python -m`` runs it (imported by nothing else: ``runpy``
#: warns about a module that its package imported before it ran).
WORKER_MODULE = "tdist.elastic.multiprocessing._worker"


def write_call(path: str, fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Write the call of ``fn(*args)`` to ``path`` for a worker.

    Raises:
        pickle.PicklingError, AttributeError, TypeError: ``fn`` or ``args`` cannot be pickled
            (the function must be importable by name, as for ``multiprocessing``'s spawn).
    """
    prep = multiprocessing.spawn.get_preparation_data("tdist-worker")
    prep.pop("authkey", None)  # (multiprocessing's own secret: not the workers' business)
    with open(path, "wb") as f:  # (the launching program's main module and path first)
        pickle.dump(prep, f)
        pickle.dump((fn, tuple(args)), f)


def worker_command(python: str, call: str, result: str) -> list[str]:
    """The argv of a worker that runs the call in ``call`` and writes its value to ``result``."""
    return [python, "-u", "-m", WORKER_MODULE, call, result]


def read_result(path: str) -> Any:
    """The value a worker wrote to ``path``; None if it wrote none (it ended its process
    itself with exit code 0, ``os._exit(0)``)."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
