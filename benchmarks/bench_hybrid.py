"""A real RPC + DDP training program side by side: tdist against torch, same run.

Run: .venv/bin/python benchmarks/bench_hybrid.py [--rounds 3] [--impls torch,tdist] [--epochs 60]
     [--busy] [--omp-threads N]

The shape of pytorch/examples' ``distributed/rpc/ddp_rpc`` on CPU, launched as it is, by
``torch.multiprocessing.spawn`` with no launcher around it (so torch's default intra-op threads,
one per core, in each process): 4 processes, a master, a parameter server and 2 trainers. The
parameter server holds an ``EmbeddingBag`` (100 x 16) as a ``RemoteModule``; each trainer holds
a ``Linear(16, 8)`` under ``DistributedDataParallel`` (a gloo group of the 2 trainers) and runs,
in a distributed autograd context, the remote lookup, the local layer, a cross-entropy loss,
``dist_autograd.backward`` and ``DistributedOptimizer(SGD).step``. The master starts both
trainers' loops by ``rpc_async`` and waits, so each trainer's loop runs inside an RPC request,
as in the example. 10 batches an epoch of 20-50 random indices.

Metrics, each from a fresh run of the 4 processes, the implementations alternating:
- ``train s``: the slower trainer's time for its loop (seconds);
- ``steps/s``: both trainers' steps over that time;
- ``CPU s``: user + system time of the 4 processes over the whole run (start-up included).

``--omp-threads N`` sets ``OMP_NUM_THREADS`` (what ``torchrun`` and ``tdist run`` give each of
several workers is 1); ``--busy``: one low-priority busy loop per core meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

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

BATCHES = 10


def _imports(impl: str) -> tuple[object, object, object, object, object, object]:
    if impl == "torch":
        import torch.distributed as dist
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.nn import RemoteModule
        from torch.distributed.optim import DistributedOptimizer
    else:
        import tdist as dist
        import tdist.autograd as dist_autograd
        import tdist.rpc as rpc
        from tdist.nn import RemoteModule
        from tdist.optim import DistributedOptimizer
    return dist, dist_autograd, rpc, RemoteModule, DistributedOptimizer, rpc.RRef


def _batches(rng: random.Random) -> list[tuple[object, object, object]]:
    import torch

    out = []
    for _ in range(BATCHES):
        n = rng.randint(20, 50)
        indices = torch.randint(0, 100, (n,))
        offsets = [0]
        while True:
            nxt = offsets[-1] + rng.randint(1, 10)
            if nxt >= n:
                break
            offsets.append(nxt)
        out.append((indices, torch.tensor(offsets), torch.randint(0, 8, (len(offsets),))))
    return out


def trainer_loop(impl: str, emb: object, rank: int, epochs: int) -> float:
    """One trainer's training (run by the master's ``rpc_async``); returns its seconds."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, dist_autograd, _, _, DistributedOptimizer, RRef = _imports(impl)
    torch.manual_seed(rank)
    fc = DDP(torch.nn.Linear(16, 8))
    params = emb.remote_parameters()  # type: ignore[attr-defined]
    params += [RRef(p) for p in fc.parameters()]  # type: ignore[operator]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)  # type: ignore[operator]
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = random.Random(rank)
    data = [_batches(rng) for _ in range(4)]
    t0 = time.perf_counter()
    for epoch in range(epochs):
        for indices, offsets, target in data[epoch % len(data)]:
            with dist_autograd.context() as ctx:  # type: ignore[attr-defined]
                loss = loss_fn(fc(emb.forward(indices, offsets)), target)  # type: ignore[attr-defined]
                dist_autograd.backward(ctx, [loss])  # type: ignore[attr-defined]
                opt.step(ctx)
    return time.perf_counter() - t0


def worker(rank: int, impl: str, ports: list[int], epochs: int, out: str) -> None:
    import torch

    dist, _, rpc, RemoteModule, _, _ = _imports(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[0]}")  # type: ignore[attr-defined]
    names = {0: "trainer0", 1: "trainer1", 2: "master", 3: "ps"}
    if rank <= 1:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{ports[1]}")  # type: ignore[attr-defined]
    rpc.init_rpc(names[rank], rank=rank, world_size=4, rpc_backend_options=opts)  # type: ignore[attr-defined]
    if rank == 2:
        emb = RemoteModule("ps", torch.nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})  # type: ignore[operator]
        futs = [rpc.rpc_async(f"trainer{r}", trainer_loop, args=(impl, emb, r, epochs), timeout=0)  # type: ignore[attr-defined]
                for r in (0, 1)]
        seconds = [f.wait() for f in futs]
        with open(out, "w") as f:
            json.dump({"train_s": max(seconds), "steps": 2 * epochs * BATCHES}, f)
    rpc.shutdown()  # type: ignore[attr-defined]
    if rank <= 1:
        dist.destroy_process_group()  # type: ignore[attr-defined]


def one_run(impl: str, epochs: int, env: dict[str, str], timeout: float) -> dict[str, float]:
    out = f"/tmp/bench_hybrid_{os.getpid()}_{impl}.json"
    cpu = spawned_program("bench_hybrid", "worker", 4, [impl, [free_port(), free_port()], epochs, out], env, timeout)
    with open(out) as f:
        got = json.load(f)
    os.unlink(out)
    return {"train_s": got["train_s"], "steps_s": got["steps"] / got["train_s"], "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--impls", default="torch,tdist")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--omp-threads", type=int, default=0, help="OMP_NUM_THREADS for the workers (0: unset)")
    parser.add_argument("--busy", action="store_true")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    impls = args.impls.split(",")
    env = program_env(args.omp_threads)
    print(machine_line())
    busy_for_the_run(args.busy)
    results: dict[str, list[dict[str, float]]] = {i: [] for i in impls}
    for r in range(args.rounds):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            got = one_run(impl, args.epochs, env, args.timeout)
            results[impl].append(got)
            print(f"  round {r + 1} {impl:5s} train {got['train_s']:.2f} s  {got['steps_s']:.0f} steps/s  CPU {got['cpu_s']:.1f} s",
                  flush=True)
    rows = [side_by_side("train s", results, "train_s"), side_by_side("steps/s", results, "steps_s", lower_is_better=False),
            side_by_side("CPU s (whole run)", results, "cpu_s")]
    print()
    print(side_by_side_table(impls, rows))
    print(f"\nmedian of {args.rounds} rounds, a fresh run of 4 processes each; OMP_NUM_THREADS "
          f"{args.omp_threads or 'unset'}{', busy host' if args.busy else ''}")


if __name__ == "__main__":
    main()
