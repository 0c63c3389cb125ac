"""What the flight recorder costs: a 2-process all_reduce loop through tdist's API, with the
recorder on (the default) and off.

By default both settings run in the same pair of processes, in alternating batches (the
group's recorder is detached for the "off" batches: what ``TDIST_FR_BUFFER_SIZE=0`` gives the
operations), so that the noise of a shared machine falls on both alike. ``--mode env`` runs
fresh pairs of processes instead, alternately with ``TDIST_FR_BUFFER_SIZE=2000`` and ``=0``
(no recorder, no responder, no watchdog at all). Each batch is ``--iters`` all_reduces; the
figure is the median over batches of each setting, and the median of the per-pair ratios.

    .venv/bin/python benchmarks/bench_flight_recorder.py                   # 4 B
    .venv/bin/python benchmarks/bench_flight_recorder.py --sizes 4,67108864
    .venv/bin/python benchmarks/bench_flight_recorder.py --mode env --runs 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import before_fork, free_port, machine_line


def _rank(rank: int, port: int, nbytes: int, iters: int, pairs: int, fr: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    if fr:
        os.environ["TDIST_FR_BUFFER_SIZE"] = fr
    import torch

    import tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    backend = tdist.group.WORLD
    backend = getattr(backend, "backend", None) or backend._get_backend()
    rec = backend.flight_recorder
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    for _ in range(min(iters, 200)):
        tdist.all_reduce(t)
    on: list[float] = []
    off: list[float] = []
    for i in range(2 * pairs):
        # on, off, off, on, ...: neither setting always goes first (--mode env: as the process is)
        recording = (i % 4) in (0, 3) if not fr else fr != "0"
        backend._fr = rec if recording else None
        tdist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            tdist.all_reduce(t)
        (on if recording else off).append((time.perf_counter() - t0) / iters * 1e6)
    backend._fr = rec
    tdist.destroy_process_group()
    if rank == 0:
        out.put((on, off))


def run_once(nbytes: int, iters: int, pairs: int, fr: str = "") -> tuple[list[float], list[float]]:
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    port = free_port()
    before_fork()
    procs = [ctx.Process(target=_rank, args=(r, port, nbytes, iters, pairs, fr, q)) for r in range(2)]
    for p in procs:
        p.start()
    on, off = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return on, off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4", help="comma-separated byte sizes (default 4)")
    ap.add_argument("--runs", type=int, default=1, help="fresh pairs of processes per size")
    ap.add_argument("--pairs", type=int, default=20, help="(on, off) batch pairs per run")
    ap.add_argument("--iters", type=int, default=0, help="ops per batch (default: by size)")
    ap.add_argument("--mode", choices=["batches", "env"], default="batches")
    args = ap.parse_args()
    print(machine_line())
    for nbytes in (int(s) for s in args.sizes.split(",")):
        iters = args.iters or (1000 if nbytes <= 65536 else max(3, (64 << 20) // max(nbytes, 1) * 3))
        on: list[float] = []
        off: list[float] = []
        for _ in range(args.runs):
            if args.mode == "env":
                on += run_once(nbytes, iters, args.pairs, "2000")[0]
                off += run_once(nbytes, iters, args.pairs, "0")[1]
            else:
                a, b = run_once(nbytes, iters, args.pairs)
                on += a
                off += b
        ratios = [x / y for x, y in zip(on, off, strict=True)]
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(
            f"all_reduce {nbytes} B, {len(on)} batches of {iters} each way: recorder on {m_on:.2f} us, "
            f"off {m_off:.2f} us ({100 * (m_on / m_off - 1):+.1f}%); median ratio of the pairs "
            f"{statistics.median(ratios):.4f} ({100 * (statistics.median(ratios) - 1):+.1f}%); best "
            f"batches {min(on):.2f} us and {min(off):.2f} us ({100 * (min(on) / min(off) - 1):+.1f}%)"
        )


if __name__ == "__main__":
    main()
