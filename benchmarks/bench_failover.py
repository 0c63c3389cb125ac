"""The loss of a store's host: tdist's standby takes over, torch's store is simply gone.

Each round: a store server in a process of its own with a few keys and a client; SIGKILL to the
server; then the time until the client's next ``get`` is answered (tdist: by the standby,
``tdist.store.StoreStandby``, through ``FailoverStore``) or fails (torch's ``TCPStore``: there is
nothing to fail over to). The figure that matters is tdist's: a job whose rendezvous store lived
on the lost host goes on (``tdist run``, c10d); torch's ends.

    .venv/bin/python benchmarks/bench_failover.py --rounds 10
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import busy_for_the_run, free_port, machine_line, median

_TORCH_SERVER = (
    "import sys, time, datetime, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), None, True, datetime.timedelta(seconds=30), wait_for_workers=False)\n"
    "s.set('k', 'v'); print('ready', flush=True); time.sleep(600)\n"
)


def tdist_round(keys: int) -> tuple[float, float]:
    """(seconds from SIGKILL to the standby's answer, seconds to copy ``keys`` keys at start)."""
    from tdist.store import FailoverStore, StoreStandby, TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    for i in range(keys):
        master.set(f"key{i}", b"x" * 64)
    t0 = time.perf_counter()
    standby = StoreStandby("127.0.0.1", master.port, timeout=timedelta(seconds=10))
    standby.synced.wait(30)
    copied = time.perf_counter() - t0
    client = FailoverStore("127.0.0.1", master.port, timeout=timedelta(seconds=30))
    client.refresh()
    client.set("k", "v")
    assert master._server is not None and master._server.pid is not None
    t0 = time.perf_counter()
    os.kill(master._server.pid, signal.SIGKILL)
    assert client.get("k") == b"v"
    took = time.perf_counter() - t0
    client.close()
    standby.stop()
    master.close()
    return took, copied


_STANDBY = (
    "import sys, datetime\n"
    "from tdist.store import StoreStandby\n"
    "s = StoreStandby('127.0.0.1', int(sys.argv[1]), timeout=datetime.timedelta(seconds=10))\n"
    "s.synced.wait(30); print('ready', flush=True); sys.stdin.read(); s.stop()\n"
)


def set_cost(ops: int) -> tuple[float, float]:
    """Microseconds per answered ``set`` (``multi_set`` of one key) and per ``add``, with a
    standby attached to the server (every change is sent to it before the reply), the standby
    in a process of its own (as on another node)."""
    from tdist.store import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    standby = subprocess.Popen([sys.executable, "-c", _STANDBY, str(master.port)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert standby.stdout is not None and standby.stdout.readline().strip() == "ready"
    client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=30))
    cost = _time_changes(client, ops)
    client.close()
    standby.communicate("", timeout=30)
    master.close()
    return cost


def set_cost_alone(ops: int) -> tuple[float, float]:
    """The same without a standby."""
    from tdist.store import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=30))
    cost = _time_changes(client, ops)
    client.close()
    master.close()
    return cost


def _time_changes(client: Any, ops: int) -> tuple[float, float]:
    """Microseconds per answered ``set`` (``multi_set`` of one key) and per ``add``."""
    t0 = time.perf_counter()
    for i in range(ops):
        client.multi_set([f"k{i % 100}"], [b"v"])
    sets = (time.perf_counter() - t0) / ops * 1e6
    t0 = time.perf_counter()
    for _ in range(ops):
        client.add("n", 1)
    adds = (time.perf_counter() - t0) / ops * 1e6
    return sets, adds


def torch_round() -> float:
    """Seconds from SIGKILL to torch's client raising on its next ``get``."""
    import torch.distributed as d

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _TORCH_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    client = d.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    assert client.get("k") == b"v"
    t0 = time.perf_counter()
    server.kill()
    try:
        client.get("k")
        raised = False
    except Exception:
        raised = True
    took = time.perf_counter() - t0
    server.wait()
    assert raised, "torch's client answered after its server was killed"
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keys", type=int, default=10000, help="keys in the store when the standby starts")
    ap.add_argument("--ops", type=int, default=3000, help="sets and adds timed, with and without a standby")
    ap.add_argument("--busy", action="store_true", help="one busy loop per core at nice 19 for the run")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    os.environ.setdefault("TDIST_SECRET", "bench-failover")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # (torch's client logs its lost connection)
    logging.getLogger("tdist").setLevel(logging.ERROR)  # (and tdist's says it failed over)
    print(machine_line())
    ours, copies, theirs = [], [], []
    with_sb: list[tuple[float, float]] = []
    alone: list[tuple[float, float]] = []
    for _ in range(args.rounds):  # (alternating)
        took, copied = tdist_round(args.keys)
        ours.append(took)
        copies.append(copied)
        theirs.append(torch_round())
        with_sb.append(set_cost(args.ops))
        alone.append(set_cost_alone(args.ops))
    print("| what | torch | tdist |\n|---|---|---|")
    print(f"| SIGKILL of the store's server -> the client's next get | raises after {median(theirs) * 1e3:.1f} ms "
          f"(the store is gone) | answered by the standby after {median(ours) * 1e3:.1f} ms |")
    print(f"| a standby's copy of {args.keys} keys at its start | - | {median(copies) * 1e3:.1f} ms |")
    print(f"| answered set / add, no standby | - | {median([a for a, _ in alone]):.1f} / {median([b for _, b in alone]):.1f} us |")
    print(f"| answered set / add, with a standby | - | {median([a for a, _ in with_sb]):.1f} / "
          f"{median([b for _, b in with_sb]):.1f} us |")


if __name__ == "__main__":
    main()
