"""Debug mode: the debug level, and the check that every rank calls the same collective.

Theory of operation. With ``TDIST_DEBUG=DETAIL`` (or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
or ``set_debug_level(DebugLevel.DETAIL)`` before the group is made) every process group gets a
``CollectiveChecker``. Before each collective, each rank describes its call as a
``Fingerprint`` (operation, dtype, root, reduction, the shapes that must agree, and the shapes
it sends to / expects from each peer) and writes it to the group's store under the collective's
sequence number; then it reads every rank's fingerprint and compares them (``compare``, a pure
function). Every rank reads the same fingerprints, so every rank reaches the same verdict: all
raise ``CollectiveMismatchError`` naming the ranks and what differs, or all go on. A rank that
never arrives makes the others fail after the group's timeout with an error naming it.

The check costs a store round trip per rank and collective; it is for finding bugs, not for
production. Fingerprints travel as JSON (never pickle: the store may be shared).

Thread-safety: a checker serves one group, whose collectives are issued in one order.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .._core.errors import CollectiveMismatchError, DistBackendError, DistError, PeerError, fresh

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "CollectiveChecker",
    "CollectiveMismatchError",
    "DebugLevel",
    "Fingerprint",
    "compare",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
]

log = logging.getLogger(__name__)


class DebugLevel(enum.IntEnum):
    """How much checking and logging the distributed layer does (torch's ``DebugLevel``)."""

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:
        return f"DebugLevel.{self.name}"


_level = DebugLevel.OFF


def get_debug_level() -> DebugLevel:
    """The current debug level (from ``TDIST_DEBUG`` / ``TORCH_DISTRIBUTED_DEBUG`` at import)."""
    return _level


def set_debug_level(level: DebugLevel) -> None:
    """Set the debug level; groups made afterwards check collectives at ``DETAIL``.

    Raises:
        TypeError: ``level`` is not a ``DebugLevel``.
    """
    global _level
    if not isinstance(level, DebugLevel):
        raise TypeError(f"set_debug_level expects a DebugLevel, got {type(level).__name__}")
    _level = level


def set_debug_level_from_env() -> None:
    """Set the debug level from ``TDIST_DEBUG`` or, if unset, ``TORCH_DISTRIBUTED_DEBUG``.

    Raises:
        ValueError: the variable holds something other than OFF, INFO or DETAIL (any case).
    """
    for var in ("TDIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        value = os.environ.get(var)
        if value:
            try:
                set_debug_level(DebugLevel[value.strip().upper()])
            except KeyError:
                raise ValueError(f"The value of {var} must be OFF, INFO, or DETAIL.") from None
            return
    set_debug_level(DebugLevel.OFF)


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Fingerprint:
    """One rank's description of a collective call.

    Attributes:
        op: the operation (``"all_reduce"``, ...).
        dtype: the tensors' dtype, if any.
        shape: a shape that must be the same on every rank, if any.
        root: the group rank of the root (broadcast, reduce, gather, scatter).
        reduce_op: the reduction, for reducing collectives.
        sends: ``peer -> shape`` this rank sends to each peer (where shapes may differ).
        recvs: ``peer -> shape`` this rank expects from each peer.
    """

    op: str
    dtype: str | None = None
    shape: Shape | None = None
    root: int | None = None
    reduce_op: str | None = None
    sends: Mapping[int, Shape] = field(default_factory=dict)
    recvs: Mapping[int, Shape] = field(default_factory=dict)

    def common(self) -> tuple[Any, ...]:
        """What must be equal on every rank."""
        return (self.op, self.dtype, self.shape, self.root, self.reduce_op)

    def describe(self) -> str:
        parts = []
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.shape is not None:
            parts.append(f"shape={list(self.shape)}")
        return f"{self.op}({', '.join(parts)})"

    def to_json(self) -> str:
        return json.dumps(
            {
                "op": self.op,
                "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape),
                "root": self.root,
                "reduce_op": self.reduce_op,
                "sends": {str(k): list(v) for k, v in self.sends.items()},
                "recvs": {str(k): list(v) for k, v in self.recvs.items()},
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Fingerprint:
        d = json.loads(text)
        return cls(
            op=d["op"],
            dtype=d["dtype"],
            shape=None if d["shape"] is None else tuple(d["shape"]),
            root=d["root"],
            reduce_op=d["reduce_op"],
            sends={int(k): tuple(v) for k, v in d["sends"].items()},
            recvs={int(k): tuple(v) for k, v in d["recvs"].items()},
        )


_FIELDS = ("operation", "dtype", "shape", "root", "reduction")


def compare(fps: Sequence[Fingerprint], me: int, seq: int = 0, group: str = "") -> str | None:
    """Compare every rank's fingerprint of one collective; ``None`` if they fit together.

    Args:
        fps: the fingerprints by group rank.
        me: this rank (the message speaks from its point of view).
        seq: the collective's sequence number in the group (for the message).
        group: the group's name (for the message).

    Returns:
        A message naming the ranks and what differs, or ``None``.
    """
    where = f"collective #{seq}" + (f" of group {group!r}" if group else "")
    variants: dict[tuple[Any, ...], list[int]] = {}
    for r, fp in enumerate(fps):
        variants.setdefault(fp.common(), []).append(r)
    if len(variants) > 1:
        mine = fps[me]
        other = next(r for r, fp in enumerate(fps) if fp.common() != mine.common())
        theirs = fps[other]
        pairs = zip(_FIELDS, mine.common(), theirs.common(), strict=True)
        if mine.op != theirs.op:  # (a root or a reduction that only one of the two ops has is no news)
            differ = [n for n, a, b in pairs if a != b and a is not None and b is not None]
        else:
            differ = [n for n, a, b in pairs if a != b]
        table = "; ".join(
            f"ranks {ranks}: {fps[ranks[0]].describe()}" for ranks in variants.values()
        )
        return (
            f"Detected mismatch between collectives on ranks ({where}). Rank {me} is running "
            f"collective: {mine.describe()}, but rank {other} is running collective: "
            f"{theirs.describe()}. Collectives differ in the following aspects: "
            f"{', '.join(differ)}. All ranks: {table}"
        )
    problems = []
    for i, fp in enumerate(fps):
        for j, shape in sorted(fp.sends.items()):
            if not 0 <= j < len(fps):
                continue
            expected = fps[j].recvs.get(i)
            if expected is not None and tuple(expected) != tuple(shape):
                problems.append(
                    f"rank {i} sends a tensor of shape {list(shape)} to rank {j}, which expects "
                    f"shape {list(expected)}"
                )
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        return (
            f"Detected mismatch between collectives on ranks ({where}, {fps[me].describe()}): "
            f"tensor sizes do not fit together: {shown}"
        )
    return None


#: how long a rank that found a mismatch waits for the others to have read the fingerprints
_MISMATCH_WAIT = 5.0
#: seconds between two looks at the lost ranks while a check waits for their fingerprints
_LOOK = 0.5


class CollectiveChecker:
    """Exchanges fingerprints through ``store`` before each collective of one group.

    Args:
        store: a store namespace private to the group's checks.
        rank: this rank in the group.
        size: the group's size.
        timeout: how long to wait for the other ranks' fingerprints.
        group: the group's name, for messages.
        lost: the group's ranks known gone, with why (the backend's ``lost_peers``): a rank
            that died or stalled fails the wait for its fingerprint at once, as the collective
            would without the check, not at the timeout.
        broken: the failure that broke the group (the backend's), if one did: its ranks that
            went on do not wait for the fingerprints of ranks that will never check again.
        fail: breaks the group with a rank's loss found here (the backend's ``break_group``),
            so that every rank's next call fails, the lost one's too should it come back.
    """

    def __init__(
        self, store: Store, rank: int, size: int, timeout: timedelta, group: str,
        lost: Callable[[], dict[int, str]] | None = None,
        broken: Callable[[], BaseException | None] | None = None,
        fail: Callable[[DistError], None] | None = None,
    ) -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._group = group
        self._lost = lost
        self._broken = broken
        self._fail = fail
        self._seq = 0
        self._lock = threading.Lock()

    def check(self, fp: Fingerprint) -> None:
        """Publish ``fp``, read every rank's, and raise if they do not fit together.

        Raises:
            CollectiveMismatchError: the calls differ (raised on every rank alike).
            DistBackendError: ranks did not reach the collective within the timeout.
        """
        with self._lock:
            seq = self._seq
            self._seq += 1
        keys = [f"{seq}/{r}" for r in range(self._size)]
        self._store.set(keys[self._rank], fp.to_json())
        try:
            self._wait(keys, fp, seq)
        except (DistError, TimeoutError) as exc:
            if isinstance(exc, DistBackendError):  # (a rank gone, the group broken: said already)
                raise
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise DistBackendError(
                f"[Rank {self._rank}] debug check of {fp.describe()} ({self._where(seq)}): ranks "
                f"{missing} did not reach collective #{seq} within "
                f"{self._timeout.total_seconds():g} s (they are stuck, or called fewer "
                "collectives on this group)"
            ) from exc
        fps = [Fingerprint.from_json(v) for v in self._store.multi_get(keys)]
        if seq > 0:
            # every rank has published #seq, so every rank has finished reading #seq - 1
            self._store.delete_key(f"{seq - 1}/{self._rank}")
        message = compare(fps, self._rank, seq, self._group)
        if message is not None:
            # (every rank finds it alike: they leave once all have read the fingerprints, so
            # that the store's host, raising and exiting first, takes no rank's read with it)
            self._all_read(seq)
            raise CollectiveMismatchError(message)

    def _wait(self, keys: list[str], fp: Fingerprint, seq: int) -> None:
        """Wait for every rank's fingerprint, looking at the lost ranks every ``_LOOK`` s.

        Raises:
            PeerError: a rank whose fingerprint is missing is gone (its process died or stalled).
            DistError, TimeoutError: the timeout expired, or the store failed.
        """
        if self._lost is None and self._broken is None:
            self._store.wait(keys, self._timeout)
            return
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            look = min(_LOOK, max(0.0, deadline - time.monotonic()))
            try:
                self._store.wait(keys, timedelta(seconds=max(look, 0.001)))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            gone = self._lost() if self._lost is not None else {}
            for r, k in enumerate(keys):
                if r in gone and not self._store.check([k]):  # (what it left before it went counts)
                    err = PeerError(
                        f"[Rank {self._rank}] debug check of {fp.describe()} ({self._where(seq)}): rank "
                        f"{r} will never reach it: {gone[r]}", peer=r,
                    )
                    if self._fail is not None:
                        self._fail(err)
                    raise fresh(err)  # (``err`` is kept: see ``fresh``)
            failure = self._broken() if self._broken is not None else None
            if failure is not None:
                raise DistBackendError(
                    f"[Rank {self._rank}] debug check of {fp.describe()} ({self._where(seq)}): the process "
                    f"group is broken by an earlier failure: {failure}"
                ) from failure

    def _all_read(self, seq: int) -> None:
        """Wait, at most ``_MISMATCH_WAIT`` seconds, until every rank has read collective
        ``seq``'s fingerprints."""
        with contextlib.suppress(DistError, TimeoutError):
            if self._store.add(f"{seq}/read", 1) == self._size:
                self._store.set(f"{seq}/all_read", b"1")
            else:
                wait = min(_MISMATCH_WAIT, self._timeout.total_seconds())
                self._store.wait([f"{seq}/all_read"], timedelta(seconds=wait))

    def _where(self, seq: int) -> str:
        return f"collective #{seq} of group {self._group!r}"


# torch's TORCH_CPP_LOG_LEVEL values (c10's log levels, by name or number)
_CPP_LOG_LEVELS = {
    "INFO": logging.INFO, "0": logging.INFO, "WARNING": logging.WARNING, "1": logging.WARNING,
    "ERROR": logging.ERROR, "2": logging.ERROR, "FATAL": logging.CRITICAL, "3": logging.CRITICAL,
}


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """tdist's records on stderr, as torch's C++ side prints c10d's, while the program has
    configured no logging of its own (once it has, the records go there)."""

    def __init__(self) -> None:
        super().__init__()  # (sys.stderr)
        self.setFormatter(logging.Formatter(
            "[%(levelname).1s%(asctime)s %(filename)s:%(lineno)d] [tdist] %(message)s", "%m%d %H:%M:%S"
        ))

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def log_level_from_env() -> None:
    """torch's ``TORCH_CPP_LOG_LEVEL`` (what c10d's C++ side prints on stderr: ``INFO``,
    ``WARNING``, ``ERROR``, ``FATAL`` or 0-3) for tdist's loggers: their level, and at ``INFO``
    a stderr handler (where the program configures no logging). Unset or another value: the
    c10d logger's level is ``WARNING`` (torch's C++ default), whatever the root logger's."""
    level = _CPP_LOG_LEVELS.get(os.environ.get("TORCH_CPP_LOG_LEVEL", "").strip().upper())
    if level is None:
        # (tdist's c10d is where torch's C++ c10d is, whose INFO lines only that variable
        # shows: a program that sets Python's root logger to INFO, as hydra does, sees none)
        logging.getLogger("tdist.c10d").setLevel(logging.WARNING)
        return
    logger = logging.getLogger("tdist")
    logger.setLevel(level)
    if level < logging.WARNING and not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())


log_level_from_env()
try:
    set_debug_level_from_env()
except ValueError as _exc:  # a bad variable must not make ``import tdist`` fail
    import warnings

    warnings.warn(f"{_exc} Debug checks stay OFF.", RuntimeWarning, stacklevel=1)
