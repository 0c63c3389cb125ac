"""The rendezvous state machine (``tdist.elastic.rendezvous._state``) as pure functions of
(state, view, now), and its executor and handler on an in-memory store with a fake clock: no
sockets, no threads that matter, no sleeps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tdist.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from tdist.elastic.rendezvous._dynamic import STATE_KEY, DynamicRendezvousHandler, StateExecutor
from tdist.elastic.rendezvous._state import (
    Action,
    Op,
    Settings,
    State,
    Step,
    View,
    apply,
    dead_nodes,
    decide,
    nodes_waiting,
    observe,
)
from tdist.store._file import FileStore
from tdist.store._hash import HashStore

pytestmark = pytest.mark.timeout(30)

FAR = 1e9  # a deadline that does not come


class Node:
    """One simulated node: its name and view; ``act`` decides and applies on a shared state."""

    def __init__(self, name: str, settings: Settings) -> None:
        self.name, self.settings, self.view = name, settings, View()

    def decide(self, op: Op, state: State, now: float, deadline: float = FAR) -> Action:
        self.view = observe(self.view, state, now)
        return decide(op, state, self.view, self.name, now, deadline, self.settings)

    def act(self, op: Op, state: State, now: float, deadline: float = FAR) -> tuple[Action, State]:
        action = self.decide(op, state, now, deadline)
        if action.step in (Step.WAIT, Step.FINISH):
            return action, state
        state = apply(state, action, self.name)
        self.view = observe(self.view, state, now)  # (as the executor: it sees what it wrote)
        return action, state


def nodes(settings: Settings, *names: str) -> list[Node]:
    return [Node(n, settings) for n in names]


def join_all(state: State, members: list[Node], now: float) -> State:
    for node in members:
        action, state = node.act(Op.JOIN, state, now)
        assert action.step is Step.JOIN
    return state


# -- the pure functions --------------------------------------------------------------------------
def test_a_round_completes_at_once_at_max_nodes_and_ranks_follow_the_names() -> None:
    s = Settings(2, 3, last_call=30)
    c, a, b = nodes(s, "c", "a", "b")
    state = join_all(State.fresh(s), [c, a], now=0.0)
    assert not state.complete and state.participants == {"c": -1, "a": -1}
    _, state = b.act(Op.JOIN, state, now=0.1)
    assert state.complete and state.version == 3
    assert dict(state.participants) == {"c": 2, "a": 0, "b": 1}  # (join order kept, ranks by name)
    for node in (a, b, c):
        assert node.decide(Op.JOIN, state, now=0.2).step is Step.FINISH


def test_the_last_call_runs_from_when_min_nodes_are_seen() -> None:
    s = Settings(2, 4, last_call=30, keep_alive_interval=100)
    a, b = nodes(s, "a", "b")
    state = join_all(State.fresh(s), [a, b], now=10.0)
    assert a.decide(Op.JOIN, state, now=10.0) == Action(Step.WAIT, until=40.0)  # the last call: 30 s from 10
    # b first saw the quorum later (it polls less often): a, whose last call ends first, completes
    b.view = observe(View(), state, 12.0)
    assert b.decide(Op.JOIN, state, now=40.0) == Action(Step.WAIT, until=42.0)
    action, state = a.act(Op.JOIN, state, now=40.0)
    assert action.step is Step.COMPLETE and state.complete
    assert dict(state.participants) == {"a": 0, "b": 1}
    assert b.decide(Op.JOIN, state, now=40.0).step is Step.FINISH


def test_a_late_node_waits_for_the_next_round_which_the_members_open() -> None:
    s = Settings(1, 3, last_call=0)
    a, b, late = nodes(s, "a", "b", "late")
    state = join_all(State.fresh(s), [a, b], now=0.0)
    _, state = a.act(Op.JOIN, state, now=0.0)  # (min_nodes and no last call: complete)
    assert state.complete and state.round == 0
    action, state = late.act(Op.JOIN, state, now=1.0)
    assert action.step is Step.WAIT_LIST and state.wait_list == ("late",)
    assert late.decide(Op.JOIN, state, now=1.0).step is Step.WAIT
    assert nodes_waiting(state) == 1
    # a member opens the next round: it leaves (and waits too); the last one out moves the round
    action, state = a.act(Op.LEAVE, state, now=2.0)
    assert action.step is Step.LEAVE and state.round == 0 and "a" not in state.participants
    _, state = a.act(Op.JOIN, state, now=2.0)
    assert state.wait_list == ("late", "a") and nodes_waiting(state) == 2
    _, state = b.act(Op.LEAVE, state, now=3.0)
    assert state.round == 1 and not state.complete and not state.participants
    for node in (late, a, b):
        _, state = node.act(Op.JOIN, state, now=4.0)
    assert state.complete and state.wait_list == () and dict(state.participants) == {"late": 2, "a": 0, "b": 1}


def test_a_full_round_keeps_its_late_nodes_as_spares() -> None:
    s = Settings(2, 2)
    a, b, spare = nodes(s, "a", "b", "spare")
    state = join_all(State.fresh(s), [a, b], now=0.0)
    _, state = spare.act(Op.JOIN, state, now=0.0)
    assert state.wait_list == ("spare",) and nodes_waiting(state) == 0  # (no room: nobody to admit)
    # as torch's redundancy list: a spare waits on past its deadline (no timeout, no wake-up
    # for it), and a close lets it go without an error
    late = spare.decide(Op.JOIN, state, now=0.5, deadline=0.1)
    assert late.step is Step.WAIT and late.until is not None and late.until > 0.5
    _, closed = b.act(Op.CLOSE, state, now=0.5)
    assert spare.decide(Op.JOIN, closed, now=0.5).step is Step.ERROR_GRACEFUL_EXIT
    _, state = a.act(Op.LEAVE, state, now=1.0)
    assert nodes_waiting(state) == 1
    # with room in the round it is a waiting node as any: its deadline holds, a close is an error
    assert spare.decide(Op.JOIN, state, now=1.0, deadline=0.1).step is Step.LEAVE
    _, closed = b.act(Op.CLOSE, state, now=1.0)
    assert spare.decide(Op.JOIN, closed, now=1.0).step is Step.ERROR_CLOSED


def test_closed() -> None:
    s = Settings(1, 2)
    a, b = nodes(s, "a", "b")
    action, state = a.act(Op.CLOSE, State.fresh(s), now=0.0)
    assert action.step is Step.CLOSE and state.closed
    assert a.decide(Op.CLOSE, state, now=0.0).step is Step.FINISH
    assert b.decide(Op.JOIN, state, now=0.0).step is Step.ERROR_CLOSED
    assert b.decide(Op.CLOSE, State.fresh(s), now=5.0, deadline=5.0).step is Step.ERROR_TIMEOUT


def test_a_join_that_times_out_takes_itself_out_first() -> None:
    s = Settings(2, 2)
    (a,) = nodes(s, "a")
    state = join_all(State.fresh(s), [a], now=0.0)
    action, state = a.act(Op.JOIN, state, now=10.0, deadline=10.0)
    assert action.step is Step.LEAVE and not state.participants and not state.heartbeats
    assert a.decide(Op.JOIN, state, now=10.0, deadline=10.0).step is Step.ERROR_TIMEOUT
    # past the rollback period it just gives up (its heartbeat's expiry takes it out)
    state = join_all(State.fresh(s), [a], now=0.0)
    assert a.decide(Op.JOIN, state, now=20.0, deadline=10.0).step is Step.ERROR_TIMEOUT


def test_a_node_whose_heartbeat_stood_still_is_dropped_by_whoever_sees_it() -> None:
    s = Settings(2, 3, last_call=60, keep_alive_interval=5, keep_alive_max_attempt=3)
    a, b, c = nodes(s, "a", "b", "c")
    state = join_all(State.fresh(s), [a, b, c], now=0.0)
    assert state.complete and a.decide(Op.JOIN, state, now=0.0).step is Step.FINISH  # (a sees c at 0)
    for t in (5.0, 10.0):  # a and b beat; c does not
        for node in (a, b):
            action, state = node.act(Op.KEEP_ALIVE, state, now=t)
            assert action.step is Step.KEEP_ALIVE
    assert a.decide(Op.KEEP_ALIVE, state, now=12.0).step is Step.FINISH  # (not due)
    assert dead_nodes(state, a.view, "a", 14.9, s) == frozenset()
    # 15 s (3 intervals) of a's clock without a beat of c's
    action, state = a.act(Op.KEEP_ALIVE, state, now=15.0)
    assert action == Action(Step.DROP, frozenset({"c"}))
    assert "c" not in state.participants and "c" not in state.heartbeats and state.complete
    assert nodes_waiting(state) == 0 and len(state.participants) == 2
    # a newcomer's view starts now: it judges only what it watched itself
    (late,) = nodes(s, "late")
    assert dead_nodes(state, observe(View(), state, 100.0), "late", 100.0, s) == frozenset()
    # the last members' death opens the next round for the waiting
    _, state = late.act(Op.JOIN, state, now=100.0)
    action, state = late.act(Op.JOIN, state, now=115.0)
    assert action.step is Step.DROP and action.nodes == {"a", "b"}
    assert state.round == 1 and not state.complete and state.wait_list == ("late",)


def test_a_waiting_node_beats_and_wakes_for_what_comes_next() -> None:
    s = Settings(2, 2, keep_alive_interval=5)
    a, b = nodes(s, "a", "b")
    state = join_all(State.fresh(s), [a], now=0.0)
    assert a.decide(Op.JOIN, state, now=1.0, deadline=100.0) == Action(Step.WAIT, until=5.0)
    action, state = a.act(Op.JOIN, state, now=5.0, deadline=100.0)
    assert action.step is Step.KEEP_ALIVE and state.heartbeats["a"] == state.version
    _, state = b.act(Op.JOIN, state, now=6.0)
    # a watches b's heartbeat: it wakes when b's would expire, if nothing changes before
    assert state.complete and a.decide(Op.JOIN, state, now=6.0).step is Step.FINISH


def test_leave_and_the_state_as_stored() -> None:
    s = Settings(1, 1)
    (a,) = nodes(s, "a")
    assert a.decide(Op.LEAVE, State.fresh(s), now=0.0).step is Step.FINISH  # (nothing to leave)
    state = join_all(State.fresh(s), [a], now=0.0)
    assert state.complete and State.decode(state.encode()) == state
    _, left = a.act(Op.LEAVE, state, now=1.0)
    assert left.round == 1 and not left.complete and left.version == state.version + 1
    with pytest.raises(ValueError, match="not a rendezvous state"):
        State.decode(b'{"version": 1}')
    with pytest.raises(ValueError, match="does not change"):
        apply(state, Action(Step.WAIT), "a")
    with pytest.raises(ValueError, match="min_nodes"):
        Settings(3, 2)


# -- the executor: compare-and-set on a store, a fake clock -------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[tuple[list[str], float]] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, keys: list[str], seconds: float) -> None:
        """What a wait in the store costs: the time passes (no other node writes meanwhile)."""
        self.waits.append((keys, seconds))
        self.now += seconds


def test_two_nodes_interleaved_lose_and_retry_a_compare_and_set() -> None:
    store, clock = HashStore(), FakeClock()
    s = Settings(2, 2)
    a = StateExecutor(store, "a", s, clock=clock, wait=clock.wait)
    b = StateExecutor(store, "b", s, clock=clock, wait=clock.wait)
    assert a.refresh().version == 0 and b.refresh().version == 0  # both read the fresh state
    assert a.step(Op.JOIN, FAR) == (Action(Step.JOIN), True)
    assert b.step(Op.JOIN, FAR) == (Action(Step.JOIN), False)  # b's write was of a stale state
    assert b.conflicts == 1 and b.state.participants == {"a": -1}  # it now holds the winner's
    assert b.step(Op.JOIN, FAR) == (Action(Step.JOIN), True)
    assert b.state.complete and dict(b.state.participants) == {"a": 0, "b": 1}
    # a, still on its old state, loses its next write too and then sees the round complete
    a.step(Op.JOIN, FAR)  # (WAIT: nothing written)
    a.refresh()
    assert a.step(Op.JOIN, FAR)[0].step is Step.FINISH
    assert State.decode(store.get(STATE_KEY)) == b.state
    assert store.check(["changed/1", "changed/2"])  # the wake-ups of the waiting nodes


def test_the_executor_waits_on_the_next_versions_marker_bounded_by_the_decision() -> None:
    store, clock = HashStore(), FakeClock()
    s = Settings(1, 2, last_call=2.5, keep_alive_interval=5)
    a = StateExecutor(store, "a", s, clock=clock, wait=clock.wait)
    state = a.run(Op.JOIN, deadline=100.0)
    assert state.complete and clock.now == 2.5
    assert clock.waits == [(["changed/2"], 1.0), (["changed/2"], 1.0), (["changed/2"], 0.5)]


def test_a_join_that_waits_for_nodes_says_so_after_30_s_then_every_minute(caplog: pytest.LogCaptureFixture) -> None:
    store, clock = HashStore(), FakeClock()
    a = StateExecutor(store, "a", Settings(2, 3), describe="c10d rendezvous of 'job'", clock=clock, wait=clock.wait)
    with caplog.at_level(logging.WARNING), pytest.raises(RendezvousTimeoutError, match="1 of at least 2 nodes joined within 100 s"):
        a.run(Op.JOIN, deadline=100.0, timeout=100.0)
    said = [(r.getMessage(), r.levelno) for r in caplog.records if "waiting for more" in r.getMessage()]
    assert said == [
        (f"c10d rendezvous of 'job': 1 of at least 2 nodes joined round 0; waiting for more ({t} s so far; the join times out after 100 s)",
         logging.WARNING)
        for t in (30, 90)
    ], said


def test_a_round_in_its_last_call_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    store, clock = HashStore(), FakeClock()
    a = StateExecutor(store, "a", Settings(1, 2, last_call=45.0, keep_alive_interval=100), clock=clock, wait=clock.wait)
    with caplog.at_level(logging.WARNING):
        assert a.run(Op.JOIN, deadline=100.0, timeout=100.0).complete
    assert clock.now == 45.0 and not caplog.records


class StallingStore(HashStore):
    """A store whose next compare-and-set takes ``stall`` seconds of the fake clock (a server
    that stopped, then a fail-over to its standby)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock, self.stall = clock, 0.0

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        self.clock.now += self.stall
        self.stall = 0.0
        return super().compare_set(key, expected_value, desired_value)


def test_a_stalled_store_is_nobodys_silence() -> None:
    """While the store stalls, no node can beat: the time a compare-and-set took (here 20 s,
    with a keep-alive timeout of 3 s) does not drop the others; their silence counts again
    from when the store answers."""
    clock = FakeClock()
    store = StallingStore(clock)
    s = Settings(2, 2, keep_alive_interval=1, keep_alive_max_attempt=3)
    a = StateExecutor(store, "a", s, clock=clock, wait=clock.wait)
    b = StateExecutor(store, "b", s, clock=clock, wait=clock.wait)
    a.refresh()
    b.refresh()
    a.step(Op.JOIN, FAR)
    b.refresh()
    b.step(Op.JOIN, FAR)
    a.refresh()
    assert a.state.complete
    clock.now = 1.0
    assert a.run(Op.KEEP_ALIVE, deadline=FAR).heartbeats  # (a beats)
    b.refresh()  # (b sees a's beat)
    store.stall = 20.0  # b's next read: the store stood still 20 s (a could not beat either)
    b.refresh()
    assert dead_nodes(b.state, b.view, "b", clock.now, s) == frozenset()
    # from the store's answer on, a's silence counts: 3 s of it and a is dead to b
    clock.now += 2.9
    assert dead_nodes(b.state, b.view, "b", clock.now, s) == frozenset()
    clock.now += 0.2
    assert dead_nodes(b.state, b.view, "b", clock.now, s) == {"a"}


def test_a_corrupt_state_is_a_state_error() -> None:
    store = HashStore()
    store.set(STATE_KEY, b"garbage")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        StateExecutor(store, "a", Settings(1, 1)).refresh()


def test_the_executor_on_a_file_store(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path / "rdzv"))
    state = StateExecutor(store, "a", Settings(1, 1)).run(Op.JOIN, deadline=FAR)
    assert state.complete and state.participants == {"a": 0}


# -- the handler, on a fake clock -----------------------------------------------------------------
def handler(store: HashStore, clock: FakeClock, min_nodes: int, max_nodes: int, **options: object) -> DynamicRendezvousHandler:
    params = RendezvousParameters("c10d", "unused:0", "job", min_nodes, max_nodes, local_addr="127.0.0.1", **options)
    return DynamicRendezvousHandler("c10d", params, store, clock=clock, wait=clock.wait)


def test_the_host_sorts_first_and_the_options_are_torchs() -> None:
    store, clock = HashStore(), FakeClock()
    params = RendezvousParameters("etcd", "unused:0", "job", 1, 2, keep_alive_interval=2, keep_alive_max_attempt="4")
    host = DynamicRendezvousHandler("etcd", params, store, first=True, clock=clock, wait=clock.wait)
    other = DynamicRendezvousHandler("etcd", params, store, clock=clock, wait=clock.wait)
    assert host.node < other.node  # (so the host is rank 0 of every round it is in)
    assert host.settings == Settings(1, 2, last_call=30, keep_alive_interval=2, keep_alive_max_attempt=4)
    with pytest.raises(ValueError, match="'join_timeout' must be a number of seconds"):
        handler(store, clock, 1, 1, join_timeout="soon")


def test_the_handler_times_out_names_the_count_and_leaves() -> None:
    store, clock = HashStore(), FakeClock()
    h = handler(store, clock, 2, 2, join_timeout=10)
    with pytest.raises(RendezvousTimeoutError, match=r"c10d rendezvous of 'job': 1 of at least 2 nodes joined within 10 s"):
        h.next_rendezvous()
    assert clock.now == 10.0
    assert not State.decode(store.get(STATE_KEY)).participants  # (it took itself out)
    h.shutdown()


def test_the_handler_rounds_heartbeats_and_close() -> None:
    store, clock = HashStore(), FakeClock()
    first = handler(store, clock, 1, 2, last_call_timeout=1)
    info = first.next_rendezvous()
    try:
        assert (info.rank, info.world_size) == (0, 1) and clock.now == 1.0
        assert info.bootstrap_store_info is not None and info.bootstrap_store_info.master_addr == "127.0.0.1"
        info.store.set("k", b"v")
        assert store.get("round0/user/k") == b"v"
        assert first.num_nodes_waiting() == 0 and not first.is_closed()
        clock.now += 5
        first._keep_alive()  # (what its heartbeat thread does every keep_alive_interval)
        assert State.decode(store.get(STATE_KEY)).heartbeats[first.node] == 3
        should_stop = [False]
        clock.wait = lambda keys, seconds: should_stop.__setitem__(0, True)  # type: ignore[method-assign]
        second = handler(store, clock, 1, 2)
        second._should_stop = lambda: should_stop[0]
        with pytest.raises(RendezvousClosedError, match="c10d rendezvous of 'job': interrupted"):
            second.next_rendezvous()  # (it waits for the next round: a signal ends the wait)
        assert first.num_nodes_waiting() == 1
    finally:
        assert first.shutdown()
    assert first.is_closed()
    with pytest.raises(RendezvousClosedError, match="the c10d rendezvous of 'job' is closed"):
        handler(store, clock, 1, 2).next_rendezvous()
