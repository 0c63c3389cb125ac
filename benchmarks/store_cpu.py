"""What one store request costs in CPU, torch's TCPStore against tdist's: one client, in a forked
process, makes ``--ops`` requests of one kind back to back; the client's user and system CPU
(``getrusage``) and the server's CPU (``/proc``: torch's server is a thread of the master's
process, which does nothing else meanwhile; tdist's is a process of its own) are divided by the
request count. Where a host's cores are all busy (a training job), what a request costs in CPU
is what the job loses to it; and with many clients, the CPU is the throughput.

``--no-spin`` sets ``TDIST_SPIN_US=0`` for tdist's side: every wait sleeps in the kernel, as a
waiter whose answers come late does once it has learnt so (``_core.spin``), and as torch's
always does. The default measures tdist as it runs. ``--busy``: one low-priority busy loop per
core meanwhile (``_common.busy_host``).

Run: .venv/bin/python benchmarks/store_cpu.py [--rounds 5] [--ops 10000] [--only add,get] [--no-spin] [--busy]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import busy_host, machine_line, median, table

OPS = ("add", "get", "check", "set")


def _cpu_of(pid: int) -> float:
    """CPU seconds (user and system) of the process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(impl: str, op: str, ops: int) -> tuple[float, float, float]:
    """(client user, client system, server) CPU microseconds per request: run in a fresh
    process (``child``)."""
    if impl == "torch":
        import torch.distributed as lib
    else:
        import tdist as lib  # type: ignore[no-redef]
    master = lib.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    server = os.getpid() if impl == "torch" else master._server.pid  # type: ignore[attr-defined]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the client
        try:
            c = lib.TCPStore("127.0.0.1", master.port, 2, False, timedelta(seconds=60))
            c.set("k", "v")
            for _ in range(500):  # (warm: connections, buffers, a spinner's first lessons)
                c.add("a", 1)
            s0, u0 = _cpu_of(server), resource.getrusage(resource.RUSAGE_SELF)
            call = {"add": lambda: c.add("a", 1), "get": lambda: c.get("k"), "check": lambda: c.check(["k"]),
                    "set": lambda: c.set("k", "v")}[op]
            for _ in range(ops):
                call()
            if op == "set":
                c.get("k")  # (a set wants no answer: the last one is in once this is answered)
            u1, s1 = resource.getrusage(resource.RUSAGE_SELF), _cpu_of(server)
            per = 1e6 / ops
            os.write(w, f"{(u1.ru_utime - u0.ru_utime) * per} {(u1.ru_stime - u0.ru_stime) * per} {(s1 - s0) * per}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        user, system, srv = (float(v) for v in f.read().split())
    return user, system, srv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=10000)
    ap.add_argument("--only", default=",".join(OPS))
    ap.add_argument("--no-spin", action="store_true", help="TDIST_SPIN_US=0 for tdist")
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, op, ops = args.child
        print(" ".join(f"{v:.3f}" for v in one(impl, op, int(ops))))
        return
    print(machine_line())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TDIST_")}
    rows = []
    with busy_host(args.busy):
        for op in args.only.split(","):
            rows.append(_row(op, args.rounds, args.ops, env, args.no_spin))
    mode = "tdist without polling (TDIST_SPIN_US=0)" if args.no_spin else "tdist as it runs"
    host = "busy host" if args.busy else "idle host"
    print(f"\none client, {args.ops} requests a run, {mode}, {host}: CPU microseconds a request, medians of {args.rounds} runs\n")
    print(table(["op", "client user torch", "tdist", "client sys torch", "tdist", "server torch", "tdist", "torch/tdist (all)"], rows))
    print("\nlower is better; the last column: torch's CPU in all over tdist's")


def _row(op: str, rounds: int, ops: int, env: dict[str, str], no_spin: bool) -> list[object]:
    """One operation's row: ``rounds`` runs of each, alternating."""
    got: dict[str, list[tuple[float, ...]]] = {"torch": [], "tdist": []}
    for r in range(rounds):
        for impl in ("torch", "tdist") if r % 2 == 0 else ("tdist", "torch"):
            e = dict(env, **({"TDIST_SPIN_US": "0"} if impl == "tdist" and no_spin else {}))
            out = subprocess.run([sys.executable, __file__, "--child", impl, op, str(ops)], env=e,
                                 capture_output=True, text=True, timeout=600, check=True).stdout
            got[impl].append(tuple(float(v) for v in out.split()))
    t = [median([g[i] for g in got["torch"]]) for i in range(3)]
    d = [median([g[i] for g in got["tdist"]]) for i in range(3)]
    return [op, f"{t[0]:.1f}", f"{d[0]:.1f}", f"{t[1]:.1f}", f"{d[1]:.1f}", f"{t[2]:.1f}", f"{d[2]:.1f}", f"{sum(t) / sum(d):.2f}x"]


if __name__ == "__main__":
    main()
