"""torch 0.3's master-worker mode on tdist: rank 0 runs this program, the other ranks serve it.

    tdist run --nproc-per-node 3 examples/master_worker.py

The master makes tensors on the workers, computes with them there, runs a collective among the
workers and fetches the results; the workers' processes end when the master's does.
"""

from __future__ import annotations

import warnings

import torch

import tdist
import tdist.master_worker as mw


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the experimental-mode banner)
        tdist.init_master_worker("tcp")  # workers never return from here
    print(f"master of workers {mw.workers()}")

    a = mw.remote_tensor(torch.ones, 2, 3, worker=1)  # made on worker1, stays there
    b = mw.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], worker=2)  # the master's value, on worker2
    a.mul_(2)  # runs on worker1
    c = torch.matmul(a, b)  # runs on worker1 (b is copied there from worker2)
    print("a @ b =", c.fetch().tolist(), "on", c.worker)
    print("sum of b:", b.sum().item(), "shape of c:", tuple(c.shape))

    shards = mw.spread(torch.arange(8.0))  # one shard per worker
    mw.all_reduce(shards, op=tdist.ReduceOp.SUM)  # among the workers, on their process group
    print("all-reduced shards:", [s.fetch().tolist() for s in shards])
    mw.shutdown()  # (also done at exit)


if __name__ == "__main__":
    main()
