"""Distributed autograd side by side: tdist.autograd / tdist.optim against
torch.distributed.autograd / torch.distributed.optim, 2 processes, same run.

Run: .venv/bin/python benchmarks/bench_dist_autograd.py [--rounds 3] [--impls torch,tdist]
     [--steps 500] [--only bwd16,bwd512,step16,ps] [--busy] [--timeout 120]

Rank 0 (``w0``, the trainer) holds an RRef to a weight ``W`` (n x n, requires grad) owned by
rank 1 (``w1``, the parameter server). Metrics, each in a fresh process pair, timed on rank 0:

- ``backward n=16`` / ``backward n=512``: p50 of one step without an optimizer:
  ``with dist_autograd.context() as ctx: y = rpc_sync("w1", forward, (W_rref, x));
  dist_autograd.backward(ctx, [y.sum()]); dist_autograd.get_gradients(ctx)``; the forward call
  returns ``W @ x`` (its reply is recorded), the backward pass sends the gradient back to w1,
  which accumulates ``dW`` in the context;
- ``train step n=16``: the same plus ``DistributedOptimizer(SGD, [W_rref]).step(ctx)``;
- ``parameter server step``: pytorch/examples' RPC parameter server, with an MLP (784-128-10,
  batch 32): rank 1 holds the model, the trainer calls its forward through
  ``rpc_sync(ps, call_method, (forward, ps_rref, x))`` inside a context, takes the loss,
  ``backward``, asks the server for its gradients in the context (as the example checks them)
  and steps a ``DistributedOptimizer(SGD)`` over the model's four parameter RRefs. torch's
  intra-op threads at their default (two here): the server computes while the trainer waits.

``torch`` is TensorPipe with its default options (shared memory on one host), ``tdist`` our
TENSORPIPE agent with default options. Each cell is the median over ``--rounds`` rounds, the
implementations alternating order from round to round. Process start: fork (see bench_rpc.py
for why that is safe here).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed.autograd as torch_autograd
import torch.distributed.optim as torch_optim
import torch.distributed.rpc as torch_rpc

from _common import _fmt, before_fork, busy_for_the_run, machine_line, median, table
from tdist.testing import RankTimeoutError, free_port, run_processes

IMPLS = ("torch", "tdist")
# (label, metric, n, with optimizer)
METRICS = [
    ("backward n=16 p50 (us)", "bwd16", 16, False),
    ("backward n=512 p50 (us)", "bwd512", 512, False),
    ("train step n=16 p50 (us)", "step16", 16, True),
    ("parameter server step p50 (us)", "ps", 0, True),
]


# -- the remote functions (module level: both ranks resolve them by name) ----------------------
def make_weight(n: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, n, requires_grad=True)


def forward(w_rref: Any, x: torch.Tensor) -> torch.Tensor:
    return w_rref.local_value() @ x


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(x.flatten(1)))), dim=1)


def make_server() -> _Mlp:
    torch.manual_seed(0)
    return _Mlp()


def call_method(method: Any, rref: Any, *args: Any) -> Any:
    return method(rref.local_value(), *args)


def server_forward(model: _Mlp, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def server_params(model: _Mlp, impl: str) -> list[Any]:
    rpc = modules(impl)[0]
    return [rpc.RRef(p) for p in model.parameters()]


def server_grads(model: _Mlp, impl: str, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    return dict(modules(impl)[1].get_gradients(context_id))


def modules(impl: str) -> tuple[Any, Any, Any]:
    if impl == "torch":
        return torch_rpc, torch_autograd, torch_optim.DistributedOptimizer
    import tdist.autograd as autograd
    import tdist.rpc as rpc
    from tdist.optim import DistributedOptimizer

    return rpc, autograd, DistributedOptimizer


def pair_main(rank: int, world: int, impl: str, port: int, metric: str, steps: int) -> dict[str, float]:
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc, autograd, dist_opt = modules(impl)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions())
    out: dict[str, float] = {}
    if rank == 0 and metric == "ps":
        w_rref = rpc.remote("w1", make_server)
        params = rpc.rpc_sync("w1", call_method, args=(server_params, w_rref, impl))
        opt = dist_opt(torch.optim.SGD, params, lr=0.03)
        torch.manual_seed(1)
        x, target = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))

        def step() -> None:
            with autograd.context() as ctx:
                pred = rpc.rpc_sync("w1", call_method, args=(server_forward, w_rref, x))
                autograd.backward(ctx, [torch.nn.functional.nll_loss(pred, target)])
                assert rpc.rpc_sync("w1", call_method, args=(server_grads, w_rref, impl, ctx))
                opt.step(ctx)

    elif rank == 0:
        _, _, n, with_opt = next(m for m in METRICS if m[1] == metric)
        w_rref = rpc.remote("w1", make_weight, args=(n,))
        x = torch.randn(n, 1)
        opt = dist_opt(torch.optim.SGD, [w_rref], lr=0.001) if with_opt else None

        def step() -> None:
            with autograd.context() as ctx:
                y = rpc.rpc_sync("w1", forward, args=(w_rref, x))
                autograd.backward(ctx, [y.sum()])
                autograd.get_gradients(ctx)
                if opt is not None:
                    opt.step(ctx)

    if rank == 0:
        for _ in range(max(10, steps // 10)):
            step()
        lat = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            lat.append(time.perf_counter() - t0)
        lat.sort()
        out["p50"] = lat[len(lat) // 2]
        del w_rref, opt
    rpc.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--only", default="", help=f"comma-separated metrics, of {','.join(m[1] for m in METRICS)}")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    impls = [i for i in args.impls.split(",") if i]
    print(f"# dist autograd benchmark: {machine_line()} | torch {torch.__version__} | 2 processes (fork)")
    print(f"# {args.rounds} rounds, {args.steps} steps per measurement")
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = impls[r % len(impls) :] + impls[: r % len(impls)]
        for _, metric, _, _ in METRICS:
            if args.only and metric not in args.only.split(","):
                continue
            for impl in order:
                before_fork()
                try:
                    res = run_processes(pair_main, 2, impl, free_port(), metric, args.steps, timeout=args.timeout, grace=5.0)[0]
                except RankTimeoutError as exc:
                    print(f"  {impl} {metric}: TIMEOUT ({exc})", flush=True)
                    continue
                except Exception as exc:
                    print(f"  {impl} {metric}: ERROR {''.join(traceback.format_exception_only(exc)).strip()}", flush=True)
                    continue
                samples.setdefault((impl, metric), []).append(res["p50"] * 1e6)
                print(f"  round {r + 1} {impl:6s} {metric} p50 {res['p50'] * 1e6:.1f} us", flush=True)
    rows = []
    for label, metric, _, _ in METRICS:
        if args.only and metric not in args.only.split(","):
            continue
        cells = {impl: median(samples[(impl, metric)]) if (impl, metric) in samples else None for impl in impls}
        t, d = cells.get("torch"), cells.get("tdist")
        ratio = f"{d / t:.2f}x ({t / d:.1f}x faster)" if t and d else "—"
        rows.append([label, *(_fmt(cells[i]) if cells[i] is not None else "n/a" for i in impls), ratio])
    print()
    print(table(["metric", *impls, "tdist / torch"], rows))
    print(f"\nmedian of {args.rounds} rounds, a fresh process pair per measurement; lower is better")


if __name__ == "__main__":
    main()
