"""Torch's intra-op parallelism, for the calling thread alone.

A rank of a process group is a busy thread already: when torch's copies and reductions inside
a collective start OpenMP threads beyond the free cores, the threads of one parallel region
wait for each other to be scheduled (64 MiB all_reduce of 2 processes on 2 cores: 650 ms with
torch's default 2 threads each, 12 ms with 1). So collectives cap the intra-op threads of the
thread that runs them.

Not with ``torch.set_num_threads``: that also sets torch's process-wide default, which threads
started meanwhile inherit and which a user thread may be setting at the same moment (our
restore would undo theirs). OpenMP keeps the thread count per thread (its ``nthreads-var``),
and torch reads the calling thread's (``omp_get_max_threads``): ``capped`` sets and restores
that of this thread only, through torch's own OpenMP runtime. Where that runtime cannot be
found, nothing is capped (slower on an oversubscribed machine, never wrong).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Callable, Iterator

import torch

__all__ = ["PARALLEL_BYTES", "capped"]

# torch runs an element-wise kernel on several threads from 32768 elements (its GRAIN_SIZE): a
# collective on fewer bytes than this never starts them, so it need not cap them
PARALLEL_BYTES = 32 << 10

_omp: Callable[[int], None] | bool | None = False  # (not looked up yet)


def _runtime() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch uses."""
    global _omp
    if _omp is False:
        _omp = None
        lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        paths = [*sorted(glob.glob(os.path.join(lib_dir, "libgomp*.so*"))), *sorted(glob.glob(os.path.join(lib_dir, "libiomp*.so*"))), None]
        for path in paths:
            try:
                set_threads = ctypes.CDLL(path).omp_set_num_threads  # (loaded by torch: the same runtime)
            except (OSError, AttributeError):
                continue
            set_threads.argtypes = [ctypes.c_int]
            _omp = set_threads
            break
    return _omp if callable(_omp) else None


@contextlib.contextmanager
def capped(threads: int) -> Iterator[None]:
    """Torch's intra-op threads of this thread at most ``threads`` inside (other threads and
    torch's process-wide setting untouched)."""
    set_threads = _runtime()
    # (first: torch gives a thread its process-wide default at its first parallel work, which
    # would undo a cap set before that)
    before = torch.get_num_threads()
    if set_threads is None or before <= threads:
        yield
        return
    set_threads(threads)
    try:
        yield
    finally:
        set_threads(before)
