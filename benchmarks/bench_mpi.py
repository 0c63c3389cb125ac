"""The mpi backend side by side: tdist's ``mpi`` backend against raw mpi4py on the same buffers
(the cost of tdist's layer), and against tdist's ``tcp`` backend and torch's gloo on this host.

Run: .venv/bin/python benchmarks/bench_mpi.py [--rounds 5] [--world 2] [--busy] [--netns]

``--netns`` (root): the two ranks on two hosts (network namespaces joined by a bridge, as
``bench_multihost.py``), MPI over TCP (MPICH, UCX and libfabric kept off shared memory).

It starts one job under mpiexec; inside it each round times, in turn (the order alternating
between rounds): mpi4py's blocking ``Allreduce`` on the tensor's memory, tdist's
``all_reduce`` on the mpi backend, then (fresh groups each round) tdist's tcp backend and
torch's gloo. The table shows medians over rounds; bus bandwidth as nccl-tests
(2(n-1)/n of the buffer per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import busy_host, free_port, machine_line, median, table

MiB = 1 << 20
SIZES = [4, 64 * MiB]


def _reps(nbytes: int) -> int:
    return 400 if nbytes <= 4096 else 5


def _time(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def inner(rounds: int, port: int, out: str, addr: str = "127.0.0.1") -> None:
    """One rank of the mpiexec job."""
    import torch
    import torch.distributed as tdc
    from mpi4py import MPI

    import tdist

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    results: dict[str, list[float]] = {}
    for rnd in range(rounds):
        order = ["mpi4py", "tdist-mpi"] if rnd % 2 == 0 else ["tdist-mpi", "mpi4py"]
        for impl in order:
            if impl == "tdist-mpi":
                tdist.init_process_group("mpi")
            for nbytes in SIZES:
                t = torch.ones(max(1, nbytes // 4))
                if impl == "mpi4py":
                    arr = t.numpy()
                    comm.Barrier()
                    value = _time(lambda arr=arr: comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM), _reps(nbytes))
                else:
                    tdist.barrier()
                    value = _time(lambda t=t: tdist.all_reduce(t), _reps(nbytes))
                results.setdefault(f"{impl}/{nbytes}", []).append(value)
            if impl == "tdist-mpi":
                tdist.destroy_process_group()
        for k, impl in enumerate(["tcp", "gloo"] if rnd % 2 == 0 else ["gloo", "tcp"]):
            url = f"tcp://{addr}:{port + 2 * rnd + k}"
            d: Any = tdist if impl == "tcp" else tdc
            d.init_process_group("gloo", init_method=url, rank=rank, world_size=n)
            for nbytes in SIZES:
                t = torch.ones(max(1, nbytes // 4))
                d.barrier()
                results.setdefault(f"{impl}/{nbytes}", []).append(_time(lambda t=t, d=d: d.all_reduce(t), _reps(nbytes)))
            d.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--netns", action="store_true", help="each rank on a host of its own (network namespaces; root)")
    ap.add_argument("--inner", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(int(args.inner[0]), int(args.inner[1]), args.inner[2], args.inner[3])
        return
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        out = os.path.join(tmp, "result.json")
        port = str(free_port())
        env = dict(os.environ)
        if args.netns:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.multihost import _netns

            hosts = stack.enter_context(_netns.hosts(args.world))
            env.update(MPIR_CVAR_NOLOCAL="1", UCX_TLS="tcp,self", FI_PROVIDER="tcp")
            cmd = [mpiexec]
            for i, h in enumerate(hosts):
                cmd += [":"] if i else []
                cmd += ["-n", "1", "-env", "GLOO_SOCKET_IFNAME", h.ifname, *_netns.command(
                    h, [sys.executable, __file__, "--inner", str(args.rounds), port, out, hosts[0].addr])]
        else:
            cmd = [mpiexec, "-n", str(args.world), sys.executable, __file__, "--inner", str(args.rounds), port, out,
                   "127.0.0.1"]
        stack.enter_context(busy_host(args.busy))
        subprocess.run(cmd, check=True, timeout=1800, env=env)
        res: dict[str, list[float]] = json.loads(Path(out).read_text())
    n = args.world
    rows = []
    for nbytes in SIZES:
        med = {impl: median(res[f"{impl}/{nbytes}"]) for impl in ("mpi4py", "tdist-mpi", "tcp", "gloo")}

        def cell(impl: str, med: dict[str, float] = med, nbytes: int = nbytes) -> str:
            t = med[impl]
            if nbytes < MiB:
                return f"{t * 1e6:.1f} us"
            return f"{t * 1e3:.1f} ms ({2 * (n - 1) / n * nbytes / t / 1e9:.2f} GB/s)"

        size = "4 B" if nbytes < 1024 else f"{nbytes // MiB} MiB"
        rows.append([
            size, cell("mpi4py"), cell("tdist-mpi"), f"{med['mpi4py'] / med['tdist-mpi']:.2f}x",
            f"{(med['tdist-mpi'] - med['mpi4py']) * 1e6:+.1f} us", cell("tcp"), cell("gloo"),
        ])
    print()
    print(table(
        ["all_reduce", "mpi4py", "tdist mpi", "vs mpi4py", "overhead", "tdist tcp", "gloo"], rows
    ))
    print(f"\nmedian of {args.rounds} rounds; float32; {n} processes under mpiexec (MPICH); {machine_line()}"
          + ("; busy host" if args.busy else "") + ("; one rank per network namespace, MPI over TCP" if args.netns else ""))


if __name__ == "__main__":
    main()
