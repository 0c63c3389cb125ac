"""The rendezvous as data: the state the nodes share, and what one node does next (sans-IO).

Theory of operation. The nodes of a job share one record, ``State``, kept in one key of a store
and changed only by compare-and-set (``_dynamic``). A node runs an operation (``Op``: join,
leave, close, keep-alive) as a loop: read the state, ``decide`` what to do, ``apply`` it and
write the result, or wait for the state to change. ``decide`` and ``apply`` are pure: no I/O, no
clock of their own. That is what this module holds; the loop, the store and the clock are the
caller's.

A round gathers ``participants``. It completes at once when ``max_nodes`` have joined, or once
``min_nodes`` are in and a last call of ``Settings.last_call`` seconds has passed; completing it
gives the ranks: the sorted order of the participants' names (a handler makes names that sort
as it wants ranks: the same nodes get the same ranks round after round). A node that comes
while the round is complete goes to the ``wait_list``: the members open the next round (each
leaves the round and joins again: the last one out moves the state to the next round, which the
waiting nodes join too). ``closed`` ends the rendezvous for everybody.

Time. No clock is shared between hosts, so the shared state holds no time at all, only
counters; every time is the observing node's own monotonic clock (``now``), and deadlines are
points on it. Liveness: each node has a heartbeat in the state, the state's version at its last
beat (a number never reused), which it bumps every ``keep_alive_interval`` seconds. What a node
has seen, and when, is its ``View`` (kept locally, built by ``observe``): a heartbeat that has
not moved for ``keep_alive_interval * keep_alive_max_attempt`` seconds of the observer's clock
is a dead node's, and whoever sees that drops it (``Step.DROP``). The last call is timed the
same way, from when the observer first saw ``min_nodes`` in the round; the first node whose
last call ends completes the round. Clock skew between hosts therefore changes nothing; a node
only judges what it watched itself.

The state's ``version`` grows by one on every write: it is the fencing token that makes a
compare-and-set of a stale state fail (two identical states written one after another still
differ in it).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "Action",
    "Op",
    "Settings",
    "State",
    "Step",
    "View",
    "apply",
    "dead_nodes",
    "decide",
    "nodes_waiting",
    "observe",
]

ROLLBACK = 5.0  # seconds past a join's deadline in which a node still takes itself out


class Op(enum.Enum):
    """What a node is doing in the rendezvous."""

    JOIN = "join"  # be a participant of a complete round
    LEAVE = "leave"  # be in no round and no wait list (before joining the next round)
    CLOSE = "close"  # end the rendezvous for every node
    KEEP_ALIVE = "keep-alive"  # beat, if due


class Step(enum.Enum):
    """What ``decide`` tells a node to do now."""

    JOIN = "join"  # add me to the round's participants (which completes it at max_nodes)
    WAIT_LIST = "wait-list"  # the round is complete without me: wait for the next one
    COMPLETE = "complete"  # the last call is over: complete the round, give the ranks
    KEEP_ALIVE = "keep-alive"  # bump my heartbeat
    LEAVE = "leave"  # take me out of the participants, the wait list and the heartbeats
    DROP = "drop"  # take the dead nodes (``Action.nodes``) out
    CLOSE = "close"  # close the rendezvous
    WAIT = "wait"  # nothing to write: wait for the state to change, at most until ``Action.until``
    FINISH = "finish"  # the operation is done
    ERROR_CLOSED = "error-closed"  # the rendezvous is closed
    ERROR_GRACEFUL_EXIT = "error-graceful-exit"  # closed while I was a spare: leave without an error
    ERROR_TIMEOUT = "error-timeout"  # the operation's deadline passed


WRITES = frozenset({Step.JOIN, Step.WAIT_LIST, Step.COMPLETE, Step.KEEP_ALIVE, Step.LEAVE, Step.DROP, Step.CLOSE})


@dataclass(frozen=True)
class Action:
    """A decision: ``step``; for ``DROP`` the ``nodes`` to drop; for ``WAIT`` the time (on the
    observer's clock) after which the decision may differ even if the state does not change
    (a last call, a heartbeat, an expiry or the deadline; None: only a change of the state)."""

    step: Step
    nodes: frozenset[str] = frozenset()
    until: float | None = None


@dataclass(frozen=True)
class Settings:
    """One node's rendezvous settings (seconds; torch's defaults).

    Attributes:
        min_nodes, max_nodes: the size of a round (the state keeps those of the node that
            wrote it first, so every node goes by the same).
        last_call: how long a round with ``min_nodes`` waits for more.
        keep_alive_interval: how often a node beats.
        keep_alive_max_attempt: how many beats a node may miss before it counts as dead.
    """

    min_nodes: int
    max_nodes: int
    last_call: float = 30.0
    keep_alive_interval: float = 3.0
    keep_alive_max_attempt: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"rendezvous sizes: expected 1 <= min_nodes ({self.min_nodes}) <= max_nodes ({self.max_nodes})")
        if self.keep_alive_interval <= 0 or self.keep_alive_max_attempt < 1 or self.last_call < 0:
            raise ValueError(
                f"rendezvous timing: keep_alive_interval ({self.keep_alive_interval:g} s) must be positive, "
                f"keep_alive_max_attempt ({self.keep_alive_max_attempt}) at least 1, last_call "
                f"({self.last_call:g} s) not negative"
            )

    @property
    def keep_alive_timeout(self) -> float:
        """How long a heartbeat may stand still before its node counts as dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass(frozen=True)
class State:
    """The rendezvous as every node sees it (immutable: ``apply`` makes a new one).

    Attributes:
        version: the fencing token: one more on every write.
        round: the current round.
        complete: whether the current round is complete (its ranks are given).
        closed: whether the rendezvous is over.
        min_nodes, max_nodes: the size of a round.
        participants: the round's nodes, in the order they joined, with their ranks (-1 until
            the round is complete).
        wait_list: the nodes waiting for the next round.
        heartbeats: every node in the round or the wait list, with the version at its last beat.
    """

    version: int = 0
    round: int = 0
    complete: bool = False
    closed: bool = False
    min_nodes: int = 1
    max_nodes: int = 1
    participants: Mapping[str, int] = field(default_factory=dict)
    wait_list: tuple[str, ...] = ()
    heartbeats: Mapping[str, int] = field(default_factory=dict)

    @staticmethod
    def fresh(settings: Settings) -> State:
        """The state before any node wrote one."""
        return State(min_nodes=settings.min_nodes, max_nodes=settings.max_nodes)

    def encode(self) -> bytes:
        """The state as stored (JSON: readable with any store client)."""
        return json.dumps(
            {
                "version": self.version, "round": self.round, "complete": self.complete, "closed": self.closed,
                "min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "participants": [[node, rank] for node, rank in self.participants.items()],
                "wait_list": list(self.wait_list), "heartbeats": dict(self.heartbeats),
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(data: bytes) -> State:
        """The state ``encode`` wrote.

        Raises:
            ValueError: ``data`` is not one (the message quotes its start).
        """
        try:
            raw: dict[str, Any] = json.loads(data)
            state = State(
                version=int(raw["version"]), round=int(raw["round"]), complete=bool(raw["complete"]),
                closed=bool(raw["closed"]), min_nodes=int(raw["min_nodes"]), max_nodes=int(raw["max_nodes"]),
                participants={str(node): int(rank) for node, rank in raw["participants"]},
                wait_list=tuple(str(node) for node in raw["wait_list"]),
                heartbeats={str(node): int(beat) for node, beat in raw["heartbeats"].items()},
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a rendezvous state: {data[:80]!r} ({exc})") from None
        return state


@dataclass(frozen=True)
class View:
    """What one node has seen of the state, and when, on its own monotonic clock.

    Attributes:
        beats: each node's heartbeat as last seen, with when it was first seen at that value.
        quorum: (round, since): when this node first saw that round, incomplete, with at least
            ``min_nodes`` participants (its last call runs from there); None otherwise.
    """

    beats: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    quorum: tuple[int, float] | None = None


def observe(view: View, state: State, now: float) -> View:
    """``view`` updated with ``state``, seen at ``now``."""
    beats = {}
    for node, beat in state.heartbeats.items():
        seen = view.beats.get(node)
        beats[node] = seen if seen is not None and seen[0] == beat else (beat, now)
    quorum = None
    if not state.complete and len(state.participants) >= state.min_nodes:
        quorum = view.quorum if view.quorum is not None and view.quorum[0] == state.round else (state.round, now)
    return View(beats, quorum)


def blind(view: View, seconds: float) -> View:
    """``view`` after ``seconds`` in which this node could not look at the state (its store
    stalled or failed over): nobody could beat then either, so that time is nobody's silence."""
    return View({node: (beat, since + seconds) for node, (beat, since) in view.beats.items()}, view.quorum)


def dead_nodes(state: State, view: View, me: str, now: float, settings: Settings) -> frozenset[str]:
    """The nodes (never ``me``) whose heartbeat has stood still for the keep-alive timeout."""
    timeout = settings.keep_alive_timeout
    return frozenset(
        node for node, (beat, since) in view.beats.items()
        if node != me and state.heartbeats.get(node) == beat and now - since >= timeout
    )


def nodes_waiting(state: State) -> int:
    """The nodes waiting for a round that has room for them (0 while the round is full: they
    are spares, that come in when a member goes)."""
    return len(state.wait_list) if len(state.participants) < state.max_nodes else 0


def decide(op: Op, state: State, view: View, me: str, now: float, deadline: float, settings: Settings) -> Action:
    """What node ``me`` does next in ``op``, given the ``state``, what it has seen (``view``,
    observed at ``now`` or before), the monotonic time ``now`` and the operation's
    ``deadline`` (on the same clock)."""
    if op is Op.JOIN:
        return _join(state, view, me, now, deadline, settings)
    if op is Op.LEAVE:
        if me not in state.participants and me not in state.wait_list:
            return Action(Step.FINISH)
        return Action(Step.ERROR_TIMEOUT) if now >= deadline else Action(Step.LEAVE)
    if op is Op.CLOSE:
        if state.closed:
            return Action(Step.FINISH)
        return Action(Step.ERROR_TIMEOUT) if now >= deadline else Action(Step.CLOSE)
    # Op.KEEP_ALIVE: a member beats, and drops the dead it sees
    if me not in state.heartbeats or not _beat_due(view, me, now, settings):
        return Action(Step.FINISH)
    if now >= deadline:
        return Action(Step.ERROR_TIMEOUT)
    dead = dead_nodes(state, view, me, now, settings)
    return Action(Step.DROP, dead) if dead else Action(Step.KEEP_ALIVE)


def _beat_due(view: View, me: str, now: float, settings: Settings) -> bool:
    seen = view.beats.get(me)
    return seen is not None and now - seen[1] >= settings.keep_alive_interval


def _join(state: State, view: View, me: str, now: float, deadline: float, settings: Settings) -> Action:
    member = me in state.participants
    # a spare: waiting while the round is full (torch's redundancy list). As torch's, it waits
    # on past its deadline, for a member to go; a close lets it go without an error.
    spare = state.complete and not member and me in state.wait_list and len(state.participants) >= state.max_nodes
    if state.closed:
        return Action(Step.ERROR_GRACEFUL_EXIT if spare else Step.ERROR_CLOSED)
    if member and state.complete:
        return Action(Step.FINISH)
    if now >= deadline and not spare:
        # take myself out while there is time (else my heartbeat's expiry will)
        if (member or me in state.wait_list) and now < deadline + ROLLBACK:
            return Action(Step.LEAVE)
        return Action(Step.ERROR_TIMEOUT)
    dead = dead_nodes(state, view, me, now, settings)
    if dead:
        return Action(Step.DROP, dead)
    last_call_ends: float | None = None
    if state.complete:
        if me not in state.wait_list:
            return Action(Step.WAIT_LIST)
    elif not member:
        return Action(Step.JOIN)
    elif view.quorum is not None:  # (a member of a round with min_nodes: the last call runs)
        last_call_ends = view.quorum[1] + settings.last_call
        if now >= last_call_ends:
            return Action(Step.COMPLETE)
    if _beat_due(view, me, now, settings):
        return Action(Step.KEEP_ALIVE)
    # nothing to do until the state changes, or until the first of these times
    times = [*([] if spare else [deadline]), *(since + settings.keep_alive_timeout for node, (_, since) in view.beats.items() if node != me)]
    if me in view.beats:
        times.append(view.beats[me][1] + settings.keep_alive_interval)
    if last_call_ends is not None:
        times.append(last_call_ends)
    return Action(Step.WAIT, until=min(times) if times else None)


def apply(state: State, action: Action, me: str) -> State:
    """The state after node ``me`` took ``action`` (a writing step) on it; its version is one more.

    Raises:
        ValueError: ``action`` writes nothing (``WAIT``, ``FINISH``, an error).
    """
    if action.step not in WRITES:
        raise ValueError(f"{action.step.value} does not change the rendezvous state")
    version = state.version + 1
    participants, wait_list, heartbeats = dict(state.participants), list(state.wait_list), dict(state.heartbeats)
    complete, closed, round_ = state.complete, state.closed, state.round
    step = action.step
    if step in (Step.JOIN, Step.WAIT_LIST, Step.KEEP_ALIVE):
        heartbeats[me] = version
    if step is Step.JOIN:
        if me in wait_list:
            wait_list.remove(me)
        participants[me] = -1
        complete = len(participants) >= state.max_nodes
    elif step is Step.WAIT_LIST:
        if me not in wait_list:
            wait_list.append(me)
    elif step is Step.COMPLETE:
        complete = True
    elif step is Step.CLOSE:
        closed = True
    elif step in (Step.LEAVE, Step.DROP):
        gone = {me} if step is Step.LEAVE else action.nodes
        had = len(participants)
        for node in gone:
            participants.pop(node, None)
            heartbeats.pop(node, None)
        wait_list = [node for node in wait_list if node not in gone]
        if complete and had and not participants:  # the last member left: the next round opens
            complete, round_ = False, round_ + 1
    if complete and (step is Step.COMPLETE or step is Step.JOIN):
        ranks = {node: rank for rank, node in enumerate(sorted(participants))}
        participants = {node: ranks[node] for node in participants}
    return replace(
        state, version=version, round=round_, complete=complete, closed=closed,
        participants=participants, wait_list=tuple(wait_list), heartbeats=heartbeats,
    )
