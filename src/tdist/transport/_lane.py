"""Shared-memory lanes: small messages between two processes of one host without a socket.

A lane is a ring of records in a ``memfd`` that one process (the producer) writes and one peer
(the consumer) reads: one lane per direction of a connection. The producer makes it the first
time it has a small message for that peer and announces it on the connection (a ``LANE``
frame); the consumer opens it through ``/proc/<pid>/fd/<n>`` as the shared-memory arena opens
its segment, so a lane exists only between processes that may open each other's descriptors.

Layout: a header page, then ``CAPACITY`` bytes of records. The header holds the producer's
``head`` and the consumer's ``tail`` (bytes written and consumed since the start, on cache
lines of their own) and the consumer's count of ``sleepers``. A record is ``seq, tag, nbytes,
meta_len`` (``RECORD``), the meta, the payload, padded to 8 bytes; one that would not fit
before the ring's end leaves a ``SKIP`` word and starts over at the beginning.

Memory order. The producer writes a record, then stores ``head``; the consumer loads ``head``,
then reads the record, then stores ``tail``: x86's total store order keeps both in order
without fences (the owner of a lane checks ``memory_order_ok`` first, as the arena does). A
consumer that goes to sleep counts itself in ``sleepers``, fences and looks at ``head`` once
more; the producer stores ``head``, fences and reads ``sleepers``: one of the two sees the
other (a locked instruction is the fence), so a sleeper is never left with a message it was not
told of (the producer wakes it through the connection).

This module is sans-IO apart from the mapping: ``put``/``peek``/``pop`` move bytes, and the
endpoint decides what they mean.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import NamedTuple

from .._core.errors import DistError, RemoteProtocolError

__all__ = ["CAPACITY", "MAX_RECORD", "Lane", "Record"]

_MAGIC = 0x7464697374_4C4E  # "tdistLN"
_VERSION = 1
CAPACITY = 256 << 10  # bytes of records in a lane
MAX_RECORD = 32 << 10  # the largest record (header, meta and payload) a lane takes
_HEADER_BYTES = 4096
_W_MAGIC, _W_VERSION, _W_CAPACITY = 0, 1, 2
_W_HEAD = 8  # (one cache line each: the producer's, the consumer's)
_W_TAIL = 16
_W_SLEEPERS = 24
RECORD = struct.Struct("<QQII")
SKIP = (1 << 64) - 1  # a seq word that says: the rest of the ring is padding
_SIZE = _HEADER_BYTES + CAPACITY


class Record(NamedTuple):
    seq: int
    tag: int
    meta: bytes
    payload: memoryview  # (the lane's memory: copy it before ``pop``)
    size: int  # bytes the record takes in the ring, padding and skip included


class Lane:
    """One direction of a lane, as its producer (``Lane.create``) or its consumer
    (``Lane.open``) sees it. Not thread-safe: the producer's calls under its connection's
    send lock, the consumer's under its endpoint's lock."""

    __slots__ = ("_buf", "_fence", "_mm", "_w", "fd", "producer")

    def __init__(self, mm: mmap.mmap, fd: int, producer: bool) -> None:
        self._mm = mm
        self._w = memoryview(mm).cast("Q")
        self._buf = memoryview(mm)[_HEADER_BYTES:]
        self._fence = threading.Lock()  # (acquired and released: a locked instruction, the fence)
        self.fd = fd  # (the producer's descriptor, which the consumer opens; -1 for a consumer)
        self.producer = producer

    @classmethod
    def create(cls) -> Lane:
        """A new lane, as its producer (its descriptor stays open until ``close``)."""
        fd = os.memfd_create("tdist-lane", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _SIZE)
            mm = mmap.mmap(fd, _SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        lane = cls(mm, fd, True)
        w = lane._w
        w[_W_VERSION] = _VERSION
        w[_W_CAPACITY] = CAPACITY
        w[_W_MAGIC] = _MAGIC
        return lane

    @classmethod
    def open(cls, pid: int, fd: int) -> Lane:
        """The lane that process ``pid`` made as descriptor ``fd``, as its consumer.

        Raises:
            DistError: it cannot be opened, or is not a lane of this version.
        """
        path = f"/proc/{pid}/fd/{fd}"
        try:
            own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise DistError(f"cannot open the shared-memory lane {path}: {exc}") from exc
        try:
            if os.fstat(own).st_size != _SIZE:
                raise DistError(f"{path} is not a tdist lane ({os.fstat(own).st_size} bytes, expected {_SIZE})")
            mm = mmap.mmap(own, _SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise DistError(f"cannot map the shared-memory lane {path}: {exc}") from exc
        finally:
            os.close(own)
        lane = cls(mm, -1, False)
        w = lane._w
        if (w[_W_MAGIC], w[_W_VERSION], w[_W_CAPACITY]) != (_MAGIC, _VERSION, CAPACITY):
            raise DistError(f"{path} is not a tdist lane of this version")
        return lane

    # -- the producer ------------------------------------------------------------------------
    def put(self, seq: int, tag: int, meta: bytes, payload: list[memoryview], nbytes: int) -> bool:
        """Write one record; False when it does not fit now (too large, or the lane is full)."""
        size = -(-(RECORD.size + len(meta) + nbytes) // 8) * 8
        if size > MAX_RECORD:
            return False
        w = self._w
        head = w[_W_HEAD]
        pos = head % CAPACITY
        skip = CAPACITY - pos if pos + size > CAPACITY else 0
        if head + skip + size - w[_W_TAIL] > CAPACITY:
            return False
        buf = self._buf
        if skip:
            struct.pack_into("<Q", buf, pos, SKIP)
            pos = 0
        RECORD.pack_into(buf, pos, seq, tag, nbytes, len(meta))
        at = pos + RECORD.size
        if meta:
            buf[at:at + len(meta)] = meta
            at += len(meta)
        for v in payload:
            n = v.nbytes
            if n:
                buf[at:at + n] = v
                at += n
        w[_W_HEAD] = head + skip + size  # (published: the record is whole before this store)
        return True

    def sleepers(self) -> int:
        """How many of the consumer's waiters sleep (after a fence: see the module docstring)."""
        self._fence.acquire()
        self._fence.release()
        return self._w[_W_SLEEPERS]

    # -- the consumer ------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether a record is there (one load each of head and tail)."""
        w = self._w
        return w[_W_HEAD] != w[_W_TAIL]

    def peek(self) -> Record | None:
        """The next record, without taking it; None when there is none.

        Raises:
            RemoteProtocolError: the ring holds what no producer writes.
        """
        w = self._w
        tail = w[_W_TAIL]
        head = w[_W_HEAD]
        if head == tail:
            return None
        buf = self._buf
        pos = tail % CAPACITY
        skip = 0
        if struct.unpack_from("<Q", buf, pos)[0] == SKIP:
            skip = CAPACITY - pos
            pos = 0
        seq, tag, nbytes, meta_len = RECORD.unpack_from(buf, pos)
        size = -(-(RECORD.size + meta_len + nbytes) // 8) * 8
        if size > MAX_RECORD or tail + skip + size > head:
            raise RemoteProtocolError(f"a lane holds a record of {size} bytes beyond what was written")
        at = pos + RECORD.size
        meta = bytes(buf[at:at + meta_len]) if meta_len else b""
        at += meta_len
        return Record(seq, tag, meta, buf[at:at + nbytes], skip + size)

    def pop(self, record: Record) -> None:
        """Give ``record``'s room back to the producer (its payload is copied out)."""
        self._w[_W_TAIL] += record.size

    def sleep(self, delta: int) -> None:
        """Count a waiter that goes to sleep (+1; then look at ``ready`` once more) or wakes (-1)."""
        self._w[_W_SLEEPERS] += delta
        self._fence.acquire()
        self._fence.release()

    def close(self) -> None:
        """Close the producer's descriptor. The mapping goes with the last reference to it, so
        a thread still looking at the lane reads memory that is there."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
