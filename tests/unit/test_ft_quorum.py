"""The fault-tolerant job's quorum (``tdist.elastic._quorum``) as pure functions of (state,
view, now), its executor on an in-memory store with a fake clock, and the state hand-over
(``_transfer``) through an in-process queue: no sockets, no sleeps."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from tdist._core.errors import DistTimeoutError
from tdist.elastic import _quorum as q
from tdist.elastic._ft import QuorumError, _QuorumClient
from tdist.elastic._transfer import recv_state, send_state
from tdist.store._hash import HashStore

pytestmark = pytest.mark.timeout(30)

FAR = 1e9
HERE = "space-a"
NOBODY_DEAD: frozenset[str] = frozenset()


class Sim:
    """One simulated node: its name, view and request; ``act`` decides and applies."""

    def __init__(self, name: str, settings: q.Settings, step: int = -1, pid: int = 1) -> None:
        self.name, self.settings, self.view = name, settings, q.View()
        self.after, self.step, self.node = 0, step, q.Node(HERE, pid)
        self.accuse: frozenset[str] = frozenset()

    def req(self) -> q.Join:
        return q.Join(self.after, self.step, self.node, self.accuse)

    def decide(self, state: q.State, now: float, dead: frozenset[str] = NOBODY_DEAD, deadline: float = FAR) -> q.Action:
        self.view = q.observe(self.view, state, now)
        return q.decide_join(state, self.view, self.name, self.req(), dead, now, deadline, self.settings)

    def act(self, state: q.State, now: float, dead: frozenset[str] = NOBODY_DEAD) -> tuple[q.Action, q.State]:
        action = self.decide(state, now, dead)
        if action.step in q.WRITES:
            state = q.apply(state, action, self.name, self.req())
            self.view = q.observe(self.view, state, now)
        return action, state

    def settle(self, state: q.State, now: float, dead: frozenset[str] = NOBODY_DEAD) -> tuple[q.Action, q.State]:
        """Act until the decision writes nothing."""
        for _ in range(20):
            action, state = self.act(state, now, dead)
            if action.step not in q.WRITES:
                return action, state
        raise AssertionError("no end of writes")


def form(settings: q.Settings, names: list[str], now: float = 0.0) -> tuple[q.State, list[Sim]]:
    """The first quorum of ``names`` (every one a candidate, then completed)."""
    state = q.State.fresh(settings)
    sims = [Sim(n, settings, pid=i + 10) for i, n in enumerate(names)]
    for s in sims:
        _, state = s.act(state, now)
    now += settings.last_call  # (the last call, if the first quorum has room for more)
    for s in sims:
        _, state = s.settle(state, now)
    assert state.epoch == 1, state
    for s in sims:
        assert s.decide(state, now).step is q.Step.FINISH
        s.after, s.step = 1, 0
    return state, sims


def test_first_quorum_forms_at_max_size_at_once() -> None:
    st = q.Settings(min_size=2, max_size=3, last_call=100)
    state, sims = form(st, ["a", "b", "c"])
    assert state.members == ("a", "b", "c") and state.candidates == {}
    assert q.heal_plan(state) == (0, 0, (1, 2))  # no state anywhere: everybody takes rank 0's
    assert sims[0].decide(state, 0.0).step is q.Step.JOIN  # (a member asking for the next quorum)


def test_first_quorum_waits_a_last_call_after_min_size() -> None:
    st = q.Settings(min_size=2, max_size=None, last_call=5, keep_alive_interval=100)
    a, b = Sim("a", st), Sim("b", st)
    state = q.State.fresh(st)
    _, state = a.act(state, 0.0)
    assert a.decide(state, 0.0).step is q.Step.WAIT
    _, state = b.act(state, 1.0)
    action = a.decide(state, 2.0)  # (a saw two candidates at 2.0: the last call runs from there)
    assert action.step is q.Step.WAIT and action.until == 7.0
    assert a.decide(state, 7.0).step is q.Step.COMPLETE


def test_a_member_found_dead_is_left_out_at_once() -> None:
    st = q.Settings(min_size=1, max_size=3, grace=10, rejoin_timeout=100, keep_alive_interval=100)
    state, (a, b, _c) = form(st, ["a", "b", "c"])
    a.step = b.step = 7
    _, state = a.settle(state, 1.0, dead=frozenset({"c"}))  # (c's pid is gone)
    assert state.dead == ("c",) and a.decide(state, 1.0).step is q.Step.WAIT  # b is not back yet
    _, state = b.settle(state, 1.1)
    assert state.epoch == 2 and state.members == ("a", "b") and state.lost == ("c",)
    assert q.heal_plan(state) == (7, 0, ())
    assert a.decide(state, 1.1).step is q.Step.FINISH


def test_a_suspect_gets_its_grace_and_is_kept_when_it_comes_back() -> None:
    st = q.Settings(min_size=1, max_size=3, grace=2, rejoin_timeout=100, keep_alive_interval=100)
    state, (a, b, c) = form(st, ["a", "b", "c"])
    a.accuse = frozenset({"c"})  # (an error named c, which only relayed an abort)
    _, state = a.settle(state, 0.0)
    _, state = b.settle(state, 0.0)
    assert state.suspects == ("c",) and state.epoch == 1
    assert b.decide(state, 1.0) == q.Action(q.Step.WAIT, until=2.0)  # (b saw c named at 0.0)
    _, state = c.settle(state, 1.5)  # c comes back within the grace
    assert state.epoch == 2 and state.members == ("a", "b", "c")


def test_a_suspect_that_stays_away_is_left_out_after_the_grace() -> None:
    st = q.Settings(min_size=1, max_size=3, grace=2, rejoin_timeout=100, keep_alive_interval=50)
    state, (a, b, c) = form(st, ["a", "b", "c"])
    b.accuse = frozenset({"c"})
    _, state = a.settle(state, 0.0)
    _, state = b.settle(state, 0.0)
    action = a.decide(state, 1.0)  # (a sees c named first now: its own clock counts)
    assert action.step is q.Step.WAIT and action.until == 3.0
    _, state = a.settle(state, 3.0)
    assert state.epoch == 2 and state.members == ("a", "b") and state.lost == ("c",)
    # c comes late: it is a candidate of the next quorum, and the members see it at a step boundary
    c.step = 0
    action, state = c.settle(state, 4.0)
    assert action.step is q.Step.WAIT and list(state.candidates) == ["c"]
    assert q.should_reform(state, 2, ("a", "b"))


def test_a_silent_member_is_left_out_after_the_rejoin_timeout() -> None:
    st = q.Settings(min_size=1, max_size=3, grace=2, rejoin_timeout=30, keep_alive_interval=100)
    state, (a, b, _c) = form(st, ["a", "b", "c"])
    _, state = a.settle(state, 0.0)
    _, state = b.settle(state, 0.0)
    action = a.decide(state, 10.0)
    assert action.step is q.Step.WAIT and action.until == 30.0
    assert a.decide(state, 30.0).step is q.Step.COMPLETE


def test_joiners_wait_for_the_members_and_heal_from_the_newest() -> None:
    st = q.Settings(min_size=1, max_size=4, keep_alive_interval=100)
    state, (a, b, c) = form(st, ["a", "b", "c"])
    d = Sim("d", st, pid=99)
    action, state = d.settle(state, 0.0)
    assert action.step is q.Step.WAIT and action.until is not None
    assert q.should_reform(state, 1, ("a", "b", "c"))
    a.step, b.step, c.step = 5, 6, 5  # (b committed a step the others lost)
    for s in (a, b, c):
        _, state = s.settle(state, 1.0)
    assert state.epoch == 2 and state.members == ("a", "b", "c", "d")
    assert q.heal_plan(state) == (6, 1, (0, 2, 3))
    assert not q.should_reform(state, 2, state.members)


def test_max_size_keeps_extra_candidates_waiting_and_does_not_churn() -> None:
    st = q.Settings(min_size=1, max_size=2, keep_alive_interval=100)
    state, _sims = form(st, ["a", "b"])
    e = Sim("e", st)
    _, state = e.settle(state, 0.0)
    assert not q.should_reform(state, 1, ("a", "b"))  # no room


def test_every_member_gone_means_the_state_is_lost() -> None:
    st = q.Settings(min_size=1, max_size=3, keep_alive_interval=100)
    state, _sims = form(st, ["a", "b"])
    d = Sim("d", st)
    _, state = d.settle(state, 0.0, dead=frozenset({"a", "b"}))
    assert sorted(state.dead) == ["a", "b"]
    assert d.decide(state, 0.0).step is q.Step.ERROR_LOST


def test_below_min_size_the_survivors_wait_for_joiners() -> None:
    st = q.Settings(min_size=2, max_size=3, keep_alive_interval=100)
    state, (a, _b) = form(st, ["a", "b"])
    action, state = a.settle(state, 0.0, dead=frozenset({"b"}))
    assert action.step is q.Step.WAIT
    d = Sim("d", st)
    _, state = d.settle(state, 1.0)
    assert state.epoch == 2 and state.members == ("a", "d")


def test_a_waiting_candidate_whose_heartbeat_stops_is_dropped() -> None:
    st = q.Settings(min_size=1, max_size=4, keep_alive_interval=1, keep_alive_max_attempt=3)
    state, (_a, _b) = form(st, ["a", "b"])
    d = Sim("d", st)
    _, state = d.settle(state, 0.0)
    e = Sim("e", st)
    _, state = e.settle(state, 0.0)
    for t in (1.0, 2.0, 3.0):
        _, state = e.settle(state, t)  # e beats, d does not
    assert list(state.candidates) == ["e"]


def test_leaving_members_close_the_job() -> None:
    st = q.Settings(min_size=1, max_size=3)
    state, (_a, _b) = form(st, ["a", "b"])
    state = q.apply(state, q.decide_leave(state, "a", 0.0, FAR), "a")
    assert state.members == ("b",) and not state.closed
    state = q.apply(state, q.decide_leave(state, "b", 0.0, FAR), "b")
    assert state.closed and q.decide_leave(state, "b", 0.0, FAR).step is q.Step.FINISH
    assert Sim("z", st).decide(state, 0.0).step is q.Step.ERROR_CLOSED


def test_state_round_trips_through_json_and_refuses_garbage() -> None:
    st = q.Settings(min_size=1, max_size=None)
    state, (a, _b) = form(st, ["a", "b"])
    a.accuse = frozenset({"b"})
    _, state = a.settle(state, 0.0)
    assert q.State.decode(state.encode()) == state
    with pytest.raises(ValueError, match="not a quorum state"):
        q.State.decode(b"{}")


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="min_size"):
        q.Settings(min_size=3, max_size=2)
    with pytest.raises(ValueError, match="grace"):
        q.Settings(grace=-1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _a_then_b(store: HashStore, clock: FakeClock, st: q.Settings) -> tuple[_QuorumClient, _QuorumClient, q.State]:
    """a asks to join alone and times out (its clock jumps: no sleeping), as a candidate still;
    b's join then forms the quorum of both. Returns the clients and that state."""
    a = _QuorumClient(store, "a", q.Node(HERE, 1), st, clock)
    b = _QuorumClient(store, "b", q.Node(HERE, 2), st, clock)

    def wait(self: _QuorumClient, until: float | None) -> None:
        clock.now = until if until is not None else clock.now + 1.0
        self.refresh()

    a._wait = wait.__get__(a)  # type: ignore[method-assign]
    with pytest.raises(DistTimeoutError, match="1 of at least 2 nodes came within 3 s"):
        a.join(q.Join(0, -1, a.node), 3.0, 3.0)
    return a, b, b.join(q.Join(0, -1, b.node), FAR, FAR)  # (a is still a candidate: its beat stands still...)


def test_the_client_forms_a_quorum_on_a_store_and_times_out_with_a_message() -> None:
    store, clock = HashStore(), FakeClock()
    st = q.Settings(min_size=2, max_size=2)
    a, b, state = _a_then_b(store, clock, st)
    assert state.epoch == 1 and state.members == ("a", "b")
    b.leave(FAR)
    state = a.refresh()
    assert state.members == ("a",)
    a.leave(FAR)
    with pytest.raises(QuorumError, match="the job is over"):
        _QuorumClient(store, "c", q.Node(HERE, 3), st, clock).join(q.Join(0, -1, q.Node(HERE, 3)), FAR, FAR)


def test_a_leave_is_done_once_its_write_won_whatever_becomes_of_the_store_after() -> None:
    """The member that serves the job's store after a fail-over stops once it sees the others
    out of the state: a leaving member's marks after its winning write may find the store gone
    (it said "could not leave" though it had left)."""
    from tdist._core.errors import DistNetworkError

    class GoneAfterTheWrite(HashStore):
        gone = False

        def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
            value = super().compare_set(key, expected_value, desired_value)
            self.gone = self.gone or (value == desired_value and b'"members":["a"]' in value)
            return value

        def set(self, key: str, value: str | bytes) -> None:
            if self.gone:
                raise DistNetworkError("lost the connection to the store (its server stopped)")
            super().set(key, value)

    store = GoneAfterTheWrite()
    a, b, state = _a_then_b(store, FakeClock(), q.Settings(min_size=2, max_size=2))
    assert state.members == ("a", "b")
    b.leave(FAR)  # (its write leaves ["a"]: the store is gone from then on)
    assert store.gone and "b" not in a.refresh().members


def test_state_transfer_keeps_structure_and_receives_into_own_tensors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": [1, (2.5, torch.arange(3))]}
    wire: collections.deque[torch.Tensor] = collections.deque()
    nbytes = send_state(state, lambda t: wire.append(t.clone()))
    assert nbytes >= 3 * (300 * 300 + 300 + 600 + 2) * 4

    other = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    fresh = torch.optim.Adam(other.parameters())
    local = {"model": other.state_dict(), "optim": fresh.state_dict()}
    weight = other[0].weight

    def recv(t: torch.Tensor) -> None:
        t.copy_(wire.popleft().reshape(t.shape))

    got = recv_state(recv, local)
    assert not wire
    assert got["model"]["0.weight"].data_ptr() == weight.data_ptr()  # (received into the receiver's parameter)
    assert got["model"]._metadata == state["model"]._metadata
    other.load_state_dict(got["model"])
    fresh.load_state_dict(got["optim"])
    for p, r in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, r)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert got["extra"][0] == 1 and got["extra"][1][0] == 2.5 and torch.equal(got["extra"][1][1], torch.arange(3))
    assert copy.deepcopy(got["optim"]["param_groups"]) == opt.state_dict()["param_groups"]


def test_state_transfer_refuses_sparse_tensors() -> None:
    with pytest.raises(TypeError, match="dense CPU"):
        send_state({"s": torch.eye(3).to_sparse()}, lambda t: None)


def test_state_transfer_allocates_large_new_tensors_populated_and_writable() -> None:
    big = torch.arange(3 << 20, dtype=torch.float32).reshape(3, 1 << 20)  # 12 MiB
    wire: collections.deque[torch.Tensor] = collections.deque()
    send_state({"momentum": big, "step": torch.tensor(5)}, lambda t: wire.append(t.clone()))
    got = recv_state(lambda t: t.copy_(wire.popleft().reshape(t.shape)), {})
    assert torch.equal(got["momentum"], big) and got["momentum"].shape == (3, 1 << 20)
    got["momentum"].mul_(2)  # (an optimizer updates it in place)
    assert got["momentum"][2, -1].item() == 2 * ((3 << 20) - 1) and got["step"].item() == 5
