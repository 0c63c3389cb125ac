"""Collective schedules: every algorithm, every world size 1..17, run through the simulator."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import pytest

from tdist.c10d import _schedules as S
from tdist.c10d._schedules import (
    Action,
    Algorithm,
    Collective,
    CostModel,
    Recv,
    Schedule,
    ScheduleError,
    Send,
    Step,
    Topology,
    ceil_log2,
    check_schedules,
    choose_algorithm,
    chunk_bounds,
    peers_of,
)
from tdist.c10d._simulate import join, simulate, split

WORLD_SIZES = list(range(1, 18))
OPS: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.add,
    "max": np.maximum,
    "product": np.multiply,
}


def numels(n: int) -> list[int]:
    """Empty, fewer elements than ranks, exactly n, uneven, and larger."""
    return sorted({0, 1, max(n - 1, 0), n, 2 * n + 3, 37})


def roots(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


def data(rng: np.random.Generator, op: str, size: int) -> np.ndarray:
    if op == "product":  # 3**17 fits easily in int64, so products stay exact
        return rng.choice(np.array([-3, -2, -1, 1, 2, 3], dtype=np.int64), size=size)
    return rng.integers(-1000, 1000, size=size, dtype=np.int64)


@functools.cache
def world(builder: Callable[..., Schedule], n: int, *args: object) -> list[Schedule]:
    """All ranks' schedules, checked for consistency and alignment."""
    schedules = [builder(r, n, *args) for r in range(n)]
    check_schedules(schedules)
    assert len({s.num_steps for s in schedules}) == 1, "steps must be aligned across ranks"
    return schedules


def reduce_all(op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    return functools.reduce(OPS[op], arrays)


# --------------------------------------------------------------------------------------------
# chunk_bounds


@pytest.mark.parametrize("nchunks", [1, 2, 3, 7, 17])
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 16, 17, 100])
def test_chunk_bounds_matches_array_split(numel: int, nchunks: int) -> None:
    bounds = chunk_bounds(numel, nchunks)
    assert len(bounds) == nchunks
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    expected = [len(p) for p in np.array_split(np.arange(numel), nchunks)]
    assert [b - a for a, b in bounds] == expected


def test_chunk_bounds_edges() -> None:
    assert chunk_bounds(0, 0) == []
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for bad in ((-1, 2), (3, -1), (3, 0)):
        with pytest.raises(ScheduleError):
            chunk_bounds(*bad)


def test_ceil_log2() -> None:
    assert [ceil_log2(n) for n in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]


# --------------------------------------------------------------------------------------------
# All-reduce


def run_all_reduce(schedules: list[Schedule], op: str, numel: int, seed: int) -> None:
    n = len(schedules)
    rng = np.random.default_rng(seed)
    xs = [data(rng, op, numel) for _ in range(n)]
    nchunks = schedules[0].nchunks
    res = simulate(schedules, [split(x, nchunks) for x in xs], OPS[op])
    expected = reduce_all(op, xs)
    for r in range(n):
        np.testing.assert_array_equal(join(res.outputs[r], nchunks), expected)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_all_reduce(n: int, op: str) -> None:
    schedules = world(S.ring_all_reduce, n)
    assert schedules[0].num_steps == 2 * (n - 1)
    assert schedules[0].nchunks == n
    for s in schedules:
        for step in s.steps:  # one chunk out, one chunk in, every step: bandwidth-optimal
            assert [len(t.chunks) for t in step.sends] == [1]
            assert [len(t.chunks) for t in step.recvs] == [1]
            assert not {c for t in step.sends for c in t.chunks} & {
                c for t in step.recvs for c in t.chunks
            }
    for numel in numels(n):
        run_all_reduce(schedules, op, numel, seed=n * 100 + numel)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_recursive_doubling_all_reduce(n: int, op: str) -> None:
    schedules = world(S.recursive_doubling_all_reduce, n)
    p = 1 << (n.bit_length() - 1)
    expected_steps = int(math.log2(p)) + (2 if n != p else 0)
    assert schedules[0].num_steps == expected_steps
    for numel in numels(n):
        run_all_reduce(schedules, op, numel, seed=n * 100 + numel)


def host_layouts(n: int) -> dict[str, list[Hashable]]:
    shuffled = list(range(n))
    random.Random(n).shuffle(shuffled)
    return {
        "one_host": ["a"] * n,
        "own_hosts": list(range(n)),
        "blocks_of_3": [r // 3 for r in range(n)],
        "round_robin_3": [f"h{r % 3}" for r in range(n)],
        "uneven": [min(r.bit_length(), 3) for r in shuffled],
    }


@pytest.mark.parametrize("inter", [Algorithm.RING, Algorithm.RECURSIVE_DOUBLING])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_hierarchical_all_reduce(n: int, op: str, inter: Algorithm) -> None:
    for name, hosts in host_layouts(n).items():
        schedules = world(S.hierarchical_all_reduce, n, tuple(hosts), inter)
        groups: dict[Hashable, list[int]] = {}
        for r, h in enumerate(hosts):
            groups.setdefault(h, []).append(r)
        nhosts = len(groups)
        local = max(ceil_log2(len(g)) for g in groups.values())
        if inter is Algorithm.RING:
            inter_steps = 2 * (nhosts - 1)
        else:
            inter_steps = world(S.recursive_doubling_all_reduce, nhosts)[0].num_steps
        assert schedules[0].num_steps == 2 * local + inter_steps, name
        leaders = {g[0] for g in groups.values()}
        for r, s in enumerate(schedules):  # only leaders talk across hosts
            crossing = {p for p in peers_of(s) if hosts[p] != hosts[r]}
            assert not crossing or r in leaders, (name, r, crossing)
        for numel in numels(n):
            run_all_reduce(schedules, op, numel, seed=n * 100 + numel)


# --------------------------------------------------------------------------------------------
# Reduce-scatter, all-gather, all-to-all


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_reduce_scatter(n: int, op: str) -> None:
    schedules = world(S.ring_reduce_scatter, n)
    assert schedules[0].num_steps == n - 1
    rng = np.random.default_rng(n)
    for numel in numels(n):
        xs = [data(rng, op, numel) for _ in range(n)]
        res = simulate(schedules, [split(x, n) for x in xs], OPS[op])
        expected = reduce_all(op, xs)
        for r, (a, b) in enumerate(chunk_bounds(numel, n)):
            assert res.outputs[r].keys() == {r}
            np.testing.assert_array_equal(res.outputs[r][r], expected[a:b])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_all_gather(n: int) -> None:
    schedules = world(S.ring_all_gather, n)
    assert schedules[0].num_steps == n - 1
    rng = np.random.default_rng(n)
    for sizes in ([3] * n, [r % 3 for r in range(n)], [0] * n):
        pieces = [rng.integers(0, 100, size=k) for k in sizes]
        res = simulate(schedules, [{r: pieces[r]} for r in range(n)])
        for r in range(n):
            np.testing.assert_array_equal(join(res.outputs[r], n), np.concatenate(pieces))


# --------------------------------------------------------------------------------------------
# Rooted collectives


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_tree_broadcast(n: int) -> None:
    rng = np.random.default_rng(n)
    for root in roots(n):
        schedules = world(S.binomial_tree_broadcast, n, root)
        assert schedules[0].num_steps == ceil_log2(n)
        # every rank but the root receives the buffer exactly once
        for r, s in enumerate(schedules):
            assert sum(len(st.recvs) for st in s.steps) == (0 if r == root else 1)
        for numel in numels(n):
            x = rng.integers(0, 100, size=numel)
            inputs = [{0: x} if r == root else {} for r in range(n)]
            res = simulate(schedules, inputs)
            for r in range(n):
                np.testing.assert_array_equal(res.outputs[r][0], x)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_chain_broadcast(n: int) -> None:
    rng = np.random.default_rng(n)
    for root in roots(n):
        for nchunks in sorted({1, 3, n + 2}):
            schedules = world(S.chain_broadcast, n, root, nchunks)
            assert schedules[0].num_steps == (nchunks + n - 2 if n > 1 else 0)
            for r, s in enumerate(schedules):  # a chain: one successor, one predecessor
                assert peers_of(s) <= {(r - 1) % n, (r + 1) % n}
            for numel in numels(n):
                x = rng.integers(0, 100, size=numel)
                inputs = [split(x, nchunks) if r == root else {} for r in range(n)]
                res = simulate(schedules, inputs)
                for r in range(n):
                    np.testing.assert_array_equal(join(res.outputs[r], nchunks), x)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_tree_reduce(n: int, op: str) -> None:
    rng = np.random.default_rng(n)
    for root in roots(n):
        schedules = world(S.binomial_tree_reduce, n, root)
        assert schedules[0].num_steps == ceil_log2(n)
        for numel in numels(n):
            xs = [data(rng, op, numel) for _ in range(n)]
            res = simulate(schedules, [{0: x} for x in xs], OPS[op])
            np.testing.assert_array_equal(res.outputs[root][0], reduce_all(op, xs))
            assert all(not res.outputs[r] for r in range(n) if r != root)


# --------------------------------------------------------------------------------------------
# Barrier


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_dissemination_barrier(n: int) -> None:
    schedules = world(S.dissemination_barrier, n)
    assert schedules[0].num_steps == ceil_log2(n)
    assert all(t.chunks == () for s in schedules for st in s.steps for t in st.sends)
    res = simulate(schedules, [{} for _ in range(n)])
    assert res.heard_from == [frozenset(range(n))] * n
    if n > 2:  # one round fewer is not a barrier
        cut = [dataclasses.replace(s, steps=s.steps[:-1]) for s in schedules]
        res = simulate(cut, [{} for _ in range(n)])
        assert any(h != frozenset(range(n)) for h in res.heard_from)


# --------------------------------------------------------------------------------------------
# peers_of, argument errors


def test_peers_of() -> None:
    assert peers_of(S.ring_all_reduce(0, 1)) == frozenset()
    assert peers_of(S.ring_all_reduce(0, 5)) == {1, 4}
    assert peers_of(S.ring_all_reduce(0, 2)) == {1}
    assert peers_of(S.binomial_tree_broadcast(0, 8)) == {4, 2, 1}
    assert peers_of(S.binomial_tree_broadcast(7, 8, root=3)) == {3, 1, 0}  # v=4: parent 0
    assert peers_of(S.binomial_tree_broadcast(2, 8, root=3)) == {1}  # v=7: a leaf
    # n=6: 0 folds into 1, 2 into 3; virtual ranks 0..3 are ranks 1, 3, 4, 5
    assert peers_of(S.recursive_doubling_all_reduce(1, 6)) == {0, 3, 4}
    # leaders of hosts a=(0,1), b=(2,3), c=(4)
    hosts = ["a", "a", "b", "b", "c"]
    assert peers_of(S.hierarchical_all_reduce(0, 5, hosts)) == {1, 2, 4}
    assert peers_of(S.hierarchical_all_reduce(3, 5, hosts)) == {2}


@pytest.mark.parametrize(
    "call",
    [
        lambda: S.ring_all_reduce(0, 0),
        lambda: S.ring_all_reduce(3, 3),
        lambda: S.ring_all_gather(-1, 3),
        lambda: S.binomial_tree_broadcast(0, 3, root=3),
        lambda: S.chain_broadcast(0, 3, 0, nchunks=0),
        lambda: S.hierarchical_all_reduce(0, 3, ["a", "b"]),
        lambda: S.hierarchical_all_reduce(0, 2, ["a", "b"], Algorithm.CHAIN),
    ],
)
def test_bad_arguments(call: Callable[[], Schedule]) -> None:
    with pytest.raises(ScheduleError):
        call()


def test_schedule_is_frozen_and_hashable() -> None:
    s = S.ring_all_reduce(1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rank = 2  # type: ignore[misc]
    assert hash(s) == hash(S.ring_all_reduce(1, 4))
    assert isinstance(ScheduleError("x"), ValueError)


# --------------------------------------------------------------------------------------------
# check_schedules rejects broken worlds


def replace_step(schedules: list[Schedule], rank: int, k: int, step: Step) -> list[Schedule]:
    out = list(schedules)
    steps = list(out[rank].steps)
    steps[k] = step
    out[rank] = dataclasses.replace(out[rank], steps=tuple(steps))
    return out


def test_check_rejects_missing_receive() -> None:
    good = world(S.ring_all_reduce, 4)
    bad = replace_step(good, 1, 2, dataclasses.replace(good[1].steps[2], recvs=()))
    with pytest.raises(ScheduleError, match=r"rank 0 step 2 sends .* receives nothing"):
        check_schedules(bad)
    with pytest.raises(ScheduleError):
        simulate(bad, [split(np.arange(4), 4)] * 4)


def test_check_rejects_missing_send() -> None:
    good = world(S.binomial_tree_broadcast, 5, 0)
    bad = replace_step(good, 0, 0, Step())
    with pytest.raises(ScheduleError, match="sends nothing"):
        check_schedules(bad)


def test_check_rejects_wrong_chunks() -> None:
    good = world(S.ring_all_gather, 3)
    step = good[0].steps[0]
    bad = replace_step(good, 0, 0, dataclasses.replace(step, sends=(Send(1, (2,)),)))
    with pytest.raises(ScheduleError, match="expects"):
        check_schedules(bad)


def test_check_rejects_cross_step_deadlock() -> None:
    # 0 receives from 1 in step 0 and sends in step 1; 1 does the same: a classic deadlock.
    def sched(rank: int) -> Schedule:
        peer = 1 - rank
        steps = (Step(recvs=(Recv(peer, (0,)),)), Step(sends=(Send(peer, (0,)),)))
        return Schedule(
            rank, 2, Collective.BROADCAST, Algorithm.CHAIN, 1, steps, frozenset({0}), frozenset({0})
        )

    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedules([sched(0), sched(1)])


def test_check_rejects_sending_what_it_does_not_hold() -> None:
    good = world(S.binomial_tree_broadcast, 4, 0)
    # rank 1 would forward the buffer in step 0, before it received it
    bad = replace_step(good, 1, 0, Step(sends=(Send(3, (0,)),)))
    bad = replace_step(bad, 3, 0, Step(recvs=(Recv(1, (0,)),)))
    bad = replace_step(bad, 3, 1, Step())
    bad = replace_step(bad, 2, 1, Step())
    bad = replace_step(bad, 1, 1, Step(recvs=(Recv(0, (0,)),)))
    with pytest.raises(ScheduleError, match="before it holds"):
        check_schedules(bad)


def test_check_rejects_reduce_into_missing_and_missing_outputs() -> None:
    good = world(S.binomial_tree_broadcast, 2, 0)
    bad = replace_step(good, 1, 0, Step(recvs=(Recv(0, (0,), Action.REDUCE),)))
    with pytest.raises(ScheduleError, match="does not hold"):
        check_schedules(bad)
    cut = [dataclasses.replace(s, steps=()) for s in good]
    with pytest.raises(ScheduleError, match="without its output"):
        check_schedules(cut)


def test_check_rejects_local_mistakes() -> None:
    good = world(S.ring_all_reduce, 3)
    cases = {
        "peer": Step(sends=(Send(0, (0,)),)),  # to itself
        "bad chunk ids": Step(sends=(Send(1, (0, 0)),)),
        "more than one": Step(sends=(Send(1, (0,)), Send(1, (1,)))),
        "twice": Step(recvs=(Recv(1, (0,), Action.REDUCE), Recv(2, (0,), Action.REDUCE))),
    }
    for message, step in cases.items():
        with pytest.raises(ScheduleError, match=message):
            check_schedules(replace_step(good, 0, 0, step))
    with pytest.raises(ScheduleError, match="expected rank"):
        check_schedules(good[::-1])
    with pytest.raises(ScheduleError, match="nchunks"):
        check_schedules([good[0], good[1], S.recursive_doubling_all_reduce(2, 3)])
    with pytest.raises(ScheduleError):
        check_schedules([])


# --------------------------------------------------------------------------------------------
# choose_algorithm


def test_choose_all_reduce_by_size() -> None:
    assert choose_algorithm(Collective.ALL_REDUCE, 1024, 8) is Algorithm.RECURSIVE_DOUBLING
    assert choose_algorithm(Collective.ALL_REDUCE, 64 << 20, 8) is Algorithm.RING
    # two ranks: one exchange beats two half ones at every size
    assert choose_algorithm(Collective.ALL_REDUCE, 1 << 30, 2) is Algorithm.RECURSIVE_DOUBLING
    # the crossover moves with the cost model's latency
    slow = CostModel(latency_s=1.0)
    assert choose_algorithm(Collective.ALL_REDUCE, 64 << 20, 8, cost=slow) is (
        Algorithm.RECURSIVE_DOUBLING
    )


def test_choose_crossovers_documented() -> None:
    def crossover(n: int) -> int:
        lo, hi = 1, 1 << 34
        while lo < hi:
            mid = (lo + hi) // 2
            if choose_algorithm(Collective.ALL_REDUCE, mid, n) is Algorithm.RING:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # the numbers quoted in choose_algorithm's docstring, within 10%
    for n, mb in ((3, 0.075), (4, 1.0), (5, 0.21), (8, 1.1), (16, 1.5), (17, 0.79)):
        assert abs(crossover(n) / 1e6 - mb) / mb < 0.1, (n, crossover(n))


def test_choose_by_topology() -> None:
    one = Topology.one_host(4)
    assert choose_algorithm(Collective.ALL_REDUCE, 1, 4, one) is Algorithm.SHM
    no_shm = Topology.one_host(4, shm=False)
    assert choose_algorithm(Collective.ALL_REDUCE, 1, 4, no_shm) is Algorithm.RECURSIVE_DOUBLING
    assert (
        choose_algorithm(Collective.ALL_REDUCE, 1, 4, one, shm_collectives=frozenset())
        is Algorithm.RECURSIVE_DOUBLING
    )
    assert choose_algorithm(Collective.ALL_REDUCE, 1, 1, Topology.one_host(1)) is (
        Algorithm.RECURSIVE_DOUBLING
    )
    multi = Topology.from_hosts(["a", "a", "b", "b"])
    assert (multi.num_hosts, multi.max_ranks_per_host) == (2, 2)
    assert choose_algorithm(Collective.ALL_REDUCE, 1 << 20, 4, multi) is Algorithm.HIERARCHICAL
    spread = Topology.from_hosts(range(4))
    assert choose_algorithm(Collective.ALL_REDUCE, 64 << 20, 4, spread) is Algorithm.RING
    with pytest.raises(ScheduleError):
        choose_algorithm(Collective.ALL_REDUCE, 1, 3, multi)


def test_choose_algorithm_is_for_all_reduce_only() -> None:
    for collective in Collective:
        if collective is not Collective.ALL_REDUCE:
            with pytest.raises(ScheduleError, match="all_reduce"):
                choose_algorithm(collective, 1 << 20, 5)


def test_all_names_exported() -> None:
    public = {name for name in vars(S) if not name.startswith("_")}
    imported = {
        "annotations",
        "enum",
        "Hashable",
        "Iterable",
        "Sequence",
        "dataclass",
        "DistError",
    }
    assert set(S.__all__) == public - imported


def test_reduction_cost_moves_large_all_reduce_to_the_ring() -> None:
    """With reductions in the model, recursive doubling (which reduces the whole buffer at each
    step) loses large buffers to the ring even at n = 2; without them it never does."""
    big = 64 << 20
    assert choose_algorithm(Collective.ALL_REDUCE, big, 2) == Algorithm.RECURSIVE_DOUBLING
    cost = CostModel(reduce_bytes_per_s=4e9)
    assert choose_algorithm(Collective.ALL_REDUCE, big, 2, cost=cost) == Algorithm.RING
    assert choose_algorithm(Collective.ALL_REDUCE, 4, 2, cost=cost) == Algorithm.RECURSIVE_DOUBLING
    assert cost.estimate(Collective.ALL_REDUCE, Algorithm.RING, big, 2) > CostModel().estimate(
        Collective.ALL_REDUCE, Algorithm.RING, big, 2
    )
