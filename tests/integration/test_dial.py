"""Making connections (``transport._dial``), which both transports share: real sockets, real
handshakes, a listener served from a thread."""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from typing import Any

import pytest

from tdist._core.errors import DistNetworkError, DistTimeoutError, PeerError
from tdist.transport import _dial, _handshake
from tdist.transport._dial import Dialer, Doorway, Listeners

pytestmark = pytest.mark.timeout(60)

TOKEN = b"t" * 16
SECRET = b"s3cret"


class _Server:
    """Listeners whose connections a ``Doorway`` lets in as id ``my_id`` by ``rule``, served
    from a thread."""

    def __init__(self, my_id: int, rule: Any = lambda _id, token: token == TOKEN, timeout: float = 5.0) -> None:
        self.listeners = Listeners("127.0.0.1", "test server", "tdist-test")
        self.doorway = Doorway(self.listeners, my_id=my_id, secret=SECRET, label="test server", rule=rule, timeout=timeout)
        self.joined: list[tuple[int, str, socket.socket]] = []
        self.changed = threading.Condition()  # (notified when one joins)
        self.done = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        ready = select.poll()
        ready.register(self.doorway.fileno(), select.POLLIN)
        while not self._stop:
            ready.poll(50)
            pending = self.doorway.pending
            for peer, end, _, sock in self.doorway.service():
                with self.changed:
                    self.joined.append((peer, end, sock))
                    self.changed.notify_all()
            if pending > self.doorway.pending:  # (one ended, joined or not)
                self.done.set()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5.0)
        self.doorway.close()
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
        sock, end, same, session = Dialer(
            info, time.monotonic() + 10, my_id=3, token=TOKEN, secret=SECRET, expect=7, label="me", what="peer 7"
        ).run()
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
        Dialer(info, time.monotonic() + 30, my_id=0, token=TOKEN, secret=SECRET, expect=1, label="me", what="rank 1").run()
    assert time.monotonic() - start < 20  # (the failure it guards against: waiting the 30 s out)


def test_dial_refuses_a_listener_that_answers_as_another_id() -> None:
    server = _Server(my_id=5)
    try:
        with pytest.raises(DistNetworkError, match=r"expected rank 4 .* found id 5"):
            Dialer(
                server.listeners.address, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=4,
                label="me", what="rank 4",
            ).run()
    finally:
        server.close()


def test_a_connection_the_rule_refuses_is_not_admitted_and_the_dialler_hears_no_welcome() -> None:
    server = _Server(my_id=1)
    try:
        with pytest.raises((DistNetworkError, DistTimeoutError)):
            Dialer(
                server.listeners.address, time.monotonic() + 10, my_id=0, token=b"x" * 16, secret=SECRET, expect=1,
                label="me", what="rank 1",
            ).run()
        assert server.done.wait(10) and server.joined == []
    finally:
        server.close()


def test_a_silent_stranger_holds_up_nobody_and_is_dropped_at_its_deadline() -> None:
    server = _Server(my_id=1, timeout=0.5)
    try:
        stranger = socket.create_connection(("127.0.0.1", server.listeners.address["port"]))
        try:
            assert stranger.recv(1)  # (its HELLO came: the handshake is under way)
            sock, _, _, _ = Dialer(  # (a member meanwhile gets in at once)
                server.listeners.address, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=1,
                label="me", what="rank 1",
            ).run()
            sock.close()
            stranger.settimeout(10)
            while stranger.recv(4096):  # (the rest of the HELLO, then the close at its deadline)
                pass
            assert server.doorway.pending == 0 and [j[0] for j in server.joined] == [0]
        finally:
            stranger.close()
    finally:
        server.close()


def test_failed_connections_are_logged_one_by_one_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    # whoever can connect cannot flood the log: strangers sending garbage are logged one by one
    # up to _ONE_BY_ONE in a span, then counted, and the count is said when the span (or the
    # door) ends; a stranger on the Unix socket is named by its pid
    caplog.set_level(logging.WARNING, logger="tdist.transport._dial")
    server = _Server(my_id=1)
    strangers = 3 * server.doorway._failures.one_by_one
    try:
        for i in range(strangers):
            if i == 0:  # (the first one on the Unix socket)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0" + server.listeners.address["unix"])
            else:
                s = socket.create_connection(("127.0.0.1", server.listeners.address["port"]))
            with s:
                s.sendall(b"\xff" * _handshake.JOIN.size)  # (a JOIN's size, not one: fails at once)
                s.settimeout(10)
                while s.recv(4096):  # (until the door closes it)
                    pass
    finally:
        server.close()  # (its loop's thread is joined: every failure is logged or counted)
    lines = [r.getMessage() for r in caplog.records if r.name == "tdist.transport._dial"]
    one_by_one = [m for m in lines if "handshake with" in m]
    assert len(one_by_one) == server.doorway._failures.one_by_one, lines
    assert f"pid {os.getpid()}" in one_by_one[0], one_by_one[0]
    assert any("counted, not logged one by one" in m for m in lines), lines
    assert any(f"{strangers - server.doorway._failures.one_by_one} more connections failed" in m for m in lines), lines


def test_more_strangers_than_the_limit_shed_the_oldest_and_a_member_still_gets_in() -> None:
    server = _Server(my_id=1)
    server.doorway._limit = 4
    strangers = []
    try:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", server.listeners.address["port"]))
            s.settimeout(10)
            strangers.append(s)
            assert s.recv(1)
        assert server.doorway.pending <= 4
        shed = 0
        for s in strangers[:6]:  # (the oldest were closed to make room)
            s.recv(4096)
            shed += s.recv(4096) == b""
        assert shed == 6
        sock, _, _, _ = Dialer(
            server.listeners.address, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=1,
            label="me", what="rank 1",
        ).run()
        sock.close()
    finally:
        for s in strangers:
            s.close()
        server.close()


def test_more_members_at_once_than_the_door_holds_all_get_in() -> None:
    # a shed member (its HELLO never came) dials again; none is lost to a full door
    server = _Server(my_id=1)
    server.doorway._limit = 3
    got: dict[int, Any] = {}

    def member(i: int) -> None:
        try:
            sock, _, _, _ = Dialer(
                server.listeners.address, time.monotonic() + 30, my_id=100 + i, token=TOKEN, secret=SECRET,
                expect=1, label=f"member {i}", what="server",
            ).run()
            sock.close()
            got[i] = "in"
        except Exception as exc:  # (reported below)
            got[i] = exc

    threads = [threading.Thread(target=member, args=(i,)) for i in range(12)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert got == {i: "in" for i in range(12)}
        with server.changed:  # (a member is in once it has the WELCOME; the server's loop then takes it)
            assert server.changed.wait_for(lambda: len(server.joined) == 12, 10)
        assert sorted(j[0] for j in server.joined) == [100 + i for i in range(12)]
    finally:
        server.close()


def test_a_peer_that_answers_late_is_waited_for_until_the_deadline_not_a_record_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # a process-group peer sends its HELLO only once its owner is ready (connect_later)
    monkeypatch.setattr(_dial, "_RECORD", 0.2)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    info = {"host": "another host", "addr": "127.0.0.1", "port": listener.getsockname()[1], "unix": "", "pid": 0}
    late = Listeners("127.0.0.1", "late", "tdist-test")
    try:
        # (a listener that is not serviced yet: the connection waits in its backlog)
        with pytest.raises(DistNetworkError, match="timed out"):
            Dialer(info, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=1, label="me", what="rank 1",
                 hello_within=0.2).run()
        info = {**late.address, "host": "another host"}
        door = Doorway(late, my_id=1, secret=SECRET, label="late", rule=lambda _i, t: t == TOKEN)
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(Dialer(
            info, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=1, label="me", what="rank 1").run()))
        t.start()
        ready = select.poll()
        ready.register(door.fileno(), select.POLLIN)
        end = time.monotonic() + 0.6  # (three record limits pass before the door opens)
        while time.monotonic() < end:
            time.sleep(0.05)
        joined: list[Any] = []
        while not joined and time.monotonic() < end + 10:
            ready.poll(100)
            joined += door.service()
        t.join(10)
        assert [j[0] for j in joined] == [0] and len(result) == 1
        result[0][0].close()
        joined[0][3].close()
        door.close()
    finally:
        listener.close()
        late.close()


class _Starved(socket.socket):
    """A listener whose first ``accept`` finds no descriptor."""

    failed = False

    def accept(self) -> Any:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_a_listener_left_alone_for_want_of_descriptors_is_watched_again_when_due() -> None:
    server_listeners = Listeners("127.0.0.1", "starved", "tdist-test")
    server_listeners.tcp = _Starved(socket.AF_INET, socket.SOCK_STREAM, fileno=server_listeners.tcp.detach())
    door = Doorway(server_listeners, my_id=1, secret=SECRET, label="starved", rule=lambda _i, t: t == TOKEN)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(Dialer(
        {**server_listeners.address, "host": "another host"}, time.monotonic() + 20, my_id=0, token=TOKEN,
        secret=SECRET, expect=1, label="me", what="rank 1").run()))
    t.start()
    try:
        ready = select.poll()
        ready.register(door.fileno(), select.POLLIN)
        joined: list[Any] = []
        end = time.monotonic() + 15
        while not joined and time.monotonic() < end:
            ready.poll(max(0.0, min(door.due() - time.monotonic(), 1.0)) * 1000)  # (as owners do)
            joined += door.service()
        assert [j[0] for j in joined] == [0]
        t.join(10)
        assert len(result) == 1
        result[0][0].close()
        joined[0][3].close()
    finally:
        door.close()
        server_listeners.close()


def test_a_dialler_whose_join_went_out_waits_for_the_welcome_past_its_callers_deadline() -> None:
    # The acceptor counts the connection made once it has read the JOIN: a dialler that gave up
    # there, at its caller's deadline, would leave it a connection closing at once (a peer lost,
    # to an RPC agent). A call with a tiny timeout still times out; the connection is made.
    late = Listeners("127.0.0.1", "late", "tdist-test")
    door = Doorway(late, my_id=1, secret=SECRET, label="late", rule=lambda _i, t: t == TOKEN)
    try:
        info = {**late.address, "host": "another host"}
        deadline = time.monotonic() + 0.3
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(Dialer(
            info, deadline, my_id=0, token=TOKEN, secret=SECRET, expect=1, label="me", what="rank 1",
            hello_within=10.0).run()))
        t.start()
        ready = select.poll()
        ready.register(door.fileno(), select.POLLIN)
        while door.pending == 0:  # accepted: its HELLO went
            ready.poll(100)
            assert door.service() == []
        assert ready.poll(10_000)  # the JOIN is in
        while time.monotonic() < deadline + 0.2:  # (the caller's deadline passes before the WELCOME)
            time.sleep(0.05)
        joined: list[Any] = []
        end = time.monotonic() + 10
        while not joined and time.monotonic() < end:
            joined += door.service()
            ready.poll(100)
        t.join(10)
        assert [j[0] for j in joined] == [0] and len(result) == 1, result
        sock = result[0][0]
        sock.sendall(b"ping")  # (one live connection)
        assert joined[0][3].recv(4) == b"ping"
        sock.close()
        joined[0][3].close()
    finally:
        door.close()
        late.close()


def test_a_dial_for_one_call_without_a_secret_joins_only_after_the_hello() -> None:
    # (else the acceptor may take the JOIN, counting the connection made, while the dialler,
    # its caller's deadline past, closes it: a peer lost, to the acceptor); a process group's
    # mesh dial still joins at once (half a round trip less)
    from tdist.transport._protocol import HELLO, JOIN, MAGIC, VERSION

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    info = {"host": "another host", "addr": "127.0.0.1", "port": listener.getsockname()[1], "unix": "", "pid": 0}
    try:
        for hello_within, early in ((10.0, False), (None, True)):
            dialer = Dialer(info, time.monotonic() + 30, my_id=0, token=TOKEN, secret=None, expect=1, label="me",
                            what="rank 1", hello_within=hello_within)
            give_up = time.monotonic() + 10
            while dialer.wants()[1] != select.POLLIN:  # (until connected: its handshake begins)
                assert dialer.step() is None and time.monotonic() < give_up
                time.sleep(0.01)
            theirs, _ = listener.accept()
            readable = select.poll()
            readable.register(theirs.fileno(), select.POLLIN)
            assert bool(readable.poll(200)) is early  # a JOIN before any HELLO?
            if not early:
                theirs.sendall(HELLO.pack(MAGIC, VERSION, 0, b"n" * 32))
                while not readable.poll(10):
                    assert dialer.step() is None and time.monotonic() < give_up
            assert len(theirs.recv(JOIN.size, socket.MSG_WAITALL)) == JOIN.size
            dialer.close()
            theirs.close()
    finally:
        listener.close()
