"""Data-parallel training of a small classifier: `tdist run --nproc-per-node 2 examples/train.py`.

Written as torch.distributed code with one change, the import. Each rank trains on its shard of
scikit-learn's handwritten digits (8x8 images, shipped inside the package), gradients are
all-reduced every step, parameters are broadcast from rank 0 at the start, and at the end every
rank checks that it holds exactly the same parameters.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import tdist as dist


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # scikit-learn's digits, read straight from the file it ships: importing sklearn.datasets
    # would cost each worker two seconds of start-up for one table
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if (
        spec is not None and spec.submodule_search_locations) else None
    if path is not None and path.exists():
        table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
        x, y = table[:, :-1] / 16.0, table[:, -1].long()
    else:  # no scikit-learn: a synthetic problem of the same shape
        g = torch.Generator().manual_seed(1234)
        centers = torch.randn(10, 64, generator=g)
        y = torch.randint(0, 10, (1797,), generator=g)
        x = centers[y] + 0.8 * torch.randn(1797, 64, generator=g)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    return x[:split], y[:split], x[split:], y[split:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # our tcp backend answers to torch's name
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different on purpose: the broadcast below must fix it

    x_train, y_train, x_test, y_test = load_data(seed=0)
    x_shard, y_shard = x_train[rank::world], y_train[rank::world]

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    steps = (len(y_shard) + args.batch_size - 1) // args.batch_size
    # every rank must run the same number of steps (each step is a collective)
    n_steps = torch.tensor([steps])
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    steps = int(n_steps.item())

    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_shard), generator=torch.Generator().manual_seed(epoch))
        total = torch.zeros(2)
        for s in range(steps):
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            opt.zero_grad()
            loss = loss_fn(model(x_shard[idx]), y_shard[idx])
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world
            opt.step()
            total += torch.tensor([loss.item() * len(idx), len(idx)])
        dist.all_reduce(total)
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {total[0] / total[1]:.4f}  test accuracy {acc:.3f}", flush=True)

    # the same parameters everywhere, to the bit
    flat = torch.cat([p.data.reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    same = bool(torch.equal(lo, hi))
    if rank == 0:
        print(
            f"done: {world} ranks, {args.epochs} epochs in {time.perf_counter() - t0:.1f} s; "
            f"parameters identical on every rank: {same}",
            flush=True,
        )
    dist.destroy_process_group()
    if not same:
        raise SystemExit("parameters differ between ranks")


if __name__ == "__main__":
    main()
