"""TCPStore over real sockets: API semantics, errors, authentication, bad input, failures."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import tdist as dist
from tdist._core.errors import (
    AuthenticationError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
    StoreTimeoutError,
    StoreValueError,
)
from tdist.store._protocol import (
    HEADER,
    OPENING,
    FrameDecoder,
    Op,
    Status,
    encode_frame,
    encode_int,
)

from .._sync import read_line, wait_inside, wait_until, when_inside

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["process", "thread"])
def master(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    monkeypatch.setenv("TDIST_STORE_SERVER", request.param)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    yield store
    store.close()


def client_of(store: dist.TCPStore, **kw: object) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=5), **kw)  # type: ignore[arg-type]


def raw_connect(port: int) -> tuple[socket.socket, FrameDecoder]:
    """A bare TCP connection that has read the server's HELLO."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(OPENING)  # (over TCP a tdist client speaks first)
    dec = FrameDecoder()
    while (hello := dec.next_frame()) is None:
        dec.feed(sock.recv(4096))
    assert hello.code == Op.HELLO
    return sock, dec


def read_frame(sock: socket.socket, dec: FrameDecoder) -> object:
    while (frame := dec.next_frame()) is None:
        data = sock.recv(65536)
        if not data:
            return None
        dec.feed(data)
    return frame


def test_documented_examples(master: dist.TCPStore) -> None:
    # torch's docs: one internal key coordinates the workers, so one set gives 2 keys
    master.set("first_key", "first_value")
    assert master.num_keys() == 2
    assert master.get("first_key") == b"first_value"
    assert master.add("counter", 1) == 1
    assert master.add("counter", 6) == 7
    assert master.get("counter") == b"7"
    assert master.delete_key("first_key") is True
    assert master.delete_key("first_key") is False
    assert master.timeout == timedelta(seconds=10)
    master.set_timeout(timedelta(seconds=3))
    assert master.timeout == timedelta(seconds=3)


def test_same_answers_as_torch(master: dist.TCPStore) -> None:
    import torch.distributed as torch_dist
    theirs = torch_dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    ours = master

    def script(s: object) -> list[object]:
        out: list[object] = []
        out.append(s.compare_set("k", "", "v1"))  # type: ignore[attr-defined]
        out.append(s.compare_set("k", "x", "v2"))  # type: ignore[attr-defined]
        out.append(s.compare_set("k", "v1", "v3"))  # type: ignore[attr-defined]
        out.append(s.compare_set("nokey", "abc", "v"))  # type: ignore[attr-defined]
        out.append(s.check(["nokey"]))  # type: ignore[attr-defined]
        out.append(s.add("c", 5))  # type: ignore[attr-defined]
        out.append(s.add("c", -7))  # type: ignore[attr-defined]
        s.append("a", "x")  # type: ignore[attr-defined]
        s.append("a", b"\x00y")  # type: ignore[attr-defined]
        out.append(s.multi_get(["a", "c", "k"]))  # type: ignore[attr-defined]
        s.multi_set(["m1", "m2"], ["1", b"2"])  # type: ignore[attr-defined]
        out.append(s.get("m2"))  # type: ignore[attr-defined]
        out.append(s.check(["m1", "m2"]))  # type: ignore[attr-defined]
        out.append(s.num_keys())  # type: ignore[attr-defined]
        out.append(sorted(s.list_keys()))  # type: ignore[attr-defined]
        s.queue_push("q", "1")  # type: ignore[attr-defined]
        s.queue_push("q", "2")  # type: ignore[attr-defined]
        out.append(s.queue_len("q"))  # type: ignore[attr-defined]
        out.append(s.queue_pop("q"))  # type: ignore[attr-defined]
        out.append(s.delete_key("m1"))  # type: ignore[attr-defined]
        out.append(s.delete_key("m1"))  # type: ignore[attr-defined]
        # queues are not keys: not counted, not listed, not deleted
        out.append(s.num_keys())  # type: ignore[attr-defined]
        out.append(sorted(s.list_keys()))  # type: ignore[attr-defined]
        out.append(s.delete_key("q"))  # type: ignore[attr-defined]
        out.append(s.queue_len("q"))  # type: ignore[attr-defined]
        out.append(s.check(["q"]))  # type: ignore[attr-defined]
        return out

    assert script(ours) == script(theirs)


def test_get_waits_for_set(master: dist.TCPStore) -> None:
    other = client_of(master)
    # (set once the get waits for its reply: only a wake-up on the server can answer it)
    setter = when_inside("_read_reply", lambda: other.set("late", b"here"), "_tcp.py")
    t0 = time.monotonic()
    assert master.get("late") == b"here"
    assert time.monotonic() - t0 < 5  # woken by the set, not at the 10 s timeout
    setter.join(5)
    other.close()


def test_timeouts_name_keys_time_and_address(master: dist.TCPStore) -> None:
    master.set("present", "1")
    with pytest.raises(StoreTimeoutError) as info:
        master.wait(["present", "absent1", "absent2"], timedelta(seconds=0.2))
    msg = str(info.value)
    assert "absent1" in msg and "absent2" in msg and "present," not in msg
    assert "200ms" in msg and f"127.0.0.1:{master.port}" in msg
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, DistStoreError)
    master.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(StoreTimeoutError, match="missing_key"):
        master.get("missing_key")
    with pytest.raises(StoreTimeoutError):
        master.multi_get(["present", "nope"])
    # the connection stays in step after timeouts
    assert master.get("present") == b"1"
    assert master.check(["present"]) is True


def test_get_of_a_queue_only_key_waits_for_a_value(master: dist.TCPStore) -> None:
    master.queue_push("qk", "item")
    master.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(StoreTimeoutError, match="qk"):
        master.get("qk")
    with pytest.raises(StoreTimeoutError, match="qk"):
        master.multi_get(["qk"])
    master.wait(["qk"])  # wait, though, sees the non-empty queue
    master.set("qk", "value")
    assert master.multi_get(["qk"]) == [b"value"]
    assert master.queue_pop("qk") == b"item"


def test_add_on_non_number_raises_and_connection_survives(master: dist.TCPStore) -> None:
    master.set("text", "abc")
    with pytest.raises(StoreValueError, match="'text'"):
        master.add("text", 1)
    assert master.add("num", 2) == 2
    assert master.get("text") == b"abc"


def test_add_switching_keys_empty_key_and_limits(master: dist.TCPStore) -> None:
    # the client keeps the last key's encoded frame: every switch, the empty key, a padded
    # decimal set by hand and the 64-bit limits must still be exact
    assert master.add("", 1) == 1
    assert master.add("", 2) == 3
    assert master.add("a", -5) == -5
    assert master.add("", 0) == 3
    master.set("padded", " 41 ")
    assert master.add("padded", 1) == 42
    assert master.get("padded") == b"42"
    assert master.add("big", (1 << 63) - 1) == (1 << 63) - 1
    with pytest.raises(TypeError, match="64-bit"):  # (torch's binding: an int64_t)
        master.add("a", 1 << 64)
    with pytest.raises(TypeError):
        master.add("a", "1")  # type: ignore[arg-type]
    assert master.add("a", True) == -4  # (torch's int64_t takes a bool, as 1)


def test_a_master_can_stop_accepting_and_serves_its_clients_on(master: dist.TCPStore) -> None:
    other = client_of(master)
    assert master._stop_accepting()
    master.set("still", "served")  # a round trip: the server has read the request to stop
    deadline = time.monotonic() + 5
    while True:  # the server takes the request between two polls
        try:
            late = dist.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=0.3))
        except DistNetworkError:
            break
        late.close()
        assert time.monotonic() < deadline, "new connections are still accepted"
    assert other.get("still") == b"served" and other.add("n", 2) == 2
    other.close()


def test_queue(master: dist.TCPStore) -> None:
    with pytest.raises(QueueEmptyError):
        master.queue_pop("q", block=False)
    other = client_of(master)
    # (pushed once the pop waits for its reply)
    pusher = when_inside("_read_reply", lambda: other.queue_push("q", b"item"), "_tcp.py")
    assert master.queue_pop("q") == b"item"
    pusher.join(5)
    master.queue_push("w", "x")
    master.wait(["w"], timedelta(seconds=1))  # wait works on a non-empty queue
    other.close()


def test_barrier_and_wait_from_many_threads(master: dist.TCPStore) -> None:
    n = 6
    stores = [master.clone() for _ in range(n)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            s = stores[i]
            s.barrier("b1", n, timedelta(seconds=10))
            for _ in range(100):
                s.add("count", 1)
            s.set(f"done{i}", str(i))
            s.wait([f"done{j}" for j in range(n)], timedelta(seconds=10))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert master.add("count", 0) == n * 100
    for s in stores:
        s.close()


def _joined(port: int) -> int:
    """How many clients joined the store on ``port`` (0 while it does not answer yet)."""
    try:
        probe = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.5))
    except DistError:
        return 0
    try:
        return probe.add("init/", 0)
    finally:
        probe.close()


def test_master_waits_for_workers() -> None:
    port_holder: list[int] = []
    store_holder: list[dist.TCPStore] = []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def make_master() -> None:
        store_holder.append(dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10)))

    t = threading.Thread(target=make_master)
    t.start()
    # the master has counted itself (a client that joins nothing reads the count)
    wait_until(lambda: _joined(port) == 1, 10, "the master joined its own store")
    t.join(0.3)
    assert t.is_alive()  # still waiting for the second worker
    worker = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    t.join(10)
    assert not t.is_alive() and store_holder
    assert worker.num_keys() == 1
    port_holder.append(port)
    worker.close()
    store_holder[0].close()
    with pytest.raises(StoreTimeoutError, match="1/2 clients joined"):
        dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=0.3))


def _master_whose_loop_is_held_back(mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dist.TCPStore, threading.Event]:
    """A master made to serve later, without a secret, whose server's loop, once started,
    waits for the event before it serves (set it when done: the test's ``finally``)."""
    from tdist.store._server import StoreServer

    monkeypatch.setenv("TDIST_STORE_SERVER", mode)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    go = threading.Event()
    serve_forever = StoreServer.serve_forever

    def held_back(self: StoreServer, *args: Any, **kwargs: Any) -> None:
        go.wait(10)
        serve_forever(self, *args, **kwargs)

    monkeypatch.setattr(StoreServer, "serve_forever", held_back)
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False, _serve_later=True)
    return master, go


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_master_made_to_serve_later_serves_its_own_requests_and_the_others_while_it_waits(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (how the host of a group's store joins its rendezvous: its own requests first, served
    # in its thread; then, while it waits for the others, it serves them itself, whether or
    # not its server's thread runs yet: held back here until the end)
    master, go = _master_whose_loop_is_held_back(mode, monkeypatch)
    try:
        server = master._server
        assert server is not None
        master.set("a", "1")
        assert master.add("n", 5) == 5
        assert master.compare_set("c", "", "x") == b"x"
        assert master.get("a") == b"1"
        assert server._thread is None  # (served in this thread: no loop yet)
        clients: list[dist.TCPStore] = []

        def client() -> None:  # (its handshake and its requests are answered by the master's wait)
            c = client_of(master)
            clients.append(c)
            assert c.add("n", 1) == 6
            c.set("k", "v")

        t = threading.Thread(target=client, daemon=True)
        t.start()
        master.wait(["k"], timedelta(seconds=10))  # (serves the client while it waits)
        t.join(10)
        assert clients and not t.is_alive()
        assert server._thread is not None and not server._looping  # (started, held back: not serving)
        go.set()
        assert clients[0].get("a") == b"1" and clients[0].add("n", 1) == 7  # (the loop serves now)
        clients[0].close()
    finally:
        go.set()
        master.close()


def test_a_master_that_serves_while_it_waits_hears_its_answer_from_the_loop_that_started_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the master's wait serves the others while its server's thread is started but not running
    # yet; the loop then starts and answers the wait: the wait must hear that answer (it is
    # asleep on the same epoll then, which wakes one of its sleepers per event)
    master, go = _master_whose_loop_is_held_back("thread", monkeypatch)
    try:
        server = master._server
        assert server is not None
        master._serve_now()  # (its thread is started, and held back before its loop)
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(master.get("k")), daemon=True)
        t.start()
        client = client_of(master)  # (greeted by the master's wait)
        go.set()
        wait_until(lambda: server._looping, 10, "the loop to serve")
        client.set("k", "v")  # (the loop or the wait takes it: the loop answers either way)
        t.join(10)
        assert got == [b"v"]
        client.close()
    finally:
        go.set()
        master.close()


def test_a_master_made_to_serve_later_and_closed_before_it_served_frees_its_port() -> None:
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False, _serve_later=True)
    port = master.port
    assert master.add("n", 1) == 1
    master.close()
    again = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))
    try:
        assert again.add("n", 1) == 1  # (a new store: nothing of the first)
    finally:
        again.close()


def test_client_connect_errors() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"127.0.0.1:{port}.*MASTER_ADDR"):
        dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="port must have value from 0 to 65535"):
        dist.TCPStore("127.0.0.1", 70000, is_master=True)


def test_a_client_that_cannot_connect_for_long_says_so_before_it_gives_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A master late by 30 s is no start-up skew (a wrong MASTER_PORT, a master that failed):
    the client warns then, and every minute, until its timeout (30 minutes in a group)."""
    import logging

    from tdist._core import patience

    monkeypatch.setattr(patience, "FIRST", 0.3)  # (30 s; the next, a minute later, is past the timeout)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with caplog.at_level(logging.WARNING, "tdist.store._tcp"), pytest.raises(DistNetworkError, match=r"within 3 s"):
        dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=3))
    said = [r.getMessage() for r in caplog.records if "still trying to connect" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"TCPStore client: still trying to connect to the store at 127.0.0.1:{port} ("), said
    assert "Connection refused" in said[0] and said[0].endswith("(it gives up after 3 s)"), said


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_master_listens_on_every_address_of_its_host_as_torchs_does(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's server listens on every local address, whatever host name its master is given:
    a job's other hosts reach it by an address the name may not resolve to on the master's
    own host (a hostname that /etc/hosts gives as 127.0.1.1, Debian's default). 127.0.0.2 is
    an address of every Linux host that a server bound to 127.0.0.1 alone does not answer."""
    master = dist.TCPStore(host, 0, is_master=True, timeout=timedelta(seconds=10))
    try:
        master.set("k", "v")
        monkeypatch.setenv("TDIST_STORE_UNIX", "0")  # (over TCP, to that address)
        client = dist.TCPStore("127.0.0.2", master.port, timeout=timedelta(seconds=10))
        assert client.get("k") == b"v"
        client.close()
    finally:
        master.close()
    with pytest.raises(DistNetworkError, match="does not resolve"):  # (a name that does not resolve: at once)
        dist.TCPStore("no-such-host.invalid", 0, is_master=True, timeout=timedelta(seconds=10))


def test_a_master_of_the_agents_port_joins_the_agents_store_as_torchs_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under an elastic agent (torchrun, ``tdist run``: ``TORCHELASTIC_USE_AGENT_STORE``), a
    worker's ``TCPStore(MASTER_ADDR, MASTER_PORT, is_master=rank == 0)`` finds the agent's
    store on that port and joins it as a client (torch's test_agent_store); elsewhere a taken
    port is an error."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    try:
        agent.set("k", "v")
        with pytest.raises(DistNetworkError, match="Address already in use"):
            dist.TCPStore("127.0.0.1", agent.port, 1, True, timeout=timedelta(seconds=2))
        monkeypatch.setenv("MASTER_PORT", str(agent.port))
        for value in ("1", "True"):
            monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", value)
            worker = dist.TCPStore("127.0.0.1", agent.port, 1, True, timeout=timedelta(seconds=10))
            assert worker.port == agent.port and worker.get("k") == b"v"
            worker.close()
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
        with pytest.raises(DistNetworkError, match="Address already in use"):
            dist.TCPStore("127.0.0.1", agent.port, 1, True, timeout=timedelta(seconds=2))
    finally:
        agent.close()


def test_errors_say_what_torchs_tests_expect() -> None:
    """The words torch's own test_store.py matches (each error keeps tdist's account after them)."""
    with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
        dist.TCPStore("localhost", 0, world_size=0, is_master=False)
    with pytest.raises(dist.DistStoreError, match=r"Timed out after \d+ seconds waiting for clients. \d+/\d+ clients joined."):
        dist.TCPStore("localhost", 0, 2, True, timeout=timedelta(seconds=1))
    master = dist.TCPStore("localhost", 0, 1, True)
    try:
        with pytest.raises(DistNetworkError, match=f"^The server socket has failed to listen on any local .*{master.port}"):
            dist.TCPStore("localhost", master.port, 1, True)
    finally:
        master.close()


def test_a_master_on_a_host_without_ipv6_listens_on_every_ipv4_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where IPv6 is turned off (the socket can be made, its bind fails), every address is every
    IPv4 address."""
    import errno

    from tdist.store import _server

    real = socket.socket

    class NoIPv6(real):  # type: ignore[misc,valid-type]
        def bind(self, address: object) -> None:
            if self.family == socket.AF_INET6:
                raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
            super().bind(address)

    monkeypatch.setattr(_server.socket, "socket", NoIPv6)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setattr(_server.socket, "socket", real)
    try:
        master.set("k", "v")
        monkeypatch.setenv("TDIST_STORE_UNIX", "0")
        client = dist.TCPStore("127.0.0.2", master.port, timeout=timedelta(seconds=10))
        assert client.get("k") == b"v"
        client.close()
    finally:
        master.close()


def test_client_retries_until_server_starts() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    holder: list[dist.TCPStore] = []
    # (the server starts once the client is trying to connect)
    starter = when_inside("_connect", lambda: holder.append(dist.TCPStore("127.0.0.1", port, is_master=True)), "_tcp.py")
    client = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))
    client.set("x", "1")
    assert client.get("x") == b"1"
    client.close()
    # the server may be serving before its constructor has returned
    starter.join(timeout=10)
    holder[0].close()


def test_a_clone_of_a_store_whose_server_is_gone_fails_at_once_not_after_the_timeout() -> None:
    """A clone's server was up when its original connected: a refused connection is its end
    (the desync diagnosis clones the store of a dead host and must not wait the timeout)."""
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=30))
    master.close()  # (its server stops: nothing listens on the port any more)
    t0 = time.monotonic()
    with pytest.raises(DistNetworkError, match="could not connect"):
        client.clone()
    assert time.monotonic() - t0 < 15  # (the failure it guards against: waiting 30 s)
    client.close()


def test_tcp_and_unix_paths_agree(master: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    assert master.transport == "unix"
    monkeypatch.setenv("TDIST_STORE_UNIX", "0")
    tcp = client_of(master)
    assert tcp.transport == "tcp"
    tcp.set("via", "tcp")
    assert master.get("via") == b"tcp"
    big = os.urandom(3 << 20)
    tcp.set("big", big)
    assert master.get("big") == big
    assert tcp.get("big") == big
    tcp.close()


def test_set_to_a_gone_server_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for unix in ("1", "0"):
        monkeypatch.setenv("TDIST_STORE_UNIX", unix)
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
        client = client_of(master)
        client.set("a", "1")
        assert client.get("a") == b"1"
        master.close()  # (returns once its server has stopped)
        with pytest.raises(DistNetworkError, match="lost the connection"):
            client.set("b", "2")
        # every later call names itself, and the loss it comes after
        for name, args in (("get", ("a",)), ("add", ("n", 1)), ("set", ("c", "3"))):
            with pytest.raises(DistNetworkError, match=rf"^{name.upper()} cannot be sent: lost the connection"):
                getattr(client, name)(*args)


def test_multi_tenant_shares_one_server() -> None:
    a = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    b = dist.TCPStore("127.0.0.1", a.port, is_master=True, multi_tenant=True)
    a.set("shared", "yes")
    assert b.get("shared") == b"yes"
    a.close()
    assert b.get("shared") == b"yes"  # b still holds the server
    b.close()


# -- authentication -----------------------------------------------------------------------------


def test_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, secret="right", timeout=timedelta(seconds=5))
    master.set("k", "v")
    with pytest.raises(AuthenticationError, match="requires a secret"):
        client_of(master)
    with pytest.raises(AuthenticationError, match="rejected our secret"):
        client_of(master, secret="wrong")
    monkeypatch.setenv("TDIST_SECRET", "right")
    good = client_of(master)
    assert good.get("k") == b"v"
    # large values (their frames tagged through Poly1305, in the server's own process too)
    big = os.urandom(3 << 20)
    good.set("big", big)
    assert master.get("big") == big and good.get("big") == big
    # a raw client that skips authentication gets nothing executed
    sock, dec = raw_connect(master.port)
    sock.sendall(encode_frame(Op.SET, (b"k", b"evil")))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.code == Status.ERROR and reply.fields[0] == b"auth"  # type: ignore[attr-defined]
    assert read_frame(sock, dec) is None  # and is disconnected
    sock.close()
    # an unauthenticated client may not even announce a large frame
    sock, dec = raw_connect(master.port)
    sock.sendall(HEADER.pack(1 << 20, Op.SET, 2))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.fields[0] == b"auth"  # type: ignore[attr-defined]
    sock.close()
    assert good.get("k") == b"v"
    good.close()
    master.close()


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_never_takes_the_server_down(master: dist.TCPStore) -> None:
    master.set("keep", "me")
    survivor = client_of(master)
    # unknown command: an error, and the connection stays usable
    sock, dec = raw_connect(master.port)
    sock.sendall(encode_frame(200, (b"x",)))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.code == Status.ERROR and b"unknown" in reply.fields[1]  # type: ignore[attr-defined]
    sock.sendall(encode_frame(Op.GET, (b"keep", encode_int(1000))))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.fields == [b"me"]  # type: ignore[attr-defined]
    # wrong field count: an error, connection usable
    sock.sendall(encode_frame(Op.SET, (b"only-key",)))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.code == Status.ERROR  # type: ignore[attr-defined]
    sock.close()
    # a frame larger than the limit: error and closed
    sock, dec = raw_connect(master.port)
    sock.sendall(HEADER.pack(0xFFFFFFF0, Op.SET, 2))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.fields[0] == b"too_large"  # type: ignore[attr-defined]
    sock.close()
    # malformed framing: error and closed
    sock, dec = raw_connect(master.port)
    sock.sendall(HEADER.pack(5, Op.SET, 99))
    reply = read_frame(sock, dec)
    assert reply is not None and reply.fields[0] == b"protocol"  # type: ignore[attr-defined]
    sock.close()
    # disconnect in the middle of a frame, and a client that sends nothing at all
    sock, _ = raw_connect(master.port)
    sock.sendall(encode_frame(Op.SET, (b"half", b"x" * 1000))[:500])
    sock.close()
    idle, _ = raw_connect(master.port)
    # a client that disconnects while its wait is parked
    waiting = client_of(master)
    outcome: list[BaseException] = []

    def parked_get() -> None:
        try:
            waiting.get("never")
        except DistNetworkError as exc:
            outcome.append(exc)

    th = threading.Thread(target=parked_get)
    th.start()
    # its request is out once it reads the reply: the server parks it before it reads the end
    # of the connection (in order, on one stream); a server in this process shows it parked
    wait_inside(th, "_read_reply", "_tcp.py", timeout=10)
    server = master._server
    if server is not None and server.pid is None:
        wait_until(lambda: "never" in server._parked, 10, "the server parked the get")
    waiting._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    th.join(10)
    assert len(outcome) == 1  # the client saw its connection go, at once
    assert survivor.get("keep") == b"me"
    assert survivor.check(["half"]) is False
    assert master.get("keep") == b"me"
    idle.close()
    survivor.close()


def test_fuzz_random_bytes_keep_keys_intact(master: dist.TCPStore) -> None:
    rng = random.Random(7)
    expected = {f"key{i}": rng.randbytes(rng.randint(0, 300)) for i in range(50)}
    for k, v in expected.items():
        master.set(k, v)
    master.add("ctr", 41)
    for i in range(150):
        sock, _ = raw_connect(master.port)
        try:
            if i % 3 == 0:  # a valid header with garbage after it
                sock.sendall(HEADER.pack(rng.randint(5, 400), rng.randint(0, 255), rng.randint(0, 50)))
            sock.sendall(rng.randbytes(rng.randint(1, 2000)))
            sock.settimeout(0.05)
            try:
                sock.recv(4096)
            except OSError:
                pass
        finally:
            sock.close()
    checker = client_of(master)
    for k, v in expected.items():
        assert checker.get(k) == v
    assert checker.add("ctr", 1) == 42
    checker.close()


# -- the server process ------------------------------------------------------------------------


def test_server_process_exits_with_its_parent(tmp_path: object) -> None:
    code = (
        "import tdist, datetime, sys, time\n"
        "s = tdist.TCPStore('127.0.0.1', 0, is_master=True)\n"
        "s.set('alive', '1')\n"
        "print(s.port, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(read_line(proc.stdout, 40, "the store's port"))
        client = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5))
        assert client.get("alive") == b"1"
        client.close()
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return  # the orphaned server went away
        time.sleep(0.1)
    pytest.fail("the store server outlived its parent process")


def test_get_latency_while_parent_holds_the_gil(master: dist.TCPStore) -> None:
    """The server must answer while the process that created it runs Python code."""
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    other = master.clone()
    other.set("k", "v")
    spinner = threading.Thread(target=busy)
    spinner.start()
    try:
        t0 = time.perf_counter()
        for _ in range(20):
            assert other.get("k") == b"v"
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        spinner.join()
    other.close()
    assert elapsed < 5  # a hang or a lost wake-up would blow this by far


def test_dropping_a_store_without_close_does_no_network_io_and_stops_its_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    s = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    s.set("last", "1")  # close() would confirm this set with a round trip; a finalizer must not
    server = s._server
    assert server is not None and server.pid is not None
    port, pid = s.port, server.pid
    calls: list[object] = []
    monkeypatch.setattr(dist.TCPStore, "_call_frame", lambda self, *a, **k: calls.append(a))
    del s
    gc.collect()
    assert calls == []
    try:
        pidfd = os.pidfd_open(pid)  # the server's process ends: nothing listens on the port
    except ProcessLookupError:  # (ended, and reaped, already)
        pass
    else:
        try:
            import select

            assert select.select([pidfd], [], [], 10)[0], "the store server outlived the dropped store"
        finally:
            os.close(pidfd)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def _signal_pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` is sent to process ``pid`` and not yet taken (False once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except FileNotFoundError:
        return False
    bit = 1 << (sig - 1)
    return any(int(fields[k].strip(), 16) & bit for k in ("SigPnd", "ShdPnd"))


def test_a_server_process_serves_on_after_a_sigterm_until_its_parent_stops_it() -> None:
    """``timeout``, ``kill -TERM -PGID`` and Slurm's ``scancel`` send SIGTERM to every process of
    the group at once: the store's host (``tdist run``'s agent, which leaves its rendezvous as it
    stops) gets it too, and still needs the store. The server process serves on until its
    parent stops it (or dies)."""
    import signal

    s = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    try:
        assert s._server is not None and s._server.pid is not None
        pid = s._server.pid
        s.set("before", "1")
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not _signal_pending(pid, signal.SIGTERM), 10, "the server's process took the signal")
        s.set("after", "2")
        other = dist.TCPStore("127.0.0.1", s.port, timeout=timedelta(seconds=10))
        assert other.multi_get(["before", "after"]) == [b"1", b"2"]
        other.close()
        assert s._server.exit_status() is None
    finally:
        s.close()
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 10, "the server's process ended with its store")


def _zombie(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def test_the_server_is_a_fresh_process_not_a_fork_of_a_threaded_one() -> None:
    # a fork of a process whose other threads hold locks (a logging handler's, OpenSSL's) can
    # wait on them forever in the child; the server is started as a new interpreter instead
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    try:
        assert s._server is not None and s._server.pid is not None
        with open(f"/proc/{s._server.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"-S" in argv and any(b"_serve_spawned" in a for a in argv), argv
        with open(f"/proc/{s._server.pid}/maps") as f:
            assert "libtorch" not in f.read()  # (it imports the server, not torch)
        s.set("k", "v")
        assert s.get("k") == b"v"
    finally:
        s.close()


def test_a_master_is_served_at_once_and_its_own_process_takes_over_from_exactly_where_the_thread_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A master's server ("process", the default) serves from a thread while its own process
    starts, then hands everything over: data, queues, waiting requests (with their deadlines,
    in their order), a half-received frame, an unauthenticated stranger's nonce, each session's
    tags, and the master's own connection (served in its caller's thread before, through its
    socket pair after). The hand-over is held back until all of that is in place."""
    from tdist._core import auth
    from tdist.store._server import StoreServer

    gate = threading.Event()
    monkeypatch.setattr(StoreServer, "handover_gate", gate)
    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    secret = auth.resolve_secret("s3cret")
    assert secret is not None
    opts: dict[str, object] = {"timeout": timedelta(seconds=30), "secret": "s3cret"}
    master = dist.TCPStore("127.0.0.1", 0, 1, True, **opts)  # type: ignore[arg-type]
    server = master._server
    assert server is not None and not server._handed_over
    try:
        master.set("k", "v")
        assert master.get("k") == b"v" and master._direct is not None  # (served in this thread)
        a = client_of(master, secret="s3cret")
        a.queue_push("q", "first")
        got: dict[str, object] = {}

        def blocked(name: str, call: object) -> threading.Thread:
            def run() -> None:
                try:
                    got[name] = call()  # type: ignore[operator]
                except Exception as exc:
                    got[name] = exc
            t = threading.Thread(target=run, daemon=True)
            t.start()
            return t

        b, c, d1, d2 = (client_of(master, secret="s3cret") for _ in range(4))
        c.set_timeout(timedelta(seconds=1))
        waiters = [
            blocked("get", lambda: b.get("later")),
            blocked("wait", lambda: c.wait(["never"])),  # (its deadline goes along)
            blocked("pop1", lambda: d1.queue_pop("q2")),  # (two in line for one queue)
        ]
        wait_until(lambda: len(server._parked.get("q2", [])) == 1, 10, "the first pop waits")
        waiters.append(blocked("pop2", lambda: d2.queue_pop("q2")))
        wait_until(lambda: {"later", "never"} <= server._parked.keys() and len(server._parked["q2"]) == 2, 10, "all wait")
        def hello() -> tuple[socket.socket, FrameDecoder, bytes]:
            sock = socket.create_connection(("127.0.0.1", master.port), timeout=10)
            sock.sendall(OPENING)
            dec = FrameDecoder()
            frame = read_frame(sock, dec)
            assert frame.code == Op.HELLO  # type: ignore[attr-defined]
            return sock, dec, frame.fields[2]  # type: ignore[attr-defined]

        # a stranger that read the HELLO and has not proved the secret yet
        stranger, _, stranger_nonce = hello()
        # a raw client with a session, half of whose request is in when the server moves
        raw, rdec, raw_nonce = hello()
        mine = auth.make_nonce()
        raw.sendall(encode_frame(Op.AUTH, [mine, auth.client_proof(secret, raw_nonce, mine)]))
        assert read_frame(raw, rdec).code == Op.AUTH_OK  # type: ignore[attr-defined]
        c2s, s2c = auth.session_keys(secret, raw_nonce, mine)
        send_seal, recv_seal = auth.Seal(c2s), auth.Seal(s2c)
        rdec.seal = recv_seal
        first = encode_frame(Op.SET, (b"raw", b"half before, half after"))
        first += send_seal.tag(first)
        raw.sendall(first[:7])
        wait_until(lambda: any(conn.decoder.buffered == 7 for conn in server._conns), 10, "half a frame in")

        gate.set()
        server._send(b".")
        pid = server.pid
        assert pid is not None and pid != os.getpid() and server._handed_over
        assert not server._conns and not server._listeners  # (the thread let go of everything)

        raw.sendall(first[7:])
        assert read_frame(raw, rdec).code == Status.OK  # type: ignore[attr-defined]
        ask = encode_frame(Op.GET, (b"raw", encode_int(1000)))
        raw.sendall(ask + send_seal.tag(ask))
        assert read_frame(raw, rdec).fields == [b"half before, half after"]  # type: ignore[attr-defined]
        # the stranger proves the secret against the nonce the thread gave it
        stranger.sendall(encode_frame(Op.AUTH, [mine, auth.client_proof(secret, stranger_nonce, mine)]))
        assert read_frame(stranger, FrameDecoder()).code == Op.AUTH_OK  # type: ignore[attr-defined]

        a.set("later", "x")
        a.queue_push("q2", "one")
        a.queue_push("q2", "two")
        for t in waiters:
            t.join(20)
        assert got["get"] == b"x"
        assert isinstance(got["wait"], StoreTimeoutError) and "never" in str(got["wait"])
        assert (got["pop1"], got["pop2"]) == (b"one", b"two")
        assert a.queue_pop("q") == b"first" and a.get("k") == b"v"
        assert master.get("raw") == b"half before, half after" and master._direct is None
        master.set("k", "after")
        assert master.add("n", 3) == 3  # (its set is in: a set waits for no reply)
        assert a.get("k") == b"after"
        for s_ in (a, b, c, d1, d2):
            s_.close()
        stranger.close()
        raw.close()
    finally:
        master.close()
    with pytest.raises(ProcessLookupError):  # (closing the master stopped its process)
        os.kill(pid, 0)


def test_a_master_whose_own_process_fails_to_start_or_dies_before_taking_over_is_served_by_its_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tdist.store._server import StoreServer

    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # (it cannot start)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    try:
        assert master._server is not None and master._server.pid is None
        master.set("k", "v")
        assert client_of(master).get("k") == b"v"
    finally:
        master.close()
    monkeypatch.undo()
    gate = threading.Event()
    monkeypatch.setattr(StoreServer, "handover_gate", gate)  # (it dies before taking over)
    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    try:
        server = master._server
        assert server is not None
        peer = client_of(master)
        peer.set("k", "v")
        proc = wait_until(lambda: server._proc, 10, "the server starts its process")
        proc.kill()
        assert server.pid is None  # (the thread saw it go)
        gate.set()
        server._send(b".")
        assert peer.get("k") == b"v" and master.get("k") == b"v"
        peer.set("k", "w")
        assert peer.get("k") == b"w"  # (its set is in: a set waits for no reply)
        assert master.get("k") == b"w" and master._direct is not None
        peer.close()
    finally:
        master.close()


def test_a_master_hands_over_to_its_own_process_while_a_child_forked_meanwhile_lives_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank forked (by another thread of the master's process) just as the server's thread
    # starts its process holds a copy of every descriptor made for that start. Popen waits on
    # one of its own (the child's exec) and the server's process read its configuration until
    # end of file: each waited as long as the rank lived, the first with the loop's lock held
    # (its clients unanswered until their timeouts: a CI failure of test_reshape_groups).
    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    hold_r, hold_w = os.pipe()
    forked: list[int] = []
    real_pipe = os.pipe

    def pipe_then_fork() -> tuple[int, int]:
        fds = real_pipe()
        if threading.current_thread().name.startswith("tdist-store-"):
            pid = os.fork()
            if pid == 0:  # (the "rank": holds every copy it got until the test ends)
                os.close(hold_w)
                select.select([hold_r], [], [], 60)
                os._exit(0)
            forked.append(pid)
        return fds

    monkeypatch.setattr(os, "pipe", pipe_then_fork)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    try:
        server = master._server
        assert server is not None
        peer = dist.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=5))
        peer.set("k", "v")
        wait_until(lambda: forked, 10, "the server starts its process")
        for i in range(50):  # (answered all along: the loop never waits for the forked child)
            assert peer.add("n", 1) == i + 1 and master.get("k") == b"v"
        wait_until(lambda: not server.handover_pending, 10, "the server's process takes over")
        assert server.pid is not None  # (its process took over, the children still alive)
        assert all(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in forked)
        peer.set("k", "w")
        assert master.get("k") == b"w" and peer.add("n", 0) == 50
        peer.close()
    finally:
        os.close(hold_w)
        for pid in forked:
            os.waitpid(pid, 0)
        os.close(hold_r)
        master.close()


def test_the_servers_own_process_keeps_no_descriptor_of_its_parent_but_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # (started with posix_spawn, it inherits what is inheritable in its parent, as os.dup2 or a
    # C library leaves it: a pipe's write end held there would hide its end of file from the
    # parent's reader for as long as the store lives)
    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    r, w = os.pipe()
    os.set_inheritable(w, True)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    try:
        server = master._server
        assert server is not None
        pid = server.pid
        assert pid is not None
        held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert os.readlink(f"/proc/self/fd/{w}") not in held
        os.close(w)
        assert os.read(r, 1) == b""  # (its end of file: nobody else holds the write end)
        master.set("k", "v")
        assert client_of(master).get("k") == b"v"
    finally:
        os.close(r)
        with contextlib.suppress(OSError):
            os.close(w)
        master.close()


def test_the_process_of_a_master_dropped_unclosed_is_reaped_once_it_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    # (it stops on its own, unwaited for: the next server started reaps it, as Popen's are)
    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    monkeypatch.delenv("TDIST_SECRET", raising=False)

    def state(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"

    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    pid = master._server.pid if master._server is not None else None
    assert pid is not None
    del master
    gc.collect()
    wait_until(lambda: state(pid) in ("Z", "gone"), 10, "the dropped master's server exits")
    again = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    try:
        assert again._server is not None and again._server.pid is not None  # (its own spawned)
        assert state(pid) == "gone"  # (reaped, not a zombie for as long as this process lives)
    finally:
        again.close()


def test_a_master_serving_from_a_thread_talks_to_it_over_a_socket_pair_and_others_still_prove_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TDIST_STORE_SERVER", "thread")
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), secret="s3cret")
    try:
        server = master._server
        assert server is not None
        # (its own connection: no accept, no HELLO, no proof through the server's thread)
        wait_until(lambda: [c.addr for c in server._conns] == ["this process"], 10, "the server takes in its master's pair")
        assert master._sock is not None and master._sock.family == socket.AF_UNIX and master._send_seal is None
        master.set("k", "from the master")
        peer = dist.TCPStore("127.0.0.1", master.port, 1, False, timedelta(seconds=10), secret="s3cret")
        assert peer.get("k") == b"from the master"
        peer.set("k2", "from a peer")
        assert master.get("k2") == b"from a peer"
        assert peer._send_seal is not None  # (a peer's frames carry the session's tags)
        peer.close()
        with pytest.raises(AuthenticationError):
            dist.TCPStore("127.0.0.1", master.port, 1, False, timedelta(seconds=5), secret="wrong")
        assert master.add("n", 2) == 2
    finally:
        master.close()


def test_a_master_serving_from_a_thread_serves_its_own_requests_in_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its requests are served in the calling thread (no hand-off to the server's thread and
    # back); one that must wait is answered through the socket pair by whoever sets its key,
    # and a request served so answers the other clients' waits and wakes the loop for its
    # own deadline at once.
    monkeypatch.setenv("TDIST_STORE_SERVER", "thread")
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    # (long timeouts: no deadline of theirs wakes the loop while the test runs)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=300))
    peer = dist.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=300))
    try:
        server = master._server
        assert server is not None
        own = master._own_conn if master._direct is None else master._direct[1]
        served_in: list[str] = []
        dispatch = server._dispatch_authed

        def watched(conn: object, frame: object) -> None:
            if conn is own:
                served_in.append(threading.current_thread().name)
            dispatch(conn, frame)  # type: ignore[arg-type]

        monkeypatch.setattr(server, "_dispatch_authed", watched)
        # (the loop's sleeps with nothing due: long, so that a reply or a deadline that waits
        # for the loop's next wake-up shows as a wait of a minute, not as a second's delay)
        server.idle_wait = 60.0
        wait_until(lambda: not server._lock.locked(), 10, "the loop waits for events")
        master.set("a", "1")
        assert master.add("n", 5) == 5
        assert master.get("a") == b"1" and master.check(["a", "n"]) and master.compare_set("a", "1", "2") == b"2"
        assert served_in == [threading.current_thread().name] * 5
        # a get that waits: answered through the pair when the peer sets the key
        setter = when_inside("_read_reply", lambda: peer.set("later", "from the peer"))
        assert master.get("later") == b"from the peer"
        setter.join(10)
        # the master's set answers the peer's waiting get at once, not at the loop's next wake-up
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(peer.get("w")), daemon=True)
        reader.start()
        wait_inside(reader, "_read_reply")
        wait_until(lambda: server._parked.get("w"), 10, "the peer's get is parked")
        master.set("w", "now")
        reader.join(20)
        assert got == [b"now"]
        # the master's own wait with a deadline: the loop, asleep (just woken by the peer's
        # request), looks at its timers again
        assert peer.add("tick", 1) == 1
        wait_until(lambda: not server._lock.locked(), 10, "the loop waits for events")
        with pytest.raises(StoreTimeoutError, match="wait timeout after 50ms"):
            master.wait(["never"], timedelta(milliseconds=50))  # (unanswered: its client's 5 s grace)
        assert master.add("n", 1) == 6  # (and it serves on)
        # while the loop is busy with another client, the master's request takes its turn
        # through the pair (not served in its thread)
        served_in.clear()
        with server._lock:
            reader = threading.Thread(target=lambda: got.append(master.get("a")), daemon=True)
            reader.start()
            wait_inside(reader, "_read_reply")
        reader.join(10)
        assert got[-1] == b"2" and served_in == [f"tdist-store-{server.port}"]
    finally:
        peer.close()
        master.close()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_forked_child_of_a_master_serving_from_a_thread_connects_anew(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # ("process": forked while the thread serves, before its own process takes over)
    monkeypatch.setenv("TDIST_STORE_SERVER", mode)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    try:
        master.set("before", "fork")
        pid = os.fork()
        if pid == 0:  # (the child: its parent's socket pair is not its connection)
            code = 1
            try:
                ok = master.get("before") == b"fork" and master._transport == "unix"
                master.set("child", "was here")
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert master.get("child") == b"was here"
        assert master.add("n", 1) == 1  # (the master's own pair still works)
    finally:
        master.close()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_forked_child_keeps_no_copy_of_the_servers_descriptors(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # a child forked while a thread of this process serves (a DataLoader worker, a fork-started
    # process) held copies of the listener and the clients' connections: a server stopped, or
    # killed, seemed alive to its clients (they connected and waited instead of failing over)
    from tdist.store._server import StoreServer

    monkeypatch.setattr(StoreServer, "handover_gate", threading.Event())  # ("process": still the thread)
    monkeypatch.setenv("TDIST_STORE_SERVER", mode)
    monkeypatch.delenv("TDIST_SECRET", raising=False)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    peer = client_of(master)
    peer.set("k", "v")
    assert peer.get("k") == b"v"
    port = master.port
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (holds whatever it kept, until told to go)
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        master.close()
        with pytest.raises(OSError):  # (refused: nobody listens)
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(DistError):  # (its connection ended with the server)
            peer.get("k")
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
        peer.close()


def test_a_rank_that_disagrees_on_the_world_size_never_completes_the_others_join(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank that says 4 where the others say 3 must not be counted among them: were it counted
    # before its abort lands, the two others would form a group of 3 without it. Rounds of three
    # threads, started in every order: every rank must fail, naming the problem.
    from tdist.store._rendezvous import _checked_join

    monkeypatch.delenv("TDIST_SECRET", raising=False)
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    try:
        for order in ([0, 1, 2], [2, 0, 1], [0, 2, 1], [1, 2, 0], [2, 1, 0], [1, 0, 2]) * 2:
            for key in master.list_keys():  # (each time the join's first round)
                master.delete_key(key)
            outcomes: dict[int, str] = {}
            go = [threading.Event() for _ in range(3)]

            def join(rank: int, go: list[threading.Event] = go, outcomes: dict[int, str] = outcomes) -> None:
                client = dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=10))
                try:
                    go[rank].wait(10)
                    _checked_join(client, rank, 4 if rank == 2 else 3, timedelta(seconds=8), "test")
                    outcomes[rank] = "joined"
                except ValueError as exc:
                    outcomes[rank] = str(exc)
                finally:
                    client.close()

            threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
            for t in threads:
                t.start()
            for r in order:  # (one after the other, each at once: the joins overlap)
                go[r].set()
            for t in threads:
                t.join(20)
            assert sorted(outcomes) == [0, 1, 2], (order, outcomes)
            for rank, text in outcomes.items():
                assert "disagree on the world size" in text, (order, rank, outcomes)
    finally:
        master.close()



# -- bursts of set (the server applies a run of them straight from the bytes) ----------------


def test_a_burst_of_sets_is_applied_in_order_with_the_requests_around_it(master: dist.TCPStore) -> None:
    sock, dec = raw_connect(master.port)
    burst = [encode_frame(Op.SET_QUIET, (f"b{i}".encode(), f"v{i}".encode())) for i in range(100)]
    burst += [encode_frame(Op.SET_QUIET, (b"same", str(i).encode())) for i in range(50)]
    burst.append(encode_frame(Op.SET_QUIET, (b"\xff\xfe", b"bad key")))  # (not UTF-8: an error)
    burst.append(encode_frame(Op.SET_QUIET, (b"after", b"the bad one")))
    burst.append(encode_frame(Op.GET, (b"b99", encode_int(1000))))
    burst.append(encode_frame(Op.SET_QUIET, (b"last", b"one")))
    burst.append(encode_frame(Op.SET_QUIET, (b"half",)))  # (one field: an error too)
    burst.append(encode_frame(Op.GET, (b"last", encode_int(1000))))
    sock.sendall(b"".join(burst))
    replies = [read_frame(sock, dec) for _ in range(4)]
    assert [r.code for r in replies] == [Status.ASYNC_ERROR, Status.OK, Status.ASYNC_ERROR, Status.OK]  # type: ignore[attr-defined]
    assert b"not UTF-8" in replies[0].fields[1]  # type: ignore[attr-defined]
    assert replies[1].fields == [b"v99"] and replies[3].fields == [b"one"]  # type: ignore[attr-defined]
    sock.close()
    assert master.multi_get([f"b{i}" for i in range(100)]) == [f"v{i}".encode() for i in range(100)]
    assert master.get("same") == b"49" and master.get("after") == b"the bad one"


def test_a_burst_of_sealed_sets_wakes_a_waiter_and_a_forged_tag_inside_one_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TDIST_STORE_SERVER", "process")
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), secret="s3cret")
    try:
        writer = client_of(master, secret="s3cret")
        waiter = client_of(master, secret="s3cret")
        got: list[bytes] = []
        thread = threading.Thread(target=lambda: got.append(waiter.get("k2500")))
        thread.start()
        wait_inside(thread, "_read_reply")  # (its request sent before the burst)
        for i in range(5000):
            writer.set(f"k{i}", f"v{i}".encode())
        thread.join(10)
        assert got == [b"v2500"]
        assert writer.get("k4999") == b"v4999" and master.get("k0") == b"v0"
        # two frames in one write: the first sealed as it should be, the second with a bad tag
        assert writer._send_seal is not None and writer._sock is not None
        good = encode_frame(Op.SET_QUIET, (b"sealed", b"yes"))
        good += writer._send_seal.tag(good)
        forged = encode_frame(Op.SET_QUIET, (b"forged", b"no"))
        forged += bytes(len(writer._send_seal.tag(forged)))
        writer._sock.sendall(good + forged)
        with pytest.raises(DistError, match=r"authentication tag|lost the connection|closed"):
            writer.get("sealed")
        assert master.get("sealed") == b"yes" and not master.check(["forged"])
        waiter.close()
    finally:
        master.close()


def test_a_client_that_reads_no_replies_is_read_no_further(master: dist.TCPStore) -> None:
    """Replies pile up for a client that never reads them: the server stops taking its requests
    (its sends stall) instead of buffering replies without bound; once it reads, every request
    sent meanwhile is answered, in order."""
    master.set("big", b"B" * (1 << 20))
    sock, dec = raw_connect(master.port)
    ping = encode_frame(Op.PING, [b"p" * (1 << 16)])
    # 64 MiB of pings, each answered by as many bytes: the server must stop reading them long
    # before (it holds 4 MiB of replies, the kernel's buffers some more)
    sock.settimeout(1)
    with pytest.raises(TimeoutError):
        sock.sendall(ping * 1024)
    sock.close()
    assert master.get("big") == b"B" * (1 << 20)  # (the server serves on)
    # a client that pipelines many requests and then reads gets every reply
    sock, dec = raw_connect(master.port)
    gets = [encode_frame(Op.GET, [b"big", encode_int(1000)])] * 40 + [encode_frame(Op.PING, [b"last"])]
    sender = threading.Thread(target=sock.sendall, args=(b"".join(gets),))
    sender.start()
    frames = [read_frame(sock, dec) for _ in gets]
    sender.join()
    sock.close()
    assert all(f.code == Status.OK and f.fields == [b"B" * (1 << 20)] for f in frames[:-1])  # type: ignore[attr-defined]
    assert frames[-1].fields == [b"last"]  # type: ignore[attr-defined]


def test_waits_answered_or_abandoned_leave_no_timers_behind() -> None:
    """A blocking request's deadline timer goes with the request (it stayed in the server's
    heap until the deadline: for ever, for an absurd timeout)."""
    from tdist.store._server import StoreServer

    server = StoreServer("127.0.0.1", 0)
    server.start("thread")
    try:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        for i in range(150):  # a WAIT that parks, with a huge timeout, then its client leaves
            sock, _ = raw_connect(server.port)
            sock.sendall(encode_frame(Op.WAIT, [encode_int(1 << 40), f"never{i}".encode()]))
            wait_until(lambda i=i: f"never{i}" in server._parked, 10, "the WAIT parked")
            sock.close()
        for i in range(150):  # a WAIT that parks and is answered
            sock, dec = raw_connect(server.port)
            sock.sendall(encode_frame(Op.WAIT, [encode_int(1 << 40), f"soon{i}".encode()]))
            wait_until(lambda i=i: f"soon{i}" in server._parked, 10, "the WAIT parked")
            client.set(f"soon{i}", b"x")
            assert read_frame(sock, dec).code == Status.OK  # type: ignore[attr-defined]
            sock.close()
        wait_until(lambda: not server._parked, 10, "every waiter gone")
        assert len(server._timers) <= 150  # (300 without the rebuild; rebuilt past 64 dead)
        client.close()
    finally:
        server.stop()


@pytest.mark.parametrize("state", ["listening", "bound", "unbound"])
def test_master_listen_fd_serves_on_a_socket_listening_or_not(state: str) -> None:
    """As torch's: the socket passed may listen already, or be bound only, or not even bound
    (then it listens on an ephemeral port)."""
    sock = socket.socket()
    if state != "unbound":
        sock.bind(("127.0.0.1", 0))
    if state == "listening":
        sock.listen()
    fd = sock.detach()
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False, master_listen_fd=fd)
    try:
        assert master.port > 0
        client = dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert master.get("k") == b"v"
        client.close()
    finally:
        master.close()


def test_libuv_backend_says_what_was_asked_as_torchs_does() -> None:
    """torch's ``libuvBackend`` is True by default (``use_libuv=True``) and False with
    ``use_libuv=False``; tdist's server is one implementation, but the property says the same."""
    from tdist.testing import free_port

    for kwargs, expected in (({}, True), ({"use_libuv": True}, True), ({"use_libuv": False}, False)):
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True, **kwargs)
        try:
            assert store.libuvBackend is expected, kwargs
        finally:
            store.close()
