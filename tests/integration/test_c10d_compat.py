"""What real programs rely on that gloo does and torch's documentation does not spell out:
collectives write a tensor's memory outside autograd (its version does not change, an inference
tensor is written too), and an argument torch refuses before anything is sent leaves the group
usable. Real processes, 2 ranks, through tdist's API and through torch's with the ``tdist``
backend; each expectation was observed with gloo."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tdist.testing import free_port, run_processes

pytestmark = pytest.mark.timeout(120)


def _program(rank: int, world: int, port: int, through_torch: bool) -> dict[str, Any]:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if through_torch:
        import torch.distributed as d

        import tdist  # noqa: F401 (registers the "tdist" backend with torch)

        d.init_process_group("tdist", timeout=timedelta(seconds=20))
    else:
        import tdist as d

        d.init_process_group("gloo", timeout=timedelta(seconds=20))
    out: dict[str, Any] = {}
    try:
        # a loss all-reduced for logging, then backpropagated: sqrt saved its output
        torch.manual_seed(rank)
        w = torch.nn.Parameter(torch.ones(3))
        x, y = torch.randn(8, 3), torch.randn(8)
        loss = torch.sqrt(F.mse_loss(x @ w, y))
        before = loss.item()
        d.all_reduce(loss)
        out["loss_summed"] = loss.item()
        out["loss_local"] = before
        out["loss_version"] = loss._version
        loss.backward()
        out["grad"] = w.grad is not None and bool(torch.isfinite(w.grad).all())
        # parameters broadcast from rank 0 (a leaf that requires grad): values and version
        m = torch.nn.Linear(3, 2)
        with torch.no_grad():
            m.weight.fill_(rank + 1)
        v = m.weight._version
        d.broadcast(m.weight, 0)
        out["bcast"] = m.weight.flatten().tolist()
        out["bcast_version_kept"] = m.weight._version == v
        # metrics computed under inference mode, reduced after the block (an eval loop)
        with torch.inference_mode():
            correct = torch.tensor([float(rank + 1), 1.0])
        d.all_reduce(correct)
        out["inference"] = correct.tolist()
        # a root that is not an int: refused on every rank before anything is sent...
        if not through_torch:  # (torch's own check refuses it there)
            try:
                d.broadcast(torch.ones(2), src=0.0)  # type: ignore[arg-type]
                out["float_root"] = "accepted"
            except TypeError as exc:
                out["float_root"] = f"TypeError: {exc}"
        # the groups handed out are process groups (torch's own objects, which run on ours)
        sub = d.new_group([0, 1])
        out["isinstance"] = [isinstance(g, d.ProcessGroup) for g in (d.group.WORLD, sub)]
        if not through_torch:  # torch's collectives that autograd differentiates, by tdist's names
            from tdist.nn.functional import all_reduce as differentiable_all_reduce

            xg = torch.ones(2, requires_grad=True)
            yg = differentiable_all_reduce(xg * (rank + 1))
            yg.sum().backward()
            assert xg.grad is not None
            out["nn_functional"] = (yg.tolist(), xg.grad.tolist())
        if not through_torch:  # torch's device meshes, by tdist's names, on tdist's groups
            mesh = d.init_device_mesh("cpu", (2,))
            m = torch.tensor([float(rank)])
            d.all_reduce(m, group=mesh.get_group())
            out["mesh"] = (isinstance(mesh, d.DeviceMesh), m.item())
        # the default group's device, as distributed checkpoints' state-dict loading asks it
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's deprecation of the helper)
            out["default_device"] = str(torch.distributed.distributed_c10d._get_pg_default_device())
        # ...and the group goes on
        t = torch.ones(2)
        d.all_reduce(t)
        out["after"] = t.tolist()
    finally:
        d.destroy_process_group()
    return out


@pytest.mark.parametrize("through_torch", [False, True], ids=["tdist_api", "torch_api"])
def test_collectives_write_outside_autograd_and_a_refused_argument_breaks_nothing(through_torch: bool) -> None:
    outs = run_processes(_program, 2, free_port(), through_torch, timeout=90)
    total = outs[0]["loss_local"] + outs[1]["loss_local"]
    for rank, out in enumerate(outs):
        assert out["loss_summed"] == pytest.approx(total), rank
        assert out["loss_version"] == 0 and out["grad"], out
        assert out["bcast"] == [1.0] * 6 and out["bcast_version_kept"], out
        assert out["inference"] == [3.0, 2.0], out
        if not through_torch:
            assert out["float_root"].startswith("TypeError: a rank must be an int, got float 0.0"), out
        assert out["after"] == [2.0, 2.0], out
        assert out["isinstance"] == [True, True], out
        assert out["default_device"] == "cpu", out
        assert through_torch or out["mesh"] == (True, 1.0), out
        assert through_torch or out["nn_functional"] == ([3.0, 3.0], [2.0 * (rank + 1)] * 2), out


_BREAKPOINT = """
import sys
import torch
import tdist as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
for i in range(2):
    dist.breakpoint(rank=0, skip=1)  # (the first call passes)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"after {i}: {t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_breakpoint_stops_one_rank_in_the_debugger_and_the_others_wait_for_it(tmp_path: Any) -> None:
    import subprocess
    import sys

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BREAKPOINT, str(rank), str(port)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    try:
        # rank 0 reads its commands from its terminal (here its stdin: /dev/stdin)
        out0, _ = procs[0].communicate("p 6 * 7\nc\n", timeout=60)
        out1, _ = procs[1].communicate("", timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, (out0, out1)
    assert out0.count("!!! ATTENTION !!!") == 1 and "Skip the breakpoint, counter=1" in out0, out0
    printed = re.search(r"(?:\n|\(Pdb\) )42\n", out0)  # (the debugger's answer, not a port number)
    assert printed is not None, out0
    assert "ATTENTION" not in out1 and "after 0: 2.0" in out1 and "after 1: 2.0" in out1, out1
    assert printed.start() > out0.index("after 0: 2.0"), out0  # (it stopped on the second call)


def _private_helpers(rank: int, world: int, port: int, which: str) -> dict[str, Any]:
    """torch's private helpers of ``distributed_c10d`` that libraries call, on gloo (torch's
    module) or on tdist (tdist's module of the same path)."""
    import os
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if which == "gloo":
        import torch.distributed as d
    else:
        import tdist as d  # type: ignore[no-redef]
    c10d: Any = d.distributed_c10d
    d.init_process_group("gloo", timeout=timedelta(seconds=20))
    try:
        g = d.new_group([0, 1])
        solo = d.new_group([1])
        out: dict[str, Any] = {
            "sizes": [c10d._get_group_size(None), c10d._get_group_size(g)],
            "name": c10d._get_process_group_name(g) == g.group_name != c10d._get_process_group_name(d.group.WORLD),
            "unknown name": c10d._get_process_group_name(object()),
            "resolve": c10d._resolve_process_group(g.group_name) is g,
            "object device": c10d._get_object_coll_device(g),
            "timeout": c10d._get_default_timeout("gloo"),
            "tag": c10d._get_group_tag(g) == f"ptd:{g.group_name}",
            "found": c10d._find_pg_by_ranks_and_tag(c10d._get_group_tag(g), [0, 1]) is g,
            "maps": [c10d._world.pg_group_ranks[g], c10d._world.pg_map[g][0], c10d._world.pg_names[g] == g.group_name],
            "names": sorted(c10d._pg_names.values(), key=int) if rank == 1 else len(c10d._pg_names),
            "config": {k: v for k, v in c10d._get_pg_config(g).items() if k != "pg_desc"},
            "pg ranks": c10d._pg_group_ranks[g],
        }
        with pytest.raises(RuntimeError, match="Could not resolve the process group"):
            c10d._resolve_process_group("no such group")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out["device"] = str(c10d._get_pg_default_device(g))
            out["global"] = c10d._get_global_rank(g, 1)
        out["warned"] = sorted({type(w.message).__name__ for w in seen})
        data, size = c10d._object_to_tensor({"rank": rank}, torch.device("cpu"), g)
        out["object"] = [data.dtype, size.tolist() == [data.numel()], c10d._tensor_to_object(data, size.item(), g)]
        c10d._store_based_barrier(rank, c10d._get_default_store(), "mine", world, timedelta(seconds=20))
        tagged = c10d._new_group_with_tag([0, 1], pg_tag="mine")
        out["tagged"] = [
            c10d._find_pg_by_ranks_and_tag("mine", [0, 1]) is tagged,
            c10d._get_group_tag(tagged),
            c10d._find_or_create_pg_by_ranks_and_tag("mine", [0, 1], 2) is tagged,
        ]
        if rank == 1:
            out["solo"] = c10d._get_group_size(solo)
        t = torch.ones(2)
        d.all_reduce(t, group=tagged)
        out["after"] = t.tolist()
        return out
    finally:
        d.destroy_process_group()


def test_torchs_private_helpers_answer_on_tdist_as_on_gloo() -> None:
    """``_get_group_size``, ``_get_process_group_name``, ``_resolve_process_group``, ``_world``
    and the module's maps, tags, ``_object_to_tensor``, ``_store_based_barrier``...: the same
    answers from ``tdist.distributed_c10d`` as from torch's module over gloo."""
    want = run_processes(_private_helpers, 2, free_port(), "gloo", timeout=100)
    got = run_processes(_private_helpers, 2, free_port(), "tdist", timeout=100)
    assert want[0]["names"] and want[1]["names"] == ["0", "1", "2"]
    assert got == want


def _sparse_sum(rank: int, world: int, port: int) -> list[Any]:
    import os
    import warnings

    import tdist as d

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    d.init_process_group("gloo", timeout=timedelta(seconds=20))
    try:
        t = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (3,), check_invariants=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            d.all_reduce(t)
        return [t.to_dense().tolist(), [str(w.message)[:60] for w in seen]]
    finally:
        d.destroy_process_group()


def test_a_sparse_all_reduce_warns_of_nothing() -> None:
    """gloo's one sparse collective, in fresh interpreters (torch warns once per process): the
    sum, and no warning about sparse invariant checks (the entries from peers are checked)."""
    got = run_processes(_sparse_sum, 2, free_port(), timeout=100, start_method="spawn")
    assert got == [[[1.0, 1.0, 4.0], []]] * 2
