"""Plug-in backends made of torch's own classes (``Backend.register_backend``), under
``import tdist as dist``: torch's ``ProcessGroupGloo``, as a C++ extension's backend would be
(oneCCL's ``ccl``), and a Python subclass of torch's ``ProcessGroup``. Real processes over real
sockets; each program's answers are compared with torch's own ``init_process_group``'s."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tdist.testing import free_port

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

GLOO_PLUGIN = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as tdc
    dist = tdc if sys.argv[1] == "torch" else __import__("tdist")
    rank, port = int(sys.argv[2]), int(sys.argv[3])

    def creator(store, group_rank, group_size, timeout):
        return tdc.ProcessGroupGloo(store, group_rank, group_size, timeout)

    dist.Backend.register_backend("mygloo", creator, devices=["cpu"])
    dist.init_process_group("mygloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    out = {"backend": str(dist.get_backend())}
    t = torch.arange(4.0) * (rank + 1)
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    t = torch.tensor([rank * 10.0, -rank])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t.tolist()
    b = torch.tensor([rank + 7.0])
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(outs, torch.full((2,), rank, dtype=torch.int64))
    out["all_gather"] = [o.tolist() for o in outs]
    flat = torch.zeros(4)
    dist.all_gather_into_tensor(flat, torch.full((2,), rank + 0.5))
    out["all_gather_into_tensor"] = flat.tolist()
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(4.0) + rank)
    out["reduce_scatter_tensor"] = rs.tolist()
    a2a = torch.zeros(4)
    dist.all_to_all_single(a2a, torch.arange(4.0) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()
    g = [torch.zeros(1) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.tensor([rank + 1.0]), g, dst=0)
    out["gather"] = None if g is None else [x.tolist() for x in g]
    s = torch.zeros(1)
    dist.scatter(s, [torch.tensor([5.0]), torch.tensor([6.0])] if rank == 0 else None, src=0)
    out["scatter"] = s.tolist()
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    else:
        got = torch.zeros(1)
        dist.recv(got, src=0)
        out["recv"] = got.tolist()
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    out["future"] = [x.tolist() for x in work.get_future().wait()]
    objs = [None, None]
    dist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    sub = dist.new_group([0, 1])  # (the plug-in's creator makes the sub-group's backend too)
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    out["sub_group"] = t.tolist()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    """
)


def run_program(source: str, impl: str, port: int, tmp_path: Path, world: int = 2) -> list[dict[str, object]]:
    script = tmp_path / f"program_{impl}.py"
    script.write_text(source)
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), impl, str(rank), str(port)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for rank in range(world)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def test_a_plugin_made_of_torchs_gloo_runs_under_tdist_as_under_torch(tmp_path: Path) -> None:
    theirs = run_program(GLOO_PLUGIN, "torch", free_port(), tmp_path)
    ours = run_program(GLOO_PLUGIN, "tdist", free_port(), tmp_path)
    assert ours == theirs
    assert theirs[0]["sum"] == [0.0, 3.0, 6.0, 9.0] and theirs[1]["recv"] == [42.0]
    assert theirs[0]["backend"] == "mygloo"


PYTHON_PG_PLUGIN = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as tdc
    dist = tdc if sys.argv[1] == "torch" else __import__("tdist")

    class DoneWork(tdc._Work):
        def __init__(self, result):
            super().__init__()
            self.result_ = result
        def wait(self, timeout=None):
            return True
        def get_future(self):
            fut = torch.futures.Future()
            fut.set_result(self.result_)
            return fut

    class Doubler(tdc.ProcessGroup):
        # (all_reduce of one rank, doubled: a Python backend that implements one op)
        def __init__(self, rank, size):
            super().__init__(rank, size)
        def allreduce(self, tensors, opts):
            for t in tensors:
                t.mul_(2)
            return DoneWork(tensors)
        def getBackendName(self):
            return "doubler"

    dist.Backend.register_backend("doubler", lambda store, rank, size, timeout: Doubler(rank, size), devices=["cpu"])
    dist.init_process_group("doubler", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    t = torch.ones(2)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    try:
        dist.broadcast(torch.ones(1), src=0)
        out["broadcast"] = "ran"
    except Exception as exc:
        out["broadcast"] = type(exc).__name__
    print(json.dumps(out), flush=True)
    """
)


def test_a_python_subclass_of_torchs_process_group_as_a_plugin(tmp_path: Path) -> None:
    theirs = run_program(PYTHON_PG_PLUGIN, "torch", 0, tmp_path, world=1)
    ours = run_program(PYTHON_PG_PLUGIN, "tdist", 0, tmp_path, world=1)
    assert ours == theirs
    assert theirs[0]["all_reduce"] == [2.0, 2.0]
