"""Where a parameter-server step's time goes, torch against tdist: the step of
``bench_dist_autograd.py``'s ``ps`` row (pytorch/examples' parameter server), each phase timed on
the trainer (p50 over the steps): entering the context, the forward call, the loss, backward,
the example's gradient fetch, the optimizer step, leaving the context.

Run: .venv/bin/python benchmarks/dist_autograd_parts.py [--steps 300] [--pairs 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch

import bench_dist_autograd as b
from tdist.testing import free_port, run_processes

PHASES = ("enter", "fwd", "loss", "bwd", "grads", "opt", "exit", "total")


def main(rank: int, world: int, port: int, steps: int, impl: str) -> dict[str, float]:
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc, autograd, dist_opt = b.modules(impl)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions())
    out: dict[str, float] = {}
    if rank == 0:
        w_rref = rpc.remote("w1", b.make_server)
        params = rpc.rpc_sync("w1", b.call_method, args=(b.server_params, w_rref, impl))
        opt = dist_opt(torch.optim.SGD, params, lr=0.03)
        torch.manual_seed(1)
        x, target = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
        parts: dict[str, list[float]] = {k: [] for k in PHASES}
        pc = time.perf_counter
        for i in range(steps + 50):
            t0 = pc()
            cm: Any = autograd.context()
            ctx = cm.__enter__()
            t1 = pc()
            pred = rpc.rpc_sync("w1", b.call_method, args=(b.server_forward, w_rref, x))
            t2 = pc()
            loss = torch.nn.functional.nll_loss(pred, target)
            t3 = pc()
            autograd.backward(ctx, [loss])
            t4 = pc()
            assert rpc.rpc_sync("w1", b.call_method, args=(b.server_grads, w_rref, impl, ctx))
            t5 = pc()
            opt.step(ctx)
            t6 = pc()
            cm.__exit__(None, None, None)
            t7 = pc()
            if i >= 50:  # (the first steps warm up)
                for k, a, z in zip(PHASES, (t0, t1, t2, t3, t4, t5, t6, t0), (t1, t2, t3, t4, t5, t6, t7, t7), strict=True):
                    parts[k].append(z - a)
        for k, v in parts.items():
            v.sort()
            out[k] = v[len(v) // 2] * 1e6
        del w_rref, opt, params
    rpc.shutdown()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    print("phase p50 (us):", " ".join(PHASES))
    for _ in range(args.pairs):
        for impl in ("torch", "tdist"):
            res = run_processes(main, 2, free_port(), args.steps, impl, timeout=300)[0]
            print(f"{impl:6s}", "  ".join(f"{k} {v:.0f}" for k, v in res.items()), flush=True)
