"""A pipeline-parallel RPC training program side by side: tdist against torch, same run.

Run: .venv/bin/python benchmarks/bench_pipeline.py [--rounds 3] [--impls torch,tdist]
     [--splits 1,4] [--batches 3] [--busy] [--omp-threads N]

The shape of pytorch/examples' ``distributed/rpc/pipeline`` on CPU, launched as it is, by
``torch.multiprocessing.spawn`` (torch's default intra-op threads in each process): a master and
two workers, each worker holding one half of a ResNet-50 (bottleneck blocks 3, 4 | 6, 3) behind
an RRef. For each batch of 24 images (64 x 64), in a distributed autograd context, the master
splits the batch into micro-batches of ``split`` images and sends each through both halves
(``remote`` to the first, ``rpc_async`` to the second, RRef proxies as in the example), joins
the outputs, takes an MSE loss, runs ``dist_autograd.backward`` and steps a
``DistributedOptimizer(SGD)`` over both halves' parameters. The backward passes of the
micro-batches reach each worker together.

Metrics, each from a fresh run of the 3 processes (one warm-up batch, then ``--batches``), the
implementations alternating:
- ``loop s``: the master's time for its batches (seconds);
- ``backward s``: of that, the time in ``dist_autograd.backward``;
- ``CPU s``: user + system time of the 3 processes over the whole run (start-up included).

``--omp-threads N`` sets ``OMP_NUM_THREADS``; ``--busy``: one low-priority busy loop per core
meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    busy_for_the_run,
    free_port,
    machine_line,
    program_env,
    side_by_side,
    side_by_side_table,
    spawned_program,
)

BATCH, IMAGE, CLASSES = 24, 64, 1000


def _imports(impl: str) -> tuple[Any, Any, Any]:
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
    else:
        import tdist.autograd as dist_autograd
        import tdist.rpc as rpc
        from tdist.optim import DistributedOptimizer
    return dist_autograd, rpc, DistributedOptimizer


def _bottleneck(nn: Any, inp: int, width: int, stride: int) -> Any:
    out = width * 4

    class Bottleneck(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out),
            )
            self.skip = (nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or inp != out else nn.Identity())
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.skip(x))

    return Bottleneck()


def _stage(nn: Any, inp: int, width: int, blocks: int, stride: int) -> list[Any]:
    layers = [_bottleneck(nn, inp, width, stride)]
    layers += [_bottleneck(nn, width * 4, width, 1) for _ in range(blocks - 1)]
    return layers


class Shard:
    """One half of the model, on a worker; its forward fetches the input from an RRef and runs
    under a lock, as the example's shards do."""

    def __init__(self, impl: str, half: int) -> None:
        import torch
        import torch.nn as nn

        torch.manual_seed(half)
        self.impl = impl
        self._lock = threading.Lock()
        if half == 1:
            layers = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                      nn.MaxPool2d(3, stride=2, padding=1), *_stage(nn, 64, 64, 3, 1), *_stage(nn, 256, 128, 4, 2)]
        else:
            layers = [*_stage(nn, 512, 256, 6, 2), *_stage(nn, 1024, 512, 3, 2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, CLASSES)]
        self.seq = nn.Sequential(*layers)

    def forward(self, x_rref: Any) -> Any:
        x = x_rref.to_here()
        with self._lock:
            return self.seq(x)

    def parameter_rrefs(self) -> list[Any]:
        _, rpc, _ = _imports(self.impl)
        return [rpc.RRef(p) for p in self.seq.parameters()]


def _master(impl: str, split: int, batches: int) -> dict[str, float]:
    import torch

    dist_autograd, rpc, DistributedOptimizer = _imports(impl)
    p1 = rpc.remote("worker1", Shard, args=(impl, 1))
    p2 = rpc.remote("worker2", Shard, args=(impl, 2))
    params = p1.remote().parameter_rrefs().to_here() + p2.remote().parameter_rrefs().to_here()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    loss_fn = torch.nn.MSELoss()
    torch.manual_seed(0)
    inputs = torch.randn(BATCH, 3, IMAGE, IMAGE)
    labels = torch.zeros(BATCH, CLASSES).scatter_(1, torch.randint(0, CLASSES, (BATCH, 1)), 1)
    loop = backward = 0.0
    for i in range(batches + 1):  # (the first: warm-up)
        t0 = time.perf_counter()
        with dist_autograd.context() as ctx:
            futs = []
            for x in inputs.split(split):
                y_rref = p1.remote().forward(rpc.RRef(x))
                futs.append(p2.rpc_async().forward(y_rref))
            outputs = torch.cat(torch.futures.wait_all(futs))
            t1 = time.perf_counter()
            dist_autograd.backward(ctx, [loss_fn(outputs, labels)])
            t2 = time.perf_counter()
            opt.step(ctx)
        if i:
            loop += time.perf_counter() - t0
            backward += t2 - t1
    return {"loop_s": loop, "backward_s": backward}


def worker(rank: int, impl: str, port: int, split: int, batches: int, out: str) -> None:
    _, rpc, _ = _imports(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=256, rpc_timeout=300)
    rpc.init_rpc("master" if rank == 0 else f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    if rank == 0:
        got = _master(impl, split, batches)
        with open(out, "w") as f:
            json.dump(got, f)
    rpc.shutdown()


def one_run(impl: str, split: int, batches: int, env: dict[str, str], timeout: float) -> dict[str, float]:
    out = f"/tmp/bench_pipeline_{os.getpid()}_{impl}.json"
    cpu = spawned_program("bench_pipeline", "worker", 3, [impl, free_port(), split, batches, out], env, timeout)
    with open(out) as f:
        got: dict[str, float] = json.load(f)
    os.unlink(out)
    got["cpu_s"] = cpu
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--impls", default="torch,tdist")
    parser.add_argument("--splits", default="1,4", help="micro-batch sizes (images)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--omp-threads", type=int, default=0, help="OMP_NUM_THREADS for the workers (0: unset)")
    parser.add_argument("--busy", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    impls = args.impls.split(",")
    splits = [int(s) for s in args.splits.split(",")]
    env = program_env(args.omp_threads)
    print(machine_line())
    busy_for_the_run(args.busy)
    results: dict[tuple[int, str], list[dict[str, float]]] = {(s, i): [] for s in splits for i in impls}
    for r in range(args.rounds):
        for split in splits:
            for impl in impls if r % 2 == 0 else impls[::-1]:
                got = one_run(impl, split, args.batches, env, args.timeout)
                results[split, impl].append(got)
                print(f"  round {r + 1} split {split} {impl:5s} loop {got['loop_s']:.2f} s  backward {got['backward_s']:.2f} s"
                      f"  CPU {got['cpu_s']:.1f} s", flush=True)
    rows = [side_by_side(f"split {split}: {label}", {i: results[split, i] for i in impls}, metric)
            for split in splits
            for metric, label in (("loop_s", "loop s"), ("backward_s", "backward s"), ("cpu_s", "CPU s (whole run)"))]
    print()
    print(side_by_side_table(impls, rows))
    print(f"\nmedian of {args.rounds} rounds, a fresh run of 3 processes each, {args.batches} batches of {BATCH} "
          f"after one warm-up; OMP_NUM_THREADS {args.omp_threads or 'unset'}{', busy host' if args.busy else ''}")


if __name__ == "__main__":
    main()
