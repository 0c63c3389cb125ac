"""tdist as a backend of torch.distributed: torch's own functions and DDP on tdist's transport.

Real processes (forked), torch's ``init_process_group(backend="tdist")`` after ``import tdist``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as tdc

import tdist  # noqa: F401  (registers the backend)
from tdist.testing import free_port, run_processes

pytestmark = pytest.mark.timeout(90)


def _init(rank: int, n: int, port: int, backend: str = "tdist") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    tdc.init_process_group(backend)


def _collectives(rank: int, n: int, port: int) -> dict[str, Any]:
    _init(rank, n, port)
    try:
        out: dict[str, Any] = {"backend": tdc.get_backend(), "pg": type(tdc.group.WORLD).__name__}
        t = torch.arange(6, dtype=torch.float32) + rank
        tdc.all_reduce(t)
        out["all_reduce"] = t.tolist()
        t = torch.tensor([rank, -rank], dtype=torch.int64)
        tdc.all_reduce(t, op=tdc.ReduceOp.MAX)
        out["all_reduce_max"] = t.tolist()
        t = torch.full((3,), float(rank))
        tdc.broadcast(t, src=n - 1)
        out["broadcast"] = t.tolist()
        outs = [torch.empty(2) for _ in range(n)]
        tdc.all_gather(outs, torch.full((2,), float(rank)))
        out["all_gather"] = [o.tolist() for o in outs]
        big = torch.empty(2 * n)
        tdc.all_gather_into_tensor(big, torch.full((2,), float(rank)))
        out["all_gather_into_tensor"] = big.tolist()
        rs = torch.empty(2)
        tdc.reduce_scatter_tensor(rs, torch.arange(2 * n, dtype=torch.float32) * (rank + 1))
        out["reduce_scatter_tensor"] = rs.tolist()
        a2a = torch.empty(n)
        tdc.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * rank)
        out["all_to_all_single"] = a2a.tolist()
        t = torch.full((2,), float(rank))
        tdc.reduce(t, dst=0)
        out["reduce"] = t.tolist() if rank == 0 else None
        # async work with a real future, and point to point
        t = torch.ones(1000) * (rank + 1)
        work = tdc.all_reduce(t, async_op=True)
        fut = work.get_future()
        work.wait()
        out["async"] = [t[0].item(), fut.value()[0][0].item()]
        if rank == 0:
            tdc.send(torch.tensor([42.0]), dst=1)
            r = tdc.irecv(torch.empty(1), src=1)
            r.wait()
        elif rank == 1:
            got = torch.empty(1)
            tdc.recv(got, src=0)
            tdc.isend(got + 1, dst=0).wait()
            out["recv"] = got.item()
        a, b = torch.ones(3) * (rank + 1), torch.ones(2) * (rank + 1)
        with tdc._coalescing_manager(async_ops=True) as cm:
            tdc.all_reduce(a)
            tdc.all_reduce(b)
        cm.wait()
        out["coalesced"] = [a.tolist(), b.tolist()]
        objs: list[Any] = [None] * n
        tdc.all_gather_object(objs, {"rank": rank})
        out["all_gather_object"] = objs
        tdc.barrier()
        return out
    finally:
        tdc.destroy_process_group()


@pytest.mark.parametrize("n", [2, 3])
def test_torch_collectives_run_on_the_tdist_backend(n: int) -> None:
    results = run_processes(_collectives, n, free_port(), timeout=80)
    s = sum(range(n))
    for rank, r in enumerate(results):
        assert r["backend"] == "tdist"
        assert r["all_reduce"] == [n * i + s for i in range(6)]
        assert r["all_reduce_max"] == [n - 1, 0]
        assert r["broadcast"] == [float(n - 1)] * 3
        assert r["all_gather"] == [[float(k)] * 2 for k in range(n)]
        assert r["all_gather_into_tensor"] == [float(k) for k in range(n) for _ in range(2)]
        total = sum(k + 1 for k in range(n))
        assert r["reduce_scatter_tensor"] == [float((2 * rank + j) * total) for j in range(2)]
        assert r["all_to_all_single"] == [float(rank + 10 * k) for k in range(n)]
        assert r["async"] == [float(total)] * 2
        assert r["all_gather_object"] == [{"rank": k} for k in range(n)]
        assert r["coalesced"] == [[float(total)] * 3, [float(total)] * 2]
    assert results[0]["reduce"] == [float(s)] * 2
    assert results[1]["recv"] == 42.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


STEPS = 4


def _ddp(rank: int, n: int, port: int) -> list[list[float]]:
    _init(rank, n, port)
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().flatten().tolist() for p in model.parameters()]
    finally:
        tdc.destroy_process_group()


def test_torch_ddp_trains_on_tdist_as_one_process_on_the_global_batch() -> None:
    n = 2
    results = run_processes(_ddp, n, free_port(), timeout=80)
    assert results[0] == results[1]  # identical on every rank
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        xs, ys = zip(*(_batch(step, r) for r in range(n)), strict=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    for got, want in zip(results[0], model.parameters(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want.detach().flatten(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["import torch; import tdist", "import tdist; import torch"])
def test_import_tdist_registers_the_backend_with_torch_whichever_comes_first(order: str) -> None:
    import subprocess
    import sys

    code = (
        f"{order}; import sys; import torch.distributed as d; "
        "assert 'tdist' in d.Backend.backend_list, d.Backend.backend_list; "
        "assert 'tdist.c10d' not in sys.modules  # (nothing of tdist's loads until a group is made)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_tdist_alone_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, tdist; from tdist import cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
