"""The one connection table (``transport._table``) that both front ends hold their links in:
real sockets, real handshakes, tables served from threads."""

from __future__ import annotations

import gc
import json
import os
import select
import socket
import threading
import time

import pytest

from tdist._core.errors import DistError, DistNetworkError, DistTimeoutError, PeerError
from tdist.store import HashStore
from tdist.transport import Endpoint
from tdist.transport._dial import Dialer, Doorway, Listeners, PeerAddress
from tdist.transport._link import Link
from tdist.transport._table import Table

pytestmark = pytest.mark.timeout(60)

TOKEN = b"t" * 16
SECRET = b"s3cret"


class _Node:
    """A table with listeners whose connections a thread lets in (``admit``)."""

    def __init__(self, my_id: int, admit: bool = True, one_each: bool = False) -> None:
        self.one_each = one_each
        self.table: Table[Link] = Table(Link, my_id=my_id, token=TOKEN, secret=SECRET, label=f"node {my_id}", shut="closed")
        self.listeners = Listeners("127.0.0.1", f"node {my_id}", "tdist-test")
        self.doorway = Doorway(self.listeners, my_id=my_id, secret=SECRET, label=f"node {my_id}", rule=lambda _id, token: token == TOKEN)
        self.admitted = threading.Semaphore(0)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if admit:
            self._thread.start()

    @property
    def address(self) -> PeerAddress:
        return dict(self.listeners.address)

    def _loop(self) -> None:
        ready = select.poll()
        ready.register(self.doorway.fileno(), select.POLLIN)
        while not self._stop:
            ready.poll(20)
            for _ in self.table.admit(self.doorway, self.one_each):
                self.admitted.release()

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(5.0)
        self.doorway.close()
        self.listeners.close()
        for link in self.table.close():
            link.sock.close()
        self.table.ep.close()


def test_connect_dials_a_peer_once_however_many_threads_ask_and_both_ends_are_in_their_tables() -> None:
    a, b = _Node(0), _Node(1)
    try:
        book = {1: b.address}
        got: list[Link] = []
        barrier = threading.Barrier(8)

        def connect() -> None:
            barrier.wait()
            got.append(a.table.connect(1, book.__getitem__, time.monotonic() + 10, "node 1"))

        threads = [threading.Thread(target=connect) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(got) == 8 and all(link is got[0] for link in got)  # one dial, one link
        assert a.table.peers == {1: got[0]} and a.table.by_fd == {got[0].fd: got[0]}
        assert b.admitted.acquire(timeout=10)
        (theirs,) = b.table.links(0)
        assert b.table.peers[0] is theirs and theirs.same_host
        assert not b.admitted.acquire(timeout=0.2)  # (no second connection)
        got[0].sock.sendall(b"ping")  # (the two ends are one connection)
        assert select.select([theirs.sock], [], [], 5)[0] and theirs.sock.recv(4) == b"ping"
    finally:
        a.close()
        b.close()


def test_a_lost_peer_is_named_until_it_is_forgotten_and_an_unknown_one_is_a_peer_error() -> None:
    a, b = _Node(0), _Node(1)
    try:
        book = {1: b.address}
        link = a.table.connect(1, book.__getitem__, time.monotonic() + 10, "node 1")
        why = PeerError("node 0: connection to node 1 was lost: it died", peer=1)
        assert a.table.drop(link, why) is True and link.closed
        assert a.table.drop(link, why) is None  # (out already)
        link.sock.close()
        with pytest.raises(PeerError, match="it died") as info:
            a.table.connect(1, book.__getitem__, time.monotonic() + 10, "node 1")
        assert info.value.peer == 1
        a.table.forget(1)
        again = a.table.connect(1, book.__getitem__, time.monotonic() + 10, "node 1")
        assert again is not link and a.table.peers[1] is again
        with pytest.raises(PeerError, match="cannot reach node 2") as unknown:
            a.table.connect(2, book.__getitem__, time.monotonic() + 10, "node 2")
        assert unknown.value.peer == 2
    finally:
        a.close()
        b.close()


def test_a_peer_with_two_links_loses_only_the_one_that_went_and_sends_on_the_other() -> None:
    a, b = _Node(0, admit=False), _Node(1)
    try:
        first = a.table.connect(1, {1: b.address}.__getitem__, time.monotonic() + 10, "node 1")
        sock_b, sock_a = socket.socketpair()
        second = a.table.add(1, sock_a, "unix", True, None, outbound=False)
        assert a.table.peers[1] is first and a.table.links(1) == [first, second]
        assert a.table.only(1) is None  # (two links: a reader cannot tell which the reply takes)
        assert a.table.drop(first, PeerError("gone", peer=1)) is False
        assert a.table.peers[1] is second and a.table.only(1) is second and 1 not in a.table.lost
        first.sock.close()
        sock_b.close()
    finally:
        a.close()
        b.close()


def test_a_link_taken_for_reading_wakes_no_reader_until_it_is_given_back() -> None:
    a = _Node(0, admit=False)
    ours, theirs = socket.socketpair()
    try:
        link = a.table.add(1, ours, "unix", True, None)
        assert a.table.take(link)
        assert not a.table.take(link)  # (one reader at a time)
        theirs.sendall(b"x")
        assert a.table.ep.poll(0.2) == []  # disarmed: the reader thread is not woken for it
        a.table.give(link)
        assert [fd for fd, _ in a.table.ep.poll(5)] == [link.fd]  # armed again: what came wakes one
        assert a.table.ep.poll(0.1) == []  # (one-shot)
        a.table.drop(link)
        assert not a.table.take(link)  # closed: its descriptor may be another's now
        assert link.rlock.acquire(blocking=False)
    finally:
        theirs.close()
        ours.close()
        a.close()


def _mesh(nodes: list[_Node], deadline: float, missing: dict[int, list[int]], errors: list[BaseException], size: int) -> list[threading.Thread]:
    def run(rank: int) -> None:
        node = nodes[rank]
        try:
            missing[rank] = node.table.mesh(
                {peer: nodes[peer].address for peer in range(rank)},
                node.doorway if rank < size - 1 else None,
                [peer for peer in range(size) if peer != rank],
                deadline,
                lambda: None,
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(nodes))]
    for t in threads:
        t.start()
    return threads


def test_a_mesh_connects_every_pair_once() -> None:
    nodes = [_Node(rank, admit=False) for rank in range(4)]
    try:
        missing: dict[int, list[int]] = {}
        errors: list[BaseException] = []
        for t in _mesh(nodes, time.monotonic() + 20, missing, errors, 4):
            t.join(30)
        assert not errors and missing == {0: [], 1: [], 2: [], 3: []}
        for rank, node in enumerate(nodes):
            assert sorted(node.table.peers) == [q for q in range(4) if q != rank]
            assert all(len(node.table.links(q)) == 1 for q in node.table.peers)
        nodes[3].table.peers[0].sock.sendall(b"hi")  # (the two ends of a pair are one connection)
        theirs = nodes[0].table.peers[3].sock
        assert select.select([theirs], [], [], 5)[0] and theirs.recv(2) == b"hi"
    finally:
        for node in nodes:
            node.close()


def test_a_mesh_names_the_peers_still_missing_at_its_deadline_and_a_stopped_one_closes_its_links() -> None:
    nodes = [_Node(rank, admit=False) for rank in range(2)]
    try:
        # rank 1 of 3 dials rank 0 and waits for rank 2, which never comes
        missing: dict[int, list[int]] = {}
        errors: list[BaseException] = []
        for t in _mesh(nodes, time.monotonic() + 2.5, missing, errors, 3):
            t.join(30)
        assert not errors and missing == {0: [2], 1: [2]}
        assert list(nodes[1].table.peers) == [0]
        link = nodes[1].table.peers[0]
        stop = DistError("destroyed")
        with pytest.raises(DistError, match="destroyed"):
            nodes[1].table.mesh({}, None, [0, 2], time.monotonic() + 10, lambda: stop)
        assert link.closed and nodes[1].table.peers == {} and nodes[1].table.closing
        assert link.sock.fileno() == -1
    finally:
        for node in nodes:
            node.close()


def test_a_closed_table_takes_no_link() -> None:
    a = _Node(0, admit=False)
    ours, theirs = socket.socketpair()
    try:
        a.table.close()
        with pytest.raises(DistNetworkError, match="node 0: closed"):
            a.table.add(1, ours, "unix", True, None)
        assert ours.fileno() < 0  # (add closed it)
    finally:
        theirs.close()
        a.close()



def test_a_second_connection_claiming_a_peer_that_has_one_is_dropped_where_one_each_is_asked() -> None:
    a, b = _Node(0, admit=False), _Node(1, one_each=True)
    socks = []
    try:
        for _ in range(2):  # (two whole handshakes, both claiming id 0)
            sock, *_rest = Dialer(
                b.address, time.monotonic() + 10, my_id=0, token=TOKEN, secret=SECRET, expect=1, label="node 0", what="node 1"
            ).run()
            socks.append(sock)
        assert b.admitted.acquire(timeout=10)
        second = socks[1]
        second.setblocking(True)
        second.settimeout(10)
        assert second.recv(1) == b""  # (dropped: the first one stays)
        assert len(b.table.links(0)) == 1 and not b.admitted.acquire(timeout=0.2)
    finally:
        for sock in socks:
            sock.close()
        a.close()
        b.close()


def _epolls() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "eventpoll" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def test_a_group_whose_mesh_fails_leaves_no_descriptor_open() -> None:
    gc.disable()  # (a leaked epoll set would otherwise close when the collector finds it)
    try:
        before = _epolls()
        store = HashStore()
        store.set("ep/1", json.dumps({"host": "nowhere", "addr": "127.0.0.1", "port": 1, "unix": "", "pid": 1}))
        ep = Endpoint(store, 0, 2, timeout=0.5, connect_later=True)  # (rank 1 never comes)
        with pytest.raises(DistTimeoutError, match=r"no connection with rank\(s\) \[1\]"):
            ep.connected()
        ep.close()
        assert _epolls() == before
        del ep
    finally:
        gc.enable()
