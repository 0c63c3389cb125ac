"""torch 0.3's ``torch.distributed`` (the THD module, up to 0.4): every public name it had exists
in tdist and does what it did, on a real 2-rank group (ranks as threads, tcp backend).

Master-worker mode (``init_master_worker``) runs on real processes in
``test_master_worker.py``; here only its name and its refusal to start twice are checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tdist as dist
from tdist.c10d._api import _destroy_all_worlds_for_tests
from tdist.testing import free_port, run_threads

pytestmark = pytest.mark.timeout(60)

# torch/distributed/__init__.py of torch 0.3 and 0.4 (THD): its public names, and the two private
# ones code of that time called (DistributedDataParallel's)
TORCH_03_NAMES = [
    "all_gather",
    "all_gather_multigpu",
    "all_reduce",
    "all_reduce_multigpu",
    "barrier",
    "broadcast",
    "broadcast_multigpu",
    "destroy_process_group",
    "dist_backend",
    "gather",
    "get_rank",
    "get_world_size",
    "group",
    "init_master_worker",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_multigpu",
    "reduce_op",
    "scatter",
    "send",
    # private
    "_clear_group_cache",
    "_register_stream",
]
# torch 0.3's reduce_op members: rank 0's value, rank 1's, the reduction, and the reduction of
# two copies per rank (the *_multigpu form)
REDUCE_OP_03 = {
    "SUM": (2.0, 4.0, 6.0, 12.0),
    "PRODUCT": (6.0, 4.0, 24.0, 576.0),
    "MAX": (1.0, 4.0, 4.0, 4.0),
    "MIN": (1.0, 4.0, 1.0, 1.0),
}


@pytest.fixture(autouse=True)
def _clean_world() -> Iterator[None]:
    yield
    _destroy_all_worlds_for_tests()


@pytest.mark.parametrize("name", TORCH_03_NAMES)
def test_every_torch_03_name_exists(name: str) -> None:
    obj = getattr(dist, name)
    if name in ("dist_backend", "reduce_op", "group"):
        return  # (namespaces, checked below)
    assert callable(obj), name


def test_dist_backend_has_torch_03s_values() -> None:
    b = dist.dist_backend
    assert (b.UNDEFINED, b.TCP, b.MPI, b.GLOO, b.NCCL) == (-1, 0, 1, 2, 3)


def test_names_that_need_a_group_say_so_before_init() -> None:
    with pytest.raises(RuntimeError, match=r"^torch.distributed needs to be initialized first$"):
        dist._register_stream(None)
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist._clear_group_cache()
    assert dist.is_initialized() is False


def _group(url: str, rank: int, world_size: int) -> None:
    # torch 0.3's form: backend and init_method positional, the rest keywords, group_name too
    dist.init_process_group("tcp", url, world_size=world_size, rank=rank, group_name="legacy")


def test_init_process_group_tcp_with_03s_arguments_then_twice_fails() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"

    def body(rank: int, world_size: int) -> list[Any]:
        _group(url, rank, world_size)
        out: list[Any] = [dist.get_rank(), dist.get_world_size(), dist.is_initialized()]
        with pytest.raises(ValueError, match="trying to initialize the default process group twice!"):
            _group(url, rank, world_size)
        with pytest.raises(RuntimeError, match=r"trying to initialize torch.distributed twice! \(the default process group"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dist.init_master_worker("tcp", url, world_size=world_size, rank=rank)
        dist.destroy_process_group()
        out.append(dist.is_initialized())
        return out

    assert run_threads(body, 2, timeout=40) == [[0, 2, True, False], [1, 2, True, False]]


def test_03s_functions_behave_on_a_2_rank_group() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"

    def body(rank: int, world_size: int) -> dict[str, Any]:
        _group(url, rank, world_size)
        out: dict[str, Any] = {}
        # reduce_op's members work wherever ReduceOp's do
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (reduce_op is deprecated, as in torch)
            ops = {name: getattr(dist.reduce_op, name) for name in REDUCE_OP_03}
        for name, op in ops.items():
            mine = REDUCE_OP_03[name][rank]
            t, r = torch.tensor([mine]), torch.tensor([mine])
            m = [torch.tensor([mine]), torch.tensor([mine])]
            dist.all_reduce(t, op=op)
            dist.reduce(r, dst=0, op=op)
            dist.all_reduce_multigpu(m, op=op)
            out[name] = [t.item(), r.item() if rank == 0 else None, [x.item() for x in m]]
        # group.WORLD is the default group
        w = torch.tensor([float(rank + 1)])
        dist.all_reduce(w, group=dist.group.WORLD)
        dist.barrier(dist.group.WORLD)
        out["world"] = [w.item(), dist.get_world_size(dist.group.WORLD), dist.get_rank(dist.group.WORLD)]
        # isend/irecv requests: is_completed() and wait()
        buf = torch.zeros(3)
        if rank == 0:
            req = dist.isend(torch.arange(3.0), dst=1)
        else:
            req = dist.irecv(buf, src=0)
        assert isinstance(req.is_completed(), bool)
        req.wait()
        out["request"] = [req.is_completed(), buf.tolist()]
        # recv from any source returns the sender; gather and scatter by keywords, as 0.3 wrote them
        if rank == 0:
            dist.send(torch.tensor([5.0]), dst=1)
            out["recv_from"] = None
        else:
            got = torch.zeros(1)
            out["recv_from"] = [dist.recv(got), got.item()]
        gathered = [torch.zeros(1), torch.zeros(1)] if rank == 0 else None
        dist.gather(torch.tensor([float(rank)]), dst=0, gather_list=gathered)
        out["gather"] = None if gathered is None else [x.item() for x in gathered]
        s = torch.zeros(1)
        dist.scatter(s, src=0, scatter_list=[torch.tensor([7.0]), torch.tensor([8.0])] if rank == 0 else None)
        out["scatter"] = s.item()
        # the private helpers of that time: callable, nothing to do on CPU
        assert dist._clear_group_cache() is None and dist._clear_group_cache(dist.group.WORLD) is None
        assert dist._register_stream(object()) is None
        dist.destroy_process_group()
        return out

    r0, r1 = run_threads(body, 2, timeout=40)
    for name, (_, _, want, multi) in REDUCE_OP_03.items():
        assert r0[name] == [want, want, [multi, multi]], (name, r0[name])
        assert r1[name] == [want, None, [multi, multi]], (name, r1[name])
    assert r0["world"] == [3.0, 2, 0] and r1["world"] == [3.0, 2, 1]
    assert r0["request"][0] is True and r1["request"] == [True, [0.0, 1.0, 2.0]]
    assert r1["recv_from"] == [0, 5.0]
    assert r0["gather"] == [0.0, 1.0]
    assert (r0["scatter"], r1["scatter"]) == (7.0, 8.0)


def test_03s_init_methods_and_rooted_lists_on_real_processes(tmp_path: Path) -> None:
    """torch 0.3's docs: ``file://`` with ``world_size`` and no rank assigns ranks; ``env://``
    needs no ``MASTER_ADDR`` on rank 0; ``scatter`` with ``src`` left out on the source (0.3's
    default: the caller's rank) raises torch 2's error, saying how 0.3 differed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "MASTER_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    env.update(MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    prog = [sys.executable, str(Path(__file__).with_name("legacy03_prog.py")), str(tmp_path / "shared")]
    procs = [
        subprocess.Popen(
            prog, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(env, RANK=str(rank), **({"MASTER_ADDR": "127.0.0.1"} if rank else {})),
        )
        for rank in range(2)
    ]
    try:
        runs = [p.communicate(timeout=40) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(Exception):
                p.communicate(timeout=10)
    res = []
    for p, (out, err) in zip(procs, runs, strict=True):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, (p.returncode, out, err[-3000:])
        res.append(json.loads(lines[-1][len("RESULT "):]))
    assert sorted(got["file"][0] for got in res) == [0, 1]
    assert all(got["file"][1:] == [2, 3.0] for got in res)
    assert [got["env"] for got in res] == [[0, False, 3.0], [1, True, 3.0]]
    assert res[0]["scatter"].startswith("Argument ``scatter_list`` must be specified on source rank. (src was")
    assert res[1]["scatter"].startswith("Argument ``scatter_list`` must NOT be specified on non-source ranks. (src was")
    assert "torch 0.3's scatter took the rank that gives scatter_list for the source: pass src=" in res[1]["scatter"]
