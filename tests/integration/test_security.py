"""The job secret cannot be bypassed: relays, squatters of another user, open impostors.

A relay sits between a client and a real server and passes the handshake through (so both
sides prove the secret to each other through it); from then on every frame is tagged with keys
derived from the secret and both nonces, so whatever the relay changes or injects is refused.
A process of another user that takes a Unix socket name first is refused by both ends, at once.
The tests that play another user need root (to switch a forked child to ``nobody``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch

import tdist
from tdist._core.errors import AuthenticationError, DistError, DistNetworkError, PeerError
from tdist.store._server import StoreServer, unix_address
from tdist.testing import free_port, run_threads
from tdist.transport import Endpoint
from tdist.transport import _serialization as ser
from tdist.transport._messenger import Messenger

pytestmark = pytest.mark.timeout(60)

SECRET = "job-secret"
NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user: needs root to switch a child to nobody")


class Relay:
    """A TCP relay to ``target``: pumps bytes both ways; once ``after`` bytes went from the
    client to the server, ``tamper(data)`` may change what the client sends (and what it
    returns is forwarded instead)."""

    def __init__(self, target: tuple[str, int], after: int, tamper: Callable[[bytes], bytes]) -> None:
        self.target = target
        self.after = after
        self.tamper = tamper
        self.tampered = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent_up = 0
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._serve, daemon=True)
        t.start()
        self._threads.append(t)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            for src, dst, up in ((client, server, True), (server, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if up:
                    if self.sent_up >= self.after and not self.tampered.is_set():
                        data = self.tamper(data)
                        self.tampered.set()
                    self.sent_up += len(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def flip_middle_byte(data: bytes) -> bytes:
    """(Hits the frame that the chunk starts with, even if a heartbeat follows it.)"""
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]


# -- the store -----------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[tdist.TCPStore]:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), secret=SECRET)
    yield master
    master.close()


def _handshake_bytes(port: int) -> int:
    """How many bytes a client sends the store before its first request (its AUTH frame)."""
    seen: list[int] = []
    relay = Relay(("127.0.0.1", port), 1 << 30, lambda d: d)
    c = tdist.TCPStore("127.0.0.1", relay.port, timeout=timedelta(seconds=5), secret=SECRET)
    seen.append(relay.sent_up)
    c.close()
    relay.close()
    return seen[0]


def test_a_relay_that_passed_the_handshake_through_cannot_change_a_request(server: tdist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDIST_STORE_UNIX", "0")  # (through the relay, over TCP)
    relay = Relay(("127.0.0.1", server.port), _handshake_bytes(server.port), flip_last_byte)
    client = tdist.TCPStore("127.0.0.1", relay.port, timeout=timedelta(seconds=5), secret=SECRET)
    try:
        with pytest.raises(DistError):
            client.compare_set("key", "", "value the relay changed")  # the server drops it
        assert relay.tampered.is_set()
        assert not server.check(["key"])
    finally:
        client.close()
        relay.close()


def test_a_relay_cannot_inject_a_request_of_its_own(server: tdist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.store._protocol import Op, encode_frame

    monkeypatch.setenv("TDIST_STORE_UNIX", "0")
    injected = encode_frame(Op.SET, [b"injected", b"by the relay"])
    relay = Relay(("127.0.0.1", server.port), _handshake_bytes(server.port), lambda d: injected + d)
    client = tdist.TCPStore("127.0.0.1", relay.port, timeout=timedelta(seconds=5), secret=SECRET)
    try:
        with pytest.raises(DistError):
            client.get("anything")
        assert relay.tampered.is_set()
        assert not server.check(["injected"])
    finally:
        client.close()
        relay.close()


def test_a_client_with_the_secret_refuses_a_store_that_asks_for_none() -> None:
    impostor = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), secret="")
    try:
        with pytest.raises(AuthenticationError, match="does not ask for the secret"):
            tdist.TCPStore("127.0.0.1", impostor.port, timeout=timedelta(seconds=5), secret=SECRET, world_size=2)
        assert impostor.num_keys() == 0  # nothing reached it (not even the join counter)
    finally:
        impostor.close()


def test_store_frames_carry_tags_and_every_operation_works_with_a_secret(server: tdist.TCPStore) -> None:
    client = tdist.TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5), secret=SECRET)
    try:
        assert client._send_seal is not None and client._recv_seal is not None
        client.set("a", b"x" * 100_000)  # a value past the bulk threshold
        assert server.get("a") == b"x" * 100_000
        assert client.add("n", 5) == 5 and client.check(["a", "n"])
        client.multi_set(["b", "c"], ["1", "2"])
        assert client.multi_get(["b", "c"]) == [b"1", b"2"]
        with pytest.raises(DistError):
            client.wait(["missing"], timedelta(milliseconds=50))
        assert client.compare_set("a", "nope", "z") == b"x" * 100_000
        client.queue_push("q", "v")
        assert client.queue_pop("q") == b"v"
    finally:
        client.close()


# -- another user --------------------------------------------------------------------------------
class Squatter:
    """A child process running as ``nobody`` that holds the abstract Unix socket ``name`` (and
    never answers on it)."""

    def __init__(self, name: str) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # (the child: nothing of pytest's runs here)
            try:
                os.close(r)
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind(name)
                s.listen(16)
                os.write(w, b"1")
                time.sleep(120)
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1", "the squatter could not take the name"
        os.close(r)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


@as_root
def test_a_store_whose_unix_name_is_taken_says_so_and_by_whom() -> None:
    port = free_port()
    squatter = Squatter(unix_address(port))
    try:
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match=rf"taken \(by pid {squatter.pid} of user {NOBODY}\)"):
            StoreServer("127.0.0.1", port, secret=SECRET)
        assert time.monotonic() - t0 < 10  # at once, not at a timeout
    finally:
        squatter.close()


@as_root
def test_clients_do_not_talk_to_a_stranger_holding_the_stores_unix_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # a store that does not listen on Unix (TDIST_STORE_UNIX=0 on its side) leaves the name
    # free: a stranger takes it; clients that try it first find it is not ours and use TCP
    monkeypatch.setenv("TDIST_STORE_UNIX", "0")
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), secret=SECRET)
    monkeypatch.setenv("TDIST_STORE_UNIX", "1")
    squatter = Squatter(unix_address(master.port))
    try:
        t0 = time.monotonic()
        client = tdist.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=30), secret=SECRET)
        assert client.transport == "tcp" and time.monotonic() - t0 < 10
        client.set("k", "v")
        assert master.get("k") == b"v"
        client.close()
    finally:
        squatter.close()
        master.close()


def _as_nobody(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as ``nobody``; what it returns (or raises, as text)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = repr(fn())
            except BaseException as exc:
                out = f"{type(exc).__name__}: {exc}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@as_root
def test_the_store_refuses_a_unix_client_of_another_user(server: tdist.TCPStore) -> None:
    def connect() -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(unix_address(server.port))
        return s.recv(100)  # closed before the HELLO

    assert _as_nobody(connect) == "b''"


@as_root
def test_rpc_and_process_group_listeners_refuse_a_unix_peer_of_another_user() -> None:
    from tdist.transport import _handshake

    book: dict[int, Any] = {}
    m = Messenger(0, "node0", b"t" * 16, b"s", lambda p: book[p], str, lambda *a: None, lambda *a: None)
    try:
        name = m.address["unix"]

        def join() -> Any:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect("\0" + name)
            return _handshake.connect(s, 1, b"t" * 16, b"s", "node0")

        assert "AuthenticationError" in _as_nobody(join) or "ConnectionResetError" in _as_nobody(join)
    finally:
        m.close()


@as_root
def test_a_unix_peer_of_another_user_is_refused_by_the_connecting_side() -> None:
    from tdist.transport import _handshake

    name = f"\0tdist-test-{os.getpid()}-{time.monotonic_ns()}"
    squatter = Squatter(name)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(name)
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match=f"pid {squatter.pid} of user {NOBODY}"):
            _handshake.connect(s, 1, b"t" * 16, b"s", "peer")
        assert time.monotonic() - t0 < 5  # at once: it never waits for the stranger's HELLO
        s.close()
    finally:
        squatter.close()


# -- RPC and process-group connections -----------------------------------------------------------
class _Node:
    def __init__(self, my_id: int, book: dict[int, Any], secret: bytes | None = b"s3cret") -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.lost: queue.Queue[Any] = queue.Queue()
        self.m = Messenger(
            my_id, f"node{my_id}", b"t" * 16, secret, lambda p: book[p], lambda p: f"node{p}",
            lambda peer, tag, meta, payload: self.inbox.put(
                ser.loads_parts(payload[0], payload[1:]) if isinstance(payload, list) else ser.loads(payload)),
            lambda p, e, g: self.lost.put((p, e)), stall_timeout=60.0, heartbeat_interval=30.0,
        )  # (no heartbeat in the way: what the relay changes is the message)
        book[my_id] = self.m.address


@pytest.mark.parametrize("size", [100, 300_000], ids=["small", "large"])
def test_a_relay_cannot_change_an_rpc_message(size: int) -> None:
    book: dict[int, Any] = {}
    a, b = _Node(0, book), _Node(1, book)
    relay = None
    try:
        a.m.send(1, 1, b"\x01", ser.dumps("hello"), time.monotonic() + 10)  # (b learns a's address)
        assert b.inbox.get(timeout=10) == "hello"
        # a reaches b through the relay, over TCP (another "host")
        real = dict(book[1])
        relay = Relay((real["addr"], real["port"]), 1 << 40, flip_last_byte)
        book[1] = {**real, "host": "elsewhere", "port": relay.port}
        a.m._table.peers.pop(1, None)  # (a forgets its connection: it dials anew)
        a.m._table._all.pop(1, None)
        a.m.send(1, 2, b"\x01", ser.dumps("through the relay"), time.monotonic() + 10)
        assert b.inbox.get(timeout=10) == "through the relay"  # an honest relay is harmless
        relay.after = relay.sent_up  # (the next bytes a sends: its message, or a heartbeat)
        try:
            a.m.send(1, 3, b"\x01", ser.dumps(torch.arange(size // 8, dtype=torch.float64)), time.monotonic() + 10)
        except PeerError:
            pass  # (b may drop the connection while a still writes)
        assert relay.tampered.wait(10)
        peer, _ = a.lost.get(timeout=10)  # b dropped the connection
        assert peer == 1
        with pytest.raises(queue.Empty):
            b.inbox.get(timeout=1)  # and never delivered the changed message
    finally:
        if relay is not None:
            relay.close()
        a.m.close()
        b.m.close()


@pytest.mark.parametrize("size", [1000, 3 << 20])  # (a large payload is tagged in pieces)
@pytest.mark.parametrize("honest", [False, True])
def test_a_relay_cannot_change_a_process_group_message(size: int, honest: bool) -> None:
    store = tdist.HashStore()
    payload = os.urandom(size)
    relays: list[Relay] = []

    class Rewriting(tdist.PrefixStore):
        """Rank 1 reads rank 0's address as the relay's (on another "host": TCP)."""

        def get(self, key: str) -> bytes:
            value = super().get(key)
            if key == "ep/0":
                import json

                info = json.loads(value)
                relay = Relay((info["addr"], info["port"]), 1 << 40, (lambda d: d) if honest else flip_middle_byte)
                relays.append(relay)
                value = json.dumps({**info, "host": "elsewhere", "port": relay.port}).encode()
            return value

        def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # (the endpoint reads every address at once)
            return [self.get(k) for k in keys]

    def body(rank: int, n: int) -> str:
        s = Rewriting("g", store) if rank == 1 else tdist.PrefixStore("g", store)
        ep = Endpoint(s, rank, n, timeout=10, secret=SECRET, heartbeat_interval=0.2, stall_timeout=5)
        try:
            if rank == 1:
                relays[0].after = relays[0].sent_up  # (the handshake went through untouched)
                with contextlib.suppress(DistError):
                    ep.send(0, 7, [payload])
                return "sent"
            out = bytearray(size)
            try:
                ep.wait(ep.post_recv(1, 7, memoryview(out)), time.monotonic() + 10)
            except PeerError as exc:
                return str(exc)
            return "received intact" if out == payload else "received changed"
        finally:
            ep.close()

    try:
        results = run_threads(body, 2, timeout=40)
    finally:
        for r in relays:
            r.close()
    if honest:
        assert results[0] == "received intact", results
    else:
        assert "authentication tag" in results[0], results


def test_launcher_job_with_a_secret_runs_rpc_and_collectives(tmp_path: Any) -> None:
    # every connection of a `tdist run` job is authenticated (a per-job secret): the frames of
    # the store, the process group and RPC all carry tags, and the job works
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import torch, tdist, tdist.rpc as rpc\n"
        "tdist.init_process_group('gloo')\n"
        "r = tdist.get_rank()\n"
        "t = torch.ones(100_000) * (r + 1)\n"
        "tdist.all_reduce(t)\n"
        "tdist.send(torch.full((70_000,), 5.0), 1 - r) if r == 0 else None\n"
        "if r == 1:\n"
        "    got = torch.empty(70_000); tdist.recv(got, 0); assert got.eq(5).all()\n"
        "rpc.init_rpc(f'w{r}', rank=r, world_size=2)\n"
        "back = rpc.rpc_sync(f'w{1 - r}', torch.add, args=(torch.ones(50_000), 1))\n"
        "assert back.eq(2).all() and t.eq(3).all()\n"
        "rpc.shutdown()\n"
        "tdist.destroy_process_group()\n"
        "print('ok', r)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TDIST_SECRET", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    res = subprocess.run(
        [sys.executable, "-m", "tdist.cli", "run", "--nproc-per-node", "2", "--master-port", "0", str(script)],
        capture_output=True, text=True, timeout=50, env=env,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("ok ")) == ["ok 0", "ok 1"]
