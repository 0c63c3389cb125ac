"""RPC side by side: tdist.rpc against torch.distributed.rpc, 2 processes, same run.

Run: .venv/bin/python benchmarks/bench_rpc.py [--rounds 3] [--impls torch,torch-uv,tdist,tdist-pg] [--busy]
     [--only rpc_sync,rpc_async,echo,remote,init] [--calls 2000] [--quick] [--timeout 120]

Implementations (rank 0 = caller "w0", rank 1 = callee "w1", MASTER_ADDR/MASTER_PORT env):

- ``torch``: torch.distributed.rpc, TensorPipe with default options (on one host it picks its
  shared-memory transport and, for tensor payloads, its fastest channel, e.g. cma);
- ``torch-uv``: the same with ``TensorPipeRpcBackendOptions(_transports=["uv"])``, i.e. TCP for
  the messages (the channels, which carry tensor bytes, stay at their defaults);
- ``tdist``: ``tdist.rpc`` with its default TENSORPIPE backend options;
- ``tdist-pg``: ``tdist.rpc`` with ``backend=BackendType.PROCESS_GROUP`` and
  ``ProcessGroupRpcBackendOptions()``.
An implementation that cannot be imported is reported as "not available" and skipped.

Metrics (each measured in its own fresh process pair, timed on rank 0):

- ``rpc_sync``: p50 / p90 latency of ``rpc_sync("w1", noop)`` over ``--calls`` calls after warm-up;
- ``rpc_async``: calls/s of ``rpc_async("w1", noop)`` with a *sliding* window of 64 in flight
  (FIFO: once 64 are outstanding, wait for the oldest, then submit the next), 5x ``--calls``
  calls after warm-up;
- ``echo``: ``rpc_sync("w1", echo, args=(x,))`` of a 64 MiB float32 tensor returned as is:
  median time and bandwidth 2 x 64 MiB / time (GB/s = 1e9 bytes/s); the first (warm-up) reply
  is checked to equal ``x``;
- ``remote``: p50 of ``remote("w1", noop).to_here()``;
- ``init``: ``init_rpc`` and ``shutdown`` on rank 0, separately and together, the two ranks
  released from a barrier at the same moment; several fresh pairs per round, their median.

Method: every round runs every metric for every implementation, the implementations rotating
order from round to round; each cell of the table is the median over ``--rounds`` rounds. Every
process pair gets its own free port and a hard timeout (``--timeout``, default 120 s): a pair
still running then is killed and the cell reads "timeout"; a pair that fails prints its error,
is tried again in the next round (the cell shows the median of the rounds that worked and how many
failed, or "error"), and the other implementations go on. An (implementation, metric) that timed
out is not tried again in later rounds, and an implementation that timed out twice is not
tried again at all (so a hang in init_rpc costs two timeouts, not one per metric and round).

Process start: fork (``tdist.testing.run_processes``). Fork is cheap (the pairs start in
milliseconds, torch already imported), and fork is safe here because this process does no torch
op, starts no thread pool and creates no store or RPC agent before forking: it only imports
torch, torch.distributed.rpc and tdist.rpc. (Forking after an OpenMP op or with a TCPStore /
agent thread running can deadlock the child.) The RPC functions are module-level, so both ranks
resolve them as ``__main__.noop`` / ``__main__.echo``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from collections import deque
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed.rpc as torch_rpc

from _common import _fmt, before_fork, busy_host, machine_line, median, table
from tdist.testing import RankTimeoutError, free_port, run_processes

MiB = 1 << 20
ECHO_BYTES = 64 * MiB
WINDOW = 64
IMPLS = ("torch", "torch-uv", "tdist", "tdist-pg")
METRICS = ("rpc_sync", "rpc_async", "echo", "remote", "init")


# -- the remote functions (module level: both ranks resolve them by name) ----------------------
def noop() -> None:
    return None


def echo(x: Any) -> Any:
    return x


# -- implementations ---------------------------------------------------------------------------
def load_tdist() -> tuple[Any, str]:
    """(tdist.rpc, "") or (None, why it cannot be used)."""
    try:
        import tdist.rpc as rpc
    except Exception as exc:
        return None, f"import tdist.rpc failed: {exc!r}"
    if not hasattr(rpc, "init_rpc"):
        return None, "tdist.rpc has no init_rpc"
    return rpc, ""


def available(impl: str) -> str:
    """'' when ``impl`` can run, else the reason it cannot."""
    if impl in ("torch", "torch-uv"):
        return "" if torch_rpc.is_available() else "torch.distributed.rpc.is_available() is False"
    rpc, why = load_tdist()
    if rpc is None:
        return why
    if impl == "tdist-pg":
        backend = getattr(rpc, "BackendType", None)
        if backend is None or not hasattr(backend, "PROCESS_GROUP"):
            return "tdist.rpc has no BackendType.PROCESS_GROUP"
        if not hasattr(rpc, "ProcessGroupRpcBackendOptions"):
            return "tdist.rpc has no ProcessGroupRpcBackendOptions"
    return ""


def rpc_module(impl: str) -> Any:
    return torch_rpc if impl.startswith("torch") else load_tdist()[0]


def init(rpc: Any, impl: str, rank: int) -> None:
    kwargs: dict[str, Any] = {}
    if impl == "torch-uv":
        kwargs["rpc_backend_options"] = rpc.TensorPipeRpcBackendOptions(_transports=["uv"])
    elif impl == "tdist-pg":
        kwargs["backend"] = rpc.BackendType.PROCESS_GROUP
        kwargs["rpc_backend_options"] = rpc.ProcessGroupRpcBackendOptions()
    else:
        kwargs["rpc_backend_options"] = rpc.TensorPipeRpcBackendOptions()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, **kwargs)


# -- the measurements (rank 0) -----------------------------------------------------------------
def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def latencies(call: Any, n: int, warm: int) -> dict[str, float]:
    for _ in range(warm):
        call()
    pc = time.perf_counter
    lat = []
    for _ in range(n):
        t = pc()
        call()
        lat.append(pc() - t)
    lat.sort()
    return {"p50": pct(lat, 0.5), "p90": pct(lat, 0.9)}


def m_rpc_sync(rpc: Any, cfg: dict[str, int]) -> dict[str, float]:
    return latencies(lambda: rpc.rpc_sync("w1", noop), cfg["calls"], cfg["warm"])


def m_remote(rpc: Any, cfg: dict[str, int]) -> dict[str, float]:
    return latencies(lambda: rpc.remote("w1", noop).to_here(), cfg["calls"], cfg["warm"])


def async_window(rpc: Any, total: int) -> float:
    """Seconds for ``total`` rpc_async calls, at most WINDOW outstanding (sliding, FIFO)."""
    window: deque[Any] = deque()
    t0 = time.perf_counter()
    for _ in range(total):
        if len(window) >= WINDOW:
            window.popleft().wait()
        window.append(rpc.rpc_async("w1", noop))
    while window:
        window.popleft().wait()
    return time.perf_counter() - t0


def m_rpc_async(rpc: Any, cfg: dict[str, int]) -> dict[str, float]:
    async_window(rpc, 4 * WINDOW)
    total = cfg["async_calls"]
    return {"calls_per_s": total / async_window(rpc, total)}


def m_echo(rpc: Any, cfg: dict[str, int]) -> dict[str, float]:
    x = torch.rand(ECHO_BYTES // 4, dtype=torch.float32)
    y = rpc.rpc_sync("w1", echo, args=(x,))
    if not (isinstance(y, torch.Tensor) and y.dtype == x.dtype and torch.equal(y, x)):
        raise AssertionError("echo: the reply differs from the tensor sent")
    del y
    times = []
    for _ in range(cfg["echo_reps"]):
        t0 = time.perf_counter()
        rpc.rpc_sync("w1", echo, args=(x,))
        times.append(time.perf_counter() - t0)
    t = median(times)
    return {"time": t, "gbps": 2 * ECHO_BYTES / t / 1e9}


MEASURE = {"rpc_sync": m_rpc_sync, "rpc_async": m_rpc_async, "echo": m_echo, "remote": m_remote}


def pair_main(
    rank: int, world: int, impl: str, port: int, metric: str, cfg: dict[str, int], barrier: Any
) -> dict[str, float]:
    """One rank of a fresh pair: init_rpc, (rank 0) measure ``metric``, shutdown."""
    # torch's shutdown calls all_gather_object on its gloo group, which warns on every pair
    warnings.filterwarnings("ignore", message="You are using a Backend")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc = rpc_module(impl)
    barrier.wait(30)
    t0 = time.perf_counter()
    init(rpc, impl, rank)
    t1 = time.perf_counter()
    out = MEASURE[metric](rpc, cfg) if rank == 0 and metric in MEASURE else {}
    t2 = time.perf_counter()
    rpc.shutdown()
    t3 = time.perf_counter()
    # neither rank exits before both have shut down: rank 0 hosts the store, and torch's rank 1
    # fails its shutdown ("Connection reset by peer") when rank 0's process is already gone
    barrier.wait(30)
    out.update(init=t1 - t0, shutdown=t3 - t2, init_shutdown=(t1 - t0) + (t3 - t2))
    return out


def run_pair(impl: str, metric: str, cfg: dict[str, int], timeout: float) -> dict[str, float]:
    barrier = mp.get_context("fork").Barrier(2)
    before_fork()
    res = run_processes(
        pair_main, 2, impl, free_port(), metric, cfg, barrier, timeout=timeout, grace=5.0
    )
    return res[0]


def measure(impl: str, metric: str, cfg: dict[str, int], timeout: float) -> dict[str, float]:
    if metric != "init":
        return run_pair(impl, metric, cfg, timeout)
    runs = [run_pair(impl, metric, cfg, timeout) for _ in range(cfg["init_pairs"])]
    return {k: median([r[k] for r in runs]) for k in ("init", "shutdown", "init_shutdown")}


# -- the table ---------------------------------------------------------------------------------
# (label, metric, key, scale, higher is better, target ratio tdist/best torch or None)
ROWS: list[tuple[str, str, str, float, bool, float | None]] = [
    ("rpc_sync p50 (us)", "rpc_sync", "p50", 1e6, False, 0.25),
    ("rpc_sync p90 (us)", "rpc_sync", "p90", 1e6, False, None),
    (f"rpc_async, {WINDOW} in flight (calls/s)", "rpc_async", "calls_per_s", 1.0, True, 2.0),
    ("echo 64 MiB median (ms)", "echo", "time", 1e3, False, None),
    ("echo 64 MiB bandwidth (GB/s)", "echo", "gbps", 1.0, True, 3.0),
    ("remote+to_here p50 (us)", "remote", "p50", 1e6, False, 0.3),
    ("init_rpc (ms)", "init", "init", 1e3, False, None),
    ("shutdown (ms)", "init", "shutdown", 1e3, False, None),
    ("init_rpc + shutdown (ms)", "init", "init_shutdown", 1e3, False, 0.5),
]


def ratio_text(value: float, ref: float, higher: bool) -> str:
    r = value / ref
    if higher:
        return f"{r:.2f}x"
    return f"{r:.2f}x ({ref / value:.1f}x faster)"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--impls", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}"
    )
    ap.add_argument("--only", default="", help=f"comma-separated metrics, of {','.join(METRICS)}")
    ap.add_argument(
        "--calls",
        type=int,
        default=0,
        help="calls per latency measurement (default 2000, --quick 300)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations and pairs")
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before a process pair is killed"
    )
    args = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    metrics = [m.strip() for m in args.only.split(",") if m.strip()] or list(METRICS)
    for name, given, known in (("impl", impls, IMPLS), ("metric", metrics, METRICS)):
        bad = [g for g in given if g not in known]
        if bad:
            ap.error(f"unknown {name}(s) {bad}; choose from {', '.join(known)}")
    calls = args.calls or (300 if args.quick else 2000)
    cfg = {
        "calls": calls,
        "warm": max(10, calls // 20),
        "async_calls": max(WINDOW * 4, 5 * calls),
        "echo_reps": 3 if args.quick else 7,
        "init_pairs": 1 if args.quick else 3,
    }

    busy = " | busy host" if args.busy else ""
    print(f"# rpc benchmark: {machine_line()} | torch {torch.__version__} | 2 processes (fork){busy}")
    print(f"# {args.rounds} rounds; {cfg}")
    runnable = []
    for impl in impls:
        why = available(impl)
        if why:
            print(f"{impl}: not available ({why})")
        else:
            runnable.append(impl)
    # samples[(impl, metric)]: per-round result dicts; timed_out: (impl, metric) not tried again;
    # errors[(impl, metric)]: how many rounds failed
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    timed_out: set[tuple[str, str]] = set()
    errors: dict[tuple[str, str], int] = {}
    timeouts: dict[str, int] = {}  # an implementation that times out twice is skipped from then on
    t_start = time.perf_counter()
    with busy_host(args.busy):
        for r in range(args.rounds):
            k = r % len(runnable) if runnable else 0
            order = runnable[k:] + runnable[:k]
            for metric in metrics:
                for impl in order:
                    if (impl, metric) in timed_out:
                        continue
                    if timeouts.get(impl, 0) >= 2:
                        timed_out.add((impl, metric))
                        print(
                            f"  {impl} {metric}: skipped ({impl} timed out twice already)", flush=True
                        )
                        continue
                    try:
                        res = measure(impl, metric, cfg, args.timeout)
                    except RankTimeoutError as exc:
                        timed_out.add((impl, metric))
                        timeouts[impl] = timeouts.get(impl, 0) + 1
                        print(f"  {impl} {metric}: TIMEOUT ({exc})", flush=True)
                        continue
                    except Exception as exc:
                        errors[(impl, metric)] = errors.get((impl, metric), 0) + 1
                        text = "".join(traceback.format_exception_only(exc)).strip()
                        print(f"  {impl} {metric}: ERROR {text}", flush=True)
                        continue
                    samples.setdefault((impl, metric), []).append(res)
                    shown = "; ".join(
                        f"{label} {res[key] * scale:.4g}"
                        for label, m, key, scale, _, _ in ROWS
                        if m == metric
                    )
                    print(f"  round {r + 1} {impl:8s} {shown}", flush=True)
            print(
                f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True
            )

    def cell(impl: str, metric: str, key: str, scale: float) -> tuple[float | None, str]:
        """(median over the rounds that succeeded, its text, with failed rounds noted)."""
        if impl not in impls or impl not in runnable:
            return None, "n/a"
        got = samples.get((impl, metric), [])
        notes = []
        if errors.get((impl, metric)):
            notes.append(f"{errors[(impl, metric)]} failed")
        if (impl, metric) in timed_out:
            notes.append("timeout")
        if not got:
            return None, ", ".join(notes) or "n/a"
        value = median([s[key] for s in got]) * scale
        text = _fmt(value) + (f" ({', '.join(notes)})" if notes else "")
        return value, text

    rows = []
    extra = []
    for label, metric, key, scale, higher, target in ROWS:
        if metric not in metrics:
            continue
        cells = {impl: cell(impl, metric, key, scale) for impl in IMPLS}
        vals = {impl: v for impl, (v, _) in cells.items()}
        torch_vals = [v for i, v in vals.items() if i.startswith("torch") and v is not None]
        best = (max if higher else min)(torch_vals) if torch_vals else None
        td = vals["tdist"]
        ratio = met = "—"
        if td is not None and best is not None:
            ratio = ratio_text(td, best, higher)
            if target is not None:
                ok = td / best >= target if higher else td / best <= target
                met = "yes" if ok else "no"
        tgt = "—" if target is None else (f">= {target:g}x" if higher else f"<= {target:g}x")
        rows.append(
            [
                label,
                cells["torch"][1],
                cells["torch-uv"][1],
                cells["tdist"][1],
                cells["tdist-pg"][1],
                ratio,
                tgt,
                met,
            ]
        )
        pairs = []
        for mine in ("tdist", "tdist-pg"):
            for ref in ("torch", "torch-uv"):
                a, b = vals[mine], vals[ref]
                pairs.append(f"{a / b:.2f}x" if a is not None and b is not None else "—")
        extra.append([label, *pairs])
    print()
    print(
        table(
            [
                "metric",
                "torch",
                "torch-uv",
                "tdist",
                "tdist-pg",
                "ratio vs best torch",
                "target",
                "met?",
            ],
            rows,
        )
    )
    print(
        f"\nmedian of {args.rounds} rounds, a fresh process pair per measurement; ratio = tdist / the "
        "better of torch and torch-uv (latency: lower is better, 'x faster' = torch time / tdist "
        "time; throughput and bandwidth: higher is better)"
    )
    if any(samples.get((impl, m)) for impl in ("tdist", "tdist-pg") for m in metrics):
        print()
        print(
            table(
                ["metric", "tdist/torch", "tdist/torch-uv", "tdist-pg/torch", "tdist-pg/torch-uv"],
                extra,
            )
        )


if __name__ == "__main__":
    main()
