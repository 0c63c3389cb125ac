"""The shared-memory arena: collectives among the ranks of one host, without sockets.

Theory of operation
===================

When every rank of a group runs on one host, the ``tcp`` backend hands its collectives to a
``ShmArena``. The ranks map one shared segment; data moves through it with ``torch`` copies and
reductions (whose kernels release the GIL), and the ranks sequence each other with counters in
the same segment. No byte crosses a socket and no thread hands work to another.

API
---
::

    arena = ShmArena(store, rank, size, name="arena", timeout=300.0, heartbeat_interval=1.0)
    arena.all_reduce(tensor, op)                    # in place, any view, any reducible dtype
    arena.reduce(tensor, root, op)                  # root's tensor; the others' are unchanged
    arena.broadcast(tensor, root)
    arena.all_gather(outputs, input)                # outputs[q]: rank q's input, sizes may differ
    arena.all_gather_into_tensor(output, input)
    arena.gather(outputs_or_None, input, root)
    arena.scatter(output, inputs_or_None, root)
    arena.reduce_scatter(output, inputs, op)        # inputs[q]: this rank's part for rank q
    arena.reduce_scatter_tensor(output, input, op)
    arena.all_to_all(outputs, inputs)               # inputs[q] -> rank q; sizes may differ
    arena.barrier()
    arena.abort(reason)                             # from any thread: break the arena now
    arena.close()

Every collective takes ``timeout=`` (seconds or a ``timedelta``; default: the arena's). The
errors: ``ValueError``/``TypeError`` for arguments (raised before anything is published, so the
arena stays usable), ``CollectiveMismatchError`` when ranks disagree, ``PeerError`` for a dead,
stalled, closed or failed peer, ``DistTimeoutError`` for a deadline; after any of the last three
the arena is broken and every later call raises ``DistBackendError`` at once.

Segment
-------
Rank 0 creates one anonymous shared-memory file (``memfd_create``), sizes it, maps it and
publishes it in the group's store; the others open it through ``/proc/<rank 0's pid>/fd/<n>``
and map it. Each rank's heartbeat thread faults its mapping in after
its first beat, in the background (collectives soon find it mapped; forming the group does not
wait for it). Its layout::

    header line       magic, version, world size, frames K, frame bytes F, ...
    control blocks    one per rank, a whole number of 64-byte lines:
        line 0        W, X, D: progress counters (frames), written by the owner only
        line 1        SLEEP: nonzero while the owner blocks in the kernel
        line 2        heartbeat (monotonic seconds), pid, state (starting/ready/failed/closed)
        lines 3-11    error text of a failed rank
        then          two operation descriptors (by parity of the operation number)
    data              one ring per rank: K frames of F bytes each (page aligned)

Each word has one writer, so plain aligned 8-byte loads and stores are atomic enough. The
protocol relies on x86's total store order: x86 keeps stores in order and loads in order, so
"write the data, then bump the counter" on one side and "see the counter, then read the data"
on the other is safe without fences (Python has no way to issue one). Other architectures
(ARM, POWER) reorder stores and loads, and the same code would read torn frames there, so the
arena refuses them (``memory_order_ok``): the ``tcp`` backend logs why and runs collectives
over its sockets instead.

The segment never grows: every collective streams through the rings in frames of ``F`` bytes
(``frame_bytes``: 1 MiB up to 4 ranks, less beyond), whatever its size. That bounds the shared
memory used (8 MiB for 2 ranks, about 16 MiB for more), needs no re-mapping (so no generation counter,
no second exchange through the store, no growth while a peer reads), and keeps the working set
in the last-level cache: the frames one rank writes are read by the others before they leave
it, and are overwritten in place K frames later, mostly without a trip to DRAM. Measured
here, a 64 MiB all_reduce between 2 processes took 16-17 ms with 1 MiB frames against
24-27 ms with 2-8 MiB frames: staging that outgrows the cache costs more than the extra
hand-offs of small frames, so a slot as large as the tensor would likely be slower still.

Frames and counters
-------------------
All ranks number frames the same way: an operation takes frames ``f0 .. f0 + nf - 1`` of one
global sequence, frame ``f`` lives in slot ``f % K`` of each rank's ring. Rank ``r`` publishes:

* ``W[r] = f + 1`` once its inputs for frame ``f`` are in its ring (and for every earlier
  frame); a rank with nothing to write for a frame publishes it all the same.
* ``X[r] = f + 1`` once its reduced chunk of frame ``f`` is in its ring (reductions only).
* ``D[r] = f + 1`` once it has finished reading frame ``f`` (everyone's slot of it).

Before writing frame ``f`` a rank waits until ``D[q] >= f + 1 - K`` for every ``q`` (the slot's
previous use is read by all): these are the *credits* that let a fast rank run up to ``K``
frames ahead. Every operation starts with an *arrival*: each rank writes its descriptor, its
first frame, publishes ``W = f0 + 1`` and waits until every rank has done so. So no rank
finishes operation ``k`` before all have started it, which is why two descriptor slots (by
parity) suffice, and it is where mismatches are caught.

Algorithms
----------
``all_reduce`` of at most ``small_bytes`` (64 KiB): one frame. Each rank copies its tensor into
its slot, arrives, and reduces all slots itself in rank order (so every rank gets bitwise the
same result). One wait per call.

``all_reduce`` above that, and ``reduce``: blocks of ``F`` bytes; block ``b`` is cut into
``world_size`` 64-byte-aligned chunks. Rank ``r`` copies every chunk but its own into its slot
(``W``), reduces chunk ``r`` reading its own tensor and every peer's slot, with ``out=`` into
its own slot (``X``), then copies every rank's reduced chunk out (``D``): about two copies and
one reduction pass per byte, against gloo's several trips through loopback TCP. The loop is
software-pipelined: ``copy-in(b + 1)``, ``reduce(b)``, ``copy-out(b - 1)``, so a rank rarely
waits for a peer that is one step behind (this needs ``K >= 3``; the default is 4).

Copy collectives stream frames with one frame of look-ahead: ``broadcast`` (the root writes,
the others read), ``all_gather``/``gather`` (everyone writes its input, everyone / the root
reads every slot), ``scatter``/``all_to_all``/``reduce_scatter`` (a writer's frame is cut into
``world_size`` sub-frames, one per destination; ``reduce_scatter`` reduces on read).

Waiting
-------
A waiter checks the counters; if they are not there yet it spins for ``spin_us`` (50 us),
calling ``os.sched_yield()`` between checks so that a rank sharing its core with ours runs, then
blocks in the kernel: it sets its SLEEP word and ``poll()``s its own wake-up pipe together with a
``pidfd`` of every peer process. A publisher, after bumping a counter, writes one byte into the
pipe of every peer whose SLEEP word is set. The SLEEP store and
the counter load (and the counter store and the SLEEP load on the other side) are separated by
a full memory barrier: the acquire and release of an uncontended ``threading.Lock`` are locked
read-modify-write instructions in CPython. Timeouts of ``poll`` are bounded besides, so the wait
re-checks everything at least every ``heartbeat_interval``. A pipe rather than an ``eventfd``:
another process can open a pipe's end through ``/proc/<pid>/fd`` (an eventfd would have to be
passed over a Unix socket), and it polls together with the pidfds. Writing one byte costs under a
microsecond, and only a peer that has announced it sleeps is written to.

While an operation runs, torch's intra-op threads of the thread that runs it are capped at the
rank's share of the cores (``cores // world_size``; ``_threads.capped``: no process-wide setting
changes): a rank is one busy thread already, and OpenMP threads beyond the free
cores wait for each other to be scheduled (64 MiB all_reduce of 2 processes on 2 cores: 650 ms
with torch's default 2 threads each, 12 ms with 1).

Failures
--------
Nothing hangs silently:

* a peer process that exits (kill -9 included) makes its pidfd readable: every rank waiting on
  it raises ``PeerError`` naming the rank, its pid and the operation, at once;
* a peer that stops without exiting (SIGSTOP, a frozen machine) stops its heartbeat thread,
  which writes ``time.monotonic()`` into its control block every ``heartbeat_interval / 3``; a
  waiter that finds a peer's heartbeat older than ``stall_timeout`` (default
  ``3 * heartbeat_interval``, measured against its own heartbeat so that a paused host accuses
  nobody) raises ``PeerError`` naming it as stalled;
* an operation past its deadline raises ``DistTimeoutError`` naming the operation and the ranks
  that had not arrived;
* a rank that fails for any reason (including the above, a mismatch, or an exception in a torch
  kernel) marks its state *failed*, writes the reason, and wakes every peer: they raise
  ``PeerError`` quoting it. A failed arena stays broken: later calls raise at once.

Ranks that are threads of one process share a pid, so there is no pidfd for them; the failed
state and the deadline cover them.

Mismatches
----------
Each rank's descriptor holds the operation number, kind, dtype, reduction, root, element
count, first frame and per-destination sizes. At arrival every rank compares every peer's with
its own and raises ``CollectiveMismatchError`` naming both calls, instead of reading data laid
out differently or waiting for frames that never come.

Files
-----
None. The segment is a memfd and the wake-up channels are pipes: nothing has a name, and all of
it goes away with the last process that holds it, however the processes end (``kill -9``
during ``__init__`` included). Only processes that may inspect each other (same user) can open
them through ``/proc``. (Arenas of earlier versions used files named
``/dev/shm/tdist-<uid>-<pid>-...``: rank 0 of a new arena removes those whose creator pid is
gone, ``cleanup_stale``.)

Store keys are ``shm/<name>/<k>/...``, where ``k`` counts the arenas of that name each rank
has made, so a group re-created over the same store never reads the keys of the last one.

Thread-safety
-------------
One arena per group per process; its methods are called from one thread at a time (the backend
serializes them), except ``abort``, which any thread may call. The only thread an arena starts
is its heartbeat.
"""

from __future__ import annotations

import array
import contextlib
import enum
import json
import logging
import math
import mmap
import os
import platform
import re
import select
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch

from .._core.deadline import to_seconds
from .._core.errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistTimeoutError,
    PeerError,
)
from ..store._api import Store
from ._threads import capped
from ._types import RedOpType, as_red_op

__all__ = ["CollectiveMismatchError", "ShmArena", "cleanup_stale", "default_frame_bytes", "memory_order_ok"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"

_MAGIC = 0x316D737473696474  # b"tdistsm1", little-endian
_VERSION = 1
_HEADER_WORDS = 8

# word offsets inside a rank's control block (8-byte words; a line is 8 words)
_W, _X, _D = 0, 1, 2
_SLEEP = 8
_HB, _PID, _STATE = 16, 17, 18
_ERRLEN, _ERR = 24, 25
_ERR_BYTES = 64 * 8
_DESC = 96
_DESC_HEAD = 8  # seq + 1, kind, dtype, redop + 1, root + 1, numel, f0, nsizes

_STARTING, _READY, _FAILED, _CLOSED = 0, 1, 2, 3

_DEFAULT_FRAMES = 4
_DEFAULT_SMALL_BYTES = 64 << 10
_DEFAULT_SPIN_US = 50.0
# yields before blocking: enough for a rank that shares our core, few enough that an unrelated
# busy process there (which a yield lets run out its slice) does not cost much
_MAX_YIELDS = 2
# torch runs an element-wise kernel on several threads above 32768 elements
_PARALLEL_BYTES = 32 << 10
_NULL_CONTEXT = contextlib.nullcontext()


# machines whose memory model keeps stores and loads in order (total store order)
_TSO_MACHINES = frozenset(("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"))


def memory_order_ok() -> str | None:
    """None when this machine keeps the store and load order the arena's counters rely on
    (x86); else why the arena cannot run here."""
    machine = platform.machine()
    if machine.lower() in _TSO_MACHINES:
        return None
    return (
        f"this host is {machine or 'an unknown architecture'}, whose memory model may reorder "
        "stores and loads; the shared-memory arena relies on x86's total store order"
    )


class _Kind(enum.IntEnum):
    INIT = 1
    BARRIER = 2
    ALL_REDUCE = 3
    BROADCAST = 4
    REDUCE = 5
    ALL_GATHER = 6
    GATHER = 7
    SCATTER = 8
    REDUCE_SCATTER = 9
    ALL_TO_ALL = 10


class _Desc(NamedTuple):
    """One rank's published description of an operation (see ``_write_desc``)."""

    seq: int
    kind: int
    dtype: int
    redop: int
    root: int
    numel: int
    f0: int
    sizes: tuple[int, ...]


Reducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

_REDUCERS: dict[RedOpType, Reducer] = {
    RedOpType.SUM: lambda a, b, out: torch.add(a, b, out=out),
    RedOpType.AVG: lambda a, b, out: torch.add(a, b, out=out),
    RedOpType.PRODUCT: lambda a, b, out: torch.mul(a, b, out=out),
    RedOpType.MIN: lambda a, b, out: torch.minimum(a, b, out=out),
    RedOpType.MAX: lambda a, b, out: torch.maximum(a, b, out=out),
    RedOpType.BAND: lambda a, b, out: torch.bitwise_and(a, b, out=out),
    RedOpType.BOR: lambda a, b, out: torch.bitwise_or(a, b, out=out),
    RedOpType.BXOR: lambda a, b, out: torch.bitwise_xor(a, b, out=out),
}

_reducer_cache: dict[tuple[torch.dtype, RedOpType], Reducer | Exception] = {}


def _reducer(dtype: torch.dtype, op: RedOpType, what: str) -> Reducer:
    """The binary kernel for ``op`` on ``dtype``, checked once per pair on two elements.

    Raises:
        ValueError: ``op`` cannot reduce ``dtype`` (complex MIN/MAX, bitwise ops on floats,
            integer AVG, PREMUL_SUM, a dtype torch has no kernel for).
    """
    key = (dtype, op)
    cached = _reducer_cache.get(key)
    if cached is None:
        cached = _make_reducer(dtype, op)
        _reducer_cache[key] = cached
    if isinstance(cached, Exception):
        raise ValueError(f"{what}: {cached}")
    return cached


def _make_reducer(dtype: torch.dtype, op: RedOpType) -> Reducer | Exception:
    fn = _REDUCERS.get(op)
    if fn is None:
        return ValueError(f"the shared-memory arena does not support ReduceOp.{op.name}")
    if dtype.is_complex and op in (RedOpType.MIN, RedOpType.MAX):
        return ValueError(f"ReduceOp.{op.name} is not defined on complex tensors ({dtype})")
    if op in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) and (
        dtype.is_floating_point or dtype.is_complex
    ):
        return ValueError(f"ReduceOp.{op.name} needs an integer or bool tensor, got {dtype}")
    if op is RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        # gloo refuses AVG outright; NCCL truncates. Refusing is the least surprising.
        return ValueError(
            f"ReduceOp.AVG needs a floating-point or complex tensor, got {dtype} "
            "(use SUM and divide)"
        )
    try:
        a = torch.zeros(2, dtype=dtype)
        fn(a, a, torch.empty(2, dtype=dtype))
        if op is RedOpType.AVG:
            a.div_(2)
    except Exception as exc:  # torch has no kernel for this dtype
        return ValueError(f"cannot apply ReduceOp.{op.name} to {dtype}: {exc}")
    return fn


_dtype_names: dict[int, str] = {}
_dtype_codes: dict[torch.dtype, int] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """A code for ``dtype`` that every process computes alike (``hash(str)`` is salted)."""
    code = _dtype_codes.get(dtype)
    if code is None:
        code = zlib.crc32(str(dtype).encode())
        _dtype_codes[dtype] = code
        _dtype_names.setdefault(code, str(dtype).removeprefix("torch."))
    return code


def _dtype_name(code: int) -> str:
    """The name of a dtype code a peer published (one this process may never have used)."""
    if code not in _dtype_names:
        for value in vars(torch).values():
            if isinstance(value, torch.dtype):
                _dtype_code(value)
    return _dtype_names.get(code, f"dtype#{code:x}")


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view of ``t``'s elements in order, or a contiguous copy (then True: copy back)."""
    if t.is_contiguous():
        return t.view(-1), False
    try:
        return t.view(-1), False  # a strided 1-D view (x[::2], m[:, 1]) needs no copy
    except RuntimeError:
        return t.reshape(-1), True


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu or t.layout != torch.strided:
        raise ValueError(
            f"{what}: the shared-memory arena takes dense CPU tensors, got {t.device} {t.layout}"
        )
    return t


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)[:48] or "group"


def default_frame_bytes(size: int) -> int:
    """The default frame: 1 MiB up to 4 ranks, then smaller so that the segment stays near
    16 MiB (Docker's default /dev/shm is 64 MiB), never under 256 KiB or 4 KiB per rank.

    1 MiB measured best for a 64 MiB all_reduce between 2 processes here (512 KiB: +3%,
    2 MiB: +40%: the frames in flight no longer fit the last-level cache).
    """
    return _round_up(max(256 << 10, 4096 * size, min(1 << 20, (4 << 20) // size)), 4096)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's ``tdist-`` files in ``directory`` whose creator process is gone.

    Best effort: files of live processes, of other users and unreadable entries are left
    alone. Returns the paths removed.
    """
    prefix = f"tdist-{os.getuid()}-"
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for entry in names:
        if not entry.startswith(prefix):
            continue
        m = re.match(r"(\d+)-", entry[len(prefix):])
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, entry)
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    if removed:
        log.info("removed %s stale shared-memory file(s): %s", len(removed), removed)
    return removed


def _release(stop: threading.Event, fds: list[int]) -> None:
    stop.set()
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


def _heartbeat_loop(
    words: memoryview[float], index: int, interval: float, stop: threading.Event, mm: mmap.mmap | None = None
) -> None:
    # references no arena, so that a forgotten arena can still be collected
    while True:
        words[index] = time.monotonic()
        if stop.wait(interval):
            return
        if mm is not None:  # (after the first beat: the group forms without waiting for it)
            _prefault(mm, stop)
            mm = None


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # (Linux 5.14; Python 3.13 names it)
_PREFAULT_CHUNK = 256 << 10  # (about 0.1 ms with the GIL held, then the others' turn)


def _prefault(mm: mmap.mmap, stop: threading.Event) -> None:
    """Fault every page of ``mm`` in for writing, a chunk at a time (each madvise holds the
    GIL for a fraction of a millisecond), unless ``stop`` is set; where the kernel has no
    MADV_POPULATE_WRITE, pages fault in on first use instead."""
    with contextlib.suppress(OSError, ValueError):
        for start in range(0, len(mm), _PREFAULT_CHUNK):
            if stop.is_set():
                return
            mm.madvise(_MADV_POPULATE_WRITE, start, min(_PREFAULT_CHUNK, len(mm) - start))
            time.sleep(0)


class ShmArena:
    """A shared-memory arena for the collectives of ``size`` ranks on one host.

    Every rank of the group constructs one, with the same ``name``, at the same time; the
    constructor exchanges file names and pids through ``store`` and returns once every rank
    has mapped the segment.

    Args:
        store: a store private to the group (a ``PrefixStore``); keys go under ``shm/<name>/``.
            Arenas of one name are paired by the order in which each rank makes them.
        rank: this rank, ``0 <= rank < size``.
        size: the number of ranks.
        name: names the arena in keys, file names and messages; unique among the live arenas
            sharing ``store``.
        timeout: the default deadline of each operation (and of construction), seconds.
        heartbeat_interval: seconds between heartbeats (written every third of it).
        stall_timeout: a peer whose heartbeat is this much older than ours is stalled
            (default ``3 * heartbeat_interval``).
        frame_bytes: bytes of one frame (a multiple of 4096, at least ``max(65536, 4096 * size)``;
            default ``default_frame_bytes(size)``).
        frames: frames per rank ring (at least 3).
        small_bytes: ``all_reduce``/``reduce`` of at most this many bytes take the one-frame path.
        spin_us: how long a waiter spins (yielding) before it blocks in the kernel.

    Raises:
        ValueError: bad arguments.
        DistBackendError: this machine's memory order is weaker than x86's
            (``memory_order_ok``).
        DistTimeoutError, PeerError, DistStoreError: the other ranks did not all join in time.

    Thread-safety: call an arena's methods from one thread at a time.
    """

    _w: memoryview[int]
    _fw: memoryview[float]
    _buf: torch.Tensor
    _poll: select.poll
    _peer_idx: dict[int, list[int]]
    _sleep_idx: list[tuple[int, int]]
    _state_idx: list[int]

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        *,
        name: str,
        timeout: float | timedelta = 300.0,
        heartbeat_interval: float = 1.0,
        stall_timeout: float | None = None,
        frame_bytes: int | None = None,
        frames: int = _DEFAULT_FRAMES,
        small_bytes: int = _DEFAULT_SMALL_BYTES,
        spin_us: float = _DEFAULT_SPIN_US,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"ShmArena: need 0 <= rank < size, got rank={rank}, size={size}")
        refused = memory_order_ok()
        if refused is not None:
            raise DistBackendError(f"ShmArena: {refused}")
        if frame_bytes is None:
            frame_bytes = default_frame_bytes(size)
        if frame_bytes % 4096 or frame_bytes < max(65536, 4096 * size):
            raise ValueError(
                f"ShmArena: frame_bytes={frame_bytes} must be a multiple of 4096 and at least "
                f"{max(65536, 4096 * size)}"
            )
        if frames < 3:
            raise ValueError(f"ShmArena: frames={frames} must be at least 3 (the pipeline needs it)")
        if heartbeat_interval <= 0:
            raise ValueError(f"ShmArena: heartbeat_interval={heartbeat_interval} must be positive")
        seconds = to_seconds(timeout)
        assert seconds is not None
        self.rank = rank
        self.size = size
        self.name = name
        self._timeout = seconds
        self._hb_interval = float(heartbeat_interval)
        self._stall = float(stall_timeout) if stall_timeout is not None else 3.0 * heartbeat_interval
        self._K = frames
        self._F = frame_bytes
        self._small = min(small_bytes, frame_bytes)
        self._spin_s = spin_us * 1e-6
        # intra-op threads per rank for large copies: a fair share of this process's cores
        self._threads = max(1, _usable_cores() // size)
        self._peers = [q for q in range(size) if q != rank]
        self._pid = os.getpid()
        self._frame = 0  # next frame of the global sequence
        self._seq = 0  # number of operations started
        self._op = "init"
        self._op_timeout = seconds
        self._broken: BaseException | None = None
        self._aborted: str | None = None
        self._head: list[int] = []
        self._closed = False
        self._fence_lock = threading.Lock()
        self._fifo_r = -1  # our wake-up pipe: read end, write end
        self._fifo_self = -1
        self._fifo_w: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}  # fd -> rank
        self._dead: set[int] = set()
        self._peer_pids: list[int] = [0] * size
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._slot_cache: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = {}
        self._mm: mmap.mmap | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._fds: list[int] = []  # every descriptor we hold, for close and for the finalizer
        # an arena dropped without close(): stop its heartbeat, close its descriptors
        self._finalizer = weakref.finalize(self, _release, self._hb_stop, self._fds)

        # control-block geometry
        self._desc_words = _round_up(_DESC_HEAD + size, 8)
        self._rank_words = _round_up(_DESC + 2 * self._desc_words, 8)
        ctl_bytes = 8 * (_HEADER_WORDS + size * self._rank_words)
        self._data_off = _round_up(ctl_bytes, 4096)
        self._nbytes = self._data_off + size * frames * frame_bytes
        self._base = [_HEADER_WORDS + q * self._rank_words for q in range(size)]
        self._my = self._base[rank]

        deadline = time.monotonic() + seconds
        try:
            self._setup(store, deadline)
        except BaseException:
            self._teardown()
            raise

    # -- construction ----------------------------------------------------------------------------
    def _setup(self, store: Store, deadline: float) -> None:
        # the k-th arena of this name that this rank makes pairs with everyone's k-th: a group
        # re-created over the same store does not read the keys of the one before
        gen = store.add(f"shm/{self.name}/generation/{self.rank}", 1)
        prefix = f"shm/{self.name}/{gen}/"
        seg_fd = -1
        if self.rank == 0:
            cleanup_stale()  # (files that arenas of earlier tdist versions may have left)
            # a memfd: shared memory without a name, gone with the last process that holds it
            seg_fd = os.memfd_create(f"tdist-arena-{_sanitize(self.name)}", os.MFD_CLOEXEC)
            self._fds.append(seg_fd)
            os.ftruncate(seg_fd, self._nbytes)
            self._map(seg_fd)
            w = self._w
            for i, v in enumerate(
                (_MAGIC, _VERSION, self.size, self._K, self._F, self._rank_words, self._data_off, self._small)
            ):
                w[i] = v
            # (no posix_fallocate: a memfd lives on the kernel's own shmem mount, which has no
            # size limit, so a page that cannot be had is the memory controller's business, as
            # for any tensor's page; allocating 8 MiB up front cost every group 1.6 ms of CPU)
            store.set(prefix + "seg", json.dumps({"pid": self._pid, "fd": seg_fd}))
        # our wake-up pipe: peers open its read end as writers through /proc; we keep its write
        # end open too (a pipe with no writer would read EOF, and abort() wakes us through it)
        self._fifo_r, self._fifo_self = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fds += [self._fifo_r, self._fifo_self]
        store.set(prefix + f"rank/{self.rank}", json.dumps({"pid": self._pid, "wake": self._fifo_r}))

        keys = [prefix + f"rank/{q}" for q in range(self.size)]
        if self.rank != 0:
            keys.append(prefix + "seg")
        store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
        if self.rank != 0:
            seg = json.loads(store.get(prefix + "seg").decode())
            seg_path = f"/proc/{seg['pid']}/fd/{seg['fd']}"
            try:
                fd = os.open(seg_path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise DistError(
                    f"rank {self.rank}: cannot open the shared-memory segment of arena {self.name!r} "
                    f"through {seg_path} (rank 0 in another pid namespace, or a process that may not "
                    f"be inspected?): {exc}"
                ) from exc
            try:
                if os.fstat(fd).st_size != self._nbytes:
                    raise DistError(
                        f"rank {self.rank}: segment {seg_path} has {os.fstat(fd).st_size} bytes, "
                        f"expected {self._nbytes}: do all ranks pass the same size, frame_bytes and "
                        "frames?"
                    )
                self._map(fd)
            finally:
                os.close(fd)
            header = tuple(self._w[0:8])
            expected = (_MAGIC, _VERSION, self.size, self._K, self._F, self._rank_words, self._data_off, self._small)
            if header != expected:
                raise DistError(
                    f"rank {self.rank}: segment {seg_path} has layout {header}, expected {expected} "
                    "(magic, version, size, frames, frame_bytes, control words, data offset, "
                    "small_bytes): do all ranks pass the same options?"
                )

        self._poll = select.poll()
        self._poll.register(self._fifo_r, select.POLLIN)
        for q in self._peers:
            info = json.loads(store.get(keys[q]).decode())
            pid = int(info["pid"])
            self._peer_pids[q] = pid
            try:
                self._fifo_w[q] = os.open(f"/proc/{pid}/fd/{info['wake']}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._fds.append(self._fifo_w[q])
            except OSError as exc:
                raise PeerError(
                    f"rank {self.rank}: cannot open the wake-up pipe of rank {q} (pid {pid}) in arena "
                    f"{self.name!r}: {exc}",
                    peer=q,
                ) from exc
            if pid != self._pid:
                try:
                    pidfd = os.pidfd_open(pid)
                except ProcessLookupError as exc:
                    raise PeerError(
                        f"rank {self.rank}: rank {q} (pid {pid}) of arena {self.name!r} exited "
                        "while the arena was being set up",
                        peer=q,
                    ) from exc
                except OSError:  # no pidfd on this kernel: heartbeats and deadlines remain
                    continue
                self._pidfds[pidfd] = q
                self._fds.append(pidfd)
                self._poll.register(pidfd, select.POLLIN)
        self._peer_pids[self.rank] = self._pid

        w = self._w
        fw = self._fw
        w[self._my + _PID] = self._pid
        fw[self._my + _HB] = time.monotonic()
        w[self._my + _STATE] = _READY
        self._hb_thread = threading.Thread(
            target=_heartbeat_loop,
            args=(fw, self._my + _HB, self._hb_interval / 3.0, self._hb_stop, self._mm),
            name=f"tdist-shm-heartbeat-{self.name}-r{self.rank}",
            daemon=True,
        )
        self._hb_thread.start()

        # every rank has mapped the segment and opened every pipe once all have arrived here:
        # rank 0's descriptor of the segment is needed no more (the mappings keep it)
        self._op = "init"
        self._sync(_Kind.INIT, deadline)
        if seg_fd >= 0:
            self._fds.remove(seg_fd)
            os.close(seg_fd)
        log.debug(
            "rank %s: shared-memory arena %s ready: %s ranks, %s frames of %s bytes",
            self.rank, self.name, self.size, self._K, self._F,
        )

    def _map(self, fd: int) -> None:
        # (not pre-faulted here: MAP_POPULATE costs 3 ms for the default 8 MiB, on every rank,
        # before the group exists; the heartbeat thread faults it in instead)
        self._mm = mmap.mmap(fd, self._nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._w = memoryview(self._mm).cast("Q")
        self._fw = memoryview(self._mm).cast("d")
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._peer_idx = {
            word: [self._base[q] + word for q in self._peers] for word in (_W, _X, _D)
        }
        self._sleep_idx = [(q, self._base[q] + _SLEEP) for q in self._peers]
        self._state_idx = [self._base[q] + _STATE for q in self._peers]

    # -- small helpers ---------------------------------------------------------------------------
    def _frames_of(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """``[rank][slot]``: every frame of every ring as a 1-D ``dtype`` tensor (cached)."""
        views = self._views.get(dtype)
        if views is None:
            F, K = self._F, self._K
            views = [
                [
                    self._buf[self._data_off + (q * K + k) * F: self._data_off + (q * K + k + 1) * F].view(dtype)
                    for k in range(K)
                ]
                for q in range(self.size)
            ]
            self._views[dtype] = views
        return views

    def _fence(self) -> None:
        # a locked read-modify-write each way: a full memory barrier on x86-64
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _pub(self, word: int, value: int) -> None:
        """Publish one of our counters and wake the peers that sleep."""
        w = self._w
        w[self._my + word] = value
        self._fence()
        for q, i in self._sleep_idx:
            if w[i]:
                self._wake(q)

    def _wake(self, q: int) -> None:
        try:
            os.write(self._fifo_w[q], b"\x01")
        except (BlockingIOError, BrokenPipeError):
            pass  # full: a wake-up is pending anyway; broken: the peer is gone

    def _timeout_of(self, timeout: float | timedelta | None) -> float:
        seconds = to_seconds(timeout, self._timeout)
        assert seconds is not None
        return seconds

    def _enter(self, op: str, timeout: float | timedelta | None) -> float:
        """Check that the arena can run ``op``; returns its deadline."""
        if self._closed:
            raise DistError(f"rank {self.rank}: {op} on closed shared-memory arena {self.name!r}")
        if self._broken is not None:
            raise DistBackendError(
                f"rank {self.rank}: {op}: shared-memory arena {self.name!r} is broken by an earlier "
                f"failure ({self._broken}); re-create the process group"
            ) from self._broken
        if os.getpid() != self._pid:
            raise DistError(
                f"rank {self.rank}: {op}: shared-memory arena {self.name!r} was created in pid "
                f"{self._pid} and cannot be used in a forked child (pid {os.getpid()})"
            )
        self._op = op
        self._op_timeout = self._timeout_of(timeout)
        return time.monotonic() + self._op_timeout

    def _fail(self, exc: BaseException) -> None:
        """Mark the arena broken and tell every peer why."""
        if self._broken is not None or self._mm is None:
            return
        self._broken = exc
        text = f"{type(exc).__name__}: {exc}".encode(errors="replace")[: _ERR_BYTES]
        try:
            w = self._w
            start = 8 * (self._my + _ERR)
            self._mm[start: start + len(text)] = text
            w[self._my + _ERRLEN] = len(text)
            w[self._my + _STATE] = _FAILED
            self._fence()
            for q in self._peers:
                self._wake(q)
        except (ValueError, OSError):  # pragma: no cover - the mapping is gone
            pass
        log.warning("rank %s: shared-memory arena %s failed in %s: %s", self.rank, self.name, self._op, exc)

    def _peer_text(self, q: int) -> str:
        n = min(self._w[self._base[q] + _ERRLEN], _ERR_BYTES)
        start = 8 * (self._base[q] + _ERR)
        assert self._mm is not None
        return self._mm[start: start + n].decode(errors="replace")

    # -- waiting ---------------------------------------------------------------------------------
    def _wait(self, word: int, target: int, deadline: float, ranks: Sequence[int] | None = None) -> None:
        """Wait until counter ``word`` of ``ranks`` (default: every peer) is ``>= target``."""
        w = self._w
        if ranks is None:
            idxs = self._peer_idx[word]
            ranks = self._peers
        else:
            idxs = [self._base[q] + word for q in ranks]
        for i in idxs:
            if w[i] < target:
                break
        else:
            return
        # Spin briefly: a peer on another core usually arrives within microseconds. Then yield
        # a few times, for a peer that shares our core; then block in the kernel, where a
        # wake-up also preempts an unrelated process that holds our core (a yield would let
        # it run out its slice).
        pc = time.perf_counter
        start = pc()
        pure_end = start + self._spin_s * 0.5
        spin_end = start + self._spin_s
        yields = 0
        while True:
            for i in idxs:
                if w[i] < target:
                    break
            else:
                return
            now = pc()
            if now > pure_end:
                if now > spin_end or yields >= _MAX_YIELDS:
                    break
                yields += 1
                os.sched_yield()
        self._block(word, target, deadline, ranks, idxs)

    def _block(self, word: int, target: int, deadline: float, ranks: Sequence[int], idxs: list[int]) -> None:
        w = self._w
        sleep = self._my + _SLEEP
        w[sleep] = 1
        self._fence()
        try:
            while True:
                missing = [q for q, i in zip(ranks, idxs, strict=True) if w[i] < target]
                if not missing:
                    return
                now = time.monotonic()
                try:
                    self._check_peers(missing, now)
                except PeerError:
                    # a peer may do its part and then close (or exit) between our look at the
                    # word and at its state: only what is still missing now is an error
                    if all(w[i] >= target for i in idxs):
                        return
                    raise
                if now >= deadline:
                    raise self._timeout_error(word, target, missing)
                wait_s = min(deadline - now, self._hb_interval)
                for fd, _ev in self._poll.poll(max(1, math.ceil(wait_s * 1000))):
                    if fd == self._fifo_r:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(fd, 4096):
                                pass
                    else:
                        self._dead.add(self._pidfds[fd])
                        self._poll.unregister(fd)
        finally:
            w[sleep] = 0

    def _check_peers(self, missing: list[int], now: float) -> None:
        """Raise if we were aborted, a peer failed, or a peer we wait for is dead, closed or
        stalled."""
        if self._aborted is not None:
            raise DistBackendError(
                f"rank {self.rank}: {self._op} in shared-memory arena {self.name!r} aborted: "
                f"{self._aborted}"
            )
        w = self._w
        for q in self._peers:
            if w[self._base[q] + _STATE] == _FAILED:
                raise PeerError(
                    f"rank {self.rank}: {self._op} aborted: rank {q} (pid {self._peer_pids[q]}) "
                    f"failed: {self._peer_text(q)}",
                    peer=q,
                )
        fw = self._fw
        my_age = now - fw[self._my + _HB]
        for q in missing:
            pid = self._peer_pids[q]
            if q in self._dead:
                raise PeerError(
                    f"rank {self.rank}: peer rank {q} (pid {pid}) died during {self._op} in "
                    f"shared-memory arena {self.name!r}",
                    peer=q,
                )
            if w[self._base[q] + _STATE] == _CLOSED:
                raise PeerError(
                    f"rank {self.rank}: peer rank {q} (pid {pid}) closed shared-memory arena "
                    f"{self.name!r} while this rank waited for it in {self._op}",
                    peer=q,
                )
            beat = fw[self._base[q] + _HB]
            if beat == 0.0:
                continue  # still mapping the segment: only the deadline applies
            age = now - beat
            if age - max(my_age, 0.0) > self._stall:
                raise PeerError(
                    f"rank {self.rank}: peer rank {q} (pid {pid}) stalled during {self._op}: no "
                    f"heartbeat for {age:.1f} s (limit {self._stall:g} s); is it stopped "
                    "(SIGSTOP), swapped out or starved?",
                    peer=q,
                )

    def _timeout_error(self, word: int, target: int, missing: list[int]) -> DistTimeoutError:
        frame = target - 1 - self._frame
        if word == _D:
            what = "released a ring slot (finished reading an earlier frame)"
        elif frame <= 0:
            what = f"arrived at operation #{self._seq}"
        else:
            step = "reduced" if word == _X else "written"
            what = f"{step} frame {frame} of operation #{self._seq}"
        return DistTimeoutError(
            f"rank {self.rank}: {self._op} in shared-memory arena {self.name!r} timed out after "
            f"{self._op_timeout:g} s: ranks {missing} had not {what}"
        )

    # -- descriptors and arrival -----------------------------------------------------------------
    def _write_desc(
        self, kind: _Kind, dtype: int = 0, redop: int = -1, root: int = -1, numel: int = 0,
        sizes: Sequence[int] = (),
    ) -> int:
        """Publish this rank's descriptor of the next operation; returns its first frame.

        Layout: ``seq + 1, kind, dtype, redop + 1, root + 1, f0, numel, len(sizes), *sizes``;
        the first six words must agree on every rank, ``numel`` too for most collectives.
        """
        # peers read it only after our W says the operation's first frame is ready
        at = self._my + _DESC + (self._seq & 1) * self._desc_words
        head = [self._seq + 1, int(kind), dtype, redop + 1, root + 1, self._frame, numel, len(sizes)]
        words = array.array("Q", head)
        if sizes:
            words.extend(sizes)
        self._w[at: at + len(words)] = words
        self._head = head
        return self._frame

    def _desc(self, q: int) -> _Desc:
        at = self._base[q] + _DESC + (self._seq & 1) * self._desc_words
        head = self._w[at: at + _DESC_HEAD].tolist()
        nsizes = min(head[7], self.size)
        sizes = tuple(self._w[at + _DESC_HEAD: at + _DESC_HEAD + nsizes].tolist())
        return _Desc(head[0] - 1, head[1], head[2], head[3] - 1, head[4] - 1, head[6], head[5], sizes)

    def _descs(self) -> list[_Desc]:
        """Every rank's descriptor of the current operation (valid after ``_arrive``)."""
        return [self._desc(q) for q in range(self.size)]

    def _arrive(
        self, f0: int, deadline: float, same_numel: bool = True, check_failed: bool = True
    ) -> None:
        """Wait until every rank has started this operation and check their descriptors (then,
        with ``check_failed``, that no peer has failed; else the caller calls ``_check_failed``
        after its own checks of the descriptors).

        Raises:
            CollectiveMismatchError: a peer called something else.
        """
        self._wait(_W, f0 + 1, deadline)
        n = 7 if same_numel else 6
        mine = self._head[:n]
        w = self._w
        off = _DESC + (self._seq & 1) * self._desc_words
        for q in self._peers:
            at = self._base[q] + off
            if w[at: at + n].tolist() != mine:
                self._mismatch(q, self._desc(self.rank), self._desc(q))
        if check_failed:
            self._check_failed()

    def _check_failed(self) -> None:
        """Raise if a peer failed: it gave up on this operation, which must not complete alone."""
        w = self._w
        for i in self._state_idx:
            if w[i] == _FAILED:
                self._check_peers([], time.monotonic())

    def _mismatch(self, q: int, mine: _Desc, theirs: _Desc, detail: str = "") -> None:
        raise CollectiveMismatchError(
            f"rank {self.rank}: collective mismatch in shared-memory arena {self.name!r}: rank "
            f"{self.rank} called {self._describe(mine)} but rank {q} called "
            f"{self._describe(theirs)}{detail}"
        )

    @staticmethod
    def _describe(d: _Desc) -> str:
        try:
            kind = _Kind(d.kind).name.lower()
        except ValueError:
            kind = f"kind#{d.kind}"
        parts = [_dtype_name(d.dtype)] if d.dtype else []
        if d.kind in (_Kind.ALL_REDUCE, _Kind.BROADCAST, _Kind.REDUCE, _Kind.ALL_GATHER, _Kind.GATHER):
            parts.append(f"numel={d.numel}")
        if d.sizes:
            parts.append(f"sizes={list(d.sizes)}")
        if d.redop >= 0:
            try:
                parts.append(f"op={RedOpType(d.redop).name}")
            except ValueError:
                parts.append(f"op#{d.redop}")
        if d.root >= 0:
            parts.append(f"root={d.root}")
        return f"{kind}({', '.join(parts)}) as operation #{d.seq} at frame {d.f0}"

    def _sync(self, kind: _Kind, deadline: float) -> None:
        """A barrier on the arena: one frame, nothing written."""
        f = self._write_desc(kind)
        self._pub(_W, f + 1)
        self._arrive(f, deadline)
        self._pub(_D, f + 1)
        self._done(1)

    def _done(self, nframes: int) -> None:
        self._frame += nframes
        self._seq += 1

    def _credit(self, f: int, deadline: float) -> None:
        """Wait until slot ``f % K`` of every ring has been read in its previous use."""
        need = f + 1 - self._K
        if need > 0:
            self._wait(_D, need, deadline)

    def _pipeline(self, nframes: int, write: Callable[[int], None], read: Callable[[int], None]) -> None:
        """Frames ``1 .. nframes - 1`` with one frame of look-ahead (frame 0 is written)."""
        for s in range(nframes):
            if s + 1 < nframes:
                write(s + 1)
            read(s)
        self._done(nframes)

    # -- collectives -----------------------------------------------------------------------------
    def barrier(self, *, timeout: float | timedelta | None = None) -> None:
        """Block until every rank has called ``barrier``.

        Raises:
            PeerError: a peer died, stalled, closed the arena or failed.
            DistTimeoutError: not every rank arrived within ``timeout`` (default: the arena's).
            CollectiveMismatchError: a peer called another collective.
        """
        deadline = self._enter("barrier", timeout)
        try:
            self._sync(_Kind.BARRIER, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``tensor`` across ranks in place; every rank gets the result.

        Args:
            tensor: a CPU tensor of any dtype the reduction supports; it may be a
                non-contiguous view (only the view's elements are written).
            op: the reduction (``AVG`` on floating-point and complex tensors only; ``MIN`` and
                ``MAX`` not on complex; ``BAND``/``BOR``/``BXOR`` on integers and bool only).
            timeout: seconds (or a ``timedelta``) for the whole call; default: the arena's.

        Raises:
            ValueError: ``op`` cannot reduce this dtype (raised on every rank, nothing sent).
            CollectiveMismatchError: the ranks' calls disagree (op, dtype, element count).
            PeerError: a peer died, stalled, closed the arena or failed.
            DistTimeoutError: the deadline expired.
        """
        _check_tensor(tensor, "all_reduce")
        red = as_red_op(op)
        fn = _reducer(tensor.dtype, red, "all_reduce")
        deadline = self._enter("all_reduce", timeout)
        if self.size == 1:
            return
        try:
            with self._mode((tensor,)):
                flat, copied = _flat(tensor)
                self._reduce(_Kind.ALL_REDUCE, flat, red, fn, -1, deadline)
                if copied:
                    tensor.copy_(flat.view(tensor.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``tensor`` across ranks into ``root``'s ``tensor``; the others' are unchanged.

        Args and Raises: as ``all_reduce``, plus ``root`` (ValueError when out of range).
        """
        _check_tensor(tensor, "reduce")
        self._check_root(root, "reduce")
        red = as_red_op(op)
        fn = _reducer(tensor.dtype, red, "reduce")
        deadline = self._enter("reduce", timeout)
        if self.size == 1:
            return
        try:
            with self._mode((tensor,)):
                if self.rank == root:
                    flat, copied = _flat(tensor)
                else:
                    flat, copied = tensor.reshape(-1), False  # read only: a copy will do
                self._reduce(_Kind.REDUCE, flat, red, fn, root, deadline)
                if copied:
                    tensor.copy_(flat.view(tensor.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def _reduce(
        self, kind: _Kind, flat: torch.Tensor, op: RedOpType, fn: Reducer, root: int, deadline: float
    ) -> None:
        if flat.numel() * flat.element_size() <= self._small:
            self._reduce_small(kind, flat, op, fn, root, deadline)
        else:
            self._reduce_large(kind, flat, op, fn, root, deadline)

    def _reduce_small(
        self, kind: _Kind, flat: torch.Tensor, op: RedOpType, fn: Reducer, root: int, deadline: float
    ) -> None:
        numel = flat.numel()
        dtype = flat.dtype
        f = self._write_desc(kind, _dtype_code(dtype), int(op), root, numel)
        self._credit(f, deadline)
        k = f % self._K
        key = (dtype, numel)
        slots_by_k = self._slot_cache.get(key)
        if slots_by_k is None:
            # slicing costs microseconds: a training loop reduces the same sizes again and again
            if len(self._slot_cache) >= 64:
                self._slot_cache.clear()
            views = self._frames_of(dtype)
            slots_by_k = [[views[q][j][:numel] for q in range(self.size)] for j in range(self._K)]
            self._slot_cache[key] = slots_by_k
        slots = slots_by_k[k]
        slots[self.rank].copy_(flat)
        self._pub(_W, f + 1)
        self._arrive(f, deadline)
        if root < 0 or root == self.rank:
            # every rank sums in rank order: bitwise the same result everywhere
            fn(slots[0], slots[1], flat)
            for q in range(2, self.size):
                fn(flat, slots[q], flat)
            if op is RedOpType.AVG:
                flat.div_(self.size)
        self._pub(_D, f + 1)
        self._done(1)

    def _reduce_large(
        self, kind: _Kind, flat: torch.Tensor, op: RedOpType, fn: Reducer, root: int, deadline: float
    ) -> None:
        n, r, K = self.size, self.rank, self._K
        peers = self._peers
        numel = flat.numel()
        E = self._F // flat.element_size()
        A = max(1, 64 // flat.element_size())
        nb = -(-numel // E)
        f0 = self._write_desc(kind, _dtype_code(flat.dtype), int(op), root, numel)
        views = self._frames_of(flat.dtype)
        mine = views[r]
        avg = op is RedOpType.AVG
        out_here = root < 0 or root == r

        def chunks(b: int) -> tuple[int, list[tuple[int, int]]]:
            # block b cut into n chunks on 64-byte boundaries; trailing chunks may be empty
            lo = b * E
            m = min(E, numel - lo)
            per = _round_up(-(-m // n), A)
            return lo, [(min(m, j * per), min(m, (j + 1) * per)) for j in range(n)]

        def copy_in(b: int) -> None:
            f = f0 + b
            self._credit(f, deadline)
            lo, cs = chunks(b)
            frame = mine[f % K]
            for j in peers:
                s, e = cs[j]
                if e > s:
                    frame[s:e].copy_(flat[lo + s: lo + e])
            self._pub(_W, f + 1)

        def reduce(b: int) -> None:
            f = f0 + b
            if b == 0:
                self._arrive(f0, deadline)
            else:
                self._wait(_W, f + 1, deadline)
            lo, cs = chunks(b)
            s, e = cs[r]
            k = f % K
            if e > s:
                out = mine[k][s:e]
                others = [views[q][k][s:e] for q in peers]
                fn(flat[lo + s: lo + e], others[0], out)
                for o in others[1:]:
                    fn(out, o, out)
                if avg:
                    out.div_(n)
            self._pub(_X, f + 1)

        def copy_out(b: int) -> None:
            f = f0 + b
            if out_here:
                self._wait(_X, f + 1, deadline)
                lo, cs = chunks(b)
                k = f % K
                for j in range(n):
                    s, e = cs[j]
                    if e > s:
                        flat[lo + s: lo + e].copy_(views[j][k][s:e])
            self._pub(_D, f + 1)

        # software pipeline: copy-in(b + 1), reduce(b), copy-out(b - 1); a rank waits only for
        # a peer more than a step behind
        copy_in(0)
        for b in range(nb):
            if b + 1 < nb:
                copy_in(b + 1)
            reduce(b)
            if b:
                copy_out(b - 1)
        copy_out(nb - 1)
        self._done(nb)

    def broadcast(
        self, tensor: torch.Tensor, root: int, *, timeout: float | timedelta | None = None
    ) -> None:
        """Copy ``root``'s ``tensor`` into every rank's ``tensor`` (any dtype, any view).

        Raises:
            ValueError: ``root`` out of range.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(tensor, "broadcast")
        self._check_root(root, "broadcast")
        deadline = self._enter("broadcast", timeout)
        if self.size == 1:
            return
        try:
            with self._mode((tensor,)):
                self._broadcast(tensor, root, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _broadcast(self, tensor: torch.Tensor, root: int, deadline: float) -> None:
        r, K = self.rank, self._K
        is_root = r == root
        flat, copied = _flat(tensor)
        numel = flat.numel()
        E = self._F // flat.element_size()
        nf = max(1, -(-numel // E))
        f0 = self._write_desc(_Kind.BROADCAST, _dtype_code(flat.dtype), -1, root, numel)
        views = self._frames_of(flat.dtype)

        def write(s: int) -> None:
            f = f0 + s
            if is_root:
                lo = s * E
                m = min(E, numel - lo)
                if m > 0:
                    self._credit(f, deadline)
                    views[r][f % K][:m].copy_(flat[lo: lo + m])
            self._pub(_W, f + 1)

        def read(s: int) -> None:
            f = f0 + s
            if not is_root:
                lo = s * E
                m = min(E, numel - lo)
                self._wait(_W, f + 1, deadline, (root,))
                if m > 0:
                    flat[lo: lo + m].copy_(views[root][f % K][:m])
            self._pub(_D, f + 1)

        write(0)
        self._arrive(f0, deadline)
        self._pipeline(nf, write, read)
        if copied and not is_root:
            tensor.copy_(flat.view(tensor.shape))

    def all_gather(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Gather every rank's ``input`` into ``outputs[rank]`` on every rank.

        Ranks may contribute different numbers of elements: ``outputs[q]`` must have as many as
        rank ``q``'s ``input`` (checked across ranks).

        Raises:
            ValueError: ``outputs`` is not one tensor per rank, or dtypes differ, or
                ``outputs[rank]`` does not match ``input``.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        self._check_list(outputs, "all_gather", "outputs")
        _check_tensor(input, "all_gather")
        self._check_dtypes(outputs, input.dtype, "all_gather")
        if outputs[self.rank].numel() != input.numel():
            raise ValueError(
                f"all_gather: outputs[{self.rank}] has {outputs[self.rank].numel()} elements but "
                f"this rank's input has {input.numel()}"
            )
        deadline = self._enter("all_gather", timeout)
        try:
            with self._mode((*outputs, input)):
                flats = [_flat(o) for o in outputs]
                self._all_gather([f for f, _ in flats], input.reshape(-1), deadline)
                for o, (f, copied) in zip(outputs, flats, strict=True):
                    if copied:
                        o.copy_(f.view(o.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float | timedelta | None = None
    ) -> None:
        """Gather every rank's ``input`` into ``output`` (``size`` times as many elements),
        rank ``q``'s at ``output.view(-1)[q * n:(q + 1) * n]``.

        Raises:
            ValueError: sizes or dtypes do not fit.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "all_gather_into_tensor")
        _check_tensor(input, "all_gather_into_tensor")
        if output.dtype != input.dtype or output.numel() != self.size * input.numel():
            raise ValueError(
                f"all_gather_into_tensor: output ({output.dtype}, {output.numel()} elements) must "
                f"be {self.size} x input ({input.dtype}, {input.numel()} elements)"
            )
        deadline = self._enter("all_gather_into_tensor", timeout)
        try:
            with self._mode((output, input)):
                flat, copied = _flat(output)
                # a view of output's own block as input (the in-place idiom) reads before writes
                blocks = list(torch.split(flat, input.numel())) if input.numel() else [flat] * self.size
                self._all_gather(blocks, input.reshape(-1), deadline)
                if copied:
                    output.copy_(flat.view(output.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def _all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor, deadline: float) -> None:
        n, r, K = self.size, self.rank, self._K
        sizes = [o.numel() for o in outs]
        if n == 1:
            outs[0].copy_(inp)
            return
        E = self._F // inp.element_size()
        nf = max(1, -(-max(sizes) // E))
        f0 = self._write_desc(_Kind.ALL_GATHER, _dtype_code(inp.dtype), numel=inp.numel())
        views = self._frames_of(inp.dtype)
        mine = sizes[r]

        def write(s: int) -> None:
            f = f0 + s
            lo = s * E
            m = min(E, mine - lo)
            if m > 0:
                self._credit(f, deadline)
                views[r][f % K][:m].copy_(inp[lo: lo + m])
            self._pub(_W, f + 1)

        def read(s: int) -> None:
            f = f0 + s
            lo = s * E
            k = f % K
            self._wait(_W, f + 1, deadline)
            for q in range(n):
                m = min(E, sizes[q] - lo)
                if m > 0:
                    outs[q][lo: lo + m].copy_(inp[lo: lo + m] if q == r else views[q][k][:m])
            self._pub(_D, f + 1)

        write(0)
        self._arrive(f0, deadline, same_numel=False, check_failed=False)
        descs = self._descs()
        for q in self._peers:
            if descs[q].numel != sizes[q]:
                self._mismatch(
                    q, descs[r], descs[q],
                    f": rank {r} expects {sizes[q]} elements from rank {q}, which sends {descs[q].numel}",
                )
        self._check_failed()
        self._pipeline(nf, write, read)

    def gather(
        self,
        outputs: Sequence[torch.Tensor] | None,
        input: torch.Tensor,
        root: int,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Gather every rank's ``input`` into ``outputs`` on ``root`` (``outputs[q]`` gets rank
        ``q``'s; sizes may differ per rank). Other ranks pass ``outputs=None`` (ignored).

        Raises:
            ValueError: bad ``root``, or on the root ``outputs`` is not one tensor per rank of
                ``input``'s dtype.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(input, "gather")
        self._check_root(root, "gather")
        r, n, K = self.rank, self.size, self._K
        is_root = r == root
        if is_root:
            self._check_list(outputs, "gather", "outputs")
            assert outputs is not None
            self._check_dtypes(outputs, input.dtype, "gather")
            if outputs[r].numel() != input.numel():
                raise ValueError(
                    f"gather: outputs[{r}] has {outputs[r].numel()} elements but the root's input "
                    f"has {input.numel()}"
                )
        deadline = self._enter("gather", timeout)
        try:
            with self._mode((*(outputs or ()), input)):
                inp = input.reshape(-1)
                flats = [_flat(o) for o in outputs] if is_root and outputs is not None else []
                outs = [f for f, _ in flats]
                if n == 1:
                    outs[0].copy_(inp)
                else:
                    E = self._F // inp.element_size()
                    mine = inp.numel()
                    f0 = self._write_desc(_Kind.GATHER, _dtype_code(inp.dtype), root=root, numel=mine)
                    views = self._frames_of(inp.dtype)

                    def write(s: int) -> None:
                        f = f0 + s
                        lo = s * E
                        m = min(E, mine - lo)
                        if m > 0 and not is_root:
                            self._credit(f, deadline)
                            views[r][f % K][:m].copy_(inp[lo: lo + m])
                        self._pub(_W, f + 1)

                    def read(s: int) -> None:
                        f = f0 + s
                        if is_root:
                            lo = s * E
                            k = f % K
                            self._wait(_W, f + 1, deadline)
                            for q in range(n):
                                m = min(E, outs[q].numel() - lo)
                                if m > 0:
                                    outs[q][lo: lo + m].copy_(inp[lo: lo + m] if q == r else views[q][k][:m])
                        self._pub(_D, f + 1)

                    write(0)
                    self._arrive(f0, deadline, same_numel=False, check_failed=False)
                    descs = self._descs()
                    if is_root:
                        for q in self._peers:
                            if descs[q].numel != outs[q].numel():
                                self._mismatch(
                                    q, descs[r], descs[q],
                                    f": the root expects {outs[q].numel()} elements from rank {q}, "
                                    f"which sends {descs[q].numel}",
                                )
                    nf = max(1, -(-max(d.numel for d in descs) // E))
                    self._check_failed()
                    self._pipeline(nf, write, read)
                for o, (f, copied) in zip(outputs or (), flats, strict=False):
                    if copied:
                        o.copy_(f.view(o.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None,
        root: int,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Copy ``inputs[q]`` on ``root`` into ``output`` on rank ``q`` (sizes may differ per
        rank). Other ranks pass ``inputs=None`` (ignored).

        Raises:
            ValueError: bad ``root``, or on the root ``inputs`` is not one tensor per rank of
                ``output``'s dtype.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "scatter")
        self._check_root(root, "scatter")
        r, n, K = self.rank, self.size, self._K
        is_root = r == root
        if is_root:
            self._check_list(inputs, "scatter", "inputs")
            assert inputs is not None
            self._check_dtypes(inputs, output.dtype, "scatter")
            if inputs[r].numel() != output.numel():
                raise ValueError(
                    f"scatter: inputs[{r}] has {inputs[r].numel()} elements but the root's output "
                    f"has {output.numel()}"
                )
        deadline = self._enter("scatter", timeout)
        try:
            with self._mode((output, *(inputs or ()))):
                out, copied = _flat(output)
                ins = [t.reshape(-1) for t in inputs] if is_root and inputs is not None else []
                sizes = [t.numel() for t in ins]
                if n == 1:
                    out.copy_(ins[0])
                else:
                    Es = self._sub_elems(out.element_size())
                    f0 = self._write_desc(_Kind.SCATTER, _dtype_code(out.dtype), root=root, sizes=sizes)
                    views = self._frames_of(out.dtype)

                    def write(s: int) -> None:
                        f = f0 + s
                        if is_root:
                            lo = s * Es
                            self._credit(f, deadline)
                            frame = views[r][f % K]
                            for q in self._peers:
                                m = min(Es, sizes[q] - lo)
                                if m > 0:
                                    frame[q * Es: q * Es + m].copy_(ins[q][lo: lo + m])
                        self._pub(_W, f + 1)

                    def read(s: int) -> None:
                        f = f0 + s
                        lo = s * Es
                        m = min(Es, out.numel() - lo)
                        if is_root:
                            if m > 0:
                                out[lo: lo + m].copy_(ins[r][lo: lo + m])
                        else:
                            self._wait(_W, f + 1, deadline, (root,))
                            if m > 0:
                                out[lo: lo + m].copy_(views[root][f % K][r * Es: r * Es + m])
                        self._pub(_D, f + 1)

                    write(0)
                    self._arrive(f0, deadline, same_numel=False, check_failed=False)
                    descs = self._descs()
                    theirs = descs[root].sizes
                    if len(theirs) != n or theirs[r] != out.numel():
                        self._mismatch(
                            root, descs[r], descs[root],
                            f": rank {r} expects {out.numel()} elements from the root",
                        )
                    nf = max(1, -(-max(theirs) // Es))
                    self._check_failed()
                    self._pipeline(nf, write, read)
                if copied:
                    output.copy_(out.view(output.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``inputs[q]`` across ranks into ``output`` on rank ``q``.

        ``inputs`` has one tensor per rank; ``inputs[q]`` has as many elements as rank ``q``'s
        ``output`` (the same list of sizes on every rank, checked).

        Raises:
            ValueError: sizes, dtypes or ``op`` do not fit.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "reduce_scatter")
        self._check_list(inputs, "reduce_scatter", "inputs")
        self._check_dtypes(inputs, output.dtype, "reduce_scatter")
        if inputs[self.rank].numel() != output.numel():
            raise ValueError(
                f"reduce_scatter: inputs[{self.rank}] has {inputs[self.rank].numel()} elements but "
                f"output has {output.numel()}"
            )
        red = as_red_op(op)
        fn = _reducer(output.dtype, red, "reduce_scatter")
        deadline = self._enter("reduce_scatter", timeout)
        try:
            with self._mode((output, *inputs)):
                self._reduce_scatter(output, [t.reshape(-1) for t in inputs], red, fn, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``input`` (``size`` times ``output``'s elements) across ranks; rank ``q``'s
        ``output`` gets block ``q`` of the result.

        Raises:
            ValueError: sizes, dtypes or ``op`` do not fit.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "reduce_scatter_tensor")
        _check_tensor(input, "reduce_scatter_tensor")
        if output.dtype != input.dtype or input.numel() != self.size * output.numel():
            raise ValueError(
                f"reduce_scatter_tensor: input ({input.dtype}, {input.numel()} elements) must be "
                f"{self.size} x output ({output.dtype}, {output.numel()} elements)"
            )
        red = as_red_op(op)
        fn = _reducer(output.dtype, red, "reduce_scatter_tensor")
        deadline = self._enter("reduce_scatter_tensor", timeout)
        try:
            with self._mode((output, input)):
                flat = input.reshape(-1)
                ins = list(torch.split(flat, output.numel())) if output.numel() else [flat] * self.size
                self._reduce_scatter(output, ins, red, fn, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _reduce_scatter(
        self, output: torch.Tensor, ins: list[torch.Tensor], op: RedOpType, fn: Reducer, deadline: float
    ) -> None:
        n, r, K = self.size, self.rank, self._K
        out, copied = _flat(output)
        if n == 1:
            out.copy_(ins[0])
        else:
            sizes = [t.numel() for t in ins]
            Es = self._sub_elems(out.element_size())
            nf = max(1, -(-max(sizes) // Es))
            f0 = self._write_desc(
                _Kind.REDUCE_SCATTER, _dtype_code(out.dtype), int(op), sizes=sizes
            )
            views = self._frames_of(out.dtype)
            avg = op is RedOpType.AVG

            def write(s: int) -> None:
                f = f0 + s
                lo = s * Es
                self._credit(f, deadline)
                frame = views[r][f % K]
                for q in self._peers:
                    m = min(Es, sizes[q] - lo)
                    if m > 0:
                        frame[q * Es: q * Es + m].copy_(ins[q][lo: lo + m])
                self._pub(_W, f + 1)

            def read(s: int) -> None:
                f = f0 + s
                lo = s * Es
                k = f % K
                m = min(Es, sizes[r] - lo)
                self._wait(_W, f + 1, deadline)
                if m > 0:
                    dst = out[lo: lo + m]
                    others = [views[q][k][r * Es: r * Es + m] for q in self._peers]
                    fn(ins[r][lo: lo + m], others[0], dst)
                    for o in others[1:]:
                        fn(dst, o, dst)
                    if avg:
                        dst.div_(n)
                self._pub(_D, f + 1)

            write(0)
            self._arrive(f0, deadline, same_numel=False, check_failed=False)
            descs = self._descs()
            for q in self._peers:
                if descs[q].sizes != tuple(sizes):
                    self._mismatch(q, descs[r], descs[q], ": the ranks' input sizes differ")
            self._check_failed()
            self._pipeline(nf, write, read)
        if copied:
            output.copy_(out.view(output.shape))

    def all_to_all(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Send ``inputs[q]`` to rank ``q``, which receives it in its ``outputs[rank]``.

        Sizes may differ per pair: ``outputs[q]`` must have as many elements as rank ``q``'s
        ``inputs[rank]`` (checked across ranks).

        Raises:
            ValueError: lists of the wrong length or mixed dtypes.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        self._check_list(outputs, "all_to_all", "outputs")
        self._check_list(inputs, "all_to_all", "inputs")
        dtype = inputs[0].dtype
        self._check_dtypes(inputs, dtype, "all_to_all")
        self._check_dtypes(outputs, dtype, "all_to_all")
        deadline = self._enter("all_to_all", timeout)
        try:
            with self._mode((*outputs, *inputs)):
                self._all_to_all(outputs, inputs, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _all_to_all(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], deadline: float
    ) -> None:
        n, r, K = self.size, self.rank, self._K
        ins = [t.reshape(-1) for t in inputs]
        flats = [_flat(o) for o in outputs]
        outs = [f for f, _ in flats]
        sizes = [t.numel() for t in ins]
        if outs[r].numel() != sizes[r]:
            raise ValueError(
                f"all_to_all: outputs[{r}] has {outs[r].numel()} elements but inputs[{r}] has "
                f"{sizes[r]}"
            )
        if n == 1:
            outs[0].copy_(ins[0])
        else:
            Es = self._sub_elems(ins[0].element_size())
            f0 = self._write_desc(_Kind.ALL_TO_ALL, _dtype_code(ins[0].dtype), sizes=sizes)
            views = self._frames_of(ins[0].dtype)

            def write(s: int) -> None:
                f = f0 + s
                lo = s * Es
                self._credit(f, deadline)
                frame = views[r][f % K]
                for q in self._peers:
                    m = min(Es, sizes[q] - lo)
                    if m > 0:
                        frame[q * Es: q * Es + m].copy_(ins[q][lo: lo + m])
                self._pub(_W, f + 1)

            def read(s: int) -> None:
                f = f0 + s
                lo = s * Es
                k = f % K
                self._wait(_W, f + 1, deadline)
                for q in range(n):
                    m = min(Es, outs[q].numel() - lo)
                    if m > 0:
                        src = ins[r][lo: lo + m] if q == r else views[q][k][r * Es: r * Es + m]
                        outs[q][lo: lo + m].copy_(src)
                self._pub(_D, f + 1)

            write(0)
            self._arrive(f0, deadline, same_numel=False, check_failed=False)
            descs = self._descs()
            for q in self._peers:
                theirs = descs[q].sizes
                if len(theirs) != n or theirs[r] != outs[q].numel():
                    got = theirs[r] if len(theirs) == n else "?"
                    self._mismatch(
                        q, descs[r], descs[q],
                        f": rank {r} expects {outs[q].numel()} elements from rank {q}, which sends {got}",
                    )
            nf = max(1, -(-max(max(d.sizes, default=0) for d in descs) // Es))
            self._check_failed()
            self._pipeline(nf, write, read)
        for o, (f, copied) in zip(outputs, flats, strict=True):
            if copied:
                o.copy_(f.view(o.shape))

    def _mode(self, tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
        """The context an operation runs in: autograd off if a tensor requires grad (in-place
        writes into a leaf would raise), intra-op threads capped for large tensors."""
        grad = False
        nbytes = 0
        for t in tensors:
            grad = grad or t.requires_grad
            nbytes += t.numel() * t.element_size()
        cap = nbytes > _PARALLEL_BYTES and torch.get_num_threads() > self._threads
        if not grad and not cap:
            return _NULL_CONTEXT
        return self._mode_slow(grad, cap)

    @contextlib.contextmanager
    def _mode_slow(self, grad: bool, cap: bool) -> Iterator[None]:
        # Each rank is one busy thread already: with more OpenMP threads than free cores the
        # threads of one parallel region wait for each other to be scheduled (measured here:
        # 64 MiB all_reduce 50x slower with torch's default 2 threads per rank on 2 cores).
        with capped(self._threads) if cap else _NULL_CONTEXT, torch.no_grad() if grad else _NULL_CONTEXT:
            yield

    # -- argument checks -------------------------------------------------------------------------
    def _sub_elems(self, itemsize: int) -> int:
        """Elements of one destination's sub-frame (64-byte aligned)."""
        A = max(1, 64 // itemsize)
        return (self._F // itemsize // self.size) // A * A

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{what}: root {root} is not a rank of this group of {self.size}")

    def _check_list(self, tensors: Sequence[torch.Tensor] | None, what: str, name: str) -> bool:
        if tensors is None or len(tensors) != self.size:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            raise ValueError(f"{what}: {name} must hold one tensor per rank ({self.size}), got {got}")
        for t in tensors:
            _check_tensor(t, what)
        return True

    @staticmethod
    def _check_dtypes(tensors: Sequence[torch.Tensor], dtype: torch.dtype, what: str) -> None:
        for t in tensors:
            if t.dtype != dtype:
                raise ValueError(f"{what}: all tensors must have dtype {dtype}, got {t.dtype}")

    # -- lifetime --------------------------------------------------------------------------------
    @property
    def broken(self) -> BaseException | None:
        """The failure that broke the arena, or None."""
        return self._broken

    def abort(self, reason: str = "aborted") -> None:
        """Break the arena from any thread: an operation waiting in this process raises
        ``DistBackendError``, the peers' raise ``PeerError`` quoting ``reason``."""
        if self._closed or self._mm is None:
            return
        self._aborted = reason
        self._fail(DistBackendError(f"rank {self.rank}: aborted: {reason}"))
        with contextlib.suppress(OSError):
            os.write(self._fifo_self, b"\x01")  # wakes our own waiter

    def close(self) -> None:
        """Leave the arena: peers still waiting for this rank raise ``PeerError``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._mm is not None and self._broken is None and os.getpid() == self._pid:
            with contextlib.suppress(ValueError, OSError):
                self._w[self._my + _STATE] = _CLOSED
                self._fence()
                for q in self._peers:
                    self._wake(q)
        self._teardown()

    def _teardown(self) -> None:
        self._hb_stop.set()
        thread = self._hb_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        _release(self._hb_stop, self._fds)
        self._fifo_r = self._fifo_self = -1
        self._fifo_w = {}
        self._pidfds = {}
        self._views = {}
        self._slot_cache = {}
        mm = self._mm
        self._mm = None
        if mm is not None:
            for attr in ("_buf", "_w", "_fw"):
                obj = self.__dict__.pop(attr, None)
                if isinstance(obj, memoryview) and (thread is None or not thread.is_alive()):
                    obj.release()
                del obj
            try:
                mm.close()
            except BufferError:  # a view escaped; the mapping goes with the last reference
                log.debug("rank %s: arena %s: mapping still referenced at close", self.rank, self.name)

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ready")
        return f"ShmArena({self.name!r}, rank={self.rank}, size={self.size}, {state})"
