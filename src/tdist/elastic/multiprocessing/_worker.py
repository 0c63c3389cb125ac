"""A Python function run in a new process: ``python -u -m tdist.elastic.multiprocessing._worker
CALL RESULT``, for ``start_processes`` and ``elastic_launch``.

``CALL`` is a call file (``_call.write_call``): the launching program is prepared as
``multiprocessing``'s ``spawn`` prepares it, then the function runs under ``@record`` (an
exception that escapes it goes to ``TORCHELASTIC_ERROR_FILE``, where the launcher reads it) and
its return value is written, pickled, to ``RESULT``, whole or not at all.
"""

from __future__ import annotations

import contextlib
import multiprocessing.spawn
import os
import pickle
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> None:
    from ._call import is_fd_path
    from .errors import record

    call, result = argv
    with open(call, "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))
        fn, args, macros = pickle.load(f)
    if macros:  # (a launcher's worker: torchrun's macro, as torch's agent substitutes it)
        from .._policy import substitute_local_rank

        args = tuple(substitute_local_rank(args, os.environ.get("LOCAL_RANK", "")))
    if is_fd_path(result):  # (a file of memory this process inherited, empty: written in place)
        value = record(fn)(*args)
        with open(result, "wb") as f:
            pickle.dump(value, f)
        return
    with contextlib.suppress(FileNotFoundError):  # (an earlier attempt's value is not this one's)
        os.unlink(result)
    value = record(fn)(*args)
    partial = f"{result}.partial"
    with open(partial, "wb") as f:
        pickle.dump(value, f)
    os.replace(partial, result)  # (whole or absent)


if __name__ == "__main__":
    main(sys.argv[1:])
