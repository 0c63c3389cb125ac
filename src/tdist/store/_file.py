"""``FileStore``: a store that processes share through one file (a local or shared file system).

Theory of operation
-------------------
The file is an append-only log of records after an 8-byte header. A record carries one or more
operations (set, append, delete, queue push, queue pop, and the handle count) and is written
with one ``pwrite`` while holding an exclusive ``flock``; readers take a shared ``flock``. Each
handle replays the records it has not seen yet (from its own offset) onto a private
``KVState``, so every handle sees the same semantics as the store server. Read-modify-write
commands (``add``, ``compare_set``, ``delete_key``, ``queue_pop``) decide on the replayed state
under the exclusive lock and log their *effect* (``add`` logs the new value), so replay needs no
arithmetic and every handle agrees.

A record is ``magic | crc32 | length | payload``. A writer killed mid-write leaves a torn record
at the end: readers see a short or corrupt tail and treat it as not yet written; the next writer
(holding the exclusive lock, so no live writer can own that tail) truncates it before appending.

One internal record, the handle count ``(opened, closed)``, is the coordination key torch
documents ("one key is used to coordinate all the workers"): ``num_keys()`` counts it, as
torch's does. When a handle closes and no handle remains open and at least ``world_size``
handles have closed (``world_size >= 0``), the file is removed, as torch does.

When the log grows past a threshold and is mostly dead records, a writer compacts it: it
writes a snapshot to a new file and renames it over the path. Every handle checks, after taking
the lock, that its descriptor still names the file at the path; if not it reopens and replays.

Blocking calls poll the file (1 ms, backing off to 16 ms) under one monotonic deadline. As in
torch, a timeout of zero means "wait forever". Handles are thread-safe; a handle inherited
across ``fork`` reopens the file and counts itself as a new handle on first use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from enum import IntEnum
from types import TracebackType
from typing import NamedTuple

from .._core.deadline import Deadline
from .._core.errors import DistStoreError, QueueEmptyError, StoreTimeoutError, StoreValueError
from ._api import DEFAULT_TIMEOUT, Store, as_bytes, check_key, key_list
from ._hash import timeout_message
from ._state import KVState, check_amount, parse_counter, wrap_int64

__all__ = ["FileOp", "FileStore", "Kind", "encode_record", "parse_records"]

log = logging.getLogger(__name__)

FILE_MAGIC = b"TDISTFS\x01"
_RECORD = struct.Struct("<2sIQ")  # magic, crc32 of (length, payload), payload length
_RECORD_MAGIC = b"\xd7\x5e"
_LENGTH = struct.Struct("<Q")
_OP = struct.Struct("<BIQ")  # kind, key length, value length
_REFS = struct.Struct("<qq")  # handles opened, handles closed

_POLL_FIRST = 0.001
_POLL_MAX = 0.016
_LOCK_SPIN_FIRST = 0.00005
_LOCK_SPIN_MAX = 0.005
# compact when the log passes this size and is more than half dead records
COMPACT_MIN_BYTES = 64 << 20

_HINT = "the process that sets them may be slow, dead, or using another file"

# Every open handle, so that a forked child can replace their thread locks: a lock held by
# another thread of the parent at the fork would be held forever in the child.
_handles: weakref.WeakSet[FileStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for handle in list(_handles):
        handle._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Kind(IntEnum):
    """What one logged operation does."""

    SET = 1
    APPEND = 2
    DELETE = 3
    PUSH = 4
    POP = 5
    REFS = 6


class FileOp(NamedTuple):
    kind: Kind
    key: str
    value: bytes = b""


def encode_record(ops: Sequence[FileOp]) -> bytes:
    """The bytes of one record holding ``ops`` (applied all together or not at all)."""
    parts: list[bytes] = [b""]
    for op in ops:
        key = op.key.encode()
        parts += (_OP.pack(op.kind, len(key), len(op.value)), key, op.value)
    length = sum(len(p) for p in parts)
    crc = zlib.crc32(_LENGTH.pack(length))
    for part in parts:
        crc = zlib.crc32(part, crc)
    # one join: a value of many MB is copied once
    parts[0] = _RECORD.pack(_RECORD_MAGIC, crc, length)
    return b"".join(parts)


def _decode_payload(payload: memoryview) -> list[FileOp] | None:
    ops: list[FileOp] = []
    pos, end = 0, len(payload)
    try:
        while pos < end:
            kind, klen, vlen = _OP.unpack_from(payload, pos)
            pos += _OP.size
            key = bytes(payload[pos : pos + klen]).decode()
            pos += klen
            value = bytes(payload[pos : pos + vlen])
            pos += vlen
            if pos > end:
                return None
            ops.append(FileOp(Kind(kind), key, value))
    except (struct.error, UnicodeDecodeError, ValueError):
        return None
    return ops


def parse_records(buf: bytes | memoryview, pos: int = 0) -> tuple[list[FileOp], int, bool]:
    """Decode the whole records in ``buf`` from ``pos``.

    Returns:
        ``(ops, end, torn)``: the operations of every complete, intact record; the offset just
        past the last of them; and whether bytes follow that are not a complete intact record
        (a write in progress, or the remains of a writer that died).
    """
    view = memoryview(buf)
    ops: list[FileOp] = []
    n = len(view)
    while pos < n:
        if n - pos < _RECORD.size:
            return ops, pos, True
        magic, crc, length = _RECORD.unpack_from(view, pos)
        start = pos + _RECORD.size
        if magic != _RECORD_MAGIC or start + length > n:
            return ops, pos, True
        payload = view[start : start + length]
        if zlib.crc32(payload, zlib.crc32(_LENGTH.pack(length))) != crc:
            return ops, pos, True
        decoded = _decode_payload(payload)
        if decoded is None:
            return ops, pos, True
        ops.extend(decoded)
        pos = start + length
    return ops, pos, False


class FileStore(Store):
    """A store shared by the processes that open the same file (``torch.distributed.FileStore``).

    Args:
        file_name: the file's path; it is created if missing. Use a fresh path per job: a
            file left by an earlier job still holds that job's keys.
        world_size: the number of handles expected; when that many have been closed and none
            is open, the last one removes the file. ``-1`` (the default) never removes it.

    Raises:
        DistStoreError: the file cannot be opened, or is not a tdist FileStore file.
    """

    _waits_in_chunks = True

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        super().__init__(DEFAULT_TIMEOUT)
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"FileStore file_name must be str, got {type(file_name).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"FileStore world_size must be int, got {type(world_size).__name__}")
        self._path = os.fspath(file_name)
        self._world_size = world_size
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._ident: tuple[int, int] = (0, 0)
        self._offset = 0
        self._state = KVState()
        self._refs = (0, 0)
        self._pid = os.getpid()
        self._closed = False
        self._compact_at = COMPACT_MIN_BYTES
        with self._lock:
            try:
                self._join()
            except BaseException:
                self._closed = True
                self._drop_fd()
                raise
        _handles.add(self)

    # -- the file ------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"FileStore at {self._path}"

    def _os_error(self, what: str, exc: OSError) -> DistStoreError:
        return DistStoreError(f"{self._where()}: {what} failed: {exc}")

    def _open(self, create: bool) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self._path, flags, 0o644)
        except FileNotFoundError as exc:
            if create:  # the directory is missing
                raise self._os_error("opening the file", exc) from exc
            raise self._removed() from None
        except OSError as exc:
            raise self._os_error("opening the file", exc) from exc
        st = os.fstat(fd)
        self._fd, self._ident = fd, (st.st_dev, st.st_ino)
        self._offset, self._state, self._refs = 0, KVState(), (0, 0)
        self._compact_at = max(COMPACT_MIN_BYTES, 2 * st.st_size)

    def _drop_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _removed(self) -> DistStoreError:
        return DistStoreError(
            f"{self._where()}: the file was removed while this handle was open (the last of "
            "world_size handles closed it, or something else deleted it); use a new FileStore"
        )

    def _join(self) -> None:
        """Open the file and count this handle in (the lock of the handle is held)."""
        self._pid = os.getpid()
        self._open(create=True)
        with self._flocked(exclusive=True, create=True):
            opened, closed = self._refs
            self._write([FileOp(Kind.REFS, "", _REFS.pack(opened + 1, closed))])

    @contextlib.contextmanager
    def _flocked(self, exclusive: bool, create: bool = False) -> Iterator[None]:
        """Hold the file lock, on the file now at the path, with this handle's view up to date.

        With ``create``, a file removed before we locked it is created again (a handle opening
        just as the last one closes); otherwise that is an error.
        """
        if self._closed:
            raise DistStoreError(f"{self._where()}: this handle is closed")
        if self._pid != os.getpid():
            # a forked child must not share its parent's open file description (and lock)
            self._drop_fd()
            self._join()
        try:
            self._lock_current(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, create)
        except DistStoreError:  # StoreTimeoutError is an OSError too: let ours through
            raise
        except OSError as exc:
            raise self._os_error("locking the file", exc) from exc
        try:
            try:
                self._refresh(exclusive)
            except DistStoreError:
                raise
            except OSError as exc:
                raise self._os_error("reading the file", exc) from exc
            yield
        finally:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _lock_current(self, mode: int, create: bool) -> None:
        while True:
            if self._fd is None:
                self._open(create)
            fd = self._fd
            assert fd is not None
            self._flock(fd, mode)
            try:
                st = os.stat(self._path)
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) == self._ident:
                return
            # removed (by the last handle) or replaced (by a compaction): start over
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._drop_fd()
            if st is None and not create:
                raise self._removed()

    def _flock(self, fd: int, mode: int) -> None:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        # poll rather than block, so that a holder that never lets go (a stopped process)
        # costs a timeout and not a hang
        seconds = self._timeout_seconds(None)
        deadline = Deadline(None if seconds == 0 else seconds)
        delay = _LOCK_SPIN_FIRST
        while True:
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise StoreTimeoutError(
                    f"{self._where()}: could not lock the file within {seconds:g} s; another "
                    "process holds its lock (it may be stopped or hung)"
                )
            time.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, _LOCK_SPIN_MAX)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                continue

    def _refresh(self, exclusive: bool) -> None:
        """Replay the records written since our offset; a writer also repairs a torn tail."""
        fd = self._fd
        assert fd is not None
        size = os.fstat(fd).st_size
        if self._offset == 0:
            self._check_header(fd, size, exclusive)
            if self._offset == 0:
                return  # an empty or torn header: nothing written yet
        if size == self._offset:
            return
        try:
            buf = _pread_all(fd, size - self._offset, self._offset)
        except OSError as exc:
            raise self._os_error("reading the file", exc) from exc
        ops, end, torn = parse_records(buf)
        for op in ops:
            self._apply(op)
        self._offset += end
        if torn and exclusive:
            # we hold the exclusive lock, so no live writer owns these bytes
            log.warning(
                "%s: removing %d bytes of a torn record at offset %d (a writer died mid-write)",
                self._where(),
                size - self._offset,
                self._offset,
            )
            os.ftruncate(fd, self._offset)

    def _check_header(self, fd: int, size: int, exclusive: bool) -> None:
        head = _pread_all(fd, min(size, len(FILE_MAGIC)), 0)
        if head == FILE_MAGIC:
            self._offset = len(FILE_MAGIC)
            return
        if not FILE_MAGIC.startswith(head) or size > len(FILE_MAGIC):
            raise DistStoreError(
                f"{self._where()}: the file is not a tdist FileStore file (it starts with "
                f"{head!r}); remove it or use another path"
            )
        if exclusive:  # empty, or a header whose writer died: (re)write it
            os.ftruncate(fd, 0)
            _pwrite_all(fd, FILE_MAGIC, 0)
            self._offset = len(FILE_MAGIC)

    def _apply(self, op: FileOp) -> None:
        state = self._state
        kind = op.kind
        if kind == Kind.SET:
            state.set(op.key, op.value)
        elif kind == Kind.APPEND:
            state.append(op.key, op.value)
        elif kind == Kind.DELETE:
            state.delete(op.key)
        elif kind == Kind.PUSH:
            state.queue_push(op.key, op.value)
        elif kind == Kind.POP:
            state.queue_pop(op.key)
        elif kind == Kind.REFS:
            opened, closed = _REFS.unpack(op.value)
            self._refs = (opened, closed)

    def _write(self, ops: Sequence[FileOp]) -> None:
        """Log ``ops`` and apply them here (the exclusive lock is held and the view is current)."""
        fd = self._fd
        assert fd is not None and self._offset > 0
        record = encode_record(ops)
        try:
            _pwrite_all(fd, record, self._offset)
        except OSError as exc:
            # leave no torn record behind us (a full disk, say)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._offset)
            raise self._os_error("writing the file", exc) from exc
        self._offset += len(record)
        for op in ops:
            self._apply(op)
        if self._offset >= self._compact_at:
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        state = self._state
        live = sum(len(k) + len(v) + 32 for k, v in state.data.items())
        live += sum(len(k) + len(v) + 32 for k, q in state.queues.items() for v in q)
        if 2 * live > self._offset:
            self._compact_at = 2 * self._offset
            return
        ops = [FileOp(Kind.SET, k, v) for k, v in state.data.items()]
        ops += [FileOp(Kind.PUSH, k, v) for k, q in state.queues.items() for v in q]
        ops.append(FileOp(Kind.REFS, "", _REFS.pack(*self._refs)))
        tmp = f"{self._path}.compact-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                assert self._fd is not None
                os.fchmod(fd, os.fstat(self._fd).st_mode & 0o777)
                _pwrite_all(fd, FILE_MAGIC + encode_record(ops), 0)
                # lock it before it is visible, so that nobody can use it before we let go
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.rename(tmp, self._path)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("%s: could not compact the log: %s", self._where(), exc)
            self._compact_at = 2 * self._offset
            return
        old = self._fd
        st = os.fstat(fd)
        log.info(
            "%s: compacted the log from %d to %d bytes", self._where(), self._offset, st.st_size
        )
        self._fd, self._ident, self._offset = fd, (st.st_dev, st.st_ino), st.st_size
        self._compact_at = max(COMPACT_MIN_BYTES, 2 * st.st_size)
        if old is not None:
            fcntl.flock(old, fcntl.LOCK_UN)
            os.close(old)

    # -- waiting -------------------------------------------------------------------------------
    def _poll(
        self, missing_of: Callable[[KVState], list[str]], timeout: timedelta | float | None
    ) -> None:
        """Poll until ``missing_of(state)`` is empty.

        Raises:
            StoreTimeoutError: naming what is still missing when the timeout expired.
        """
        seconds = self._timeout_seconds(timeout)
        deadline = Deadline(None if seconds == 0 else seconds)
        delay = _POLL_FIRST
        while True:
            with self._lock, self._flocked(exclusive=False):
                missing = missing_of(self._state)
            if not missing:
                return
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise StoreTimeoutError(timeout_message(seconds, missing, self._where(), _HINT))
            time.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)

    # -- the Store API -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    @property
    def world_size(self) -> int:
        """The number of handles after whose closing the file is removed (-1: never)."""
        return self._world_size

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``, replacing any old value."""
        op = FileOp(Kind.SET, check_key(key), as_bytes(value))
        with self._lock, self._flocked(exclusive=True):
            self._write([op])

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set.

        Raises:
            StoreTimeoutError: the key was not set in time.
        """
        return self.multi_get([key])[0]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if missing); returns the new value.

        Raises:
            StoreValueError: the key holds something that is not an integer (nothing is
                written; the store stays usable).
        """
        key = check_key(key)
        amount = check_amount(amount)
        with self._lock, self._flocked(exclusive=True):
            raw = self._state.data.get(key)
            value = wrap_int64(amount if raw is None else parse_counter(key, raw) + amount)
            self._write([FileOp(Kind.SET, key, str(value).encode())])
        return value

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (missing = ``b""``).

        Returns:
            The value after the call; for a missing key and a non-empty ``expected_value``,
            ``expected_value`` (as torch does).
        """
        key = check_key(key)
        expected, desired = as_bytes(expected_value), as_bytes(desired_value)
        with self._lock, self._flocked(exclusive=True):
            current = self._state.data.get(key)
            if current is None and expected != b"":
                return expected
            if current is not None and current != expected:
                return current
            self._write([FileOp(Kind.SET, key, desired)])
            return desired

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` is set (or is a non-empty queue).

        Raises:
            StoreTimeoutError: naming the keys still missing when the timeout expired.
        """
        keys = key_list(keys, "wait")
        wanted = [check_key(k) for k in keys]
        self._poll(lambda state: state.missing(wanted), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set (or is a non-empty queue), without waiting."""
        keys = key_list(keys, "check")
        wanted = [check_key(k) for k in keys]
        with self._lock, self._flocked(exclusive=False):
            return not self._state.missing(wanted)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; a queue of that name is not a key and stays (as torch's stores).

        Returns:
            Whether it existed (torch's FileStore always returns True).
        """
        key = check_key(key)
        with self._lock, self._flocked(exclusive=True):
            if key not in self._state.data:
                return False
            self._write([FileOp(Kind.DELETE, key)])
            return True

    def num_keys(self) -> int:
        """The number of keys, plus the one key that coordinates the handles (as torch)."""
        with self._lock, self._flocked(exclusive=False):
            return self._state.num_keys() + 1

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to the store's timeout for all of them.

        Raises:
            StoreTimeoutError: naming the keys still missing when the timeout expired.
        """
        keys = key_list(keys, "multi_get")
        wanted = [check_key(k) for k in keys]
        values: list[bytes] = []

        def missing(state: KVState) -> list[str]:
            # get needs a value: a key that only names a queue does not count
            absent = [k for k in wanted if k not in state.data]
            if not absent:
                values[:] = [state.data[k] for k in wanted]
            return absent

        self._poll(missing, None)
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set every key to the matching value, in one record (all or none are written)."""
        keys = key_list(keys, "multi_set")
        if len(keys) != len(values):
            raise StoreValueError(f"multi_set: {len(keys)} keys but {len(values)} values; they must be of the same size")
        ops = [
            FileOp(Kind.SET, check_key(k), as_bytes(v)) for k, v in zip(keys, values, strict=True)
        ]
        with self._lock, self._flocked(exclusive=True):
            self._write(ops)

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (set it if missing)."""
        op = FileOp(Kind.APPEND, check_key(key), as_bytes(value))
        with self._lock, self._flocked(exclusive=True):
            self._write([op])

    def list_keys(self) -> list[str]:
        """Every key in the store (without the coordination key that ``num_keys`` counts)."""
        with self._lock, self._flocked(exclusive=False):
            return self._state.list_keys()

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Push ``value`` at the tail of the queue ``key``."""
        op = FileOp(Kind.PUSH, check_key(key), as_bytes(value))
        with self._lock, self._flocked(exclusive=True):
            self._write([op])

    def _try_pop(self, key: str) -> bytes | None:
        with self._lock, self._flocked(exclusive=True):
            queue = self._state.queues.get(key)
            if not queue:
                return None
            value = queue[0]
            self._write([FileOp(Kind.POP, key)])
            return value

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the head of the queue ``key``, waiting up to the store's timeout if ``block``.

        Raises:
            QueueEmptyError: ``block`` is False and the queue is empty.
            StoreTimeoutError: nothing was pushed in time.
        """
        key = check_key(key)
        value = self._try_pop(key)
        if value is not None:
            return value
        if not block:
            raise QueueEmptyError(f"queue {key!r} is empty ({self._where()})")
        seconds = self._timeout_seconds(None)
        deadline = Deadline(None if seconds == 0 else seconds)
        delay = _POLL_FIRST
        while True:
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise StoreTimeoutError(timeout_message(seconds, [key], self._where(), _HINT))
            time.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)
            value = self._try_pop(key)
            if value is not None:
                return value

    def queue_len(self, key: str) -> int:
        """The number of values in the queue ``key``."""
        key = check_key(key)
        with self._lock, self._flocked(exclusive=False):
            return self._state.queue_len(key)

    def clone(self) -> FileStore:
        """A new handle on the same file (counted as a handle, as torch's clone is)."""
        other = FileStore(self._path, self._world_size)
        other.set_timeout(self._timeout)
        return other

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Count this handle out; the last of ``world_size`` handles removes the file.

        Idempotent. A handle that a forked child inherited and never used closes silently.
        """
        if self._closed:
            return
        with self._lock:
            if self._closed:
                return
            try:
                if self._pid == os.getpid() and self._fd is not None:
                    self._leave()
            finally:
                self._closed = True
                self._drop_fd()

    def _leave(self) -> None:
        try:
            with self._flocked(exclusive=True):
                opened, closed = self._refs
                closed += 1
                self._write([FileOp(Kind.REFS, "", _REFS.pack(opened, closed))])
                if opened - closed <= 0 and 0 <= self._world_size <= closed:
                    log.debug("%s: the last handle closed; removing the file", self._where())
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path)
        except DistStoreError as exc:
            # the file is gone already (removed by hand, say): nothing left to count
            log.debug("%s: close: %s", self._where(), exc)

    def __enter__(self) -> FileStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"world_size={self._world_size}"
        return f"FileStore({self._path!r}, {state})"


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.pwrite(fd, view, offset)
        except InterruptedError:
            continue
        if written == 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written
