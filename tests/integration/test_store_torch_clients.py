"""Clients of torch's own ``TCPStore`` (C++, its own protocol) served by tdist's store server.

torch's client is the real one (``torch.distributed.TCPStore(..., is_master=False)``); each
test runs it against a tdist server over real sockets. The first test runs the same calls
against torch's own server too and compares every answer.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as torch_dist

import tdist
from tdist.store._server import StoreServer
from tdist.store._torch_wire import MAGIC

from .._sync import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreServer]:
    """An open tdist server in a process of its own (torch's ``queue_len`` holds the GIL
    while it waits for its answer: a server in a thread of this process would never give it)."""
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    srv = StoreServer("127.0.0.1", 0)
    srv.start("process")
    # (a thread of this process serves until the process takes over: wait for that, or a
    # queue_len sent meanwhile holds the GIL that thread needs, for good; a loaded host's
    # slow start of the process hung the suite so)
    assert srv.pid is not None
    yield srv
    srv.stop()


@pytest.fixture
def thread_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreServer]:
    """An open tdist server in a thread of this process, whose waiters a test can see
    (``_parked``); for calls of torch's client that let the GIL go while they wait."""
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    srv = StoreServer("127.0.0.1", 0)
    srv.start("thread")
    yield srv
    srv.stop()


def torch_client(port: int, timeout: float = 5.0) -> Any:
    return torch_dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=timeout))


def outcome(call: Callable[[], Any]) -> Any:
    """What a call of torch's client gave: its value, or its error's type and message."""
    try:
        return call()
    except Exception as exc:  # (compared as such: the same error on both servers)
        return type(exc).__name__, str(exc).split(",")[0]


def exercise(c: Any) -> list[Any]:
    """Every call of torch's client, on keys it made, in an order that covers each answer."""
    return [
        outcome(lambda: c.set("k", "v")),
        outcome(lambda: c.get("k")),
        outcome(lambda: c.add("n", 5)),
        outcome(lambda: c.add("n", -7)),
        outcome(lambda: c.compare_set("k", "v", "w")),
        outcome(lambda: c.compare_set("k", "no", "x")),
        outcome(lambda: c.compare_set("fresh", "", "f")),
        outcome(lambda: c.compare_set("absent", "e", "x")),
        outcome(lambda: c.check(["k", "n"])),
        outcome(lambda: c.check(["k", "nothing"])),
        outcome(lambda: c.wait(["k", "fresh"])),
        outcome(lambda: c.wait(["never"], timedelta(milliseconds=200))),
        outcome(lambda: c.get("k")),  # (the connection is in step after the cancelled wait)
        outcome(lambda: c.num_keys()),
        outcome(lambda: c.delete_key("fresh")),
        outcome(lambda: c.delete_key("fresh")),
        outcome(lambda: c.append("a", "x")),
        outcome(lambda: c.append("a", "yz")),
        outcome(lambda: c.multi_get(["a", "n", "k"])),
        outcome(lambda: c.multi_set(["p", "q"], ["1", "2"])),
        outcome(lambda: [c.get("p"), c.get("q")]),
        outcome(lambda: c.queue_push("queue", "one")),
        outcome(lambda: c.queue_push("queue", b"\x00two")),
        outcome(lambda: c.queue_len("queue")),
        outcome(lambda: c.check(["queue"])),
        outcome(lambda: c.queue_pop("queue")),
        outcome(lambda: c.queue_pop("queue", block=False)),
        outcome(lambda: c.queue_pop("queue", block=False)),
        outcome(lambda: c.queue_len("queue")),
        outcome(lambda: c.set("big", b"\xff" * 300_000)),
        outcome(lambda: len(c.get("big"))),
        outcome(lambda: c.num_keys()),
        outcome(lambda: sorted(c.list_keys())),
        outcome(lambda: c.get("k")),  # (in step after the list)
    ]


def test_torchs_client_gets_from_a_tdist_server_what_it_gets_from_torchs(server: StoreServer) -> None:
    theirs = torch_dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    expected = exercise(torch_client(theirs.port, timeout=1.0))
    got = exercise(torch_client(server.port, timeout=1.0))
    assert got == expected
    # (the cancelled wait timed out, as on torch's server, and queue_pop on empty raised)
    assert expected[11][0] == "DistStoreError" and expected[27][0] == "QueueEmptyError"


def test_torchs_client_lists_the_keys_it_can_name(server: StoreServer) -> None:
    """``list_keys`` of torch's client: its own keys and tdist's under its namespace, never
    tdist's own. (A server in another process: torch's client holds the GIL while it lists.)"""
    theirs = torch_client(server.port)
    ours = tdist.TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    theirs.set("from_torch", "t")
    ours.set("torch:/from_tdist", b"d")
    ours.set("not_theirs", b"x")
    assert ours.check(["not_theirs"])  # (a round trip: its quiet sets are served by now)
    assert sorted(theirs.list_keys()) == ["from_tdist", "from_torch"]
    assert theirs.get("from_torch") == b"t"  # (in step after the list)


def test_tdist_and_torch_clients_share_the_keys_torchs_client_names(thread_server: StoreServer) -> None:
    srv = thread_server
    theirs = torch_client(srv.port)
    ours = tdist.TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5))
    theirs.set("from_torch", "t")
    # (torch's client puts "/" before its keys; the server, "torch:" before theirs)
    assert ours.get("torch:/from_torch") == b"t" and not ours.check(["from_torch", "/from_torch"])
    ours.set("torch:/from_tdist", b"d")
    assert theirs.get("from_tdist") == b"d"
    assert ours.add("torch:/count", 2) == 2 and theirs.add("count", 3) == 5
    assert ours.check(["init/"])  # (its own, added as it connected)
    ours.set("/not_theirs", b"x")
    assert not theirs.check(["not_theirs"]) and theirs.num_keys() == 4  # (init/ and its own 3)

    # a torch client waiting on a key is answered when a tdist client sets it
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(theirs.get("later")))
    waiter.start()
    wait_until(lambda: "torch:/later" in srv._parked, 10, "torch's get waits on the server")
    ours.set("torch:/later", b"L")
    waiter.join(10)
    assert got == [b"L"]


def test_a_push_wakes_one_of_torchs_waiting_pops(thread_server: StoreServer) -> None:
    # (torch's blocking pop is a WAIT, then a POP: a pop whose WAIT comes after the push finds
    # the item there and pops too, and one of the two finds the queue empty, as on torch's own
    # server; so both wait first. A server in a thread, whose waiters are in sight: torch's
    # queue_pop lets the GIL go while it waits.)
    srv = thread_server
    a, b = torch_client(srv.port, timeout=10), torch_client(srv.port, timeout=10)
    ours = tdist.TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5))
    got: list[Any] = []
    pops = [threading.Thread(target=lambda c=c: got.append(outcome(lambda: c.queue_pop("jobs")))) for c in (a, b)]
    for t in pops:
        t.start()
    wait_until(lambda: len(srv._parked.get("torch:/jobs", ())) == 2, 10, "both pops wait on the server")
    ours.queue_push("torch:/jobs", b"first")
    wait_until(lambda: got, 10, "one pop has its item")
    ours.queue_push("torch:/jobs", b"second")  # (the other waited on: it did not find the queue empty)
    for t in pops:
        t.join(10)
    assert sorted(got, key=repr) == [b"first", b"second"], got


def raw_torch_connection(port: int) -> socket.socket:
    """A connection that opens as torch's client does (VALIDATE, then PING)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"\x00" + struct.pack("<I", MAGIC) + b"\x0d" + struct.pack("<I", 77))
    assert sock.recv(4) == struct.pack("<I", 77)
    return sock


def torch_set(key: bytes, value: bytes) -> bytes:
    return b"\x01" + struct.pack("<Q", len(key)) + key + struct.pack("<Q", len(value)) + value


def torch_get(key: bytes) -> bytes:
    return b"\x03" + struct.pack("<Q", len(key)) + key


def read_value(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 8:
        head += sock.recv(8 - len(head))
    (n,) = struct.unpack("<Q", head)
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_store_with_a_secret_keeps_torchs_clients_off_its_keys(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    caplog.set_level(logging.WARNING, logger="tdist.store._server")
    # refused by default: torch's client proves no secret
    guarded = StoreServer("127.0.0.1", 0, secret="s3cret")
    guarded.start("thread")
    try:
        with pytest.raises(Exception):  # noqa: B017 (torch's client: a lost connection, in its words)
            torch_client(guarded.port, timeout=1.0)
        assert "refused a client of torch's TCPStore" in caplog.text
        ours = tdist.TCPStore("127.0.0.1", guarded.port, timeout=timedelta(seconds=5), secret="s3cret")
        ours.set("after", b"ok")  # (the server is up, its clients unaffected)
        assert ours.get("after") == b"ok"
    finally:
        guarded.stop()

    # served when asked (tdist run's store), in a namespace of their own
    shared = StoreServer("127.0.0.1", 0, secret="s3cret", torch_clients=True)
    shared.start("process")
    try:
        ours = tdist.TCPStore("127.0.0.1", shared.port, timeout=timedelta(seconds=5), secret="s3cret")
        ours.set("job/token", b"private")
        ours.set("/job/token", b"private too")  # (a tdist key that begins with "/", as torch's do)
        theirs = torch_client(shared.port)
        theirs.set("k", "v")
        assert theirs.get("k") == b"v" and ours.get("torch:/k") == b"v"
        assert not theirs.check(["job/token"])
        for name in (b"job/token", b"/job/token"):  # (a raw client names any key: it stays in its namespace)
            sock = raw_torch_connection(shared.port)
            sock.sendall(torch_get(name))
            assert read_value(sock) == b""
            sock.sendall(torch_set(name, b"mine"))
            sock.sendall(torch_get(name))
            assert read_value(sock) == b"mine"
            sock.close()
        assert ours.get("job/token") == b"private" and ours.get("/job/token") == b"private too"
        assert ours.get("torch:job/token") == b"mine"
        sock = raw_torch_connection(shared.port)
        sock.sendall(torch_get(b"\xff\xfe"))  # (not UTF-8: refused, the connection goes)
        assert closed(sock)
        sock.close()
        assert theirs.get("k") == b"v"
    finally:
        shared.stop()


def test_bad_openings_and_queries_cost_one_connection(server: StoreServer) -> None:
    ours = tdist.TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    for opening in (b"GET / HTTP/1.1\r\n\r\n", b"\x00\x01\x02\x03\x04", b"TDS\x02"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(opening)
        assert closed(sock), opening
        sock.close()
    for query in (
        b"\x63",  # an unknown query type
        b"\x01" + struct.pack("<Q", 1 << 40),  # a key larger than the server takes
        b"\x06" + struct.pack("<Q", 1 << 30),  # a wait on too many keys
        b"\x04" + struct.pack("<Q", 2) + b"/k" + struct.pack("<q", 1),  # add to a key holding text
    ):
        ours.set("torch:/k", b"text")
        sock = raw_torch_connection(server.port)
        sock.sendall(query)
        assert closed(sock), query
        sock.close()
    ours.set("torch:/still", b"up")
    assert torch_client(server.port).get("still") == b"up"


def test_a_torch_client_waiting_moves_with_the_server_to_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    gate = threading.Event()
    monkeypatch.setattr(StoreServer, "handover_gate", gate)
    srv = StoreServer("127.0.0.1", 0)
    srv.start("process")
    try:
        theirs = torch_client(srv.port, timeout=20)
        theirs.set("before", "b")
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(outcome(lambda: theirs.get("during"))))
        waiter.start()
        wait_until(lambda: "torch:/during" in srv._parked, 10, "torch's get waits on the server's thread")
        half = raw_torch_connection(srv.port)
        query = torch_get(b"/before")
        half.sendall(query[:5])  # (half a query in when the server moves)
        wait_until(lambda: any(c.queries is not None and c.queries.buffered == 5 for c in srv._conns), 10, "half a query in")
        gate.set()
        srv._send(b".")
        assert srv.pid is not None and srv._handed_over
        half.sendall(query[5:])
        assert read_value(half) == b"b"
        ours = tdist.TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5))
        ours.set("torch:/during", b"d")
        waiter.join(10)
        assert got == [b"d"]
        half.close()
    finally:
        srv.stop()


def test_tdists_client_of_torchs_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.store._rendezvous import _agent_is_torchs
    from tdist.store._tcp import TorchServerError

    monkeypatch.delenv("TDIST_SECRET", raising=False)
    monkeypatch.delenv("TDIST_AGENT_STORE", raising=False)
    theirs = torch_dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    # tdist's client, as code ported from torch's makes it (torchrun's agent store): served
    # through torch's client, which torch's server answers at once (no waiting out the timeout)
    ours = tdist.TCPStore("127.0.0.1", theirs.port, 2, timeout=timedelta(seconds=600))
    assert ours.transport == "torch"
    ours.set("k", "v")
    assert theirs.get("k") == b"v" and ours.get("k") == b"v"
    assert ours.add("n", 2) == 2 and ours.compare_set("k", "v", "w") == b"w"
    assert ours.check(["k", "n"]) and not ours.check(["absent"])
    with pytest.raises(tdist.DistStoreError):  # (torch's timeout, as tdist's error: torch's too)
        ours.wait(["absent"], timedelta(milliseconds=100))
    assert ours.clone().get("k") == b"w"
    ours.close()
    with pytest.raises(tdist.DistNetworkError, match="closed"):
        ours.get("k")
    # a client that holds a secret refuses a server that asks for none, torch's among them
    with pytest.raises(TorchServerError, match="is torch's own TCPStore server"):
        tdist.TCPStore("127.0.0.1", theirs.port, timeout=timedelta(seconds=600), secret="s3cret")
    assert _agent_is_torchs("127.0.0.1", theirs.port)
    for secret in (None, "s3cret"):
        srv = StoreServer("127.0.0.1", 0, secret=secret)
        srv.start("thread")
        try:
            assert not _agent_is_torchs("127.0.0.1", srv.port)
        finally:
            srv.stop()
