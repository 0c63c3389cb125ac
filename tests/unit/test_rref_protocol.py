"""The RRef reference-counting protocol, on a simulated network of RRefProtocol instances.

No sockets and no threads: ``Net`` carries messages between N protocol instances in per-pair
FIFO queues (or in any order at all), and a seeded random scheduler interleaves deliveries with
the scripted forks and releases. After every step the safety invariant is checked: once an
owner deletes an RRef, nothing anywhere (a Python handle, a user record, a message in flight)
still refers to it, and an RRef created but not deleted has a live owner record. At the end,
with everything released and every queue drained, each instance is idle and each owner deleted
its value exactly once.
"""

from __future__ import annotations

import copy
import functools
import pickle
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest

import tdist.rpc._rref_protocol as rp
from tdist._core.errors import LocalProtocolError, PeerError
from tdist.rpc._rref_protocol import (
    Action,
    ChildAccept,
    Confirmed,
    DeleteOwner,
    ForkAccept,
    ForkId,
    ForkRequest,
    GloballyUniqueId,
    Message,
    OwnerState,
    ProtocolWarning,
    RRefId,
    RRefLost,
    RRefProtocol,
    Send,
    UserDelete,
)

SEEDS = range(50)

# -- the simulated network -------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteCall:
    """The remote() request (the agent's message, not the protocol's)."""

    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True)
class RemoteReply:
    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True)
class Payload:
    """A user message carrying one pickled RRef; ``label`` names the handle it becomes."""

    label: str
    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int


Item = Message | RemoteCall | RemoteReply | Payload


@dataclass
class Handle:
    """A live Python RRef object on ``worker`` (``fork_id`` None: the owner's own object)."""

    worker: int
    rref_id: RRefId
    fork_id: ForkId | None
    owner: int


class Net:
    def __init__(self, n: int, seed: int, fifo: bool = True) -> None:
        self.rng = random.Random(seed)
        self.fifo = fifo
        self.protos = {w: RRefProtocol(w) for w in range(n)}
        self.queues: dict[tuple[int, int], deque[Item]] = {}
        self.handles: dict[str, Handle] = {}
        self.ever: set[str] = set()
        self.deleted: Counter[RRefId] = Counter()
        self.created: set[RRefId] = set()
        self.owner_of: dict[RRefId, int] = {}
        self.touched: dict[RRefId, set[int]] = {}
        self.warnings: list[str] = []
        self.lost: list[tuple[int, RRefLost]] = []
        self.dead: set[int] = set()
        self.tainted: set[RRefId] = set()
        self.to_notify: set[tuple[int, int]] = set()  # (survivor, dead) not yet told
        self.shut: set[int] = set()  # release_all_users() ran: its handles keep nothing alive
        self.steps = 0
        self._labels = 0

    # -- plumbing

    def alive(self) -> list[int]:
        return [w for w in self.protos if w not in self.dead]

    def new_label(self) -> str:
        self._labels += 1
        return f"h{self._labels}"

    def enqueue(self, src: int, dst: int, item: Item) -> None:
        assert src != dst or isinstance(item, Payload), f"{item} sent to self"
        if dst in self.dead:
            return
        self.queues.setdefault((src, dst), deque()).append(item)

    def apply(self, w: int, actions: Iterable[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                assert action.dst != w, f"worker {w} returned a Send to itself: {action}"
                self.enqueue(w, action.dst, action.msg)
            elif isinstance(action, DeleteOwner):
                assert self.owner_of[action.rref_id] == w
                self.deleted[action.rref_id] += 1
            elif isinstance(action, ProtocolWarning):
                self.warnings.append(action.text)
            elif isinstance(action, RRefLost):
                self.lost.append((w, action))
            else:
                assert isinstance(action, Confirmed)

    def touch(self, rref_id: RRefId, *workers: int) -> None:
        self.touched.setdefault(rref_id, set()).update(workers)

    # -- operations (what the agent does when Python code runs)

    def remote(self, creator: int, owner: int, label: str | None = None) -> str:
        label = label or self.new_label()
        rref_id, fork_id = self.protos[creator].create_user_for_remote(owner)
        assert rref_id != fork_id and rref_id.created_on == fork_id.created_on == creator
        self.owner_of[rref_id] = owner
        self.touch(rref_id, creator, owner)
        self.add_handle(label, Handle(creator, rref_id, fork_id, owner))
        self.enqueue(creator, owner, RemoteCall(rref_id, fork_id))
        return label

    def local(self, worker: int, label: str | None = None) -> str:
        label = label or self.new_label()
        rref_id = self.protos[worker].create_owner_local()
        self.owner_of[rref_id] = worker
        self.created.add(rref_id)
        self.touch(rref_id, worker)
        self.add_handle(label, Handle(worker, rref_id, None, worker))
        return label

    def send(self, label: str, dst: int, new_label: str | None = None) -> str:
        new_label = new_label or self.new_label()
        h = self.handles[label]
        decision = self.protos[h.worker].fork_for(h.rref_id, h.fork_id, h.owner, dst)
        self.touch(h.rref_id, dst)
        self.apply(h.worker, decision.actions)
        self.enqueue(
            h.worker, dst, Payload(new_label, h.rref_id, decision.fork_id, h.owner, h.worker)
        )
        return new_label

    def release(self, label: str) -> None:
        h = self.handles.pop(label)
        proto = self.protos[h.worker]
        if h.fork_id is None:
            self.apply(h.worker, proto.owner_released(h.rref_id))
        else:
            self.apply(h.worker, proto.user_released(h.fork_id))

    def add_handle(self, label: str, handle: Handle) -> None:
        assert label not in self.ever
        self.handles[label] = handle
        self.ever.add(label)

    def fail(self, worker: int) -> None:
        """``worker`` crashes: its handles vanish, what it had not sent yet may be lost."""
        self.dead.add(worker)
        for key in [k for k in self.queues if worker == k[1]]:
            del self.queues[key]
        for key in [k for k in self.queues if worker == k[0]]:
            queue = self.queues[key]
            keep = self.rng.randint(0, len(queue))
            while len(queue) > keep:
                queue.pop()
            if not queue:
                del self.queues[key]
        for label in [lab for lab, h in self.handles.items() if h.worker == worker]:
            del self.handles[label]
        self.tainted |= {r for r, ws in self.touched.items() if worker in ws}
        self.to_notify = {(w, d) for w, d in self.to_notify if w != worker}
        self.to_notify |= {(w, worker) for w in self.alive()}

    def notify_choices(self) -> list[tuple[int, int]]:
        """Survivors that have received everything the dead worker sent them."""
        return sorted(
            (w, d)
            for (w, d) in self.to_notify
            if w not in self.dead and not self.queues.get((d, w))
        )

    def notify(self, w: int, dead: int) -> None:
        self.to_notify.discard((w, dead))
        self.apply(w, self.protos[w].peer_failed(dead))

    def deliver(self, key: tuple[int, int]) -> None:
        src, dst = key
        queue = self.queues[key]
        if self.fifo:
            item = queue.popleft()
        else:
            index = self.rng.randrange(len(queue))
            item = queue[index]
            del queue[index]
        if not queue:
            del self.queues[key]
        proto = self.protos[dst]
        if isinstance(item, RemoteCall):
            self.apply(dst, proto.owner_created_by_remote(item.rref_id, item.fork_id, src))
            self.created.add(item.rref_id)
            self.enqueue(dst, src, RemoteReply(item.rref_id, item.fork_id))
        elif isinstance(item, RemoteReply):
            self.apply(dst, proto.confirm(item.fork_id))
        elif isinstance(item, Payload):
            self.apply(dst, proto.received(item.rref_id, item.fork_id, item.owner, item.parent))
            fork = None if item.owner == dst else item.fork_id
            self.add_handle(item.label, Handle(dst, item.rref_id, fork, item.owner))
        else:
            self.apply(dst, proto.handle(src, item))

    # -- invariants

    def in_flight(self) -> set[RRefId]:
        return {item.rref_id for q in self.queues.values() for item in q}

    def check(self) -> None:
        self.steps += 1
        over = {r: c for r, c in self.deleted.items() if c > 1}
        assert not over, f"DeleteOwner emitted more than once: {over}"
        held = {h.rref_id for h in self.handles.values() if h.worker not in self.shut}
        users = {u.rref_id for w in self.alive() for u in self.protos[w].all_users()}
        flying = self.in_flight()
        for r in self.deleted:
            if r in self.tainted:
                continue
            where = [name for name, refs in (("a handle", held), ("a user", users)) if r in refs]
            where += ["a message"] if r in flying else []
            assert not where, f"RRef {r} deleted while {where} still refers to it"
            assert self.protos[self.owner_of[r]].owner_state(r) is None
        for r in self.created - set(self.deleted) - self.tainted:
            state = self.protos[self.owner_of[r]].owner_state(r)
            assert state is OwnerState.LIVE, f"RRef {r} created, not deleted, owner says {state}"
        assert self.warnings == [], self.warnings

    def check_final(self) -> None:
        assert not self.queues and not self.handles and not self.to_notify
        for w in self.alive():
            proto = self.protos[w]
            assert proto.idle(), proto.pending()
            assert proto.pending() == ""
            assert proto.all_users() == [], proto.all_users()
            assert not [lk for lk in proto.leaks() if lk.role == "fork"]
            for r, owner in self.owner_of.items():
                if owner == w:
                    assert proto.owner_state(r) is None, f"owner record of {r} left on {w}"
        for r in self.created:
            if self.owner_of[r] not in self.dead:
                assert self.deleted[r] == 1, f"RRef {r} deleted {self.deleted[r]} times"
        if not self.dead:
            assert self.lost == []
            assert set(self.deleted) == self.created

    # -- scheduling

    def run(
        self,
        steps: list[Step] | None = None,
        generate: Callable[[Net], list[Callable[[], object]]] | None = None,
        strict: bool = True,
    ) -> None:
        """Run ``steps`` (and generated operations) interleaved at random with deliveries.

        A release waits for every send scripted from the same label. With ``strict`` every step
        must have run by the end (without it, steps whose handle never came are skipped).
        """
        todo = list(steps or [])
        for step in todo:
            if step.kind == "release":
                forks = tuple(s.name for s in todo if s.kind == "send" and s.label == step.label)
                step.after += forks
        done: set[str] = set()

        def take(step: Step) -> None:
            step.run(self)
            done.add(step.name)
            todo.remove(step)

        while True:
            choices: list[Callable[[], object]] = [
                functools.partial(take, s) for s in todo if s.ready(self, done)
            ]
            for key in sorted(self.queues):  # deliveries weigh double: fewer stalls
                choices += [functools.partial(self.deliver, key)] * 2
            for w, d in self.notify_choices():
                choices.append(functools.partial(self.notify, w, d))
            if generate is not None:
                choices += generate(self)
            if not choices:
                break
            self.rng.choice(choices)()
            self.check()
        assert not strict or not todo, f"steps never became ready: {[s.name for s in todo]}"


@dataclass
class Step:
    """One scripted operation. ``after`` names steps that must have run first, or
    ``got:<label>`` for a label that must have been received."""

    name: str
    kind: str
    worker: int = -1
    label: str = ""
    dst: int = -1
    after: tuple[str, ...] = ()

    def ready(self, net: Net, done: set[str]) -> bool:
        for dep in self.after:
            if dep.startswith("got:"):
                if dep[4:] not in net.ever:
                    return False
            elif dep not in done:
                return False
        if self.kind in ("send", "release"):
            return self.label in net.handles
        return self.worker not in net.dead

    def run(self, net: Net) -> None:
        if self.kind == "remote":
            net.remote(self.worker, self.dst, self.name)
        elif self.kind == "local":
            net.local(self.worker, self.name)
        elif self.kind == "send":
            try:
                net.send(self.label, self.dst, self.name)
            except PeerError:  # towards a worker, or of an RRef owned by one, known dead
                assert net.dead
        elif self.kind == "release":
            net.release(self.label)
        elif self.kind == "shutdown":
            net.shut.add(self.worker)
            net.apply(self.worker, net.protos[self.worker].release_all_users())
        elif self.kind == "fail":
            net.fail(self.worker)
        else:
            raise AssertionError(self.kind)


def remote(label: str, creator: int, owner: int, after: tuple[str, ...] = ()) -> Step:
    return Step(label, "remote", worker=creator, dst=owner, after=after)


def local(label: str, worker: int) -> Step:
    return Step(label, "local", worker=worker)


def send(src: str, new: str, dst: int, after: tuple[str, ...] = ()) -> Step:
    return Step(new, "send", label=src, dst=dst, after=after)


def release(label: str, after: tuple[str, ...] = ()) -> Step:
    return Step(f"x:{label}", "release", label=label, after=after)


def run_script(steps: list[Step], n: int, seed: int, fifo: bool = True) -> Net:
    net = Net(n, seed, fifo)
    net.run(copy.deepcopy(steps))
    net.check_final()
    return net


def for_seeds(seeds: Iterable[int], body: Callable[[int], object]) -> None:
    """Run ``body(seed)`` for each seed (in one test, to keep the run short); name the seed."""
    for seed in seeds:
        try:
            body(seed)
        except Exception as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc


# -- scenarios -------------------------------------------------------------------------------

ORDERS = pytest.mark.parametrize("fifo", [True, False], ids=["fifo", "any-order"])


@ORDERS
def test_remote_then_release(fifo: bool) -> None:
    steps = [remote("a", 0, 1), release("a")]
    for_seeds(SEEDS, lambda seed: run_script(steps, 2, seed, fifo))


@ORDERS
def test_owner_forks_to_users(fifo: bool) -> None:
    steps = [
        local("x", 0),
        send("x", "y", 1),
        send("x", "z", 2),
        send("y", "y2", 2),  # a user forwards it too
        *(release(x) for x in ("x", "y", "z", "y2")),
    ]
    for_seeds(SEEDS, lambda seed: run_script(steps, 3, seed, fifo))


@ORDERS
def test_user_forks_to_owner(fifo: bool) -> None:
    steps = [
        remote("a", 0, 1),
        send("a", "b", 1),  # back to the owner, maybe before the remote() request
        send("b", "c", 2),  # the owner forwards its object, maybe before its value exists
        *(release(x) for x in "abc"),
    ]
    for_seeds(SEEDS, lambda seed: run_script(steps, 3, seed, fifo))


@ORDERS
@pytest.mark.parametrize("origin", ["remote", "local"])
def test_chain_released_from_the_root(fifo: bool, origin: str) -> None:
    """A -> B -> C; A drops first, then B, then C; the value lives until C drops."""
    first = remote("a", 0, 3) if origin == "remote" else local("a", 3)
    steps = [
        first,
        send("a", "b", 1),
        send("b", "c", 2),
        release("a"),
        release("b", after=("x:a",)),
        release("c", after=("x:b",)),
    ]

    def body(seed: int) -> None:
        net = run_script(steps, 4, seed, fifo)
        (rref,) = net.created
        assert net.deleted[rref] == 1

    for_seeds(SEEDS, body)


@ORDERS
def test_user_shares_with_several_users(fifo: bool) -> None:
    steps = [
        remote("a", 0, 1),
        send("a", "b", 2),
        send("a", "c", 3),
        send("a", "d", 4),
        send("b", "e", 3),  # worker 3 holds two forks of the same RRef
        send("c", "f", 3),  # and a third, forked by itself
        send("e", "g", 0),  # back to the creator
        *(release(x) for x in "abcdefg"),
    ]
    for_seeds(SEEDS, lambda seed: run_script(steps, 5, seed, fifo))


@ORDERS
def test_fork_then_release_before_confirmation(fifo: bool) -> None:
    steps = [
        remote("a", 0, 1),
        send("a", "b", 2),
        release("a"),  # right after forking: unconfirmed, with a pending child
        send("b", "c", 3),
        release("b"),  # right after forking, maybe before its ForkAccept
        send("c", "d", 2),
        release("c"),
        release("d"),
    ]
    for_seeds(SEEDS, lambda seed: run_script(steps, 4, seed, fifo))


def test_release_order_permutations() -> None:
    def body(seed: int) -> None:
        order = random.Random(seed).sample("abcde", 5)
        steps = [
            remote("a", 0, 1),
            send("a", "b", 2),
            send("b", "c", 0),
            send("a", "d", 1),
            send("c", "e", 2),
        ]
        previous: tuple[str, ...] = ("got:b", "got:c", "got:d", "got:e")
        for label in order:
            steps.append(release(label, after=previous))
            previous = (f"x:{label}",)
        run_script(steps, 3, seed, fifo=bool(seed % 2))

    for_seeds(range(240), body)


@ORDERS
def test_self_sends(fifo: bool) -> None:
    steps = [
        local("o", 0),
        send("o", "o2", 0),  # the owner to itself
        release("o"),  # maybe before o2 is read: the fork keeps the value alive
        remote("a", 1, 0),
        send("a", "a2", 1),  # a user to itself
        *(release(x) for x in ("a", "o2", "a2")),
    ]
    for_seeds(SEEDS, lambda seed: run_script(steps, 2, seed, fifo))


@ORDERS
def test_shutdown_release_all_users(fifo: bool) -> None:
    sends = [
        remote("a", 0, 1),
        local("o", 2),
        send("a", "b", 2),
        send("b", "c", 3),
        send("o", "p", 3),
        send("p", "q", 0),
    ]
    forked = tuple(s.name for s in sends)

    def body(seed: int) -> None:
        net = Net(4, seed, fifo)
        shutdowns = [Step(f"s{w}", "shutdown", worker=w, after=forked) for w in range(4)]
        net.run(copy.deepcopy(sends) + shutdowns)
        for w, proto in net.protos.items():
            assert proto.idle(), proto.pending()
            held = {h.fork_id for h in net.handles.values() if h.worker == w and h.fork_id}
            leaked = {lk.fork_id for lk in proto.leaks() if lk.role == "user"}
            assert leaked == held
            assert all("Leaking RRef" in str(lk) for lk in proto.leaks())
        assert net.protos[1].owner_state(net.handles["a"].rref_id) is None  # users let go
        assert net.protos[2].owner_state(net.handles["o"].rref_id) is OwnerState.LIVE
        for label in sorted(net.handles):  # Python objects die after shutdown
            net.release(label)
        net.check()
        net.check_final()

    for_seeds(SEEDS, body)


@ORDERS
@pytest.mark.parametrize("victim", [0, 1, 2, 3])
def test_peer_failure(fifo: bool, victim: int) -> None:
    """0 creates on 1 and forks 0 -> 2 -> 3 -> 0; 2 forks its own; ``victim`` dies sometime."""
    steps = [
        remote("a", 0, 1),
        local("o", 2),
        send("a", "b", 2),
        send("b", "c", 3),
        send("o", "p", 0),
        send("p", "q", 3),
        send("c", "d", 0),
        send("q", "r", 1),
        Step("fail", "fail", worker=victim, after=("got:b",)),
        *(release(x) for x in "abcdopqr"),
    ]

    def body(seed: int) -> None:
        net = Net(4, seed, fifo)
        net.run(copy.deepcopy(steps), strict=False)  # the victim's steps never come
        net.run(generate=_release_any)
        net.check_final()
        assert all(lost.rref_id in net.tainted for _, lost in net.lost)

    for_seeds(SEEDS, body)


def _release_any(net: Net) -> list[Callable[[], object]]:
    if not net.handles:
        return []
    return [lambda: net.release(net.rng.choice(sorted(net.handles)))]


def _random_ops(budget: dict[str, int]) -> Callable[[Net], list[Callable[[], object]]]:
    """Random remote()/RRef()/send/release/failure operations, within ``budget``."""

    def generate(net: Net) -> list[Callable[[], object]]:
        ops: list[Callable[[], object]] = []
        alive = net.alive()
        if budget["create"] > 0:

            def create() -> None:
                budget["create"] -= 1
                creator, owner = net.rng.choice(alive), net.rng.choice(alive)
                if owner == creator:
                    net.local(creator)
                else:
                    net.remote(creator, owner)

            ops.append(create)
        if budget["send"] > 0 and net.handles:

            def fork() -> None:
                budget["send"] -= 1
                label = net.rng.choice(sorted(net.handles))
                try:
                    net.send(label, net.rng.choice(alive))
                except PeerError:  # its owner is known dead
                    assert net.dead

            ops += [fork] * 3
        ops += _release_any(net)
        if budget["fail"] > 0 and len(alive) > 2:

            def fail() -> None:
                budget["fail"] -= 1
                net.fail(net.rng.choice(alive))

            ops.append(fail)
        return ops

    return generate


@ORDERS
@pytest.mark.parametrize("failures", [0, 1, 2], ids=["no-failure", "1-failure", "2-failures"])
def test_random_programs(fifo: bool, failures: int) -> None:
    def body(seed: int) -> None:
        net = Net(5, seed, fifo)
        net.run(generate=_random_ops({"create": 4, "send": 16, "fail": failures}))
        net.check_final()

    for_seeds(range(100), body)


# -- single steps, errors and queries ----------------------------------------------------------


def _sends(actions: Iterable[Action]) -> list[tuple[int, Message]]:
    return [(a.dst, a.msg) for a in actions if isinstance(a, Send)]


def test_ids_and_messages_pickle() -> None:
    gid = GloballyUniqueId(3, 7)
    assert gid == (3, 7) and gid.created_on == 3 and gid.local_id == 7
    assert type(pickle.loads(pickle.dumps(gid))) is GloballyUniqueId
    request = ForkRequest(gid, GloballyUniqueId(4, 1), 4)
    msgs: list[object] = [
        request,
        ForkAccept(gid, gid),
        ChildAccept(gid, gid),
        UserDelete(gid, gid),
        Send(1, UserDelete(gid, gid)),
    ]
    assert [pickle.loads(pickle.dumps(m)) for m in msgs] == msgs
    with pytest.raises(AttributeError):
        request.parent = 5  # type: ignore[misc]


def test_plain_tuples_find_records() -> None:
    p = RRefProtocol(1)
    rref, fork = GloballyUniqueId(0, 5), GloballyUniqueId(0, 6)
    acts = p.received((0, 5), (0, 6), owner=2, parent=0)  # type: ignore[arg-type]
    (send,) = acts
    assert send == Send(2, ForkRequest(rref, fork, 0))
    assert isinstance(send, Send) and type(send.msg.rref_id) is GloballyUniqueId
    assert p.handle(2, ForkAccept(rref, fork)) == [
        Confirmed(fork),
        Send(0, ChildAccept(rref, fork)),
    ]


def test_fork_request_overtakes_remote_and_parent_delete() -> None:
    """B's ForkRequest reaches the owner before A's remote(); A's release waits for B."""
    a, b, o = RRefProtocol(0), RRefProtocol(1), RRefProtocol(2)
    rref, fa = a.create_user_for_remote(2)
    fb = a.fork_for(rref, fa, 2, 1).fork_id
    assert a.user_released(fa) == []  # unconfirmed, and a pending child
    ((dst, req),) = _sends(b.received(rref, fb, 2, 0))
    assert dst == 2
    ((_, accept),) = _sends(o.handle(1, req))
    assert o.owner_state(rref) is OwnerState.PENDING
    acts = b.handle(2, accept)
    assert Confirmed(fb) in acts and _sends(acts) == [(0, ChildAccept(rref, fb))]
    assert a.handle(1, ChildAccept(rref, fb)) == []  # still unconfirmed
    ((_, delete_b),) = _sends(b.user_released(fb))
    assert o.handle(1, delete_b) == []  # pending owner emptied: nothing to delete
    assert o.owner_created_by_remote(rref, fa, 0) == []
    assert o.owner_state(rref) is OwnerState.LIVE
    acts = a.confirm(fa)
    assert acts[0] == Confirmed(fa)
    ((_, delete_a),) = _sends(acts)
    assert o.handle(0, delete_a) == [DeleteOwner(rref)]
    assert a.idle() and b.idle() and o.idle() and not o.has_owner(rref)


def test_bad_messages_are_ignored_with_a_warning() -> None:
    o = RRefProtocol(0)
    rref = o.create_owner_local()
    fork = o.fork_for(rref, None, 0, 1).fork_id
    before = (o.leaks(), o.pending(), o.owner_state(rref))
    bad: list[tuple[int, Message]] = [
        (1, UserDelete(rref, GloballyUniqueId(1, 99))),  # unknown fork
        (2, UserDelete(rref, fork)),  # held by 1, not 2
        (1, ChildAccept(rref, fork)),  # no such pending child
        (1, ForkAccept(rref, fork)),  # no such user
        (1, ForkRequest(rref, fork, 0)),  # already registered
    ]
    for src, msg in bad:
        (warning,) = o.handle(src, msg)
        assert isinstance(warning, ProtocolWarning) and "worker 0: ignored" in warning.text
        assert (o.leaks(), o.pending(), o.owner_state(rref)) == before
    (warning,) = o.handle(1, "junk")  # type: ignore[arg-type]
    assert isinstance(warning, ProtocolWarning)
    assert o.handle(1, UserDelete(rref, fork)) == []
    assert o.owner_released(rref) == [DeleteOwner(rref)]
    (warning,) = o.handle(1, UserDelete(rref, fork))  # after deletion
    assert isinstance(warning, ProtocolWarning)


def test_duplicates_from_the_network_warn() -> None:
    u = RRefProtocol(1)
    rref, fork = GloballyUniqueId(0, 0), GloballyUniqueId(0, 1)
    assert u.received(rref, fork, 0, 0) == [Confirmed(fork)]
    (warning,) = u.received(rref, fork, 0, 0)
    assert isinstance(warning, ProtocolWarning)
    (warning,) = u.confirm(fork)  # not a remote() user
    assert isinstance(warning, ProtocolWarning)
    o = RRefProtocol(0)
    assert o.owner_created_by_remote(GloballyUniqueId(5, 0), GloballyUniqueId(5, 0), 5) == []
    (warning,) = o.owner_created_by_remote(GloballyUniqueId(5, 0), GloballyUniqueId(5, 0), 5)
    assert isinstance(warning, ProtocolWarning)


def test_local_misuse_raises_without_changing_state() -> None:
    p = RRefProtocol(0)
    with pytest.raises(LocalProtocolError, match="remote\\(\\) to itself"):
        p.create_user_for_remote(0)
    rref, fork = p.create_user_for_remote(1)
    with pytest.raises(LocalProtocolError, match="holder"):
        p.fork_for(rref, None, 1, 2)
    with pytest.raises(LocalProtocolError, match="no user reference"):
        p.fork_for(rref, GloballyUniqueId(0, 42), 1, 2)
    with pytest.raises(LocalProtocolError, match="no local reference"):
        p.fork_for(GloballyUniqueId(0, 42), None, 0, 2)
    with pytest.raises(LocalProtocolError, match="no local reference"):
        p.owner_released(GloballyUniqueId(0, 42))
    with pytest.raises(LocalProtocolError, match="unknown user fork"):
        p.user_released(GloballyUniqueId(0, 42))
    assert p.user_released(fork) == []
    with pytest.raises(LocalProtocolError, match="released twice"):
        p.user_released(fork)
    with pytest.raises(LocalProtocolError, match="was released"):
        p.fork_for(rref, fork, 1, 2)
    with pytest.raises(LocalProtocolError, match="on itself"):
        p.peer_failed(0)
    info = p.user(fork)
    assert info is not None and info.released and not info.confirmed and info.children == ()
    assert "waits for confirmation by owner 1" in p.pending()


def test_fork_towards_dead_workers_raises_peer_error() -> None:
    p = RRefProtocol(0)
    rref, fork = p.create_user_for_remote(1)
    p.confirm(fork)
    local_rref = p.create_owner_local()
    p.peer_failed(2)
    with pytest.raises(PeerError) as err:
        p.fork_for(local_rref, None, 0, 2)
    assert err.value.peer == 2
    assert p.peer_failed(1) == [RRefLost(rref, "its owner, worker 1, failed")]
    with pytest.raises(PeerError, match="owner, worker 1, failed"):
        p.fork_for(rref, fork, 1, 3)
    with pytest.raises(PeerError):
        p.create_user_for_remote(1)
    assert p.peer_failed(1) == []  # idempotent
    assert p.user_released(fork) == []  # no UserDelete to a dead owner
    assert p.user(fork) is None
    (warning,) = p.handle(1, UserDelete(local_rref, fork))
    assert isinstance(warning, ProtocolWarning) and "declared failed" in warning.text


def test_fork_not_sent_undoes_the_fork() -> None:
    o = RRefProtocol(0)
    rref = o.create_owner_local()
    fork = o.fork_for(rref, None, 0, 1).fork_id
    assert o.owner_released(rref) == []
    assert o.fork_not_sent(rref, fork) == [DeleteOwner(rref)]
    assert o.fork_not_sent(rref, fork) == []  # unknown: ignored
    u = RRefProtocol(1)
    r2, f2 = u.create_user_for_remote(0)
    u.confirm(f2)
    child = u.fork_for(r2, f2, 0, 2).fork_id
    assert u.user_released(f2) == []
    assert _sends(u.fork_not_sent(r2, child)) == [(0, UserDelete(r2, f2))]
    r3, f3 = u.create_user_for_remote(0)
    acts = u.fork_not_sent(r3, f3)
    assert len(acts) == 1 and isinstance(acts[0], RRefLost)
    assert u.idle() and u.user_released(f3) == [] and u.all_users() == []


def test_owner_record_states_after_failures() -> None:
    o = RRefProtocol(0)
    pending = GloballyUniqueId(3, 0)
    ((_, accept),) = _sends(o.handle(2, ForkRequest(pending, GloballyUniqueId(1, 0), 1)))
    assert accept == ForkAccept(pending, GloballyUniqueId(1, 0))
    assert o.owner_state(pending) is OwnerState.PENDING
    acts = o.peer_failed(3)  # its creator died before the remote() arrived
    assert [type(a) for a in acts] == [RRefLost]
    assert o.owner_state(pending) is OwnerState.ABANDONED and not o.idle()
    assert "owned RRef" in o.pending() and "@2" in o.pending()
    (leak,) = o.leaks()
    assert (leak.role, leak.holder, leak.owner, leak.creator) == ("fork", 2, 0, 3)
    assert o.handle(2, UserDelete(pending, GloballyUniqueId(1, 0))) == []  # dropped, no delete
    assert not o.has_owner(pending) and o.idle()
    # A fork of an unknown RRef from a dead parent, or one created here: abandoned at once.
    o.peer_failed(1)
    for rref, parent in ((GloballyUniqueId(4, 0), 1), (GloballyUniqueId(0, 9), 4)):
        acts = o.handle(2, ForkRequest(rref, GloballyUniqueId(2, 0), parent))
        assert isinstance(acts[0], RRefLost) and _sends(acts)
        assert o.owner_state(rref) is OwnerState.ABANDONED
    assert o.owner_created_by_remote(GloballyUniqueId(4, 0), GloballyUniqueId(4, 0), 4) == []
    assert o.owner_state(GloballyUniqueId(4, 0)) is OwnerState.LIVE


def test_owner_shutdown_keeps_local_values() -> None:
    o = RRefProtocol(0)
    rref = o.create_owner_local()
    assert o.release_all_users() == [] and o.idle() and o.leaks() == []
    with pytest.raises(LocalProtocolError, match="after release_all_users"):
        o.fork_for(rref, None, 0, 1)
    assert o.user_released(GloballyUniqueId(0, 77)) == []  # ignored after shutdown
    # A user received after shutdown is released as soon as it can be.
    assert _sends(o.received(GloballyUniqueId(1, 0), GloballyUniqueId(1, 1), 1, 1)) == [
        (1, UserDelete(GloballyUniqueId(1, 0), GloballyUniqueId(1, 1)))
    ]
    assert o.owner_released(rref) == [DeleteOwner(rref)]


def test_module_is_sans_io() -> None:
    source = open(rp.__file__, encoding="utf-8").read()
    for name in ("socket", "threading", "time", "select", "asyncio"):
        assert f"import {name}" not in source
    assert sorted(rp.__all__) == rp.__all__
    for name in rp.__all__:
        assert hasattr(rp, name)


def test_debug_counts_follow_torchs_rref_context_figures() -> None:
    """Owned values count once another worker references them, forks per reference there,
    pending users until the owner confirms them."""
    o, u = RRefProtocol(0), RRefProtocol(1)
    zero = {"owners": 0, "forks": 0, "pending_users": 0}
    local = o.create_owner_local()
    assert o.debug_counts() == zero  # a local RRef is not counted until shared
    fork = o.fork_for(local, None, 0, 1).fork_id
    assert o.debug_counts() == {"owners": 1, "forks": 1, "pending_users": 0}
    assert u.received(local, fork, owner=0, parent=0) == [Confirmed(fork)]
    assert u.debug_counts() == zero  # the owner sent it: confirmed at once
    ((_, delete),) = _sends(u.user_released(fork))
    o.handle(1, delete)
    assert o.debug_counts() == zero
    rref, fa = u.create_user_for_remote(0)
    assert u.debug_counts() == {"owners": 0, "forks": 0, "pending_users": 1}
    o.owner_created_by_remote(rref, fa, 1)
    assert o.debug_counts() == {"owners": 1, "forks": 1, "pending_users": 0}
    u.confirm(fa)
    assert u.debug_counts() == zero
