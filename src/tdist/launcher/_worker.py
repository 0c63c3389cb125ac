"""A worker that runs a Python function: ``python -m tdist.launcher._worker CALL RESULTS``
(``elastic_launch`` and ``LocalElasticAgent`` with a function entrypoint).

``CALL`` holds two pickles: the launching program's ``multiprocessing`` preparation data (its
main module, path and working directory, as ``spawn`` gives its children: a function of the
launching script is found in its ``__mp_main__``), then ``(function, args)``. ``${local_rank}``
in a ``str`` argument becomes the worker's local rank (torch's macro, substituted as torch's
agent does). The function runs under ``@record`` (an exception that escapes it goes to
``TORCHELASTIC_ERROR_FILE`` for the launcher's report) and its return value is written,
pickled, to ``RESULTS/<RANK>.pkl``.

The launcher's side is here too: ``write_call`` makes ``CALL`` and ``read_results`` reads the
values back.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import string
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["WORKER_MODULE", "main", "read_results", "write_call"]

#: the module a launcher runs (``python -m``) with ``write_call``'s arguments
WORKER_MODULE = "tdist.launcher._worker"


def write_call(results: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, str]:
    """Write the call of ``fn(*args)`` into the directory ``results``; returns the worker
    module's arguments (``CALL``, ``RESULTS``).

    Raises:
        pickle.PicklingError, AttributeError, TypeError: ``fn`` or ``args`` cannot be pickled.
    """
    payload = os.path.join(results, "call.pkl")
    prep = multiprocessing.spawn.get_preparation_data("tdist-worker")
    prep.pop("authkey", None)  # (multiprocessing's own secret: not the workers' business)
    with open(payload, "wb") as f:  # (the launching program's main module and path first)
        pickle.dump(prep, f)
        pickle.dump((fn, args), f)
    return payload, results


def read_results(results: str, ranks: Iterable[int]) -> dict[int, Any]:
    """The return values the workers of ``ranks`` wrote in ``results``, by rank.

    Raises:
        OSError: a worker wrote none (it did not succeed).
    """
    values = {}
    for rank in sorted(ranks):
        with open(os.path.join(results, f"{rank}.pkl"), "rb") as f:
            values[rank] = pickle.load(f)
    return values


def main(argv: Sequence[str]) -> None:
    from ..elastic.multiprocessing.errors import record

    call, results = argv
    with open(call, "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))
        fn, args = pickle.load(f)
    local_rank = os.environ.get("LOCAL_RANK", "")
    args = tuple(string.Template(a).safe_substitute(local_rank=local_rank) if isinstance(a, str) else a for a in args)
    value = record(fn)(*args)
    rank = os.environ["RANK"]
    partial = os.path.join(results, f"{rank}.pkl.partial")
    with open(partial, "wb") as f:
        pickle.dump(value, f)
    os.replace(partial, os.path.join(results, f"{rank}.pkl"))  # (whole or absent)


if __name__ == "__main__":
    main(sys.argv[1:])
