"""Fault-tolerant training without restarts: ``Manager`` (see ``tdist.elastic.ft``).

Theory of operation. Every process of the job makes a ``Manager`` on one shared store (its
keys under ``prefix``). ``start()`` makes the process a candidate of the job's quorum
(``_quorum``: a state in one store key, changed by compare-and-set) and returns once a quorum
took it: the Manager then makes tdist's default process group for that quorum, on a key space
of its own (``PrefixStore("epoch<N>")``: nothing of an earlier group is read again), so
torch's default group (DDP, ``torch.distributed``) runs on it too; it hands the state to the
members that need it, then calls ``on_reconfigure``.

A training step runs inside ``with manager.step():`` (or ``run_step(fn)``). At its start the
members agree whether to re-form now: rank 0 reads how many times the quorum state was written
(and the state, if that moved), and a two-element ``all_reduce`` hands its verdict to every
member (nodes wait to join, or a member asked), with the count of members that are finishing
(``shutdown``). After every re-form the members agree again, so the next collective of every
member, a joiner's included, is that same one. A re-form for joiners costs no failure. When the step fails because the group did (a ``DistError``
anywhere in the exception's chain, or the group reports itself broken, as under DDP, which
wraps the error in a ``RuntimeError``), the member destroys its group at once (so every other
member's pending operation fails within milliseconds instead of waiting for a heartbeat),
names the peers the error named, and becomes a candidate of the next quorum with its committed
step; the others do the same as their own operations fail. The quorum forms as soon as every
member is back or known gone (``_quorum``); the survivors keep their processes, their Python
state and their model.

Consistency: a step is committed on a member when its body returned. A failure can end a step
on some members after others committed it (the last collective completed there); members
agree afterwards, not during the step: the new quorum knows every member's committed step,
and those behind the most advanced member receive its state (``heal_plan``), exactly as a
joiner does. So after every re-form all members hold the same state and the same step count;
a step that no member committed is lost (``step().committed`` is False: skip it, or call the
body again: ``run_step(fn, retries=N)``), one that some member committed counts as done
everywhere.

A joining process calls ``start()`` on the running job's store: it waits as a candidate until
the members, at a step boundary, see it and re-form with it; the member with the newest state
sends it over the new group's point-to-point messages (``_transfer``: received into the
joiner's own tensors where they fit), and the joiner takes part from the next step.

Every wait has a deadline: a re-form by ``timeout``, a join by ``join_timeout``; a member that
neither comes back nor is named by the others is left out ``rejoin_timeout`` seconds after
re-forming began. The store: a ``TCPStore`` client makes it the one part whose loss ends the
job; with a ``tdist.store.FailoverStore`` client, one member keeps a standby of the store's
server (``store._replica``, checked every ``_UPKEEP`` seconds by a thread of each Manager), which
takes over when the server's host is lost, and every member's client fails over to it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch

from .._core._process import pid_alive
from .._core.deadline import Clock
from .._core.errors import DistError, DistTimeoutError, PeerError, StoreTimeoutError
from ..c10d import _api as c10d
from ..store._api import Store
from ..store._prefix import PrefixStore
from ..store._replica import FailoverStore, StandbyKeeper
from ..transport._link import host_id
from . import _quorum as q
from ._transfer import recv_state, send_state

__all__ = ["Manager", "Quorum", "QuorumError", "StepOutcome", "job_store"]

log = logging.getLogger(__name__)

STATE_KEY = "state"
WRITES_KEY = "writes"  # how many times the state was written (read at every step boundary)
_POLL = 0.5  # the longest wait between two reads of the state (and two liveness checks)
_KEEP_MARKERS = 16  # change markers kept behind the current version
_UPKEEP = 2.0  # seconds between two looks at the store's standby (a FailoverStore)


class QuorumError(DistError):
    """No quorum can take this node: the job is over (its last member left), or every member
    of the job is gone, and its state with them (no live peer to receive it from)."""


@dataclass(frozen=True)
class Quorum:
    """A quorum this node is a member of, as ``on_reconfigure`` and ``Manager.quorum`` give it.

    Attributes:
        epoch: the quorum's number (1 for the job's first).
        rank, world_size: this node's rank and the quorum's size (the default group's).
        previous_world_size: the size of the quorum before (0 for the first this node is in).
        members: the members' names in rank order (``host:pid:tag``).
        lost: the members of the quorum before that this one left out.
        joined: the members new in this one (every member in the first).
        step: the committed step every member holds now.
        source: the rank that sent its state to the ranks behind (-1: nobody was behind).
        healed: the ranks that received it.
        seconds: how long forming took here, from the failure (or the decision) to the group
            being ready with every member's state in place.
        transfer: of which the state hand-over here (sending it, or receiving and loading it).
    """

    epoch: int
    rank: int
    world_size: int
    previous_world_size: int
    members: tuple[str, ...]
    lost: tuple[str, ...]
    joined: tuple[str, ...]
    step: int
    source: int
    healed: tuple[int, ...]
    seconds: float
    transfer: float = 0.0


@dataclass
class StepOutcome:
    """What became of one step (``with manager.step() as outcome``).

    Attributes:
        number: the committed step count when the step began (after any re-form at its start).
        committed: True: the step's update is in the state (this member ran it, or a member
            that did gave its state); False: no member committed it (lost; retry or skip it).
            None while the step runs.
        error: the failure that ended the step, if any.
        quorum: the quorum formed because of it, if any.
    """

    number: int
    committed: bool | None = None
    error: BaseException | None = None
    quorum: Quorum | None = None


def _pid_space() -> str:
    """Where pids mean the same thing: this host and boot, network and pid namespace."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{host_id()}|{ns}"


class _QuorumClient:
    """Runs quorum operations for node ``me`` over the state in ``store`` (``_quorum`` decides,
    this writes with compare-and-set and waits, as ``rendezvous._dynamic.StateExecutor``).
    Not thread-safe."""

    def __init__(self, store: Store, me: str, node: q.Node, settings: q.Settings, clock: Clock) -> None:
        self.store, self.me, self.node, self.settings, self._clock = store, me, node, settings, clock
        self.state = q.State.fresh(settings)
        self._fresh = self.state.encode()
        self._raw = b""
        self._writes = -1  # the count of writes when the state was last read
        self.view = q.View()

    def _seen(self, raw: bytes) -> None:
        try:
            self.state = q.State.decode(raw) if raw else q.State.fresh(self.settings)
        except ValueError as exc:
            raise QuorumError(f"fault-tolerant job: the quorum state in the store is corrupt: {exc}") from exc
        self._raw = raw
        self.view = q.observe(self.view, self.state, self._clock())

    def refresh(self) -> q.State:
        """Read the state (two requests: the count of writes first, then the state)."""
        self._writes = self.store.add(WRITES_KEY, 0)
        self._seen(self.store.compare_set(STATE_KEY, b"", self._fresh))
        return self.state

    def changed(self) -> bool:
        """Whether the state was written since this node last read it (one request: the
        count of writes, cheaper than reading the state)."""
        return self.store.add(WRITES_KEY, 0) != self._writes

    def _write(self, action: q.Action, req: q.Join | None = None, leaving: bool = False) -> bool:
        """Write the state ``action`` makes (compare-and-set); whether it won. ``leaving``: the
        marks that follow a won write are best effort (the member that serves the job's store
        after a fail-over may stop once it sees this node out of the state: this node's leave
        is done all the same)."""
        new = q.apply(self.state, action, self.me, req)
        data = new.encode()
        current = self.store.compare_set(STATE_KEY, self._raw, data)
        won = current == data
        if won:
            log.debug("ft: node %s: %s -> version %d (epoch %d)", self.me, action.step.value, new.version, new.epoch)
            try:
                self.store.set(f"changed/{new.version}", b"")
                self.store.add(WRITES_KEY, 1)
                if new.version > _KEEP_MARKERS:
                    self.store.delete_key(f"changed/{new.version - _KEEP_MARKERS}")
            except DistError as exc:
                if not leaving:
                    raise
                log.debug("ft: node %s: left; the marks after it did not go through: %s", self.me, exc)
        self._seen(current)
        return won

    def _dead_here(self) -> frozenset[str]:
        """The nodes of the state that run in this node's pid space and whose process is gone."""
        return frozenset(
            name for name, node in self.state.nodes.items()
            if name != self.me and node.space == self.node.space and not pid_alive(node.pid)
        )

    def _wait(self, until: float | None) -> None:
        now = self._clock()
        end = now + _POLL if until is None else min(until, now + _POLL)
        with contextlib.suppress(StoreTimeoutError):  # (a bounded wait: its end is a poll)
            self.store.wait([f"changed/{self.state.version + 1}"], timedelta(seconds=max(0.001, end - now)))
        self.refresh()

    def join(self, req: q.Join, deadline: float, timeout: float) -> q.State:
        """Be a member of a quorum newer than ``req.after``, by ``deadline``; returns the state
        in which it formed.

        Raises:
            QuorumError: the job is over, or its state is lost.
            DistTimeoutError: no quorum took this node by ``deadline`` (``timeout`` seconds).
        """
        self.refresh()
        while True:
            action = q.decide_join(self.state, self.view, self.me, req, self._dead_here(), self._clock(), deadline, self.settings)
            step = action.step
            if step is q.Step.FINISH:
                return self.state
            if step is q.Step.ERROR_CLOSED:
                raise QuorumError(f"fault-tolerant job: node {self.me} cannot join: {q.JOB_OVER}")
            if step is q.Step.ERROR_LOST:
                raise QuorumError(
                    f"fault-tolerant job: every member of quorum {self.state.epoch} "
                    f"({', '.join(self.state.members)}) is gone, and the job's state with them"
                )
            if step is q.Step.ERROR_TIMEOUT:
                raise DistTimeoutError(self._timeout_message(req, timeout))
            if step is q.Step.WAIT:
                self._wait(action.until)
                continue
            if step is q.Step.ACCUSE and action.nodes:
                log.warning("ft: node %s: found gone: %s", self.me, ", ".join(sorted(action.nodes)))
            self._write(action, req)

    def leave(self, deadline: float) -> None:
        """Take this node out of the quorum and the candidates (the last member out ends the job)."""
        self.refresh()
        while True:
            action = q.decide_leave(self.state, self.me, self._clock(), deadline)
            if action.step is q.Step.FINISH:
                return
            if action.step is q.Step.ERROR_TIMEOUT:
                raise DistTimeoutError(f"fault-tolerant job: node {self.me} could not leave in time")
            self._write(action, leaving=True)

    def _timeout_message(self, req: q.Join, timeout: float) -> str:
        state = self.state
        if state.epoch == 0:
            return (
                f"fault-tolerant job: node {self.me}: {len(state.candidates)} of at least {state.min_size} nodes came "
                f"within {timeout:g} s; the first quorum did not form"
            )
        waiting = [m for m in state.members if m not in state.candidates and m not in state.dead]
        if not any(m in state.candidates for m in state.members):
            return (
                f"fault-tolerant job: node {self.me}: the members of quorum {state.epoch} did not admit it within "
                f"{timeout:g} s (they admit nodes at a step boundary: is the job still training?)"
            )
        return (
            f"fault-tolerant job: node {self.me}: quorum {state.epoch + 1} did not form within {timeout:g} s: "
            f"waiting for {', '.join(waiting) or 'more nodes'} ({len(q.next_members(state))} of at least "
            f"{state.min_size} ready)"
        )


def job_store(timeout: float | timedelta = 60.0) -> Store:
    """The job's store for a ``Manager``, from the environment: under ``tdist run`` (``--ft``)
    the launcher's store (``TDIST_AGENT_STORE``), else ``MASTER_ADDR``:``MASTER_PORT``; a
    ``FailoverStore`` client, so that a member keeps a standby of its server.

    Raises:
        ValueError: neither is set, or the store is torch's own torchrun's.
        DistNetworkError: the store cannot be reached.
    """
    from ..store._rendezvous import _agent_is_torchs, _agent_store
    from ..store._replica import FailoverStore

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError("ft.job_store: no store in the environment (TDIST_AGENT_STORE under tdist run, or MASTER_ADDR "
                         "and MASTER_PORT)")
    host, number = _agent_store(addr, int(port)) or (addr, int(port))  # (tdist run: the launcher's)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _agent_is_torchs(host, number):
        raise ValueError(
            f"ft.job_store: the store at {host}:{number} is torchrun's (torch's C++ TCPStore), "
            "which a fault-tolerant job cannot use: start the job with `tdist run`"
        )
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return FailoverStore(host, number, timeout=timedelta(seconds=seconds))


class Manager:
    """A fault-tolerant training loop's view of its job: the quorum, the default process group
    made for it, the state hand-over (see the module).

    Args:
        store: a store every process of the job reaches: a ``TCPStore`` client (then it must
            outlive every process of the job), or a ``tdist.store.FailoverStore`` client (then
            a member keeps a standby of its server, and the job outlives the server's host).
        min_size: the fewest members the job trains with; a re-form waits for joiners below.
        max_size: the most members (None: no limit).
        initial_size: the first quorum forms as soon as this many processes started (default:
            ``max_size``); with fewer, ``last_call`` seconds after ``min_size`` came.
        state_dict: returns this process's state to hand over (nested dicts and lists of CPU
            tensors and picklable values: ``{"model": m.state_dict(), "optim":
            opt.state_dict()}``).
        load_state_dict: takes such a state received from a peer.
        on_reconfigure: called with the ``Quorum`` after every (re-)form, once the group is
            ready and the state in place: re-create DDP there, re-scale the learning rate.
        backend: the default group's backend (``"gloo"``: tdist's).
        timeout: the default group's timeout, and the deadline of a re-form (seconds or a
            ``timedelta``).
        join_timeout: how long ``start()`` waits to be admitted (seconds).
        last_call: how long the first quorum waits for more processes once ``min_size`` came.
        grace: how long a member named by another's error may take to come back.
        rejoin_timeout: how long a member nobody named may take to come back.
        check_every: steps between two checks for waiting joiners (1: every step).
        prefix: the key space of this job's quorum in ``store``.
        clock: the monotonic clock (tests).

    Thread-safety: use it from one thread (the training loop's).
    """

    def __init__(
        self,
        store: Store,
        *,
        min_size: int = 1,
        max_size: int | None = None,
        initial_size: int | None = None,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], object] | None = None,
        on_reconfigure: Callable[[Quorum], object] | None = None,
        backend: str = "gloo",
        timeout: float | timedelta = 60.0,
        join_timeout: float = 600.0,
        last_call: float = 5.0,
        grace: float = 1.0,
        rejoin_timeout: float = 30.0,
        check_every: int = 1,
        prefix: str = "tdist_ft",
        clock: Clock = time.monotonic,
    ) -> None:
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError("Manager: give both state_dict and load_state_dict, or neither")
        if check_every < 1:
            raise ValueError(f"Manager: check_every must be at least 1, got {check_every}")
        self._settings = q.Settings(
            min_size, max_size, initial_size, last_call=last_call, grace=grace, rejoin_timeout=rejoin_timeout
        )
        self._timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if self._timeout <= 0 or join_timeout <= 0:
            raise ValueError(f"Manager: timeouts must be positive, got timeout={self._timeout:g}, join_timeout={join_timeout:g}")
        self._join_timeout = float(join_timeout)
        self._store = PrefixStore(prefix, store)
        self._state_dict, self._load_state_dict, self._on_reconfigure = state_dict, load_state_dict, on_reconfigure
        self._backend, self._check_every, self._clock = backend, check_every, clock
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"
        self._client = _QuorumClient(self._store, self.name, q.Node(_pid_space(), os.getpid()), self._settings, clock)
        self._epoch = 0  # the last quorum this node was a member of
        self._members: tuple[str, ...] = ()
        self._step = -1  # committed steps (-1: no state yet)
        self._quorum: Quorum | None = None
        self._boundaries = 0
        self._flags = torch.zeros(2, dtype=torch.int32)
        self._state = "new"  # new -> running -> closed
        self._thread = threading.get_ident()
        # a FailoverStore: a member keeps the server's standby (checked by a thread of ours)
        self._keeper = StandbyKeeper(store, hosting=False) if isinstance(store, FailoverStore) else None
        self._upkeep_stop = threading.Event()

    # -- what the training loop reads ---------------------------------------------------------
    @property
    def rank(self) -> int:
        """This node's rank in the current quorum."""
        return self._require().rank

    @property
    def world_size(self) -> int:
        """The current quorum's size."""
        return self._require().world_size

    @property
    def epoch(self) -> int:
        """The current quorum's number."""
        return self._epoch

    @property
    def current_step(self) -> int:
        """The steps committed so far (the same on every member after each re-form)."""
        return max(self._step, 0)

    @property
    def quorum(self) -> Quorum | None:
        """The current quorum (None before ``start()``)."""
        return self._quorum

    def _require(self) -> Quorum:
        if self._quorum is None:
            raise RuntimeError("Manager: not started (call start() first)")
        return self._quorum

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> Quorum:
        """Join the job: wait until a quorum takes this process (the first one, or the running
        job's at its next step boundary), make the default group, receive the state if this
        process is behind, call ``on_reconfigure``.

        Raises:
            DistTimeoutError: no quorum took it within ``join_timeout``.
            QuorumError: the job is over, or its state is lost.
        """
        if self._state != "new":
            raise RuntimeError(f"Manager: start() called twice (node {self.name})")
        self._state = "running"
        if self._keeper is not None:
            self._keeper.settle()  # (every member knows the standby before the job starts)
            threading.Thread(target=self._upkeep, name="tdist-ft-standby", daemon=True).start()
        return self._reform(frozenset(), "start", self._clock())

    def _upkeep(self) -> None:
        assert self._keeper is not None
        while True:
            self._keeper.upkeep()
            if self._upkeep_stop.wait(_UPKEEP):
                break
        self._keeper.stop()

    def step(self) -> _StepContext:
        """A context manager around one training step (see the module): at its start the
        members re-form if nodes wait to join; a failure of the group inside it re-forms the
        quorum and is swallowed, and the outcome says whether the step's update is in the
        state. Other exceptions pass through."""
        if self._state != "running":
            raise RuntimeError(f"Manager: step() needs a started manager (node {self.name} is {self._state})")
        return _StepContext(self)

    def run_step(self, fn: Callable[[], object], retries: int = 0) -> bool:
        """Run ``fn`` as a step (``with self.step(): fn()``); after a failure that lost the
        step, run it again up to ``retries`` times (with the new quorum: ``fn`` reads
        ``rank``/``world_size`` again).

        Returns:
            Whether the step's update is in the state (False: it was lost ``retries + 1`` times).
        """
        for _ in range(retries + 1):
            with self.step() as outcome:
                fn()
            if outcome.committed:
                return True
        return False

    def reconfigure(self, reason: str = "asked") -> Quorum:
        """Form the next quorum now, with the same members and every node waiting to join
        (each member must call it at the same point of its loop)."""
        self._require()
        return self._reform(frozenset(), reason, self._clock())

    def shutdown(self) -> None:
        """Leave the job after its last step (every member calls it after the same step):
        agree with the other members (if the group fails, re-form first, so that a member
        behind gets the final state), destroy the default group, leave the quorum (the last
        member out ends the job; nodes still waiting to join get ``QuorumError``)."""
        if self._state != "running":
            self._state = "closed"
            return
        try:
            self._boundary(finishing=True)
        finally:
            self._state = "closed"
            self._teardown()
            deadline = self._clock() + self._timeout
            try:
                self._client.leave(deadline)
            except DistError as exc:
                log.warning("ft: node %s could not leave the quorum: %s", self.name, exc)
            else:
                self._serve_while_others_leave(deadline)
            self._upkeep_stop.set()

    def _serve_while_others_leave(self, deadline: float) -> None:
        """Where the job's store serves from this process (its standby took over from a lost
        server), the members still leaving need it: serve on until none is left (the last one
        out ends the job), or until ``deadline``. (Stopped at once, it took the store away from
        members that had not left yet: each spent its whole timeout failing to.)"""
        keeper = self._keeper
        standby = None if keeper is None else keeper.standby
        if standby is None or not standby.serving:
            return
        client = self._client
        try:  # (a member whose process is gone never leaves: not waited for)
            while set(client.state.members) - set(client.state.dead) - client._dead_here() and self._clock() < deadline:
                client._wait(deadline)
        except DistError as exc:
            log.warning("ft: node %s: serving the job's store until the others left: %s", self.name, exc)

    def __enter__(self) -> Manager:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self.shutdown()
        else:  # (leave without agreeing: the others see this process go)
            self._state = "closed"
            self._teardown()
            with contextlib.suppress(Exception):
                self._client.leave(self._clock() + 5.0)

    # -- inside a step ------------------------------------------------------------------------
    def _boundary(self, finishing: bool = False) -> None:
        """The agreement at a step's start (and at shutdown): one ``all_reduce(SUM)`` of two
        counters hands every member rank 0's verdict on re-forming (nodes wait to join, a
        member asked) and how many members are finishing. After every re-form the members
        agree again, so that the next collective of every member, the joiners' included, is
        this one."""
        self._boundaries += 1
        if not finishing and self._boundaries % self._check_every:
            return
        flags = self._flags
        while True:
            t0 = self._clock()
            flags.zero_()
            if self.rank == 0 and self._client.changed():
                flags[0] = int(q.should_reform(self._client.refresh(), self._epoch, self._members))
            flags[1] = int(finishing)
            try:
                c10d.all_reduce(flags)
            except Exception as exc:
                if not self._failed(exc)[0]:
                    raise
                self._recover(exc, t0)
                continue
            verdict, finishers = int(flags[0]), int(flags[1])
            if finishing:
                if finishers < self.world_size:
                    log.warning(
                        "ft: rank %d of %d: %d members are not finishing with this one: they go on without it",
                        self.rank, self.world_size, self.world_size - finishers,
                    )
                return
            if finishers:
                self._reform(frozenset(), f"{finishers} members finished", t0)
            elif verdict:
                self._reform(frozenset(), "nodes wait to join, or a member asked to re-form", t0)
            else:
                return

    def _failed(self, exc: BaseException) -> tuple[bool, frozenset[str]]:
        """Whether ``exc`` is a failure of the group, and the members it names."""
        peers: set[int] = set()
        failed = False
        todo, seen = [exc], set()
        broken = self._group_failure()
        if broken is not None:
            failed = True
            todo.append(broken)
        while todo:
            e = todo.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, DistError):
                failed = True
            if isinstance(e, PeerError) and isinstance(e.peer, int):
                peers.add(e.peer)
            todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        me = self._quorum.rank if self._quorum is not None else -1
        names = frozenset(self._members[p] for p in peers if 0 <= p < len(self._members) and p != me)
        return failed, names

    @staticmethod
    def _group_failure() -> BaseException | None:
        """The error that broke the default group, if it is broken (the backend keeps the
        first failure; DDP hands on only its text)."""
        if not c10d.is_initialized():
            return None
        try:
            backend = c10d._default_group()._get_backend()
        except Exception:
            return None
        err = getattr(backend, "_broken", None)
        if err is None:
            err = getattr(getattr(backend, "endpoint", None), "broken", None)
        return err if isinstance(err, BaseException) else None

    def _recover(self, exc: BaseException, t0: float | None) -> Quorum:
        _, named = self._failed(exc)
        # the failed step's finished frames let go of their locals (as unittest does): what
        # only they held goes now (an old DDP, whose reducer's hooks on the parameters would
        # otherwise fire in the next backward), not at the next garbage collection
        traceback.clear_frames(exc.__traceback__)
        log.warning(
            "ft: rank %d of %d (epoch %d, step %d): the group failed: %s; re-forming the quorum",
            self.rank, self.world_size, self._epoch, self.current_step, _first_line(exc),
        )
        return self._reform(named, "failure", self._clock() if t0 is None else t0)

    # -- forming ------------------------------------------------------------------------------
    def _teardown(self) -> None:
        """Destroy the default group (its peers' pending operations fail at once)."""
        if c10d.is_initialized():
            try:
                c10d.destroy_process_group()
            except Exception as exc:
                log.warning("ft: node %s: destroying the process group failed: %s", self.name, exc)

    def _reform(self, accuse: frozenset[str], reason: str, t0: float) -> Quorum:
        """Leave the current group, be a member of the next quorum, make its group (again, if a
        member fails while it forms)."""
        while True:
            self._teardown()
            member = self._epoch > 0
            timeout = self._timeout if member else self._join_timeout
            req = q.Join(self._epoch, self._step, self._client.node, accuse)
            state = self._client.join(req, self._clock() + timeout, timeout)
            try:
                return self._enter(state, t0)
            except Exception as exc:
                failed, accuse = self._failed(exc)
                if not failed:
                    raise
                log.warning("ft: node %s: quorum %d failed while forming: %s; again", self.name, state.epoch, _first_line(exc))

    def _enter(self, state: q.State, t0: float) -> Quorum:
        """Make quorum ``state.epoch``'s group, heal the members behind, tell the caller."""
        previous = self._members
        self._epoch, self._members = state.epoch, state.members
        rank, size = state.members.index(self.name), len(state.members)
        self._quorum = None
        c10d.init_process_group(
            self._backend, store=PrefixStore(f"epoch{state.epoch}", self._store), rank=rank, world_size=size,
            timeout=timedelta(seconds=self._timeout),
        )
        step, source, healed = q.heal_plan(state)
        t1 = transfer = self._clock()
        if healed and self._state_dict is not None and self._load_state_dict is not None:
            if rank == source:
                local = self._state_dict()
                nbytes = 0
                for h in healed:
                    nbytes = send_state(local, functools.partial(_send_to, h))
                log.info(
                    "ft: rank %d of %d: sent the state of step %d (%d MiB) to ranks %s in %.3f s",
                    rank, size, step, nbytes >> 20, list(healed), self._clock() - t1,
                )
            elif rank in healed:
                received = recv_state(lambda t: c10d.recv(t, source), self._state_dict())
                self._load_state_dict(received)
                log.info("ft: rank %d of %d: received the state of step %d from rank %d in %.3f s", rank, size, step, source, self._clock() - t1)
        transfer = self._clock() - t1
        self._step = step
        quorum = Quorum(
            epoch=state.epoch, rank=rank, world_size=size, previous_world_size=len(previous), members=state.members,
            lost=tuple(m for m in previous if m not in state.members), joined=tuple(m for m in state.members if m not in previous),
            step=step, source=source if healed else -1, healed=healed, seconds=self._clock() - t0, transfer=transfer,
        )
        self._quorum = quorum
        log.log(
            logging.WARNING if quorum.lost else logging.INFO,
            "ft: epoch %d: world size %d -> %d%s%s; this node (%s) is rank %d; step %d%s (%.3f s)",
            state.epoch, len(previous), size,
            f"; lost {', '.join(quorum.lost)}" if quorum.lost else "",
            f"; joined {', '.join(quorum.joined)}" if previous and quorum.joined else "",
            self.name, rank, step, f"; state from rank {source} to ranks {list(healed)}" if healed else "",
            quorum.seconds,
        )
        if self._on_reconfigure is not None:
            self._on_reconfigure(quorum)
        return quorum


class _StepContext:
    """``with manager.step() as outcome:`` (see ``Manager.step``)."""

    def __init__(self, manager: Manager) -> None:
        self._m = manager
        self.outcome = StepOutcome(manager.current_step)

    def __enter__(self) -> StepOutcome:
        self._m._boundary()
        self.outcome.number = self._m.current_step
        return self.outcome

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        m, outcome = self._m, self.outcome
        if exc is None:
            m._step = outcome.number + 1
            outcome.committed = True
            return False
        if not isinstance(exc, Exception) or not m._failed(exc)[0]:
            return False
        outcome.error = exc
        outcome.quorum = m._recover(exc, None)
        outcome.committed = m.current_step > outcome.number
        return True


def _send_to(dst: int, t: torch.Tensor) -> None:
    c10d.send(t, dst)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
