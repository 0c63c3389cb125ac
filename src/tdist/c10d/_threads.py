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

``ParkedTeam``: how long OpenMP's idle threads spin. GNU OpenMP (torch's on Linux) gives every
thread that starts a parallel region a team of its own, and a team's idle threads wait for the
next region by spinning, up to 300,000 pauses (milliseconds), unless the process holds more
OpenMP threads than it has cores: then 1,000, and they sleep (``GOMP_SPINCOUNT`` in libgomp's
manual). torch's RPC runs requests, callbacks and distributed backward passes on pools of
threads, so its processes hold several teams and are in the second mode. tdist runs a request
where it arrives, on one poller: a trainer that RPC drives (pytorch/examples' ``ddp_rpc``)
computes on one thread, and its team's idle thread spins after every kernel through every wait
for a reply, on a core the other processes need (that example trained 2.2x slower than on
torch, 4 processes on 2 cores). An RPC agent keeps one team parked, which puts its process in
torch's mode.

The autograd engine after a fork. torch replaces its autograd engine in a forked child (a fork
handler marks it stale; the first use there destroys and rebuilds it, unguarded, and that first
use may come without the interpreter's lock: an operation saving a tensor for backward asks the
engine for its default hooks). Two of tdist's threads whose first autograd work in a forked
child comes at the same moment (two RPC requests, each running ``x * w`` in its distributed
autograd context) both rebuild it, and the process dies of a segmentation fault in the
engine's destructor. ``_settle_autograd_engine`` makes that first use while the child has one
thread: at fork (``os.register_at_fork``) and as this module loads (a child forked before
tdist was imported).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import os
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["PARALLEL_BYTES", "ParkedTeam", "capped", "usable_cores"]

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


def usable_cores() -> int:
    """The cores this process may run on (its affinity; else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


class ParkedTeam:
    """A thread that starts one OpenMP team (one parallel region of torch's) and sleeps until
    ``stop``: its team's threads count towards the process's, so that GNU OpenMP's idle threads
    spin briefly and sleep, as in torch's RPC processes (see the module's docstring).

    Nothing is parked where it would change nothing or override a choice: torch on one intra-op
    thread, a runtime other than GNU OpenMP's, or ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` set.
    """

    def __init__(self, label: str) -> None:
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        if _spins_by_default():
            self.thread = threading.Thread(target=self._park, name=f"tdist-omp-{label}", daemon=True)
            self.thread.start()
            atexit.register(self.stop)  # (a program that exits without stopping its agent)

    def _park(self) -> None:
        # (twice torch's GRAIN_SIZE of elements: an element-wise kernel on all its threads)
        torch.ones(2 * PARALLEL_BYTES).add_(1)
        self._stop.wait()  # (until the agent stops: the team goes with the thread)

    def stop(self) -> None:
        """Let the thread go, and wait (5 s at most) until it has: a process that exits while
        a thread that started a team lives aborts ("terminate called without an active
        exception", torch alone does it too)."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join(5.0)
            atexit.unregister(self.stop)


def _settle_autograd_engine() -> None:
    """Let torch rebuild its autograd engine now, if a fork left it stale (the module's
    docstring): any call that asks for the engine does, and this one does nothing else."""
    torch.autograd.Variable._execution_engine.is_checkpoint_valid()


_settle_autograd_engine()
os.register_at_fork(after_in_child=_settle_autograd_engine)


def _spins_by_default() -> bool:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or torch.get_num_threads() <= 1:
        return False
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False
