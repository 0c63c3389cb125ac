"""The arena's core: making and mapping the segment, publishing and waiting on the
counters, operation descriptors and arrival, failures, and closing.

``ArenaCore`` holds all of an arena but its collectives, which ``ShmArena`` (``_arena``) builds
on ``_write_desc``, ``_arrive``, ``_credit``, ``_pub``, ``_wait`` and ``_pipeline``.

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

Waiting
-------
A waiter checks the counters; if they are not there yet it spins for ``spin_us`` as
``_core.spin``'s one policy says (polling without yielding for half of it, then at most
``spin.YIELDS`` ``os.sched_yield()`` calls so that a rank sharing its core with ours runs), then
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

Failures
--------
Nothing hangs silently:

* a peer process that exits (kill -9 included) makes its pidfd readable: every rank waiting on
  it raises ``PeerError`` naming the rank, its pid and the operation, at once;
* a peer that stops without exiting (SIGSTOP, a frozen machine) stops its heartbeat thread,
  which writes ``time.monotonic()`` into its control block every ``heartbeat_interval / 3`` (or
  its owner's thread, through ``beat()``: the ``tcp`` backend's endpoint heartbeat); a
  waiter that finds a peer's heartbeat older than ``stall_timeout`` (default
  ``3 * heartbeat_interval``, measured against its own heartbeat so that a paused host accuses
  nobody) raises ``PeerError`` naming it as stalled;
* an operation past its deadline raises ``CollectiveTimeoutError`` naming the operation and the ranks
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
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import math
import mmap
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Self

import torch

from ..._core import spin
from ..._core.deadline import to_seconds
from ..._core.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistBackendError,
    DistError,
    PeerError,
    fresh,
)
from ...store._api import Store, multi_get_within
from ...transport._liveness import STALL_CAUSES, still_running
from .._threads import usable_cores
from .._types import RedOpType
from ._layout import (
    _CLOSED,
    _D,
    _DESC,
    _DESC_HEAD,
    _ERR,
    _ERR_BYTES,
    _ERRLEN,
    _FAILED,
    _HB,
    _HEADER_WORDS,
    _MAGIC,
    _PID,
    _READY,
    _SLEEP,
    _STATE,
    _VERSION,
    _W,
    _X,
    _Desc,
    _dtype_name,
    _Kind,
    _round_up,
    default_frame_bytes,
    memory_order_ok,
)
from ._lifetime import _heartbeat_loop, _prefault, _release

__all__ = ["ArenaCore"]

log = logging.getLogger(__name__)

_DEFAULT_FRAMES = 4
_DEFAULT_SMALL_BYTES = 64 << 10
_DEFAULT_SPIN_US = spin.SPIN * 1e6


_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")  # (compiled at import: not on the way to a group)


def _sanitize(name: str) -> str:
    return _UNSAFE.sub("_", name)[:48] or "group"


class ArenaCore:
    """An arena without its collectives: the segment, the counters, the waiting, the
    descriptors and the failures (``ShmArena`` documents the arguments).

    Thread-safety: call an arena's methods from one thread at a time, except ``abort``.
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
        store: Store | None,
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
        beats: bool = True,
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
        self._threads = max(1, usable_cores() // size)
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
        self._own_beats = beats  # (False: the owner calls ``beat()``, from its own heartbeat thread)
        self._unfaulted: mmap.mmap | None = None  # (faulted in by the first ``beat()`` after join)
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

        self._joined = False
        try:
            self._prepare()
            if store is not None:
                self._exchange(store)
        except BaseException:
            self._teardown()
            raise

    # -- construction ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        """This rank's half of the set-up, before it hears of the others: rank 0 makes the
        segment and writes its header; every rank makes its wake-up pipe (``record`` says where
        both are). Every rank maps the segment in ``join`` (rank 0 too: its mapping, 0.1-0.3 ms
        here, then comes after its record is out, beside the others', not before them)."""
        self._seg_fd = -1
        if self.rank == 0:
            # a memfd: shared memory without a name, gone with the last process that holds it
            seg_fd = os.memfd_create(f"tdist-arena-{_sanitize(self.name)}", os.MFD_CLOEXEC)
            self._fds.append(seg_fd)
            os.ftruncate(seg_fd, self._nbytes)
            header = array.array("Q", self._layout())
            if os.pwrite(seg_fd, header.tobytes(), 0) != 8 * len(header):
                raise OSError(f"a short write of the header of arena {self.name!r}")
            # (no posix_fallocate: a memfd lives on the kernel's own shmem mount, which has no
            # size limit, so a page that cannot be had is the memory controller's business, as
            # for any tensor's page; allocating 8 MiB up front cost every group 1.6 ms of CPU)
            self._seg_fd = seg_fd
        # our wake-up pipe: peers open its read end as writers through /proc; we keep its write
        # end open too (a pipe with no writer would read EOF, and abort() wakes us through it)
        self._fifo_r, self._fifo_self = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fds += [self._fifo_r, self._fifo_self]

    @property
    def record(self) -> dict[str, int]:
        """What the other ranks need of this one to join it (JSON-able): its pid, its wake-up
        pipe, and on rank 0 the segment. A caller that exchanges the records itself (the
        ``tcp`` backend, with its connection addresses) constructs the arena with
        ``store=None`` and then calls ``join``."""
        out = {"pid": self._pid, "wake": self._fifo_r}
        if self.rank == 0:
            out["seg"] = self._seg_fd
        return out

    def _exchange(self, store: Store) -> None:
        # the k-th arena of this name that this rank makes pairs with everyone's k-th: a group
        # re-created over the same store does not read the keys of the one before
        gen = store.add(f"shm/{self.name}/generation/{self.rank}", 1)
        prefix = f"shm/{self.name}/{gen}/"
        store.set(prefix + f"rank/{self.rank}", json.dumps(self.record))
        # (every rank's record in one request, where the store's timeout is ours)
        keys = [prefix + f"rank/{q}" for q in range(self.size)]
        values = multi_get_within(store, keys, timedelta(seconds=self._timeout))
        self.join({q: json.loads(v.decode()) for q, v in enumerate(values)})

    def join(self, records: Mapping[int, Mapping[str, Any]]) -> None:
        """Finish the set-up with every rank's ``record`` (by rank): map rank 0's segment, open
        the peers' wake-up pipes, start the heartbeat.

        Raises:
            DistError / PeerError: a peer's segment or pipe cannot be opened, or it exited.
        """
        try:
            self._join(records)
        except BaseException:
            self._teardown()
            raise
        self._joined = True

    def _layout(self) -> tuple[int, ...]:
        """The segment's header: what every rank must agree on."""
        return (_MAGIC, _VERSION, self.size, self._K, self._F, self._rank_words, self._data_off, self._small)

    def _join(self, records: Mapping[int, Mapping[str, Any]]) -> None:
        if self.rank == 0:
            self._map(self._seg_fd)
        else:
            seg = records[0]
            seg_path = f"/proc/{seg['pid']}/fd/{seg['seg']}"
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
            expected = self._layout()
            if header != expected:
                raise DistError(
                    f"rank {self.rank}: segment {seg_path} has layout {header}, expected {expected} "
                    "(magic, version, size, frames, frame_bytes, control words, data offset, "
                    "small_bytes): do all ranks pass the same options?"
                )

        self._poll = select.poll()
        self._poll.register(self._fifo_r, select.POLLIN)
        for q in self._peers:
            info = records[q]
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
        if self._own_beats:
            self._hb_thread = threading.Thread(
                target=_heartbeat_loop,
                args=(fw, self._my + _HB, self._hb_interval / 3.0, self._hb_stop, self._mm),
                name=f"tdist-shm-heartbeat-{self.name}-r{self.rank}",
                daemon=True,
            )
            self._hb_thread.start()
        else:
            self._unfaulted = self._mm

        # (no barrier here: the first operation waits for every rank anyway, and a peer whose
        # heartbeat is still 0 is only subject to the deadline; rank 0 keeps its descriptor of
        # the segment open until close, for peers that open it later)
        log.debug(
            "rank %s: shared-memory arena %s ready: %s ranks, %s frames of %s bytes",
            self.rank, self.name, self.size, self._K, self._F,
        )

    def beat(self) -> None:
        """This rank's heartbeat, for an arena made with ``beats=False``: its owner calls it
        from a thread of its own (the ``tcp`` backend: its endpoint's heartbeat rounds) more
        often than every ``stall_timeout / 3``. The first call after ``join`` faults the
        segment in (a chunk at a time). Never raises; a closed arena ignores it."""
        fw = self.__dict__.get("_fw")
        if fw is None or self._closed or not self._joined:
            return
        with contextlib.suppress(ValueError):  # (released by a close meanwhile)
            fw[self._my + _HB] = time.monotonic()
        mm, self._unfaulted = self._unfaulted, None
        if mm is not None:
            _prefault(mm, self._hb_stop)

    def _map(self, fd: int) -> None:
        # (not pre-faulted here: MAP_POPULATE costs 3 ms for the default 8 MiB, on every rank,
        # before the group exists; the first heartbeat faults it in instead)
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
        self._broken = fresh(exc)  # (``exc`` is raised: see ``fresh``)
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
        # (debug: the caller raises it, and a program that handles it wants no line on stderr)
        log.debug("rank %s: shared-memory arena %s failed in %s: %s", self.rank, self.name, self._op, exc)

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
                if now > spin_end or yields >= spin.YIELDS:
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
            # (a peer that runs all the same is busy in one call that holds its interpreter
            # lock: only the operation's timeout applies; see ``transport._liveness``)
            if age - max(my_age, 0.0) > self._stall and not still_running(pid):
                raise PeerError(
                    f"rank {self.rank}: peer rank {q} (pid {pid}) stalled during {self._op}: no "
                    f"heartbeat for {age:.1f} s (limit {self._stall:g} s); it is "
                    f"{STALL_CAUSES[True]} (SIGSTOP, a debugger, swapped out?)",
                    peer=q,
                )

    def _timeout_error(self, word: int, target: int, missing: list[int]) -> CollectiveTimeoutError:
        frame = target - 1 - self._frame
        if word == _D:
            what = "released a ring slot (finished reading an earlier frame)"
        elif frame <= 0:  # (operations counted from 1, as the flight recorder's collectives are)
            what = f"arrived at operation #{self._seq + 1}"
        else:
            step = "reduced" if word == _X else "written"
            what = f"{step} frame {frame} of operation #{self._seq + 1}"
        return CollectiveTimeoutError(
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
        return f"{kind}({', '.join(parts)}) as operation #{d.seq + 1} at frame {d.f0}"

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
        if self._mm is not None and self._joined and self._broken is None and os.getpid() == self._pid:
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ready")
        return f"ShmArena({self.name!r}, rank={self.rank}, size={self.size}, {state})"
