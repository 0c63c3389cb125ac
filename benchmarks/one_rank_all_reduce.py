"""The Python path of one collective: a 1-rank group's ``all_reduce`` of one element, the best
of 60 batches of 500 calls, in microseconds per call. Run it for two trees alternately (by
``PYTHONPATH``) to see what a change costs on every operation.

Run: PYTHONPATH=src .venv/bin/python benchmarks/one_rank_all_reduce.py
"""

from __future__ import annotations

import os
import socket
import time

import torch

import tdist as dist


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1)
    best = float("inf")
    for _ in range(60):
        start = time.perf_counter()
        for _ in range(500):
            dist.all_reduce(t)
        best = min(best, (time.perf_counter() - start) / 500)
    print(f"{best * 1e6:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
