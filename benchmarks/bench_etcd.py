"""The etcd store side by side: ``tdist.store.EtcdStore`` against torchelastic's ``EtcdStore``.

Run: .venv/bin/python benchmarks/bench_etcd.py [--rounds 5] [--ops 300]

Both talk to the same private etcd server, started here on free ports (``etcd --enable-v2``):
torch's store (``torch.distributed.elastic.rendezvous.etcd_store.EtcdStore``, what its etcd
rendezvous uses) speaks etcd's v2 API through the ``python-etcd`` package; ours speaks the v3
JSON API with the standard library. Measured, as medians over ``--rounds`` alternating rounds:

- ``set``, ``get``, ``add``, ``check`` of one key: microseconds per call, one client;
- ``wait`` wake-up: from one client's ``set`` to the return of another client's ``wait`` on
  that key (a waiter that sleeps in etcd, not one that polls, wakes at once);
- a rendezvous of 8 clients (threads): each ``add``s itself to a counter and ``wait``s for the
  last one's key, as nodes meet in the etcd rendezvous: time until all 8 are through.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import busy_for_the_run, machine_line, median, table
from tdist.store import EtcdStore

IMPLS = ("torch", "tdist")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_etcd(tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [binary, "--enable-v2", "--data-dir", os.path.join(tmp, "d"),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", client), timeout=1):
                return proc, client
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("etcd did not start (is the etcd-server package installed?)") from None
            time.sleep(0.05)


def make(impl: str, port: int, prefix: str) -> Any:
    if impl == "tdist":
        return EtcdStore("127.0.0.1", port, prefix=prefix, timeout=timedelta(seconds=30))
    import etcd  # python-etcd, which torch's etcd store needs
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as TorchEtcdStore

    client = etcd.Client(host="127.0.0.1", port=port, protocol="http")
    return TorchEtcdStore(client, prefix, timeout=timedelta(seconds=30))


def per_call(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


def wake_latency(impl: str, port: int, prefix: str, n: int) -> float:
    waiter, writer = make(impl, port, prefix), make(impl, port, prefix)
    out = []
    for i in range(n):
        key = f"wake{i}"
        ready = threading.Event()
        woke: list[float] = []

        def wait(key: str = key, ready: threading.Event = ready, woke: list[float] = woke) -> None:
            ready.set()
            waiter.wait([key])
            woke.append(time.perf_counter())

        t = threading.Thread(target=wait)
        t.start()
        ready.wait()
        time.sleep(0.02)  # (the waiter is waiting in etcd)
        t0 = time.perf_counter()
        writer.set(key, b"1")
        t.join()
        out.append((woke[0] - t0) * 1e6)
    return statistics.median(out)


def rendezvous(impl: str, port: int, prefix: str, clients: int = 8) -> float:
    stores = [make(impl, port, prefix) for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def node(s: Any) -> None:
        start.wait()
        if s.add("joined", 1) == clients:
            s.set("all", b"1")
        s.wait(["all"])

    threads = [threading.Thread(target=node, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3


def one_round(impl: str, port: int, r: int, ops: int) -> dict[str, float]:
    prefix = f"/bench/{impl}/{r}"
    s = make(impl, port, prefix)
    res = {
        "set (us)": per_call(lambda i: s.set(f"k{i}", b"value"), ops),
        "get (us)": per_call(lambda i: s.get(f"k{i}"), ops),
        "add (us)": per_call(lambda i: s.add("counter", 1), ops),
        "check (us)": per_call(lambda i: s.check([f"k{i}"]), ops),
        "wait wake-up (us)": wake_latency(impl, port, prefix, max(5, ops // 30)),
        "rendezvous of 8 (ms)": rendezvous(impl, port, prefix + "/rdzv"),
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    impls = list(IMPLS)
    try:
        import etcd  # noqa: F401
    except ImportError:
        print("torch's etcd store needs python-etcd (pip install python-etcd): measuring tdist only")
        impls = ["tdist"]
    results: dict[str, list[dict[str, float]]] = {i: [] for i in impls}
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_etcd(tmp)
        try:
            for r in range(args.rounds):
                for impl in impls if r % 2 == 0 else list(reversed(impls)):
                    results[impl].append(one_round(impl, port, r, args.ops))
        finally:
            proc.terminate()
            proc.wait(10)
    print(machine_line())
    print(f"one etcd server (3.4, on this host); medians of {args.rounds} alternating rounds\n")
    rows = []
    for metric in results["tdist"][0]:
        d = median([x[metric] for x in results["tdist"]])
        if "torch" in results:
            t = median([x[metric] for x in results["torch"]])
            rows.append([metric, t, d, f"{d / t:.2f}x"])
        else:
            rows.append([metric, "—", d, "—"])
    print(table(["metric (lower is better)", "torch", "tdist", "tdist/torch"], rows))


if __name__ == "__main__":
    main()
