"""One rank of a torch 0.3-era program (test_legacy_names.py starts two): the 0.3 docs' init
methods and its gather/scatter, printed as ``RESULT <json>``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

import tdist as dist


def main() -> None:
    path = sys.argv[1]
    out: dict[str, Any] = {}
    # file:// with world_size and group_name, no rank: "Rank will be assigned automatically"
    dist.init_process_group("tcp", init_method=f"file://{path}", world_size=2, group_name="job")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out["file"] = [dist.get_rank(), dist.get_world_size(), t.item()]
    dist.destroy_process_group()
    # env://: "MASTER_ADDR - required (except for rank 0)" (the test sets it on rank 1 only)
    dist.init_process_group("tcp")
    r = dist.get_rank()
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    out["env"] = [r, "MASTER_ADDR" in os.environ, t.item()]
    # scatter from rank 1 written as 0.3 did (src left out on the source): tdist keeps torch 2's
    # rank 0 and says how 0.3 differed, on both ranks, before any message is sent
    try:
        if r == 1:
            dist.scatter(torch.zeros(1), scatter_list=[torch.zeros(1), torch.ones(1)])
        else:
            dist.scatter(torch.zeros(1), src=None)
    except ValueError as exc:
        out["scatter"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
