"""The RPC agent: calls, replies, deadlines, worker pool, RRef owners; transport-agnostic.

Theory of operation. A subclass moves messages (``_transmit``) and feeds every received one to
``_on_message`` from whichever thread read it. Outgoing requests get an id and an entry in the
pending table (its future, the callee, a description, a deadline); a reply completes the
entry's ``torch.futures.Future`` in the reading thread; a timer thread fails entries whose
deadline passed; a lost peer fails every entry that waits on it at once. Incoming requests run
on ``num_worker_threads`` pool threads; a function marked ``async_execution`` returns a future
and its reply leaves when that future completes. A blocking ``rpc_sync`` asks the subclass to
read the callee's connection in the calling thread (``_wait_reply``), so its reply needs no
thread hand-off. Whether that thread polls before it sleeps is learnt per callee and function
(``spin_budget``; ``_core.spin``'s rule): a call whose replies come within the spin budget is
polled for, one whose callee computes for longer (a parameter server's forward or backward)
is slept on, so that the wait leaves the cores to that work.

RRefs: values owned here live in ``_owners`` (a future per RRef id, created on first sight so a
fetch or fork request that overtakes the ``REMOTE`` finds it); the reference counting is
``_rref_protocol``'s, whose actions this class carries out.

Beside it: ``_worker_info`` (``WorkerInfo``, the name rule), ``_calls`` (a pending-table entry,
the light future a blocking call waits on, call descriptions, ``RpcTimeoutError``) and
``_execution`` (running a request's user function, RRef proxy calls).

Thread-safety: every public method may be called from any thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
import time
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from .._core import patience, spin
from .._core.errors import (
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    PeerError,
    fresh,
)
from ..c10d._threads import ParkedTeam
from ..transport import _serialization as ser
from . import _errors, _remote_profiling
from ._calls import (
    _EXPIRED,
    RpcTimeoutError,
    _Call,
    _SyncReply,
    _wait_future,
    count_failed,
    count_sent,
)
from ._execution import (
    _not_a_future,
    _OwnerError,
    _set_owner_error,
    _unwrap,
    dispatch,
    failed,
    with_pickler_hint,
)
from ._future import Future
from ._message import REQUESTS, MsgKind, decode_meta
from ._rref_protocol import GloballyUniqueId
from ._worker_info import WorkerInfo
from ._worker_info import validate_name as validate_name  # (_pg_agent imports it from here)
from .constants import UNSET_RPC_TIMEOUT
from .server_process_global_profiler import profiled_job

__all__ = ["RpcAgent", "current_agent", "set_current_agent", "wait_replies"]

log = logging.getLogger(__name__)

_BARRIER_STEP = 0.5  # seconds a shutdown barrier waits on the store between looks at the missing

_REPLIES = frozenset((MsgKind.REPLY_OK, MsgKind.REPLY_ERR, MsgKind.REPLY_OK_ACK))


class _GilProbe:
    """``rpc.enable_gil_profiling(True)``: a thread that every 10 ms lets the GIL go and times
    how long it waits to get it back; the average is torch's ``agent.gil_average_wait_time_us``."""

    def __init__(self, label: str) -> None:
        self.total = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tdist-rpc-gil-{label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        clock = time.perf_counter
        while not self._stop.wait(0.01):
            t0 = clock()
            time.sleep(0)  # (lets the GIL go: the time is the wait to get it back)
            self.total += clock() - t0
            self.count += 1

    def average_us(self) -> float:
        return self.total / self.count * 1e6 if self.count else 0.0

    def stop(self) -> None:
        self._stop.set()


_current: RpcAgent | None = None


class _ThreadState(threading.local):
    # the class holds the default (a missing attribute of a plain threading.local costs an
    # exception on every look, and this one is looked at for every message)
    peer: int | None = None
    # (agent, caller, request id, reply): a remote() whose value is set and whose reply has not
    # gone; a fetch reply to that caller from this thread takes it along (``_run_remote``)
    ack: tuple[Any, int, int, Any] | None = None
    # while a request is unpickled: the user RRefs made from it that their owner has not
    # confirmed yet (``note_unconfirmed``); the request runs once they are
    unconfirmed: list[Any] | None = None
    # while a message is pickled: the agent and whether it is a request (else a reply)
    sending: tuple[Any, bool] | None = None


_tls = _ThreadState()


def _refuse_device(tensor: torch.Tensor) -> None:
    """A tensor on another device than the CPU in a message to a worker that no device map
    sends to: torch's error (its TensorPipe agent sends only CPU tensors by default)."""
    sending, dst = _tls.sending, _tls.peer
    if sending is None or dst is None:  # (not an RPC message: an object collective's, say)
        return
    agent, request = sending
    info = agent._workers.get(dst)
    name = info.name if info is not None else str(dst)
    if info is not None and agent._get_device_map(info):
        return
    raise RuntimeError(
        "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to CPU before "
        "sending them over RPC, or call `set_device_map` on `TensorPipeRpcBackendOptions` to explicitly configure "
        f"device mapping. {'Request' if request else 'Response'} device mapping is not available for destination "
        f"{name}, but found tensor on device: {tensor.device}"
    )


ser.device_hook[0] = _refuse_device


def current_agent(required: bool = True) -> RpcAgent | None:
    """The running agent of this process."""
    if _current is None and required:
        raise RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.")
    return _current


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType)
_MAX_BUDGETS = 4096


def wait_replies(calls: list[tuple[int, Any]]) -> list[Any]:
    """The values of the futures of ``calls`` (``(callee id, future)`` pairs), each reply read
    in this thread where the agent can (no hand-off from a poller); raises the first error once
    every call is done."""
    agent = _current
    results, errors = [], []
    for dst, fut in calls:
        try:
            results.append(agent.wait(fut, dst, None) if agent is not None else fut.wait())
        except Exception as exc:
            errors.append(exc)
    if errors:
        try:
            raise errors[0]
        finally:  # (no cycle through this frame: see ``errors.fresh``)
            errors.clear()
    return results


# the id of this process's last agent: distributed autograd's worker id once RPC has run
# (torch's autograd container keeps the id init_rpc gave it after shutdown)
last_rank: int | None = None


def set_current_agent(agent: RpcAgent | None) -> None:
    global _current, last_rank
    _current = agent
    if agent is not None:
        last_rank = agent.rank
        from ..c10d._flight_recorder import add_dump_section

        add_dump_section("rpc_in_flight", _calls_in_flight)


def _calls_in_flight() -> list[dict[str, Any]]:
    agent = _current
    return [] if agent is None else agent.calls_in_flight()


def serialization_peer() -> int | None:
    """While this thread pickles or unpickles an RPC message: the other worker's id."""
    return _tls.peer


def note_unconfirmed(fork_id: Any) -> None:
    """A user RRef unpickled now is not confirmed by its owner yet: a request that carried it
    runs once it is (as torch's callee waits for the forks in a request)."""
    pending = _tls.unconfirmed
    if pending is not None:
        pending.append(fork_id)


# the keys of get_debug_info that torch's agent also reports as its metrics
_TORCH_METRICS = frozenset({
    "agent.client_active_calls", "agent.num_idle_threads", "agent.server_active_async_calls",
    "agent.server_active_calls", "agent.thread_pool_size", "agent.gil_average_wait_time_us",
})


class RpcAgent:
    """Base of the TENSORPIPE and PROCESS_GROUP agents.

    Args:
        name: this worker's name.
        rank: this worker's id.
        world_size: the group size, or None for a dynamic group.
        rpc_timeout: the default timeout in seconds (0: none).
        num_worker_threads: threads that run incoming requests.
    """

    def __init__(self, name: str, rank: int, world_size: int | None, rpc_timeout: float, num_worker_threads: int) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.rpc_timeout = rpc_timeout
        self.info = WorkerInfo(name, rank)
        self.label = f"{name} (id {rank})"
        self._workers: dict[int, WorkerInfo] = {rank: self.info}
        self._by_name: dict[str, WorkerInfo] = {name: self.info}
        self._lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        # calls that timed out while their request was out: their reply handlers still wait
        # for the real outcome (a remote()'s owner made the value and holds a fork for us)
        self._late: dict[int, tuple[int, Callable[[Any, BaseException | None], None]]] = {}
        self._ids = itertools.count(1)
        self._budgets: dict[tuple[int, Any], spin.Budget] = {}  # (callee, function) -> its waits
        # the earliest deadline of a pending call (a lower bound: calls that completed may
        # have had it); the timer thread sleeps until then, then scans what is pending
        self._soonest = math.inf
        self._timer_cv = threading.Condition(self._lock)
        self._dead: dict[int, PeerError] = {}
        self._left: set[int] = set()  # (of those, the ones that shut down in an orderly way)
        self._closed = False
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._busy = 0
        self._active_requests = 0
        self._idle_cv = threading.Condition(self._lock)
        # worker threads start when work waits for one (most requests run where they arrive)
        self._max_workers = max(1, num_worker_threads)
        self._idle_workers = 0
        self._pool: list[threading.Thread] = []
        self._timer = threading.Thread(target=self._timer_loop, name=f"tdist-rpc-timer-{rank}", daemon=True)
        self._timer.start()
        self._omp_team: ParkedTeam | None = None  # (``park_openmp``)
        self._owners: dict[Any, Any] = {}  # RRef id -> torch Future of the owned value
        self._active_async = 0  # async_execution requests waiting for their future
        self._gil_probe: _GilProbe | None = None
        self.store: Any = None  # the group's store (set by subclasses)
        self._prefix = "rpc"  # where this group's keys live in it
        self._gathered: tuple[str, int] | None = None  # the last gather: (what, world_size)
        from ._rref import RRefContext

        self.rref_ctx: Any = RRefContext(self)

    def park_openmp(self) -> None:
        """Once the agent runs: requests run where they arrive, often all on one thread, and
        OpenMP's idle threads would spin through this worker's waits, unlike in torch's RPC
        (``ParkedTeam``); until ``stop``."""
        with self._lock:
            if self._omp_team is None and not self._closed:
                self._omp_team = ParkedTeam(str(self.rank))

    # -- subclass interface ---------------------------------------------------------------------
    def _transmit(self, dst: int, tag: int, kind: MsgKind, body: Any, deadline: float | None, answer: bool = False) -> None:
        """Send a message; ``answer``: the reply a caller waits for (its next request may
        follow soon)."""
        raise NotImplementedError

    def _wait_reply(self, dst: int, fut: Any, deadline: float | None) -> None:
        """Block until ``fut`` is done or the deadline passes (a subclass may read the callee's
        connection itself)."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        _wait_future(fut, timeout)

    def _close_transport(self, graceful: bool) -> None:
        raise NotImplementedError

    # -- workers --------------------------------------------------------------------------------
    def get_worker_info(self, name: str | int | None = None) -> WorkerInfo:
        """This worker's ``WorkerInfo``, or that of the worker with this name (or id).

        Raises:
            RuntimeError: no such worker (torch's message).
        """
        if name is None:
            return self.info
        if isinstance(name, int) and not isinstance(name, bool):
            info = self._workers.get(name) or self._find_worker_id(name)
            if info is None:
                raise RuntimeError(f"name:{self.name},rank:{self.rank} could not find destination id {name}")
            return info
        if not isinstance(name, str):
            raise TypeError(f"get_worker_info(): expected a worker name or id, got {type(name).__name__}")
        info = self._by_name.get(name) or self._find_worker(name)
        if info is None:
            raise RuntimeError(f"name:{self.name},rank:{self.rank} could not find destination name {name}")
        return info

    def _find_worker(self, name: str) -> WorkerInfo | None:
        """A worker this agent has not heard of yet (a subclass may wait or look it up)."""
        return None

    def _find_worker_id(self, wid: int) -> WorkerInfo | None:
        """As ``_find_worker``, by id."""
        return None

    def get_debug_info(self) -> dict[str, str]:
        """What this agent is doing, as strings: torch's keys (``agent.client_active_calls``:
        requests waiting for their reply, ``agent.server_active_calls``: requests running here,
        ``agent.server_active_async_calls``: ``async_execution`` ones waiting for their future,
        ``agent.thread_pool_size``: ``num_worker_threads``, ``agent.num_idle_threads``: those
        not running a request, ``agent.gil_average_wait_time_us`` with GIL profiling on) and
        ours (``agent.name``, ``agent.rank``, ``agent.world_size``, ``agent.rpc_timeout``,
        ``agent.num_timed_out_awaiting_reply``, ``agent.dead_workers``, ``agent.type``)."""
        with self._lock:
            busy = len(self._pool) - self._idle_workers
            info = {
                "agent.server_active_async_calls": str(self._active_async),
                "agent.client_active_calls": str(len(self._pending)),
                "agent.server_active_calls": str(self._active_requests),
                "agent.num_idle_threads": str(max(0, self._max_workers - busy)),
                "agent.thread_pool_size": str(self._max_workers),
                "agent.type": type(self).__name__,
                "agent.name": self.name,
                "agent.rank": str(self.rank),
                "agent.world_size": str(self.world_size),
                "agent.rpc_timeout": str(self.rpc_timeout),
                "agent.num_timed_out_awaiting_reply": str(len(self._late)),
                "agent.dead_workers": ",".join(str(w) for w in sorted(self._dead)),
            }
        probe = self._gil_probe
        if probe is not None:
            info["agent.gil_average_wait_time_us"] = f"{probe.average_us():.6f}"
        return info

    def get_metrics(self) -> dict[str, str]:
        """Torch's agent metrics: the keys of ``get_debug_info`` that torch's agent reports
        (``agent.client_active_calls`` ... ``agent.thread_pool_size``, and
        ``agent.gil_average_wait_time_us`` with GIL profiling on)."""
        info = self.get_debug_info()
        return {k: v for k, v in info.items() if k in _TORCH_METRICS}

    @property
    def is_static_group(self) -> bool:
        """True for a group formed with a ``world_size``, False for a dynamic one."""
        return self.world_size is not None

    def _get_backend_options(self) -> Any:
        """The ``rpc_backend_options`` this agent was made with (torch's agent method)."""
        return getattr(self, "options", None)

    def _get_device_map(self, dst: WorkerInfo) -> dict[Any, Any]:
        """The device map of calls to ``dst``, as ``rpc_backend_options.device_maps`` set it
        (empty where none was set)."""
        options = self._get_backend_options()
        maps: dict[str, Any] = getattr(options, "device_maps", None) or {}
        return dict(maps.get(dst.name, {}))

    def calls_in_flight(self) -> list[dict[str, Any]]:
        """This worker's requests waiting for their reply, oldest first: the callee (name and
        id), the call (``rpc_sync(worker1, mod.fn)``), its age and its timeout in seconds (what
        the flight recorder's dumps carry as ``rpc_in_flight``)."""
        now = time.monotonic()
        with self._lock:
            calls = list(self._pending.values())
            workers = dict(self._workers)
        calls.sort(key=lambda c: c.started)
        out = []
        for c in calls:
            info = workers.get(c.dst)
            out.append({
                "callee": info.name if info is not None else str(c.dst),
                "callee_id": c.dst,
                "call": str(c.what),
                "age_s": round(now - c.started, 3),
                "timeout_s": c.seconds,
            })
        return out

    def rref_debug_info(self) -> dict[str, str]:
        """Torch's RRef context figures, as strings: ``num_owner_rrefs`` (values owned here
        that other workers reference; a local ``RRef`` counts once shared), ``num_forks``
        (their references elsewhere), ``num_pending_users`` (user references here their owner
        has not confirmed yet), ``num_pending_futures`` (values owned here not made yet); and
        ours, ``rref_protocol_pending`` (what the protocol still waits for, one line each)."""
        ctx = self.rref_ctx
        with ctx.lock:
            counts = ctx.proto.debug_counts()
            pending = ctx.proto.pending()
        return {
            "num_pending_users": str(counts["pending_users"]),
            "num_forks": str(counts["forks"]),
            "num_pending_futures": str(sum(1 for f in list(self._owners.values()) if not f.done())),
            "num_owner_rrefs": str(counts["owners"]),
            "rref_protocol_pending": pending,
        }

    def enable_gil_profiling(self, flag: bool) -> None:
        """Measure how long threads wait for the GIL (``agent.gil_average_wait_time_us``)."""
        with self._lock:
            probe, self._gil_probe = self._gil_probe, (_GilProbe(str(self.rank)) if flag else None)
        if probe is not None:
            probe.stop()

    def get_worker_infos(self) -> list[WorkerInfo]:
        return sorted(self._workers.values(), key=lambda w: w.id)

    def _add_worker(self, info: WorkerInfo) -> None:
        with self._lock:
            old = self._workers.get(info.id)
            if old is not None and old.name != info.name:
                self._by_name.pop(old.name, None)
            self._workers[info.id] = info
            self._by_name[info.name] = info
            self._dead.pop(info.id, None)
            self._left.discard(info.id)

    def _remove_worker(self, wid: int) -> None:
        with self._lock:
            info = self._workers.pop(wid, None)
            if info is not None and self._by_name.get(info.name) is info:
                del self._by_name[info.name]

    def describe(self, wid: int) -> str:
        info = self._workers.get(wid)
        return f"{info.name} (id {wid})" if info is not None else f"worker id {wid}"

    def resolve(self, to: Any) -> WorkerInfo:
        """The ``WorkerInfo`` of a name, an id or a ``WorkerInfo`` (found by its name, as torch
        finds it).

        Raises:
            RuntimeError: no such worker. ValueError: ``to`` is none of those (torch's).
        """
        if isinstance(to, WorkerInfo):
            known = self._by_name.get(to.name)
            return known if known is not None else self.get_worker_info(to.name)
        if isinstance(to, (str, int)) and not isinstance(to, bool):
            return self.get_worker_info(to)
        raise ValueError(f"Cannot get WorkerInfo from name {to}")

    # -- calling --------------------------------------------------------------------------------
    def timeout_seconds(self, timeout: float | None) -> float | None:
        """The per-call timeout: -1 (unset) is the agent's default; 0 means none; another
        negative value has run out already (as in torch)."""
        if timeout is None or timeout == UNSET_RPC_TIMEOUT:
            timeout = self.rpc_timeout
        elif timeout < 0:
            return _EXPIRED
        return None if timeout == 0 else float(timeout)

    def request(
        self,
        dst: int,
        kind: MsgKind,
        body: Any,
        timeout: float | None,
        what: object,
        on_reply: Callable[[Any, BaseException | None], None] | None = None,
        sync: bool = False,
    ) -> Any:
        """Send a request; returns a ``torch.futures.Future`` of its reply (``sync``: a lighter
        object with ``done``/``wait``/``add_done_callback``, where no user holds the future)."""
        seconds = self.timeout_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        fut: Any = _SyncReply() if sync else Future()
        fut._tdist_spin = self.spin_budget(dst, what)
        tag = next(self._ids)
        # (a negative timeout, spent already, is named as given in the timeout error, as torch's)
        shown = seconds if seconds != _EXPIRED or timeout is None else float(timeout)
        call = _Call(fut, dst, what, shown, deadline, on_reply, kind)
        count_sent(kind)  # (a request refused below, by a shut-down agent, was sent all the same)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.label}: RPC agent is shut down; cannot send {what}")
            dead = self._dead.get(dst)
            if dead is None:
                self._pending[tag] = call
                if deadline is not None and deadline < self._soonest:
                    self._soonest = deadline
                    self._timer_cv.notify()
        if dead is not None:
            self._finish(call, None, PeerError(f"{dead} (while sending {what})", peer=dst))
            return fut
        try:
            self._transmit(dst, tag, kind, body, deadline)
        except BaseException as exc:
            with self._lock:
                mine = self._pending.pop(tag, None) is not None  # else a failure or timeout did it
                late = self._late.pop(tag, None)
            if late is not None:  # it timed out while being sent, and never went out
                self._late_reply(late[1], None, self._timeout_error(call))
            if isinstance(exc, (DistError, OSError)):
                if mine:
                    err: BaseException
                    if isinstance(exc, PeerError):
                        err = fresh(exc)  # (kept by the future: see ``fresh``)
                    elif isinstance(exc, DistTimeoutError) or (deadline is not None and time.monotonic() >= deadline):
                        # (a first contact that the call's deadline cut short: the call timed out)
                        err = self._timeout_error(call)
                    else:
                        err = PeerError(f"{self.label}: could not send {what} to {self.describe(dst)}: {exc}", peer=dst)
                    self._finish(call, None, err)
                return fut
            raise
        return fut

    def spin_budget(self, dst: int, what: object) -> spin.Budget:
        """The spin budget of a wait for a reply from ``dst`` to the call ``what`` describes:
        one per callee and function (a ``CallText``'s function; else the kind of description),
        which learns how soon those replies come."""
        func = getattr(what, "func", None)
        if isinstance(func, types.MethodType):
            func = func.__func__  # (a bound method is made anew at each access; its object may go)
        site = func if isinstance(func, _FUNCTIONS) else type(func if func is not None else what)
        key = (dst, site)
        budget = self._budgets.get(key)
        if budget is None:
            if len(self._budgets) >= _MAX_BUDGETS:  # (functions made on the fly: forget them all)
                self._budgets.clear()
            budget = self._budgets[key] = spin.Budget()
        return budget

    def cast(self, dst: int, func: Any, args: tuple[Any, ...]) -> None:
        """A one-way call: ``func(*args)`` runs on ``dst`` (as a request does), nothing answers
        and nothing here waits or keeps track of it (tdist's own notices, e.g. an autograd
        context's release; a failure there is logged there).

        Raises:
            RuntimeError: this agent is shut down. PeerError / DistError: ``dst`` is lost, or
                the message could not be sent.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.label}: RPC agent is shut down; cannot send a one-way call")
            dead = self._dead.get(dst)
        if dead is not None:
            raise PeerError(str(dead), peer=dst)
        self._transmit(dst, 0, MsgKind.CAST, (func, args, {}), time.monotonic() + 30.0)

    def call_sync(self, dst: int, kind: MsgKind, body: Any, timeout: float | None, what: object) -> Any:
        """``request`` and wait for the reply: its value, or its exception raised."""
        return self.wait(self.request(dst, kind, body, timeout, what, sync=True), dst, timeout)

    def wait(self, fut: Any, dst: int, timeout: float | None) -> Any:
        """``fut.wait()`` for a request to ``dst`` (reading the reply in this thread if it can)."""
        if not fut.done():
            seconds = self.timeout_seconds(timeout)
            deadline = None if seconds is None else time.monotonic() + seconds + 1.0
            self._wait_reply(dst, fut, deadline)
        return fut.wait()

    def _finish(self, call: _Call, value: Any, exc: BaseException | None) -> None:
        if exc is not None:
            count_failed(call.kind)
        if call.on_reply is not None:
            try:
                call.on_reply(value, exc)
            except Exception:
                log.exception("%s: reply handler for %s failed", self.label, call.what)
        if exc is not None:
            call.fut.set_exception(exc)
        else:
            call.fut.set_result(value)

    def _timer_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed and not self._pending:
                    return
                now = time.monotonic()
                if now < self._soonest:
                    self._timer_cv.wait(min(1.0, self._soonest - now))
                    continue
                expired = [(t, c) for t, c in self._pending.items() if c.deadline is not None and c.deadline <= now]
                for t, c in expired:
                    del self._pending[t]
                    if c.on_reply is not None:  # the caller gives up; the handler hears the end
                        self._late[t] = (c.dst, c.on_reply)
                        c.on_reply = None
                self._soonest = min((c.deadline for c in self._pending.values() if c.deadline is not None), default=math.inf)
            for _, call in expired:
                self._finish(call, None, self._timeout_error(call))

    def _late_reply(self, handler: Callable[[Any, BaseException | None], None], value: Any, exc: BaseException | None) -> None:
        try:
            handler(value, exc)
        except Exception:
            log.exception("%s: late reply handler failed", self.label)

    def _timeout_error(self, call: _Call) -> RpcTimeoutError:
        ms = round((call.seconds or 0.0) * 1000)
        return RpcTimeoutError(
            f"RPC ran for more than set timeout ({ms} ms) and will now be marked with an error: "
            f"{call.what} to {self.describe(call.dst)} did not complete in time (worker {self.label})"
        )

    # -- receiving ------------------------------------------------------------------------------
    def _on_message(self, src: int, tag: int, meta: bytes, decode: Callable[..., Any]) -> None:
        """One received message; ``decode()`` unpickles its body (in this thread),
        ``decode(lenient=True)`` with placeholders for what cannot be rebuilt
        (``serialization.loads``)."""
        try:
            kind = decode_meta(meta)
        except DistError as exc:
            log.warning("%s: dropped a message from %s: %s", self.label, self.describe(src), exc)
            return
        if kind in _REPLIES:
            if kind == MsgKind.REPLY_OK_ACK:
                self._on_reply_ack(src, tag, decode)
            else:
                self._on_reply(src, tag, kind == MsgKind.REPLY_OK, decode)
            return
        if kind in REQUESTS:
            unconfirmed: list[Any] = []
            try:
                body = self._decode(src, decode, unconfirmed)
            except BaseException as exc:
                err = _errors.capture(with_pickler_hint(exc), self.label)
                if kind == MsgKind.REMOTE:
                    self._remote_undecodable(src, decode, err)
                self._to_pool(lambda: self._reply_error(src, tag, err))
                return
            self._accept_request(src, tag, kind, body, unconfirmed)
            return
        if kind == MsgKind.RREF:
            try:
                body = self._decode(src, decode)
            except BaseException:
                log.exception("%s: undecodable RRef message from %s", self.label, self.describe(src))
                return
            self._on_rref_message(src, body)
            return
        if kind == MsgKind.CAST:
            try:
                func, args, kwargs = self._decode(src, decode)
            except BaseException:
                log.exception("%s: undecodable one-way call from %s", self.label, self.describe(src))
                return
            self._schedule(lambda: self._run_cast(src, func, args, kwargs))
            return
        if kind == MsgKind.LEAVE:
            self._on_leave(src)

    def _on_reply(self, src: int, tag: int, ok: bool, decode: Callable[..., Any]) -> None:
        """The reply to request ``tag`` (``ok``: its value, else its error record)."""
        with self._lock:
            call = self._pending.pop(tag, None)
            late = self._late.pop(tag, None) if call is None else None
        if call is None:
            if late is not None:  # it timed out already; its handler hears the outcome
                self._late_reply(late[1], None, None if ok else RuntimeError("the request failed"))
            return
        try:
            body = self._decode(src, decode)
        except BaseException as exc:
            self._finish(call, None, RuntimeError(f"{self.label}: could not decode the reply to {call.what} from {self.describe(src)}: {exc!r}"))
            return
        if ok:
            self._finish(call, body, None)
        else:
            self._finish(call, None, _errors.rebuild(body, call=str(call.what)) if isinstance(body, _errors.RemoteExceptionRecord) else RuntimeError(repr(body)))

    def _on_reply_ack(self, src: int, tag: int, decode: Callable[..., Any]) -> None:
        """``REPLY_OK_ACK (remote_tag, value, remote_reply)``: the ``remote()`` of id
        ``remote_tag`` is done (its reply first, as if it had come alone), then fetch ``tag``
        has its value."""
        try:
            remote_tag, value, remote_reply = self._decode(src, decode)
        except BaseException:
            try:  # the value cannot be rebuilt here: the remote() is done all the same
                remote_tag = self._decode(src, lambda: decode(lenient=True))[0]
            except Exception as exc:
                log.warning("%s: dropped an unreadable reply from %s: %s", self.label, self.describe(src), exc)
                return
            self._on_reply(src, remote_tag, True, lambda: None)
            self._on_reply(src, tag, True, decode)  # (says what could not be decoded)
            return
        self._on_reply(src, remote_tag, True, lambda: remote_reply)
        self._on_reply(src, tag, True, lambda: value)

    def _decode(self, src: int, decode: Callable[..., Any], unconfirmed: list[Any] | None = None) -> Any:
        old, old_unconfirmed = _tls.peer, _tls.unconfirmed
        _tls.peer, _tls.unconfirmed = src, unconfirmed
        try:
            return decode()
        finally:
            _tls.peer, _tls.unconfirmed = old, old_unconfirmed

    def encode(self, dst: int, body: Any, kind: MsgKind) -> list[memoryview]:
        """Serialize ``body``, a message of ``kind``, for ``dst`` (RRefs inside fork for
        ``dst``; a tensor on another device than the CPU needs a device map to ``dst``)."""
        old, old_sending = _tls.peer, _tls.sending
        _tls.peer, _tls.sending = dst, (self, kind in REQUESTS)
        try:
            return ser.dumps(body)
        finally:
            _tls.peer, _tls.sending = old, old_sending

    def _accept_request(self, src: int, tag: int, kind: MsgKind, body: Any, unconfirmed: list[Any]) -> None:
        """Run a request; one that carried user RRefs not confirmed yet (``unconfirmed``) once
        their owners confirm them, so that the function sees them confirmed, as torch's."""
        if kind == MsgKind.REMOTE:
            # the owner's record exists from the moment the request arrives (in arrival order)
            rid, fid, func, args, kwargs = body
            rref_id = GloballyUniqueId(*rid)
            self._owner_future(rref_id)
            self.rref_ctx.run(self.rref_ctx.proto.owner_created_by_remote, rref_id, GloballyUniqueId(*fid), src)
            job = lambda: self._run_remote(src, tag, func, args, kwargs, rref_id)  # noqa: E731
        elif kind == MsgKind.FETCH:
            self._serve_fetch(src, tag, body)
            return
        elif kind == MsgKind.JOIN:
            self._on_join(src, tag, body)
            return
        else:
            func, args, kwargs = body
            job = lambda: self._run_call(src, tag, func, args, kwargs)  # noqa: E731
        if unconfirmed:  # (on a pool thread: the confirmation comes in the middle of other work)
            self.rref_ctx.when_confirmed(unconfirmed, lambda: self._to_pool(job))
        else:
            self._schedule(job)

    def _schedule(self, job: Callable[[], None]) -> None:
        """Run a request's job: on the worker pool here (a subclass may run it where the
        message arrived)."""
        self._to_pool(job)

    def _to_pool(self, job: Callable[[], None]) -> None:
        # Each job reserves an idle worker or starts one (up to num_worker_threads), so a job
        # never waits behind another that may block on it while a thread could be started.
        with self._lock:
            if self._idle_workers > 0:
                self._idle_workers -= 1
                start = False
            else:
                start = len(self._pool) < self._max_workers and not self._closed
                if start:
                    t = threading.Thread(target=self._worker, name=f"tdist-rpc-worker-{self.rank}-{len(self._pool)}", daemon=True)
                    self._pool.append(t)
        self._jobs.put(job)
        if start:
            t.start()

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run_job(job)
            del job  # not kept alive (with its arguments) while this thread waits
            with self._lock:
                self._idle_workers += 1

    def _run_job(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._active_requests += 1
        try:
            profiled_job(job)
        except BaseException:
            log.exception("%s: an RPC job failed", self.label)
        finally:
            with self._lock:
                self._active_requests -= 1
                if self._active_requests == 0 and self._closed:  # only shutdown waits for it
                    self._idle_cv.notify_all()

    def _run_call(self, src: int, tag: int, func: Any, args: Any, kwargs: Any) -> None:
        try:
            is_async, result = dispatch(func, args or (), kwargs or {})
        except BaseException as exc:
            self._reply_error(src, tag, failed(exc, self))
            return
        if is_async:
            self._reply_when_done(src, tag, result, func)
        else:
            self._reply(src, tag, result)

    def _run_cast(self, src: int, func: Any, args: Any, kwargs: Any) -> None:
        try:
            dispatch(func, args, kwargs)
        except BaseException:  # (nobody waits for it: said here)
            log.warning("%s: a one-way call from %s failed", self.label, self.describe(src), exc_info=True)

    def _reply_when_done(self, src: int, tag: int, fut: Any, func: Any) -> None:
        if not isinstance(fut, torch._C.Future):
            err = _not_a_future(func, fut)
            self._reply_error(src, tag, _errors.capture(err, self.label))
            return

        def done(f: Any) -> None:
            with self._lock:
                self._active_async -= 1
            try:
                value = f.wait()
            except BaseException as exc:
                self._reply_error(src, tag, _errors.capture(_unwrap(exc), self.label))
                return
            self._reply(src, tag, value)

        with self._lock:
            self._active_async += 1
        fut.add_done_callback(done)

    def _reply(self, dst: int, tag: int, value: Any, answer: bool = True) -> None:
        try:
            self._transmit(dst, tag, MsgKind.REPLY_OK, value, None, answer)
        except (DistError, OSError) as exc:
            log.debug("%s: could not reply to %s: %s", self.label, self.describe(dst), exc)
        except BaseException as exc:  # the result could not be serialized: say so
            self._reply_error(dst, tag, self._unsendable(exc))

    def _unsendable(self, exc: BaseException) -> Any:
        """The error record of a result that could not be serialized (``exc``: the pickler's
        error), which the caller raises as a ``RuntimeError``, as torch's: its own type where
        that is rebuilt as a ``RuntimeError`` too (``_errors``' rule 5); a ``TypeError`` or
        ``ValueError``, which would be rebuilt as such and read as the function's own, as a
        ``RuntimeError`` that names it (torch's words)."""
        if not isinstance(exc, (TypeError, ValueError)):
            return _errors.capture(exc, self.label)
        failed = RuntimeError(f"{type(exc).__name__}: {exc}")
        failed.__cause__ = exc
        return _errors.capture(failed.with_traceback(exc.__traceback__), self.label)

    def _reply_error(self, dst: int, tag: int, record: Any) -> None:
        try:
            self._transmit(dst, tag, MsgKind.REPLY_ERR, record, None)
        except BaseException as exc:
            log.debug("%s: could not send an error reply to %s: %s", self.label, self.describe(dst), exc)

    # -- RRef owners ----------------------------------------------------------------------------
    def _remote_undecodable(self, src: int, decode: Callable[..., Any], err: Any) -> None:
        """A ``REMOTE`` whose call cannot be rebuilt here (a function this worker lacks, an
        argument whose unpickling raises): its value is that error, so that a fetch (maybe on
        its way already) gets it. The ids are read again with placeholders for the rest."""
        try:
            rid, fid = self._decode(src, lambda: decode(lenient=True))[:2]
            rref_id, fork_id = GloballyUniqueId(*rid), GloballyUniqueId(*fid)
        except Exception as exc:
            log.warning("%s: dropped a remote() request from %s that cannot be read: %s", self.label, self.describe(src), exc)
            return
        fut = self._owner_future(rref_id)
        self.rref_ctx.run(self.rref_ctx.proto.owner_created_by_remote, rref_id, fork_id, src)
        _set_owner_error(fut, err)

    def _owner_future(self, rref_id: Any) -> Any:
        fut = self._owners.get(rref_id)
        if fut is not None:
            return fut
        with self._lock:
            fut = self._owners.get(rref_id)
            if fut is None:
                fut = self._owners[rref_id] = _SyncReply()
            return fut

    def _run_remote(self, src: int, tag: int, func: Any, args: Any, kwargs: Any, rref_id: Any) -> None:
        fut = self._owner_future(rref_id)
        try:
            is_async, result = dispatch(func, args or (), kwargs or {})
        except BaseException as exc:
            record = failed(exc, self)
            _set_owner_error(fut, record)
            self._reply_error(src, tag, record)
            return
        if is_async and not isinstance(result, torch._C.Future):
            record = _errors.capture(_not_a_future(func, result), self.label)
            _set_owner_error(fut, record)
            self._reply_error(src, tag, record)
            return
        reply: Any = None
        if type(result) is _remote_profiling.Profiled:  # a profiled remote(): the events go back
            reply, result = _remote_profiling.Profiled(None, result.events, result.started, result.node), result.value
        if is_async:

            def done(f: Any) -> None:
                try:
                    value = f.wait()
                except BaseException as exc:
                    record = _errors.capture(_unwrap(exc), self.label)
                    _set_owner_error(fut, record)
                    self._reply_error(src, tag, record)
                    return
                if not fut.done():
                    fut.set_result(value)
                self._reply(src, tag, None)

            result.add_done_callback(done)
            return
        # a fetch from the caller that came before the value was set is answered as it is
        # set (``_send_owned``, in this thread), and its reply answers this request too
        ack = _tls.ack = (self, src, tag, reply)
        try:
            if not fut.done():
                fut.set_result(result)
        finally:
            taken, _tls.ack = _tls.ack is not ack, None
        if not taken:
            # (an answer: its caller may wait on the creation, and send its next request at once)
            self._reply(src, tag, reply)

    def _serve_fetch(self, src: int, tag: int, rref_id: Any) -> None:
        fut = self._owner_future(rref_id)
        if fut.done():  # the common case: made already
            self._send_owned(src, tag, fut)
        else:  # sent from where the value is set (a worker)
            fut.add_done_callback(lambda f: self._send_owned(src, tag, f))

    def _send_owned(self, src: int, tag: int, fut: Any) -> None:
        value = fut.value()
        if isinstance(value, _OwnerError):
            self._reply_error(src, tag, value.record)
            return
        if getattr(fut, "as_tensor", False):  # RRef(parameter): torch's to_here() gives a tensor
            value = value.detach().requires_grad_(value.requires_grad)
        ack = _tls.ack
        if ack is not None and ack[0] is self and ack[1] == src:
            # the caller's remote() of this value is not answered yet: this reply does it
            _tls.ack = None
            try:
                self._transmit(src, tag, MsgKind.REPLY_OK_ACK, (ack[2], value, ack[3]), None, True)
            except (DistError, OSError) as exc:
                log.debug("%s: could not reply to %s: %s", self.label, self.describe(src), exc)
            except BaseException as exc:  # the value could not be serialized: say so
                self._reply_error(src, tag, self._unsendable(exc))
                self._reply(src, ack[2], ack[3], answer=False)
            return
        self._reply(src, tag, value)

    def _on_rref_message(self, src: int, msgs: Any) -> None:
        for msg in msgs:
            self.rref_ctx.run(self.rref_ctx.proto.handle, src, msg)

    # -- membership -----------------------------------------------------------------------------
    def _on_join(self, src: int, tag: int, body: Any) -> None:
        self._to_pool(lambda: self._reply(src, tag, None))

    def _on_leave(self, src: int) -> None:
        self._remove_worker(src)

    def peer_lost(self, peer: int, err: PeerError, graceful: bool) -> None:
        """Fail every request waiting on ``peer``; later requests to it fail at once."""
        with self._lock:
            self._dead[peer] = err
            if graceful:
                self._left.add(peer)
            calls = [(t, c) for t, c in self._pending.items() if c.dst == peer]
            for t, _ in calls:
                del self._pending[t]
            late = [(t, h) for t, (dst, h) in self._late.items() if dst == peer]
            for t, _ in late:
                del self._late[t]
        for _, c in calls:
            self._finish(c, None, PeerError(f"{err} (while waiting for {c.what})", peer=peer))
        for _, h in late:
            self._late_reply(h, None, PeerError(str(err), peer=peer))
        if peer != self.rank:
            self.rref_ctx.run(self.rref_ctx.proto.peer_failed, peer)
        if graceful and self.world_size is None:
            self._remove_worker(peer)

    # -- forming a static group (through ``self.store`` under ``self._prefix``) ----------------
    def gather(self, what: str, value: str, world_size: int, timeout: float) -> list[bytes]:
        """Publish ``value`` and return every worker's, by id (a barrier of the static group).

        Raises:
            RuntimeError: naming the worker ids that did not publish in time.
        """
        self.store.set(f"{self._prefix}/{what}/{self.rank}", value)
        keys = [f"{self._prefix}/{what}/{i}" for i in range(world_size)]
        from ..store._rendezvous import claims_gone

        gone = claims_gone(self.store, world_size)  # (a worker of this pid space whose process is gone: said at once)
        start = time.monotonic()
        words = patience.Words()
        while True:
            left = start + timeout - time.monotonic()
            try:  # (a second at a time: a worker gone meanwhile is named, and a long wait said)
                self.store.wait(keys, timedelta(seconds=max(0.01, min(1.0, left))))
                break
            except (DistStoreError, TimeoutError) as exc:
                missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
                if left <= 1.0:
                    raise RuntimeError(
                        f"{self.label}: init_rpc timed out waiting for workers with ids {missing} to join ({world_size} expected)"
                    ) from exc
                for i in missing:
                    why = gone(i) if gone is not None else None
                    if why is not None:
                        raise RuntimeError(f"{self.label}: init_rpc: the worker with id {i} never joined, and it is gone: {why}") from exc
                waited = time.monotonic() - start
                if words.due(waited):
                    log.warning("%s: init_rpc has waited %.0f s for the workers with ids %s to join (it times out after %g s)",
                                self.label, waited, missing, timeout)
        values = list(self.store.multi_get(keys))
        # read: a worker whose init_rpc fails after this (an invalid device map, a name used
        # twice: every worker fails alike) waits for the others' reads before it leaves, so
        # that the store it may host stays up until they have what they need to fail alike
        self.store.set(f"{self._prefix}/{what}/read/{self.rank}", "")
        self._gathered = (what, world_size)
        # and on success too: the worker that hosts the store (it is one of us) must not go on
        # (and may leave the program, taking the store along) while another still reads; that
        # one's read would fail with a lost connection
        self.linger_after_gather()
        return values

    def linger_after_gather(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout`` s) until every worker has read the last ``gather``, so
        that a store this process hosts outlives their reads (after a ``gather``, and on a
        failed ``init_rpc``)."""
        if self._gathered is None:
            return
        what, world_size = self._gathered
        keys = [f"{self._prefix}/{what}/read/{i}" for i in range(world_size)]
        with contextlib.suppress(Exception):
            self.store.wait(keys, timedelta(seconds=timeout))

    def add_workers(self, names: list[str]) -> None:
        """Register the static group's workers (id = index).

        Raises:
            RuntimeError: two workers share a name.
        """
        first: dict[str, int] = {}
        for i, n in enumerate(names):
            if n in first:
                raise RuntimeError(f"RPC worker name {n!r} is used by workers {first[n]} and {i}: names must be unique")
            first[n] = i
        for i, n in enumerate(names):
            self._add_worker(WorkerInfo(n, i))

    # -- shutdown -------------------------------------------------------------------------------
    # (barriers use ``self.store`` and ``self._prefix``, which subclasses set)
    def barrier(self, name: str, timeout: float | None) -> None:
        """Wait until every worker of the static group has reached ``name`` (through the store).
        With ``timeout`` None it waits as long as the missing workers live (torch's shutdown
        waits without limit); a worker that died or stalls fails it within seconds of the
        moment every other missing worker has come (or was lost too): the live ones may still
        be working with this one.

        Raises:
            DistTimeoutError: naming the workers that did not arrive in time.
            PeerError: a worker that did not arrive is lost (naming it).
        """
        assert self.world_size is not None
        try:
            self._barrier(name, timeout)
        except DistNetworkError as exc:
            # the store went with its host: a worker lost (not one that left by shutting down)
            # is the better answer; not the store's host (id 0) where another is lost too, as
            # that one may have left after its own error about the other (which this worker,
            # not connected to it, had not heard of yet)
            lost = {i: self._lost_peer(i) for i in range(self.world_size) if i != self.rank and i not in self._left}
            gone = [i for i, why in lost.items() if why is not None]
            if gone:
                first = next((i for i in gone if i != 0), gone[0])
                also = f" (and {self.describe(0)}, which hosted the store, is gone too)" if first != 0 and 0 in gone else ""
                raise PeerError(f"{self.label}: RPC shutdown: {self.describe(first)} was lost: {lost[first]}{also}", peer=first) from exc
            if 0 in self._left:
                # the store's host shut down before this worker came (its wait timed out, as
                # torch's shutdown timeout lets it): nobody is left to wait for through it
                log.warning("%s: RPC shutdown: %s shut down before this worker reached %r; going on alone",
                            self.label, self.describe(0), name)
                return
            raise

    def _barrier(self, name: str, timeout: float | None) -> None:
        assert self.world_size is not None
        key = f"{self._prefix}/{name}"
        self.store.set(f"{key}/{self.rank}", "1")
        if self.store.add(key, 1) >= self.world_size:
            self.store.set(f"{key}/done", "1")
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        words = patience.Words()
        while True:
            step = _BARRIER_STEP if deadline is None else min(_BARRIER_STEP, deadline - time.monotonic())
            try:
                self.store.wait([f"{key}/done"], timedelta(seconds=max(0.01, step)))
                return
            except TimeoutError as exc:
                missing = [i for i in range(self.world_size) if not self.store.check([f"{key}/{i}"])]
                if missing and all(i in self._left for i in missing):
                    # they shut down before this worker came (their wait timed out, as torch's
                    # shutdown timeout lets it): nobody is left to wait for
                    log.warning("%s: RPC shutdown: %s shut down before this worker reached %r; going on alone",
                                self.label, ", ".join(self.describe(i) for i in missing), name)
                    return
                # a lost worker fails it once every other missing one is lost or left too: the
                # live ones may still be working with this one (a parameter server whose other
                # trainers died serves the one left until it is done, as torch's would)
                lost = {i: self._lost_peer(i) for i in missing}
                gone = [i for i in missing if lost[i] is not None]
                if gone and all(lost[i] is not None or i in self._left for i in missing):
                    first = gone[0]
                    also = f" (nor will {', '.join(self.describe(i) for i in gone[1:])})" if len(gone) > 1 else ""
                    raise PeerError(f"{self.label}: RPC shutdown: {self.describe(first)} will never reach it: {lost[first]}{also}",
                                    peer=first) from None
                if deadline is not None and time.monotonic() >= deadline:
                    names = ", ".join(self.describe(i) for i in missing)
                    raise DistTimeoutError(f"{self.label}: RPC shutdown timed out after {timeout:g} s waiting for {names}") from exc
                waited = time.monotonic() - start
                if words.due(waited):  # (a wait without limit, by default, is not a silent one)
                    log.warning(
                        "%s: RPC shutdown has waited %.0f s for %s to call shutdown (%s)", self.label, waited,
                        ", ".join(self.describe(i) for i in missing),
                        "it waits as long as they live" if deadline is None else f"it gives up after {timeout:g} s",
                    )

    def _lost_peer(self, peer: int) -> PeerError | None:
        """Why ``peer`` is known to be gone, or None while it may still come (a subclass may
        look, e.g. by connecting to it, so that its heartbeats tell when it dies or stalls)."""
        with self._lock:
            return self._dead.get(peer)

    def release_store_host(self, timeout: float) -> None:
        """After the last barrier: the others say they are done with the store, and the worker
        that may host it (id 0, as the rendezvous makes it) waits for that before it goes."""
        assert self.world_size is not None
        key = f"{self._prefix}/shutdown-done"
        try:
            if self.rank != 0:
                self.store.add(key, 1)
                return
            end = time.monotonic() + timeout
            others = set(range(1, self.world_size))
            # (one that shut down already, as a worker whose shutdown timed out does, is done)
            while self.store.add(key, 0) < self.world_size - 1 and time.monotonic() < end and not others <= self._left:
                time.sleep(0.0005)
        except Exception as exc:  # the store is only being given back
            log.debug("%s: store release: %s", self.label, exc)

    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait_outstanding(self, deadline: float | None) -> bool:
        """Wait until no request of ours waits for a reply; False at the deadline."""
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def stop(self, graceful: bool) -> None:
        """Stop the pool and the transport; pending requests fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            calls = list(self._pending.values())
            self._pending.clear()
            self._late.clear()
            self._timer_cv.notify_all()
        err = RuntimeError(f"{self.label}: RPC agent shut down before a reply came")
        for c in calls:
            self._finish(c, None, err)
        if self._gil_probe is not None:
            self._gil_probe.stop()
        if self._omp_team is not None:
            self._omp_team.stop()
        if graceful:
            end = time.monotonic() + 5.0
            with self._lock:
                while (self._active_requests or self._jobs.qsize()) and time.monotonic() < end:
                    self._idle_cv.wait(0.05)
        self._close_transport(graceful)
        self.rref_ctx.close()
        for _ in self._pool:
            self._jobs.put(None)
        me = threading.current_thread()
        end = time.monotonic() + 2.0
        for t in self._pool:
            if t is not me:
                t.join(max(0.0, end - time.monotonic()))
