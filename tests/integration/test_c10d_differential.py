"""Differential test: one program, run by ``torch.distributed`` (gloo, real processes) and by
``tdist`` (ranks as threads, and as real processes), must give exactly the same results (small
integers, so every dtype is exact) for every collective and every ReduceOp gloo supports, world
sizes 1 to 4.

torch's side runs in a fresh driver process (this file run as a script) that forks the ranks
(forking the test process, which runs threads, would not be safe); the driver runs tdist's
process ranks too.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import tdist
from tdist.c10d._api import _destroy_all_worlds_for_tests
from tdist.testing import free_port, run_processes, run_threads

pytestmark = pytest.mark.timeout(240)

SIZES = [1, 2, 3, 4]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
SUM_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64]
TIMEOUT = timedelta(seconds=30)


def _vals(rank: int, n: int = 5, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([(rank * 3 + i * 5) % 7 + 1 for i in range(n)], dtype=dtype)


def program(d: Any, rank: int, ws: int) -> dict[str, Any]:
    """Every collective once or more; ``d`` is ``torch.distributed`` or ``tdist``."""
    warnings.simplefilter("ignore", FutureWarning)
    out: dict[str, Any] = {}
    for op in OPS:
        t = _vals(rank)
        d.all_reduce(t, op=getattr(d.ReduceOp, op))
        out[f"all_reduce/{op}"] = t.tolist()
        for root in range(ws):
            t = _vals(rank)
            d.reduce(t, root, op=getattr(d.ReduceOp, op))
            if rank == root:
                out[f"reduce/{op}/{root}"] = t.tolist()
        rs = torch.zeros(2, dtype=torch.int64)
        d.reduce_scatter(rs, [_vals(rank + i, 2) for i in range(ws)], op=getattr(d.ReduceOp, op))
        out[f"reduce_scatter/{op}"] = rs.tolist()
        rsu = torch.zeros(rank + 1, dtype=torch.int64)  # (uneven: input_list[i] has rank i's size)
        d.reduce_scatter(rsu, [_vals(rank + i, i + 1) for i in range(ws)], op=getattr(d.ReduceOp, op))
        out[f"reduce_scatter/uneven/{op}"] = rsu.tolist()
        rst = torch.zeros(2, dtype=torch.int64)
        d.reduce_scatter_tensor(rst, _vals(rank, 2 * ws), op=getattr(d.ReduceOp, op))
        out[f"reduce_scatter_tensor/{op}"] = rst.tolist()
    for dt in SUM_DTYPES:
        t = _vals(rank, 6, dt)
        d.all_reduce(t)
        out[f"all_reduce/SUM/{dt}"] = t.tolist()
    f = torch.tensor([2.0 * rank, 4.0, -6.0 * rank], dtype=torch.float64)
    d.all_reduce(f, op=d.ReduceOp.AVG)
    out["all_reduce/AVG"] = f.tolist()
    c = torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * (rank + 1)
    d.all_reduce(c)
    out["all_reduce/complex"] = c.tolist()
    for root in range(ws):
        t = _vals(rank)
        d.broadcast(t, root)
        out[f"broadcast/{root}"] = t.tolist()
        g = [torch.zeros(3, dtype=torch.int64) for _ in range(ws)] if rank == root else None
        d.gather(_vals(rank, 3), g, dst=root)
        if g is not None:
            out[f"gather/{root}"] = [x.tolist() for x in g]
        s = torch.zeros(2, dtype=torch.int64)
        d.scatter(s, [_vals(root * 10 + r, 2) for r in range(ws)] if rank == root else None, src=root)
        out[f"scatter/{root}"] = s.tolist()
    ag = [torch.zeros(4, dtype=torch.int32) for _ in range(ws)]
    d.all_gather(ag, _vals(rank, 4, torch.int32))
    out["all_gather"] = [x.tolist() for x in ag]
    agt = torch.zeros(ws * 3, dtype=torch.int64)
    d.all_gather_into_tensor(agt, _vals(rank, 3))
    out["all_gather_into_tensor"] = agt.tolist()
    a2a = [torch.zeros(2, dtype=torch.int64) for _ in range(ws)]
    d.all_to_all(a2a, [_vals(rank * 10 + j, 2) for j in range(ws)])
    out["all_to_all"] = [x.tolist() for x in a2a]
    in_splits = [(rank + j) % 3 + 1 for j in range(ws)]
    out_splits = [(i + rank) % 3 + 1 for i in range(ws)]
    src = torch.cat([torch.full((n,), rank * 10 + j) for j, n in enumerate(in_splits)])
    dst = torch.zeros(sum(out_splits), dtype=torch.int64)
    d.all_to_all_single(dst, src, out_splits, in_splits)
    out["all_to_all_single/splits"] = dst.tolist()
    even = torch.zeros(2 * ws, dtype=torch.int64)
    d.all_to_all_single(even, torch.arange(2 * ws) + 100 * rank)
    out["all_to_all_single"] = even.tolist()
    d.barrier()
    work = d.all_reduce(torch.full((2,), rank + 1), async_op=True)
    work.wait()
    out["async"] = [t.tolist() for t in work.result()]
    if ws > 1:
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        r = torch.zeros(2, dtype=torch.int64)
        reqs = d.batch_isend_irecv([d.P2POp(d.isend, _vals(rank, 2), nxt), d.P2POp(d.irecv, r, prv)])
        for w in reqs:
            w.wait()
        out["batch_isend_irecv"] = r.tolist()
        if rank == 0:
            senders = []
            for _ in range(ws - 1):
                x = torch.zeros(1, dtype=torch.int64)
                sender = d.recv(x)
                senders.append((sender, x.item()))
            out["recv_any"] = sorted(senders)
        else:
            d.send(torch.tensor([rank * 7]), 0)
        box: list[Any] = [None, None]
        if rank == 0:
            d.send_object_list([{"a": 1}, "b"], dst=ws - 1)
        elif rank == ws - 1:
            out["recv_object_list"] = (d.recv_object_list(box, src=0), box)
    sub = d.new_group([0, ws - 1]) if ws > 1 else d.new_group([0])
    if rank in (0, ws - 1):
        t = _vals(rank)
        d.all_reduce(t, group=sub)
        out["sub/all_reduce"] = t.tolist()
        b = _vals(rank)
        d.broadcast(b, ws - 1, group=sub)
        out["sub/broadcast"] = b.tolist()
        out["sub/ranks"] = (d.get_rank(sub), d.get_world_size(sub), d.get_process_group_ranks(sub))
    else:
        out["sub/ranks"] = (d.get_rank(sub), d.get_world_size(sub))
    objs: list[Any] = [None] * ws
    d.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    out["all_gather_object"] = objs
    lst: list[Any] = [1, [2, "three"]] if rank == 0 else [None, None]
    d.broadcast_object_list(lst, src=0)
    out["broadcast_object_list"] = lst
    gl: list[Any] | None = [None] * ws if rank == 0 else None
    d.gather_object(("r", rank), gl, dst=0)
    out["gather_object"] = gl
    so: list[Any] = [None]
    d.scatter_object_list(so, [{"to": r} for r in range(ws)] if rank == 0 else None, src=0)
    out["scatter_object_list"] = so
    out["meta"] = (d.get_rank(), d.get_world_size(), d.get_backend(), d.is_initialized())
    _errors(d, rank, ws, sub, out)
    return out


_BASES = (TypeError, ValueError, RuntimeError, IndexError, KeyError, TimeoutError, AssertionError)


def _errors(d: Any, rank: int, ws: int, sub: Any, out: dict[str, Any]) -> None:
    """Calls that raise before anything is sent: the builtin bases of what each raises (``_diff``
    wants ours to have every base torch's has: ours may add one, e.g. ValueError to gloo's
    RuntimeError)."""
    warnings.filterwarnings("ignore", message="Running .* which does not belong to the given group")

    def err(name: str, call: Any) -> None:
        try:
            call()
            out[f"err/{name}"] = "no error"
        except Exception as exc:
            out[f"err/{name}"] = sorted(b.__name__ for b in _BASES if isinstance(exc, b))

    err("group_not_a_group", lambda: d.all_reduce(torch.ones(1), group="g"))
    err("get_rank_not_a_group", lambda: d.get_rank("g"))
    if rank == 0:
        store = d.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
        err("store_multi_set_sizes", lambda: store.multi_set(["a", "b"], ["x"]))
    if ws > 1:  # (gloo's pair to itself is not connected: a RuntimeError; torch's send checks first)
        err("isend_self", lambda: d.isend(torch.ones(1), rank))
        err("recv_self", lambda: d.recv(torch.ones(1), rank))
        err("send_self", lambda: d.send(torch.ones(1), rank))
    if rank not in (0, ws - 1):  # not in ``sub``: torch maps a root before it skips the call
        err("non_member/broadcast_no_src", lambda: d.broadcast(torch.ones(1), group=sub))
        err("non_member/broadcast_src_not_in_group", lambda: d.broadcast(torch.ones(1), src=rank, group=sub))
        err("non_member/broadcast_group_src", lambda: d.broadcast(torch.ones(1), group=sub, group_src=1))
        err("non_member/reduce_both", lambda: d.reduce(torch.ones(1), dst=0, group=sub, group_dst=0))
        err("non_member/isend_no_dst", lambda: d.isend(torch.ones(1), group=sub))
        err("non_member/scatter_src_not_in_group", lambda: d.scatter(torch.ones(1), src=rank, group=sub))
        err("non_member/gather_object_both", lambda: d.gather_object(1, None, dst=0, group=sub, group_dst=0))
        err("non_member/broadcast_object_list", lambda: d.broadcast_object_list([1], src=rank, group=sub))
        err("non_member/scatter_object_list", lambda: d.scatter_object_list([None], None, group=sub))
    # refused by every rank alike (gloo: RuntimeError, at the call or from the work)
    err("all_gather_slot_size", lambda: d.all_gather([torch.zeros(2) for _ in range(ws)], torch.ones(1)))
    err("all_gather_list_len", lambda: d.all_gather([torch.zeros(1)] * (ws + 1), torch.ones(1)))
    err("all_reduce_float8", lambda: d.all_reduce(torch.ones(2).to(torch.float8_e4m3fn)))
    err("reduce_scatter_list_len", lambda: d.reduce_scatter(torch.zeros(1), [torch.ones(1)] * (ws + 1)))
    # (every rank sends itself 2 elements into 1: gloo's enforce, tdist's check before sending)
    err("all_to_all_single_own_part", lambda: d.all_to_all_single(torch.zeros(ws), torch.ones(2 * ws), None, [2] * ws))
    # (gloo refuses a non-contiguous input, ValueError, and takes a non-contiguous output)
    err("all_to_all_single_noncontiguous_input", lambda: d.all_to_all_single(torch.zeros(ws, 2), torch.ones(2, ws).t()))
    err("all_to_all_single_noncontiguous_output", lambda: d.all_to_all_single(torch.zeros(2, ws).t(), torch.ones(ws, 2)))


def _torch_rank(rank: int, ws: int, port: int) -> dict[str, Any]:
    import torch.distributed as tdd

    store = tdd.TCPStore("127.0.0.1", port, ws, rank == 0, TIMEOUT)
    tdd.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=TIMEOUT)
    try:
        return program(tdd, rank, ws)
    finally:
        tdd.destroy_process_group()


def _tdist_rank(rank: int, ws: int, port: int) -> dict[str, Any]:
    store = tdist.TCPStore("127.0.0.1", port, ws, rank == 0, TIMEOUT)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=TIMEOUT)
    try:
        return program(tdist, rank, ws)
    finally:
        tdist.destroy_process_group()


def _driver() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for ws in SIZES:
        out[f"torch/{ws}"] = run_processes(_torch_rank, ws, free_port(), timeout=90, start_method="fork")
        out[f"tdist/{ws}"] = run_processes(_tdist_rank, ws, free_port(), timeout=90, start_method="fork")
    return out


@pytest.fixture(scope="module")
def from_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("differential") / "results.pickle"
    done = subprocess.run(
        [sys.executable, __file__, str(path)], capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode == 0, f"the driver failed:\n{done.stdout}\n{done.stderr}"
    with path.open("rb") as f:
        results: dict[str, list[dict[str, Any]]] = pickle.load(f)
    return results


def _diff(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for rank, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for key in sorted(set(a) | set(b)):
            if key.startswith("err/") and isinstance(a.get(key), list) and isinstance(b.get(key), list):
                if not set(b[key]) <= set(a[key]):
                    problems.append(f"rank {rank} {key}: tdist raises {a[key]}, torch {b[key]}")
            elif a.get(key, "<missing>") != b.get(key, "<missing>"):
                problems.append(f"rank {rank} {key}: tdist {a.get(key, '<missing>')!r} != torch {b.get(key, '<missing>')!r}")
    return problems


@pytest.mark.parametrize("ws", SIZES)
def test_tdist_threads_match_torch_gloo(ws: int, from_processes: dict[str, list[dict[str, Any]]]) -> None:
    store = tdist.HashStore()
    store.set_timeout(TIMEOUT)

    def body(rank: int, world_size: int) -> dict[str, Any]:
        tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
        try:
            return program(tdist, rank, world_size)
        finally:
            tdist.destroy_process_group()

    try:
        ours = run_threads(body, ws, timeout=60)
    finally:
        _destroy_all_worlds_for_tests()
    theirs = from_processes[f"torch/{ws}"]
    assert not _diff(ours, theirs)
    assert len(theirs[0]) > 40  # the program really ran


@pytest.mark.parametrize("ws", SIZES)
def test_tdist_processes_match_torch_gloo(ws: int, from_processes: dict[str, list[dict[str, Any]]]) -> None:
    assert not _diff(from_processes[f"tdist/{ws}"], from_processes[f"torch/{ws}"])


if __name__ == "__main__":
    with Path(sys.argv[1]).open("wb") as out_file:
        pickle.dump(_driver(), out_file)
