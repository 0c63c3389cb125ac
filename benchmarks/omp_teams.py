"""How torch's intra-op parallelism slows down once a second thread has used it (libgomp).

Run: .venv/bin/python benchmarks/omp_teams.py [--iters 800]

One process, no other load: thread A runs a small MLP's forward (784-128-10, batch 32, the
parameter server's of ``bench_dist_autograd.py``) over and over, then thread B does the same while
A sits idle but alive, then the main thread. Each OpenMP team belongs to the thread that started
it; once libgomp manages more threads than there are CPUs (a second team does that on 2 cores),
its workers spin 1,000 times instead of 300,000 before they sleep (its documented rule), and every
parallel region pays a wake-up. An RPC server whose requests run on several threads is in that
state for good. Compare with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dist_autograd import make_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=800)
    args = parser.parse_args()
    model, x = make_server(), torch.randn(32, 1, 28, 28)
    results: dict[str, float] = {}
    stop = threading.Event()

    def run(label: str) -> None:
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            model(x)
            times.append((time.perf_counter() - t0) * 1e6)
        results[label] = statistics.median(times[args.iters // 8:])

    def thread(label: str, done: threading.Event) -> None:
        run(label)
        done.set()
        stop.wait()  # (idle but alive: its team stays)

    threads = []
    for label in ("thread A (the first to use it)", "thread B (A idle)"):
        done = threading.Event()
        t = threading.Thread(target=thread, args=(label, done), daemon=True)
        t.start()
        done.wait()
        threads.append(t)
    run("main thread (A and B idle)")
    stop.set()
    for t in threads:
        t.join()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    for label, us in results.items():
        print(f"  {label:34s} forward median {us:6.0f} us")


if __name__ == "__main__":
    main()
