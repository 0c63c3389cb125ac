"""One store client on a busy host, with client and server pinned to one core or to two.

Run: .venv/bin/python benchmarks/store_cores.py [--ops 3000] [--rounds 5] [--only set,add]

``bench_store.py --busy`` is bimodal on a 2-core machine: the scheduler puts a client and its
server on one core (the busy loops on the other) or on two, and one run lands in either mode.
This pins them (``sched_setaffinity``: the client process, and the server's, which is a thread of
the master's process for torch and a process of its own for tdist), one nice-19 busy loop per
core running meanwhile (``_common.busy_host``), and times each mode alone: ``set`` (``n`` sets,
then one ``get`` so that all were taken in) and ``add`` (``n`` round trips), in operations per
second, the median of the rounds, torch and tdist alternating.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as tdc

import tdist
from _common import busy_host, free_port, machine_line, median, table

IMPLS = ("torch", "tdist")


def _store(impl: str, port: int, master: bool) -> Any:
    cls = tdc.TCPStore if impl == "torch" else tdist.TCPStore
    return cls("127.0.0.1", port, None, master, timedelta(seconds=60), wait_for_workers=False)


def _client(impl: str, port: int, op: str, n: int, out: Any, go: Any) -> None:
    os.sched_setaffinity(0, {0})
    try:
        store = _store(impl, port, False)
        store.set("warm", b"1")
        store.get("warm")
        if not go.wait(60):
            raise TimeoutError("the master never said go")
        t0 = time.perf_counter()
        if op == "set":
            for _ in range(n):
                store.set("k", b"value")
            store.get("k")  # (every set taken in)
        else:
            for _ in range(n):
                store.add("ctr", 1)
        out.put(n / (time.perf_counter() - t0))
    except BaseException as exc:
        out.put(repr(exc))


def measure(impl: str, op: str, same: bool, n: int) -> float:
    """ops/s of one client, its server on the client's core (``same``) or the other one."""
    ctx = mp.get_context("fork")
    port = free_port()
    out = ctx.Queue()
    go = ctx.Event()
    proc = ctx.Process(target=_client, args=(impl, port, op, n, out, go))
    proc.start()  # (forked before the master exists: see bench_store.py)
    core = {0} if same else {1}
    os.sched_setaffinity(0, core)  # (torch's server thread starts here, and inherits it)
    try:
        master = _store(impl, port, True)
        server = getattr(master, "_server", None)
        # tdist's server: timed once its own process serves (a thread of the master serves
        # its first 0.1-0.2 s, as bench_store.py's rows), that process pinned too
        pid = None if server is None else server.pid
        if pid is not None:
            os.sched_setaffinity(pid, core)
        go.set()
        value = out.get(timeout=120)
        proc.join(30)
        if isinstance(value, str):
            raise RuntimeError(f"{impl} {op}: {value}")
        if hasattr(master, "close"):
            master.close()
        del master
        return float(value)
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="set,add")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"# one store client, pinned, busy host: {machine_line()}")
    ops = [o for o in args.only.split(",") if o]
    samples: dict[tuple[str, bool, str], list[float]] = {}
    with busy_host(True):
        for r in range(args.rounds):
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]
            for op in ops:
                for same in (True, False):
                    for impl in order:
                        samples.setdefault((op, same, impl), []).append(measure(impl, op, same, args.ops))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    rows = []
    for op in ops:
        for same in (True, False):
            t, o = median(samples[(op, same, "torch")]), median(samples[(op, same, "tdist")])
            rows.append([op, "one core" if same else "two cores", f"{t:,.0f}", f"{o:,.0f}", f"{o / t:.2f}x"])
    print()
    print(table(["operation", "client and server", "torch ops/s", "tdist ops/s", "speed-up"], rows))


if __name__ == "__main__":
    main()
