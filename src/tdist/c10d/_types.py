"""Process-group vocabulary shared by the API layer and every backend: ``ReduceOp``, the option
records torch passes to backends, ``Work`` (the handle of an operation in flight) and ``P2POp``.

Thread-safety: a ``Work`` is completed by one thread (the backend's) and waited on by any.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._core.deadline import to_seconds
from .._core.errors import CollectiveTimeoutError, DistError, fail_future, fresh

__all__ = [
    "AllToAllOptions",
    "AllgatherOptions",
    "AllreduceOptions",
    "BarrierOptions",
    "BroadcastOptions",
    "GatherOptions",
    "RedOpType",
    "ReduceOp",
    "ReduceOptions",
    "ReduceScatterOptions",
    "ScatterOptions",
    "Work",
    "as_red_op",
    "reduce_op",
]


class RedOpType(enum.IntEnum):
    """The reduction operations (torch's ``ReduceOp.RedOpType``)."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8
    UNUSED = 9

    def __repr__(self) -> str:
        return f"<RedOpType.{self.name}: {self.value}>"

    def __str__(self) -> str:
        return f"RedOpType.{self.name}"


_RedOpType = RedOpType


class _ReduceOpMeta(type):
    # torch's ReduceOp.SUM is a RedOpType, yet isinstance(ReduceOp.SUM, ReduceOp) holds there
    # (pybind11's implicit conversion); code that validates its ``op`` argument so must pass
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, RedOpType) or super().__instancecheck__(obj)


class ReduceOp(metaclass=_ReduceOpMeta):
    """An element-wise reduction for ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    ``ReduceOp.SUM`` and friends are ``RedOpType`` members, as in torch (and, as there, instances
    of ``ReduceOp`` for ``isinstance``); ``ReduceOp(op)`` wraps one and compares equal to it.
    """

    RedOpType = RedOpType
    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM
    UNUSED = RedOpType.UNUSED

    def __init__(self, op: _RedOpType) -> None:  # (no default: torch's ReduceOp() is a TypeError too)
        self.op = as_red_op(op)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RedOpType):
            return self.op == other
        if isinstance(other, ReduceOp):
            return self.op == other.op
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.op)

    def __repr__(self) -> str:
        return f"ReduceOp({self.op.name})"


def as_red_op(op: object) -> RedOpType:
    """Normalize ``op``: a ``RedOpType``, a ``ReduceOp``, the old ``reduce_op`` values, or
    torch's own (``torch.distributed.ReduceOp.MAX``, which is what ``tdist.ReduceOp.MAX`` is
    once torch is loaded, and ``ReduceOp`` objects such as ``_make_nccl_premul_sum``'s).

    Raises:
        ValueError: not a reduction operation.
    """
    if isinstance(op, RedOpType):
        return op
    if isinstance(op, ReduceOp):
        return op.op
    if type(op).__name__ == "RedOpType" and type(op).__module__.startswith("torch"):
        with contextlib.suppress(TypeError, ValueError):
            return RedOpType(int(op))  # type: ignore[call-overload]
    inner = getattr(op, "op", None)  # (torch's ReduceOp object: its RedOpType)
    if inner is not None and inner is not op and type(op).__module__.startswith("torch"):
        return as_red_op(inner)
    raise ValueError(f"Invalid ReduceOp: {op!r} (use dist.ReduceOp.SUM, PRODUCT, MIN, MAX, ...)")


class _ReduceOpAlias:
    """``torch.distributed.reduce_op``: the deprecated spelling of ``ReduceOp``."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__"):
            return object.__getattribute__(self, name)
        warnings.warn(
            "torch.distributed.reduce_op is deprecated, please use torch.distributed.ReduceOp instead",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(ReduceOp, name)


reduce_op = _ReduceOpAlias()


# -- options: torch's record types, torch's (camelCase) field names ------------------------------
class _Options:
    timeout: timedelta | None = None
    # False: the caller waits for the result at once, so the backend may run the operation in
    # the caller's thread (torch's options carry the same flag)
    asyncOp: bool = True

    def __init__(self, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__} has no option {name!r}")
            setattr(self, name, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


# option fields keep torch's camelCase names
class AllreduceOptions(_Options):
    reduceOp: RedOpType = RedOpType.SUM


class BroadcastOptions(_Options):
    rootRank: int = 0
    rootTensor: int = 0


class ReduceOptions(_Options):
    reduceOp: RedOpType = RedOpType.SUM
    rootRank: int = 0
    rootTensor: int = 0


class AllgatherOptions(_Options):
    pass


class GatherOptions(_Options):
    rootRank: int = 0


class ScatterOptions(_Options):
    rootRank: int = 0


class ReduceScatterOptions(_Options):
    reduceOp: RedOpType = RedOpType.SUM


class AllToAllOptions(_Options):
    pass


class BarrierOptions(_Options):
    device_ids: list[int] | None = None


# -- Work ----------------------------------------------------------------------------------------
#: torch's ``OpType`` numbers, by the operation names tdist's works carry
_OP_TYPES = {
    "broadcast": 0, "all_reduce": 1, "allreduce_coalesced": 2, "reduce": 3, "all_gather": 4,
    "all_gather_into_tensor": 5, "allgather_coalesced": 6, "gather": 7, "scatter": 8,
    "reduce_scatter": 9, "all_to_all_single": 10, "all_to_all": 11, "send": 12, "recv": 13,
    "recv_anysource": 14, "barrier": 15, "reduce_scatter_tensor": 16, "coalesced": 17,
    "reduce_scatter_tensor_coalesced": 19,
}


class Work:
    """The handle of a process-group operation (``torch.distributed.Work``).

    A backend completes it with ``_complete(result)`` or ``_fail(exc)`` from any thread.
    """

    def __init__(self, op: str = "", peer: str = "", result: list[Any] | None = None) -> None:
        self._op = op
        # the event is made only if someone waits before completion: most operations finish
        # in the caller's thread, and an Event (a Condition and two locks) costs microseconds
        self._is_done = False
        self._event: threading.Event | None = None
        self._exc: BaseException | None = None
        self._result: list[Any] = result if result is not None else []
        self._src_rank = -1
        self._future: Any = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Work], None]] = []
        self._started = time.monotonic()
        self._duration: float | None = None
        self.peer = peer

    @classmethod
    def completed(cls, result: list[Any] | None = None, op: str = "") -> Work:
        """A ``Work`` that is already done (for operations that finish inline)."""
        work = cls(op, result=result)
        work._complete(work._result)
        return work

    # -- the torch API ---------------------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation is done; returns True.

        Args:
            timeout: at most this long (``timedelta(0)``/``None``: the operation's own deadline,
                which backends always set, so this never blocks forever).

        Raises:
            CollectiveTimeoutError: the timeout expired first (the operation goes on).
            DistError: the operation failed; the backend's error, naming peer and operation.
        """
        seconds = to_seconds(timeout)
        if seconds == 0:
            seconds = None
        if not self._is_done:
            with self._lock:
                if self._event is None:
                    self._event = threading.Event()
                    if self._is_done:
                        self._event.set()
                event = self._event
            event.wait(seconds)
        if not self._is_done:
            raise CollectiveTimeoutError(
                f"Work.wait: {self._op or 'operation'} did not complete within {seconds:g} s"
            )
        if self._exc is not None:
            raise fresh(self._exc)  # (the work keeps its own: see ``fresh``)
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._is_done

    def is_success(self) -> bool:
        """Whether the operation has not failed: True while it runs too, as torch's (its
        ``!exception_``; an API torch deprecates). ``is_completed`` says whether it is done."""
        self.is_completed()  # (a subclass's poll: a receive that failed has its error set)
        return self._exc is None

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or None."""
        return self._exc

    def result(self) -> list[Any]:
        """The output tensors (after ``wait``)."""
        self.wait()
        return self._result

    def source_rank(self) -> int:
        """For a receive: the group rank the message came from.

        Raises:
            DistError: (a ``RuntimeError``) the operation is not a completed receive.
        """
        if self._src_rank < 0:
            raise DistError(
                f"source_rank() is only available for a completed recv or recv from any source, "
                f"not for {self._op or 'this operation'}"
            )
        return self._src_rank

    def _source_rank(self) -> int:
        """torch's spelling of ``source_rank()`` (what ``torch.distributed.recv`` itself calls)."""
        return self.source_rank()

    def _source_rank_value(self) -> int:
        return self._src_rank

    def block_current_stream(self) -> None:
        """Nothing to do for CPU tensors (no stream to block): returns at once, as torch's does."""

    def synchronize(self) -> None:
        """CPU tensors need no stream synchronization: a no-op once done."""
        self.wait()

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` completed with the output tensors (or the error)."""
        import torch

        with self._lock:
            if self._future is None:
                fut: Any = torch.futures.Future()
                self._future = fut
                if self._is_done:
                    self._settle_future()
            return self._future

    def _get_op_type(self) -> int:
        """torch's ``OpType`` number of the operation (100, UNKNOWN, for one it has none for)."""
        return _OP_TYPES.get(self._op, 100)

    def get_future_result(self) -> Any:
        """A ``torch.futures.Future`` completed, once the operation is over, with how it ended
        as an int of torch's ``WorkResult``: 0 success, 1 timeout, 2 communication error.
        (torch serves this on NCCL only; it never holds the operation's error.)"""
        import torch

        fut: Any = torch.futures.Future()

        def settle(w: Work) -> None:
            exc = w._exc
            if exc is None:
                fut.set_result(0)
            elif isinstance(exc, TimeoutError):  # (DistTimeoutError among them)
                fut.set_result(1)
            else:
                fut.set_result(2)

        self.add_done_callback(settle)
        return fut

    def _get_duration(self) -> float:
        """Milliseconds the operation took (torch's private helper)."""
        if self._duration is None:
            raise DistError("the operation has not completed")
        return self._duration * 1000.0

    # -- for backends ----------------------------------------------------------------------------
    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Run ``fn(self)`` when the operation completes (at once if it already has)."""
        with self._lock:
            if not self._is_done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _complete(self, result: list[Any] | None = None, source_rank: int = -1) -> None:
        self._finish(None, result, source_rank)

    def _fail(self, exc: BaseException) -> None:
        self._finish(exc, None, -1)

    def _finish(self, exc: BaseException | None, result: list[Any] | None, source_rank: int) -> None:
        kept = None if exc is None else fresh(exc)  # (``exc`` may be raised: see ``fresh``)
        with self._lock:
            if self._is_done:
                return
            self._exc = kept
            if result is not None:
                self._result = result
            if source_rank >= 0:
                self._src_rank = source_rank
            self._duration = time.monotonic() - self._started
            self._is_done = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
            if self._future is not None:
                self._settle_future()
        for fn in callbacks:
            fn(self)

    def _settle_future(self) -> None:
        fut = self._future
        if fut is None or fut.done():
            return
        if self._exc is not None:
            fail_future(fut, self._exc)
        else:
            fut.set_result(self._result)

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        if self._exc is not None:
            state = f"failed: {self._exc}"
        return f"Work({self._op}, {state})"
