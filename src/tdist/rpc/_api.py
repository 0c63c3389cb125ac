"""``tdist.rpc``'s functions: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown``.

Semantics follow ``torch.distributed.rpc``: timeouts in seconds where -1 (``UNSET_RPC_TIMEOUT``)
is the agent's default and 0 means none; ``rpc_async`` returns a ``torch.futures.Future``;
``remote`` returns an ``RRef`` at once. Errors raised by the callee are raised on the caller
with their type, message, the callee's name and its traceback (``_errors``).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import threading
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from .. import store as _store
from .._core.errors import DistTimeoutError
from ..store._rendezvous import rendezvous
from ..store._tcp import serving_in_a_thread
from . import _hooks, _remote_profiling, backend_registry, functions
from ._agent import RpcAgent, current_agent, set_current_agent
from ._calls import CallText
from ._future import Future
from ._message import MsgKind
from ._options import ProcessGroupRpcBackendOptions, RpcBackendOptions, TensorPipeRpcBackendOptions
from ._rref import RRef, owner_leaks
from ._worker_info import WorkerInfo
from .constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from .internal import RPCExecMode, _build_rpc_profiling_key

__all__ = [
    "RRef",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

log = logging.getLogger(__name__)

# torch's switch: when False, shutdown raises when values owned here are still referenced by
# other workers (leaks); when True (the default) it logs them
_ignore_rref_leak = True
_STORE_RELEASE = 30.0  # seconds the store's host waits for the others to be done with it
_init_lock = threading.Lock()
_stores: list[Any] = []  # keep the rendezvous store (and a store server we host) alive


def is_available() -> bool:
    """RPC is always available in tdist."""
    return True


def _dynamic_store(init_method: str, rank: int) -> Any:
    """A store for a group without a fixed size: rank 0 hosts it, others connect."""
    from urllib.parse import urlparse

    url = urlparse(init_method)
    if url.scheme == "env":
        host = os.environ["MASTER_ADDR"]
        port = int(os.environ["MASTER_PORT"])
    elif url.scheme == "tcp":
        host, port = url.hostname or "127.0.0.1", int(url.port or 0)
    elif url.scheme == "file":
        return _store.FileStore(url.path, -1)
    else:
        raise ValueError(f"init_method {init_method!r} cannot form a dynamic RPC group (use env://, tcp:// or file://)")
    return _store.TCPStore(host, port, None, rank == 0, timedelta(seconds=300), wait_for_workers=False)


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Start this process's RPC agent and join the group (``torch.distributed.rpc.init_rpc``).

    Args:
        name: a unique name of letters, digits, ``-``, ``_`` and ``:``, shorter than 128 characters.
        backend: a ``BackendType`` (default ``TENSORPIPE``, or the one the options imply).
        rank: this worker's unique id (-1: ``RANK`` from the environment).
        world_size: the number of workers of a static group; ``None`` for a group that
            workers join and leave while it runs.
        rpc_backend_options: the backend's options (default: the backend's defaults).

    Raises:
        TypeError: ``backend`` or ``rpc_backend_options`` of the wrong type. RuntimeError: a
        name, rank or world size of the wrong type (torch's check); a name already used; RPC
        already initialized; the group did not form. ValueError: invalid device maps.
        RuntimeError: already initialized, duplicate names, or the group did not form.
    """
    if backend is not None and not isinstance(backend, backend_registry.BackendTypeBase):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if world_size:  # a static group: torch's rendezvous checks these first, in its words
        if not isinstance(rank, numbers.Integral):
            raise RuntimeError(f"`rank` must be an integer. {rank}")
        if not isinstance(world_size, numbers.Integral):
            raise RuntimeError(f"`world_size` must be an integer. {world_size}")
    for value, kinds in ((name, str), (rank, numbers.Integral), (world_size, (numbers.Integral, type(None)))):
        if not isinstance(value, kinds) or isinstance(value, bool):  # torch's check and message
            raise RuntimeError(f"Argument {value} must be of type {kinds} but got type {type(value)}")
    if backend is None:
        if isinstance(rpc_backend_options, ProcessGroupRpcBackendOptions):
            backend = backend_registry.BackendType.PROCESS_GROUP
        else:
            backend = backend_registry.BackendType.TENSORPIPE
    if rpc_backend_options is None:
        rpc_backend_options = backend_registry.construct_rpc_backend_options(backend)
    if rank is None or rank < 0:
        rank = int(os.environ.get("RANK", "-1"))
        if rank < 0:
            raise ValueError("init_rpc needs a rank: pass rank= or set RANK")
    if world_size is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    with _init_lock:
        if current_agent(required=False) is not None:
            raise RuntimeError("RPC is already initialized")
        # RPC needs its store only to form the group and to leave it: a store server hosted
        # here runs in a thread, not in a process of its own (whose start costs tens of ms of
        # init_rpc); graceful shutdown keeps the host until every worker is past its last use
        with serving_in_a_thread():
            if world_size is None:
                store = _dynamic_store(rpc_backend_options.init_method, rank)
            else:
                store, rank, world_size = next(rendezvous(rpc_backend_options.init_method, rank=rank, world_size=world_size))
        try:
            agent = backend_registry.init_backend(
                backend, store=store, name=name, rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options
            )
        except BaseException:
            close = getattr(store, "close", None)  # (a server hosted here stops, freeing its port)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            raise
        _stores.append(store)
        set_current_agent(agent)
        if isinstance(agent, RpcAgent):  # (not a backend registered by a user)
            agent.park_openmp()
        with contextlib.suppress(AttributeError, RuntimeError):  # profiler events carry the worker id, as torch's
            torch._C._distributed_rpc._set_profiler_node_id(agent.rank)


def _get_current_rpc_agent() -> RpcAgent:
    """The running agent (torch's ``rpc.api._get_current_rpc_agent``: ``get_worker_infos()``,
    ``get_worker_info()``, ``get_debug_info()``).

    Raises:
        RuntimeError: RPC is not initialized.
    """
    agent = current_agent(required=False)
    if agent is None:
        raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling `rpc.init_rpc`)?")
    return agent


def _is_current_rpc_agent_set() -> bool:
    return current_agent(required=False) is not None


def _set_rpc_timeout(rpcTimeoutSeconds: float) -> None:  # (torch's keyword)
    """Change the default timeout of this worker's RPCs (torch's ``rpc._set_rpc_timeout``)."""
    _agent().rpc_timeout = float(rpcTimeoutSeconds)


def _get_debug_info() -> dict[str, Any]:
    """The RRef context's, the agent's and distributed autograd's state (torch's
    ``rpc._get_debug_info``: ``_rref_context_get_debug_info()``, the agent's
    ``get_debug_info()`` and ``dist_autograd._get_debug_info()`` in one dict).

    Raises:
        RuntimeError: RPC is not initialized.
    """
    agent = _agent()
    info: dict[str, Any] = agent.rref_debug_info()
    info.update(agent.get_debug_info())
    info.update(_hooks.load_autograd()._get_debug_info())
    return info


def _rref_context_get_debug_info() -> dict[str, str]:
    """The RRef context's figures on this worker (torch's; see ``RpcAgent.rref_debug_info``).

    Raises:
        RuntimeError: RPC is not initialized (torch's message).
    """
    return _get_current_rpc_agent().rref_debug_info()


def enable_gil_profiling(flag: bool) -> None:
    """Measure (``True``) or stop measuring how long this worker's threads wait for the GIL:
    ``_get_debug_info()["agent.gil_average_wait_time_us"]`` (torch's; a thread wakes every
    10 ms while on).

    Raises:
        RuntimeError: RPC is not initialized (torch's message).
    """
    _get_current_rpc_agent().enable_gil_profiling(bool(flag))


def _to_worker_info(to: Any) -> WorkerInfo:
    """The ``WorkerInfo`` of a name, an id or a ``WorkerInfo`` (torch's helper)."""
    return _agent().resolve(to)


def _agent() -> RpcAgent:
    agent = current_agent()
    assert agent is not None
    return agent


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of ``worker_name``, or of this worker when None.

    Raises:
        RuntimeError: RPC is not initialized, or no worker has that name.
    """
    return _agent().get_worker_info(worker_name)


def get_rpc_timeout() -> float:
    """The default timeout of this worker's RPCs, in seconds."""
    return _get_current_rpc_agent().rpc_timeout


def _profiling() -> bool:
    """Whether calls are profiled: torch's rule, only under the legacy autograd profiler
    (``torch.autograd.profiler_legacy.profile``)."""
    return bool(torch._C._autograd._profiler_enabled()) and torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.LEGACY


def _record(exec_type: str, to: Any, func: Any) -> tuple[Any, str]:
    """The profiler range of one call, and its name, as torch names it:
    ``rpc_<sync|async|remote>#<function>(<this worker> -> <callee>)``."""
    agent = _agent()
    builtin = torch.jit._builtins._find_builtin(func)  # type: ignore[no-untyped-call]
    if builtin is not None:
        name = builtin
    elif isinstance(func, torch.jit.ScriptFunction):
        name = torch._jit_internal._qualified_name(func)
    else:
        name = getattr(func, "__qualname__", repr(func))
    key = _build_rpc_profiling_key(RPCExecMode(exec_type), name, agent.name, agent.resolve(to).name)
    return torch.autograd.profiler.record_function(key), key


def _profiled_call(func: Any, key: str) -> Any:
    """``func`` wrapped so that the callee's profiler events come back (``_remote_profiling``),
    or None where they cannot (inside a distributed autograd context, ``async_execution``)."""
    hooks = _hooks.autograd
    if (hooks is not None and hooks.active) or not callable(func) or getattr(func, "_wrapped_async_rpc_function", None) is not None:
        return None
    return _remote_profiling.ProfiledCall(func, key)


def _call_body(func: Any, args: Any, kwargs: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    if type(func) is types.FunctionType and "_wrapped_async_rpc_function" in func.__dict__:
        func = functions._sendable(func)  # (async_execution over a TorchScript function)
    return func, tuple(args) if args is not None else (), dict(kwargs) if kwargs is not None else {}


def _call(api: str, to: Any, func: Any, args: Any, kwargs: Any, shown: Any = None) -> tuple[RpcAgent, WorkerInfo, Any, CallText]:
    """The agent, the callee, the request body and a description of the call (naming
    ``shown`` when given: the function a wrapper stands for)."""
    agent = _agent()
    dst = agent.resolve(to)
    return agent, dst, _call_body(func, args, kwargs), CallText(api, dst.name, func if shown is None else shown)


def rpc_async(to: Any, func: Any, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to``; returns a ``torch.futures.Future``.

    Raises:
        RuntimeError: RPC not initialized or unknown worker; the future fails with the callee's
            exception, a timeout or a lost callee.
    """
    if _profiling():
        rf, key = _record("async", to, func)
        with rf:
            profiled = _profiled_call(func, key)
            with _remote_profiling.unrecorded():
                if profiled is None:
                    fut = _rpc_async(to, func, args, kwargs, timeout)
                else:  # (the callee's events come back with the value)
                    sent = time.perf_counter()
                    fut = _mapped(_rpc_async(to, profiled, args, kwargs, timeout, func), _remote_profiling.unwrap(key, sent))
            fut = rf._call_end_callbacks_on_future(fut)
    else:
        fut = _rpc_async(to, func, args, kwargs, timeout)
    pending = getattr(_thread_local_var, "future_list", None)
    if pending is not None:  # inside ``_wait_all()``: its exit waits for this call
        pending.append(fut)
    return fut


# torch's name: ``future_list`` is set on it inside ``_wait_all()`` (per thread)
_thread_local_var = threading.local()


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Collect the futures of every ``rpc_async`` this thread makes in the block and wait for
    them all on leaving it (``torch.distributed.rpc.api._wait_all``).

    Raises:
        Exception: the first of those calls' errors (a timeout, the callee's exception), once
            every future is done; an error raised in the block itself is raised after that wait
            unless a call failed too.
    """
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def _rpc_async(to: Any, func: Any, args: Any, kwargs: Any, timeout: float, shown: Any = None) -> Any:
    agent, dst, body, what = _call("rpc_async", to, func, args, kwargs, shown)
    hooks = _hooks.autograd
    if hooks is not None and hooks.active:  # inside a distributed autograd context (_hooks)
        rec = hooks.record_call(dst.id, *body)
        if rec is not None:
            call, call_args, unwrap = rec
            fut = agent.request(dst.id, MsgKind.CALL, (call, call_args, {}), timeout, what)
            return _mapped(fut, unwrap)
    return agent.request(dst.id, MsgKind.CALL, body, timeout, what)


def _mapped(fut: Any, fn: Any) -> Any:
    """A future of ``fn(fut's value)`` that fails with ``fut``'s own error (``then`` would wrap it
    in a RuntimeError)."""
    out: Any = Future()

    def done(f: Any) -> None:
        try:
            out.set_result(fn(f.wait()))
        except BaseException as exc:
            out.set_exception(exc)

    fut.add_done_callback(done)
    return out


def rpc_sync(to: Any, func: Any, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Raises:
        Exception: the callee's exception (same type where it can be rebuilt), a timeout
            (``RuntimeError``/``TimeoutError``) or a ``PeerError`` when the callee is lost.
    """
    if _profiling():
        rf, key = _record("sync", to, func)
        with rf:
            profiled = _profiled_call(func, key)
            with _remote_profiling.unrecorded():
                if profiled is None:
                    return _rpc_sync(to, func, args, kwargs, timeout)
                sent = time.perf_counter()  # (the callee's events come back with the value)
                return _remote_profiling.keep(key, sent, _rpc_sync(to, profiled, args, kwargs, timeout, func))
    return _rpc_sync(to, func, args, kwargs, timeout)


def _rpc_sync(to: Any, func: Any, args: Any, kwargs: Any, timeout: float, shown: Any = None) -> Any:
    agent, dst, body, what = _call("rpc_sync", to, func, args, kwargs, shown)
    hooks = _hooks.autograd
    if hooks is not None and hooks.active:  # inside a distributed autograd context (_hooks)
        rec = hooks.record_call(dst.id, *body)
        if rec is not None:
            call, call_args, unwrap = rec
            return unwrap(agent.call_sync(dst.id, MsgKind.CALL, (call, call_args, {}), timeout, what))
    return agent.call_sync(dst.id, MsgKind.CALL, body, timeout, what)


def call_outside_context(to: Any, func: Any, args: tuple[Any, ...]) -> Any:
    """``rpc_sync(to, func, args)`` that carries no distributed autograd context (RPC's own
    requests, such as ``RRef.backward``'s to the owner, which torch sends as messages of its
    own: the owner knows a context only if the program's calls brought it there)."""
    agent, dst, body, what = _call("rpc_sync", to, func, args, None)
    return agent.call_sync(dst.id, MsgKind.CALL, body, UNSET_RPC_TIMEOUT, what)


def remote(to: Any, func: Any, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return an ``RRef`` to its result at
    once (the value stays on ``to``)."""
    if _profiling():
        rf, key = _record("remote", to, func)
        with rf:
            agent = _agent()
            profiled = _profiled_call(func, key) if agent.resolve(to).id != agent.rank else None
            sent = time.perf_counter()
            with _remote_profiling.unrecorded():
                rref = _remote(to, func if profiled is None else profiled, args, kwargs, timeout)
            if profiled is not None:  # the owner's events come back with the creation's reply
                _remote_profiling.keep_on(rref._create_fut, key, sent)
            # (a future that completes once the range is recorded, as torch keeps it)
            rref._set_profiling_future(rf._call_end_callbacks_on_future(rref._get_future()))
            return rref
    return _remote(to, func, args, kwargs, timeout)


def _remote(to: Any, func: Any, args: Any, kwargs: Any, timeout: float) -> Any:
    from ._rref import create_remote

    agent = _agent()
    dst = agent.resolve(to)
    func, a, kw = _call_body(func, args, kwargs)
    hooks = _hooks.autograd
    if hooks is not None and hooks.active:  # inside a distributed autograd context (_hooks)
        rec = hooks.record_remote(dst.id, func, a, kw)
        if rec is not None:
            func, a, kw = rec[0], rec[1], {}
    return create_remote(agent, dst, func, a, kw, timeout)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker's agent.

    With ``graceful=True`` (static group) it waits until every worker has called shutdown and
    all outstanding work and RRef messages are done; in a dynamic group it finishes its own
    work, tells the others it leaves and goes. ``graceful=False`` leaves at once.

    Args:
        graceful: see above.
        timeout: seconds for the graceful phases; 0 (the default) waits for the other workers
            as long as they live (a worker that dies or stalls fails it within seconds).

    Raises:
        RuntimeError: RPC is not initialized; ``PeerError`` when another worker was lost;
            leaked RRefs when ``_ignore_rref_leak`` is False. Workers still running but late
            past ``timeout`` are logged, not raised, as torch's: this worker shuts down without
            them.
    """
    agent = _agent()
    leaks: list[str] = []
    try:
        if graceful:
            # torch's meaning: 0 (the default) waits for the other workers without limit (here,
            # as long as they live: a lost worker fails it within seconds)
            try:
                held = _graceful(agent, timeout if timeout and timeout > 0 else None)
            except DistTimeoutError as exc:
                # torch's timeout bounds the wait and raises nothing for a worker that is late
                # (only one that is lost fails it): this worker shuts down without it
                log.warning("%s: %s; shutting down without them", agent.label, exc)
                held = []
            if held:  # (released by now, as torch does: not a leak)
                log.info("%s: RRefs still referenced at shutdown (released): %s", agent.label, "; ".join(held))
        leaks = owner_leaks(agent)
    finally:
        agent.stop(graceful)
        with _init_lock:
            if current_agent(required=False) is agent:
                set_current_agent(None)
    if leaks:  # torch's check: references other workers still hold to values owned here
        text = "\n".join(leaks)
        if not _ignore_rref_leak:
            raise RuntimeError(text)
        log.warning(
            "%s: Detected RRef Leaks during shutdown: other workers still hold references to values "
            "owned here (a non-graceful shutdown, or references kept past shutdown):\n%s",
            agent.label,
            text,
        )


def _forget_store(agent: RpcAgent) -> None:
    """After a static group's graceful shutdown nobody needs its store: the next ``init_rpc``
    (on the same address) must not find this group's keys, nor this store server."""
    store = agent.store
    try:
        if agent.rank == 0:
            store.delete_key("rpc/token")
    except Exception as exc:
        log.debug("%s: could not clear the store: %s", agent.label, exc)
    s = _rendezvous_store(agent)
    if s is not None:
        _stores.remove(s)
        close = getattr(s, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def _rendezvous_store(agent: RpcAgent) -> Any:
    """The store ``init_rpc`` made for ``agent`` (the agent may hold it or a store it wraps)."""
    for s in _stores:
        if s is agent.store or getattr(s, "underlying_store", None) is agent.store:
            return s
    return None


def _stop_accepting(agent: RpcAgent) -> None:
    s = _rendezvous_store(agent)
    for store in (s, getattr(s, "underlying_store", None)):
        stop = getattr(store, "_stop_accepting", None)
        if stop is not None:
            stop()


def _graceful(agent: RpcAgent, seconds: float | None) -> list[str]:
    from ._rref import release_all, settle

    deadline = None if seconds is None else time.monotonic() + seconds

    def left() -> float | None:
        return None if deadline is None else max(0.1, deadline - time.monotonic())

    agent.wait_outstanding(deadline)
    barrier = getattr(agent, "barrier", None)
    if agent.world_size is not None and barrier is not None:
        barrier("shutdown-1", left())
    leaks = release_all(agent)
    settle(agent, deadline)
    agent.wait_outstanding(deadline)
    if agent.world_size is not None and barrier is not None:
        if agent.rank == 0:
            # the store's host: nobody connects anew from here on but a worker's next init_rpc
            # on this address, which must wait for the next store (not talk to this one)
            _stop_accepting(agent)
        barrier("shutdown-2", left())
        agent.release_store_host(left() or _STORE_RELEASE)
        _forget_store(agent)
    else:
        leave = getattr(agent, "leave_dynamic", None)
        if leave is not None:
            leave()
    return leaks


_keep = (torch, TensorPipeRpcBackendOptions)
