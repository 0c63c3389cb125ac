"""A worker of ``elastic_launch`` with a Python function: ``python -m tdist.launcher._worker
CALL RESULTS``.

``CALL`` holds two pickles: the launching program's ``multiprocessing`` preparation data (its
main module, path and working directory, as ``spawn`` gives its children: a function of the
launching script is found in its ``__mp_main__``), then ``(function, args)``. The function runs
under ``@record`` (an exception that escapes it goes to ``TORCHELASTIC_ERROR_FILE`` for the
launcher's report) and its return value is written, pickled, to ``RESULTS/<RANK>.pkl``.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> None:
    from ..elastic.multiprocessing.errors import record

    call, results = argv
    with open(call, "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))
        fn, args = pickle.load(f)
    value = record(fn)(*args)
    rank = os.environ["RANK"]
    partial = os.path.join(results, f"{rank}.pkl.partial")
    with open(partial, "wb") as f:
        pickle.dump(value, f)
    os.replace(partial, os.path.join(results, f"{rank}.pkl"))  # (whole or absent)


if __name__ == "__main__":
    main(sys.argv[1:])
