"""One rank of a multi-host job (run inside a namespace by test_netns.py); prints JSON."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import tdist as dist
from tdist.c10d._api import _default_group
from tests._sync import when_inside


def forming_without_a_dead_rank(case: str) -> None:
    """The last rank dies after publishing its address, before it connects. The others print
    how long they took to fail."""
    from datetime import timedelta

    import tdist.transport._endpoint as endpoint

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == world - 1:
        endpoint.Endpoint._connect_mesh = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        error = None
    except dist.DistError as exc:
        error = str(exc)
    print(json.dumps({"rank": rank, "error": error, "elapsed": time.monotonic() - t0}), flush=True)
    time.sleep(0.5)  # (rank 0's store serves the others' last requests)


def main() -> None:
    case = sys.argv[1]
    if case.startswith("dies"):
        forming_without_a_dead_rank(case)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = _default_group()._get_backend()
    ep = backend.endpoint  # type: ignore[attr-defined]
    out: dict[str, object] = {
        "rank": rank,
        "same_host": [ep.same_host(p) for p in range(world) if p != rank],
        "paths": sorted({p.addr.split(":")[0] if p.addr != "unix" else "unix" for p in ep._peers.values()}),
    }
    if case == "collectives":
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        out["sum"] = t[0].item()
        big = torch.full((3 << 20,), float(rank))
        dist.all_reduce(big, op=dist.ReduceOp.MAX)
        out["max"] = big[-1].item()
        b = torch.arange(10.0) if rank == world - 1 else torch.zeros(10)
        dist.broadcast(b, src=world - 1)
        out["bcast"] = b.sum().item()
        outs = [torch.empty(2) for _ in range(world)]
        dist.all_gather(outs, torch.full((2,), float(rank)))
        out["gather"] = [o[0].item() for o in outs]
        if world >= 2:
            payload = torch.arange(float(1 << 20))
            if rank == 0:
                dist.send(payload, world - 1)
            elif rank == world - 1:
                got = torch.empty(1 << 20)
                dist.recv(got, 0)
                out["p2p_ok"] = bool(torch.equal(got, payload))
        dist.barrier()
    elif case == "kill":
        dist.barrier()
        if rank == 1:
            print(json.dumps({"victim": os.getpid()}), flush=True)
            time.sleep(60)
        # (the test kills rank 1 once both are inside the all_reduce: a watcher of the stack says so)
        when_inside("allreduce", lambda: print(json.dumps({"inside": rank}), flush=True), "_tcp_backend.py")
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(100))
            out["error"] = None
        except dist.DistError as exc:
            out["error"] = str(exc)
            out["elapsed"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
        os._exit(0)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
