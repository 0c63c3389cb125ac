"""Forming the default group side by side: ``tdist.init_process_group`` against torch's (gloo).

Run: .venv/bin/python benchmarks/bench_init.py [--rounds 7] [--world 2] [--busy]

Each round starts ``--world`` fresh processes per library, the libraries alternating. A process
imports torch and its library (``import torch.distributed as dist`` / ``import tdist as dist``),
says it is ready, and waits; when every one is ready the benchmark tells them all to go at once,
and each times ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", ...)``
(rank 0 hosts the store, as it does without a launcher), then its first 4-byte all_reduce, then
``destroy_process_group``. The figure of a round is the slowest rank's (the group is usable
when every rank has it); the table shows medians over rounds.

Each child runs ``gc.collect()`` after its imports, before it says it is ready. Importing torch
leaves its first full collection due (60-150 ms on this host: it walks every object torch made);
without the collect it lands in whichever call first allocates Python objects past the
threshold, which is tdist's init (Python) and gloo's first Python work after its init (C++). It
is the import's cost, paid the same by both wherever it lands, and left in it swamps the figure.

``--busy``: one low-priority busy loop per core runs meanwhile, as a training job's other work
would leave the host (see ``_common.busy_host``).

``--store``: the other common form instead: each rank makes the store itself,
``dist.TCPStore("127.0.0.1", PORT, world, is_master=rank == 0)``, and passes it
(``init_process_group("gloo", store=store, rank=..., world_size=...)``); the time counts both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import busy_host, free_port, machine_line, median, table

CHILD = """\
import sys, time
impl, rank, world, port, form = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
import torch
if impl == "gloo":
    import torch.distributed as dist
else:
    import tdist as dist
import gc
gc.collect()  # (the imports' debt: see the module's docstring)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
if form == "store":
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
else:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
t1 = time.perf_counter()
x = torch.ones(1)
dist.all_reduce(x)
assert x.item() == world
t2 = time.perf_counter()
dist.destroy_process_group()
t3 = time.perf_counter()
print(f"{t1 - t0} {t2 - t0} {t3 - t2}", flush=True)
"""

IMPLS = ("gloo", "tdist")


def one_run(impl: str, world: int, form: str = "url") -> tuple[float, float, float]:
    """(init, init + first all_reduce, destroy) in seconds, the slowest rank's each."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TDIST_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, impl, str(r), str(world), str(port), form],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:  # (go: every rank at once)
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [p.communicate(timeout=120)[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{impl}: a rank failed (exit codes {[p.returncode for p in procs]})")
    vals = [[float(v) for v in line] for line in lines]
    return max(v[0] for v in vals), max(v[1] for v in vals), max(v[2] for v in vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--store", action="store_true", help="each rank makes a TCPStore and passes it (not init_method)")
    args = ap.parse_args()
    print(machine_line())
    samples: dict[str, list[tuple[float, float, float]]] = {impl: [] for impl in IMPLS}
    with busy_host(args.busy):
        for r in range(args.rounds):
            for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                samples[impl].append(one_run(impl, args.world, "store" if args.store else "url"))
    rows = []
    for i, what in enumerate(("init_process_group", "... + first all_reduce", "destroy_process_group")):
        g = median([s[i] for s in samples["gloo"]]) * 1e3
        t = median([s[i] for s in samples["tdist"]]) * 1e3
        rows.append([what, args.world, g, t, f"{g / t:.2f}x"])
    host = "busy host" if args.busy else "idle host"
    form = "TCPStore passed as store=" if args.store else "init_method tcp://"
    print(f"\n{args.world} ranks, {host}, {form}, medians of {args.rounds} rounds (ms, lower is better)\n")
    print(table(["step", "ranks", "gloo ms", "tdist ms", "speed-up"], rows))
    for impl in IMPLS:
        print(f"  {impl} per round (init, destroy ms): " + ", ".join(f"{s[0] * 1e3:.1f}/{s[2] * 1e3:.1f}" for s in samples[impl]))


if __name__ == "__main__":
    main()
