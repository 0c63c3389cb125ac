"""The quorum of a fault-tolerant job as data: who trains together, and what a node does next
to get into the next quorum (sans-IO).

Theory of operation. The nodes of a job share one record, ``State``, kept in one key of a
store and changed only by compare-and-set with the state's ``version`` as the fencing token
(``_ft`` runs the loop: read, ``decide_join``/``decide_leave``, ``apply`` and write, or wait for
the state to change). This is the rendezvous's design (``rendezvous._state``); its state
machine is not reused as it stands because a round there completes at ``max_nodes`` or after a
last call, while a quorum that lost a rank must complete the moment every *surviving* member
is back, without a last call and without waiting for a heartbeat to expire; and it must carry
each node's committed step so that the nodes that are behind can be healed from one that is
not. The heartbeats, the ``View`` of what this node saw when, and the pure ``decide``/
``apply`` pair keep the rendezvous's meaning.

A quorum is numbered by its ``epoch`` (0: none yet) and lists its ``members`` in rank order.
A node that wants to be in the next quorum is a ``candidate``, with its committed step (``-1``:
it has no state yet). The first quorum forms as a rendezvous round: at once with ``max_size``
candidates, or ``last_call`` seconds after the observer first saw ``min_size``. Every later
quorum forms when each member of the current one is a candidate again or is gone, and it keeps
the members that came back in their order, then the new candidates in the order they came
(up to ``max_size``; at least ``min_size``). Members train while no quorum is forming: a
candidate that is not a member waits until the members, checking at a step boundary, see it
(``should_reform``) and come back themselves.

A member is gone when it is ``dead`` (a node on the same host found its process gone: proof),
``suspected`` for ``grace`` seconds (another node's error named it: a rank that relayed an
abort is named as well, and gets ``grace`` seconds to come back), or, once re-forming began,
when it has neither come back nor been named for ``rejoin_timeout`` seconds. A candidate that
is waiting beats every ``keep_alive_interval``; one whose heartbeat stood still for
``keep_alive_interval * keep_alive_max_attempt`` seconds, or whose process is gone, is taken
out. A node left out of a quorum (suspected wrongly, or too late) is a candidate of the next
one, and heals from a member like any joiner.

Time: as in the rendezvous, the shared state holds no time, only counters; every time is the
observing node's own monotonic clock, kept in its ``View``.

If every member of the current quorum is gone, the job's state is gone with it: candidates get
``ERROR_LOST`` rather than a quorum that would start training again from nothing. When the last
member leaves (``decide_leave``), the job is over: ``closed``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "Action",
    "Join",
    "Node",
    "Settings",
    "State",
    "Step",
    "View",
    "apply",
    "decide_join",
    "decide_leave",
    "heal_plan",
    "next_members",
    "observe",
    "should_reform",
]


#: what a ``QuorumError`` says when the job had ended (``tdist run --ft`` reads it in the last
#: lines of a worker started again: it came too late, which is no failure of the job)
JOB_OVER = "the job is over (its last member left)"

class Step(enum.Enum):
    """What a decision tells a node to do now."""

    JOIN = "join"  # be a candidate of the next quorum (with my step and where I run)
    BEAT = "beat"  # bump my heartbeat (a waiting candidate)
    ACCUSE = "accuse"  # record nodes as gone (``Action.nodes``) or suspected (``Action.suspects``)
    COMPLETE = "complete"  # form the next quorum (``next_members``)
    LEAVE = "leave"  # take me out of the quorum and the candidates
    WAIT = "wait"  # nothing to write: wait for a change, at most until ``Action.until``
    FINISH = "finish"  # the operation is done
    ERROR_CLOSED = "error-closed"  # the job is over
    ERROR_TIMEOUT = "error-timeout"  # the operation's deadline passed
    ERROR_LOST = "error-lost"  # every member is gone, and the job's state with them


WRITES = frozenset({Step.JOIN, Step.BEAT, Step.ACCUSE, Step.COMPLETE, Step.LEAVE})


@dataclass(frozen=True)
class Action:
    """A decision: ``step``; for ``ACCUSE`` the ``nodes`` found gone and the ``suspects``; for
    ``WAIT`` the time (observer's clock) after which the decision may differ even if the
    state does not (None: only a change of the state)."""

    step: Step
    nodes: frozenset[str] = frozenset()
    suspects: frozenset[str] = frozenset()
    until: float | None = None


@dataclass(frozen=True)
class Settings:
    """One node's quorum settings (seconds).

    Attributes:
        min_size: the fewest members a quorum may have.
        max_size: the most (None: no limit; the state keeps the first writer's sizes).
        initial_size: the first quorum forms at once with this many candidates (default:
            ``max_size``).
        last_call: how long the first quorum waits for more candidates once it has
            ``min_size`` (it forms at once with ``initial_size``).
        grace: how long a suspected member may take to come back before it is left out.
        rejoin_timeout: how long a member that nobody named may take to come back once
            re-forming began.
        keep_alive_interval: how often a waiting candidate beats.
        keep_alive_max_attempt: how many beats a candidate may miss before it is taken out.
    """

    min_size: int = 1
    max_size: int | None = None
    initial_size: int | None = None
    last_call: float = 5.0
    grace: float = 1.0
    rejoin_timeout: float = 30.0
    keep_alive_interval: float = 1.0
    keep_alive_max_attempt: int = 5

    def __post_init__(self) -> None:
        if self.min_size < 1 or (self.max_size is not None and self.max_size < self.min_size):
            raise ValueError(f"quorum sizes: expected 1 <= min_size ({self.min_size}) <= max_size ({self.max_size})")
        if self.initial_size is not None and not (
            self.min_size <= self.initial_size and (self.max_size is None or self.initial_size <= self.max_size)
        ):
            raise ValueError(
                f"quorum sizes: expected min_size ({self.min_size}) <= initial_size ({self.initial_size}) <= "
                f"max_size ({self.max_size})"
            )
        if min(self.last_call, self.grace, self.rejoin_timeout) < 0 or self.keep_alive_interval <= 0 or self.keep_alive_max_attempt < 1:
            raise ValueError(
                f"quorum timing: last_call ({self.last_call:g} s), grace ({self.grace:g} s) and rejoin_timeout "
                f"({self.rejoin_timeout:g} s) must not be negative, keep_alive_interval ({self.keep_alive_interval:g} s) "
                f"must be positive, keep_alive_max_attempt ({self.keep_alive_max_attempt}) at least 1"
            )

    @property
    def keep_alive_timeout(self) -> float:
        """How long a candidate's heartbeat may stand still before it is taken out."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass(frozen=True)
class Node:
    """Where a node runs: its process id and the id of the pid space it is valid in (host,
    boot and namespaces), so that nodes of the same space can tell whether it still runs."""

    space: str
    pid: int


@dataclass(frozen=True)
class State:
    """The quorum as every node sees it (immutable: ``apply`` makes a new one).

    Attributes:
        version: the fencing token: one more on every write.
        epoch: the current quorum's number (0: none formed yet).
        closed: whether the job is over.
        min_size, max_size, initial_size: the quorum's sizes (the first writer's).
        members: the current quorum, in rank order.
        steps: each member's committed step when the quorum formed (-1: no state).
        lost: the members of the previous quorum that this one left out.
        candidates: the nodes that want to be in the next quorum, in the order they came, with
            their committed steps.
        dead: members found gone since the quorum formed.
        suspects: members named by another node's error since the quorum formed.
        nodes: where every member and candidate runs.
        beats: each candidate's heartbeat: the version at its last beat.
    """

    version: int = 0
    epoch: int = 0
    closed: bool = False
    min_size: int = 1
    max_size: int | None = None
    initial_size: int | None = None
    members: tuple[str, ...] = ()
    steps: Mapping[str, int] = field(default_factory=dict)
    lost: tuple[str, ...] = ()
    candidates: Mapping[str, int] = field(default_factory=dict)
    dead: tuple[str, ...] = ()
    suspects: tuple[str, ...] = ()
    nodes: Mapping[str, Node] = field(default_factory=dict)
    beats: Mapping[str, int] = field(default_factory=dict)

    @staticmethod
    def fresh(settings: Settings) -> State:
        """The state before any node wrote one."""
        initial = settings.initial_size if settings.initial_size is not None else settings.max_size
        return State(min_size=settings.min_size, max_size=settings.max_size, initial_size=initial)

    def encode(self) -> bytes:
        """The state as stored (JSON: readable with any store client)."""
        return json.dumps(
            {
                "version": self.version, "epoch": self.epoch, "closed": self.closed,
                "min_size": self.min_size, "max_size": self.max_size, "initial_size": self.initial_size,
                "members": list(self.members),
                "steps": dict(self.steps), "lost": list(self.lost),
                "candidates": [[node, step] for node, step in self.candidates.items()],
                "dead": list(self.dead), "suspects": list(self.suspects),
                "nodes": {name: [n.space, n.pid] for name, n in self.nodes.items()}, "beats": dict(self.beats),
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
            max_size, initial = raw["max_size"], raw["initial_size"]
            return State(
                version=int(raw["version"]), epoch=int(raw["epoch"]), closed=bool(raw["closed"]),
                min_size=int(raw["min_size"]), max_size=None if max_size is None else int(max_size),
                initial_size=None if initial is None else int(initial),
                members=tuple(str(m) for m in raw["members"]),
                steps={str(m): int(s) for m, s in raw["steps"].items()},
                lost=tuple(str(m) for m in raw["lost"]),
                candidates={str(n): int(s) for n, s in raw["candidates"]},
                dead=tuple(str(m) for m in raw["dead"]), suspects=tuple(str(m) for m in raw["suspects"]),
                nodes={str(name): Node(str(space), int(pid)) for name, (space, pid) in raw["nodes"].items()},
                beats={str(n): int(b) for n, b in raw["beats"].items()},
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a quorum state: {data[:80]!r} ({exc})") from None


@dataclass(frozen=True)
class View:
    """What one node has seen of the state, and when, on its own monotonic clock.

    Attributes:
        beats: each candidate's heartbeat as last seen, with when it was first seen at that value.
        suspects: when each suspect was first seen named.
        reform: (epoch, since): when this node first saw a member of quorum ``epoch`` among the
            candidates (re-forming began); None otherwise.
        first: when this node first saw ``min_size`` candidates before the first quorum (the
            last call runs from there); None otherwise.
    """

    beats: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    suspects: Mapping[str, float] = field(default_factory=dict)
    reform: tuple[int, float] | None = None
    first: float | None = None


@dataclass(frozen=True)
class Join:
    """A node's request to be in a quorum newer than ``after``.

    Attributes:
        after: the last quorum this node was a member of (0: none).
        step: its committed step (-1: it has no state yet).
        node: where it runs.
        accuse: the members of quorum ``after`` that the error which ended it named.
    """

    after: int
    step: int
    node: Node
    accuse: frozenset[str] = frozenset()


def observe(view: View, state: State, now: float) -> View:
    """``view`` updated with ``state``, seen at ``now``."""
    beats = {}
    for node, beat in state.beats.items():
        seen = view.beats.get(node)
        beats[node] = seen if seen is not None and seen[0] == beat else (beat, now)
    suspects = {node: view.suspects.get(node, now) for node in state.suspects}
    reform = None
    if state.epoch >= 1 and any(m in state.candidates for m in state.members):
        reform = view.reform if view.reform is not None and view.reform[0] == state.epoch else (state.epoch, now)
    first = None
    if state.epoch == 0 and len(state.candidates) >= state.min_size:
        first = view.first if view.first is not None else now
    return View(beats, suspects, reform, first)


def next_members(state: State) -> tuple[str, ...]:
    """The members the next quorum would have: the current members that are candidates, in
    their order, then the other candidates in the order they came; at most ``max_size``."""
    back = [m for m in state.members if m in state.candidates]
    new = back + [n for n in state.candidates if n not in state.members]
    return tuple(new if state.max_size is None else new[: state.max_size])


def should_reform(state: State, epoch: int, members: tuple[str, ...]) -> bool:
    """Whether the members of quorum ``epoch`` (who saw ``members``) should form the next one
    now: one of them asked for it (it is a candidate, or left), the quorum moved on without
    them, or candidates wait and there is room for them."""
    if state.closed:
        return False
    if state.epoch != epoch or state.members != members:
        return True
    if any(m in state.candidates for m in members):
        return True
    room = state.max_size is None or len(members) < state.max_size
    return room and any(n not in members for n in state.candidates)


def _stale(state: State, view: View, me: str, now: float, settings: Settings) -> frozenset[str]:
    """The candidates (never ``me``) whose heartbeat stood still for the keep-alive timeout."""
    timeout = settings.keep_alive_timeout
    return frozenset(
        node for node, (beat, since) in view.beats.items()
        if node != me and node in state.candidates and state.beats.get(node) == beat and now - since >= timeout
    )


def decide_join(
    state: State, view: View, me: str, req: Join, dead: frozenset[str], now: float, deadline: float, settings: Settings
) -> Action:
    """What node ``me`` does next to be in a quorum newer than ``req.after``.

    Args:
        state: the state last read; view: what this node saw of it (``observe``).
        me: this node's name; req: its request.
        dead: the nodes this node found gone (their processes, in its own pid space).
        now: the monotonic time; deadline: the operation's deadline on the same clock.
        settings: this node's settings.
    """
    if state.closed:
        return Action(Step.ERROR_CLOSED)
    if state.epoch > req.after and me in state.members:
        return Action(Step.FINISH)
    if now >= deadline:
        return Action(Step.ERROR_TIMEOUT)
    # evidence first: what is gone, what this node's error named
    known = set(state.members) | set(state.candidates)
    gone = (dead & known) - set(state.dead) - {me}
    gone |= _stale(state, view, me, now, settings)
    accuse: frozenset[str] = frozenset()
    if state.epoch == req.after:
        accuse = req.accuse & set(state.members) - set(state.suspects) - set(state.dead) - set(state.candidates) - {me}
    if gone or accuse:
        return Action(Step.ACCUSE, nodes=frozenset(gone), suspects=accuse)
    if me not in state.candidates:
        return Action(Step.JOIN)
    times = [deadline]
    ready, until, lost = _ready(state, view, now, settings)
    if lost:
        return Action(Step.ERROR_LOST)
    if ready:
        return Action(Step.COMPLETE)
    if until is not None:
        times.append(until)
    beat = view.beats.get(me)
    if beat is not None:
        if now - beat[1] >= settings.keep_alive_interval:
            return Action(Step.BEAT)
        times.append(beat[1] + settings.keep_alive_interval)
    times.extend(since + settings.keep_alive_timeout for node, (_, since) in view.beats.items() if node != me)
    return Action(Step.WAIT, until=min(times))


def _ready(state: State, view: View, now: float, settings: Settings) -> tuple[bool, float | None, bool]:
    """Whether the next quorum can form now; if not, the time at which that may change (None:
    only a change of the state); and whether it never can (every member gone)."""
    if state.epoch == 0:
        n = len(state.candidates)
        if state.initial_size is not None and n >= state.initial_size:
            return True, None, False
        if n < state.min_size or view.first is None:
            return False, None, False
        ends = view.first + settings.last_call
        return now >= ends, ends, False
    # every member not back must be gone: the latest time one of them counts as gone
    latest = float("-inf")
    for m in state.members:
        if m in state.candidates or m in state.dead:
            continue
        at = _gone_at(state, view, m, settings)
        if at is None:
            return False, None, False  # (the members train: they come at a step boundary)
        latest = max(latest, at)
    if now < latest:
        return False, latest, False
    if not any(m in state.candidates for m in state.members):
        return False, None, True
    if len(next_members(state)) < state.min_size:
        return False, None, False  # wait for more candidates
    return True, None, False


def _gone_at(state: State, view: View, member: str, settings: Settings) -> float | None:
    """When ``member`` (not back, not dead) counts as gone: ``grace`` after it was first seen
    suspected, or ``rejoin_timeout`` after re-forming began; None: neither applies."""
    times = []
    since = view.suspects.get(member)
    if since is not None:
        times.append(since + settings.grace)
    if view.reform is not None and view.reform[0] == state.epoch:
        times.append(view.reform[1] + settings.rejoin_timeout)
    return min(times) if times else None


def decide_leave(state: State, me: str, now: float, deadline: float) -> Action:
    """What node ``me`` does next to leave the job (the quorum and the candidates)."""
    if me not in state.members and me not in state.candidates:
        return Action(Step.FINISH)
    return Action(Step.ERROR_TIMEOUT) if now >= deadline else Action(Step.LEAVE)


def apply(state: State, action: Action, me: str, req: Join | None = None) -> State:
    """The state after node ``me`` took ``action`` (a writing step; ``JOIN`` needs ``req``);
    its version is one more.

    Raises:
        ValueError: ``action`` writes nothing, or a ``JOIN`` without ``req``.
    """
    if action.step not in WRITES:
        raise ValueError(f"{action.step.value} does not change the quorum state")
    version = state.version + 1
    step = action.step
    candidates, nodes, beats = dict(state.candidates), dict(state.nodes), dict(state.beats)
    if step is Step.JOIN:
        if req is None:
            raise ValueError("a join needs the node's request")
        candidates[me] = req.step
        nodes[me] = req.node
        beats[me] = version
        return replace(state, version=version, candidates=candidates, nodes=nodes, beats=beats)
    if step is Step.BEAT:
        beats[me] = version
        return replace(state, version=version, beats=beats)
    if step is Step.ACCUSE:
        dead = list(state.dead)
        for node in action.nodes:
            candidates.pop(node, None)
            beats.pop(node, None)
            if node in state.members:
                if node not in dead:
                    dead.append(node)
            else:
                nodes.pop(node, None)
        suspects = [*state.suspects, *sorted(action.suspects - set(state.suspects))]
        return replace(state, version=version, candidates=candidates, nodes=nodes, beats=beats, dead=tuple(dead), suspects=tuple(suspects))
    if step is Step.LEAVE:
        members = tuple(m for m in state.members if m != me)
        candidates.pop(me, None)
        nodes.pop(me, None)
        beats.pop(me, None)
        steps = {m: s for m, s in state.steps.items() if m != me}
        closed = state.closed or (state.epoch >= 1 and not members)
        return replace(
            state, version=version, members=members, steps=steps, candidates=candidates, nodes=nodes, beats=beats,
            closed=closed, suspects=tuple(s for s in state.suspects if s != me),
        )
    # COMPLETE
    new = next_members(state)
    rest = {n: s for n, s in candidates.items() if n not in new}
    return replace(
        state, version=version, epoch=state.epoch + 1, members=new, steps={m: candidates[m] for m in new},
        lost=tuple(m for m in state.members if m not in new), candidates=rest, dead=(), suspects=(),
        nodes={n: nodes[n] for n in (*new, *rest) if n in nodes}, beats={n: b for n, b in beats.items() if n in rest},
    )


def heal_plan(state: State) -> tuple[int, int, tuple[int, ...]]:
    """Who gives its state to whom when quorum ``state.epoch`` forms: ``(step, source,
    healers)``: the highest committed step of its members, the first rank that has it, and
    the ranks behind it, which receive the source's state. When no member has any state yet
    (a job's first quorum) every rank takes rank 0's, and the step is 0."""
    steps = [state.steps.get(m, -1) for m in state.members]
    if not steps:
        return 0, -1, ()
    top = max(steps)
    if top < 0:
        return 0, 0, tuple(range(1, len(steps)))
    return top, steps.index(top), tuple(r for r, s in enumerate(steps) if s < top)
