"""Meet at a store: every worker sets a key, adds to a counter, waits for the others.

Run it with the launcher, which hosts the store and tells each worker where it is::

    tdist run --nproc-per-node 2 examples/store_demo.py

``tdist.rendezvous("env://")`` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which
``tdist run`` (or torchrun) sets, and returns a store shared by every worker.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import tdist as dist


def main() -> None:
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=60)))

    # every worker adds to a shared counter (atomic on the server) ...
    arrived = store.add("arrived", 1)
    print(f"rank {rank}/{world_size}: I was number {arrived} to arrive")
    # ... then announces itself under its own key (after the add, so that a worker that sees
    # every key also sees the whole count) ...
    store.set(f"hello/{rank}", f"rank {rank} on {socket.gethostname()}, pid {os.getpid()}")

    # ... and waits until everyone has done the same
    start = time.monotonic()
    store.wait([f"hello/{r}" for r in range(world_size)])
    waited_ms = (time.monotonic() - start) * 1000

    if rank == 0:
        greetings = store.multi_get([f"hello/{r}" for r in range(world_size)])
        print(f"rank 0: all {world_size} workers met (waited {waited_ms:.1f} ms):")
        for line in greetings:
            print(f"  {line.decode()}")
        print(f"rank 0: counter = {int(store.get('arrived'))}")
    # nobody leaves before rank 0 has read everything: the store goes away with the job
    store.barrier("done", world_size)


if __name__ == "__main__":
    main()
