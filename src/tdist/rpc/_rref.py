"""``RRef``: a reference to a value that lives on one worker, and the agent's side of the
reference-counting protocol.

Theory of operation. The decisions are ``_rref_protocol``'s (pure). ``RRefContext`` holds one
``RRefProtocol`` per agent under a lock, feeds it what happens here (a ``remote()``, an RRef
pickled into or out of a message, a Python ``RRef`` object dying, a protocol message, a lost
peer) and performs its actions: protocol messages go out on one sender thread, in order;
``DeleteOwner`` drops the owned value; ``Confirmed`` marks the Python object. Python objects die
in ``__del__``, possibly inside the garbage collector on any thread, so they only enqueue their
release (``SimpleQueue.put`` is safe there) and the sender thread tells the protocol.

An ``RRef`` pickles only inside an RPC message (the agent says which worker it goes to): that
is a fork. Unpickling makes an owner object on the owner and a user object anywhere else.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import types
import weakref
from typing import Any

import torch

from .._core.errors import DistError, PeerError, fresh
from . import _errors, _hooks, _remote_profiling
from ._agent import RpcAgent, current_agent, note_unconfirmed, serialization_peer
from ._calls import CallText, LazyText, RpcTimeoutError
from ._execution import _not_a_future, _OwnerError, failed, run_user_function
from ._future import Future
from ._message import MsgKind
from ._rref_protocol import (
    Confirmed,
    DeleteOwner,
    ForkId,
    GloballyUniqueId,
    ProtocolWarning,
    RRefId,
    RRefLost,
    RRefProtocol,
    Send,
    UserDelete,
)
from ._worker_info import WorkerInfo
from .constants import UNSET_RPC_TIMEOUT
from .rref_proxy import RRefProxy

__all__ = ["RRef", "RRefContext", "create_remote", "owner_leaks", "release_all", "settle"]

_DELETE_DELAY = 0.005  # seconds a lone deletion waits for others to travel with
_SETTLE_MAX = 10.0  # seconds shutdown waits for the RRef protocol to settle here

CREATION_TIMED_OUT = (
    "RRef creation via rpc.remote() timed out, and it is possible that the RRef on the owner node "
    "does not exist."
)
"""How ``to_here()`` of an RRef whose ``remote()`` timed out starts its error (torch's text)."""

log = logging.getLogger(__name__)


class RRefContext:
    """The agent's RRef state: the protocol, live user objects, the ordered sender."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.proto = RRefProtocol(agent.rank)
        self.lock = threading.Lock()
        self.users: dict[ForkId, weakref.ref[RRef]] = {}
        self.lost: dict[RRefId, str] = {}
        self._out: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._queued = 0  # items put and not yet done (approximate, for settle())
        self._pending: dict[int, list[Any]] = {}  # protocol messages not sent yet, by worker
        self._released: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake_pending = False
        # requests that wait for user RRefs they carried to be confirmed: (forks, start)
        self._waiting: list[tuple[list[ForkId], Any]] = []
        self._thread = threading.Thread(target=self._loop, name=f"tdist-rref-{agent.rank}", daemon=True)
        self._thread.start()

    def run(self, fn: Any, *args: Any) -> Any:
        """Call a protocol method under the lock and perform its actions."""
        with self.lock:
            actions = fn(*args)
            self.perform(actions)
        return actions

    def when_confirmed(self, forks: list[ForkId], start: Any) -> None:
        """Call ``start()`` once every user RRef in ``forks`` is confirmed by its owner or lost
        (a lost one fails where it is used, with the reason)."""
        with self.lock:
            if any(self._unconfirmed(f) for f in forks):
                self._waiting.append((forks, start))
                return
        start()

    def _unconfirmed(self, fork_id: ForkId) -> bool:
        u = self.proto.user(fork_id)
        return u is not None and not u.confirmed and not u.lost

    def _wake(self) -> None:
        """(Under the lock.) Start the waiting requests whose RRefs are all confirmed now."""
        still = []
        for forks, start in self._waiting:
            if any(self._unconfirmed(f) for f in forks):
                still.append((forks, start))
            else:
                start()
        self._waiting = still

    def perform(self, actions: Any) -> None:
        wake = False
        for a in actions:
            if isinstance(a, Send):
                self._put(("send", (a.dst, a.msg)))
            elif isinstance(a, DeleteOwner):
                self.agent._owners.pop(a.rref_id, None)
            elif isinstance(a, Confirmed):
                ref = self.users.get(a.fork_id)
                obj = ref() if ref is not None else None
                if obj is not None:
                    obj._confirmed = True
                wake = bool(self._waiting)
            elif isinstance(a, RRefLost):
                self.lost[a.rref_id] = a.reason
                wake = bool(self._waiting)
                fut = self.agent._owners.get(a.rref_id)
                if fut is not None and not fut.done():
                    err = RuntimeError(f"{self.agent.label}: RRef {a.rref_id} is lost: {a.reason}")
                    fut.set_result(_OwnerError(_errors.capture(err, self.agent.label)))
            elif isinstance(a, ProtocolWarning):
                log.info("%s: RRef protocol: %s", self.agent.label, a.text)
        if wake:
            self._wake()

    def _put(self, item: tuple[str, Any]) -> None:
        self._queued += 1
        self._out.put(item)

    def released(self, kind: str, ident: Any) -> None:
        """From ``__del__``: a Python object died (no locks taken here: ``deque.append`` and
        ``SimpleQueue.put`` are safe inside the garbage collector). The sender thread is woken
        once per batch of releases, not once per release."""
        self._released.append((kind, ident))
        if not self._wake_pending:
            self._wake_pending = True
            self._queued += 1
            self._out.put(("wake", None))

    def _loop(self) -> None:
        # Protocol messages to one worker travel together: those queued while one was being
        # handled go in one message. Deletions alone (nothing waits for them) wait a little
        # for company, so a loop that drops RRefs costs one message per few milliseconds.
        pending = self._pending
        oldest: float | None = None  # when the oldest unsent message was queued
        while True:
            try:
                item = self._out.get(timeout=_DELETE_DELAY) if pending else self._out.get()
            except queue.Empty:
                self._flush(pending)
                oldest = None
                continue
            if item is None:
                self._flush(pending)
                return
            kind, arg = item
            try:
                if kind == "send":
                    dst, msg = arg
                    pending.setdefault(dst, []).append(msg)
                elif kind == "wake":
                    time.sleep(_DELETE_DELAY)  # let more releases gather
                    self._wake_pending = False
                    self._take_releases()
            except Exception:
                log.exception("%s: RRef bookkeeping failed", self.agent.label)
            finally:
                self._queued -= 1
                del item
            if not pending:
                oldest = None
            elif oldest is None:
                oldest = time.monotonic()
            if pending and (
                (self._out.empty() and not all(isinstance(m, UserDelete) for ms in pending.values() for m in ms))
                or time.monotonic() - (oldest or 0.0) >= _DELETE_DELAY  # releases that never stop
            ):
                self._flush(pending)
                oldest = None

    def _take_releases(self) -> None:
        while self._released:
            kind, arg = self._released.popleft()
            with self.lock:
                if kind == "user":
                    self.users.pop(arg, None)
                    if self.proto.user(arg) is not None:
                        self.perform(self.proto.user_released(arg))
                elif self.proto.has_owner(arg):
                    self.perform(self.proto.owner_released(arg))

    def _flush(self, pending: dict[int, list[Any]]) -> None:
        for dst, msgs in pending.items():
            try:
                self.agent._transmit(dst, 0, MsgKind.RREF, msgs, time.monotonic() + 30.0)
            except (DistError, OSError) as exc:
                log.debug("%s: RRef messages to %s not sent: %s", self.agent.label, self.agent.describe(dst), exc)
        pending.clear()

    def busy(self) -> bool:
        return self._queued > 0 or bool(self._released) or self._unflushed()

    def _unflushed(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        self._out.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)


def release_all(agent: RpcAgent) -> list[str]:
    """Graceful shutdown: release every user reference; returns the leaks (held locally)."""
    ctx: RRefContext = agent.rref_ctx
    ctx._take_releases()  # objects already gone are not leaks
    with ctx.lock:
        ctx.perform(ctx.proto.release_all_users())
        return [str(leak) for leak in ctx.proto.leaks() if leak.role == "user"]


def owner_leaks(agent: RpcAgent) -> list[str]:
    """Shutdown: the forks RRefs owned here still have (torch's leaks), one line each."""
    ctx: RRefContext = agent.rref_ctx
    with ctx.lock:
        return [str(leak) for leak in ctx.proto.leaks() if leak.role == "fork"]


def settle(agent: RpcAgent, deadline: float | None) -> bool:
    """Wait until nothing of the RRef protocol is in flight here (or the deadline)."""
    ctx: RRefContext = agent.rref_ctx
    # bounded: a remote() whose function never returns leaves its creator's user unconfirmed
    limit = time.monotonic() + _SETTLE_MAX
    deadline = limit if deadline is None else min(deadline, limit)
    while time.monotonic() < deadline:
        with ctx.lock:
            idle = ctx.proto.idle()
        if idle and not ctx.busy():
            return True
        time.sleep(0.002)
    with ctx.lock:
        log.info("%s: RRef protocol not settled at shutdown:\n%s", agent.label, ctx.proto.pending())
    return False


class RRef:
    """A reference to a value on one worker, its owner (``torch.distributed.rpc.RRef``).

    ``RRef(value)`` makes a local one (this worker owns ``value``); ``rpc.remote`` makes one
    owned by the callee. Passing an RRef in an RPC shares it; the value is deleted on its owner
    when no reference remains anywhere.
    """

    __slots__ = (
        "__weakref__", "_agent", "_confirmed", "_create_fut", "_dead", "_fork_id", "_is_owner", "_owner",
        "_profiling_fut", "_rref_id", "_type",
    )  # fmt: skip

    def __init__(self, value: Any, type_hint: Any = None) -> None:
        if isinstance(value, torch.jit.ScriptModule):
            type_hint = _script_module_type(value, type_hint)
        elif type_hint is not None:
            raise RuntimeError("type_hint should only be specified when the RRef being created contains a ScriptModule.")
        agent = _require_agent()
        ctx: RRefContext = agent.rref_ctx
        with ctx.lock:
            rref_id = ctx.proto.create_owner_local()
        fut = agent._owner_future(rref_id)
        if type(value) is torch.nn.Parameter:
            fut.as_tensor = True  # (fetched as a plain tensor; remote()'s values keep their type)
        fut.set_result(value)
        self._set_owner(agent, rref_id, type_hint if type_hint is not None else type(value))

    def _set_owner(self, agent: RpcAgent, rref_id: RRefId, type_hint: Any = None) -> None:
        self._agent = agent
        self._rref_id = rref_id
        self._fork_id: ForkId | None = None
        self._owner = agent.info
        self._is_owner = True
        self._confirmed = True
        self._create_fut: Any = None
        self._type = type_hint
        self._dead = False

    @classmethod
    def _user(cls, agent: RpcAgent, rref_id: RRefId, fork_id: ForkId, owner: WorkerInfo, confirmed: bool, type_hint: Any = None) -> RRef:
        obj = cls.__new__(cls)
        obj._agent = agent
        obj._rref_id = rref_id
        obj._fork_id = fork_id
        obj._owner = owner
        obj._is_owner = False
        obj._confirmed = confirmed
        obj._create_fut = None
        obj._type = type_hint
        obj._dead = False
        return obj

    def __class_getitem__(cls, item: Any) -> Any:
        # (a generic alias, as torch's ``RRef[T]``: ``typing.get_args(RRef[int]) == (int,)``,
        # and ``isinstance(x, RRef[int])`` is refused as for any parameterized generic)
        return types.GenericAlias(cls, item)

    # -- queries --------------------------------------------------------------------------------
    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._is_owner

    def owner(self) -> WorkerInfo:
        """The owner's ``WorkerInfo``."""
        return self._owner

    def owner_name(self) -> str:
        """The owner's name."""
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows about this reference (always True on the owner)."""
        return self._confirmed

    def _get_future(self) -> Any:
        """A future that completes when the owner has created the value (``remote()``)."""
        cf = self._create_fut
        if cf is None:
            fut: Any = Future()
            fut.set_result(None)
            return fut
        if isinstance(cf, torch.futures.Future):
            return cf
        # remote() waits on a lighter future (a torch one costs a lot to complete): the torch
        # future a user asks for follows it, and is the one returned from now on. As torch's, it
        # fails when the request did (a timeout, a lost owner), not when the function raised:
        # the value is then that error, which to_here() raises
        fut = Future()

        def follow(f: Any) -> None:
            exc = _future_error(f)
            if isinstance(exc, (RpcTimeoutError, PeerError)):
                fut.set_exception(fresh(exc))
            else:
                fut.set_result(None)

        cf.add_done_callback(follow)
        self._create_fut = fut
        return fut

    def _set_profiling_future(self, fut: Any) -> None:
        """Keep the future that completes once a profiled ``remote()``'s range is recorded
        (torch's; ``rpc.remote`` sets it under the legacy profiler)."""
        self._profiling_fut = fut

    def _get_profiling_future(self) -> Any:
        """The future ``_set_profiling_future`` kept: wait on it to know a profiled ``remote()``
        is recorded (its creation confirmed by the owner, which may come after ``to_here()``).

        Raises:
            RuntimeError: none was set (torch's error).
        """
        fut = getattr(self, "_profiling_fut", None)
        if fut is None:
            raise RuntimeError("Profiling future has not been set!")
        return fut

    def local_value(self) -> Any:
        """The value, on the owner.

        Raises:
            RuntimeError: called on a user (not the owner), or the value failed.
        """
        if not self._is_owner:  # (torch's words)
            raise RuntimeError(
                f"For UserRRef(rref_id={self._rref_id}, fork_id={self._fork_id}), can't call localValue() on "
                f"user {self._agent.get_worker_info()}. Call it on owner {self._owner}"
            )
        return self._owned_value(None)

    def _owned_value(self, timeout: float | None) -> Any:
        fut = self._agent._owners.get(self._rref_id)
        if fut is None:
            raise RuntimeError(f"{self._agent.label}: the value of RRef {self._rref_id} was deleted")
        if not fut.done():
            self._wait_owned(fut, timeout)
        value = fut.value()
        if isinstance(value, _OwnerError):
            raise _errors.rebuild(value.record, call=f"creating RRef {self._rref_id}")
        return value

    def _wait_owned(self, fut: Any, timeout: float | None) -> None:
        """Wait on the owner for the value's creation. With a timeout given (``to_here(t)``),
        that long; otherwise as long as the creation takes, as torch's ``local_value()``
        waits (a constructor may run for minutes), but not for a value that will never come:
        one whose creator is lost before its remote() arrived fails (the protocol's
        ``RRefLost``), and an agent that shuts down ends the wait with an error."""
        agent = self._agent
        seconds = None if timeout is None or timeout == UNSET_RPC_TIMEOUT else agent.timeout_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        ev = threading.Event()
        fut.add_done_callback(lambda _f: ev.set())
        while True:
            step = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if ev.wait(max(step, 0.0)):
                return
            if deadline is not None and time.monotonic() >= deadline:
                assert seconds is not None
                raise RpcTimeoutError(
                    f"RPC ran for more than set timeout ({seconds:g} s) and will now be marked with an "
                    f"error: the value of RRef {self._rref_id} on {agent.label} is not ready"
                )
            if agent._closed:
                raise RuntimeError(f"{agent.label}: RPC agent shut down while waiting for the value of RRef {self._rref_id}")

    def _pending_owned(self) -> Any:
        """On the owner, the future of a value not made yet; None once it is (or off the owner)."""
        if not self._is_owner:
            return None
        fut = self._agent._owners.get(self._rref_id)
        return None if fut is None or fut.done() else fut

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A copy of the value, fetched from the owner (the value itself on the owner).

        Raises:
            Exception: the error the value's creation raised; a timeout; ``PeerError`` when the
                owner is lost.
        """
        if self._is_owner:
            return self._owned_value(timeout)
        if torch._C._autograd._profiler_enabled():  # recorded as torch records it
            with torch.autograd.profiler.record_function(f"to_here#({self._agent.name})->({self._owner.name})"):
                with _remote_profiling.unrecorded():
                    return self._fetch(timeout)
        return self._fetch(timeout)

    def _deleted(self) -> bool:
        """Whether this user RRef was deleted: by a graceful shutdown (which releases the users
        still held, as torch's), or when its agent went otherwise."""
        agent = self._agent
        if self._is_owner or not agent._closed:
            return False
        with agent.rref_ctx.lock:
            u = agent.rref_ctx.proto.user(self._fork_id)
        return u is None or u.released

    def _fetch(self, timeout: float) -> Any:
        if self._deleted():  # (torch's words)
            raise RuntimeError(
                f"UserRRef(rref_id={self._rref_id}, fork_id={self._fork_id}) has been deleted. Cannot call "
                "to_here() on it after deletion."
            )
        hooks = _hooks.autograd
        if hooks is not None and hooks.active:  # in a distributed autograd context: recorded
            done, value = hooks.to_here_with_autograd(self, timeout)
            if done:
                return value
        cf = self._create_fut
        if cf is not None and cf.done():
            exc = _future_error(cf)
            if isinstance(exc, RpcTimeoutError):
                # torch's sentence first, then which call it was and to whom
                raise RpcTimeoutError(f"{CREATION_TIMED_OUT} {exc}") from None
            if isinstance(exc, PeerError):
                # a copy: the stored error raised here would keep this frame, and so this
                # RRef, alive through its traceback (a cycle that holds the owner's value)
                raise fresh(exc) from None
        reason = self._agent.rref_ctx.lost.get(self._rref_id)
        if reason is not None:
            raise PeerError(
                f"{self._agent.label}: to_here() of RRef {self._rref_id} owned by {self._owner.name}: {reason}",
                peer=self._owner.id,
            )
        what = LazyText("to_here() of RRef %s owned by %s", self._rref_id, self._owner.name)
        # the id as a plain tuple: the owner finds it all the same, and unpickles it faster
        rid = self._rref_id
        return self._agent.call_sync(self._owner.id, MsgKind.FETCH, (rid[0], rid[1]), timeout, what)

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
        """The type of the value (asked of the owner once, then kept); with ``blocking=False``
        a future of it, which a user gets at once (the owner answers it later)."""
        if self._type is None and not self._is_owner:
            from ._api import rpc_async, rpc_sync

            if blocking:
                self._type = rpc_sync(self._owner, _value_type, args=(self,), timeout=timeout)
            else:
                def keep(done: Any) -> Any:
                    self._type = done.wait()
                    return self._type

                return rpc_async(self._owner, _value_type, args=(self,), timeout=timeout).then(keep)
        if self._type is None:
            self._type = _type_of(self._owned_value(timeout))
        if not blocking:
            fut: Any = Future()
            fut.set_result(self._type)
            return fut
        return self._type

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Autograd from this RRef's value (a scalar tensor) as the root: with a distributed
        autograd context id, the distributed pass of that context from the owner (gradients
        via ``get_gradients``); with -1, a local pass, on the owner only.

        Raises:
            RuntimeError: -1 off the owner, a value that is not a scalar tensor requiring grad,
                or the backward pass's errors.
        """
        if not self._is_owner:
            if dist_autograd_ctx_id == -1:  # (torch's words, then why)
                raise RuntimeError(
                    "User RRefs require 'dist_autograd_ctx_id' to be specified: without a distributed "
                    f"autograd context, backward() runs local autograd, on the owner ({self._owner.name})"
                )
            from ._api import call_outside_context

            # (the context goes to the owner only with the program's own calls: one the owner
            # never saw is an error there, as torch's "Could not find autograd context")
            call_outside_context(self._owner, _rref_backward, (self, dist_autograd_ctx_id, retain_graph))
            return
        _rref_backward(self, dist_autograd_ctx_id, retain_graph)

    # -- proxies --------------------------------------------------------------------------------
    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the value, on the owner."""
        from ._api import rpc_sync

        return RRefProxy(self, rpc_sync, timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.rpc_async().method(*args)`` returns a future of ``method``'s result."""
        from ._api import rpc_async

        return RRefProxy(self, rpc_async, timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.remote().method(*args)`` returns an RRef to ``method``'s result (on the owner)."""
        from ._api import remote

        return RRefProxy(self, remote, timeout)

    # -- pickling and lifetime ------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        if self._deleted():  # (torch's words)
            raise RuntimeError("Cannot call fork an UserRRef after deletion.")
        dst = serialization_peer()
        if dst is None:
            raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")
        agent = self._agent
        ctx: RRefContext = agent.rref_ctx
        with ctx.lock:
            decision = ctx.proto.fork_for(self._rref_id, self._fork_id, self._owner.id, dst)
            ctx.perform(decision.actions)
        type_name = None
        return (
            _rebuild_rref,
            (tuple(self._rref_id), tuple(decision.fork_id), self._owner.id, self._owner.name, agent.rank, type_name),
        )

    def __getstate__(self) -> Any:
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")

    def __del__(self) -> None:
        try:
            if getattr(self, "_dead", True):
                return
            self._dead = True
            ctx = self._agent.rref_ctx
            if self._is_owner:
                ctx.released("owner", self._rref_id)
            else:
                ctx.released("user", self._fork_id)
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._is_owner:
            return f"OwnerRRef({self._rref_id})"
        return f"UserRRef(RRefId = {self._rref_id}, ForkId = {self._fork_id})"


def _rref_backward(rref: RRef, context_id: int, retain_graph: bool) -> None:
    """On the owner: ``RRef.backward``."""
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):  # (torch's words; autograd's own say the rest)
        raise RuntimeError(f"RRef should contain a tensor for .backward() (it holds a {type(value).__qualname__})")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
    else:  # (a worker that never loaded autograd has no context: autograd says so)
        _hooks.load_autograd().backward(context_id, [value], retain_graph)


def _value_type(rref: RRef) -> Any:
    return _type_of(rref.local_value())


def _type_of(value: Any) -> Any:
    """What ``_get_type`` reports: the value's type; for a ScriptModule, held by its interface,
    ``torch._C.ScriptModule`` (as torch's)."""
    return torch._C.ScriptModule if isinstance(value, torch.jit.ScriptModule) else type(value)


def _future_error(fut: Any) -> BaseException | None:
    """The error ``fut`` (done) holds, or None. The future keeps the error: its traceback is
    cleared, or it would keep the caller's frames (an RRef and its owner's value) alive."""
    try:
        fut.wait()
    except BaseException as exc:
        exc.__traceback__ = None
        return exc
    return None


def _require_agent() -> RpcAgent:
    agent = current_agent(required=False)
    if agent is None:  # (torch's words)
        raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling `rpc.init_rpc`)?")
    return agent


def _script_module_type(module: torch.jit.ScriptModule, interface: Any) -> Any:
    """The type an RRef to a ScriptModule reports (``torch._C.ScriptModule``, as torch's), once
    ``interface`` (a ``@torch.jit.interface`` class) is checked to be one the module implements.

    Raises:
        RuntimeError: no interface, or one the module does not implement (torch's checks).
    """
    if interface is None:
        raise RuntimeError(
            "The RRef being created contains a ScriptModule, must provide its ModuleInterface type hint. "
        )
    try:
        name = torch._jit_internal._qualified_name(interface)
    except Exception:  # not a class: the check below names it
        name = repr(interface)
    compiled = torch.jit._state._python_cu.get_interface(name) if isinstance(interface, type) else None
    module_type = module._c._type()
    if compiled is None or not module_type.isSubtypeOf(compiled):
        raise RuntimeError(
            f"{module_type.qualified_name()} is not a subtype of the type hint: {name}, did you pass a "
            "valid interface type?"
            + ("" if compiled is not None else " (it is not a @torch.jit.interface class)")
        )
    return torch._C.ScriptModule


def _rebuild_rref(rref_id: tuple[int, int], fork_id: tuple[int, int], owner_id: int, owner_name: str, parent: int, type_hint: Any) -> RRef:
    agent = _require_agent()
    ctx: RRefContext = agent.rref_ctx
    rid, fid = GloballyUniqueId(*rref_id), GloballyUniqueId(*fork_id)
    with ctx.lock:
        if owner_id == agent.rank:
            obj = RRef.__new__(RRef)
            obj._set_owner(agent, rid, type_hint)
            agent._owner_future(rid)
        else:
            info = agent._workers.get(owner_id) or WorkerInfo(owner_name, owner_id)
            obj = RRef._user(agent, rid, fid, info, confirmed=False, type_hint=type_hint)
            ctx.users[fid] = weakref.ref(obj)
        ctx.perform(ctx.proto.received(rid, fid, owner_id, parent))
        if not obj._is_owner:
            u = ctx.proto.user(fid)
            obj._confirmed = bool(u is not None and u.confirmed)
            if u is not None and not u.confirmed and not u.lost:
                note_unconfirmed(fid)
    return obj


def create_remote(agent: RpcAgent, dst: WorkerInfo, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> RRef:
    """``rpc.remote``: an RRef at once; the value is made on ``dst``."""
    ctx: RRefContext = agent.rref_ctx
    what = CallText("remote", dst.name, func)
    if dst.id == agent.rank:
        with ctx.lock:
            rref_id = ctx.proto.create_owner_local()
        obj = RRef.__new__(RRef)
        obj._set_owner(agent, rref_id)
        value_fut = agent._owner_future(rref_id)
        created: Any = Future()
        obj._create_fut = created
        agent._to_pool(lambda: _run_local(agent, func, args, kwargs, value_fut, created))
        return obj
    with ctx.lock:
        rref_id, fork_id = ctx.proto.create_user_for_remote(dst.id)
        obj = RRef._user(agent, rref_id, fork_id, dst, confirmed=False)
        ctx.users[fork_id] = weakref.ref(obj)

    def on_reply(value: Any, exc: BaseException | None) -> None:
        # (a request that timed out after it went out is confirmed by its late reply: the
        # owner registered our fork and deletes the value when we let go)
        if isinstance(exc, PeerError):
            return  # the protocol hears of the lost peer itself
        if isinstance(exc, RpcTimeoutError):
            ctx.run(ctx.proto.fork_not_sent, rref_id, fork_id)  # it never went out
            return
        ctx.run(ctx.proto.confirm, fork_id)

    try:
        # one pickle: the ids are plain tuples first, so that an owner which cannot rebuild the
        # call still reads them (``RpcAgent._remote_undecodable``)
        body = ((rref_id[0], rref_id[1]), (fork_id[0], fork_id[1]), func, args, kwargs)
        obj._create_fut = agent.request(dst.id, MsgKind.REMOTE, body, timeout, what, on_reply=on_reply, sync=True)
    except BaseException:
        ctx.run(ctx.proto.fork_not_sent, rref_id, fork_id)
        obj._dead = True
        raise
    return obj


def _run_local(agent: RpcAgent, func: Any, args: Any, kwargs: Any, value_fut: Any, created: Any) -> None:
    def fail(exc: BaseException, record: Any = None) -> None:
        # the value is the error (to_here() and local_value() raise it); the creation itself
        # completed, as torch's creation future does
        if record is None:
            record = _errors.capture(exc, agent.label)
        if not value_fut.done():
            value_fut.set_result(_OwnerError(record))
        created.set_result(None)

    try:
        is_async, result = run_user_function(func, args, kwargs)
    except BaseException as exc:
        fail(exc, failed(exc, agent))  # (printed, as another worker's call that fails is)
        return
    if is_async and not isinstance(result, torch._C.Future):
        fail(_not_a_future(func, result))
        return
    if is_async:

        def done(f: Any) -> None:
            try:
                v = f.wait()
            except BaseException as exc:
                fail(exc)
                return
            value_fut.set_result(v)
            created.set_result(None)

        result.add_done_callback(done)
        return
    value_fut.set_result(result)
    created.set_result(None)
