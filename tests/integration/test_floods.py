"""Connection floods and slow handshakes: listeners that run out of descriptors back off and say
so once; silent strangers delay nobody, cost a bounded number of threads, and are dropped first;
the job's own clients are served throughout."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tdist
from tdist.testing import run_threads
from tdist.transport import Endpoint

from .._sync import read_line
from .test_security import _Node

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_store_out_of_descriptors_backs_off_says_so_once_and_serves_its_clients(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    env = {**os.environ, "TDIST_SECRET": "flood", "PYTHONPATH": str(ROOT / "src")}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tdist.cli", "store", "--port", "0"], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(read_line(proc.stdout, 60, "tdist store's address").split("127.0.0.1:")[1].split()[0])
        client = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10), secret="flood")
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (32, 32))  # (few descriptors left)
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        served = 0
        while time.monotonic() - t0 < 4.0:
            for _ in range(20):  # strangers that connect and say nothing
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            client.set(f"k{served}", "v")  # the job's own client, connected before, throughout
            assert client.get(f"k{served}") == b"v"
            served += 1
            fresh = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10), secret="flood")
            assert fresh.get(f"k{served - 1}") == b"v"  # and a newcomer of the job gets in
            fresh.close()
        cpu = _cpu_seconds(proc.pid) - cpu0
        elapsed = time.monotonic() - t0
        client.close()
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert text.count("out of descriptors") == 1, text[-2000:]  # one line per episode
    assert len(text) < 20_000, len(text)
    assert cpu < 0.6 * elapsed, (cpu, elapsed)  # not spinning on the listener
    assert served >= 5


def test_silent_connections_do_not_delay_the_mesh() -> None:
    store = tdist.HashStore()
    silent: list[socket.socket] = []
    opened = threading.Event()

    def body(rank: int, n: int) -> float:
        t0 = time.monotonic()
        if rank == 1:
            # strangers connect to rank 0's listener and say nothing, before rank 1 does
            info = json.loads(store.get("mesh/ep/0"))
            for _ in range(3):
                silent.append(socket.create_connection((info["addr"], info["port"]), timeout=5))
            opened.set()
            t0 = time.monotonic()
        ep = Endpoint(tdist.PrefixStore("mesh", store), rank, n, timeout=60)
        try:
            ep.send(1 - rank, 1, [b"hi"])
            h = ep.post_recv(1 - rank, 1)
            ep.wait(h, time.monotonic() + 10)
            return time.monotonic() - t0
        finally:
            ep.close()

    try:
        took = run_threads(body, 2, timeout=80)
    finally:
        for s in silent:
            s.close()
    assert opened.is_set()
    assert max(took) < 8, took  # one at a time, each silent one held the door 10 s


def test_silent_rpc_connections_cost_no_thread_and_delay_nobody() -> None:
    book: dict[int, Any] = {}
    a = _Node(0, book)
    held: list[socket.socket] = []
    try:
        before = threading.active_count()
        addr = a.m.address
        for _ in range(300):
            held.append(socket.create_connection((addr["addr"], addr["port"]), timeout=5))
        deadline = time.monotonic() + 10
        while a.m._doorway.pending < 64 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.m._doorway.pending == 64  # (at most that many at once: the oldest were shed)
        assert threading.active_count() - before <= 4, threading.active_count() - before
        b = _Node(1, book)
        try:
            t0 = time.monotonic()
            b.m.send(0, 1, b"\x01", tdist.transport._serialization.dumps("through the flood"), time.monotonic() + 20)
            assert a.inbox.get(timeout=20) == "through the flood"
            assert time.monotonic() - t0 < 8
        finally:
            b.m.close()
    finally:
        for s in held:
            s.close()
        a.m.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_a_closed_connection_gives_its_buffers_back_at_once() -> None:
    import struct

    from tdist.store._protocol import Op

    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), secret="mem")
    try:
        assert master._server is not None and master._server.pid is not None
        pid = master._server.pid
        client = tdist.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=10), secret="mem")
        base = _rss_mib(pid)
        sock = client._sock
        assert sock is not None
        sock.setblocking(True)
        # most of a 300 MiB request, then the connection goes
        sock.sendall(struct.pack("<IBII", 9 + (300 << 20), Op.SET, 2, 3) + b"key" + struct.pack("<I", 300 << 20))
        chunk = b"\0" * (1 << 20)
        for _ in range(200):
            sock.sendall(chunk)
        deadline = time.monotonic() + 10
        while _rss_mib(pid) < base + 150 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _rss_mib(pid) >= base + 150  # (the server holds what came so far)
        sock.close()
        deadline = time.monotonic() + 5  # (its authentication timer would have held it 10-30 s)
        while _rss_mib(pid) > base + 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _rss_mib(pid) <= base + 50, (base, _rss_mib(pid))
        assert not master.check(["key"])  # (the request never completed)
    finally:
        master.close()
