"""``split_group`` and ``shrink_group`` with real processes: splits made by their members only,
and a default group shrunk by the survivors of a rank that died (torch serves neither on CPU)."""

from __future__ import annotations

import multiprocessing
import os
import select
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import tdist
from tdist.testing import run_processes

pytestmark = pytest.mark.timeout(90)


def _init(rank: int, world: int, port: int) -> None:
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))


def _sum_of(values: list[float], group: Any) -> float:
    t = torch.tensor([values[tdist.get_rank()]])
    tdist.all_reduce(t, group=group)
    return float(t.item())


def _splits(rank: int, world: int, port: int) -> dict[str, Any]:
    _init(rank, world, port)
    try:
        out: dict[str, Any] = {}
        for bad, kind in (
            ([], "cannot be None or empty"),
            ([[0, 1], []], "cannot be empty"),
            ([[0, 0]], "duplicate"),
            ([[0, 1], [1, 2]], "appeared in both"),
            ([[0, 4]], "not a group rank"),
        ):
            with pytest.raises(ValueError, match=kind):
                tdist.split_group(split_ranks=bad)
        # ranks 0, 1 in one split, rank 2 alone, rank 3 in none
        mine = tdist.split_group(split_ranks=[[1, 0], [2]])
        values = [1.0, 2.0, 4.0, 8.0]
        out["size"] = None if mine is None else tdist.get_world_size(mine)
        out["sum"] = None if mine is None else _sum_of(values, mine)
        out["desc"] = None if mine is None else mine.group_desc
        # a sub-group's split takes group ranks of that sub-group: [1, 2, 3] -> [[0], [1, 2]]
        # the descriptions count every split, on every rank (rank 3 was in none of the first)
        again = tdist.split_group(split_ranks=[[3], [0, 1, 2]])
        out["again"] = again.group_desc if again is not None else None
        sub = tdist.new_group([1, 2, 3])
        if rank in (1, 2, 3):
            part = tdist.split_group(sub, [[0], [2, 1]])
            out["sub_ranks"] = tdist.get_process_group_ranks(part)
            out["sub_sum"] = _sum_of(values, part)
        return out
    finally:
        tdist.destroy_process_group()


def test_split_group_makes_each_ranks_split_and_none_outside_them() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        out = run_processes(_splits, 4, master.port, timeout=80)
    finally:
        master.close()
    assert [o["size"] for o in out] == [2, 2, 1, None]
    assert [o["sum"] for o in out] == [3.0, 3.0, 4.0, None]
    assert out[0]["desc"] == "default_pg:split:0"
    assert {o["again"] for o in out} == {"default_pg:split:1"}
    assert [o.get("sub_ranks") for o in out] == [None, [1], [2, 3], [2, 3]]
    assert [o.get("sub_sum") for o in out] == [None, 2.0, 12.0, 12.0]


def _dies_after_one_all_reduce(port: int) -> None:
    _init(2, 3, port)
    tdist.distributed_c10d._get_default_store().set("dying_pid", str(os.getpid()))
    tdist.all_reduce(torch.ones(1))
    os._exit(0)  # (gone at once: nothing closed, no goodbye)


def _survivor(rank: int, _world: int, port: int, noticed: bool) -> dict[str, Any]:
    _init(rank, 3, port)
    tdist.all_reduce(torch.ones(1))
    side = tdist.new_group([0, 1])
    out: dict[str, Any] = {}
    if not noticed:  # (they learn of it some other way: the old group never failed here)
        pid = int(tdist.distributed_c10d._get_default_store().get("dying_pid"))
        gone = os.pidfd_open(pid)
        try:
            assert select.select([gone], [], [], 30)[0], "rank 2 did not exit"
        finally:
            os.close(gone)
    else:
        with pytest.raises(tdist.DistError) as failed:
            tdist.all_reduce(torch.ones(1))
        out["error"] = str(failed.value)
    with pytest.raises(RuntimeError, match="should not call shrink_group"):
        tdist.shrink_group([rank])
    with pytest.raises(TypeError, match="must be a list"):
        tdist.shrink_group((2,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of bounds"):
        tdist.shrink_group([3])
    with pytest.raises(ValueError, match="shrink_flags"):
        tdist.shrink_group([2], shrink_flags=7)
    new = tdist.shrink_group([2])
    try:
        out["rank"], out["size"] = tdist.get_rank(), tdist.get_world_size()
        out["is_world"] = new is tdist.group.WORLD
        t = torch.tensor([10.0 * (rank + 1)])
        tdist.all_reduce(t)
        out["sum"] = t.item()
        # torch's default group moved with ours: torch's modules (DDP) reach the new one
        out["torch_size"] = torch_dist.get_world_size()
        u = torch.ones(2)
        torch_dist.all_reduce(u)
        out["torch_sum"] = u.tolist()
        with pytest.raises((ValueError, tdist.DistError)):
            tdist.all_reduce(torch.ones(1), group=side)  # (ended with the old default group)
        return out
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("noticed", [True, False], ids=["after-a-failed-all-reduce", "at-once"])
def test_survivors_shrink_the_default_group_after_a_rank_dies_and_go_on(noticed: bool) -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    dying = multiprocessing.get_context("fork").Process(target=_dies_after_one_all_reduce, args=(master.port,))
    dying.start()
    try:
        out = run_processes(_survivor, 2, master.port, noticed, timeout=80)
        dying.join(10)
        assert dying.exitcode == 0
    finally:
        if dying.is_alive():
            dying.kill()
        master.close()
    assert all("rank 2" in o["error"] for o in out if noticed), out
    assert [(o["rank"], o["size"], o["is_world"]) for o in out] == [(0, 2, True), (1, 2, True)]
    assert [o["sum"] for o in out] == [30.0, 30.0]
    assert [o["torch_size"] for o in out] == [2, 2]
    assert [o["torch_sum"] for o in out] == [[2.0, 2.0]] * 2


def _shrinks_a_sub_group(rank: int, world: int, port: int) -> Any:
    _init(rank, world, port)
    try:
        sub = tdist.new_group([2, 0, 1], sort_ranks=False)  # group ranks: 2 -> 0, 0 -> 1, 1 -> 2
        store = tdist.distributed_c10d._get_default_store()
        if rank == 2:  # excluded (group rank 0): it takes no part, and waits for the others
            store.wait(["shrunk/0", "shrunk/1"])
            return None
        new = tdist.shrink_group([0], group=sub)
        ranks = tdist.get_process_group_ranks(new)
        total = _sum_of([1.0, 2.0, 4.0], new)
        with pytest.raises((ValueError, tdist.DistError)):
            tdist.all_reduce(torch.ones(1), group=sub)  # (ended)
        still = tdist.get_world_size(), tdist.get_rank()
        store.set(f"shrunk/{rank}", "1")
        return ranks, total, still, new.group_desc
    finally:
        tdist.destroy_process_group()


def test_a_sub_group_shrinks_among_the_ranks_that_call_and_keeps_their_order() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        out = run_processes(_shrinks_a_sub_group, 3, master.port, timeout=80)
    finally:
        master.close()
    assert out[2] is None
    for rank in (0, 1):
        ranks, total, still, desc = out[rank]
        assert ranks == [0, 1] and total == 3.0 and still == (3, rank)
        assert desc.endswith(":shrunk")


def _methods(rank: int, world: int, port: int) -> dict[str, Any]:
    """torch's ProcessGroup methods: split_group (members only), merge_remote_group, the
    coalesced tensor collectives, Work.get_future_result; and torch's coalescing manager."""
    _init(rank, world, port)
    try:
        pg = tdist.group.WORLD
        out: dict[str, Any] = {"gloo": pg.GLOO == pg.BackendType.GLOO == tdist.ProcessGroup.GLOO == 1}
        # (torch's C++ answered None, raised, raised on a group that runs on tdist)
        pg.get_group_store().set(f"k{rank}", "v")
        out["twin"] = (pg.use_pg_for_symm_mem_rendezvous, pg._get_sequence_number_for_group() >= 0)
        w = torch_dist.all_reduce(torch.ones(2), async_op=True)  # (torch's function, torch's Work)
        out["work"] = (w.result()[0].tolist(), w._get_op_type())
        for bad, kind in (([], "cannot be empty"), ([0, 0], "duplicates"), ([0, 1, 2, 0], "no larger")):
            with pytest.raises(RuntimeError, match=kind):
                pg.split_group(bad)
        if rank != 1:  # (rank 1 is in no split and need not call)
            part = pg.split_group([2, 0])
            out["split"] = (part.rank(), part.size(), _sum_of([1.0, 2.0, 4.0], part), part.group_desc)
        if rank == 1:
            assert pg.split_group([0, 2]) is None
        merged = pg.merge_remote_group(tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30)), world)
        t = torch.tensor([float(1 << merged.rank())])
        merged.allreduce([t]).wait()
        out["merged"] = (merged.size(), t.item(), merged.group_name)
        tdist.all_reduce(t, group=merged)  # (tdist's functions take a group of no world)
        out["merged_again"] = t.item()
        if merged.rank() < 2:  # (a group of no world splits into another)
            half = merged.split_group([1, 0])
            u = torch.ones(1)
            half.allreduce([u]).wait()
            out["half"] = (half.group_name, u.item())
        merged.shutdown()
        gathered = [torch.zeros(2 * world), torch.zeros(world)]
        work = pg.allgather_into_tensor_coalesced(gathered, [torch.full((2,), float(rank)), torch.full((1,), rank + 0.5)])
        out["future_result"] = work.get_future_result().wait()
        out["ag"] = [g.tolist() for g in gathered]
        reduced = [torch.zeros(1), torch.zeros(2)]
        pg.reduce_scatter_tensor_coalesced(
            reduced, [torch.arange(world, dtype=torch.float) + rank, torch.ones(2 * world)]
        ).wait()
        out["rs"] = [r.tolist() for r in reduced]
        # torch's coalescing manager (the documented use: plain calls in an async_ops block)
        a, b, c = torch.ones(2), torch.ones(3), torch.zeros(world)
        with tdist._coalescing_manager(async_ops=True) as cm:
            assert tdist.all_reduce(a) is None
            tdist.all_reduce(b)
            tdist.all_gather_into_tensor(c, torch.tensor([float(rank)]))
        cm.wait()
        out["coalesced"] = (len(cm.works), a.tolist(), b.tolist(), c.tolist())
        return out
    finally:
        tdist.destroy_process_group()


def test_process_group_methods_split_merge_and_coalesced_collectives() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        out = run_processes(_methods, 3, master.port, timeout=80)
    finally:
        master.close()
    assert [o["work"] for o in out] == [([3.0, 3.0], 1)] * 3
    assert all(o["gloo"] for o in out) and [o["twin"] for o in out] == [(False, True)] * 3
    assert out[0]["split"] == (0, 2, 5.0, "default_pg:split:[0, 2]")
    assert out[2]["split"][:3] == (1, 2, 5.0) and "split" not in out[1]
    assert [o["merged"][:2] for o in out] == [(3, 7.0)] * 3 and out[0]["merged"][2] == "0:merge"
    assert [o["merged_again"] for o in out] == [21.0] * 3
    assert sorted(o["half"] for o in out if "half" in o) == [("0:merge:split:[0, 1]", 2.0)] * 2
    assert [o["future_result"] for o in out] == [0, 0, 0]
    assert out[1]["ag"] == [[0.0, 0.0, 1.0, 1.0, 2.0, 2.0], [0.5, 1.5, 2.5]]
    # rank r's block r of (arange + rank) summed over ranks: 3 r + 3; of ones: 3
    assert out[2]["coalesced"] == (3, [3.0, 3.0], [3.0, 3.0, 3.0], [0.0, 1.0, 2.0])
    assert [o["rs"] for o in out] == [[[3.0], [3.0, 3.0]], [[6.0], [3.0, 3.0]], [[9.0], [3.0, 3.0]]]
