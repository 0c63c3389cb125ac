"""The RPC transport (``transport._messenger``): two or three messengers in one process, real
sockets, real threads."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tdist._core import spin
from tdist._core.errors import AuthenticationError, DistNetworkError, PeerError
from tdist.transport import _handshake
from tdist.transport import _serialization as ser
from tdist.transport._messenger import Messenger

from .._sync import holds_for, wait_until
from ._faults import ShortOnce

TOKEN = b"t" * 16


class Node:
    def __init__(self, my_id: int, book: dict[int, Any], secret: bytes | None = b"s3cret", token: bytes = TOKEN) -> None:
        self.inbox: queue.Queue[tuple[int, int, bytes, Any]] = queue.Queue()
        self.lost: queue.Queue[tuple[int, PeerError, bool]] = queue.Queue()
        self.m = Messenger(
            my_id,
            f"node{my_id}",
            token,
            secret,
            lambda p: book[p],
            lambda p: f"node{p}",
            self._on_message,
            lambda p, e, g: self.lost.put((p, e, g)),
            stall_timeout=1.5,
            heartbeat_interval=0.2,
        )
        book[my_id] = self.m.address

    def _on_message(self, peer: int, tag: int, meta: bytes, payload: Any) -> None:
        if isinstance(payload, list):
            obj = ser.loads_parts(payload[0], payload[1:])
        else:
            obj = ser.loads(payload)
        self.inbox.put((peer, tag, meta, obj))

    def send(self, peer: int, tag: int, obj: Any) -> None:
        self.m.send(peer, tag, b"\x01", ser.dumps(obj), time.monotonic() + 10)

    def get(self, timeout: float = 10.0) -> tuple[int, int, bytes, Any]:
        return self.inbox.get(timeout=timeout)


@pytest.fixture
def pair() -> Iterator[tuple[Node, Node]]:
    book: dict[int, Any] = {}
    a, b = Node(0, book), Node(1, book)
    yield a, b
    a.m.close()
    b.m.close()


def test_messages_both_ways_with_tensors(pair: tuple[Node, Node]) -> None:
    a, b = pair
    for i in range(50):
        a.send(1, i, {"i": i, "t": torch.full((3,), float(i))})
    seen = set()
    for _ in range(50):
        # every message arrives once, intact; two pollers may hand over two batches in either
        # order (RPC does not depend on the order of deliveries)
        peer, tag, meta, obj = b.get()
        assert (peer, meta, obj["i"]) == (0, b"\x01", tag)
        assert torch.equal(obj["t"], torch.full((3,), float(tag)))
        seen.add(tag)
    assert seen == set(range(50))
    b.send(0, 7, "back")  # on the connection a opened
    assert a.get()[1:] == (7, b"\x01", "back")


def test_large_tensor_by_cross_memory_copy_and_buffer_reuse(pair: tuple[Node, Node]) -> None:
    a, b = pair
    # 16 MiB: cross-memory copy on one host. Made and compared with numpy: a large torch op
    # here would start torch's OpenMP pool in the pytest process, and processes forked from it
    # by later tests would hang in their first parallel torch op.
    x = torch.from_numpy(np.random.default_rng(0).random(4 << 20, dtype=np.float32))
    for _ in range(3):
        a.send(1, 1, x)
        got = b.get()[3]
        assert np.array_equal(got.numpy(), x.numpy())
        del got  # the pooled buffer is free again for the next message


def test_reply_read_by_the_waiting_thread(pair: tuple[Node, Node]) -> None:
    a, b = pair
    a.send(1, 1, "ping")
    b.get()
    token = a.m.claim(1)
    assert token is not None
    b.send(0, 2, "pong")
    assert a.m.read_until(1, lambda: not a.inbox.empty(), time.monotonic() + 5, claimed=token)
    assert a.get(0)[3] == "pong"


def test_a_closed_peer_is_reported_once_and_later_sends_fail_fast(pair: tuple[Node, Node]) -> None:
    a, b = pair
    a.send(1, 1, "hello")
    b.get()
    b.m.close()
    peer, err, graceful = a.lost.get(timeout=5)
    assert peer == 1 and graceful and "node1" in str(err)
    with pytest.raises(PeerError, match="node1"):
        a.send(1, 2, "anyone?")
    assert a.lost.empty()


def test_a_silent_peer_is_called_stalled(pair: tuple[Node, Node]) -> None:
    a, b = pair
    a.send(1, 1, "hello")
    b.get()
    b.m._heartbeats.stop()  # b stops sending heartbeats, as a stopped process would
    peer, err, graceful = a.lost.get(timeout=10)
    assert peer == 1 and not graceful and "stalled" in str(err)


def test_wrong_secret_is_refused_before_anything_is_read_and_the_server_goes_on() -> None:
    book: dict[int, Any] = {}
    a = Node(0, book)
    try:
        addr = a.m.address
        for secret in (b"wrong", None):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect("\0" + addr["unix"])
            with pytest.raises(AuthenticationError):
                _handshake.connect(s, 5, TOKEN, secret, "node0")
            s.close()
        # garbage instead of a handshake, then a pickle bomb that must never be unpickled
        s = socket.create_connection((addr["addr"], addr["port"]), timeout=5)
        s.sendall(os.urandom(200) + b"cos\nsystem\n(S'echo pwned'\ntR.")
        s.settimeout(5)
        _expect_dropped(s)
        _still_serving(a, book)
    finally:
        a.m.close()


def _expect_dropped(s: socket.socket) -> None:
    """The other side closes ``s`` (or never answers)."""
    with pytest.raises((ConnectionResetError, TimeoutError, OSError)):
        while s.recv(4096):
            pass
        raise ConnectionResetError("closed")
    s.close()


def _still_serving(a: Node, book: dict[int, Any]) -> None:
    """A well-behaved newcomer still gets its message through to ``a``."""
    b = Node(1, book)
    try:
        b.send(0, 3, "still serving")
        assert a.get()[3] == "still serving"
    finally:
        b.m.close()


def test_a_connection_from_another_job_is_refused() -> None:
    book: dict[int, Any] = {}
    a = Node(0, book)
    other = Node(1, book, token=b"x" * 16)
    try:
        try:
            other.send(0, 1, "hi")  # refused during the handshake
        except (PeerError, DistNetworkError):
            pass
        with pytest.raises(queue.Empty):  # never delivered (watched for a second)
            print("delivered:", a.get(timeout=1.0))
        assert not a.m.is_connected(1)
    finally:
        other.m.close()
        a.m.close()


def test_an_authenticated_peer_that_breaks_the_framing_is_dropped_and_the_rest_go_on() -> None:
    from tdist.transport._protocol import FRAME_HEADER

    book: dict[int, Any] = {}
    a = Node(0, book)
    try:
        addr = a.m.address
        for bad in (FRAME_HEADER.pack(99, 0, 1, 0), FRAME_HEADER.pack(1, 0, 1, 1 << 41)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect("\0" + addr["unix"])
            _handshake.connect(s, 7, TOKEN, b"s3cret", "node0")
            s.sendall(bad)  # an unknown frame kind, then an absurd payload length
            _expect_dropped(s)
        assert a.inbox.empty()
        _still_serving(a, book)
    finally:
        a.m.close()


class Answering(Node):
    """A node whose poller answers every message at once (as an RPC callee does), so that the
    poller then waits on the connection for the next request (``_POLLER_SPIN``)."""

    def __init__(self, my_id: int, book: dict[int, Any], quiet: bool = True) -> None:
        super().__init__(my_id, book)
        self.m.quiet = lambda: quiet

    def _on_message(self, peer: int, tag: int, meta: bytes, payload: Any) -> None:
        super()._on_message(peer, tag, meta, payload)
        self.m.send(peer, tag, b"\x01", ser.dumps(("re", tag)), time.monotonic() + 10, answer=True)


def _conn_to(node: Node, peer: int) -> Any:
    return node.m._table.links(peer)[0]


@contextlib.contextmanager
def _answering(monkeypatch: pytest.MonkeyPatch, spin: float, quiet: bool, ping: bool = True) -> Iterator[tuple[Node, Answering]]:
    """Node 0 and an answering node 1 whose pollers wait ``spin`` seconds for the next request
    (``quiet``: nothing else runs there); with ``ping``, one request answered already."""
    from tdist.transport import _messenger

    monkeypatch.setattr(_messenger, "_POLLER_SPIN", spin)
    book: dict[int, Any] = {}
    a, b = Node(0, book), Answering(1, book, quiet)
    try:
        if ping:
            a.send(1, 1, "ping")
            a.get()
        yield a, b
    finally:
        a.m.close()
        b.m.close()


def test_requests_that_come_while_a_poller_waits_for_them_are_all_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.transport import _messenger

    caught: list[bool] = []  # (each wait of the answering poller: whether a request came in it)
    await_next = _messenger.Messenger._await_next

    def record(self: Any, c: Any, held: bool = False) -> Any:
        got = await_next(self, c, held)
        caught.append(got is not None)
        return got

    monkeypatch.setattr(_messenger.Messenger, "_await_next", record)
    with _answering(monkeypatch, 0.002, quiet=True, ping=False) as (a, b):
        for i in range(300):  # one at a time, as rpc_sync does: most arrive while b polls
            a.send(1, i, i)
            assert a.get()[1:] == (i, b"\x01", ("re", i))
        c = _conn_to(b, 0)
        # requests came while b waited for them (a loaded host may have paused its waits since:
        # eight late ones in a row do, so the budget's state at the end says nothing)
        assert sum(caught) >= 10, (len(caught), sum(caught))
        # the wait ends (its 2 ms): the connection is armed again for any poller
        wait_until(lambda: not c.spinner and not c.rlock.locked(), 10, "b's poller stops waiting on the connection")
        a.send(1, 999, "late")
        assert a.get()[3] == ("re", 999)
        assert b.inbox.qsize() == 301


def test_a_waiting_poller_lets_go_of_the_connection_for_a_thread_that_claims_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with _answering(monkeypatch, 5.0, quiet=True) as (a, b):
        c = _conn_to(b, 0)
        deadline = time.monotonic() + 5
        while not c.spinner and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c.spinner, "b's poller should be waiting on the connection"
        t0 = time.monotonic()
        token = b.m.claim(0)
        while token is None and time.monotonic() - t0 < 4:  # (a loaded host may not run the poller at once)
            token = b.m.claim(0)
        assert token is not None and time.monotonic() - t0 < 4  # (not once the 5 s wait ended)
        b.inbox.get(timeout=1)  # the ping
        a.send(1, 2, "read by the claiming thread")
        assert b.m.read_until(0, lambda: not b.inbox.empty(), time.monotonic() + 5, claimed=token)
        assert b.get(0)[3] == "read by the claiming thread"
        a.send(1, 3, "and by pollers again")
        assert b.get()[3] == "and by pollers again"


def test_no_poller_waits_on_a_connection_while_other_work_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    with _answering(monkeypatch, 5.0, quiet=False) as (a, b):
        c = _conn_to(b, 0)
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            assert not c.spinner
            time.sleep(0.001)
        a.send(1, 2, "still served")
        assert a.get()[3] == ("re", 2)


def test_a_poller_does_not_wait_on_a_connection_whose_requests_come_seldom(monkeypatch: pytest.MonkeyPatch) -> None:
    with _answering(monkeypatch, 0.005, quiet=True, ping=False) as (a, b):
        # answered, then silence longer than a wait (a gap each, the first excepted): after
        # WINDOW + 1 of them on an idle host; more where a loaded host kept b's poller from
        # waiting until a request was in already (which counts as a quick one)
        for i in range(spin.WINDOW * 8):
            a.send(1, i, i)
            a.get()
            time.sleep(0.03)
            c = _conn_to(b, 0)
            if i >= spin.WINDOW and c.gaps.seconds() == 0:
                break
        assert c.gaps.seconds() == 0  # (its last requests all came late)
        a.send(1, 100, "seldom")
        assert a.get()[3] == ("re", 100)
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            assert not c.spinner
            time.sleep(0.0005)
        for i in range(40):  # (the first comes after the watch above:) a request soon after its
            a.send(1, 200 + i, i)  # answer: b waits for the next one again (soon: within the
            a.get()  # budget, which a loaded host may miss now and then)
            if i >= 1 and c.gaps.seconds() > 0:
                break
        assert c.gaps.seconds() > 0


class SlowAnswering(Answering):
    """An answering node whose every request computes for ``job`` seconds first."""

    def __init__(self, my_id: int, book: dict[int, Any], job: float) -> None:
        super().__init__(my_id, book)
        self.job = job

    def _on_message(self, peer: int, tag: int, meta: bytes, payload: Any) -> None:
        end = time.monotonic() + self.job
        while time.monotonic() < end:  # (computing, as a parameter server's forward does)
            pass
        super()._on_message(peer, tag, meta, payload)


def test_a_poller_does_not_wait_for_the_next_request_after_one_that_ran_longer_than_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that computed for longer than the poller's budget leaves torch's intra-op
    threads spinning and its caller computing: the poller sleeps instead of polling then (it
    would take one core of two). A quick request is followed by a wait as before."""
    from tdist.transport import _messenger

    monkeypatch.setattr(_messenger, "_POLLER_SPIN", 0.05)
    book: dict[int, Any] = {}
    a, b = Node(0, book), SlowAnswering(1, book, job=0.1)
    try:
        for i in range(3):
            a.send(1, i, i)
            assert a.get()[3] == ("re", i)
        c = _conn_to(b, 0)
        assert c.gaps.seconds() > 0  # (its requests come soon after their answers...)
        # (...but what ran was long: b's poller sleeps)
        holds_for(lambda: not c.spinner, 0.2, "b's poller waits for a request after a long one", interval=0.001)
        b.job = 0.0
        a.send(1, 9, "quick")
        assert a.get()[3] == ("re", 9)
        wait_until(lambda: c.spinner, 5, "after a quick request the poller waits for the next", interval=0.0005)
    finally:
        a.m.close()
        b.m.close()


class Holding(Node):
    """A node whose handler of tag 1 runs until ``release`` is set (at most ``job`` seconds), as
    a request run by the poller that read it; tag 2 sets ``release``. Records which thread
    delivered each tag."""

    def __init__(self, my_id: int, book: dict[int, Any], job: float) -> None:
        super().__init__(my_id, book)
        self.job = job
        self.release = threading.Event()
        self.started = threading.Event()
        self.running = False  # the job of tag 1 runs
        self.threads: dict[int, str] = {}
        self.during_job: dict[int, bool] = {}  # whether each tag was delivered while the job ran

    def _on_message(self, peer: int, tag: int, meta: bytes, payload: Any) -> None:
        self.threads[tag] = threading.current_thread().name
        self.during_job[tag] = self.running
        if tag == 1:
            self.running = True
            self.started.set()
            self.release.wait(self.job)
            self.running = False
        elif tag == 2:
            self.release.set()
        super()._on_message(peer, tag, meta, payload)


@contextlib.contextmanager
def _holding(monkeypatch: pytest.MonkeyPatch, hold_max: float, job: float) -> Iterator[tuple[Node, Holding]]:
    from tdist.transport import _messenger

    monkeypatch.setattr(_messenger, "_HOLD_MAX", hold_max)
    book: dict[int, Any] = {}
    a, b = Node(0, book), Holding(1, book, job)
    try:
        yield a, b
    finally:
        a.m.close()
        b.m.close()


def test_a_message_that_comes_while_its_connection_is_held_is_read_by_the_same_poller(monkeypatch: pytest.MonkeyPatch) -> None:
    with _holding(monkeypatch, hold_max=2.0, job=0.2) as (a, b):
        a.send(1, 1, "a short job")
        assert b.started.wait(5)
        a.send(1, 3, "comes while the job runs")  # (the job takes 0.2 s)
        assert [b.get()[1], b.get()[1]] == [1, 3]
        assert not b.during_job[3]  # no other poller woke for it: the connection is held
        assert b.threads[3] == b.threads[1]  # read on by the poller that ran the job


def test_a_held_connection_is_armed_again_when_its_job_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    with _holding(monkeypatch, hold_max=0.02, job=10.0) as (a, b):
        for _ in range(2):  # the second time after the guard slept
            b.release.clear()
            b.started.clear()
            a.send(1, 1, "blocks until the next message")
            assert b.started.wait(5)
            t0 = time.monotonic()
            a.send(1, 2, "releases it")
            assert b.get()[1] == 2
            # read by another poller once the guard armed it (not once the 10 s job ended)
            assert time.monotonic() - t0 < 5
            assert b.get()[1] == 1
            assert b.threads[2] != b.threads[1]
            c = _conn_to(b, 0)
            assert c.hold_off > time.monotonic() - 1.0  # its jobs block: not held for a while
            # the guard sleeps once no holds happen, and wakes for the next one
            deadline = time.monotonic() + 5
            while b.m._guard_on and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not b.m._guard_on, "the guard should sleep when nothing is held"
            time.sleep(max(0.0, c.hold_off - time.monotonic()) + 0.01)


def test_send_returns_once_the_peer_has_copied_so_the_sender_may_overwrite_at_once(pair: tuple[Node, Node]) -> None:
    a, b = pair
    x = np.zeros(4 << 20, dtype=np.float32)  # 16 MiB: copied out of a's memory by b
    for i in range(10):
        x.fill(i)
        a.send(1, i, torch.from_numpy(x))
        x.fill(-1)  # the moment send returns
        got = b.get()[3].numpy()
        assert got.min() == got.max() == i


def test_a_heartbeat_written_in_part_is_finished_before_the_next_frame(pair: tuple[Node, Node]) -> None:
    a, b = pair
    a.send(1, 1, "hello")
    assert b.get()[3] == "hello"
    c = a.m._table.peers[1]
    short = c.sock = ShortOnce(c.sock)  # type: ignore[assignment]
    assert short.cut.wait(5)  # a heartbeat went out in part
    for i in range(3):
        a.send(1, 2 + i, {"after": i})
        assert b.get()[3] == {"after": i}
    assert b.lost.empty() and a.lost.empty()  # nobody was blamed for breaking the protocol
