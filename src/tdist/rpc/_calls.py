"""The bookkeeping of one call: what the agent's pending table holds for a request, what a
blocking call waits on, how a call is described in messages, and the error of one that ran out
of time.

``_Call`` is an entry of the pending table (its future, the callee, a description, the timeout
and the deadline, the handler of a late reply). A blocking call waits on a ``_SyncReply``, the
part of ``torch.futures.Future`` the agent uses, at a fraction of its cost; a call that a user
holds gets a real ``Future``. ``CallText`` and ``LazyText`` are written out only when a message
needs them, not on every call. ``call_counts`` tells how many requests of each kind this
process sent and how many of them failed (``tdist run --metrics-port`` exports them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .._core.errors import DistTimeoutError, fresh
from . import _errors

__all__ = ["CallText", "LazyText", "RpcTimeoutError", "call_counts"]


_EXPIRED = 1e-9  # a deadline that has passed when the request is out


class RpcTimeoutError(DistTimeoutError):
    """An RPC (or ``to_here``) did not finish within its timeout. A ``RuntimeError`` and a
    ``TimeoutError``; the text starts like torch's."""


_reply_lock = threading.Lock()

# requests sent and failed, by kind (``MsgKind``); process-wide (every agent of the process,
# ranks run as threads included), so that they only grow across ``init_rpc``/``shutdown``
_sent: dict[Any, int] = {}
_failed: dict[Any, int] = {}
_count_lock = threading.Lock()


def count_sent(kind: Any) -> None:
    """One more request of ``kind`` goes out."""
    with _count_lock:
        _sent[kind] = _sent.get(kind, 0) + 1


def count_failed(kind: Any) -> None:
    """One more request of ``kind`` ended with an error (the callee's, a timeout, a lost peer)."""
    with _count_lock:
        _failed[kind] = _failed.get(kind, 0) + 1


def call_counts() -> dict[str, tuple[int, int]]:
    """The requests this process sent, by kind (``"call"``: ``rpc_sync``/``rpc_async``,
    ``"remote"``, ``"fetch"``: ``to_here``, ``"join"``): ``(sent, failed)``."""
    with _count_lock:
        sent, failed = dict(_sent), dict(_failed)
    return {getattr(k, "name", str(k)).lower(): (n, failed.get(k, 0)) for k, n in sent.items()}


class _SyncReply:
    """The part of ``torch.futures.Future`` the agent uses, at a fraction of its cost, where no
    user ever holds one: what a blocking call waits on (``rpc_sync`` returns the value) and an
    owned RRef value (users get copies or ``local_value()``)."""

    # ``as_tensor`` (set only on an owned value made by ``RRef(parameter)``): a user fetches a
    # plain tensor, as torch's does for a value whose type TorchScript infers
    __slots__ = ("_callbacks", "_done", "_exc", "_tdist_spin", "_value", "as_tensor")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Any], None]] | None = None
        self._tdist_spin: Any = None  # (the agent's spin budget for the wait on it)

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._value = value
        self._fire()

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._fire()

    def _fire(self) -> None:
        with _reply_lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            cb(self)

    def add_done_callback(self, cb: Callable[[Any], None]) -> None:
        with _reply_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self) -> Any:
        if not self._done:
            _wait_future(self, None)
        if self._exc is not None:
            raise fresh(self._exc)  # (kept, and raised again by a later call: see ``fresh``)
        return self._value

    def value(self) -> Any:
        """The result of a done future (its exception raised)."""
        if self._exc is not None:
            raise fresh(self._exc)  # (kept, and raised again by a later call: see ``fresh``)
        return self._value


class CallText:
    """What a request is, for messages (``rpc_sync(worker1, mod.fn)``): written out only when a
    message needs it, not on every call."""

    __slots__ = ("api", "dst", "func")

    def __init__(self, api: str, dst: str, func: Any) -> None:
        self.api = api
        self.dst = dst
        self.func = func

    def __str__(self) -> str:
        return f"{self.api}({self.dst}, {_errors.describe_call(self.func)})"

    __repr__ = __str__


class LazyText:
    """``fmt % args``, written out only when a message needs it."""

    __slots__ = ("args", "fmt")

    def __init__(self, fmt: str, *args: Any) -> None:
        self.fmt = fmt
        self.args = args

    def __str__(self) -> str:
        return self.fmt % self.args

    __repr__ = __str__


class _Call:
    __slots__ = ("deadline", "dst", "fut", "kind", "on_reply", "seconds", "started", "what")

    def __init__(self, fut: Any, dst: int, what: object, seconds: float | None, deadline: float | None, on_reply: Callable[[Any, BaseException | None], None] | None, kind: Any = None) -> None:
        self.kind = kind  # (its MsgKind, for ``call_counts``)
        self.fut = fut
        self.dst = dst
        self.what = what
        self.seconds = seconds
        self.deadline = deadline
        self.on_reply = on_reply
        self.started = time.monotonic()  # (the flight recorder's "age" of a call in flight)


def _wait_future(fut: Any, timeout: float | None) -> None:
    if fut.done():
        return
    ev = threading.Event()
    fut.add_done_callback(lambda _f: ev.set())
    ev.wait(timeout)
