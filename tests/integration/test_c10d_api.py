"""The module-level c10d API end to end over the tcp backend, ranks as threads of this process:
every collective and its uneven, async, numpy, complex and sub-group forms, point to point,
object collectives, ``monitored_barrier``, debug-mode mismatch reports, destroy and re-init."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tdist as dist
from tdist.c10d._api import _destroy_all_worlds_for_tests
from tdist.c10d._debug import CollectiveMismatchError
from tdist.testing import LocalStore, free_port, local_store, run_threads

from .._sync import join_or_kill

pytestmark = pytest.mark.timeout(60)

PG_TIMEOUT = timedelta(seconds=20)
SIZES = [1, 2, 3, 4]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


@pytest.fixture(autouse=True)
def _clean_world() -> Iterator[None]:
    yield
    _destroy_all_worlds_for_tests()


def spmd(fn: Callable[..., Any], ws: int, *args: Any, timeout: float = 40.0,
         backend: str | None = "gloo", pg_timeout: timedelta = PG_TIMEOUT) -> list[Any]:
    """Run ``fn(rank, ws, *args)`` on ``ws`` threads, each in a process group of its own."""
    store = dist.HashStore()
    store.set_timeout(pg_timeout)

    def body(rank: int, world_size: int) -> Any:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
        try:
            return fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()

    return run_threads(body, ws, timeout=timeout)


def vals(rank: int, n: int = 4, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Small distinct integers per rank (exact in every dtype used here)."""
    return torch.tensor([(rank * 3 + i * 5) % 7 + 1 for i in range(n)], dtype=dtype)


def reference(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = {
            "SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
            "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor,
        }[op](acc, t)
    return acc


# -- reductions ------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", SIZES)
def test_all_reduce_every_op(ws: int) -> None:
    def body(rank: int, ws: int) -> dict[str, list[int]]:
        out = {}
        for op in INT_OPS:
            t = vals(rank)
            assert dist.all_reduce(t, op=getattr(dist.ReduceOp, op)) is None
            out[op] = t.tolist()
        f = torch.tensor([2.0 * rank, 4.0], dtype=torch.float64)
        dist.all_reduce(f, op=dist.ReduceOp.AVG)
        out["AVG"] = f.tolist()
        return out

    for res in spmd(body, ws):
        for op in INT_OPS:
            assert res[op] == reference(op, [vals(r) for r in range(ws)]).tolist(), op
        assert res["AVG"] == [float(ws - 1), 4.0]


@pytest.mark.parametrize("ws", [2, 3])
def test_all_reduce_dtypes_views_numpy_complex(ws: int) -> None:
    dtypes = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.float16, torch.bfloat16,
              torch.float32, torch.float64]

    def body(rank: int, ws: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for dt in dtypes:
            t = vals(rank, 5, dt)
            dist.all_reduce(t)
            out[str(dt)] = t.tolist()
        b = torch.tensor([rank == 0, False, True])
        dist.all_reduce(b)
        out["bool"] = b.tolist()
        m = torch.arange(12, dtype=torch.int64).reshape(4, 3) * (rank + 1)
        dist.all_reduce(m[:, 1])  # a strided column: only it changes
        out["view"] = m.tolist()
        a = np.arange(4, dtype=np.float32) * (rank + 1)
        dist.all_reduce(a)
        out["numpy"] = a.tolist()
        c = torch.tensor([1 + 2j, -1j], dtype=torch.complex64) * (rank + 1)
        dist.all_reduce(c)
        out["complex"] = c.tolist()
        return out

    total = sum(range(1, ws + 1))
    for rank, res in enumerate(spmd(body, ws)):
        for dt in dtypes:
            assert res[str(dt)] == sum(vals(r, 5, torch.int64) for r in range(ws)).to(dt).tolist(), dt
        assert res["bool"] == [True, False, True]
        expect = (torch.arange(12).reshape(4, 3) * (rank + 1)).tolist()
        for i in range(4):
            expect[i][1] = (i * 3 + 1) * total
        assert res["view"] == expect
        assert res["numpy"] == [float(i * total) for i in range(4)]
        assert res["complex"] == [complex(total, 2 * total), complex(0, -total)]


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("ws", [2, 3])
def test_tensors_whose_elements_share_memory(ws: int, shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An expanded tensor (stride 0) or overlapping windows (``unfold``) in ``all_reduce``,
    ``reduce`` and ``broadcast``: each memory location takes the result of its elements, on
    the arena and over sockets, as gloo (``copy_`` refuses such a tensor); where a collective
    writes other ranks' data into one (``all_gather``), it is refused before anything is sent,
    on every rank, and the group goes on."""
    monkeypatch.setenv("TDIST_SHM", shm)

    def body(rank: int, ws: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        t = torch.full((1,), rank + 1.0).expand(3)
        dist.all_reduce(t)
        out["all_reduce"] = t.tolist()
        t = torch.full((1, 1), rank + 1).expand(2, 3)
        dist.reduce(t, 0, op=dist.ReduceOp.MAX)
        out["reduce"] = t.tolist()
        t = torch.full((1,), rank + 5.0).expand(4)
        dist.broadcast(t, ws - 1)  # (the root's tensor is expanded too)
        out["broadcast"] = t.tolist()
        base = torch.arange(5.0) + rank
        windows = base.unfold(0, 3, 1)  # rows [0:3], [1:4], [2:5]: shared elements
        dist.all_reduce(windows)
        out["unfold"] = (windows.tolist(), base.tolist())
        try:
            dist.all_gather([torch.zeros(1).expand(2) for _ in range(ws)], torch.ones(2))
        except RuntimeError as exc:
            out["all_gather"] = str(exc)
        t = torch.ones(2)
        dist.all_reduce(t)
        out["after"] = t.tolist()
        return out

    total = sum(range(1, ws + 1))
    base = sum(torch.arange(5.0) + r for r in range(ws))
    for rank, res in enumerate(spmd(body, ws)):
        assert res["all_reduce"] == [float(total)] * 3
        assert res["reduce"] == [[ws if rank == 0 else rank + 1] * 3] * 2
        assert res["broadcast"] == [ws + 4.0] * 4
        assert res["unfold"] == (base.unfold(0, 3, 1).tolist(), base.tolist())
        assert "all_gather: unsupported operation: more than one element of the written-to tensor" in res["all_gather"]
        assert res["after"] == [float(ws)] * 2


def test_collectives_on_meta_tensors_do_nothing() -> None:
    """torch's meta kernels: a collective on meta tensors (a model not yet materialised) sends
    nothing and returns ``None`` (a completed ``Work`` where one is asked for); the group stays
    in step."""
    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta")

    def body(rank: int, ws: int) -> list[Any]:
        m = meta(4)
        got: list[Any] = [
            dist.all_reduce(m), dist.broadcast(m, 0), dist.reduce(m, 1),
            dist.all_gather([meta(4), meta(4)], m), dist.all_gather_single(meta(8), m),
            dist.reduce_scatter_single(meta(2), m), dist.all_to_all_single(meta(4), m),
            dist.scatter(m, [meta(4), meta(4)] if rank == 0 else None, 0),
            dist.send(m, 1) if rank == 0 else dist.recv(m, 0),
        ]
        work = dist.all_reduce(m, async_op=True)
        assert work is not None and work.is_completed() and work.wait()
        assert dist.isend(m, 1 - rank) is not None
        t = torch.full((2,), rank + 1.0)
        dist.all_reduce(t)
        return [*got, t.tolist()]

    for rank, res in enumerate(spmd(body, 2)):
        assert res == [None] * 8 + [None if rank == 0 else -1, [3.0, 3.0]]


@pytest.mark.parametrize("ws", SIZES)
def test_broadcast_and_reduce_from_every_root(ws: int) -> None:
    def body(rank: int, ws: int) -> list[Any]:
        out = []
        for root in range(ws):
            t = vals(rank)
            dist.broadcast(t, root)
            out.append(t.tolist())
            t = vals(rank)
            dist.reduce(t, root, op=dist.ReduceOp.MAX)
            out.append(t.tolist() if rank == root else None)
        return out

    for res in spmd(body, ws):
        for root in range(ws):
            assert res[2 * root] == vals(root).tolist()
        assert [res[2 * r + 1] for r in range(ws) if res[2 * r + 1] is not None] == [
            reference("MAX", [vals(r) for r in range(ws)]).tolist()
        ]


def test_parameters_that_require_grad_can_be_written() -> None:
    """As torch's C++ collectives, broadcast and all_reduce write outside autograd (DDP-style
    parameter sync). all_gather ends with a ``copy_`` in gloo, which autograd refuses on a leaf
    that requires grad, unless under ``no_grad`` (see
    ``test_outputs_that_require_grad_are_written_as_gloos_copy``)."""

    def body(rank: int, ws: int) -> list[Any]:
        p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
        dist.broadcast(p, 1)
        after_broadcast = p.tolist()
        dist.all_reduce(p)
        outs = [torch.zeros(3, requires_grad=True) for _ in range(ws)]
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            dist.all_gather(outs, p)
        with torch.no_grad():
            dist.all_gather(outs, p)
        assert p.requires_grad and p.grad_fn is None
        return [after_broadcast, p.tolist(), [o.tolist() for o in outs]]

    for res in spmd(body, 2):
        assert res == [[2.0] * 3, [4.0] * 3, [[4.0] * 3] * 2]


# -- gathers and scatters ----------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("ws", SIZES)
def test_all_gather_even_uneven_and_into_tensor(ws: int) -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        even = [torch.zeros(4, dtype=torch.int64) for _ in range(ws)]
        dist.all_gather(even, vals(rank))
        uneven = [torch.zeros(r + 1, 2, dtype=torch.int64) for r in range(ws)]
        dist.all_gather(uneven, torch.full((rank + 1, 2), rank))
        cat = torch.zeros(ws * 2, 3, dtype=torch.int64)
        dist.all_gather_single(cat, torch.full((2, 3), rank))
        stack = torch.zeros(ws, 2, dtype=torch.int64)
        dist.all_gather_into_tensor(stack, torch.full((2,), rank * 10))  # warns (see unit tests)
        return {
            "even": [t.tolist() for t in even],
            "uneven": [t.tolist() for t in uneven],
            "cat": cat.tolist(),
            "stack": stack.tolist(),
        }

    for res in spmd(body, ws):
        assert res["even"] == [vals(r).tolist() for r in range(ws)]
        assert res["uneven"] == [[[r, r]] * (r + 1) for r in range(ws)]
        assert res["cat"] == [[r] * 3 for r in range(ws) for _ in range(2)]
        assert res["stack"] == [[r * 10] * 2 for r in range(ws)]


@pytest.mark.parametrize("ws", SIZES)
def test_gather_and_scatter_at_every_root(ws: int) -> None:
    def body(rank: int, ws: int) -> list[Any]:
        out = []
        for root in range(ws):
            glist = [torch.zeros(4, dtype=torch.int64) for _ in range(ws)] if rank == root else None
            dist.gather(vals(rank), glist, dst=root)
            out.append([t.tolist() for t in glist] if glist else None)
            s = torch.zeros(3, dtype=torch.int64)
            slist = [torch.full((3,), root * 100 + r) for r in range(ws)] if rank == root else None
            dist.scatter(s, slist, src=root)
            out.append(s.tolist())
        return out

    for rank, res in enumerate(spmd(body, ws)):
        for root in range(ws):
            gathered = res[2 * root]
            assert gathered == ([vals(r).tolist() for r in range(ws)] if rank == root else None)
            assert res[2 * root + 1] == [root * 100 + rank] * 3


@pytest.mark.parametrize("ws", SIZES)
def test_reduce_scatter_both_forms(ws: int) -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        out = torch.zeros(2, dtype=torch.int64)
        dist.reduce_scatter(out, [torch.full((2,), rank * 10 + i) for i in range(ws)])
        single = torch.zeros(3, dtype=torch.int64)
        dist.reduce_scatter_single(single, torch.arange(3 * ws) + rank, op=dist.ReduceOp.MAX)
        stacked = torch.zeros(2, dtype=torch.int64)
        dist.reduce_scatter_single(stacked, torch.ones(ws, 2, dtype=torch.int64) * (rank + 1))
        return {"list": out.tolist(), "single": single.tolist(), "stacked": stacked.tolist()}

    for rank, res in enumerate(spmd(body, ws)):
        assert res["list"] == [sum(r * 10 + rank for r in range(ws))] * 2
        assert res["single"] == [3 * rank + i + ws - 1 for i in range(3)]
        assert res["stacked"] == [sum(range(1, ws + 1))] * 2


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("ws", [2, 3])
def test_reduce_scatter_with_uneven_sizes_as_gloo(ws: int, shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``input_list[i]`` has rank i's output size, which may differ per rank (as gloo; empty
    too): every op and dtype, sync and async, over the arena and over sockets. A float result
    is bitwise the head of the even reduction whose chunks are the same values padded to the
    largest size (the same reduction order), small and large (several frames and pieces)."""
    monkeypatch.setenv("TDIST_SHM", shm)
    dtypes = [torch.int8, torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float64,
              torch.bool, torch.complex64]

    def body(rank: int, ws: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for op in INT_OPS:
            o = torch.zeros(2 * rank, dtype=torch.int64)
            dist.reduce_scatter(o, [vals(rank + i, 2 * i) for i in range(ws)], op=getattr(dist.ReduceOp, op))
            out[op] = o.tolist()
        for dt in dtypes:
            o = torch.zeros(rank + 1, dtype=dt)
            work = dist.reduce_scatter(o, [vals(rank + i, i + 1).to(dt) for i in range(ws)], async_op=True)
            assert work is not None
            work.wait()
            out[str(dt)] = o.tolist()
        for name, size in (("small", lambda i: 3 * i + 1), ("large", lambda i: 90_001 * i + 5)):
            top = size(ws - 1)
            gen = torch.Generator().manual_seed(rank)
            data = [torch.randn(top, generator=gen) for _ in range(ws)]
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MAX):
                uneven = torch.zeros(size(rank))
                dist.reduce_scatter(uneven, [d[: size(i)] for i, d in enumerate(data)], op=op)
                even = torch.zeros(top)
                dist.reduce_scatter(even, [d.clone() for d in data], op=op)
                out[f"{name}/{op}"] = torch.equal(uneven, even[: size(rank)])
        return out

    for rank, res in enumerate(spmd(body, ws)):
        for op in INT_OPS:
            assert res[op] == reference(op, [vals(r + rank, 2 * rank) for r in range(ws)]).tolist(), op
        for dt in dtypes:
            got = torch.tensor(res[str(dt)], dtype=dt)
            want = [vals(r + rank, rank + 1).to(dt) for r in range(ws)]
            assert torch.equal(got, torch.stack(want).sum(0).to(dt) if dt != torch.bool else want[0]), dt
        assert all(v is True for k, v in res.items() if "/" in k), res


@pytest.mark.parametrize("ws", SIZES)
def test_all_to_all_even_uneven_and_single(ws: int) -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        even = [torch.zeros(2, dtype=torch.int64) for _ in range(ws)]
        dist.all_to_all(even, [torch.full((2,), rank * 10 + j) for j in range(ws)])
        # rank i sends i + j + 1 elements to rank j
        uneven = [torch.zeros(i + rank + 1, dtype=torch.int64) for i in range(ws)]
        dist.all_to_all(uneven, [torch.full((rank + j + 1,), rank) for j in range(ws)])
        single = torch.zeros(ws * 2, dtype=torch.int64)
        dist.all_to_all_single(single, torch.arange(ws * 2) + rank * 100)
        in_splits = [rank + j + 1 for j in range(ws)]
        out_splits = [i + rank + 1 for i in range(ws)]
        src = torch.cat([torch.full((n,), rank * 10 + j) for j, n in enumerate(in_splits)])
        dst = torch.zeros(sum(out_splits), dtype=torch.int64)
        dist.all_to_all_single(dst, src, out_splits, in_splits)
        return {"even": [t.tolist() for t in even], "uneven": [t.tolist() for t in uneven],
                "single": single.tolist(), "splits": dst.tolist()}

    for rank, res in enumerate(spmd(body, ws)):
        assert res["even"] == [[i * 10 + rank] * 2 for i in range(ws)]
        assert res["uneven"] == [[i] * (i + rank + 1) for i in range(ws)]
        assert res["single"] == [i * 100 + 2 * rank + k for i in range(ws) for k in range(2)]
        assert res["splits"] == [i * 10 + rank for i in range(ws) for _ in range(i + rank + 1)]


# -- barriers, async, point to point -------------------------------------------------------------
@pytest.mark.parametrize("ws", [1, 3])
def test_barrier_and_async_work(ws: int) -> None:
    def body(rank: int, ws: int) -> list[Any]:
        dist.barrier()
        w = dist.barrier(async_op=True)
        assert isinstance(w, dist.Work)
        w.wait()
        t = torch.full((3,), rank + 1)
        work = dist.all_reduce(t, async_op=True)
        assert isinstance(work, dist.Work)
        assert work.wait() is True and work.is_completed() and work.is_success()
        fut = dist.broadcast(torch.full((2,), rank), 0, async_op=True).get_future()  # type: ignore[union-attr]
        works = [dist.all_reduce(torch.ones(1) * i, async_op=True) for i in range(5)]
        got = [w.result()[0].item() for w in works]  # type: ignore[union-attr]
        return [t.tolist(), fut.wait()[0].tolist(), got]

    for res in spmd(body, ws):
        assert res == [[ws * (ws + 1) // 2] * 3, [0, 0], [float(i * ws) for i in range(5)]]


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_point_to_point(ws: int) -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        # blocking ring, even ranks first
        r = torch.zeros(2, dtype=torch.int64)
        if rank % 2 == 0:
            dist.send(torch.full((2,), rank), nxt)
            out["from"] = dist.recv(r, prv)
        else:
            out["from"] = dist.recv(r, prv)
            dist.send(torch.full((2,), rank), nxt)
        out["ring"] = r.tolist()
        # any source: everyone sends to rank 0
        if rank == 0:
            senders = set()
            for _ in range(ws - 1):
                t = torch.zeros(1, dtype=torch.int64)
                src = dist.recv(t, tag=5)  # a tag of its own: the later ring sends use tag 0
                assert t.item() == src * 7
                senders.add(src)
            out["any"] = sorted(senders)
        else:
            dist.send(torch.tensor([rank * 7]), 0, tag=5)
        # isend/irecv with tags, received out of order
        reqs = [dist.isend(torch.tensor([rank * 10 + tag]), nxt, tag=tag) for tag in (1, 2)]
        a, b = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        rb = dist.irecv(b, prv, tag=2)
        ra = dist.irecv(a, prv, tag=1)
        for w in [*reqs, ra, rb]:
            assert w is not None
            w.wait()
        out["tags"] = [a.item(), b.item()]
        # batch: send to next, receive from previous, in either order
        s, rr = torch.full((3,), rank, dtype=torch.float32), torch.zeros(3)
        ops = [dist.P2POp(dist.irecv, rr, prv), dist.P2POp(dist.isend, s, nxt)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out["batch"] = rr.tolist()
        # numpy into numpy
        arr = np.zeros(2, dtype=np.int32)
        if rank == 0:
            dist.send(np.array([5, 6], dtype=np.int32), 1)
        elif rank == 1:
            dist.recv(arr, 0)
        out["numpy"] = arr.tolist()
        return out

    for rank, res in enumerate(spmd(body, ws)):
        prv = (rank - 1) % ws
        assert res["from"] == prv and res["ring"] == [prv, prv]
        if rank == 0:
            assert res["any"] == list(range(1, ws))
        assert res["tags"] == [prv * 10 + 1, prv * 10 + 2]
        assert res["batch"] == [float(prv)] * 3
        assert res["numpy"] == ([5, 6] if rank == 1 else [0, 0])


def test_point_to_point_errors() -> None:
    def body(rank: int, ws: int) -> list[str]:
        msgs = []
        for call in (
            lambda: dist.send(torch.ones(1), rank),
            lambda: dist.recv(torch.ones(1), rank),
            lambda: dist.send(torch.ones(1), 5),
            lambda: dist.send([1], 1 - rank),  # type: ignore[arg-type]
        ):
            try:
                call()
                msgs.append("no error")
            except (ValueError, TypeError) as exc:
                msgs.append(f"{type(exc).__name__}: {exc}")
        return msgs

    for res in spmd(body, 2):
        # (a ValueError as torch's send, and a RuntimeError as torch's recv: gloo's error)
        assert res[0] == ("CollectiveArgumentError: Invalid destination rank: destination rank should "
                          "not be the same as the rank of the current process.")
        assert res[1].startswith("CollectiveArgumentError: Invalid source rank: source rank should not be")
        assert "invalid destination rank 5" in res[2]
        assert res[3].startswith("TypeError: Invalid function argument. Expected parameter `tensor`")


# -- sub-groups --------------------------------------------------------------------------------
def test_sub_groups_map_ranks_and_skip_non_members(recwarn: pytest.WarningsRecorder) -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sub = dist.new_group([3, 1])
        odd = dist.new_group([1, 3])  # a second group of the same ranks: its own backend
        if rank in (1, 3):
            assert isinstance(sub, dist.ProcessGroup) and isinstance(odd, dist.ProcessGroup)
            out["ranks"] = (dist.get_rank(sub), dist.get_world_size(sub), dist.get_process_group_ranks(sub))
            t = torch.tensor([rank])
            dist.all_reduce(t, group=sub)
            out["sum"] = t.item()
            b = torch.tensor([rank])
            dist.broadcast(b, src=3, group=sub)  # a global rank
            out["bcast"] = b.item()
            b2 = torch.tensor([rank])
            dist.broadcast(b2, group=odd, group_src=0)  # a group rank: global 1
            out["bcast_group_src"] = b2.item()
            g = [torch.zeros(1, dtype=torch.int64) for _ in range(2)] if rank == 3 else None
            dist.gather(torch.tensor([rank * 2]), g, group=sub, group_dst=1)
            out["gather"] = [x.item() for x in g] if g else None
            if rank == 1:
                dist.send(torch.tensor([11]), 3, group=sub)
            else:
                r = torch.zeros(1, dtype=torch.int64)
                out["recv_from"] = dist.recv(r, group=sub)  # any source: returns the global rank
                out["recv"] = r.item()
            objs: list[Any] = [None, None]
            dist.all_gather_object(objs, f"r{rank}", group=sub)
            out["objs"] = objs
            try:
                dist.broadcast(torch.ones(1), src=0, group=sub)
            except ValueError as exc:
                out["bad_src"] = str(exc)
        else:
            assert sub == dist.GroupMember.NON_GROUP_MEMBER
            # warnings state is global: the test records them for all threads (recwarn)
            assert dist.all_reduce(torch.ones(1), group=sub) is None
            assert dist.broadcast(torch.ones(1), 1, group=sub) is None
            assert dist.recv(torch.ones(1), group=sub) == -1
            with pytest.raises(ValueError, match=r"^Invalid process group specified$"):
                dist.send(torch.ones(1), 1, group=sub)  # (torch's send refuses it; its isend warns)
            assert dist.isend(torch.ones(1), 1, group=sub) is None
            # (torch's object p2p looks its peer up in the group first, which fails here)
            with pytest.raises(ValueError, match=r"^Invalid process group specified$"):
                dist.send_object_list([1], dst=3, group=sub)
            with pytest.raises(ValueError, match=r"^Invalid process group specified$"):
                dist.recv_object_list([None], src=3, group=sub)
            dist.all_gather_object([None], 1, group=sub)
            out["ranks"] = (dist.get_rank(sub), dist.get_world_size(sub))
        dist.barrier()
        return out

    res = spmd(body, 4)
    assert res[1]["ranks"] == (0, 2, [1, 3]) and res[3]["ranks"] == (1, 2, [1, 3])
    for r in (1, 3):
        assert res[r]["sum"] == 4 and res[r]["bcast"] == 3 and res[r]["bcast_group_src"] == 1
        assert res[r]["objs"] == ["r1", "r3"]
        assert res[r]["bad_src"].startswith("Global rank 0 is not part of group")
    assert res[3]["gather"] == [2, 6] and res[1]["gather"] is None
    assert res[3]["recv_from"] == 1 and res[3]["recv"] == 11
    messages = {str(w.message) for w in recwarn}
    for r in (0, 2):
        assert res[r]["ranks"] == (-1, -1)
        for op in ("all_reduce", "broadcast", "recv", "all_gather_object"):
            assert f"Running {op} on global rank {r} which does not belong to the given group." in messages


def test_new_subgroups_and_local_synchronization() -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        mine, subs = dist.new_subgroups(2)
        assert isinstance(mine, dist.ProcessGroup) and len(subs) == 2
        t = torch.tensor([rank])
        dist.all_reduce(t, group=mine)
        cur, _ = dist.new_subgroups_by_enumeration([[0, 3], [1]])
        enum_ranks = dist.get_process_group_ranks(cur) if isinstance(cur, dist.ProcessGroup) else None
        local = dist.new_group([0, 1], use_local_synchronization=True) if rank < 2 else None
        if isinstance(local, dist.ProcessGroup):
            x = torch.tensor([10 + rank])
            dist.all_reduce(x, group=local)
            return {"pair": t.item(), "enum": enum_ranks, "local": x.item()}
        return {"pair": t.item(), "enum": enum_ranks, "local": None}

    res = spmd(body, 4)
    assert [r["pair"] for r in res] == [1, 1, 5, 5]
    assert [r["enum"] for r in res] == [[0, 3], [1], None, [0, 3]]
    assert [r["local"] for r in res] == [21, 21, None, None]


# -- object collectives -------------------------------------------------------------------------
@pytest.mark.parametrize("ws", SIZES)
def test_object_collectives(ws: int) -> None:
    def body(rank: int, ws: int) -> dict[str, Any]:
        obj = {"rank": rank, "payload": "x" * (rank * 50), "t": torch.arange(rank + 1)}
        everyone: list[Any] = [None] * ws
        dist.all_gather_object(everyone, obj)
        at_last: list[Any] | None = [None] * ws if rank == ws - 1 else None
        dist.gather_object(rank * 3, at_last, dst=ws - 1)
        lst: list[Any] = [{"from": 0}, [1, 2, 3], None] if rank == 0 else [None, None, None]
        dist.broadcast_object_list(lst, src=0)
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, [f"to{r}" * (r + 1) for r in range(ws)] if rank == 0 else None, src=0)
        return {
            "all": [(o["rank"], len(o["payload"]), o["t"].tolist()) for o in everyone],
            "gather": at_last, "bcast": lst, "scatter": mine[0],
        }

    for rank, res in enumerate(spmd(body, ws)):
        assert res["all"] == [(r, r * 50, list(range(r + 1))) for r in range(ws)]
        assert res["gather"] == ([r * 3 for r in range(ws)] if rank == ws - 1 else None)
        assert res["bcast"] == [{"from": 0}, [1, 2, 3], None]
        assert res["scatter"] == f"to{rank}" * (rank + 1)


def test_send_and_recv_object_lists() -> None:
    def body(rank: int, ws: int) -> Any:
        if rank == 0:
            dist.send_object_list([1, "two", {"three": 3}], dst=2)
            dist.send_object_list(["any"], dst=1)
            return None
        if rank == 1:
            box: list[Any] = [None]
            return dist.recv_object_list(box), box  # from any source
        box = [None, None, None]
        return dist.recv_object_list(box, src=0), box

    res = spmd(body, 3)
    assert res[1] == (0, ["any"])
    assert res[2] == (0, [1, "two", {"three": 3}])


# -- multi-device and coalesced forms --------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 3])
def test_multigpu_forms_on_lists_of_cpu_tensors(ws: int) -> None:
    k = 2

    def body(rank: int, ws: int) -> dict[str, Any]:
        ts = [torch.tensor([rank * 10 + j]) for j in range(k)]
        dist.all_reduce_multigpu(ts)
        bs = [torch.tensor([rank * 10 + j]) for j in range(k)]
        dist.broadcast_multigpu(bs, src=ws - 1, src_tensor=1)
        rs = [torch.tensor([rank + j + 1]) for j in range(k)]
        dist.reduce_multigpu(rs, dst=0, op=dist.ReduceOp.PRODUCT, dst_tensor=1)
        outs = [[torch.zeros(1, dtype=torch.int64) for _ in range(k * ws)] for _ in range(k)]
        dist.all_gather_multigpu(outs, [torch.tensor([rank * 10 + j]) for j in range(k)])
        rso = [torch.zeros(1, dtype=torch.int64) for _ in range(k)]
        dist.reduce_scatter_multigpu(
            rso, [[torch.tensor([100 * i + c]) for c in range(k * ws)] for i in range(k)]
        )
        work = dist.all_reduce_multigpu([torch.ones(1), torch.ones(1)], async_op=True)
        assert work is not None and work.wait()
        return {"ar": [t.item() for t in ts], "bc": [t.item() for t in bs],
                "red": rs[1].item() if rank == 0 else None,
                "ag": [[t.item() for t in lst] for lst in outs], "rs": [t.item() for t in rso]}

    total = sum(rank * 10 + j for rank in range(ws) for j in range(k))
    prod = 1
    for rank in range(ws):
        for j in range(k):
            prod *= rank + j + 1
    for rank, res in enumerate(spmd(body, ws)):
        assert res["ar"] == [total] * k
        assert res["bc"] == [(ws - 1) * 10 + 1] * k
        assert res["red"] == (prod if rank == 0 else None)
        assert res["ag"] == [[r * 10 + j for r in range(ws) for j in range(k)]] * k
        assert res["rs"] == [ws * (100 * 0 + rank * k + j) + ws * (100 + rank * k + j) for j in range(k)]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_coalesced_forms() -> None:
    def body(rank: int, ws: int) -> Any:
        ts = [torch.ones(2) * rank, torch.ones(3) * (rank + 1)]
        dist.all_reduce_coalesced(ts)
        outs = [[torch.zeros(1), torch.zeros(2)] for _ in range(ws)]
        fut = dist.all_gather_coalesced(outs, [torch.ones(1) * rank, torch.ones(2) * rank * 2], async_op=True)
        fut.wait()
        # (torch's test_allgather_coalesced_checks: gloo's words, RuntimeError, before any message)
        ins = [torch.zeros(1)]
        bad = [[torch.zeros(1)] for _ in range(ws)]
        bad[0] = [torch.zeros(0)]
        with pytest.raises(RuntimeError, match=r"invalid size of output tensor at index 0"):
            dist.all_gather_coalesced(bad, ins)
        bad[0] = [torch.zeros(1, dtype=torch.float64)]
        with pytest.raises(RuntimeError, match=r"invalid tensor type at index 0"):
            dist.all_gather_coalesced(bad, ins)
        with pytest.raises(RuntimeError, match=r"output lists should be equal to world size"):
            dist.all_gather_coalesced([[torch.zeros(1)] for _ in range(ws + 1)], ins)
        return [t.tolist() for t in ts], [[t.tolist() for t in lst] for lst in outs]

    for res in spmd(body, 3):
        assert res[0] == [[3.0, 3.0], [6.0, 6.0, 6.0]]
        assert res[1] == [[[float(r)], [2.0 * r, 2.0 * r]] for r in range(3)]


# -- argument errors with a real group -----------------------------------------------------------
def test_argument_errors_are_raised_before_any_communication() -> None:
    def body(rank: int, ws: int) -> list[str]:
        calls: list[Callable[[], Any]] = [
            lambda: dist.all_gather([torch.zeros(1)], torch.zeros(1)),
            lambda: dist.all_gather([torch.zeros(1), torch.zeros(1, dtype=torch.int64)], torch.zeros(1)),
            lambda: dist.broadcast(torch.zeros(1), 2),
            lambda: dist.reduce_scatter(torch.zeros(1), [torch.zeros(1)]),
            lambda: dist.all_to_all([torch.zeros(1)], [torch.zeros(1)] * 2),
            lambda: dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [1, 1], [1, 2]),
            lambda: dist.all_gather_single(torch.zeros(3), torch.zeros(1)),
            lambda: dist.gather(torch.zeros(1), [torch.zeros(1)] * 2, dst=1 - rank),
            lambda: dist.scatter(torch.zeros(1), [torch.zeros(1)], src=0),  # short on 0, given on 1
        ]
        out = []
        for call in calls:
            try:
                call()
                out.append("no error")
            except (ValueError, TypeError, RuntimeError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        dist.barrier()  # the group is still healthy
        return out

    res = spmd(body, 2)
    for rank, msgs in enumerate(res):
        assert "output tensor list size 1" in msgs[0]
        assert "Invalid usage of tensors with different dtypes" in msgs[1]
        assert "broadcast: invalid root rank: 2" in msgs[2]
        assert "input tensor list size 1" in msgs[3]
        assert "all_to_all: invalid output tensor list size 1" in msgs[4]
        assert "Split sizes doesn't match total dim 0 size" in msgs[5]
        assert "output tensor size must be equal to world_size times input tensor size" in msgs[6]
        assert "must NOT be specified on non-destination ranks" in msgs[7]
        if rank == 0:
            assert "invalid scatter_list size 1" in msgs[8]
        else:
            assert "must NOT be specified on non-source ranks" in msgs[8]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_non_member_handle_answers_for_the_latest_group_left_out_of_as_torch() -> None:
    """torch files a left-out rank's map under NON_GROUP_MEMBER: code asking every rank
    ``get_rank() in get_process_group_ranks(g)`` works there, so it must here."""

    def body(rank: int, ws: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if rank == 2:
            with pytest.raises(ValueError, match="never left out of a group"):
                dist.get_process_group_ranks(dist.GroupMember.NON_GROUP_MEMBER)
        dist.new_group([0, 2])
        g = dist.new_group([1, 0])  # sorted, as torch: [0, 1]
        out["ranks"] = dist.get_process_group_ranks(g)
        out["member"] = rank in out["ranks"]
        out["global_of_1"] = dist.get_global_rank(g, 1)
        out["group_of_0"] = dist.get_group_rank(g, 0)
        with pytest.raises(ValueError, match="not part of group"):
            dist.get_group_rank(g, 2)
        # the ops of a batch on a group this rank is not in are skipped, as torch's
        ops = [dist.P2POp(dist.isend, torch.ones(1), group=g, group_peer=1 - min(rank, 1))]
        if rank == 2:
            assert dist.batch_isend_irecv(ops) == []
        else:
            r = torch.zeros(1)
            works = dist.batch_isend_irecv([*ops, dist.P2POp(dist.irecv, r, 1 - rank, group=g)])
            for w in works:
                w.wait()
        dist.barrier()
        return out

    res = spmd(body, 3)
    for rank in range(3):
        assert res[rank] == {"ranks": [0, 1], "member": rank < 2, "global_of_1": 1, "group_of_0": 0}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("ws", [1, 2])
def test_a_dtype_torch_cannot_reduce_is_refused_as_runtime_error(
    ws: int, shm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uint16/32/64 have no add, min or max kernel in torch: refused before anything is sent,
    on every world size and path, a RuntimeError as gloo's ("Invalid scalar type"); the bitwise
    ops, which torch has for them, work."""
    monkeypatch.setenv("TDIST_SHM", shm)

    def body(rank: int, ws: int) -> list[str]:
        out = []
        for dtype in (torch.uint16, torch.uint32, torch.uint64):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                a, b = torch.ones(3, dtype=dtype), torch.ones(ws, dtype=dtype)
                calls: list[Callable[[], Any]] = [
                    partial(dist.all_reduce, a, op=op),
                    partial(dist.reduce, a, dst=0, op=op),
                    partial(dist.reduce_scatter_tensor, a[:1], b, op=op),
                ]
                for call in calls:
                    with pytest.raises(RuntimeError) as info:
                        call()
                    assert isinstance(info.value, ValueError)
                    out.append(str(info.value))
            t = torch.tensor([1 << rank, 3], dtype=dtype)
            dist.all_reduce(t, op=dist.ReduceOp.BXOR)  # the group is still healthy
            assert t.tolist() == ([1, 3] if ws == 1 else [3, 0])
        return out

    for msgs in spmd(body, ws):
        assert len(msgs) == 27
        assert "cannot apply ReduceOp.SUM to torch.uint16" in msgs[0]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_argument_errors_are_runtime_and_value_errors_as_in_torch() -> None:
    """gloo raises RuntimeError for these, torch's Python checks ValueError: ours is both."""

    def body(rank: int, ws: int) -> list[str]:
        calls: list[Callable[[], Any]] = [
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG),
            lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PREMUL_SUM),
            lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
            lambda: dist.all_gather_into_tensor(torch.zeros(4, dtype=torch.int64), torch.ones(2)),
            lambda: dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.int32), torch.ones(4), op=dist.ReduceOp.AVG),
        ]
        out = []
        for call in calls:
            with pytest.raises(RuntimeError) as info:
                call()
            assert isinstance(info.value, ValueError)
            out.append(str(info.value))
        t = torch.full((2,), 1.0 + rank)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)  # the group is still healthy
        assert t.tolist() == [1.5, 1.5]
        return out

    for msgs in spmd(body, 2):
        assert "ReduceOp.AVG needs a floating point" in msgs[0]
        assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in msgs[1]
        assert "Cannot use ReduceOp.BAND with non-integral dtype" in msgs[2]
        assert "Invalid usage of tensors with different dtypes" in msgs[3]


def test_work_source_rank_as_torch_spells_it() -> None:
    """``work._source_rank()`` (what torch's own ``recv`` calls) names the sender of a recv."""

    def body(rank: int, ws: int) -> tuple[int, ...] | None:
        coll = dist.all_reduce(torch.ones(1), async_op=True)
        assert coll is not None
        coll.wait()
        with pytest.raises(RuntimeError, match="source_rank"):
            coll._source_rank()
        assert coll.block_current_stream() is None
        if rank == 0:
            dist.send(torch.ones(1), 1)
            dist.send(torch.ones(1), 1)
            return None
        specific = dist.irecv(torch.zeros(1), 0)
        anyone = dist.irecv(torch.zeros(1))
        specific.wait()
        anyone.wait()
        return specific._source_rank(), anyone._source_rank(), anyone.source_rank()

    assert spmd(body, 2)[1] == (0, 0, 0)


# -- monitored barrier -----------------------------------------------------------------------------
def test_monitored_barrier_names_the_late_rank() -> None:
    reported = threading.Event()

    def body(rank: int, ws: int) -> str:
        dist.monitored_barrier(timeout=timedelta(seconds=5))
        if rank == 2:  # late: comes once rank 0 has given up on it
            assert reported.wait(20), "rank 0's monitored barrier never ended"
        try:
            dist.monitored_barrier(timeout=timedelta(milliseconds=300), wait_all_ranks=True)
            return "passed"
        except dist.DistBackendError as exc:
            return str(exc)
        finally:
            if rank == 0:
                reported.set()

    res = spmd(body, 3)
    assert res[0] == "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 300 ms"
    assert all("Ranks 2 failed to pass monitoredBarrier in 300 ms" in m for m in res[1:]), res


def _monitored_barrier_with_a_rank_gone(rank: int, ws: int, port: int) -> str:
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    dist.barrier()
    if rank == 1:  # (gone from the group: its connections are closed)
        dist.destroy_process_group()
        store.wait(["verdict0"], timedelta(seconds=50))
        return "left"
    start = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)
        return "passed"
    except dist.DistBackendError as exc:
        return f"{time.monotonic() - start:.0f} s: {exc}"
    finally:
        store.set(f"verdict{rank}", "1")
        if rank == 0:  # (its store goes with it: not before rank 2 has set its verdict)
            store.wait(["verdict2"], timedelta(seconds=50))
        dist.destroy_process_group()


def test_monitored_barrier_fails_at_once_for_a_rank_whose_process_is_gone() -> None:
    """A rank gone from the group is not waited for (gloo's connection to it fails the barrier
    at once): ranks 0 and 2 fail in seconds, naming it and why, not at the 60 s timeout."""
    from tdist.testing import run_processes

    got = run_processes(_monitored_barrier_with_a_rank_gone, 3, free_port(), timeout=50)
    assert got[1] == "left"
    for m in (got[0], got[2]):
        seconds = int(m.split(" s: ")[0])
        assert seconds < 30 and "Ranks 1 failed to pass monitoredBarrier in 60000 ms (rank 1:" in m, got
        assert "left the process group" in m or "was lost" in m, got


def _new_group_with_a_member_killed(rank: int, ws: int, port: int) -> None:
    import os
    import signal

    store = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.new_group([0, 1, 2])
        out = "formed"
    except dist.DistBackendError as exc:
        out = f"{time.monotonic() - start:.0f} s: {exc}"
    store.set(f"result{rank}", out)
    os._exit(0)


def test_new_group_with_a_member_that_died_fails_naming_it() -> None:
    """``new_group`` waits for every member's address; one that the default group knows dead
    fails it at once on the others, naming it, not at the group's 60 s timeout with a store
    key (torch hangs there)."""
    import multiprocessing

    # (the results wait 40 s at most, below the groups' 60 s: a wait that runs out the group's
    # timeout fails here)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=40))
    procs = [multiprocessing.get_context("fork").Process(target=_new_group_with_a_member_killed, args=(r, 3, master.port))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        for r in (0, 2):
            got = master.get(f"result{r}").decode()
            seconds = int(got.split(" s: ")[0]) if " s: " in got else None
            assert seconds is not None and seconds < 30, got
            assert "rank 1 never published its address, and it is gone" in got and "lost" in got, got
    finally:
        join_or_kill(procs)
        master.close()


def _formation_fails_on_rank_2(rank: int, ws: int, results_port: int, port: int, how: str) -> None:
    import os

    import tdist.transport._endpoint as endpoint

    results = dist.TCPStore("127.0.0.1", results_port, timeout=timedelta(seconds=60))
    if how == "dies_before_connecting":
        os.environ["TDIST_SHM"] = "0"  # (no arena, whose join, naming rank 2 too, could fail first)
    if rank == 2:
        if how == "raises":  # (as an address of TDIST_ADDR that is not this host's)
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise OSError(99, "Cannot assign requested address (injected)")

            endpoint.Listeners = refuse  # type: ignore[assignment,misc]
        elif how == "dies_before_its_address":
            endpoint.Endpoint._build_mesh = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
        else:
            endpoint.Endpoint._connect_mesh = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=60))
        out = "formed"
    except Exception as exc:
        out = f"{time.monotonic() - start:.0f} s: {type(exc).__name__}: {exc}"
    results.set(f"result{rank}", out)
    # (a program that fails ends through sys.exit, and rank 0's store serves the others until
    # they have left: this forked child ends with os._exit, and waits for them instead)
    results.wait(["result0", "result1"])
    os._exit(0)


@pytest.mark.parametrize("how", ["raises", "dies_before_its_address", "dies_before_connecting"])
def test_a_rank_that_fails_or_dies_while_the_group_forms_is_named_at_once(how: str) -> None:
    """torch (gloo) waits for the group's timeout (30 minutes by default) for a rank that
    failed to make its listener, or died, while the group formed, then names a store key.
    tdist's ranks fail within seconds, naming it: its error, or its process gone."""
    import multiprocessing

    # (the results wait 40 s at most, below the group's 60 s: a wait that runs out the group's
    # timeout fails here)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=40))
    port = free_port()
    procs = [multiprocessing.get_context("fork").Process(target=_formation_fails_on_rank_2, args=(r, 3, master.port, port, how))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = {r: master.get(f"result{r}").decode() for r in ((0, 1, 2) if how == "raises" else (0, 1))}
        for r in (0, 1):
            seconds = int(got[r].split(" s: ")[0]) if " s: " in got[r] else None
            assert seconds is not None and seconds < 30, got
            assert "rank 2" in got[r], got
        if how == "raises":
            assert got[2].endswith("OSError: [Errno 99] Cannot assign requested address (injected)"), got
            for r in (0, 1):
                assert (f"PeerError: rank {r}: forming process group '0': rank 2 failed to form it: OSError: [Errno 99] "
                        "Cannot assign requested address (injected)") in got[r], got
        elif how == "dies_before_its_address":
            for r in (0, 1):
                assert "rank 2 never published its address, and it is gone: its process, pid " in got[r], got
        else:
            for r in (0, 1):
                assert "rank 2 has not connected, and it is gone: its process, pid " in got[r], got
    finally:
        join_or_kill(procs)
        master.close()


def test_a_sub_groups_failure_says_which_global_rank_each_of_its_ranks_is() -> None:
    """In ``new_group([1, 2])``, the transport's messages name the group's ranks ("rank 1"
    is global rank 2): the error says which global rank each is."""
    left = threading.Event()

    def body(rank: int, ws: int) -> str:
        sub = dist.new_group([1, 2])
        if rank == 2:
            dist.destroy_process_group(sub)
            left.set()
            return ""
        if rank == 1:
            assert left.wait(20)
            try:
                dist.all_reduce(torch.ones(2), group=sub)
                return "no error"
            except dist.DistError as exc:
                return str(exc)
        return ""

    res = spmd(body, 3)
    assert "the ranks above are those of group" in res[1] and "0 is global rank 1, 1 is global rank 2" in res[1], res


# -- debug mode ---------------------------------------------------------------------------------
@pytest.fixture
def detail() -> Iterator[None]:
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    yield
    dist.set_debug_level(before)


@pytest.mark.usefixtures("detail")
def test_debug_mode_reports_mismatches_on_every_rank() -> None:
    def body(rank: int, ws: int) -> dict[str, str]:
        out = {}
        cases: dict[str, Callable[[], Any]] = {
            "kind": lambda: dist.all_reduce(torch.ones(2)) if rank != 1 else dist.broadcast(torch.ones(2), 0),
            "shape": lambda: dist.all_reduce(torch.ones(2 if rank != 2 else 3)),
            "dtype": lambda: dist.all_reduce(torch.ones(2, dtype=torch.float64 if rank == 0 else torch.float32)),
            "root": lambda: dist.broadcast(torch.ones(1), 0 if rank != 1 else 1),
            "op": lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX if rank == 2 else dist.ReduceOp.SUM),
            "uneven": lambda: dist.all_gather([torch.zeros(1)] * ws, torch.zeros(2 if rank == 1 else 1)),
        }
        for name, call in cases.items():
            try:
                call()
                out[name] = "no error"
            except CollectiveMismatchError as exc:
                out[name] = str(exc)
        ok = [torch.zeros(r + 1) for r in range(ws)]
        dist.all_gather(ok, torch.zeros(rank + 1))  # consistent uneven sizes pass
        return out

    res = spmd(body, 3)
    for rank, out in enumerate(res):
        assert out["kind"].startswith("Detected mismatch between collectives on ranks")
        assert f"Rank {rank} is running collective" in out["kind"]
        assert "ranks [0, 2]: all_reduce" in out["kind"] and "ranks [1]: broadcast" in out["kind"]
        assert "differ in the following aspects: operation. All ranks" in out["kind"]  # (as torch's: op type)
        assert "differ in the following aspects: shape" in out["shape"] and "ranks [2]" in out["shape"]
        assert "aspects: dtype" in out["dtype"]
        assert "aspects: root" in out["root"]
        assert "aspects: reduction" in out["op"]
        assert "rank 1 sends a tensor of shape [2] to rank 0, which expects shape [1]" in out["uneven"]


# -- lifetime -----------------------------------------------------------------------------------
def test_destroy_and_init_again_on_the_same_store() -> None:
    store = dist.HashStore()
    store.set_timeout(PG_TIMEOUT)

    def body(rank: int, ws: int) -> list[int]:
        out = []
        for round_ in range(3):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=PG_TIMEOUT)
            sub = dist.new_group([0, 1])
            t = torch.tensor([rank + round_])
            dist.all_reduce(t)
            if sub != dist.GroupMember.NON_GROUP_MEMBER:
                dist.all_reduce(t, group=sub)
            out.append(t.item())
            dist.destroy_process_group()
            assert not dist.is_initialized()
        return out

    res = run_threads(body, 3, timeout=40)
    for rank, out in enumerate(res):
        assert out == [(3 + 3 * r) * (2 if rank < 2 else 1) for r in range(3)]


def test_init_process_groups_ranks_name_the_default_group_as_torchs() -> None:
    """torch's private ``_ranks``: the default group is named by a hash of its ranks (and of the
    number of groups before it, none), and the next group is "0" (torch counts only the others)."""

    store = dist.HashStore()

    def main(rank: int, ws: int) -> tuple[Any, ...]:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ws, _ranks=[0, 1])
        try:
            sub = dist.new_group([0, 1])
            t = torch.ones(1)
            dist.all_reduce(t, group=sub)
            return dist.group.WORLD.group_name, sub.group_name, t.item()
        finally:
            dist.destroy_process_group()

    expected = hashlib.sha1(b"0_1_0", usedforsecurity=False).hexdigest()
    assert run_threads(main, 2, timeout=40) == [(expected, "0", 2.0)] * 2


def test_default_backend_and_names() -> None:
    def body(rank: int, ws: int) -> tuple[Any, ...]:
        pg = dist.group.WORLD
        assert pg is not None
        return (dist.get_backend(), dist.get_backend_config(), pg.name(), pg.group_name,
                dist.get_backend(dist.new_group([0, 1])) if ws > 1 else None)

    assert spmd(body, 2, backend=None)[0] == ("undefined", "cpu:gloo", "gloo", "0", "undefined")
    assert spmd(body, 2, backend="GLOO")[0] == ("gloo", "cpu:gloo,cuda:gloo", "gloo", "0", "gloo")
    assert spmd(body, 1, backend="tcp")[0] == ("tcp", "cpu:tcp", "tcp", "0", None)


@pytest.fixture
def server() -> Iterator[LocalStore]:
    with local_store(2, timeout=20) as s:
        yield s


def test_init_method_urls(server: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(me: int, ws: int, **kwargs: Any) -> Any:
        dist.init_process_group("gloo", timeout=PG_TIMEOUT, **kwargs)
        try:
            t = torch.tensor([me + 1])
            dist.all_reduce(t)
            return t.item(), dist.get_rank(), dist.get_world_size()
        finally:
            dist.destroy_process_group()

    # env:// through the launcher's store (every rank a client), as `tdist run` does
    for key, value in server.env(0).items():
        monkeypatch.setenv(key, value)
    res = run_threads(lambda rank, ws: run(rank, ws, init_method=f"env://?rank={rank}"), 2, timeout=30)
    assert res == [(3, 0, 2), (3, 1, 2)]
    # tcp://: rank 0 hosts a store of its own
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    port = free_port()
    res = run_threads(
        lambda rank, ws: run(rank, ws, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws),
        2, timeout=30,
    )
    assert res == [(3, 0, 2), (3, 1, 2)]


def _reinit_cycles(rank: int, world_size: int, port: int, cycles: int, marks: str | None = None) -> int:
    """``cycles`` times init, all_reduce, destroy. With ``marks`` (a folder), rank 0 (the store's
    host) lags every other cycle: it destroys its group only once the others are in the next
    group's init_process_group (each marks it there from a watcher of its stack), on its store."""
    import os

    from .._sync import wait_until, when_inside

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = 0
    for c in range(cycles):
        if marks is None:
            time.sleep(0.05 * rank)  # the ranks come 50 ms apart
        elif rank:
            mark = os.path.join(marks, f"{rank}-{c}")
            when_inside("init_process_group", lambda mark=mark: open(mark, "w").close())  # type: ignore[misc]
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == world_size
        if marks is not None and rank == 0 and c % 2 and c + 1 < cycles:
            wanted = [os.path.join(marks, f"{r}-{c + 1}") for r in range(1, world_size)]
            wait_until(lambda w=wanted: all(map(os.path.exists, w)), 30, "the others are in the next init")
        dist.destroy_process_group()
        done += 1
    return done


def _destroy_retires_the_store(rank: int, world_size: int, port: int) -> tuple[bool, bool]:
    import gc

    from tdist.store import _tcp

    gc.disable()  # (the store sits in reference cycles: the collector must not close it here)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    key = ("127.0.0.1", port)
    return key in _tcp._tenants, key in _tcp._retired


@pytest.mark.timeout(60)
def test_destroy_retires_the_store_that_rank_0_serves_so_that_it_answers_the_others_as_it_exits() -> None:
    # rank 0's destroy_process_group retires the group's store (it serves on until the other
    # ranks have left, even while rank 0 exits): before, it stayed open until the collector
    # found it, and a rank still leaving (its claim's release goes through that store) waited
    # for rank 0's process to be gone: 350-600 ms in a third of bench_init's rounds
    from tdist.testing import run_processes

    open_, retired = run_processes(_destroy_retires_the_store, 2, free_port(), timeout=50)[0]
    assert not open_ and retired


@pytest.mark.timeout(120)
def test_ranks_quicker_than_the_store_host_to_init_again_find_the_next_group(tmp_path: Any) -> None:
    from tdist.testing import run_processes

    done = run_processes(_reinit_cycles, 3, free_port(), 6, str(tmp_path), timeout=100, start_method="forkserver")
    assert done == [6, 6, 6]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_many_destroy_and_init_again_cycles_on_one_address_on_a_busy_machine() -> None:
    # A rank quicker than rank 0 starts the next group while rank 0's store still serves the
    # last one: that store serves on for it (retired, not stopped) and rank 0 takes it back,
    # where it used to vanish under that rank ("lost the connection to the store ... during GET").
    import subprocess
    import sys

    from tdist.testing import run_processes

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        done = run_processes(_reinit_cycles, 3, free_port(), 30, timeout=220, start_method="forkserver")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert done == [30, 30, 30]


def _misconfigured(index: int, n: int, port: int, ranks: list[int], sizes: list[int]) -> tuple[str, float]:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", rank=ranks[index], world_size=sizes[index], timeout=timedelta(seconds=60))
    except ValueError as exc:
        return str(exc), time.monotonic() - t0
    dist.destroy_process_group()
    return "joined", time.monotonic() - t0


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("ranks", "sizes", "words"),
    [
        ([0, 1], [2, 3], "disagree on the world size"),
        ([0, 1, 1], [3, 3, 3], "rank 1 is claimed by two processes"),
        # (the second cannot host the store, its port taken: it joins the first's, as rank 0)
        ([0, 0], [2, 2], "rank 0 is claimed by two processes"),
    ],
    ids=["world_size", "same_rank", "two_rank_zeros"],
)
def test_misconfigured_ranks_fail_at_the_rendezvous_naming_the_problem(ranks: list[int], sizes: list[int], words: str) -> None:
    # torch (and tdist before) waited for the whole timeout (30 minutes by default). (The ranks
    # are forked, from the forkserver: a process that multiprocessing started ends with
    # os._exit, which runs no atexit handler; rank 0's store must answer the last rank's
    # request for the verdict all the same, where that rank found it gone.)
    from tdist.testing import run_processes

    results = run_processes(_misconfigured, len(ranks), free_port(), ranks, sizes, timeout=80, start_method="forkserver")
    for text, took in results:
        assert words in text, results
        assert took < 20, results


def _rendezvous_without_rank_2(rank: int, n: int, port: int) -> tuple[str, str, float]:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.monotonic()
    try:  # (rank 0, which hosts the store, gives up first; rank 1 would wait 60 s)
        dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=2 if rank == 0 else 60))
    except Exception as exc:
        # (torch's: a DistStoreError, which a retry loop around init catches)
        from tdist._core.errors import DistTimeoutError

        assert all(isinstance(exc, k) for k in (dist.DistStoreError, torch.distributed.DistStoreError, DistTimeoutError)), exc
        return type(exc).__name__, str(exc), time.monotonic() - t0
    dist.destroy_process_group()
    return "joined", "", time.monotonic() - t0


def test_a_rendezvous_that_times_out_fails_every_waiting_rank_with_its_reason() -> None:
    """Rank 0 times out waiting for rank 2; rank 1 fails with it, saying which rank never
    joined, where it waited on (and got "lost the connection to the store" once rank 0's
    process, which hosts the store, ended)."""
    from tdist.testing import run_processes

    results = run_processes(_rendezvous_without_rank_2, 2, free_port(), timeout=80, start_method="forkserver")
    for rank, (kind, text, took) in enumerate(results):
        assert kind == "StoreTimeoutError", results
        assert text.startswith(f"rank {rank}: the rendezvous at ") and "rank(s) [2] of 3 never joined" in text, results
        assert took < 30, results


def _warnings_said(rank: int, told: Any, words: str) -> list[str]:
    """The warnings of tdist's loggers with ``words`` in them, as they come; each says so in
    ``told`` (``warned/<rank>``)."""
    import logging

    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING and words in record.getMessage():
                said.append(record.getMessage())
                told.set(f"warned/{rank}", "1")

    logging.getLogger("tdist").addHandler(Catch())
    return said


def _late_rank_2(rank: int, n: int, port: int, side: str) -> list[str]:
    """Ranks 0 and 1 wait at the rendezvous for rank 2, which comes once both have warned."""
    from tdist._core import patience

    patience.FIRST, patience.EVERY = 0.5, 1.0  # (30 s and a minute)
    told = dist.FileStore(side, n)
    # (the warnings that name rank 2 alone: on a loaded host rank 1 may come after rank 0's
    # first warning, which then names both)
    said = _warnings_said(rank, told, "for rank(s) [2] of 3 (")
    if rank == 2:
        told.wait(["warned/0", "warned/1"], timedelta(seconds=30))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timedelta(seconds=60))
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]
    dist.destroy_process_group()
    return said


def test_a_rendezvous_that_waits_long_says_which_ranks_it_waits_for(tmp_path: Path) -> None:
    """torch says nothing until its timeout (30 minutes by default); tdist warns after 30 s,
    naming the ranks that have not come, then every minute; the late rank then joins."""
    from tdist.testing import run_processes

    results = run_processes(_late_rank_2, 3, free_port(), str(tmp_path / "side"), timeout=80, start_method="forkserver")
    assert results[2] == [], results
    for rank in (0, 1):
        assert results[rank], results
        assert results[rank][0].startswith(f"rank {rank}: waiting at the rendezvous at 127.0.0.1:"), results
        assert "for rank(s) [2] of 3 (" in results[rank][0] and "it times out after 0:01:00" in results[rank][0], results


def _late_to_new_group(rank: int, n: int, port: int, side: str) -> list[str]:
    """Ranks 0 and 1 wait in new_group for rank 2, which comes once both have warned."""
    from tdist._core import patience

    patience.FIRST, patience.EVERY = 0.5, 1.0  # (30 s and a minute)
    told = dist.FileStore(side, n)
    said = _warnings_said(rank, told, "has waited")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timedelta(seconds=60))
    if rank == 2:
        told.wait(["warned/0", "warned/1"], timedelta(seconds=30))
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=50))
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [3.0, 3.0]
    dist.destroy_process_group()
    return said


def test_a_new_group_that_waits_long_says_which_ranks_it_waits_for(tmp_path: Path) -> None:
    """torch's waits silently for the group's timeout (30 minutes by default) for a rank that
    never calls new_group; tdist warns after 30 s, then every minute, naming it."""
    from tdist.testing import run_processes

    results = run_processes(_late_to_new_group, 3, free_port(), str(tmp_path / "side"), timeout=80, start_method="forkserver")
    assert results[2] == [], results
    for rank in (0, 1):
        assert results[rank], results
        assert results[rank][0].startswith(f"rank {rank}: forming process group '1' has waited "), results
        assert results[rank][0].endswith("for rank(s) [2], which have not come to it yet (it times out after 0:00:50)"), results


def test_a_timed_out_all_to_all_single_is_named_so() -> None:
    gone = threading.Event()

    def body(rank: int, ws: int) -> str:
        if rank == 1:  # (never comes: rank 0 times out)
            assert gone.wait(30)
            return ""
        try:
            dist.all_to_all_single(torch.zeros(2), torch.ones(2))
        except Exception as exc:
            return str(exc)
        finally:
            gone.set()
        return "no error"

    message = spmd(body, 2, pg_timeout=timedelta(seconds=1))[0]
    assert message.splitlines()[0].startswith("rank 0: all_to_all_single "), message


def _summed(rank: int, n: int) -> list[float]:
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.tolist()


def test_init_fails_naming_the_interface_gloo_socket_ifname_names_where_there_is_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TDIST_ADDR", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nonexistent0")
    with pytest.raises(RuntimeError, match="Unable to find address for: nonexistent0"):
        spmd(_summed, 2)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert spmd(_summed, 2) == [[2.0, 2.0]] * 2


def _mismatched_while_one_rank_reads_late(rank: int, n: int, port: int) -> str:
    import os

    from tdist.c10d import _debug

    dist.set_debug_level(dist.DebugLevel.DETAIL)
    os.environ["TDIST_SHM"] = "0"  # (over sockets the debug check finds it; shared memory, itself)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=PG_TIMEOUT)
    if rank == 1:  # (reads the fingerprints well after rank 0, which hosts the store, has)
        wait_ = _debug.CollectiveChecker.check

        def late(self: Any, fp: Any) -> None:
            real = self._store.multi_get

            def multi_get(keys: list[str]) -> list[bytes]:
                time.sleep(1.0)  # (widens the window; the test does not synchronise on it)
                return real(keys)  # type: ignore[no-any-return]

            self._store.multi_get = multi_get
            wait_(self, fp)

        _debug.CollectiveChecker.check = late  # type: ignore[method-assign]
    try:
        dist.all_reduce(torch.ones(rank + 1))
        return "no error"
    except Exception as exc:
        return type(exc).__name__
    finally:
        dist.destroy_process_group()


def test_a_mismatch_is_reported_on_every_rank_when_the_stores_host_finds_it_first() -> None:
    """Rank 0 hosts the group's store: it must not raise (and exit, taking the store along)
    before rank 1 has read the fingerprints, or rank 1 reports a lost store, not the mismatch."""
    from tdist.testing import run_processes

    got = run_processes(_mismatched_while_one_rank_reads_late, 2, free_port(), timeout=50)
    assert got == ["CollectiveMismatchError"] * 2


@pytest.mark.parametrize("path", ["shm", "sockets"])
def test_an_input_that_is_another_ranks_output_slot_is_read_before_it_is_written(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective's input that is also an output slot of another rank (or a view of
    another rank's part of the output, or an input list that is the output list turned
    round, or, over the connections, all_to_all_single in place) gives what gloo gives:
    every rank's values, not a peer's data read back as this rank's (gloo copies its inputs
    first)."""
    monkeypatch.setenv("TDIST_SHM", "1" if path == "shm" else "0")
    splits = [[1, 5, 2], [5, 1, 3], [2, 3, 4]]  # (in place: what r sends k, k sends r)

    def body(rank: int, ws: int) -> list[Any]:
        t = torch.full((2,), float(rank + 1))
        outs = [torch.zeros(2) for _ in range(ws)]
        outs[(rank - 1) % ws] = t  # (this rank's input sits in the previous rank's slot)
        dist.all_gather(outs, t)
        o = torch.zeros(2 * ws)
        j = (rank + 1) % ws  # (the input is the next rank's part of the output)
        o[2 * j:2 * j + 2] = rank + 1
        dist.all_gather_into_tensor(o, o[2 * j:2 * j + 2])
        ins = [torch.full((1,), float(10 * rank + k)) for k in range(ws)]
        dist.all_to_all(ins[1:] + ins[:1], ins)
        single = torch.arange(float(ws)) + 10 * rank
        dist.all_to_all_single(single, single)  # (in place, each part to its own rank)
        g = [torch.zeros(1) for _ in range(ws)]
        mine = g[(rank + 1) % ws]
        mine.fill_(rank + 1)
        dist.all_gather(g, mine)
        own = torch.full((3,), float(rank))
        own_slots = [torch.zeros(3) for _ in range(ws)]
        own_slots[rank] = own  # (the usual in-place call: the input is its own slot)
        dist.all_gather(own_slots, own)
        sz = splits[rank]
        uneven = torch.cat([torch.full((sz[k],), float(10 * rank + k)) for k in range(ws)])
        dist.all_to_all_single(uneven, uneven, sz, sz)
        expected = torch.cat([torch.full((splits[k][rank],), float(10 * k + rank)) for k in range(ws)])
        return [
            [x[0].item() for x in outs], o[::2].tolist(), [x.item() for x in ins[1:] + ins[:1]],
            single.tolist(), [x.item() for x in g], [x[0].item() for x in own_slots],
            torch.equal(uneven, expected),
        ]

    ws = 3
    for rank, got in enumerate(spmd(body, ws)):
        assert got[0] == [float(k + 1) for k in range(ws)], (rank, got)
        assert got[1] == [float(k + 1) for k in range(ws)], (rank, got)
        assert got[2] == [float(10 * k + rank) for k in range(ws)], (rank, got)
        assert got[3] == [float(10 * k + rank) for k in range(ws)], (rank, got)
        assert got[4] == [float(k + 1) for k in range(ws)], (rank, got)
        assert got[5] == [float(k) for k in range(ws)], (rank, got)
        assert got[6], (rank, got)


def test_outputs_that_require_grad_are_written_as_gloos_copy() -> None:
    """The collectives that gloo ends with a ``copy_`` into their outputs refuse, as that copy
    does in grad mode, a leaf that requires grad, before anything is sent (all_gather in
    both forms, reduce_scatter in both forms, all_to_all, all_reduce_coalesced; gather on its
    root); another output that requires grad gets the copy's grad_fn. all_reduce, broadcast,
    scatter and all_to_all_single write such a leaf, as gloo. Under ``no_grad`` all write."""
    leaf_error = "a leaf Variable that requires grad is being used in an in-place operation"

    def body(rank: int, ws: int) -> dict[str, str]:
        def leaf(n: int) -> torch.Tensor:
            return torch.zeros(n, requires_grad=True)

        calls = {
            "all_gather": lambda: dist.all_gather([leaf(2) for _ in range(ws)], torch.ones(2)),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(leaf(2 * ws), torch.ones(2)),
            "reduce_scatter": lambda: dist.reduce_scatter(leaf(2), [torch.ones(2)] * ws),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(leaf(2), torch.ones(2 * ws)),
            "all_to_all": lambda: dist.all_to_all([leaf(1) for _ in range(ws)], [torch.ones(1)] * ws),
            "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([leaf(2)]),
            "all_reduce": lambda: dist.all_reduce(leaf(2)),
            "broadcast": lambda: dist.broadcast(leaf(2), 0),
            "all_to_all_single": lambda: dist.all_to_all_single(leaf(ws), torch.ones(ws)),
            "scatter": lambda: dist.scatter(leaf(2), [torch.ones(2)] * ws if rank == 0 else None, src=0),
        }
        out = {}
        for name, call in calls.items():
            try:
                call()
                out[name] = "ok"
            except RuntimeError as exc:
                out[name] = "refused" if leaf_error in str(exc) else str(exc)
        with torch.no_grad():
            dist.all_gather([leaf(2) for _ in range(ws)], torch.ones(2))
        x = torch.zeros(2, requires_grad=True) * 1
        dist.all_gather([x if r == 0 else torch.zeros(2) for r in range(ws)], torch.full((2,), float(rank + 1)))
        out["non-leaf"] = f"{type(x.grad_fn).__name__} {x.tolist()}"
        g = torch.zeros(1, requires_grad=True) * 1
        dist.gather(torch.ones(1), [g] + [torch.zeros(1) for _ in range(ws - 1)] if rank == 0 else None, dst=0)
        out["gather root"] = type(g.grad_fn).__name__
        return out

    refused = {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_reduce_coalesced"}
    for rank, got in enumerate(spmd(body, 2)):
        assert {k for k, v in got.items() if v == "refused"} == refused, (rank, got)
        assert all(got[k] == "ok" for k in ("all_reduce", "broadcast", "all_to_all_single", "scatter")), (rank, got)
        assert got["non-leaf"] == "CopyBackwards [1.0, 1.0]", (rank, got)
        assert got["gather root"] == ("CopyBackwards" if rank == 0 else "MulBackward0"), (rank, got)


def test_all_to_all_single_of_nothing_and_split_sizes_given_as_a_tensor() -> None:
    """A tensor with no elements goes through all_to_all_single whatever its dim 0 (torch's
    does: nothing travels); split sizes given as a tensor are refused with torch's type,
    TypeError, before anything is sent."""

    def body(rank: int, ws: int) -> list[Any]:
        got = []
        for shape in [(3, 0), (1, 0), (0,)]:
            out = torch.zeros(shape)
            dist.all_to_all_single(out, torch.zeros(shape))
            got.append(tuple(out.shape))
        with pytest.raises(TypeError, match="split_sizes must be a list of ints"):
            dist.all_to_all_single(torch.zeros(2), torch.zeros(2), torch.tensor([1, 1]), torch.tensor([1, 1]))
        x = torch.full((2,), float(rank))
        dist.all_reduce(x)  # (the group still works)
        got.append(x.tolist())
        return got

    assert spmd(body, 2) == [[(3, 0), (1, 0), (0,), [1.0, 1.0]]] * 2


@pytest.mark.parametrize("path", ["shm", "sockets"])
def test_min_and_max_leave_the_same_bits_on_every_rank(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tie of +0.0 and -0.0, or of NaNs with other sign bits, is decided the same way on every
    rank (over the connections, the two ranks of a recursive-doubling exchange each combined its
    own partial result first, and kept different zeros), and as a fold in rank order decides it."""
    monkeypatch.setenv("TDIST_SHM", "1" if path == "shm" else "0")
    nan = float("nan")

    def value(rank: int) -> torch.Tensor:
        # per element: a zero whose sign alternates with rank and position, a NaN whose sign
        # does, and plain numbers
        zeros = [(-0.0 if (rank + i) % 2 else 0.0) for i in range(6)]
        nans = [(-nan if (rank + i) % 2 else nan) for i in range(4)]
        return torch.tensor(zeros + nans + [float(rank), -float(rank)])

    def body(rank: int, ws: int) -> list[list[int]]:
        out = []
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            t = value(rank)
            dist.all_reduce(t, op=op)
            out.append(t.view(torch.int32).tolist())
        return out

    for ws in (2, 3, 4, 5):
        got = spmd(body, ws)
        assert all(g == got[0] for g in got), (ws, got)
        for k, fold in enumerate((torch.maximum, torch.minimum)):
            expected = value(0)
            for r in range(1, ws):
                expected = fold(expected, value(r))
            assert got[0][k][:6] == expected[:6].view(torch.int32).tolist(), (ws, k, got[0][k], expected)
            assert torch.tensor(got[0][k], dtype=torch.int32).view(torch.float32)[6:10].isnan().all()
            assert got[0][k][10:] == expected[10:].view(torch.int32).tolist()
