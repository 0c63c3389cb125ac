"""The c10d and etcd rendezvous: ``_state``'s decisions carried out on a store.

``StateExecutor`` keeps the rendezvous state in one key of any tdist ``Store`` (``state``) and
runs an operation as ``_state`` describes it: decide, then write the result with
``compare_set`` against the state it read (the state's version is the fencing token), or wait.
A lost compare-and-set hands back the state that won, on which the node decides again. After
each write the writer sets ``changed/<version>``: a node that waits for the state to change
waits in the store for the key of the next version (``Store.wait``: the TCP store's server, a
watch in etcd, a condition in a HashStore), never longer than ``_POLL`` seconds or than its
decision's ``until``; it then reads again, so a lost wake-up costs at most ``_POLL`` seconds.
Old marker keys are deleted as the versions go by.

``DynamicRendezvousHandler`` is torchelastic's ``RendezvousHandler`` on it: ``next_rendezvous``
leaves the node's previous round and joins the next one (deadline ``join_timeout``); while the
node is a member a thread beats every ``keep_alive_interval`` seconds (and drops dead nodes);
``set_closed``/``shutdown`` close the rendezvous. Its clock and its way of waiting can be
replaced, so tests run it on a fake clock over a HashStore without sleeping (the heartbeat
thread only calls ``_keep_alive``, which a test calls itself).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ..._core import patience
from ..._core.deadline import Clock
from ..._core.errors import DistError, StoreTimeoutError
from ...store._api import Store
from ...store._prefix import PrefixStore
from ..events import NodeState, construct_and_record_rdzv_event
from . import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from ._state import (
    WRITES,
    Action,
    Op,
    Settings,
    State,
    Step,
    View,
    apply,
    blind,
    decide,
    nodes_waiting,
    observe,
)

if TYPE_CHECKING:
    from .dynamic_rendezvous import RendezvousBackend, RendezvousTimeout

__all__ = ["DynamicRendezvousHandler", "StateExecutor"]

log = logging.getLogger(__name__)

STATE_KEY = "state"
_POLL = 1.0  # the longest wait between two reads of the state (and two checks of should_stop)
_KEEP_MARKERS = 16  # change markers kept behind the current version
_local_ids = itertools.count()  # (several handlers in one process are several nodes)

Waiter = Callable[[list[str], float], None]


class StateExecutor:
    """Runs rendezvous operations for node ``me`` over the state in ``store`` (see the module).

    Args:
        store: where the state lives (its key ``state``, and the change markers).
        me: this node's name (ranks follow the names' sorted order).
        settings: this node's settings.
        describe: how errors name the rendezvous (``"c10d rendezvous of 'job'"``).
        clock: the monotonic clock that ``now`` and the deadlines are read on.
        wait: ``wait(keys, seconds)``: return when every key is set, or after ``seconds``
            (default: ``store.wait``, its timeout swallowed).
        should_stop: asked before each wait; True ends the operation with
            ``RendezvousClosedError`` (a launcher's signal).

    Not thread-safe: one operation at a time (the handler holds a lock).
    """

    def __init__(
        self,
        store: Store,
        me: str,
        settings: Settings,
        *,
        describe: str = "rendezvous",
        clock: Clock = time.monotonic,
        wait: Waiter | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store, self.me, self.settings, self.describe = store, me, settings, describe
        self._clock = clock
        self._wait = wait if wait is not None else self._store_wait
        self.should_stop = should_stop
        self.state = State.fresh(settings)
        self._raw = b""  # the state's bytes as last read or written: the compare-and-set's expectation
        self.view = View()
        self.conflicts = 0  # compare-and-sets lost to another node (for tests and logs)
        self.joined = 0  # the participants of the last incomplete round seen as a member (timeout message)
        self._timeout: float | None = None  # (what the deadline of the operation under way stands for)

    def _store_wait(self, keys: list[str], seconds: float) -> None:
        with contextlib.suppress(StoreTimeoutError):  # (the wait is bounded: its end is a poll)
            self.store.wait(keys, timedelta(seconds=seconds))

    def _seen(self, raw: bytes) -> None:
        """Take ``raw`` as the current state."""
        try:
            state = State.decode(raw) if raw else State.fresh(self.settings)
        except ValueError as exc:
            raise RendezvousStateError(f"{self.describe}: the state in the store is corrupt: {exc}") from exc
        self.state, self._raw = state, raw
        self.view = observe(self.view, state, self._clock())

    def _compare_set(self, expected: bytes, desired: bytes) -> bytes:
        """The store's compare-and-set of the state. One that took longer than a heartbeat
        interval (a stalled store, a fail-over to its standby) was time in which no node could
        beat: it does not count towards anyone's keep-alive timeout."""
        t0 = self._clock()
        current = self.store.compare_set(STATE_KEY, expected, desired)
        took = self._clock() - t0
        if took > self.settings.keep_alive_interval:
            self.view = blind(self.view, took)
        return current

    def refresh(self) -> State:
        """Read the state (one request: a compare-and-set that writes only to a missing key)."""
        fresh = State.fresh(self.settings).encode()
        self._seen(self._compare_set(b"", fresh))
        return self.state

    def step(self, op: Op, deadline: float) -> tuple[Action, bool]:
        """Decide on the state last read and act once: returns the action and whether a write
        it made won (False: another node's came first; the state now is the winner's).

        Raises:
            RendezvousClosedError: the rendezvous is closed (for a join).
            RendezvousGracefulExitError: it closed while this node was a spare (a join).
            RendezvousTimeoutError: ``deadline`` passed.
        """
        now = self._clock()
        state = self.state
        if self.me in state.participants and not state.complete:
            self.joined = len(state.participants)
        action = decide(op, state, self.view, self.me, now, deadline, self.settings)
        if action.step is Step.ERROR_CLOSED:
            raise RendezvousClosedError(f"the {self.describe} is closed")
        if action.step is Step.ERROR_GRACEFUL_EXIT:
            raise RendezvousGracefulExitError(
                f"the {self.describe} is closed while this node waited as a spare (the round was full): "
                "terminating pending rendezvous"
            )
        if action.step is Step.ERROR_TIMEOUT:
            raise RendezvousTimeoutError(self._timeout_message(op, self._timeout))
        if action.step not in WRITES:
            return action, False
        new = apply(state, action, self.me)
        data = new.encode()
        current = self._compare_set(self._raw, data)
        won = current == data
        if won:
            log.debug("%s: node %s: %s -> version %d (round %d)", self.describe, self.me, action.step.value, new.version, new.round)
            if action.step is Step.DROP:
                log.warning("%s: dropped nodes %s: no heartbeat for %g s", self.describe, sorted(action.nodes), self.settings.keep_alive_timeout)
            self._mark(new.version)
        else:
            self.conflicts += 1
            log.debug("%s: node %s: %s lost to another node's write; deciding again", self.describe, self.me, action.step.value)
        self._seen(current)
        return action, won

    def _mark(self, version: int) -> None:
        """Wake the nodes waiting for version ``version``; forget an old marker."""
        self.store.set(f"changed/{version}", b"")
        if version > _KEEP_MARKERS:
            self.store.delete_key(f"changed/{version - _KEEP_MARKERS}")

    def run(self, op: Op, deadline: float, timeout: float | None = None) -> State:
        """Run ``op`` until it is done, by ``deadline`` on this executor's clock (``timeout``:
        the seconds it stands for, for the error message); returns the state.

        Raises:
            RendezvousClosedError: the rendezvous is closed (a join), or ``should_stop``.
            RendezvousTimeoutError: ``deadline`` passed first.
            RendezvousStateError: the stored state is corrupt.
            DistError: the store failed.
        """
        self._timeout = timeout
        self.refresh()
        start = self._clock()
        words = patience.Words()
        while True:
            action, _ = self.step(op, deadline)
            if action.step is Step.FINISH:
                return self.state
            if action.step is Step.WAIT:
                if self.should_stop():
                    raise RendezvousClosedError(f"{self.describe}: interrupted")
                now = self._clock()
                if words.due(now - start):
                    self._say_what_it_waits_for(op, now - start, timeout)
                until = now + _POLL if action.until is None else min(action.until, now + _POLL)
                planned = max(0.001, until - now)
                self._wait([f"changed/{self.state.version + 1}"], planned)
                late = self._clock() - now - planned
                if late > self.settings.keep_alive_interval:  # (the store stalled: see _compare_set)
                    self.view = blind(self.view, late)
                self.refresh()

    def _say_what_it_waits_for(self, op: Op, waited: float, timeout: float | None) -> None:
        """A join that waits for 30 s for too few nodes to start a round is not silent: a
        warning says how many have joined (then every minute). A spare waiting for a round with
        room, or a round waiting out its last call, says nothing: they wait by design."""
        state = self.state
        if op is not Op.JOIN or state.complete or self.me not in state.participants or len(state.participants) >= state.min_nodes:
            return
        log.warning(
            "%s: %d of at least %d nodes joined round %d; waiting for more (%.0f s so far%s)",
            self.describe, len(state.participants), state.min_nodes, state.round, waited,
            "" if timeout is None else f"; the join times out after {timeout:g} s",
        )

    def _timeout_message(self, op: Op, timeout: float | None) -> str:
        state, within = self.state, "in time" if timeout is None else f"within {timeout:g} s"
        if op is Op.JOIN and self.joined:
            return f"{self.describe}: {self.joined} of at least {state.min_nodes} nodes joined {within}"
        if op is Op.JOIN:
            return (
                f"{self.describe}: round {state.round} is complete with {len(state.participants)} nodes (at most "
                f"{state.max_nodes}), and no next round took this node {within}"
            )
        return f"{self.describe}: node {self.me} could not {op.value} {within}"


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    """A time option of ``params`` in seconds (torch's keys; a float is fine)."""
    value = params.get(key, default)
    try:
        seconds = float(value.total_seconds() if isinstance(value, timedelta) else value)
    except (TypeError, ValueError):
        raise ValueError(f"The rendezvous configuration option '{key}' must be a number of seconds, got {value!r}.") from None
    if seconds < 0:
        raise ValueError(f"The rendezvous configuration option '{key}' must not be negative, got {seconds:g}.")
    return seconds


class DynamicRendezvousHandler(RendezvousHandler):
    """The c10d and etcd handlers (see the module): torchelastic's rendezvous over ``store``.

    Args:
        backend: the backend's name (``get_backend()``, and errors).
        params: the run id, the sizes and the options: ``join_timeout`` (600 s),
            ``last_call_timeout`` (30 s), ``close_timeout`` (30 s), ``heartbeat_timeout`` (5 s:
            one keep-alive), ``keep_alive_interval`` (3 s; torch's is 5: a dead node is then dropped within 10 s), ``keep_alive_max_attempt`` (3);
            ``local_addr``: the address rank 0 publishes as ``MASTER_ADDR``.
        store: where the state lives (the handler uses it as it is: give it a prefix of the job).
        first: this node's name sorts first, so it gets rank 0 when it is a participant (the
            node that hosts the store at the endpoint).
        server_port: the ``MASTER_PORT`` rank 0 publishes (default: a free port).
        on_shutdown: called once by ``shutdown`` (to release the store).
        on_beat: called after every heartbeat (the c10d handler keeps the store's standby).
        clock, wait: see ``StateExecutor``.
        round_store: the store whose prefix each round's nodes get (default: ``store``).

    Thread-safe: the operations and the heartbeat thread take turns.
    """

    def __init__(
        self,
        backend: str,
        params: RendezvousParameters,
        store: Store,
        *,
        first: bool = False,
        server_port: int | None = None,
        on_shutdown: Callable[[], None] | None = None,
        on_beat: Callable[[], None] | None = None,
        clock: Clock = time.monotonic,
        wait: Waiter | None = None,
        round_store: Store | None = None,
    ) -> None:
        keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
        self._settings = Settings(
            params.min_nodes, params.max_nodes, last_call=_seconds(params, "last_call_timeout", 30.0),
            keep_alive_interval=_seconds(params, "keep_alive_interval", 3.0),
            keep_alive_max_attempt=3 if keep_alive_max_attempt is None else keep_alive_max_attempt,
        )
        self._join_timeout = _seconds(params, "join_timeout", 600.0)
        self._close_timeout = _seconds(params, "close_timeout", 30.0)
        self._heartbeat_timeout = _seconds(params, "heartbeat_timeout", 5.0)
        self._backend, self._params, self._store = backend, params, store
        self._server_port, self._on_shutdown, self._clock = server_port, on_shutdown, clock
        self._on_beat = on_beat
        self._round_store = round_store
        host = params.local_addr or socket.gethostname()
        self._me = f"{0 if first else 1}/{host}/{os.getpid()}/{next(_local_ids)}"
        self._describe = f"{backend} rendezvous of {params.run_id!r}"
        self._exec = StateExecutor(
            store, self._me, self._settings, describe=self._describe, clock=clock, wait=wait,
            should_stop=lambda: self._should_stop(),
        )
        self._lock = threading.Lock()
        self._beating: tuple[threading.Event, threading.Thread] | None = None
        # (a launcher sets this to end a wait on a signal: checked at least once a second)
        self._should_stop: Callable[[], bool] = lambda: False
        self._in_round: tuple[int, int] | None = None  # (the round this node is in, its node count)

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: Store,
        backend: RendezvousBackend,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: float = 5,
        keep_alive_max_attempt: int = 3,
    ) -> DynamicRendezvousHandler:
        """torch's constructor: a handler whose state lives in ``backend`` (a
        ``RendezvousBackend``: ``get_state``/``set_state`` with a fencing token) and whose
        rounds share ``store`` (each round its prefix ``torch.rendezvous.<run_id>.<round>``).
        ``timeout``: a ``RendezvousTimeout`` (torch's defaults); ``keep_alive_interval`` in
        seconds (torch's default, 5). A node waiting for the state to change polls the backend
        (at least every 0.1 s)."""
        from .dynamic_rendezvous import RendezvousTimeout, _BackendStateStore

        timeout = timeout or RendezvousTimeout()
        params = RendezvousParameters(
            backend.name, "", run_id, min_nodes, max_nodes, local_addr,
            join_timeout=timeout.join.total_seconds(), last_call_timeout=timeout.last_call.total_seconds(),
            close_timeout=timeout.close.total_seconds(), heartbeat_timeout=timeout.heartbeat.total_seconds(),
            keep_alive_interval=keep_alive_interval, keep_alive_max_attempt=keep_alive_max_attempt,
        )
        state = _BackendStateStore(backend)
        return cls(backend.name, params, state, wait=state.wait_for_change, round_store=store)

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def node(self) -> str:
        """This node's name in the state."""
        return self._me

    def get_backend(self) -> str:
        return self._backend

    @property
    def round(self) -> int | None:
        """The round this node last joined (every node of it has the same), or None before one."""
        return None if self._in_round is None else self._in_round[0]

    @property
    def use_agent_store(self) -> bool:
        # (the workers get a store of their own: rank 0's MASTER_ADDR and MASTER_PORT)
        return False

    def get_run_id(self) -> str:
        return self._params.run_id

    def _run(self, op: Op, timeout: float, deadline: float | None = None) -> State:
        """Run ``op`` by ``deadline`` (default: ``timeout`` seconds from now), store errors
        translated."""
        try:
            with self._lock:
                return self._exec.run(op, self._clock() + timeout if deadline is None else deadline, timeout)
        except DistError as exc:
            raise RendezvousConnectionError(f"{self._describe}: {exc}") from exc

    def _read(self) -> State:
        try:
            with self._lock:
                return self._exec.refresh()
        except DistError as exc:
            raise RendezvousConnectionError(f"{self._describe}: {exc}") from exc

    def next_rendezvous(self) -> RendezvousInfo:
        """Leave this node's round (if it has one) and join the next; returns once it is
        complete. Rank 0 publishes ``MASTER_ADDR``/``MASTER_PORT`` in the round's store.

        Raises:
            RendezvousClosedError: the rendezvous is closed, or the wait was interrupted.
            RendezvousGracefulExitError: the rendezvous closed while this node waited as a
                spare (it came when the round was full; as torch's, a spare waits on past
                ``join_timeout`` for a member to go).
            RendezvousTimeoutError: no round took this node within ``join_timeout``.
            RendezvousConnectionError: the store failed.
            RendezvousStateError: the stored state is corrupt.
        """
        self._stop_heartbeats()
        deadline = self._clock() + self._join_timeout
        run_id = self._params.run_id
        try:
            self._run(Op.LEAVE, self._join_timeout, deadline)
            state = self._run(Op.JOIN, self._join_timeout, deadline)
        except Exception:  # (torch's rendezvous event; nothing is built unless a handler is set)
            construct_and_record_rdzv_event(run_id, f"node {self._me} could not join a round", NodeState.FAILED)
            raise
        rank, world_size, n = state.participants[self._me], len(state.participants), state.round
        construct_and_record_rdzv_event(
            run_id, f"node {self._me} joined round {n} as rank {rank} of {world_size}", NodeState.SUCCEEDED, rank=rank
        )
        self._in_round = (n, world_size)
        self._start_heartbeats()
        if self._on_beat is not None:
            self._on_beat()  # (at once: a node lost before the first beat is then handled too)
        log.info("%s: node %s is rank %d of %d in round %d", self._describe, self._me, rank, world_size, n)
        if self._round_store is None:
            store = PrefixStore(f"round{n}/user", self._store)
        else:  # (from_backend: the user's store, as torch's prefix)
            store = PrefixStore(f"torch.rendezvous.{run_id}.{n}", self._round_store)
        try:  # (in the round's store, as torch's: its MASTER_ADDR and MASTER_PORT keys)
            info = RendezvousStoreInfo.build(rank, store, self._params.local_addr, self._server_port)
        except DistError as exc:
            raise RendezvousConnectionError(f"{self._describe}: {exc}") from exc
        return RendezvousInfo(store, rank, world_size, info)

    def is_closed(self) -> bool:
        return self._read().closed

    def set_closed(self) -> None:
        """Close the rendezvous: every node's next (or waiting) ``next_rendezvous`` raises
        ``RendezvousClosedError``."""
        self._run(Op.CLOSE, self._close_timeout)

    def members_lost(self) -> bool:
        """Whether this node's round has lost members since it completed: a node left it (a
        scale-down) or was dropped (its heartbeat stood still), or the round moved on."""
        if self._in_round is None:
            return False
        n, size = self._in_round
        state = self._read()
        return state.round != n or len(state.participants) < size

    def num_nodes_waiting(self) -> int:
        """The nodes waiting to be admitted: in the wait list while the round has room (a
        member that opened the next round is one of them)."""
        return nodes_waiting(self._read())

    def _keep_alive(self) -> None:
        """Beat if due (and drop the dead nodes seen); failures are logged, not raised."""
        try:
            self._run(Op.KEEP_ALIVE, self._heartbeat_timeout)
        except Exception as exc:  # (the next beat tries again; the others drop this node if none lands)
            log.warning("%s: node %s could not send its heartbeat: %s", self._describe, self._me, exc)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self._settings.keep_alive_interval):
            self._keep_alive()
            if self._on_beat is not None:
                try:
                    self._on_beat()
                except Exception as exc:  # (the next beat tries again)
                    log.warning("%s: node %s: %s", self._describe, self._me, exc)

    def _start_heartbeats(self) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._beat, args=(stop,), name=f"tdist-rdzv-heartbeat-{self._params.run_id}", daemon=True)
        self._beating = (stop, thread)
        thread.start()

    def _stop_heartbeats(self) -> None:
        """Stop the heartbeat thread; a beat under way finishes first."""
        if self._beating is not None:
            stop, thread = self._beating
            self._beating = None
            stop.set()
            thread.join(self._heartbeat_timeout + _POLL)

    def _leave(self) -> None:
        """Stop beating and take this node out of its round or the wait list (a node that is
        giving up, without closing the rendezvous for the others); errors are logged."""
        self._stop_heartbeats()
        try:
            self._run(Op.LEAVE, self._close_timeout)
        except Exception as exc:  # (its heartbeat's expiry takes it out in the end)
            log.warning("%s: node %s could not leave the rendezvous: %s", self._describe, self._me, exc)

    def shutdown(self) -> bool:
        """Stop beating, close the rendezvous (as torch's: nodes still waiting get
        ``RendezvousClosedError``) and release what the handler holds; False when the close
        failed."""
        self._stop_heartbeats()
        closed = True
        try:
            self.set_closed()
        except Exception as exc:  # (RendezvousError, or a store already gone)
            log.warning("%s: node %s could not close the rendezvous: %s", self._describe, self._me, exc)
            closed = False
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None
        return closed
