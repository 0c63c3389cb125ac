"""Where forming a group waits for a core: ``init_process_group`` of gloo and tdist, alternating,
under the kernel's scheduler trace (root: tracefs).

Run: .venv/bin/python benchmarks/sched_trace.py [--rounds 6] [--world 2] [--busy] [--impls gloo,tdist]

Each round starts ``--world`` fresh processes per library, as ``bench_init.py`` does, with the
kernel's ``sched_switch`` and ``sched_wakeup`` events recorded (``/sys/kernel/tracing``, mounted
here if it is not). Each rank marks the start and end of its ``init_process_group`` in the
trace. For every rank the report gives its wall time, the time its threads were on a core, and
the time they were ready to run but waited for one (after a wake-up, after a thread's start, or
after being preempted), with the longest of those waits and what held the core meanwhile.

What it showed (2026-12-02, 2 cores, kernel 6.18, ``--busy``): a thread of a group's rank that
wakes, starts, or is preempted on a core a nice-19 busy loop holds waits up to one scheduler
tick (4 ms) for it, several times in a group's forming; the waits that tdist's own design put
on the path (a new thread that must run before the others are answered) are the ones it can
remove.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import busy_host, free_port, machine_line

TRACING = "/sys/kernel/tracing/"

CHILD = """\
import os, sys, time
impl, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import torch
if impl == "gloo":
    import torch.distributed as dist
else:
    import tdist as dist
import gc
gc.collect()
mark = open("/sys/kernel/tracing/trace_marker", "w")
print("ready", flush=True)
sys.stdin.readline()
mark.write(f"BEGIN {impl} {rank} {os.getpid()}\\n"); mark.flush()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
mark.write(f"END {impl} {rank} {os.getpid()}\\n"); mark.flush()
print("done", flush=True)
dist.destroy_process_group()
"""

_LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):\s+(.*)$")
_SWITCH = re.compile(r"prev_comm=(.+?) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)")

Event = tuple[float, int, int, str, str]  # (time, tid, cpu, kind, rest)


def _write(name: str, value: str) -> None:
    with open(TRACING + name, "w") as f:
        f.write(value)


def one_run(impl: str, world: int) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TDIST_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, impl, str(r), str(world), str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            p.communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def parse(text: str) -> tuple[list[Event], dict[int, int], dict[int, tuple[str, int, float, float]]]:
    """The events; each thread's creator; each rank's process: (impl, rank, begin, end)."""
    events: list[Event] = []
    parent: dict[int, int] = {}
    marks: dict[int, dict[str, object]] = collections.defaultdict(dict)
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        t, tid, cpu, kind, rest = float(m.group(4)), int(m.group(2)), int(m.group(3)), m.group(5), m.group(6)
        events.append((t, tid, cpu, kind, rest))
        if kind == "sched_process_fork":
            f = re.search(r"pid=(\d+) child_comm=.+? child_pid=(\d+)", rest)
            if f:
                parent[int(f.group(2))] = int(f.group(1))
        elif kind == "tracing_mark_write":
            mk = re.match(r"(BEGIN|END) (\w+) (\d+) (\d+)", rest)
            if mk:
                marks[int(mk.group(4))].update({mk.group(1): t, "impl": mk.group(2), "rank": int(mk.group(3))})
    ranks = {
        pid: (str(d["impl"]), int(str(d["rank"])), float(str(d["BEGIN"])), float(str(d["END"])))
        for pid, d in marks.items()
        if "BEGIN" in d and "END" in d
    }
    return events, parent, ranks


def holders(events: list[Event], cpu: int, t0: float, t1: float) -> str:
    """What ran on ``cpu`` between ``t0`` and ``t1`` (ms each, most first)."""
    held: collections.Counter[str] = collections.Counter()
    current, since = None, t0
    for t, _, c, kind, rest in events:
        if c != cpu or kind != "sched_switch":
            continue
        m = _SWITCH.search(rest)
        if not m:
            continue
        if t > t1:
            break
        if t >= t0 and current is not None:
            held[current] += t - since
        current, since = f"{m.group(4)}-{m.group(5)}", max(t, t0)
    if current is not None:
        held[current] += t1 - since
    return ", ".join(f"{who} {ms * 1e3:.2f}" for who, ms in held.most_common(3))


def report(events: list[Event], parent: dict[int, int], ranks: dict[int, tuple[str, int, float, float]]) -> None:
    def process_of(tid: int) -> int:
        seen = set()
        while tid not in ranks and tid in parent and tid not in seen:
            seen.add(tid)
            tid = parent[tid]
        return tid

    for pid, (impl, rank, begin, end) in sorted(ranks.items(), key=lambda kv: kv[1][2]):
        state: dict[int, tuple[str, float, str]] = {}
        on_cpu = 0.0
        waits: list[tuple[float, int, str, int, float]] = []
        for t, _, cpu, kind, rest in events:
            if t > end:
                break
            if kind == "sched_switch":
                m = _SWITCH.search(rest)
                if not m:
                    continue
                prev, prev_state, nxt = int(m.group(2)), m.group(3), int(m.group(5))
                if process_of(prev) == pid:
                    s = state.get(prev)
                    if s is not None and s[0] == "run" and t >= begin:
                        on_cpu += t - max(s[1], begin)
                    state[prev] = ("ready", t, "preempted") if prev_state.startswith("R") else ("asleep", t, "")
                if process_of(nxt) == pid:
                    s = state.get(nxt)
                    if s is not None and s[0] == "ready" and t >= begin:
                        waits.append((t - max(s[1], begin), nxt, s[2], cpu, max(s[1], begin)))
                    state[nxt] = ("run", t, "")
            elif kind in ("sched_wakeup", "sched_wakeup_new"):
                w = re.search(r"pid=(\d+)", rest)
                if w and process_of(int(w.group(1))) == pid and state.get(int(w.group(1)), ("asleep",))[0] != "run":
                    state[int(w.group(1))] = ("ready", t, "started" if kind == "sched_wakeup_new" else "woken")
        waited = sum(w[0] for w in waits)
        print(f"{impl:5s} rank {rank}: {(end - begin) * 1e3:6.2f} ms, on a core {on_cpu * 1e3:5.2f}, ready and waiting {waited * 1e3:5.2f}")
        for length, tid, why, cpu, since in sorted(waits, reverse=True)[:3]:
            if length < 2e-4:
                break
            who = "main thread" if tid == pid else f"thread {tid}"
            print(f"      {length * 1e3:.2f} ms at +{(since - begin) * 1e3:.2f}, {who} {why}; core {cpu} held by {holders(events, cpu, since, since + length)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--impls", default="gloo,tdist")
    args = ap.parse_args()
    if not os.path.isdir(TRACING + "events"):
        subprocess.run(["mount", "-t", "tracefs", "nodev", TRACING], check=True)
    print(machine_line() + (" | busy host" if args.busy else ""))
    impls = [i for i in args.impls.split(",") if i]
    _write("tracing_on", "0")
    _write("trace", "")
    _write("buffer_size_kb", "30000")
    _write("set_event", "sched:sched_switch\nsched:sched_wakeup\nsched:sched_wakeup_new\nsched:sched_process_fork\n")
    try:
        with busy_host(args.busy):
            _write("tracing_on", "1")
            for r in range(args.rounds):
                for impl in impls if r % 2 == 0 else impls[::-1]:
                    one_run(impl, args.world)
            _write("tracing_on", "0")
        with open(TRACING + "trace") as f:
            text = f.read()
    finally:
        _write("tracing_on", "0")
        _write("set_event", "")
        _write("trace", "")
    report(*parse(text))


if __name__ == "__main__":
    main()
