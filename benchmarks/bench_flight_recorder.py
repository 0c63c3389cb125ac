"""What the flight recorder costs: a 2-process all_reduce loop through tdist's API with the
recorder on (the default) and off (``TDIST_FR_BUFFER_SIZE=0``), in alternating runs.

Each run is a fresh pair of processes (the recorder's setting is read when a group is made);
each measures ``--iters`` all_reduces after a warm-up and reports the median of ``--batches``
batch means (microseconds per op). The figure is the median over runs of each setting, and
their ratio.

    .venv/bin/python benchmarks/bench_flight_recorder.py --rounds 5
    .venv/bin/python benchmarks/bench_flight_recorder.py --sizes 4,67108864 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import before_fork, free_port, machine_line  # noqa: E402


def _rank(rank: int, port: int, nbytes: int, iters: int, batches: int, fr: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    os.environ["TDIST_FR_BUFFER_SIZE"] = fr
    import torch

    import tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    for _ in range(min(iters, 200)):
        tdist.all_reduce(t)
    means = []
    for _ in range(batches):
        tdist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            tdist.all_reduce(t)
        means.append((time.perf_counter() - t0) / iters * 1e6)
    tdist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(means))


def run_once(nbytes: int, iters: int, batches: int, fr: str) -> float:
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    port = free_port()
    before_fork()
    procs = [ctx.Process(target=_rank, args=(r, port, nbytes, iters, batches, fr, q)) for r in range(2)]
    for p in procs:
        p.start()
    value = float(q.get(timeout=600))
    for p in procs:
        p.join(60)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4", help="comma-separated byte sizes (default 4)")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each setting, alternating")
    ap.add_argument("--iters", type=int, default=0, help="ops per batch (default: by size)")
    ap.add_argument("--batches", type=int, default=7)
    args = ap.parse_args()
    print(machine_line())
    for nbytes in (int(s) for s in args.sizes.split(",")):
        iters = args.iters or (2000 if nbytes <= 4096 else max(3, (256 << 20) // max(nbytes, 1) // 4))
        on: list[float] = []
        off: list[float] = []
        for _ in range(args.rounds):
            on.append(run_once(nbytes, iters, args.batches, "2000"))
            off.append(run_once(nbytes, iters, args.batches, "0"))
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(
            f"all_reduce {nbytes} B: recorder on {m_on:.2f} us, off {m_off:.2f} us, "
            f"overhead {100 * (m_on / m_off - 1):+.1f}% (runs on {[round(x, 2) for x in on]}, "
            f"off {[round(x, 2) for x in off]})"
        )


if __name__ == "__main__":
    main()
