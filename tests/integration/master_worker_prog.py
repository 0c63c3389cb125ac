"""The programs of ``test_master_worker.py``: ``python master_worker_prog.py SCENARIO RANK PORT``.

Every rank runs this file; rank 0 (the master) prints ``RESULT <json>`` and the workers serve
it inside ``init_master_worker``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch

import tdist
import tdist.master_worker as mw

torch.set_num_threads(1)


def scaled(t: torch.Tensor, k: float) -> torch.Tensor:
    """Run on a worker by ``mw.run`` (found there as ``__main__.scaled``)."""
    return t * k


def stats(t: torch.Tensor) -> dict[str, Any]:
    return {"sum": t.sum(), "n": t.numel(), "where": os.getpid()}


def _error(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "text": "\n".join([str(exc), *getattr(exc, "__notes__", [])])}
    return {"type": None}


def basic() -> dict[str, Any]:
    out: dict[str, Any] = {"workers": mw.workers()}
    pids = {r: mw.run(os.getpid, worker=r) for r in mw.workers()}
    out["pids_distinct"] = len(set(pids.values())) == 2 and os.getpid() not in pids.values()

    a = mw.remote_tensor(torch.arange, 6.0, worker=1)
    b = mw.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], worker="worker2")
    out["a_where"], out["b_where"] = a.worker, b.worker_rank
    same = a.add_(1)  # in place: the same handle back
    out["inplace_same_handle"] = same is a
    out["a"] = a.fetch().tolist()
    out["a_shape"] = list(a.shape)
    out["a_dtype"] = str(a.dtype)
    out["a_sum"] = a.sum().item()  # a 0-dim tensor stays remote; item() brings the number
    out["a_sum_is_remote"] = isinstance(a.sum(), mw.RemoteTensor)
    m = a.view(2, 3)  # a view: shares the worker's storage
    m.mul_(2)
    out["a_after_view_mul"] = a.to_here().tolist()
    out["m_row"] = m[1].fetch().tolist()
    out["ops"] = ((m + 1) * 2 - m).fetch().tolist()
    c = torch.matmul(m, b)  # m on worker1, b on worker2: runs on worker1
    out["matmul"] = c.fetch().tolist()
    out["matmul_where"] = c.worker
    out["matmul_operator"] = (m @ b).fetch().tolist()
    out["functional_relu"] = torch.nn.functional.relu(m - 6).fetch().tolist()
    mx = torch.max(m, dim=1)  # torch.return_types.max: both tensors stay remote
    out["max"] = [mx.values.fetch().tolist(), mx.indices.fetch().tolist(), type(mx).__name__]
    out["run_scaled"] = mw.run(scaled, b, 0.5).fetch().tolist()
    st = mw.run(stats, b)
    out["run_stats"] = [st["sum"].fetch().item(), st["n"], st["where"] == pids[2]]
    out["len_and_float"] = [len(b), float(b.sum())]
    out["remote_error"] = _error(lambda: torch.matmul(b, b))  # (3x2 @ 3x2: torch's error, its type)
    out["no_worker"] = _error(lambda: mw.run(torch.ones, 2))
    out["master_rank"] = _error(lambda: mw.remote_tensor(torch.ones, 2, worker=0))

    # sharded over the workers, collectives among them
    shards = mw.spread(torch.arange(8.0))
    out["spread_where"] = [s.worker for s in shards]
    mw.all_reduce(shards)
    out["all_reduce_sum"] = [s.fetch().tolist() for s in shards]
    mw.all_reduce(shards, op=tdist.reduce_op.MAX)  # torch 0.3's spelling
    out["all_reduce_max"] = [s.fetch().tolist() for s in shards]
    ones = mw.on_each_worker(torch.ones, 3)
    for i, h in enumerate(ones):
        h.mul_(i + 2)  # 2 on worker1, 3 on worker2
    mw.all_reduce(ones, op=tdist.ReduceOp.PRODUCT)
    out["all_reduce_product"] = mw.gather(ones).tolist()
    mw.broadcast(ones, src=ones[1])
    ones[1].fill_(7)
    out["broadcast"] = [h.fetch().tolist() for h in ones]
    mw.reduce(ones, dst=ones[0])
    out["reduce"] = ones[0].fetch().tolist()
    g = mw.all_gather([shards[1], shards[0]])  # in the handles' order
    out["all_gather"] = [h.fetch().tolist() for h in g]
    single = [mw.tensor([5.0], worker=2)]
    mw.all_reduce(single)  # a sub-group of one worker (made on both)
    out["subgroup"] = single[0].fetch().tolist()
    mw.barrier()
    out["two_on_one"] = _error(lambda: mw.all_reduce([a, m]))
    out["twice"] = _error(lambda: tdist.init_master_worker("tcp"))
    mw.shutdown()
    mw.shutdown()  # (again: nothing)
    return out


def kill_worker() -> dict[str, Any]:
    h = mw.remote_tensor(torch.ones, 4, worker=2)
    other = mw.remote_tensor(torch.ones, 4, worker=1)
    pid = mw.run(os.getpid, worker=2)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    out: dict[str, Any] = {"call": _error(lambda: h.sum())}
    out["call_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["fetch"] = _error(h.fetch)
    out["fetch_s"] = time.monotonic() - t0
    out["other_still_serves"] = other.sum().item()
    t0 = time.monotonic()
    out["shutdown"] = _error(mw.shutdown)
    out["shutdown_s"] = time.monotonic() - t0
    return out


def at_exit() -> dict[str, Any]:
    h = mw.remote_tensor(torch.ones, 2, worker=1)
    return {"sum": h.sum().item()}  # no shutdown: the master's exit ends the job


def master_dies() -> dict[str, Any]:
    mw.remote_tensor(torch.ones, 2, worker=1)
    print("RESULT {}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


SCENARIOS = {"basic": basic, "kill_worker": kill_worker, "at_exit": at_exit, "master_dies": master_dies}


def main() -> None:
    scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def init() -> None:
        tdist.init_master_worker(
            "tcp", f"tcp://127.0.0.1:{port}", world_size=3, rank=rank, group_name="test",
            timeout=timedelta(seconds=30),
        )

    if rank != 0:  # (a worker's warning goes to its stderr, where the test looks for it)
        init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init()
    assert rank == 0, "a worker returned from init_master_worker"
    out = SCENARIOS[scenario]()
    out["warning"] = [(w.category.__name__, str(w.message)) for w in caught]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
