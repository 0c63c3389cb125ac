"""The shared-memory arena side by side with torch's gloo: 2 processes on this host, float32.

Run: .venv/bin/python benchmarks/bench_shm_arena.py [--rounds 5] [--world-size 2]

Every figure is a median: within a round, of ``reps`` timed calls (each after a barrier for
the large sizes); across rounds, of the round figures. The two implementations alternate inside
each round (gloo first in even rounds, the arena first in odd ones), in the same two processes,
so that both see the same machine. Sizes are bytes per rank: the tensor of ``all_reduce`` and
``broadcast``; the *output* of ``all_gather`` (as nccl-tests count it: each rank contributes
size / world_size). "ratio" is gloo's time over the arena's (> 1: the arena is faster).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as tdc

from _common import busy_for_the_run, machine_line, median, memcpy_gbps, table
from tdist.c10d._shm import ShmArena
from tdist.store import TCPStore
from tdist.testing import free_port

KiB, MiB = 1 << 10, 1 << 20
CASES: list[tuple[str, int, int]] = [  # (collective, bytes, timed calls per round)
    ("all_reduce", 4, 400),
    ("all_reduce", 1 * MiB, 30),
    ("all_reduce", 64 * MiB, 5),
    ("all_reduce", 256 * MiB, 3),
    ("broadcast", 64 * MiB, 5),
    ("all_gather", 64 * MiB, 5),
]


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else (f"{n // KiB} KiB" if n >= KiB else f"{n} B")


def rank_main(rank: int, ws: int, gloo_port: int, store_port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gloo_port))
    tdc.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=120))
    store = TCPStore("127.0.0.1", store_port, timeout=timedelta(seconds=60))
    kw: dict[str, Any] = {}
    if args.frame_bytes:
        kw["frame_bytes"] = args.frame_bytes
    if args.frames:
        kw["frames"] = args.frames
    arena = ShmArena(store, rank, ws, name="bench", timeout=120, **kw)

    def ops(impl: str) -> dict[str, Callable[..., None]]:
        if impl == "gloo":
            return {
                "all_reduce": lambda t: tdc.all_reduce(t),
                "broadcast": lambda t: tdc.broadcast(t, 0),
                "all_gather": lambda outs, t: tdc.all_gather(outs, t),
                "barrier": lambda: tdc.barrier(),
            }
        return {
            "all_reduce": lambda t: arena.all_reduce(t),
            "broadcast": lambda t: arena.broadcast(t, 0),
            "all_gather": lambda outs, t: arena.all_gather(outs, t),
            "barrier": lambda: arena.barrier(),
        }

    results: dict[tuple[str, int, str], list[float]] = {}
    cases = [c for c in CASES if not args.only or any(s in f"{c[0]} {fmt_size(c[1])}" for s in args.only)]
    for name, nbytes, reps in cases:
        numel = max(1, nbytes // 4)
        if name == "all_gather":
            t = torch.ones(numel // ws)
            outs = [torch.empty(numel // ws) for _ in range(ws)]
            call_args: tuple[Any, ...] = (outs, t)
        else:
            call_args = (torch.ones(numel),)
        for rnd in range(args.rounds):
            order = ("gloo", "tdist") if rnd % 2 == 0 else ("tdist", "gloo")
            for impl in order:
                o = ops(impl)
                fn = o[name]
                fn(*call_args)  # warm: connections, pages, caches
                times = []
                if nbytes < MiB:
                    # latency: back-to-back calls, as a training loop issues them
                    o["barrier"]()
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        fn(*call_args)
                        times.append(time.perf_counter() - t0)
                else:
                    for _ in range(reps):
                        o["barrier"]()
                        t0 = time.perf_counter()
                        fn(*call_args)
                        times.append(time.perf_counter() - t0)
                results.setdefault((name, nbytes, impl), []).append(median(times))
    arena.close()
    tdc.destroy_process_group()
    out.put((rank, results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--frame-bytes", type=int, default=0, help="arena frame size (default: its own)")
    parser.add_argument("--frames", type=int, default=0, help="frames per ring (default: its own)")
    parser.add_argument("--only", nargs="*", default=[], help='cases to run, e.g. "all_reduce 64 MiB"')
    parser.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = parser.parse_args()
    busy_for_the_run(args.busy)
    ws = args.world_size

    print(machine_line())
    print(f"memcpy: {memcpy_gbps():.1f} GB/s (torch copy_, 64 MiB, pre-faulted); torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads per process")
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gloo_port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, ws, gloo_port, master.port, args, out)) for r in range(ws)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=900) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        master.close()

    res = results[0]
    rows = []
    for name, nbytes, _reps in CASES:
        if (name, nbytes, "gloo") not in res:
            continue
        g = median(res[(name, nbytes, "gloo")])
        t = median(res[(name, nbytes, "tdist")])
        unit = 1e6 if nbytes < MiB else 1e3
        rows.append([
            name, fmt_size(nbytes), f"{g * unit:.1f} {'us' if unit == 1e6 else 'ms'}",
            f"{t * unit:.1f} {'us' if unit == 1e6 else 'ms'}", f"{nbytes / t / 1e9:.2f}", f"{g / t:.2f}x",
        ])
    print(f"{ws} processes, float32, median of {args.rounds} rounds (rank 0's clock)")
    print(table(["collective", "size", "gloo", "tdist shm", "tdist GB/s", "ratio"], rows))


if __name__ == "__main__":
    main()
