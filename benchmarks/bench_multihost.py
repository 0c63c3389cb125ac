"""Across hosts: tdist's tcp backend against gloo, and tdist's RPC against torch's TensorPipe,
over the same veth link (TCP only).

Run (as root): .venv/bin/python benchmarks/bench_multihost.py [--rounds 3] [--mib 64]

Two network namespaces joined by a bridge stand for two hosts, one rank in each; each round runs
both implementations (alternating order) on the same link and times all_reduce of --mib MiB of
float32 (median of several calls) and of 4 B, then (fresh processes) an ``rpc_sync`` round trip
of a no-op and of a 1 MiB tensor echoed (p50 of several hundred calls, rank 0 calling rank 1);
the table shows medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from tests.multihost import _netns  # noqa: E402

from _common import busy_for_the_run, machine_line, median, table  # noqa: E402

WORKER = r"""
import json, os, sys, time, torch
impl, mib, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if impl == "gloo":
    import torch.distributed as d
else:
    import tdist as d
d.init_process_group("gloo")
t = torch.ones(mib * (1 << 20) // 4)
small = torch.ones(1)
d.all_reduce(t); d.barrier()
times = []
for _ in range(reps):
    t0 = time.perf_counter(); d.all_reduce(t); times.append(time.perf_counter() - t0)
lat = []
for _ in range(200):
    t0 = time.perf_counter(); d.all_reduce(small); lat.append(time.perf_counter() - t0)
times.sort(); lat.sort()
print(json.dumps({"big": times[len(times) // 2], "small": lat[len(lat) // 2]}), flush=True)
d.destroy_process_group()
"""


RPC_WORKER = r"""
import json, os, sys, time, torch
impl = sys.argv[1]
if impl == "torch":
    import torch.distributed.rpc as rpc
else:
    import tdist.rpc as rpc
def noop():
    return None
def echo(x):
    return x
rank = int(os.environ["RANK"])
rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
out = {}
if rank == 0:
    for name, args, n in (("rpc_noop", (), 600), ("rpc_1mib", (torch.ones(1 << 18),), 150)):
        fn = echo if args else noop
        for _ in range(50):
            rpc.rpc_sync("w1", fn, args=args)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter(); rpc.rpc_sync("w1", fn, args=args); lat.append(time.perf_counter() - t0)
        lat.sort()
        out[name] = lat[len(lat) // 2]
rpc.shutdown()
print(json.dumps(out), flush=True)
"""


def run(hosts: list[_netns.Host], impl: str, mib: int, reps: int, port: int, worker: str = WORKER) -> dict[str, float]:
    procs = []
    for rank, h in enumerate(hosts):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(hosts)), MASTER_ADDR=hosts[0].addr,
                   MASTER_PORT=str(port), TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=os.pathsep.join(sys.path),
                   GLOO_SOCKET_IFNAME=h.ifname, TP_SOCKET_IFNAME=h.ifname)
        procs.append(subprocess.Popen(_netns.command(h, [sys.executable, "-c", worker, impl, str(mib), str(reps)]),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"{impl} failed: {err[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:  # (a rank left waiting for a failed peer)
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    print(f"# multi-host benchmark (2 namespaces, veth + bridge, TCP): {machine_line()}")
    samples: dict[tuple[str, str], list[float]] = {}
    with _netns.hosts(2) as hosts:
        port = 29700
        for r in range(args.rounds):
            for impl in (("gloo", "tdist") if r % 2 == 0 else ("tdist", "gloo")):
                port += 1
                res = run(hosts, impl, args.mib, args.reps, port)
                for k, v in res.items():
                    samples.setdefault((impl, k), []).append(v)
            for impl in (("torch", "tdist") if r % 2 == 0 else ("tdist", "torch")):
                port += 1
                res = run(hosts, impl, args.mib, args.reps, port, RPC_WORKER)
                for k, v in res.items():
                    samples.setdefault((impl, k), []).append(v)
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    nbytes = args.mib << 20
    g, o = median(samples[("gloo", "big")]), median(samples[("tdist", "big")])
    gs, os_ = median(samples[("gloo", "small")]), median(samples[("tdist", "small")])
    rows = [
        [f"all_reduce {args.mib} MiB", f"{g * 1e3:.1f} ms ({nbytes / g / 1e9:.2f} GB/s busbw)",
         f"{o * 1e3:.1f} ms ({nbytes / o / 1e9:.2f} GB/s busbw)", f"{g / o:.2f}x"],
        ["all_reduce 4 B", f"{gs * 1e6:.0f} us", f"{os_ * 1e6:.0f} us", f"{gs / os_:.2f}x"],
    ]
    for key, label in (("rpc_noop", "rpc_sync no-op, p50"), ("rpc_1mib", "rpc_sync 1 MiB tensor echoed, p50")):
        tp, td = median(samples[("torch", key)]), median(samples[("tdist", key)])
        rows.append([label, f"{tp * 1e6:.0f} us (TensorPipe)", f"{td * 1e6:.0f} us", f"{tp / td:.2f}x ({td / tp:.2f}x the time)"])
    print()
    print(table(["operation", "gloo / torch", "tdist", "speed-up"], rows))
    print(f"\nspeed-up = torch's time / tdist's time; median of {args.rounds} rounds; 2 ranks, one per namespace")


if __name__ == "__main__":
    main()
