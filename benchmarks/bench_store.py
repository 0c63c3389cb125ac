"""TCPStore side by side: tdist against torch.distributed, same machine, same client count.

Run: .venv/bin/python benchmarks/bench_store.py [--rounds 5] [--ops 5000] [--busy] [--torch-clients]

``--busy``: one low-priority busy loop per core runs meanwhile (``_common.busy_host``), as a
training job leaves the host: a speed that comes from spinning on idle cores does not survive it.

Every figure is the median over ``--rounds`` rounds, the two implementations alternating inside
each round. Clients are separate processes (forked); the server lives in the benchmark process
(torch: its server thread; tdist: the child process TCPStore starts). The "master's own client"
rows (clients 0) time the master store object itself in the benchmark process, as rank 0 uses
its group's store (tdist: its server in a thread of the process, as ``init_process_group`` and
``init_rpc`` start theirs). "create" times ``TCPStore(host, 0, is_master=True)`` itself (and its
first request), a master closed between two. The other rows start timing once tdist's server
runs in its own process (a thread of the master serves its first moments: ``StoreServer.start``).

``--torch-clients``: every client is torch's own ``TCPStore`` client, on both sides; only the
server differs (torch's, or tdist's serving torch's protocol: what a torch program's store
calls cost under ``tdist run``, against torchrun). The master's own rows are left out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import torch.distributed as tdc

import tdist
from _common import busy_host, machine_line, median, table
from tdist.testing import free_port

IMPLS = ("torch", "tdist")
TORCH_CLIENTS = False  # (--torch-clients: torch's client against either server)


def make_master(impl: str, port: int, settled: bool = True) -> Any:
    if impl == "torch":
        return tdc.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    master = tdist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    if settled and master._server is not None:
        master._server.pid  # noqa: B018 (waits until its own process serves)
    return master


def measure_create(impl: str, n: int) -> float:
    """p50 us of making a master and its first request (a ``set``, then a ``get``)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        master = make_master(impl, 0, settled=False)
        master.set("k", "v")
        master.get("k")
        times.append(time.perf_counter() - t0)
        if hasattr(master, "close"):
            master.close()
        del master
    return median(times) * 1e6


def make_client(impl: str, port: int) -> Any:
    if impl == "torch" or TORCH_CLIENTS:
        return tdc.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False)
    return tdist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False)


def run_op(store: Any, op: str, n: int, me: int) -> list[float]:
    """Run ``n`` ops; returns per-op latencies (seconds) for latency ops, else [total]."""
    key = f"k{me}"
    store.set(key, b"v" * 16)
    store.set("present", b"1")
    lat: list[float] = []
    t0 = time.perf_counter()
    if op == "get":
        for _ in range(n):
            store.get(key)
    elif op == "add":
        for _ in range(n):
            store.add("ctr", 1)
    elif op == "check":
        for _ in range(n):
            store.check([key])
    elif op == "set":
        for _ in range(n):
            store.set(key, b"value")
        store.get(key)  # everything written has been taken
    elif op in ("wait", "get_lat"):
        pc = time.perf_counter
        for _ in range(n):
            t = pc()
            if op == "wait":
                store.wait(["present"])
            else:
                store.get(key)
            lat.append(pc() - t)
        return lat
    return [time.perf_counter() - t0]


def measure_own(impl: str, op: str, n: int) -> float:
    """ops/s of the master's own client (its server: torch's thread, tdist's in a thread)."""
    if impl == "torch":
        master = make_master(impl, 0)
    else:
        from tdist.store._tcp import serving_in_a_thread

        with serving_in_a_thread():
            master = make_master(impl, 0)
    try:
        run_op(master, op, min(n, 500), 0)  # (warm)
        return n / run_op(master, op, n, 0)[0]
    finally:
        if hasattr(master, "close"):
            master.close()


def client_main(impl: str, port: int, op: str, n: int, me: int, start: Any, out: Any) -> None:
    try:
        store = make_client(impl, port)
        start.wait()
        out.put((me, run_op(store, op, n, me)))
    except BaseException as exc:
        out.put((me, repr(exc)))


def measure(impl: str, op: str, clients: int, n: int, busy: bool = False) -> float:
    """ops/s aggregate (throughput ops) or median latency in us (wait / get_lat); ``clients``
    0: the master's own client (``measure_own``)."""
    if op == "create":
        return measure_create(impl, min(n, 30))
    if clients == 0:
        return measure_own(impl, op, n)
    ctx = mp.get_context("fork")
    # Fork the clients before the master exists: a child forked while torch's server thread
    # runs can deadlock on a lock that thread held at the fork.
    port = free_port()
    start = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=client_main, args=(impl, port, op, n, i, start, out)) for i in range(clients)]
    for p in procs:
        p.start()
    master = make_master(impl, port)
    stop = threading.Event()
    spinner = None
    if busy:  # the hosting process runs Python code, as a training loop would
        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    start.wait()
    t0 = time.perf_counter()
    results = [out.get(timeout=300) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    stop.set()
    if spinner is not None:
        spinner.join()
    errors = [r for _, r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"{impl} {op}: {errors[0]}")
    if op in ("wait", "get_lat"):
        lats = sorted(x for _, r in results for x in r)
        value = lats[len(lats) // 2] * 1e6
    else:
        value = clients * n / wall
    if hasattr(master, "close"):
        master.close()
    del master
    return value


def mixed_main(impl: str, port: int, n: int, me: int, start: Any, out: Any) -> None:
    try:
        store = make_client(impl, port)
        start.wait()
        adds = 0
        for i in range(n):
            r = i % 5
            if r == 0:
                store.add("mixed_ctr", 1)
                adds += 1
            elif r == 1:
                store.set(f"m{me}", str(i))
            elif r == 2:
                assert store.get(f"m{me}") == str(i - 1).encode()
            elif r == 3:
                store.check([f"m{me}", "mixed_ctr"])
            else:
                store.compare_set(f"cs{me}", str(i - 5) if i >= 5 else "", str(i))
        out.put((me, adds))
    except BaseException as exc:
        out.put((me, repr(exc)))


def mixed(impl: str, clients: int, n: int) -> tuple[bool, float]:
    ctx = mp.get_context("fork")
    port = free_port()
    start = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=mixed_main, args=(impl, port, n, i, start, out)) for i in range(clients)]
    for p in procs:
        p.start()
    master = make_master(impl, port)
    start.wait()
    t0 = time.perf_counter()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    errors = [r for _, r in results if isinstance(r, str)]
    expected = sum(r for _, r in results if isinstance(r, int))
    # (torch's client puts "/" before its keys; tdist's master names the key as it is)
    final = master.add("/mixed_ctr" if TORCH_CLIENTS and impl == "tdist" else "mixed_ctr", 0)
    ok = not errors and final == expected
    if errors:
        print(f"  {impl} mixed errors: {errors[:3]}")
    if hasattr(master, "close"):
        master.close()
    return ok, clients * n / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=5000)
    ap.add_argument("--mixed-clients", type=int, default=64)
    ap.add_argument("--mixed-ops", type=int, default=1000)
    ap.add_argument("--only", default="", help="comma-separated operations to run (e.g. add,check)")
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--torch-clients", action="store_true", help="torch's client on both sides: only the server differs")
    args = ap.parse_args()
    global TORCH_CLIENTS
    TORCH_CLIENTS = args.torch_clients
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"# store benchmark: {machine_line()}" + (" | busy host" if args.busy else "")
          + (" | torch's clients on both servers" if args.torch_clients else ""))
    with busy_host(args.busy):
        run(args)


def run(args: argparse.Namespace) -> None:
    cases = [
        ("get", 1, "ops/s", False, 1.5),
        ("add", 1, "ops/s", False, 1.5),
        ("check", 1, "ops/s", False, 1.5),
        ("set", 1, "ops/s", False, 0.8),
        ("get", 8, "ops/s", False, 1.0),
        ("add", 8, "ops/s", False, 1.0),
        ("check", 8, "ops/s", False, 1.0),
        ("wait", 1, "p50 us", False, 1.0),
        ("get_lat", 1, "p50 us", False, 1.0),
        ("get_lat", 1, "p50 us", True, 1.0),
        ("get", 0, "ops/s", False, 1.0),
        ("add", 0, "ops/s", False, 1.0),
        ("check", 0, "ops/s", False, 1.0),
        ("create", 0, "p50 us", False, 1.0),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c[0] in wanted]
    if args.torch_clients:
        cases = [(op, n, unit, busy, 1.0) for op, n, unit, busy, _ in cases if n > 0]
    samples: dict[tuple[str, int, bool, str], list[float]] = {}
    for r in range(args.rounds):
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]
        for op, clients, _, busy, _ in cases:
            n = args.ops if clients == 1 else max(1000, args.ops // 2)
            for impl in order:
                samples.setdefault((op, clients, busy, impl), []).append(measure(impl, op, clients, n, busy))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    rows = []
    for op, clients, unit, busy, target in cases:
        t = median(samples[(op, clients, busy, "torch")])
        o = median(samples[(op, clients, busy, "tdist")])
        lower_better = unit.startswith("p50")
        ratio = t / o if lower_better else o / t
        name = {"get_lat": "get latency", "wait": "wait (present key)"}.get(op, op)
        if busy:
            name += " (host busy)"
        if clients == 0 and op != "create":
            name += " (master's own client)"
        if op == "create":
            name = "create a master (+ set, get)"
        verdict = "ok" if ratio >= target else "BELOW"
        rows.append([name, clients, unit, t, o, f"{ratio:.2f}x", f">={target}x", verdict])
    print()
    print(table(["operation", "clients", "unit", "torch", "tdist", "speed-up", "target", ""], rows))
    print("\nspeed-up: tdist over torch (ops/s ratio, or latency ratio torch/tdist); median of", args.rounds, "rounds")
    if args.no_mixed:
        return
    print(f"\nmixed load: {args.mixed_clients} clients x {args.mixed_ops} ops (add/set/get/check/compare_set)")
    mrows = []
    for impl in IMPLS:
        ok, rate = mixed(impl, args.mixed_clients, args.mixed_ops)
        mrows.append([impl, "exact" if ok else "WRONG", rate])
    print(table(["impl", "final counter", "aggregate ops/s"], mrows))


if __name__ == "__main__":
    main()
