"""Memory between processes of one host, and memory for what arrives: one place for both
transports (process groups' ``_endpoint`` and RPC's ``_messenger``).

Same-host copies. A large message to a process of this host is not written to the socket:
the sender names its buffers (``address``) in a ``DATA_CMA`` frame (``_protocol``'s one
format), the receiver copies them straight out of the sender's memory with
``process_vm_readv`` (``cma_read``: one copy, no socket; a large copy is shared by two
threads), and acks. ``CMA_MIN`` is the size from which a message goes this way.

Received memory. ``fresh_buffer(n)`` is where a received payload lands when no receive gave
its own memory: small ones in a fresh ``bytearray``, large ones in pooled mappings that are
populated once (on huge pages where the kernel gives them) and reused when nothing views them
any more (``_RecvPool``): faulting fresh pages costs more than the copy into them.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os
import sys
import threading
from typing import Any

__all__ = ["CMA_MIN", "address", "cma_possible", "cma_read", "fresh_buffer"]

_POPULATE_MIN = 1 << 20  # (smaller payloads: a bytearray, whose few pages fault in cheaply)
_HUGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _process_vm_readv: Any = _libc.process_vm_readv
    _process_vm_readv.restype = ctypes.c_ssize_t
except (OSError, AttributeError):  # not Linux, or no such call
    _process_vm_readv = None

# messages at least this large travel by cross-memory attach between processes of one host
CMA_MIN = int(os.environ.get("TDIST_CMA_MIN_BYTES", str(256 << 10)))


def cma_possible() -> bool:
    """Whether this process can copy out of another's memory at all (``process_vm_readv``
    exists, and same-host copies are on)."""
    return CMA_MIN > 0 and _process_vm_readv is not None


def address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for read-only buffers)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError, BufferError):
        return None


_CMA_SPLIT = 8 << 20  # bytes above which two threads share a copy
_cma_pool: concurrent.futures.ThreadPoolExecutor | None = None
_cma_pool_pid = 0  # a forked child has the pool object but not its thread: make a new one
_cma_pool_lock = threading.Lock()


def cma_read(pid: int, segments: list[tuple[int, int]], dest: memoryview) -> int:
    """Copy the segments of process ``pid`` into ``dest``; returns 0 or an errno.

    ``process_vm_readv`` pins the remote pages as it goes and copies at about half of memcpy
    speed, so a large copy is shared with a second thread (the call releases the GIL, and the
    sender is idle, waiting for our ack): the two halves run on two cores.
    """
    addr = address(dest)
    if addr is None or _process_vm_readv is None:
        return errno.ENOSYS
    total = sum(n for _, n in segments)
    if total >= _CMA_SPLIT and len(segments) == 1 and (os.cpu_count() or 1) > 1:
        global _cma_pool, _cma_pool_pid
        with _cma_pool_lock:
            if _cma_pool is None or _cma_pool_pid != os.getpid():
                _cma_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tdist-cma")
                _cma_pool_pid = os.getpid()
        base, length = segments[0]
        half = (length // 2) & ~4095
        other = _cma_pool.submit(_cma_copy, pid, [(base + half, length - half)], addr + half)
        mine = _cma_copy(pid, [(base, half)], addr)
        theirs = other.result()
        return mine or theirs
    return _cma_copy(pid, segments, addr)


def _cma_copy(pid: int, segments: list[tuple[int, int]], addr: int) -> int:
    off = 0
    for base, length in segments:
        done = 0
        while done < length:
            local = _IOVec(addr + off + done, length - done)
            remote = _IOVec(base + done, length - done)
            n = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if n <= 0:
                return ctypes.get_errno() or errno.EIO
            done += n
        off += length
    return 0



def _huge_mapping(n: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of at least ``n`` bytes, populated, on huge pages where the
    kernel gives them; returns it and the offset of its first 2 MiB boundary."""
    m = mmap.mmap(-1, n + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = address(memoryview(m))
    off = (-base) % _HUGE if base is not None else 0
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, n - n % _HUGE or n)
        m.madvise(_MADV_POPULATE_WRITE, off, n)
    except (OSError, AttributeError, ValueError):
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        off = 0
    return m, off


class _RecvPool:
    """Reused memory for large received payloads.

    Faulting fresh pages in costs more here than copying into them (64 MiB: 30 ms or more of
    faults against 10 ms of copy), so large payloads land in mappings that are populated once
    and reused. A received tensor views its mapping; the mapping is free again when nothing but
    the pool refers to it (its reference count says so), so a buffer is never reused while a
    tensor still uses it. Free mappings beyond ``limit`` bytes are dropped.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._maps: list[tuple[mmap.mmap, int, int]] = []  # (mapping, offset, usable bytes)

    def take(self, n: int) -> memoryview:
        size = -(-n // _HUGE) * _HUGE
        with self._lock:
            for i, entry in enumerate(self._maps):
                if entry[2] == size and _unused(entry):
                    del self._maps[i]
                    self._maps.append(entry)  # most recently used last
                    return memoryview(entry[0])[entry[1] : entry[1] + n]
            free_bytes = sum(e[2] for e in self._maps if _unused(e))
            if free_bytes + size > self.limit:
                keep = []
                for entry in self._maps:  # drop free mappings, least recently used first
                    if free_bytes + size > self.limit and _unused(entry):
                        free_bytes -= entry[2]
                    else:
                        keep.append(entry)
                self._maps = keep
            m, off = _huge_mapping(size)
            if size <= self.limit:
                self._maps.append((m, off, size))
            return memoryview(m)[off : off + n]


def _unused(entry: tuple[mmap.mmap, int, int]) -> bool:
    # referenced only by the pool's tuple and getrefcount's argument: no view of it is alive
    return sys.getrefcount(entry[0]) <= 2


_pool = _RecvPool(int(os.environ.get("TDIST_RECV_POOL_BYTES", str(1 << 30))))


def fresh_buffer(n: int) -> memoryview:
    """Writable memory for ``n`` received bytes (pooled, pre-faulted mappings when large)."""
    if n < _POPULATE_MIN:
        return memoryview(bytearray(n))
    return _pool.take(n)
