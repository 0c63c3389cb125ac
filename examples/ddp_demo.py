"""torch's DistributedDataParallel on the tdist backend: a 34M-parameter classifier trained on
scikit-learn's digits by N workers.

    .venv/bin/tdist run --nproc-per-node 2 examples/ddp_demo.py [--epochs 5] [--limit STEPS]

The program is torch's own DDP recipe (torchrun's environment, ``DistributedSampler``,
``DistributedDataParallel``); the one tdist line is ``import tdist``, which registers the
``"tdist"`` backend with ``torch.distributed``. Each epoch prints one line; at the end every
rank's parameters are compared (a checksum all-gathered) and the program fails if they differ.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tdist  # noqa: F401  (registers the "tdist" backend with torch.distributed)

WIDTH = 4096  # 64 -> 4096 -> 4096 -> 4096 -> 10: 34 M parameters


def data() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    x, y = x[order], y[order]
    cut = int(len(x) * 0.8)
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # (DDP broadcasts rank 0's parameters anyway)
    return torch.nn.Sequential(
        torch.nn.Linear(64, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="per worker")
    ap.add_argument("--limit", type=int, default=None, help="at most this many steps per epoch (a quick check)")
    ap.add_argument("--backend", default="tdist", help='"gloo" runs the same on torch\'s own backend')
    args = ap.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.set_num_threads(1)  # (torchrun's OMP_NUM_THREADS=1: the workers share the cores)
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    train, test = data()
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler)
    net = DDP(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if rank == 0:
        params = sum(p.numel() for p in net.parameters())
        print(f"DDP on {dist.get_backend()}: {world} workers, {params / 1e6:.1f} M parameters, "
              f"{len(train)} training images, batch {args.batch} per worker", flush=True)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, total, count = time.perf_counter(), torch.zeros(2), 0
        for x, y in loader:
            if count == args.limit:
                break
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
            count += 1
        dist.all_reduce(total)  # (the epoch's mean loss over every worker's samples)
        with torch.no_grad():
            correct = (net.module(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {total[0] / total[1]:.4f}, test accuracy "
                  f"{correct:.1%}, {count} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    # the ranks agree: every worker holds the same parameters
    mine = torch.stack([torch.cat([p.detach().flatten() for p in net.parameters()]).double().sum(),
                        torch.tensor(float(sum(p.numel() for p in net.parameters())), dtype=torch.float64)])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if any(not torch.equal(e, every[0]) for e in every):
        raise SystemExit(f"rank {rank}: the workers' parameters differ: {[e.tolist() for e in every]}")
    if rank == 0:
        print(f"done in {time.perf_counter() - start:.1f} s; all {world} workers hold identical "
              f"parameters (checksum {every[0][0].item():.6f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
