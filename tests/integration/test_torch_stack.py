"""torch's stack above the process group on the tdist backend: FSDP2, DTensor and DeviceMesh,
distributed checkpoints, pipelining. Each runs the same program on torch's gloo and on tdist
(real processes) and compares every result.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdc

import tdist  # (registers the backend)
from tdist.testing import free_port, run_processes

pytestmark = pytest.mark.timeout(120)


def _run(body: Any, n: int, backend: str, *args: Any) -> list[Any]:
    return run_processes(_main, n, free_port(), backend, body, *args, timeout=100)


def _main(rank: int, n: int, port: int, backend: str, body: Any, *args: Any) -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    if backend == "tdist-api":  # a program ported by its imports: ``import tdist as dist``
        tdist.init_process_group("gloo")
    else:
        tdc.init_process_group(backend)
    try:
        out = body(rank, n, *args)
        tdc.barrier()  # (nobody leaves while a peer still needs it)
        return out
    finally:
        (tdist.destroy_process_group if backend == "tdist-api" else tdc.destroy_process_group)()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def _train(forward: Any, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[float]:
    """``steps`` training steps of ``forward`` on this rank's data; the losses."""
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fsdp2(rank: int, n: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, reshard_after_forward=True)
    fully_shard(model)
    losses = _train(model, torch.optim.Adam(model.parameters(), lr=0.01), rank, 4)
    return {
        "full": [p.full_tensor().flatten().tolist() for p in model.parameters()],
        "local": [p.to_local().flatten().tolist() for p in model.parameters()],
        "losses": losses,
    }


@pytest.mark.parametrize(("n", "backend"), [(2, "tdist"), (3, "tdist"), (2, "tdist-api")])
def test_fsdp2_trains_on_tdist_as_on_gloo(n: int, backend: str) -> None:
    got, want = _run(_fsdp2, n, backend), _run(_fsdp2, n, "gloo")
    for rank in range(n):
        assert got[rank]["full"] == got[0]["full"]  # every rank holds the same model
        for key in ("full", "local", "losses"):
            for g, w in zip(got[rank][key], want[rank][key], strict=True):
                torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-6, atol=1e-7)
    assert any(got[0]["local"][i] != got[1]["local"][i] for i in range(len(got[0]["local"])))  # (sharded)


def _ddp_compiled(rank: int, n: int) -> dict[str, Any]:
    """DDP under ``torch.compile``: DDP's reducer rebuilds its buckets with a broadcast before
    the second compiled forward, from torch's C++; dynamo, tracing tdist's group method there,
    raised "Attempted to access unregistered member on an OpaqueObject"."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model)
    losses = _train(torch.compile(ddp, backend="eager"), torch.optim.SGD(ddp.parameters(), lr=0.1), rank, 3)
    return {"losses": losses, "params": [p.flatten().tolist() for p in model.parameters()]}


@pytest.mark.parametrize("backend", ["tdist", "tdist-api"])
def test_ddp_under_torch_compile_trains_on_tdist_as_on_gloo(backend: str) -> None:
    got, want = _run(_ddp_compiled, 2, backend), _run(_ddp_compiled, 2, "gloo")
    assert got == want


def _dtensor(rank: int, n: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (n,))
    a = torch.arange(24.0).reshape(6, 4)
    b = torch.arange(8.0).reshape(4, 2) - 3
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    prod = (da @ db).redistribute(mesh, [Replicate()]).to_local()
    col = distribute_tensor(a, mesh, [Shard(1)]).redistribute(mesh, [Shard(0)]).full_tensor()
    total = da.sum().full_tensor()
    return {"prod": prod.tolist(), "col": col.tolist(), "sum": total.item(), "local": da.to_local().tolist()}


def test_device_mesh_and_dtensor_on_tdist() -> None:
    n = 2
    got = _run(_dtensor, n, "tdist")
    a = torch.arange(24.0).reshape(6, 4)
    b = torch.arange(8.0).reshape(4, 2) - 3
    for rank, r in enumerate(got):
        assert r["prod"] == (a @ b).tolist()
        assert r["col"] == a.tolist()
        assert r["sum"] == a.sum().item()
        assert r["local"] == a.chunk(n)[rank].tolist()


def _checkpoint(rank: int, n: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    opt.step()
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    saved = [p.full_tensor().flatten().tolist() for p in model.parameters()]
    # a fresh model and optimizer, different weights: loading brings the saved ones back
    torch.manual_seed(123)
    fresh = _model()
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    fully_shard(fresh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh(x).sum().backward()
    fresh_opt.step()  # (so that the optimizer has state to overwrite)
    model_sd, opt_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = [p.full_tensor().flatten().tolist() for p in fresh.parameters()]
    exp_avg = [
        s["exp_avg"].full_tensor().flatten().tolist() for s in fresh_opt.state.values()
    ]
    orig_avg = [s["exp_avg"].full_tensor().flatten().tolist() for s in opt.state.values()]
    return {"saved": saved, "loaded": loaded, "exp_avg": exp_avg, "orig_avg": orig_avg}


def test_distributed_checkpoint_saves_and_loads_sharded_state_on_tdist(tmp_path: Path) -> None:
    n = 2
    got = _run(_checkpoint, n, "tdist", str(tmp_path / "ck"))
    for r in got:
        assert r["loaded"] == r["saved"] == got[0]["saved"]
        assert r["exp_avg"] == r["orig_avg"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def _pipeline(rank: int, n: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    out: dict[str, Any] = {}
    for name, schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8) for _ in range(n)]
        stage = PipelineStage(layers[rank], rank, n, torch.device("cpu"))
        sched = schedule(stage, n_microbatches=4, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        elif rank == n - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        out[name] = {
            "grads": [p.grad.flatten().tolist() for p in layers[rank].parameters()],  # type: ignore[union-attr]
            "loss": sum(loss.item() for loss in losses),
        }
    return out


def test_pipelining_schedules_on_tdist_match_one_process() -> None:
    n = 2
    got = _run(_pipeline, n, "tdist")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(n)))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    loss = ((layers(x) - y) ** 2).sum()
    loss.backward()
    for name in ("gpipe", "1f1b"):
        torch.testing.assert_close(torch.tensor(got[n - 1][name]["loss"]), loss.detach(), rtol=1e-5, atol=1e-5)
        for rank in range(n):
            # (torch's schedules divide the gradients by the number of micro-batches)
            want = [p.grad.flatten() / 4 for p in layers[rank].parameters()]  # type: ignore[union-attr]
            for g_, w in zip(got[rank][name]["grads"], want, strict=True):
                torch.testing.assert_close(torch.tensor(g_), w, rtol=1e-5, atol=1e-5)


def _zero(rank: int, n: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    with Join([model, opt]):  # (uneven inputs: rank r has 3 + r batches)
        for step in range(3 + rank):
            g = torch.Generator().manual_seed(10 * step + rank)
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g)).sum().backward()
            opt.step()
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    return {
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "state": None if state is None else [s["exp_avg"].flatten().tolist() for s in state["state"].values()],
    }


def test_zero_redundancy_optimizer_with_join_on_tdist_as_on_gloo() -> None:
    n = 3
    got, want = _run(_zero, n, "tdist"), _run(_zero, n, "gloo")
    for rank in range(n):
        assert got[rank]["params"] == got[0]["params"]
        for g, w in zip(got[rank]["params"], want[rank]["params"], strict=True):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-6, atol=1e-7)
    assert got[0]["state"] is not None and len(got[0]["state"]) == len(want[0]["state"])
    for g, w in zip(got[0]["state"], want[0]["state"], strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-6, atol=1e-7)


def _join_live_world(rank: int, n: int) -> dict[str, Any]:
    """DDP's ``join(divide_by_initial_world_size=False)``: the reducer keeps the forward's
    all-reduce of the live ranks (a work of ours handed to torch's C++) and waits on it in the
    backward pass, after Python has dropped it."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.join(divide_by_initial_world_size=False):
        for step in range(1 + rank):  # (uneven: rank r has 1 + r batches)
            g = torch.Generator().manual_seed(10 * step + rank)
            opt.zero_grad()
            loss = model(torch.randn(4, 16, generator=g)).sum()
            gc.collect()  # (nothing of Python's keeps the work alive now)
            loss.backward()
            opt.step()
    return {"params": [p.detach().flatten().tolist() for p in model.parameters()]}


@pytest.mark.parametrize("backend", ["tdist", "tdist-api"])
def test_ddp_join_over_the_live_ranks_finishes_as_on_gloo(backend: str) -> None:
    got, want = _run(_join_live_world, 2, backend), _run(_join_live_world, 2, "gloo")
    assert got == want  # (bit for bit at 2 ranks)


def _torchs_own_new_group(rank: int, n: int) -> dict[str, Any]:
    """A program ported by its imports whose library code asks torch itself for groups."""
    store = tdc.distributed_c10d._get_default_store()
    store.set(f"k{rank}", "v")
    sub = tdc.new_group([0, 1])
    mine, _ = tdc.new_subgroups(group_size=1)
    t = torch.ones(1) * (rank + 1)
    tdc.all_reduce(t, group=sub)
    return {"set": store.get(f"k{rank}").decode(), "sum": t.item(), "mine": tdc.get_process_group_ranks(mine)}


def test_torchs_store_and_new_group_work_in_a_program_ported_by_its_imports() -> None:
    got = _run(_torchs_own_new_group, 2, "tdist-api")
    assert got == [{"set": "v", "sum": 3.0, "mine": [r]} for r in range(2)]


def _pg_count(rank: int, n: int) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    counts = [tdist.get_pg_count()]
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # (torch's groups: 2 per dim)
    counts.append(tdist.get_pg_count())
    tdist.new_group([0, 1])
    counts.append(tdist.get_pg_count())
    tdist.new_group([3, 2, 1, 0], sort_ranks=False)  # (no twin in torch)
    counts.append(tdist.get_pg_count())
    return counts


@pytest.mark.parametrize("backend", ["tdist", "tdist-api"])
def test_get_pg_count_counts_the_groups_torchs_modules_made_too(backend: str) -> None:
    # torch's own count on gloo: the default group, 4 of the mesh, the new group
    assert _run(_pg_count, 4, backend) == [[1, 5, 6, 7]] * 4


def _elastic_sampler(rank: int, n: int) -> list[int]:
    from tdist.elastic.utils.data import ElasticDistributedSampler

    sampler = ElasticDistributedSampler(list(range(10)))  # (its ranks: torch's, the mirror of ours)
    return list(sampler)


def test_torchelastics_sampler_splits_the_data_of_a_group_formed_with_tdist() -> None:
    got = _run(_elastic_sampler, 2, "tdist-api")
    assert sorted(got[0] + got[1]) == list(range(10)) and not set(got[0]) & set(got[1])


def _ported(rank: int, n: int, path: str) -> dict[str, Any]:
    """torch's training stack in a program ported by its imports (``torch.distributed`` ->
    ``tdist``): the module paths are torch's very modules."""
    import sys

    import tdist.checkpoint as dcp
    from tdist.checkpoint.state_dict import get_state_dict
    from tdist.device_mesh import init_device_mesh
    from tdist.fsdp import fully_shard
    from tdist.tensor import Shard, distribute_tensor

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (n,)))
    model(torch.ones(2, 16)).sum().backward()
    model_sd, _ = get_state_dict(model, [])
    dcp.save({"model": model_sd}, checkpoint_id=path)
    a = distribute_tensor(torch.arange(8.0).reshape(4, 2), tdist.device_mesh.init_device_mesh("cpu", (n,)), [Shard(0)])
    return {
        "same": sys.modules["tdist.fsdp"] is sys.modules["torch.distributed.fsdp"],
        "spec": tdist.fsdp.__spec__.name,
        "sum": a.sum().full_tensor().item(),
        "files": sorted(os.listdir(path)),
    }


def _implicit_world(rank: int, n: int, port: int, entry: str) -> dict[str, Any]:
    """A ported program that calls no ``init_process_group``: torch's device mesh forms the
    world group itself (pytorch/examples' tensor-parallel programs), which must be tdist's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    if entry == "torch's":  # a program that changed only ``import torch.distributed as dist``
        from torch.distributed.device_mesh import init_device_mesh as torchs
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = torchs("cpu", (n,))
    else:
        from tdist.tensor import Shard, distribute_tensor  # type: ignore[no-redef]
    if entry == "alias":
        from tdist.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (n,))
    elif entry != "torch's":
        mesh = tdist.init_device_mesh("cpu", (n,))
    a = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    out = {
        "tdist sees it": tdist.is_initialized() and tdist.get_rank() == rank,
        # (as torch names it: formed with no backend named)
        "named": (tdist.get_backend(), tdist.get_backend_config()) == (tdc.get_backend(), tdc.get_backend_config()),
        "backend": type(tdc.group.WORLD._get_backend(torch.device("cpu"))).__module__,
        "sum": a.sum().full_tensor().item(),
    }
    tdist.barrier()
    tdist.destroy_process_group()
    out["left"] = not tdc.is_initialized()
    return out


@pytest.mark.parametrize("entry", ["alias", "tdist.init_device_mesh", "torch's"])
def test_a_device_mesh_made_before_any_group_forms_tdists_world_group(entry: str) -> None:
    got = run_processes(_implicit_world, 2, free_port(), entry, timeout=100)
    assert got[0] == got[1] == {
        "tdist sees it": True, "named": True, "backend": "tdist.c10d._torch_pg", "sum": 28.0, "left": True,
    }


def test_torchs_training_stack_under_tdists_module_paths(tmp_path: Path) -> None:
    got = _run(_ported, 2, "tdist-api", str(tmp_path / "ck"))
    assert got[0] == got[1] == {
        "same": True, "spec": "torch.distributed.fsdp", "sum": 28.0,
        "files": [".metadata", "__0_0.distcp", "__1_0.distcp"],
    }


def _sharded_tensor_device(rank: int, n: int) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import empty as sharded_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    group = tdc.group.WORLD
    assert group is not None
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])  # every row on rank 0
    st = sharded_empty(spec, 4, 2)
    return {"name": group._get_backend_name(), "device": str(st.device), "local": len(st.local_shards())}


@pytest.mark.parametrize("backend", ["gloo", "tdist-api"])
def test_torch_code_that_asks_the_backend_name_sees_a_gloo_group(backend: str) -> None:
    """torch's own code branches on ``_get_backend_name() == "gloo"`` (a CPU group): a
    ShardedTensor with no shard on a rank says it lives on the CPU there, under
    ``tdist.init_process_group("gloo")`` as under torch's (no CUDA needed)."""
    res = _run(_sharded_tensor_device, 2, backend)
    assert res == [{"name": "gloo", "device": "cpu", "local": 1}, {"name": "gloo", "device": "cpu", "local": 0}]
