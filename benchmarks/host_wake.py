"""What a wake-up costs on this host: a figure to record beside any latency-bound benchmark.

Run: .venv/bin/python benchmarks/host_wake.py [--rounds 3] [--iters 2000] [--busy]

A message-passing step is a chain of waits: a process sends, sleeps until the answer comes,
and is woken. On a virtual machine an idle virtual CPU halts, and waking it costs the waker an
interrupt between CPUs and the woken code cold caches: the same Python takes longer right after
a sleep than when it runs back to back. How much depends on the host, not on the code, and it
moves between days (the same tree's small distributed-autograd step took 607 us on one day and
1,150 on another), so a section that compares latency figures with an earlier one should record
these figures too.

Measured, in one process unless said otherwise (medians of ``--iters``, each row's median over
``--rounds``):

- ``work, hot``: a fixed piece of Python (three ``tdist`` serializations of a 16-float tensor,
  the work of a small message) run back to back;
- ``work after a 300 us spin``: the same, each after polling the clock for 300 us;
- ``work after a 300 us sleep``: the same, each after ``time.sleep(300e-6)``;
- ``wake-up of a process asleep for 20 / 300 us``: from a write into a pipe to the moment the
  process blocked in reading it runs (one clock for both processes), after it slept that long
  (a hypervisor polls a halted virtual CPU for a while before it gives the CPU away, so a short
  sleep wakes quicker); ``hand-over to a polling process``: the same to a reader that polls.

``--busy``: one low-priority busy loop per core meanwhile (``_common.busy_host``), which keeps
every virtual CPU running: its sleeps no longer halt it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch

from _common import busy_for_the_run, machine_line, median, table
from tdist.transport import _serialization as ser

_X = torch.randn(16, 1)


def _work() -> None:
    for _ in range(3):
        ser.dumps(_X)


def _timed(pause: str, iters: int) -> float:
    ns = time.perf_counter_ns
    out = []
    for _ in range(iters):
        if pause == "spin":
            end = ns() + 300_000
            while ns() < end:
                pass
        elif pause == "sleep":
            time.sleep(300e-6)
        t0 = ns()
        _work()
        out.append(ns() - t0)
    return statistics.median(out) / 1e3


def _wake(iters: int, gap_us: int, poll: bool) -> float:
    """The latency of one wake-up between processes (us): from the write into a pipe to the
    moment its reader, blocked in ``read`` for ``gap_us`` already (or, with ``poll``, polling
    it), runs again. The reader sends its clock back (one clock for both processes)."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        try:
            if poll:
                os.set_blocking(a_r, False)
            while True:
                try:
                    got = os.read(a_r, 1)
                except BlockingIOError:
                    continue
                woke = time.perf_counter_ns()
                if got != b"x":
                    break
                os.write(b_w, woke.to_bytes(8, "little"))
        finally:
            os._exit(0)
    ns = time.perf_counter_ns
    out = []
    try:
        for _ in range(iters):
            end = ns() + gap_us * 1000  # (the reader sleeps meanwhile)
            while ns() < end:
                pass
            t0 = ns()
            os.write(a_w, b"x")
            woke = int.from_bytes(os.read(b_r, 8), "little")
            out.append(woke - t0)
    finally:
        os.write(a_w, b"q")
        os.waitpid(pid, 0)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
    return statistics.median(out) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    print(f"# host wake-up costs: {machine_line()} | {'busy' if args.busy else 'idle'} host")
    rows = {
        "work, hot (us)": lambda: _timed("hot", args.iters),
        "work after a 300 us spin (us)": lambda: _timed("spin", args.iters),
        "work after a 300 us sleep (us)": lambda: _timed("sleep", args.iters),
        "wake-up of a process asleep for 20 us (us)": lambda: _wake(args.iters, 20, poll=False),
        "wake-up of a process asleep for 300 us (us)": lambda: _wake(args.iters, 300, poll=False),
        "hand-over to a polling process (us)": lambda: _wake(args.iters, 300, poll=True),
    }
    samples: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(args.rounds):
        for label, fn in rows.items():
            samples[label].append(fn())
        print(f"  round {r + 1}: " + ", ".join(f"{k.split(' (')[0]} {v[-1]:.1f}" for k, v in samples.items()), flush=True)
    med = {k: median(v) for k, v in samples.items()}
    print()
    print(table(["figure", "median"], [[k, f"{v:.1f}"] for k, v in med.items()]))
    hot = med["work, hot (us)"]
    print(f"\nthe work after a sleep takes {med['work after a 300 us sleep (us)'] / hot:.2f}x its hot time "
          f"(after a spin {med['work after a 300 us spin (us)'] / hot:.2f}x)")


if __name__ == "__main__":
    main()
