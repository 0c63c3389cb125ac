"""Making connections (``transport._dial``), which both transports share: real sockets, real
handshakes, a listener served from a thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from tdist._core.errors import DistNetworkError, DistTimeoutError, PeerError
from tdist._core.floods import Admission
from tdist.transport._dial import Listeners, admit, dial

pytestmark = pytest.mark.timeout(60)

TOKEN = b"t" * 16
SECRET = b"s3cret"


class _Server:
    """Listeners whose accepted connections are admitted as id ``my_id`` by ``rule``."""

    def __init__(self, my_id: int, rule: Any = lambda _id, token: token == TOKEN) -> None:
        self.listeners = Listeners("127.0.0.1", "test server", "tdist-test")
        self.joined: list[tuple[int, str, socket.socket]] = []
        self.done = threading.Event()

        def run(sock: socket.socket, addr: Any) -> None:
            got = admit(sock, addr, my_id=my_id, secret=SECRET, timeout=5.0, label="test server", rule=rule)
            if got is not None:
                self.admission.keep(sock)
                self.joined.append((got[0], got[1], sock))
            self.done.set()

        self.admission = Admission("test server", run)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import selectors

        with selectors.DefaultSelector() as sel:
            for s in self.listeners.sockets:
                sel.register(s, selectors.EVENT_READ)
            while not self._stop:
                for key, _ in sel.select(0.05):
                    self.listeners.accept(key.fileobj, self.admission)  # type: ignore[arg-type]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5.0)
        self.admission.close()
        self.listeners.close()
        for _, _, s in self.joined:
            s.close()


@pytest.mark.parametrize("same_host", [True, False])
def test_dial_reaches_the_peer_by_unix_socket_on_its_host_and_by_tcp_from_another(same_host: bool) -> None:
    server = _Server(my_id=7)
    try:
        info = dict(server.listeners.address)
        if not same_host:
            info["host"] = "another host"
        sock, end, same, session = dial(
            info, time.monotonic() + 10, my_id=3, token=TOKEN, secret=SECRET, expect=7, label="me", what="peer 7"
        )
        try:
            assert server.done.wait(10)
            assert same is same_host and (end == "unix") is same_host and session is not None
            assert sock.family == (socket.AF_UNIX if same_host else socket.AF_INET)
            peer, their_end, theirs = server.joined[0]
            assert peer == 3 and (their_end == "unix") is same_host
            sock.sendall(b"ping")  # (the two ends are one connection)
            assert theirs.recv(4) == b"ping"
        finally:
            sock.close()
    finally:
        server.close()


def test_dial_says_that_a_peer_whose_listener_is_gone_has_shut_down_at_once_not_at_its_deadline() -> None:
    server = _Server(my_id=1)
    info = dict(server.listeners.address)
    server.close()
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"refused the connection .* shut down or died"):
        dial(info, time.monotonic() + 30, my_id=0, token=TOKEN, secret=SECRET, expect=1, label="me", what="rank 1")
    assert time.monotonic() - start < 20  # (the failure it guards against: waiting the 30 s out)


def test_dial_refuses_a_listener_that_answers_as_another_id() -> None:
    server = _Server(my_id=5)
    try:
        with pytest.raises(DistNetworkError, match=r"expected rank 4 .* found id 5"):
            dial(
                server.listeners.address, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=4,
                label="me", what="rank 4",
            )
    finally:
        server.close()


def test_a_connection_the_rule_refuses_is_not_admitted_and_the_dialler_hears_no_welcome() -> None:
    server = _Server(my_id=1)
    try:
        with pytest.raises((DistNetworkError, DistTimeoutError)):
            dial(
                server.listeners.address, time.monotonic() + 10, my_id=0, token=b"x" * 16, secret=SECRET, expect=1,
                label="me", what="rank 1",
            )
        assert server.done.wait(10) and server.joined == []
    finally:
        server.close()
