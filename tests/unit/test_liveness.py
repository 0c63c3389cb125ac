"""The one liveness mechanism of both transports (``transport/_liveness``), on socket pairs."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import pytest

from tdist.transport._liveness import Heartbeats

pytestmark = pytest.mark.timeout(30)

FRAME = b"HB-frame"


@dataclass
class _Link:
    sock: socket.socket
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    last_rx: float = field(default_factory=time.monotonic)
    last_tx: float = field(default_factory=time.monotonic)
    tail: bytes = b""
    dead: bool = False

    def heartbeat(self) -> bytes:
        return FRAME


def _beats(links: list[_Link], on_stall: object = None, interval: float = 1.0, stall: float = 10.0) -> Heartbeats:
    return Heartbeats("test-hb", interval, stall, lambda: links, lambda link: link.dead, on_stall)


def test_a_heartbeat_goes_out_whole_or_waits_whole_in_the_tail() -> None:
    a, b = socket.socketpair()
    try:
        link = _Link(a)
        hb = _beats([link])
        hb.beat(link, 5.0)
        assert b.recv(100) == FRAME and link.tail == b"" and link.last_tx == 5.0
        a.setblocking(False)
        filled = 0
        with pytest.raises(BlockingIOError):
            while True:
                filled += a.send(b"x" * 65536)
        hb.beat(link, 6.0)  # (no room: the frame is kept, whole, for the next write)
        assert link.tail == FRAME and link.last_tx == 5.0
        got = 0
        b.setblocking(False)
        while got < filled:
            try:
                got += len(b.recv(1 << 20))
            except BlockingIOError:
                time.sleep(0.001)
        hb.beat(link, 7.0)  # (room again: the tail leaves first)
        b.setblocking(True)
        assert b.recv(100) == FRAME and link.tail == b"" and link.last_tx == 7.0
    finally:
        a.close()
        b.close()


def test_quiet_links_get_heartbeats_and_a_silent_one_is_reported_stalled() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    stalled = threading.Event()
    seen: list[tuple[_Link, float]] = []

    def on_stall(link: _Link, silent: float) -> None:
        seen.append((link, silent))
        link.dead = True
        stalled.set()

    talking, silent_link = _Link(a), _Link(c)
    hb = _beats([talking, silent_link], on_stall, interval=0.05, stall=0.5)
    hb.start()
    try:
        b.settimeout(10)
        deadline = time.monotonic() + 10
        while not stalled.is_set() and time.monotonic() < deadline:
            assert b.recv(100).startswith(FRAME)  # (heartbeats keep coming on the quiet link)
            talking.last_rx = time.monotonic()  # (and its peer answers)
        assert stalled.wait(10)
        assert [link for link, _ in seen] == [silent_link] and seen[0][1] > 0.5
        assert not talking.dead
    finally:
        hb.stop()
        hb.join(5)
        for s in (a, b, c, d):
            s.close()
