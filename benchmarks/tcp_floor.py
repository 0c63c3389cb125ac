"""Raw TCP throughput between two network namespaces: the floor under any collective.

Run (as root): .venv/bin/python benchmarks/tcp_floor.py [--mib 64] [--reps 7] [--only "both ways"]

Two namespaces joined by a veth/bridge (tests/multihost/_netns.py), one process in each; the
processes open 1, 2 or 4 TCP connections, then time moving --mib MiB one way (A to B) or both
ways at once (each side sends --mib MiB and receives --mib MiB, what a 2-rank ring all_reduce does
in each of its two phases), split evenly over the connections, one thread per direction and
connection, large ``sendmsg``/``recv_into`` calls on preallocated, pre-faulted buffers ("1 thread
per direction": one thread sends round the connections and one receives, non-blocking, as a
backend's caller and reader thread would). Each variant takes the median of --reps transfers;
socket options are varied one at a time. In brackets: the whole machine's CPU split during ten
more transfers (from /proc/stat: the namespaces share the host's cores).

A 2-rank all_reduce of N bytes sends and receives N/2 in its reduce-scatter and N/2 in its
all-gather on each rank: at best the "both ways" time at --mib N, plus reducing N/2 bytes.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SO_ZEROCOPY = 60
MSG_ZEROCOPY = 0x4000000
TCP_NOTSENT_LOWAT = 25
SO_BUSY_POLL = 46


def _opts(s: socket.socket, cfg: dict) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if cfg.get("nodelay", True) else 0)
    if cfg.get("buf"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg["buf"])
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg["buf"])
    if cfg.get("lowat"):
        s.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, cfg["lowat"])
    if cfg.get("busypoll"):
        s.setsockopt(socket.SOL_SOCKET, SO_BUSY_POLL, cfg["busypoll"])
    if cfg.get("zerocopy"):
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)


def _send(s: socket.socket, mv: memoryview, chunk: int, zerocopy: bool) -> None:
    off, n = 0, len(mv)
    flags = MSG_ZEROCOPY if zerocopy else 0
    while off < n:
        try:
            off += s.sendmsg([mv[off:off + chunk]], [], flags)
        except BlockingIOError:  # (zerocopy: optmem full; drain completions)
            _drain_errqueue(s)
    if zerocopy:
        _drain_errqueue(s)


def _drain_errqueue(s: socket.socket) -> None:
    while True:
        try:
            s.recvmsg(0, 4096, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return


def _send_mux(socks: list[socket.socket], mvs: list[memoryview], chunk: int) -> None:
    """One thread sends every connection's share: non-blocking writes round the connections,
    a poll for room when none takes more (as one sending thread over several connections)."""
    import select
    offs = [0] * len(socks)
    poller = select.poll()
    for s in socks:
        poller.register(s.fileno(), select.POLLOUT)
    left = set(range(len(socks)))
    while left:
        progressed = False
        for i in list(left):
            try:
                offs[i] += socks[i].send(mvs[i][offs[i]:offs[i] + chunk], socket.MSG_DONTWAIT)
                progressed = True
            except BlockingIOError:
                continue
            if offs[i] >= len(mvs[i]):
                left.discard(i)
                poller.unregister(socks[i].fileno())
        if left and not progressed:
            poller.poll(1000)


def _recv_mux(socks: list[socket.socket], mvs: list[memoryview]) -> None:
    import select
    offs = [0] * len(socks)
    poller = select.poll()
    fd2i = {}
    for i, s in enumerate(socks):
        poller.register(s.fileno(), select.POLLIN)
        fd2i[s.fileno()] = i
    left = set(range(len(socks)))
    while left:
        for fd, _ in poller.poll(1000):
            i = fd2i[fd]
            while offs[i] < len(mvs[i]):
                try:
                    got = socks[i].recv_into(mvs[i][offs[i]:], len(mvs[i]) - offs[i], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if not got:
                    raise EOFError
                offs[i] += got
            if offs[i] >= len(mvs[i]) and i in left:
                left.discard(i)
                poller.unregister(fd)


def _recv(s: socket.socket, mv: memoryview) -> None:
    off, n = 0, len(mv)
    while off < n:
        got = s.recv_into(mv[off:], n - off)
        if not got:
            raise EOFError
        off += got


def _one(socks: list[socket.socket], smv: memoryview, rmv: memoryview, share: int, nconn: int, sends: bool,
         recvs: bool, chunk: int, cfg: dict) -> None:
    ths: list[threading.Thread] = []
    if cfg.get("mux"):
        if sends:
            ths.append(threading.Thread(target=_send_mux, args=(
                socks, [smv[i * share:(i + 1) * share] for i in range(nconn)], chunk)))
        if recvs:
            ths.append(threading.Thread(target=_recv_mux, args=(
                socks, [rmv[i * share:(i + 1) * share] for i in range(nconn)])))
    for i, s in enumerate(socks if not cfg.get("mux") else ()):
        if sends:
            ths.append(threading.Thread(target=_send, args=(s, smv[i * share:(i + 1) * share], chunk,
                                                            bool(cfg.get("zerocopy")))))
        if recvs:
            ths.append(threading.Thread(target=_recv, args=(s, rmv[i * share:(i + 1) * share])))
    for t in ths:
        t.start()
    for t in ths:
        t.join()


def peer(role: str, addr: str, port: int, cfg: dict) -> None:
    nconn, nbytes, reps, bidir = cfg["nconn"], cfg["mib"] << 20, cfg["reps"], cfg["bidir"]
    chunk = cfg.get("chunk", 1 << 30)
    if role == "A":
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if cfg.get("buf"):  # (the receive window is set before connect/listen)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg["buf"])
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg["buf"])
        ls.bind((addr, port))
        ls.listen(16)
        ctl = ls.accept()[0]
        socks = [ls.accept()[0] for _ in range(nconn)]
    else:
        def dial() -> socket.socket:
            for _ in range(500):
                s = socket.socket()
                if cfg.get("buf"):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg["buf"])
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg["buf"])
                try:
                    s.connect((addr, port))
                    return s
                except ConnectionRefusedError:
                    s.close()
                    time.sleep(0.01)
            raise RuntimeError("no listener")
        ctl = dial()
        socks = [dial() for _ in range(nconn)]
    for s in socks:
        _opts(s, cfg)
    ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sbuf = bytearray(nbytes)
    rbuf = bytearray(nbytes)
    for i in range(0, nbytes, 4096):  # pre-fault
        sbuf[i] = 1
        rbuf[i] = 1
    share = nbytes // nconn
    smv, rmv = memoryview(sbuf), memoryview(rbuf)
    sends = role == "A" or bidir
    recvs = role == "B" or bidir
    times = []
    for _ in range(reps + 1):
        # barrier on the control connection
        ctl.sendall(b"x")
        ctl.recv(1)
        t0 = time.perf_counter()
        _one(socks, smv, rmv, share, nconn, sends, recvs, chunk, cfg)
        # the receiver's finish ends the transfer: wait for the peer's done
        ctl.sendall(b"d")
        ctl.recv(1)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    if cfg.get("cpustat") and role == "A":
        def st() -> list[int]:
            with open("/proc/stat") as f:
                return [int(x) for x in f.readline().split()[1:]]
        a = st()
        t1 = time.perf_counter()
        for _ in range(10):
            ctl.sendall(b"x")
            ctl.recv(1)
            _one(socks, smv, rmv, share, nconn, sends, recvs, chunk, cfg)
        el = time.perf_counter() - t1
        b = st()
        dd = [y - x for x, y in zip(a, b, strict=True)]
        names = "user nice system idle iowait irq softirq steal".split()
        print("CPU " + " ".join(f"{n}={v / sum(dd) * 100:.0f}%" for n, v in zip(names, dd, strict=False) if v)
              + f" {el / 10 * 1e3:.1f} ms/transfer", file=sys.stderr)
    elif cfg.get("cpustat"):
        for _ in range(10):
            ctl.sendall(b"x")
            ctl.recv(1)
            _one(socks, smv, rmv, share, nconn, sends, recvs, chunk, cfg)
    print(json.dumps({"t": times[len(times) // 2], "all": times}), flush=True)


def measure(hosts, cfg: dict, port: int) -> float:
    from tests.multihost import _netns
    procs = []
    for role, h in (("A", hosts[0]), ("B", hosts[1])):
        procs.append(subprocess.Popen(
            _netns.command(h, [sys.executable, __file__, "--peer", role, hosts[0].addr, str(port), json.dumps(cfg)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs, cpu = [], ""
    for p in procs:
        out, err = p.communicate(timeout=300)
        outs.append(json.loads(out.strip().splitlines()[-1]))
        cpu += "".join(line for line in err.splitlines(True) if line.startswith("CPU"))
    return max(o["t"] for o in outs), cpu.strip()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        peer(sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    args = ap.parse_args()
    from tests.multihost import _netns
    base = {"mib": args.mib, "reps": args.reps, "cpustat": True}
    variants = {
        "1 conn, one way": {"nconn": 1, "bidir": False},
        "2 conn, one way": {"nconn": 2, "bidir": False},
        "4 conn, one way": {"nconn": 4, "bidir": False},
        "1 conn, both ways": {"nconn": 1, "bidir": True},
        "2 conn, both ways": {"nconn": 2, "bidir": True},
        "4 conn, both ways": {"nconn": 4, "bidir": True},
        "1 conn, both ways, 1 thread per direction": {"nconn": 1, "bidir": True, "mux": True, "chunk": 1 << 20},
        "2 conn, both ways, 1 thread per direction": {"nconn": 2, "bidir": True, "mux": True, "chunk": 1 << 20},
        "4 conn, both ways, 1 thread per direction": {"nconn": 4, "bidir": True, "mux": True, "chunk": 1 << 20},
        "2 conn, one way, 1 thread per direction": {"nconn": 2, "bidir": False, "mux": True, "chunk": 1 << 20},
        "4 conn, both ways, 1 thread/dir, buf 4M": {"nconn": 4, "bidir": True, "mux": True, "chunk": 1 << 20,
                                                    "buf": 4 << 20},
        "1 conn, both ways, no NODELAY": {"nconn": 1, "bidir": True, "nodelay": False},
        "1 conn, both ways, buf 256K": {"nconn": 1, "bidir": True, "buf": 256 << 10},
        "1 conn, both ways, buf 1M": {"nconn": 1, "bidir": True, "buf": 1 << 20},
        "1 conn, both ways, buf 4M": {"nconn": 1, "bidir": True, "buf": 4 << 20},
        "1 conn, both ways, 256K sends": {"nconn": 1, "bidir": True, "chunk": 256 << 10},
        "1 conn, both ways, 4M sends": {"nconn": 1, "bidir": True, "chunk": 4 << 20},
        "1 conn, both ways, NOTSENT_LOWAT 128K": {"nconn": 1, "bidir": True, "lowat": 128 << 10},
        "1 conn, both ways, busy_poll 50us": {"nconn": 1, "bidir": True, "busypoll": 50},
        "1 conn, both ways, MSG_ZEROCOPY": {"nconn": 1, "bidir": True, "zerocopy": True},
        "1 conn, one way, MSG_ZEROCOPY": {"nconn": 1, "bidir": False, "zerocopy": True},
    }
    only = [v for v in args.only.split(",") if v]
    port = 31000
    with _netns.hosts(2) as hosts:
        for name, v in variants.items():
            if only and not any(o in name for o in only):
                continue
            port += 1
            t, cpu = measure(hosts, {**base, **v}, port)
            nb = args.mib << 20
            print(f"{name:42s} {t * 1e3:7.1f} ms  {nb / t / 1e9:5.2f} GB/s per direction  ({cpu})", flush=True)


if __name__ == "__main__":
    main()
