"""Collectives side by side: tdist's tcp backend against torch.distributed's gloo, same run.

Run: .venv/bin/python benchmarks/bench_c10d.py [--rounds 3] [--world 2] [--quick]

Each round starts a fresh group of --world processes per implementation (the order alternates
between rounds) and times every case; the table shows medians over rounds. Bus bandwidth follows
nccl-tests: all_reduce moves 2(n-1)/n of the buffer per rank, all_gather (n-1)/n of the output,
broadcast and send/recv the buffer once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as tdc

import tdist
from _common import before_fork, busy_host, machine_line, median, memcpy_gbps, table
from tdist.testing import free_port, run_processes

MiB = 1 << 20
CASES_FULL = [
    ("all_reduce", 4), ("barrier", 0), ("all_reduce", 1 * MiB), ("all_reduce", 64 * MiB),
    ("all_reduce", 256 * MiB), ("broadcast", 64 * MiB), ("send_recv", 4), ("send_recv", 64 * MiB),
    ("all_gather", 64 * MiB),
]
CASES_QUICK = [("all_reduce", 4), ("barrier", 0), ("all_reduce", 1 * MiB), ("all_reduce", 64 * MiB)]


def reps_for(nbytes: int) -> int:
    if nbytes <= 4096:
        return 300
    if nbytes <= 4 * MiB:
        return 30
    return 4 if nbytes <= 64 * MiB else 2


def bench_rank(rank: int, world: int, impl: str, port: int, cases: list[tuple[str, int]]) -> dict[str, float]:
    d: Any = tdc if impl == "gloo" else tdist
    d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, float] = {}
    for op, nbytes in cases:
        numel = max(1, nbytes // 4)
        t = torch.ones(numel)
        outs = [torch.empty(numel) for _ in range(world)] if op == "all_gather" else None

        def once(op: str = op, t: torch.Tensor = t, outs: list[torch.Tensor] | None = outs) -> None:
            if op == "all_reduce":
                d.all_reduce(t)
            elif op == "barrier":
                d.barrier()
            elif op == "broadcast":
                d.broadcast(t, src=0)
            elif op == "all_gather":
                d.all_gather(outs, t)
            elif op == "send_recv":
                if rank == 0:
                    d.send(t, 1)
                    d.recv(t, 1)
                elif rank == 1:
                    d.recv(t, 0)
                    d.send(t, 0)

        once()
        d.barrier()
        times = []
        for _ in range(reps_for(nbytes)):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        value = median(times)
        if op == "send_recv":
            value /= 2  # one direction
        out[f"{op}:{nbytes}"] = value
    d.destroy_process_group()
    return out


def busbw(op: str, nbytes: int, world: int, seconds: float) -> float:
    if op == "all_reduce":
        return 2 * (world - 1) / world * nbytes / seconds / 1e9
    if op == "all_gather":
        return (world - 1) / world * nbytes * world / seconds / 1e9
    return nbytes / seconds / 1e9


def human(nbytes: int) -> str:
    if nbytes >= MiB:
        return f"{nbytes // MiB} MiB"
    return f"{nbytes} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--only", help="only this operation (e.g. send_recv)")
    args = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    cases = CASES_QUICK if args.quick or args.world > 2 else CASES_FULL
    if args.only:
        cases = [c for c in CASES_FULL if c[0] == args.only]
    # no torch work in this process before the forks below: a forked child of a process whose
    # OpenMP pool is running can deadlock in its first parallel torch op
    print(f"# c10d benchmark: {machine_line()} | world {args.world}" + (" | busy host" if args.busy else ""))
    samples: dict[tuple[str, str], list[float]] = {}
    with busy_host(args.busy):
        _rounds(args, cases, samples)
    rows = []
    for op, nbytes in cases:
        key = f"{op}:{nbytes}"
        g = median(samples[("gloo", key)])
        o = median(samples[("tdist", key)])
        if nbytes <= 4096:
            rows.append([op, human(nbytes), f"{g * 1e6:.0f} us", f"{o * 1e6:.0f} us", f"{g / o:.2f}x"])
        else:
            rows.append([
                op, human(nbytes),
                f"{g * 1e3:.1f} ms ({busbw(op, nbytes, args.world, g):.2f} GB/s)",
                f"{o * 1e3:.1f} ms ({busbw(op, nbytes, args.world, o):.2f} GB/s)",
                f"{g / o:.2f}x",
            ])
    print()
    print(table(["operation", "size", "gloo", "tdist", "speed-up"], rows))
    print(f"\nspeed-up = gloo time / tdist time; median of {args.rounds} rounds; float32; {args.world} processes")
    print(f"memcpy on this machine: {memcpy_gbps():.1f} GB/s")


def _rounds(args: argparse.Namespace, cases: list[tuple[str, int]], samples: dict[tuple[str, str], list[float]]) -> None:
    for r in range(args.rounds):
        order = ("gloo", "tdist") if r % 2 == 0 else ("tdist", "gloo")
        for impl in order:
            before_fork()
            res = run_processes(bench_rank, args.world, impl, free_port(), cases, timeout=600)[0]
            for key, value in res.items():
                samples.setdefault((impl, key), []).append(value)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)


if __name__ == "__main__":
    main()
