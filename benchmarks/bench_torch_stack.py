"""torch's training stack on tdist against the same on gloo: DDP, FSDP2, distributed checkpoints.

Run: .venv/bin/python benchmarks/bench_torch_stack.py [--rounds 3] [--world 2] [--quick]

Every case runs torch's own code (``DistributedDataParallel``, ``fully_shard``,
``torch.distributed.checkpoint``) on ``init_process_group("gloo")`` and on
``init_process_group("tdist")``: same model, same batch, fresh processes for each, the order
alternating between rounds; each figure is the slowest rank's, and the table shows medians
over rounds. Each rank computes on one thread, as under torchrun (``OMP_NUM_THREADS=1`` when
it starts several processes).

- ddp comm-bound: 4 Linear 2048x2048 (64 MiB of gradients), batch 8, SGD: one step.
- ddp compute-bound: 4 Linear 1024x1024, batch 2048. "hidden" is the part of the gradient
  all-reduce that overlapped the backward pass: 1 - (step - the step with a comm hook that
  sends nothing) / (one all-reduce of all the gradients alone).
- fsdp2: 4 Linear 4096x4096 (256 MiB of parameters) sharded per layer, batch 8, SGD: one step.
- dcp save / load: 256 MiB of DTensors sharded over the ranks, to and from /dev/shm.
- torch route: ``torch.distributed.all_reduce`` on the tdist backend against
  ``tdist.all_reduce`` on the same group, in one process (tdist's default group is torch's).
"""


import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as tdc

import tdist
from _common import before_fork, busy_for_the_run, machine_line, median, table
from tdist.testing import free_port, run_processes

MiB = 1 << 20


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))


def _timed(step: Any, warm: int, reps: int) -> float:
    for _ in range(warm):
        step()
    tdc.barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return median(times)


def ddp_step(width: int, batch: int, reps: int) -> dict[str, float]:
    """One DDP training step; and, to see what communication costs, the same step with a comm
    hook that sends nothing (DDP's bucketing and copies, no all-reduce), the step without DDP,
    and one all-reduce of all the gradients alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(batch, width)
    out = {}
    for name in ("step", "no_comm", "no_ddp"):
        model = _mlp(width)
        if name != "no_ddp":
            model = DDP(model)
        if name == "no_comm":
            model.register_comm_hook(None, _no_comm)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

        out[name] = _timed(step, 2, reps)
        del model, opt
    flat = torch.ones(sum(p.numel() for p in _mlp(width).parameters()))
    out["allreduce"] = _timed(lambda: tdc.all_reduce(flat), 1, reps)
    return out


def _no_comm(state: object, bucket: tdc.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def fsdp_step(width: int, batch: int, reps: int) -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard

    model = _mlp(width)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return {"step": _timed(step, 2, reps)}


def dcp_io(total: int, reps: int, rank: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (tdc.get_world_size(),))
    side = int((total // 4 // 4) ** 0.5)  # four square float32 tensors
    state = {f"w{i}": distribute_tensor(torch.full((side, side), float(i)), mesh, [Shard(0)]) for i in range(4)}
    where = [tempfile.mkdtemp(dir="/dev/shm") if rank == 0 else ""]
    tdc.broadcast_object_list(where, src=0)
    saves, loads = [], []
    try:
        for i in range(reps + 1):
            path = os.path.join(where[0], f"ck{i}")
            tdc.barrier()
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=path)
            t1 = time.perf_counter()
            dcp.load(state, checkpoint_id=path)
            t2 = time.perf_counter()
            if i:  # (the first is a warm-up)
                saves.append(t1 - t0)
                loads.append(t2 - t1)
    finally:
        tdc.barrier()
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    return {"save": median(saves), "load": median(loads)}


def route(reps_small: int, reps_big: int) -> dict[str, float]:
    out = {}
    for nbytes, reps in ((4, reps_small), (64 * MiB, reps_big)):
        t = torch.ones(max(1, nbytes // 4))
        for name, fn in (("tdist", tdist.all_reduce), ("torch", tdc.all_reduce)):
            fn(t)
            tdist.barrier()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(t)
                times.append(time.perf_counter() - t0)
            out[f"{name}:{nbytes}"] = median(times)
    return out


def rank_main(rank: int, world: int, port: int, impl: str, case: str, quick: bool) -> dict[str, float]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # (as torchrun's OMP_NUM_THREADS=1: ranks share the cores)
    if case == "route":
        tdist.init_process_group("gloo")
        try:
            return route(200 if quick else 1000, 4 if quick else 10)
        finally:
            tdist.destroy_process_group()
    tdc.init_process_group(impl)
    try:
        reps = 4 if quick else 8
        if case == "ddp_comm":
            return ddp_step(2048, 8, reps)
        if case == "ddp_compute":
            return ddp_step(1024, 2048, reps)
        if case == "fsdp2":
            return fsdp_step(4096, 8, reps)
        if case == "dcp":
            return dcp_io(256 * MiB, 2 if quick else 4, rank)
        raise ValueError(case)
    finally:
        tdc.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="ddp_comm,ddp_compute,fsdp2,dcp,route")
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    cases = args.cases.split(",")
    print(f"# torch stack benchmark: {machine_line()} | world {args.world}")
    samples: dict[tuple[str, str, str], list[float]] = {}
    for r in range(args.rounds):
        for case in cases:
            impls = ["tdist"] if case == "route" else (["gloo", "tdist"] if r % 2 == 0 else ["tdist", "gloo"])
            for impl in impls:
                before_fork()
                per_rank = run_processes(rank_main, args.world, free_port(), impl, case, args.quick, timeout=600)
                # (the job moves at its slowest rank's pace; which rank gets the slower core
                # here changes from run to run by 20%)
                res = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
                for key, value in res.items():
                    samples.setdefault((case, impl, key), []).append(value)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)

    def m(case: str, impl: str, key: str) -> float:
        return median(samples[(case, impl, key)])

    rows: list[list[object]] = []
    for case, label in (("ddp_comm", "DDP step, 64 MiB gradients"), ("ddp_compute", "DDP step, compute-bound"),
                        ("fsdp2", "FSDP2 step, 256 MiB"), ("dcp", "")):
        if case not in cases:
            continue
        keys = ("save", "load") if case == "dcp" else ("step",)
        for key in keys:
            g, o = m(case, "gloo", key), m(case, "tdist", key)
            name = f"DCP {key}, 256 MiB sharded" if case == "dcp" else label
            rows.append([name, f"{g * 1e3:.1f} ms", f"{o * 1e3:.1f} ms", f"{g / o:.2f}x"])
    if rows:
        print()
        print(table(["case", "gloo", "tdist", "speed-up"], rows))
    for case in ("ddp_comm", "ddp_compute"):
        if case not in cases:
            continue
        print(f"\n{case}: where a step's time goes (ms)")
        for impl in ("gloo", "tdist"):
            step, quiet, bare, ar = (m(case, impl, k) for k in ("step", "no_comm", "no_ddp", "allreduce"))
            hidden = max(0.0, min(1.0, 1 - (step - quiet) / ar))
            print(f"  {impl}: step {step * 1e3:.1f}; DDP sending nothing {quiet * 1e3:.1f}; no DDP {bare * 1e3:.1f}; "
                  f"all-reduce of the gradients alone {ar * 1e3:.1f}: exposed communication "
                  f"{(step - quiet) * 1e3:.1f}, {hidden:.0%} of the all-reduce hidden behind backward")
        g = m(case, "gloo", "step")
        print(f"  ceiling: gloo's step / DDP sending nothing = {g / m(case, 'tdist', 'no_comm'):.2f}x "
              "(what a backend with free communication would reach)")
    if "route" in cases:
        print()
        for nbytes in (4, 64 * MiB):
            a, b = m("route", "tdist", f"tdist:{nbytes}"), m("route", "tdist", f"torch:{nbytes}")
            size = "4 B" if nbytes == 4 else "64 MiB"
            print(f"all_reduce {size}: tdist.all_reduce {a * 1e6:.1f} us, torch.distributed.all_reduce on tdist "
                  f"{b * 1e6:.1f} us: {(b - a) * 1e6:+.1f} us ({(b / a - 1):+.1%})")
    print(f"\nspeed-up = gloo time / tdist time; median of {args.rounds} rounds; {args.world} processes")


if __name__ == "__main__":
    main()
