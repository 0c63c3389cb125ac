"""tdist as a backend of torch.distributed: torch's own functions and DDP on tdist's transport.

Real processes (forked), torch's ``init_process_group(backend="tdist")`` after ``import tdist``.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as tdc

import tdist  # (registers the backend)
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
        rsu = torch.empty(rank + 1)  # (uneven: input_list[i] has rank i's size, as gloo)
        tdc.reduce_scatter(rsu, [torch.arange(i + 1.0) * (rank + 1) for i in range(n)])
        out["reduce_scatter_uneven"] = rsu.tolist()
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
        # torch's contract: once wait() returned, a future asked for then is done already
        late = []
        for _ in range(20):
            w = tdc.all_reduce(torch.ones(2), async_op=True)
            w.wait()
            late.append(w.get_future().done())
        out["future_after_wait"] = all(late)
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
        assert r["reduce_scatter_uneven"] == [float(j * total) for j in range(rank + 1)]
        assert r["all_to_all_single"] == [float(rank + 10 * k) for k in range(n)]
        assert r["async"] == [float(total)] * 2
        assert r["future_after_wait"]
        assert r["all_gather_object"] == [{"rank": k} for k in range(n)]
        assert r["coalesced"] == [[float(total)] * 3, [float(total)] * 2]
    assert results[0]["reduce"] == [float(s)] * 2
    assert results[1]["recv"] == 42.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class _Branchy(torch.nn.Module):
    """A model with a branch some steps leave unused, and a buffer (running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.b = torch.nn.Linear(32, 4)
        self.unused = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x)))
        return self.b(h) + (self.unused(h) if use_branch else 0)


class _Sparse(torch.nn.Module):
    """An embedding with sparse gradients (DDP all-reduces them as sparse tensors)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16, sparse=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb((x.abs() * 10).long() % 50).mean(dim=1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


STEPS = 4


def _hook(ddp: Any, feature: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if feature == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif feature == "fp16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif feature == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _train(rank: int, n: int, port: int, backend: str, feature: str) -> dict[str, Any]:
    """``STEPS`` steps of DDP with ``feature``, on torch's ``backend`` (or, with "tdist-api",
    a program ported by its imports: ``tdist.init_process_group("gloo")``, no process group
    given to DDP, torch's DistributedSampler)."""
    if backend == "tdist-api":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
        tdist.init_process_group("gloo")
        destroy: Any = tdist.destroy_process_group
    else:
        _init(rank, n, port, backend)
        destroy = tdc.destroy_process_group
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        out: dict[str, Any] = {}
        model = _Branchy() if feature in ("find_unused", "broadcast_buffers", "static_graph") else _model()
        if feature == "sparse_gradients":
            model = _Sparse()
        kw: dict[str, Any] = {}
        if feature == "find_unused":
            kw["find_unused_parameters"] = True
        elif feature == "gradient_as_bucket_view":
            kw["gradient_as_bucket_view"] = True
        elif feature == "static_graph":
            kw["static_graph"] = True
        elif feature == "broadcast_buffers":
            kw["broadcast_buffers"] = True
        if feature == "broadcast_buffers" and rank > 0:  # (rank 0's running statistics win)
            with torch.no_grad():
                model.bn.running_mean.fill_(float(rank))
        ddp = DDP(model, bucket_cap_mb=0.001 if feature == "small_buckets" else 25, **kw)
        _hook(ddp, feature)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        if feature == "sampler":
            from torch.utils.data import DistributedSampler, TensorDataset

            sampler = DistributedSampler(TensorDataset(torch.arange(20)), shuffle=False)
            out["sampler"] = [len(sampler), list(sampler)]
        steps = STEPS + rank if feature == "join" else STEPS  # (uneven inputs)
        with ddp.join() if feature == "join" else _nothing():
            for step in range(steps):
                x, y = _batch(step, rank)
                opt.zero_grad()
                if feature == "no_sync":  # two micro-batches, the first without a sync
                    with ddp.no_sync():
                        torch.nn.functional.mse_loss(ddp(x[:4]), y[:4]).backward()
                    torch.nn.functional.mse_loss(ddp(x[4:]), y[4:]).backward()
                elif feature == "find_unused":
                    torch.nn.functional.mse_loss(ddp(x, use_branch=step % 2 == 1), y).backward()
                elif feature == "broadcast_buffers":
                    torch.nn.functional.mse_loss(ddp(x, use_branch=True), y).backward()
                else:
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
        out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
        out["buffers"] = [b.detach().flatten().tolist() for b in model.buffers()]
        out["torch_rank"] = [tdc.get_rank(), tdc.get_world_size()]
        # (gloo's group, held by DDP's reducer, joins its threads when freed, and hangs if a
        # peer has gone: free it while every rank is still there)
        del ddp, opt
        gc.collect()
        tdc.barrier()
        return out
    finally:
        destroy()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _single_process(n: int) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        xs, ys = zip(*(_batch(step, r) for r in range(n)), strict=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach().flatten() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["tdist", "tdist-api"])
def test_torch_ddp_trains_on_tdist_as_one_process_on_the_global_batch(backend: str) -> None:
    n = 2
    results = run_processes(_train, n, free_port(), backend, "sampler", timeout=80)
    assert results[0]["params"] == results[1]["params"]  # identical on every rank
    for got, want in zip(results[0]["params"], _single_process(n), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    # torch's own functions (DistributedSampler's among them) see the group
    assert [r["torch_rank"] for r in results] == [[0, 2], [1, 2]]
    assert results[0]["sampler"] == [10, list(range(0, 20, 2))]
    assert results[1]["sampler"] == [10, list(range(1, 20, 2))]


FEATURES = [
    "no_sync", "find_unused", "gradient_as_bucket_view", "static_graph", "small_buckets",
    "allreduce_hook", "fp16_compress_hook", "powersgd", "join", "broadcast_buffers", "sparse_gradients",
]


@pytest.mark.parametrize("feature", FEATURES)
def test_ddp_feature_on_tdist_trains_as_on_gloo(feature: str) -> None:
    """The same training under torch's gloo and under tdist: every parameter and buffer equal."""
    n = 3 if feature in ("join", "find_unused") else 2
    got = run_processes(_train, n, free_port(), "tdist", feature, timeout=80)
    want = run_processes(_train, n, free_port(), "gloo", feature, timeout=80)
    for rank in range(n):
        assert got[rank]["params"] == got[0]["params"]  # identical on every rank
        for key in ("params", "buffers"):
            for g, w in zip(got[rank][key], want[rank][key], strict=True):
                torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-6, atol=1e-7)
    # (broadcast_buffers: rank 1 starts with other running statistics than rank 0; matching
    # gloo's rank by rank means rank 0's reached it)


def _ported_groups(rank: int, n: int, port: int) -> dict[str, Any]:
    """A program ported by its imports hands tdist's groups to torch's modules: a sub-group to
    DDP, ``group.WORLD`` to PowerSGD's state."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    tdist.init_process_group("gloo")
    try:
        out: dict[str, Any] = {}
        sub = tdist.new_group([0, 1])
        world = tdist.group.WORLD
        out["world"] = [world is tdc.group.WORLD, tdist.get_rank(world), tdist.get_world_size(world)]
        if rank < 2:
            t = torch.ones(2) * (rank + 1)
            tdist.all_reduce(t, group=sub)
            tdc.all_reduce(t, group=sub)  # (torch's function, on the same group)
            out["sub"] = [t.tolist(), tdist.get_rank(sub), tdist.get_process_group_ranks(sub)]
            ddp = DDP(_model(), process_group=sub)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(STEPS):
                x, y = _batch(step, rank)
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            out["params"] = [p.detach().flatten().tolist() for p in ddp.parameters()]
            del ddp, opt
            tdist.barrier(group=sub)
            tdist.destroy_process_group(sub)
            try:
                tdist.get_rank(sub)
            except ValueError as exc:
                out["destroyed"] = str(exc)
        else:
            out["sub"] = sub
        state = powerSGD_hook.PowerSGDState(process_group=world, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp = DDP(_model(), process_group=world)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        for step in range(3):
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        out["world_grads"] = [p.grad.flatten().tolist() for p in ddp.parameters()]
        del ddp
        gc.collect()
        tdist.barrier()
        return out
    finally:
        tdist.destroy_process_group()


def test_tdist_groups_and_group_world_are_taken_by_torchs_modules() -> None:
    """tdist's ``new_group`` and ``group.WORLD`` hand out torch's twin of the group (same
    backend, no new connection): torch's DDP and PowerSGD take them, tdist's and torch's
    functions both run on them, and destroying one destroys the twin."""
    n = 3
    res = run_processes(_ported_groups, n, free_port(), timeout=80)
    for rank, r in enumerate(res):
        assert r["world"] == [True, rank, n]
        assert r["world_grads"] == res[0]["world_grads"]
    assert res[2]["sub"] == tdist.GroupMember.NON_GROUP_MEMBER
    for rank in range(2):
        assert res[rank]["sub"] == [[6.0, 6.0], rank, [0, 1]]
        assert "not registered" in res[rank]["destroyed"]
    assert res[0]["params"] == res[1]["params"]
    for got, want in zip(res[0]["params"], _single_process(2), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def _torch_made(rank: int, n: int, port: int, port2: int) -> dict[str, Any]:
    """torch's ``init_process_group("tdist")`` made the group; tdist's functions run on it."""
    _init(rank, n, port)
    out: dict[str, Any] = {}
    t = torch.ones(3) * (rank + 1)
    tdist.all_reduce(t)
    out["world"] = [
        t.tolist(), tdist.is_initialized(), tdist.get_rank(), tdist.get_world_size(),
        tdist.get_backend(), tdist.group.WORLD is tdc.group.WORLD,
    ]
    sub = tdist.new_group([0, 2])  # (torch makes it: its group counter moves on every rank)
    torch_sub = tdc.new_group([1, 2], backend="tdist")
    if rank != 1:
        x = torch.tensor([float(rank)])
        tdist.all_reduce(x, group=sub)
        out["sub"] = [x.item(), tdist.get_rank(sub), tdist.get_process_group_ranks(sub), isinstance(sub, tdc.ProcessGroup)]
    if rank != 0:
        y = torch.tensor([float(rank)])
        tdist.broadcast(y, group_src=1, group=torch_sub)  # (a group of torch's own making)
        out["torch_sub"] = [y.item(), tdist.get_rank(torch_sub), tdist.get_group_rank(torch_sub, rank)]
    objs: list[Any] = [None] * n
    tdist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    if rank == 0:
        tdist.send(torch.arange(4.0), 1)
    elif rank == 1:
        r = torch.zeros(4)
        tdist.recv(r, 0)
        out["recv"] = r.tolist()
    tdist.barrier()
    try:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=rank, world_size=n)
    except ValueError as exc:
        out["twice"] = str(exc)
    tdist.destroy_process_group()  # (torch's too: it is one group)
    out["after"] = [tdc.is_initialized(), tdist.is_initialized()]
    _init(rank, n, port2)
    z = torch.ones(1)
    tdist.all_reduce(z)
    tdc.destroy_process_group()  # (torch destroys it: tdist lets go of it too)
    out["again"] = [z.item(), tdist.is_initialized()]
    return out


def test_tdist_functions_run_on_the_group_torchs_init_process_group_made() -> None:
    """The reverse of a port by imports: a program calls torch's ``init_process_group("tdist")``
    and then tdist's functions (``all_reduce``, ``new_group``, object collectives, p2p): they run
    on torch's default group and on torch's ``new_group(backend="tdist")`` groups, and
    destroying on either side lets both go."""
    n = 3
    res = run_processes(_torch_made, n, free_port(), free_port(), timeout=80)
    for rank, r in enumerate(res):
        assert r["world"] == [[6.0] * 3, True, rank, n, "tdist", True]
        assert r["objects"] == [{"rank": i} for i in range(n)]
        assert r["twice"] == "trying to initialize the default process group twice!"
        assert r["after"] == [False, False]
        assert r["again"] == [float(n), False]
    assert res[0]["sub"] == [2.0, 0, [0, 2], True] and res[2]["sub"] == [2.0, 1, [0, 2], True]
    assert res[1]["torch_sub"] == [2.0, 0, 0] and res[2]["torch_sub"] == [2.0, 1, 1]  # (group rank 1: rank 2)
    assert res[1]["recv"] == [0.0, 1.0, 2.0, 3.0]


def _init_form(rank: int, n: int, port: int, form: str, where: str) -> None:
    if form == "env":
        _init(rank, n, port, "cpu:tdist")
    elif form == "tcp":
        tdc.init_process_group("tdist", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    elif form == "file":
        tdc.init_process_group("tdist", init_method=f"file://{where}/rdzv", rank=rank, world_size=n)
    else:  # a store of torch's own
        store = tdc.TCPStore("127.0.0.1", port, n, is_master=rank == 0, timeout=timedelta(seconds=30))
        tdc.init_process_group("tdist", store=store, rank=rank, world_size=n)


def _forms(rank: int, n: int, port: int, form: str, where: str) -> dict[str, Any]:
    _init_form(rank, n, port, form, where)
    try:
        out: dict[str, Any] = {"backend": tdc.get_backend()}
        t = torch.ones(4) * (rank + 1)
        tdc.all_reduce(t)
        out["all_reduce"] = t.tolist()
        # a sub-group of ranks 1.. on the tdist backend, and its collectives
        sub = tdc.new_group(list(range(1, n)), backend="tdist")
        if rank >= 1:
            out["sub_backend"] = tdc.get_backend(sub)
            t = torch.ones(2) * rank
            tdc.all_reduce(t, group=sub)
            out["sub"] = t.tolist()
        # (torch's function refuses every backend but gloo by name; tdist's serves torch's groups)
        tdist.monitored_barrier(tdc.group.WORLD, timeout=timedelta(seconds=20), wait_all_ranks=True)
        # a ring of batched sends and receives
        right, left = (rank + 1) % n, (rank - 1) % n
        got = torch.empty(3)
        ops = [tdc.P2POp(tdc.isend, torch.full((3,), float(rank)), right), tdc.P2POp(tdc.irecv, got, left)]
        for w in tdc.batch_isend_irecv(ops):
            w.wait()
        out["ring"] = got.tolist()
        objs: list[Any] = [{"from": rank}] if rank == 0 else [None]
        tdc.broadcast_object_list(objs, src=0)
        out["object"] = objs[0]
        if rank == 0:
            tdc.send(torch.tensor([7.0]), dst=n - 1)
        elif rank == n - 1:
            t = torch.empty(1)
            out["any_source"] = tdc.recv(t)  # (src=None: from anyone)
        return out
    finally:
        tdc.destroy_process_group()


@pytest.mark.parametrize("form", ["env", "tcp", "file", "store"])
def test_every_init_form_and_group_op_on_the_tdist_backend(form: str, tmp_path: Any) -> None:
    n = 3
    results = run_processes(_forms, n, free_port(), form, str(tmp_path), timeout=80)
    for rank, r in enumerate(results):
        assert r["backend"] == ("cpu:tdist" if form == "env" else "tdist")  # (torch's echo of the string)
        assert r["all_reduce"] == [6.0] * 4
        if rank >= 1:
            assert r["sub_backend"] == "tdist"
            assert r["sub"] == [float(sum(range(1, n)))] * 2
        assert r["ring"] == [float((rank - 1) % n)] * 3
        assert r["object"] == {"from": 0}
    assert results[n - 1]["any_source"] == 0


def _layout(v: Any, outputs: list[torch.Tensor]) -> Any:
    """A future's value with each tensor named by where it lies in ``outputs`` (index, and
    offset in elements from that tensor's start) and by its shape."""
    if isinstance(v, list):
        return [_layout(x, outputs) for x in v]
    for i, o in enumerate(outputs):
        start, size = o.data_ptr(), o.numel() * o.element_size()
        if start <= v.data_ptr() < start + max(size, 1):
            return [i, (v.data_ptr() - start) // o.element_size(), list(v.shape)]
    return ["not an output", list(v.shape)]


def _gather_futures(rank: int, n: int, port: int, backend: str) -> dict[str, Any]:
    """What the futures of torch's gathering collectives hold (DDP's comm hooks read them:
    the quantization hooks index ``fut.value()``)."""
    _init(rank, n, port, backend)
    try:
        out: dict[str, Any] = {}
        outs = [torch.empty(2) for _ in range(n)]
        w = tdc.all_gather(outs, torch.full((2,), float(rank)), async_op=True)
        out["all_gather"] = _layout(w.get_future().wait(), outs)
        flat = torch.empty(2 * n)
        w = tdc.all_gather_into_tensor(flat, torch.full((2,), float(rank)), async_op=True)
        out["all_gather_into_tensor"] = _layout(w.get_future().wait(), [flat])
        stacked = torch.empty(n, 3)
        w = tdc.all_gather_into_tensor(stacked, torch.full((1, 3), float(rank)), async_op=True)
        w.wait()
        out["stacked_result"] = _layout(w.result(), [stacked])
        got = [torch.empty(2) for _ in range(n)] if rank == 0 else None
        w = tdc.gather(torch.full((2,), float(rank)), got, dst=0, async_op=True)
        out["gather"] = _layout(w.get_future().wait(), got or [])
        # (torch's deprecated all_gather_coalesced: lists[r][i] gets rank r's inputs[i])
        ins = [torch.full((2, 2), float(rank)), torch.arange(3.0) + rank]
        lists = [[torch.zeros(2, 2), torch.zeros(3)] for _ in range(n)]
        fut = tdc.all_gather_coalesced(lists, ins, async_op=True)
        value = fut.wait()
        out["coalesced"] = [[t.flatten().tolist() for t in lst] for lst in lists]
        out["coalesced_value"] = _layout(value, [t for lst in lists for t in lst])
        with pytest.raises(RuntimeError, match="allgather_coalesced"):
            tdc.all_gather_coalesced(lists[:1], ins)
        tdc.barrier()
        return out
    finally:
        tdc.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gathering_futures_hold_what_gloos_hold() -> None:
    n = 3
    got = run_processes(_gather_futures, n, free_port(), "tdist", timeout=80)
    want = run_processes(_gather_futures, n, free_port(), "gloo", timeout=80)
    assert got == want
    assert want[0]["all_gather"] == [[k, 0, [2]] for k in range(n)]  # (the output tensors, flat)
    assert want[0]["all_gather_into_tensor"] == [[0, 2 * k, [2]] for k in range(n)]  # (views, a rank each)
    assert want[0]["coalesced"] == [[[float(r)] * 4, [r + 0.0, r + 1.0, r + 2.0]] for r in range(n)]


def _gather_into_tensor_future(rank: int, n: int, port: int) -> list[Any]:
    """tdist's own ``all_gather_into_tensor``: its future holds ``output`` cut a rank a view."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    tdist.init_process_group("gloo")
    try:
        flat, stacked = torch.empty(2 * n), torch.empty(n, 3)
        v1 = tdist.all_gather_into_tensor(flat, torch.full((2,), float(rank)), async_op=True).get_future().wait()
        v2 = tdist.all_gather_into_tensor(stacked, torch.ones(1, 3), async_op=True).get_future().wait()
        return [_layout(v1, [flat]), _layout(v2, [stacked])]
    finally:
        tdist.destroy_process_group()


def test_tdists_gather_into_tensor_future_holds_a_view_per_rank_as_gloos() -> None:
    n = 3
    for got in run_processes(_gather_into_tensor_future, n, free_port(), timeout=60):
        assert got == [[[0, 2 * k, [2]] for k in range(n)], [[0, 3 * k, [1, 3]] for k in range(n)]]


class _OffCpu(torch.Tensor):
    """A tensor that says it is on an XPU device (and has no data anywhere)."""

    @staticmethod
    def __new__(cls, n: int) -> _OffCpu:
        return torch.Tensor._make_wrapper_subclass(cls, (n,), dtype=torch.float32, device="xpu")  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"_OffCpu has no data ({func})")


def _bad_input(rank: int, n: int, port: int, api: str) -> dict[str, Any]:
    d: Any = tdc
    if api == "tdist":  # tdist's own functions refuse the same, with the same types
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
        tdist.init_process_group("gloo")
        d = tdist
    else:
        _init(rank, n, port)
    try:
        out: dict[str, Any] = {}
        off_cpu = _OffCpu(2)  # (no accelerator here: a tensor that only says where it lives)
        for name, call in {
            "all_reduce": lambda: d.all_reduce(off_cpu),
            "broadcast": lambda: d.broadcast(off_cpu, src=0),
            "all_gather": lambda: d.all_gather([torch.empty(2) for _ in range(n)], off_cpu),
            "send": lambda: d.send(off_cpu, dst=(rank + 1) % n),
        }.items():
            with pytest.raises(RuntimeError, match=r"tdist: \w+ got a tensor on xpu.*\.cpu\(\)"):
                call()
            out[name] = "refused"
        meta = torch.ones(2, device="meta")  # (as gloo's meta kernels: nothing happens)
        out["meta"] = [d.all_reduce(meta), d.broadcast(meta, src=0), d.send(meta, dst=(rank + 1) % n)]
        sparse = torch.eye(3).to_sparse()
        with pytest.raises(NotImplementedError, match=r"broadcast does not take torch\.sparse_coo"):
            d.broadcast(sparse, src=0)
        # the one sparse collective gloo has: a sum of every rank's entries
        t = torch.sparse_coo_tensor([[0, rank + 1], [rank, 2]], [1.0 + rank, 5.0], (n + 1, 3))
        d.all_reduce(t)
        out["sparse"] = [t.is_sparse, t.to_dense().tolist()]
        t = torch.ones(2)
        d.all_reduce(t)  # (nobody sent anything for a refused call: the group is in step)
        out["after"] = t.tolist()
        return out
    finally:
        d.destroy_process_group()


@pytest.mark.parametrize("api", ["torch", "tdist"])
def test_bad_input_is_refused_with_torchs_error_types_and_the_group_goes_on(api: str) -> None:
    n = 2
    results = run_processes(_bad_input, n, free_port(), api, timeout=60)
    want = torch.zeros(n + 1, 3)
    for r in range(n):
        want[0, r] += 1.0 + r
        want[r + 1, 2] += 5.0
    for r in results:
        assert r["sparse"] == [True, want.tolist()]
        assert r["after"] == [float(n)] * 2
        assert r["meta"] == [None, None, None]


def _refusals(rank: int, n: int, port: int, which: str) -> dict[str, Any]:
    """Each call of ``which`` set on torch's functions: refused with gloo's type, RuntimeError
    (its type and text), before anything is sent; the group goes on in step."""
    import torch.distributed._functional_collectives as fc

    _init(rank, n, port)
    try:
        calls = {
            "splits": {
                "count": lambda: tdc.all_to_all_single(torch.empty(4), torch.ones(4), None, [4]),
                "sum": lambda: tdc.all_to_all_single(torch.empty(4), torch.ones(4), [3, 3], None),
                "funcol": lambda: fc.all_to_all_single(torch.ones(4), [1, 2], [1, 1], tdc.group.WORLD).wait(),
            },
            "sizes": {
                "all_gather_list_len": lambda: tdc.all_gather([torch.empty(1)], torch.ones(1)),
                "all_gather_slot_size": lambda: tdc.all_gather([torch.empty(2) for _ in range(n)], torch.ones(1)),
                "all_gather_into_tensor": lambda: tdc.all_gather_into_tensor(torch.empty(2 * n + 1), torch.ones(2)),
                "reduce_scatter_tensor": lambda: tdc.reduce_scatter_tensor(torch.empty(1), torch.ones(n + 1)),
                "reduce_scatter_own_entry": lambda: tdc.reduce_scatter(torch.empty(2), [torch.ones(1)] * n),
                "all_to_all_single_own_part": lambda: tdc.all_to_all_single(torch.empty(n), torch.ones(2 * n), None, [2] * n),
            },
        }[which]
        out: dict[str, Any] = {}
        for name, call in calls.items():
            try:
                call()
                out[name] = ("no error", "")
            except RuntimeError as exc:
                out[name] = (type(exc).__name__, str(exc))
        t = torch.ones(2)
        tdc.all_reduce(t)  # (nothing was sent for a refused call: the group is in step)
        out["after"] = t.tolist()
        return out
    finally:
        tdc.destroy_process_group()


def test_all_to_all_single_refuses_bad_split_sizes_with_gloos_error_type() -> None:
    for r in run_processes(_refusals, 2, free_port(), "splits", timeout=60):
        assert "Number of tensor splits not equal to group size" in r["count"][1]
        assert "Split sizes doesn't match total dim 0 size" in r["sum"][1]
        assert "Split sizes doesn't match total dim 0 size" in r["funcol"][1]
        assert r["after"] == [2.0, 2.0]


def test_wrong_sizes_through_torchs_functions_are_runtime_errors_as_gloos() -> None:
    for r in run_processes(_refusals, 2, free_port(), "sizes", timeout=60):
        assert r.pop("after") == [2.0, 2.0]
        kinds = {name: kind for name, (kind, _) in r.items()}
        assert kinds == dict.fromkeys(kinds, "CollectiveArgumentError") and len(kinds) == 6, r


def _store_port_after_destroy(rank: int, n: int, port: int, between: str) -> bool:
    import gc
    import socket
    import time

    gc.disable()  # (only reference counts free what destroy lets go of)
    try:
        _init(rank, n, port)
        t = torch.ones(2)
        tdc.all_reduce(t)
        if between == "a tdist call":  # (tdist takes torch's group for its own: a handle on it)
            import tdist

            assert tdist.get_rank() == rank
        elif between == "a device mesh":  # (groups of torch's making, on tdist's backend)
            from torch.distributed.device_mesh import init_device_mesh

            init_device_mesh("cpu", (1, n))
        tdc.barrier()
        tdc.destroy_process_group()
        if rank != 0:
            return True
        deadline = time.monotonic() + 5.0  # (a stopping thread may hold it a moment)
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    return True  # rank 0's server of torch's store is gone, as with gloo
        return False
    finally:
        gc.enable()


@pytest.mark.parametrize("between", ["nothing", "a tdist call", "a device mesh"])
def test_destroying_the_group_lets_go_of_torchs_store_at_once(between: str) -> None:
    # (its server on rank 0 lived on until the garbage collector ran: a program that formed its
    # group again on the same port had ranks read the old group's keys from it)
    assert run_processes(_store_port_after_destroy, 2, free_port(), between, timeout=60) == [True, True]


def _form_again(rank: int, n: int, port: int, where: str, rounds: int) -> list[Any]:
    import time

    from torch.distributed.device_mesh import init_device_mesh

    out: list[Any] = []
    for it in range(rounds):
        _init(rank, n, port)
        t = torch.ones(2)
        tdc.all_reduce(t)
        out.append(t.tolist())
        init_device_mesh("cpu", (2, n // 2))  # (groups of torch's making on it: a longer destroy)
        tdc.barrier()
        if it == 0 and rank == 0:
            # rank 0 is late to destroy (as a rank doing more work may be): the others wait in
            # their destroy while it still serves the store, so none is seen leaving it
            # (else it would start the next group on this old server)
            left = [os.path.join(where, f"left-{q}") for q in range(1, n)]
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not any(os.path.exists(f) for f in left):
                time.sleep(0.01)
            out.append([q for q, f in enumerate(left, 1) if os.path.exists(f)])
        tdc.destroy_process_group()
        if it == 0 and rank != 0:
            open(os.path.join(where, f"left-{rank}"), "w").close()
    return out


@pytest.mark.timeout(120)
def test_forming_the_default_group_again_on_the_same_port(tmp_path: Any) -> None:
    # (a rank through its destroy before rank 0 had let go of torch's store joined rank 0's old
    # server when it formed the group again: it read the old group's keys and failed, or hung
    # with rank 0 waiting for it on the new server; 1 run in 3 with a device mesh between, so
    # the group is formed several times)
    rounds = 6
    results = run_processes(_form_again, 4, free_port(), str(tmp_path), rounds, timeout=100)
    assert results[0][1] == []  # (no rank left its destroy while rank 0 still served the store)
    for r in results:
        assert [x for x in r if len(x) == 2] == [[4.0, 4.0]] * rounds


def _ddp_peer_dies(rank: int, n: int, port: int, where: str) -> None:
    import time

    _init(rank, n, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(10_000):
            if rank == 1 and step == 5:
                os._exit(3)  # (dies between two steps; rank 0 is in, or soon in, an all-reduce)
            opt.zero_grad()
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
    except Exception as exc:
        with open(os.path.join(where, "rank0.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f} {type(exc).__name__}: {exc}")
        raise


def test_a_rank_that_dies_under_ddp_fails_the_others_naming_it(tmp_path: Any) -> None:
    from tdist.testing import RankFailedError

    with pytest.raises(RankFailedError, match="rank 1 of 2"):
        run_processes(_ddp_peer_dies, 2, free_port(), str(tmp_path), timeout=80, grace=30)
    seconds, said = (tmp_path / "rank0.txt").read_text().split(" ", 1)
    assert "rank 1" in said and "died" in said, said
    assert float(seconds) < 30  # (in seconds, not the 30-minute group timeout)


@pytest.mark.parametrize(
    "order",
    [
        "import torch; import tdist",
        "import tdist; import torch",
        # (libraries probe for torch before importing it: the probe must not use the hook up)
        "import tdist, importlib.util; importlib.util.find_spec('torch'); import torch",
    ],
)
def test_import_tdist_registers_the_backend_with_torch_whichever_comes_first(order: str) -> None:
    import subprocess
    import sys

    # tdist imported after torch loads its process groups at once (as torch's import loads
    # torch.distributed); imported before, nothing of tdist's loads while torch is importing
    # (nor until a group is made)
    loaded = order.startswith("import torch")
    code = (
        f"{order}; import sys; import torch.distributed as d; "
        "assert 'tdist' in d.Backend.backend_list, d.Backend.backend_list; "
        f"assert ('tdist.c10d._tcp_backend' in sys.modules) is {loaded}"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_tdist_alone_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, tdist; from tdist import cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _form_again_on_an_agent_store(rank: int, n: int, port: int, rounds: int) -> list[list[float]]:
    import time

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # (torchrun's agent hosts the store)
    out = []
    for i in range(rounds):
        _init(rank, n, port)
        t = torch.ones(2) * (rank + 1)
        tdc.all_reduce(t)
        out.append(t.tolist())
        if rank == 0 and i % 2 == 0:
            time.sleep(0.2)  # (rank 0 late to destroy: the others form the next group first)
        tdc.destroy_process_group()
    return out


def test_forming_the_default_group_again_on_a_store_that_outlives_it() -> None:
    # (under torchrun the agent's store outlives the group, and torch names the group formed
    # again after destroy_process_group as before: a rank read the addresses its peers left the
    # time before, and failed with a refused connection, every run)
    agent_store = tdc.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    rounds = 4
    results = run_processes(_form_again_on_an_agent_store, 2, agent_store.port, rounds, timeout=60)
    assert results == [[[3.0, 3.0]] * rounds] * 2


_UNDER_TORCHRUN = """\
import sys
import torch
import tdist as dist
dist.init_process_group("gloo")
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
# (each rank its own file: two ranks' prints on torchrun's shared stdout can interleave)
with open(f"{sys.argv[1]}/rank{dist.get_rank()}", "w") as f:
    f.write(f"rank {dist.get_rank()}/{dist.get_world_size()} {t.tolist()}")
dist.destroy_process_group()
"""


def test_a_program_ported_to_tdist_runs_under_torchs_own_torchrun(tmp_path: Any) -> None:
    # torchrun says TORCHELASTIC_USE_AGENT_STORE=True: the store at MASTER_ADDR:MASTER_PORT is
    # torch's C++ one, which tdist's client cannot talk to (it waited for a greeting for the
    # whole init timeout); tdist joins it with torch's client
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    prog.write_text(_UNDER_TORCHRUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "TORCHELASTIC_", "MASTER_"))}
    env["TMPDIR"] = str(tmp_path)  # (torchrun leaves its run's log directory, torchelastic_*)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(prog), str(tmp_path)],
        capture_output=True, text=True, timeout=80, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [
        "rank 0/2 [3.0, 3.0]", "rank 1/2 [3.0, 3.0]",
    ]


def _hook_from_torchs_docs(rank: int, n: int, port: int) -> list[float]:
    """``register_comm_hook``'s example in torch's docs, ported by its import: the hook's
    bucket is annotated ``dist.GradBucket``, which DDP checks is torch's class."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = tdist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    dist.init_process_group("gloo")
    try:
        # (compiled here: this file's annotations are strings, and DDP compares the object)
        namespace: dict[str, Any] = {"dist": dist, "n": n}
        source = (
            "def mean(state, bucket: dist.GradBucket):\n"
            "    t = bucket.buffer() / n\n"
            "    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])\n"
        )
        exec(compile(source, "<hook>", "exec", dont_inherit=True), namespace)
        mean = namespace["mean"]
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(3, 1))
        model.register_comm_hook(None, mean)
        model(torch.full((2, 3), float(rank + 1))).sum().backward()
        assert dist._rank_not_in_group(None) is False
        return [float(g) for p in model.parameters() for g in p.grad.flatten()]
    finally:
        dist.destroy_process_group()


def test_a_comm_hook_annotated_with_dist_gradbucket_runs_on_tdist() -> None:
    got = run_processes(_hook_from_torchs_docs, 2, free_port(), timeout=60)
    assert got[0] == got[1] == [3.0, 3.0, 3.0, 2.0]  # (weights: the mean of 2 and 4; the bias: of 2 and 2)


def test_torchruns_store_is_told_from_tdists_and_refused_by_ft(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.elastic import ft
    from tdist.store._rendezvous import _agent_is_torchs

    torchs = tdc.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    ours = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    try:
        monkeypatch.delenv("TDIST_AGENT_STORE", raising=False)
        assert _agent_is_torchs("127.0.0.1", torchs.port)
        assert not _agent_is_torchs("127.0.0.1", ours.port)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(torchs.port))
        with pytest.raises(ValueError, match=r"torchrun's .* start the job with `tdist run`"):
            ft.job_store(timeout=5)
    finally:
        ours.close()
        del torchs


def _late_rank(rank: int, n: int, port: int) -> list[float]:
    """The last rank publishes its address 2.5 s after the others wait for it."""
    import time

    from tdist.c10d._tcp_backend import ProcessGroupTCP

    if rank == n - 1:
        offer = ProcessGroupTCP._offer_arena

        def late(self: Any, *args: Any) -> Any:
            time.sleep(2.5)  # (longer than one of the waits the others make)
            return offer(self, *args)

        ProcessGroupTCP._offer_arena = late  # type: ignore[method-assign]
    _init(rank, n, port)
    t = torch.ones(2)
    tdc.all_reduce(t)
    tdc.destroy_process_group()
    return t.tolist()


def test_a_rank_late_to_torchs_init_process_group_is_waited_for() -> None:
    """On torch's store, forming the group waits for a late rank in one wait, as long as the
    group's timeout: torch's client raises its own error at the end of a shorter one (and logs
    it), which must not end the formation."""
    assert run_processes(_late_rank, 3, free_port(), timeout=60) == [[3.0, 3.0]] * 3
