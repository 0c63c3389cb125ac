"""One rank of an MPI job (started by mpiexec in tests/mpi/test_mpi_backend.py): runs a case
and writes its results as JSON to ``$MPI_TEST_OUT/<rank>.json``."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch

import tdist as dist


def _connects(addr: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((addr, port), timeout=2).close()
        return True
    except OSError:
        return False


def _ops() -> dict[str, Any]:
    dist.init_process_group("mpi")
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": r, "size": n, "backend": dist.get_backend(), "avail": dist.is_mpi_available()}
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            t = (torch.arange(5) % 3 + r + 1).to(dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce/{dtype}/{op}"] = t.tolist()
    t = torch.ones(4) * (r + 1)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["avg"] = t.tolist()
    b = torch.ones(6, dtype=torch.int32) * (r + 1)
    dist.all_reduce(b, op=dist.ReduceOp.BXOR)
    out["bxor"] = b.tolist()
    nc = torch.ones(4, 6)[:, ::2] * (r + 1)  # (non-contiguous: one staging copy)
    dist.all_reduce(nc)
    out["noncontig"] = nc.tolist()
    ex = torch.full((1,), r + 1.0).expand(3)  # (elements sharing memory: written back once each)
    dist.all_reduce(ex)
    exb = torch.full((1, 1), r + 5.0).expand(2, 2)
    dist.broadcast(exb, src=2)
    out["expanded"] = [ex.tolist(), exb.tolist()]
    bf = torch.arange(4, dtype=torch.bfloat16) * 1.5 if r == 1 else torch.zeros(4, dtype=torch.bfloat16)
    dist.broadcast(bf, src=1)  # (bytes: any dtype)
    out["bcast_bf16"] = bf.float().tolist()
    red = torch.ones(3) * (r + 1)
    dist.reduce(red, dst=0)
    if r == 0:
        out["reduce"] = red.tolist()
    outs = [torch.zeros(k + 1, dtype=torch.float16) for k in range(n)]
    dist.all_gather(outs, torch.ones(r + 1, dtype=torch.float16) * r)  # (uneven)
    out["all_gather"] = [o.tolist() for o in outs]
    # the job's store: on the loopback alone (one host), and it asks for the job's secret,
    # which came over MPI (the same on every rank)
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    out["secret"] = os.environ.get("TDIST_SECRET", "")
    if r == 0:
        import socket

        names = {a for a in socket.gethostbyname_ex(socket.gethostname())[2] if not a.startswith("127.")}
        out["reachable_elsewhere"] = any(_connects(a, store.port) for a in names)
        os.environ.pop("TDIST_SECRET")
        try:
            dist.TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=5))
            out["open"] = True
        except Exception as exc:
            out["open"] = f"{type(exc).__name__}: {exc}"
        os.environ["TDIST_SECRET"] = out["secret"]
    ag = torch.empty(2 * n)
    dist.all_gather_into_tensor(ag, torch.tensor([r, r + 0.5]))
    out["all_gather_into_tensor"] = ag.tolist()
    gl = [torch.zeros(2) for _ in range(n)] if r == 0 else None
    dist.gather(torch.ones(2) * r, gl, dst=0)
    if r == 0:
        out["gather"] = [g.tolist() for g in gl or []]
    sc = torch.zeros(2)
    dist.scatter(sc, [torch.ones(2) * k for k in range(n)] if r == 1 else None, src=1)
    out["scatter"] = sc.tolist()
    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.ones(2) * (k + r) for k in range(n)])
    out["reduce_scatter"] = rs.tolist()
    rsu = torch.zeros(r + 1)  # (uneven: input_list[k] has rank k's size)
    dist.reduce_scatter(rsu, [torch.arange(k + 1.0) + r for k in range(n)])
    out["reduce_scatter_uneven"] = rsu.tolist()
    rst = torch.zeros(2)
    dist.reduce_scatter_tensor(rst, torch.arange(2.0 * n))
    out["reduce_scatter_tensor"] = rst.tolist()
    a2a_in = [torch.ones(k + 1) * (10 * r + k) for k in range(n)]  # (uneven: rank k gets k+1 values)
    a2a_out = [torch.zeros(r + 1) for _ in range(n)]
    dist.all_to_all(a2a_out, a2a_in)
    out["all_to_all"] = [o.tolist() for o in a2a_out]
    single_in = torch.arange(float(n)) + 100 * r
    single_out = torch.zeros(n)
    dist.all_to_all_single(single_out, single_in)
    out["all_to_all_single"] = single_out.tolist()
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"rank": r, "word": "x" * r})
    out["objects"] = objs
    bl: list[Any] = [{"from": 0}] if r == 0 else [None]
    dist.broadcast_object_list(bl, src=0)
    out["broadcast_object"] = bl[0]
    if r == 0:
        dist.send(torch.tensor([5.0, 6.0]), 1, tag=3)
        dist.send(torch.arange(3, dtype=torch.int64), 2)
    elif r == 1:
        x = torch.zeros(2)
        out["recv_any"] = [dist.recv(x, tag=3), x.tolist()]
    elif r == 2:
        y = torch.zeros(3, dtype=torch.int64)
        dist.recv(y, 0)
        out["recv"] = y.tolist()
    w = dist.all_reduce(torch.ones(2), async_op=True)
    assert w is not None
    w.wait()
    out["async"] = [w.is_completed(), w.is_success()]
    sub = dist.new_group([0, 2])
    if r != 1:
        s = torch.ones(1) * r
        dist.all_reduce(s, group=sub)
        out["sub"] = [s.item(), dist.get_rank(sub), dist.get_world_size(sub)]
    # forms that chain a work of theirs to the MPI one (done through its callback)
    mg = [torch.ones(2) * r, torch.ones(2)]
    dist.all_reduce_multigpu(mg)
    co = [torch.ones(1) * r, torch.ones(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(co)
    wr = dist.all_reduce(torch.ones(1), async_op=True)
    assert wr is not None
    out["chained"] = [mg[1].tolist(), [c.tolist() for c in co], wr.get_future_result().wait()]
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.bfloat16))
    except Exception as exc:
        out["bf16_error"] = [type(exc).__name__, isinstance(exc, RuntimeError), str(exc)]
    dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=20))
    dist.destroy_process_group()
    return out


def _stuck() -> dict[str, Any]:
    dist.init_process_group("mpi", timeout=timedelta(seconds=3))
    r = dist.get_rank()
    out: dict[str, Any] = {"rank": r}
    dist.all_reduce(torch.ones(1))
    if r == 2:
        out["skipped"] = True
        _write(out)
        # stands apart while the others time out, until they have written their results (its
        # leaving ends the job: mpiexec would kill a rank still diagnosing)
        others = [os.path.join(os.environ["MPI_TEST_OUT"], f"{q}.json") for q in (0, 1)]
        wait_until = time.monotonic() + 60
        while time.monotonic() < wait_until and not all(map(os.path.exists, others)):
            time.sleep(0.01)
        os._exit(0)
    else:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as exc:
            out["error"] = [type(exc).__name__, str(exc), round(time.monotonic() - t0, 1)]
    return out


def _late() -> dict[str, Any]:
    """Ranks 0 and 1 wait in an all_reduce for rank 2, busy in code of its own until both have
    warned (``TDIST_FR_CHECK_AFTER=0.1``: the warning comes after 1.5 s)."""
    import logging

    out_dir = os.environ["MPI_TEST_OUT"]
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING and "has waited" in record.getMessage():
                said.append(record.getMessage())
                with open(os.path.join(out_dir, f"warned{dist.get_rank()}"), "w"):
                    pass

    logging.getLogger("tdist.c10d").addHandler(Catch())
    dist.init_process_group("mpi", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    dist.barrier()
    if r == 2:
        until = time.monotonic() + 30
        while time.monotonic() < until and not all(os.path.exists(os.path.join(out_dir, f"warned{q}")) for q in (0, 1)):
            time.sleep(0.01)
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"rank": r, "sum": t.tolist(), "said": said[:1]}


def _split() -> dict[str, Any]:
    """``split_group`` on the mpi backend: each split's members make its communicator alone."""
    dist.init_process_group("mpi")
    r = dist.get_rank()
    g = dist.split_group(split_ranks=[[0, 2], [1]])
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=g)
    out = {"rank": r, "ranks": dist.get_process_group_ranks(g), "sum": t.item()}
    dist.destroy_process_group()
    return out


def _destroyed() -> dict[str, Any]:
    """Rank 1 destroys its group where rank 0 calls an all_reduce: the destroy's own wait for
    the other ranks must not be taken for rank 0's collective."""
    dist.init_process_group("mpi", timeout=timedelta(seconds=4))
    r = dist.get_rank()
    out: dict[str, Any] = {"rank": r}
    if r == 0:
        t = torch.full((4,), 7.0)
        try:
            dist.all_reduce(t)
            out["error"] = None
            out["result"] = t.tolist()
        except Exception as exc:
            out["error"] = [type(exc).__name__, str(exc)]
    dist.destroy_process_group()
    return out


def _dies() -> dict[str, Any]:
    dist.init_process_group("mpi", timeout=timedelta(seconds=4))
    r = dist.get_rank()
    dist.all_reduce(torch.ones(1))
    if r == 1:
        os._exit(3)  # (dies between two collectives)
    out: dict[str, Any] = {"rank": r}
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        out["error"] = None
    except Exception as exc:
        out["error"] = [type(exc).__name__, str(exc), round(time.monotonic() - t0, 1)]
    return out


def _hosts() -> dict[str, Any]:
    """Ranks on separate hosts (network namespaces): the collectives, and where each rank is."""
    import faulthandler

    faulthandler.dump_traceback_later(50, exit=True)
    from tdist.transport._link import host_id

    def sent() -> int:  # (bytes out of this namespace's interfaces but loopback: /proc/net/dev)
        total = 0
        with open("/proc/net/dev") as f:
            for line in f.read().splitlines()[2:]:
                name, fields = line.split(":", 1)
                if name.strip() != "lo":
                    total += int(fields.split()[8])
        return total

    dist.init_process_group("mpi")
    r, n = dist.get_rank(), dist.get_world_size()
    big = torch.arange(1 << 20, dtype=torch.float32) * (r + 1)
    before = sent()
    dist.all_reduce(big)
    wire = sent() - before
    small = torch.ones(1) * (r + 1)
    dist.all_reduce(small)
    names: list[Any] = [None] * n
    dist.all_gather_object(names, host_id())
    dist.destroy_process_group()
    want = torch.arange(1 << 20, dtype=torch.float32) * sum(range(1, n + 1))
    return {"rank": r, "big_ok": bool(torch.equal(big, want)), "small": small.item(), "hosts": names, "wire": wire}


def _rpc_beside() -> dict[str, Any]:
    from tdist import rpc

    dist.init_process_group("mpi")
    r, n = dist.get_rank(), dist.get_world_size()
    rpc.init_rpc(f"worker{r}", rank=r, world_size=n)
    got = rpc.rpc_sync(f"worker{(r + 1) % n}", torch.add, args=(torch.ones(2), r))
    t = torch.ones(1)
    dist.all_reduce(t)
    rpc.shutdown()
    dist.destroy_process_group()
    return {"rank": r, "rpc": got.tolist(), "all_reduce": t.item()}


def _args_checked() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # rank and world size given that MPI contradicts: ignored with a warning, as torch's MPI
    # backend ignores them; MASTER_ADDR alone (the test sets no MASTER_PORT) asks for no
    # rendezvous: torch's MPI backend reads neither, and the group's store is served at that
    # address
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("mpi", rank=7, world_size=9)
    out["warnings"] = [str(w.message) for w in caught]
    out["rank"] = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    dist.destroy_process_group()
    return out


def _alone() -> dict[str, Any]:
    """Started without mpiexec, where the job says 2 processes: refused, MPI finalized at once
    (MPICH's lone process keeps a shared-memory file of its pid until then)."""
    from mpi4py import MPI

    try:
        dist.init_process_group("mpi")
    except RuntimeError as exc:
        segment = f"/dev/shm/mpich_shm_{os.getpid():x}_0"
        return {"error": str(exc), "finalized": MPI.Is_finalized(), "segment_left": os.path.exists(segment)}
    return {"error": None, "world_size": dist.get_world_size()}


def _write(result: dict[str, Any]) -> None:
    path = os.path.join(os.environ["MPI_TEST_OUT"], f"{os.environ['PMI_RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    case = sys.argv[1]
    result = {"ops": _ops, "stuck": _stuck, "dies": _dies, "destroyed": _destroyed, "split": _split, "hosts": _hosts, "rpc": _rpc_beside, "args": _args_checked, "alone": _alone, "late": _late}[case]()
    _write(result)
    if case in ("stuck", "dies"):
        # the survivors leave together: mpiexec ends the job's processes once one has left (a
        # rank still writing its result would be killed), and they finish their diagnosis at
        # different moments
        survivors = ("0", "1", "2") if case == "stuck" else ("0", "2")
        wait_until = time.monotonic() + 20
        while time.monotonic() < wait_until and not all(
            os.path.exists(os.path.join(os.environ["MPI_TEST_OUT"], f"{r}.json")) for r in survivors
        ):
            time.sleep(0.01)
        os._exit(0)  # (MPI's finalize would wait for the all-reduce rank 2 never joined)
