"""The peer transport over real sockets: matching, any-source, mismatches, auth, failures."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import pytest
import torch

import tdist
from tdist._core.errors import DistError, DistTimeoutError, PeerError
from tdist.testing import run_processes, run_threads
from tdist.transport import Endpoint

from .._sync import join_or_kill, when_inside
from ._faults import ShortOnce

pytestmark = pytest.mark.timeout(60)


def view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def test_ring_exchange_ordering_and_any_source() -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> list[float]:
        ep = Endpoint(tdist.PrefixStore("g", store), rank, n, timeout=10)
        try:
            nxt, prv = (rank + 1) % n, (rank - 1) % n
            # several messages with one tag arrive in order, early or late
            for i in range(5):
                ep.send(nxt, 1, [view(torch.tensor([float(rank * 100 + i)]))])
            got = []
            for _ in range(5):
                out = torch.empty(1)
                ep.wait(ep.post_recv(prv, 1, view(out)), time.monotonic() + 5)
                got.append(out.item())
            assert got == [float(prv * 100 + i) for i in range(5)]
            # a large message lands straight in the posted buffer
            big = torch.arange(1 << 20, dtype=torch.float32) + rank
            dst = torch.empty_like(big)
            h = ep.post_recv(prv, 2, view(dst))
            ep.send(nxt, 2, [view(big)])
            ep.wait(h, time.monotonic() + 10)
            assert torch.equal(dst, torch.arange(1 << 20, dtype=torch.float32) + prv)
            # any source, with the sender reported
            if rank == 0:
                sources = set()
                for _ in range(n - 1):
                    h = ep.post_recv(-1, 3)
                    ep.wait(h, time.monotonic() + 5)
                    assert h.data == f"hi from {h.source}".encode()
                    sources.add(h.source)
                assert sources == set(range(1, n))
            else:
                ep.send(0, 3, [f"hi from {rank}".encode()])
            ep.send(nxt, 4, [b"done"])
            ep.wait(ep.post_recv(prv, 4), time.monotonic() + 5)
            return got
        finally:
            ep.close()

    run_threads(body, 3, timeout=30)


def test_size_and_fingerprint_mismatches_are_errors() -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> None:
        ep = Endpoint(tdist.PrefixStore("m", store), rank, n, timeout=10)
        try:
            if rank == 0:
                ep.send(1, 5, [b"x" * 8], meta=b"all_reduce#1 float32 [2]")
                ep.send(1, 6, [b"y" * 8], meta=b"broadcast#2 float32 [2]")
                ep.wait(ep.post_recv(1, 7), time.monotonic() + 5)
            else:
                with pytest.raises(DistError, match="sent 8 bytes but the receiving tensor holds 4"):
                    ep.wait(ep.post_recv(0, 5, memoryview(bytearray(4)), b"all_reduce#1 float32 [2]"), time.monotonic() + 5)
                with pytest.raises(DistError, match="mismatched calls: rank 0 sent broadcast#2"):
                    ep.wait(ep.post_recv(0, 6, memoryview(bytearray(8)), b"all_reduce#2 float32 [2]"), time.monotonic() + 5)
                ep.send(0, 7, [b""])
        finally:
            ep.close()

    run_threads(body, 2, timeout=30)


def test_wrong_secret_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> str:
        secret = "right" if rank == 0 else "wrong"
        try:
            ep = Endpoint(tdist.PrefixStore("a", store), rank, n, timeout=2, secret=secret)
        except DistError as exc:
            return type(exc).__name__
        ep.close()
        return "connected"

    results = run_threads(body, 2, timeout=30)
    assert results[1] == "AuthenticationError"
    assert results[0] != "connected"  # rank 0 never got an authenticated rank 1


def _fault_rank(rank: int, n: int, port: int) -> None:
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20))
    ep = Endpoint(tdist.PrefixStore("f", store), rank, n, timeout=20, heartbeat_interval=0.2, stall_timeout=1.5)
    store.set(f"pid{rank}", str(os.getpid()))
    if rank == 1:
        time.sleep(60)  # the victim: killed or stopped by the test
        os._exit(0)
    store.wait(["armed"])
    t0 = time.monotonic()
    # (the test stops rank 1 once this rank waits for it: a watcher of its stack says so)
    when_inside("wait", lambda: store.clone().set(f"waiting{rank}", "1"), "_endpoint.py")
    try:
        ep.wait(ep.post_recv(1, 9), t0 + 30, "recv from the victim")
        store.set(f"result{rank}", json.dumps(["no error"]))
    except PeerError as exc:
        store.set(f"result{rank}", json.dumps([time.monotonic() - t0, str(exc), exc.peer]))
    os._exit(0)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_stalled_peer_fails_every_waiter(how: str) -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_fault_rank, args=(r, 3, master.port)) for r in range(3)]
    for p in procs:
        p.start()
    victim = 0
    try:
        master.wait(["pid0", "pid1", "pid2"])
        victim = int(master.get("pid1"))
        master.set("armed", "1")
        master.wait(["waiting0", "waiting2"])  # they wait for the victim's message
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        results = [json.loads(master.get(f"result{r}")) for r in (0, 2)]
        for elapsed, message, peer in results:
            assert peer == 1
            assert elapsed < 5, message
            assert "rank 1" in message
            assert ("stalled" in message) == (how == "stop"), message
    finally:
        if victim:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, sig)
        join_or_kill(procs)
        master.close()


def _threads_started_forming(rank: int, n: int, port: int) -> list[str]:
    # (counted as they are made: some start without waiting to run, ``QuickThread``)
    made: list[threading.Thread] = []
    init = threading.Thread.__init__

    def counted(self: threading.Thread, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    threading.Thread.__init__ = counted  # type: ignore[method-assign]
    try:
        ep = Endpoint(tdist.PrefixStore("threads", tdist.TCPStore("127.0.0.1", port)), rank, n, timeout=30)
    finally:
        threading.Thread.__init__ = init  # type: ignore[method-assign]
    started = [t.name for t in made if t.is_alive() or t.ident is not None]
    ep.close()
    return started


def test_forming_a_mesh_starts_one_thread_per_rank_however_many_peers_it_dials_or_lets_in() -> None:
    # rank 0 lets 3 in, rank 3 dials 3, ranks 1 and 2 do both: each starts its reader only
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        started = run_processes(_threads_started_forming, 4, master.port, timeout=60)
    finally:
        master.close()
    assert [len(names) for names in started] == [1, 1, 1, 1], started


def _big_exchange(rank: int, n: int, port: int, refuse: bool, slow_acks: bool = False) -> list[str]:
    from tdist.transport import _memory

    if slow_acks and rank == 0:
        # acks leave from a thread a moment after the receive completes: a receiver that closes
        # right after its last receive must still send them (else its sender sees it leave)
        real_ack_loop = Endpoint._ack_loop

        def slow_ack_loop(self: Endpoint, acks: Any) -> None:
            class Slow:
                def get(self) -> Any:
                    item = acks.get()
                    time.sleep(0.2)
                    return item

            real_ack_loop(self, Slow())

        Endpoint._ack_loop = slow_ack_loop  # type: ignore[method-assign]
    if refuse and rank == 1:
        # a receiver that may not read the sender's memory (as under a strict ptrace policy)
        def refused(*args: object) -> int:
            ctypes.set_errno(errno.EPERM)
            return -1

        _memory._process_vm_readv = refused
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20))
    ep = Endpoint(tdist.PrefixStore(f"big{refuse}", store), rank, n, timeout=20)
    out = []
    try:
        peer = 1 - rank
        size = 3 << 20
        for i in range(4):
            mine = torch.full((size,), float(rank * 10 + i))
            got = torch.empty(size)
            if i % 2 == 0:  # receive posted first: one copy, straight into `got`
                h = ep.post_recv(peer, i, view(got))
                ep.send(peer, i, [view(mine)])
            else:  # receive posted late: the message waits in a pooled buffer
                if rank == 0:
                    ep.send(peer, i, [view(mine)])
                deadline = time.monotonic() + 10  # (rank 1 sends once it has rank 0's message)
                while i not in ep._peers[peer].unexpected:  # until it is here, unclaimed
                    assert time.monotonic() < deadline, f"message {i} never arrived"
                    time.sleep(0.001)
                h = ep.post_recv(peer, i, view(got))
                if rank == 1:
                    ep.send(peer, i, [view(mine)])
            ep.wait(h, time.monotonic() + 10)
            assert torch.equal(got, torch.full((size,), float(peer * 10 + i))), i
            out.append("cma" if ep._peers[peer].cma_ok else "inline")
    finally:
        ep.close()
    return out


@pytest.mark.parametrize("refuse", [False, True])
def test_large_messages_between_processes(refuse: bool) -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        results = run_processes(_big_exchange, 2, master.port, refuse, timeout=60)
    finally:
        master.close()
    assert results[1][-1] == "cma"  # rank 1 reads rank 0's memory... unless refused:
    assert results[0][-1] == ("inline" if refuse else "cma")


def test_close_sends_pending_acks_first() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        results = run_processes(_big_exchange, 2, master.port, False, True, timeout=60)
    finally:
        master.close()
    assert results[0][-1] == results[1][-1] == "cma"


def test_a_heartbeat_written_in_part_is_finished_before_the_next_frame() -> None:
    store = tdist.HashStore()
    cut = threading.Event()

    def body(rank: int, n: int) -> list[bytes]:
        ep = Endpoint(tdist.PrefixStore("hb", store), rank, n, timeout=10, heartbeat_interval=0.2)
        try:
            got = []
            if rank == 0:
                short = ShortOnce(ep._peers[1].sock)
                ep._peers[1].sock = short  # type: ignore[assignment]
                assert short.cut.wait(5)  # a heartbeat went out in part
                cut.set()
                for i in range(3):
                    ep.send(1, i, [f"after {i}".encode()])
            else:
                assert cut.wait(10)
                for i in range(3):
                    h = ep.post_recv(0, i)
                    ep.wait(h, time.monotonic() + 5)
                    got.append(h.data)
            ep.send(1 - rank, 9, [b"bye"])
            ep.wait(ep.post_recv(1 - rank, 9), time.monotonic() + 5)
            return got
        finally:
            ep.close()

    assert run_threads(body, 2, timeout=30)[1] == [b"after 0", b"after 1", b"after 2"]


class _CuttingRelay:
    """Between rank 1 and rank 0 (TCP): once ``hold`` is set, forwards ``limit`` more bytes
    from rank 1, then holds the rest until ``cut``, and then closes both connections."""

    def __init__(self, target: tuple[str, int], limit: int) -> None:
        import socket

        self.target = target
        self.limit = limit
        self.hold = threading.Event()
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[Any] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket

        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            self.socks = [client, server]
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
            self._pump(client, server, True)

    def _pump(self, src: Any, dst: Any, up: bool) -> None:
        left = self.limit
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536 if not (up and self.hold.is_set()) else max(1, left))
                if not data:
                    break
                if up and self.hold.is_set():
                    left -= len(data)
                    if left <= 0:
                        dst.sendall(data)
                        self.cut.wait(30)
                        for s in self.socks:
                            with contextlib.suppress(OSError):
                                s.shutdown(2)
                        return
                dst.sendall(data)


class _Relayed(tdist.PrefixStore):
    """Rank 1's view of the group's store: rank 0's address is a ``_CuttingRelay`` to it
    (appended to ``relays``; forwarding 100,000 bytes once held), on another "host" (TCP)."""

    def __init__(self, prefix: str, store: Any, relays: list[_CuttingRelay]) -> None:
        super().__init__(prefix, store)
        self.relays = relays

    def get(self, key: str) -> bytes:
        value = super().get(key)
        if key == "ep/0":
            info = json.loads(value)
            self.relays.append(_CuttingRelay((info["addr"], info["port"]), 100_000))
            value = json.dumps({**info, "host": "elsewhere", "port": self.relays[0].port}).encode()
        return value

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # (the endpoint reads every address at once)
        return [self.get(k) for k in keys]


def _send_held(ep: Endpoint, relay: _CuttingRelay, size: int) -> str:
    """Rank 1: send rank 0 a message of ``size`` bytes (tag 7) that ``relay`` holds part-way."""
    relay.hold.set()
    with contextlib.suppress(DistError):
        ep.send(0, 7, [bytes(size)], deadline=time.monotonic() + 30)
    return "sent"


def _await_arriving(ep: Endpoint) -> None:
    """Rank 0: until rank 1's message (tag 7) is arriving, unclaimed, held by the relay."""
    peer = ep._peers[1]
    deadline = time.monotonic() + 20
    while 7 not in peer.unexpected:
        assert time.monotonic() < deadline, "the message never started to arrive"
        time.sleep(0.005)


def test_a_receive_matched_to_a_message_still_arriving_fails_with_its_connection() -> None:
    # A receive posted while its message is coming in takes that message over; the connection
    # then goes mid-message: the receive fails at once, naming the peer (it used to wait for
    # its deadline: the message had left the list of early arrivals that a failure empties).
    store = tdist.HashStore()
    relays: list[_CuttingRelay] = []
    size = 1 << 20

    def body(rank: int, n: int) -> str:
        s = _Relayed("g", store, relays) if rank == 1 else tdist.PrefixStore("g", store)
        ep = Endpoint(s, rank, n, timeout=10, heartbeat_interval=0.2, stall_timeout=20)
        try:
            if rank == 1:
                return _send_held(ep, relays[0], size)
            _await_arriving(ep)
            handle = ep.post_recv(1, 7, memoryview(bytearray(size)))
            relays[0].cut.set()
            t0 = time.monotonic()
            try:
                ep.wait(handle, t0 + 25)
            except PeerError as exc:
                return f"PeerError after {time.monotonic() - t0:.1f} s: {exc}"
            except DistError as exc:
                return f"{type(exc).__name__}: {exc}"
            return "received"
        finally:
            ep.close()

    results = run_threads(body, 2, timeout=50)
    assert results[0].startswith("PeerError"), results
    assert "rank 1" in results[0]


def test_a_waiting_thread_reads_its_own_message_and_the_reader_reads_on_after_it() -> None:
    # A thread waiting for a message from one peer reads that connection itself: the message
    # (small, or large and placed straight into the receive) is delivered by the waiting thread,
    # with no hand-off from the reader thread. A wait that ends at its deadline gives the
    # connection back: the reader delivers what comes next.
    store = tdist.HashStore()
    eps: dict[int, Endpoint] = {}
    formed = threading.Barrier(2)
    timed_out = threading.Event()
    delivered: list[tuple[str, int, str]] = []  # (how, tag, the thread that delivered it)
    size = 1 << 20

    def body(rank: int, n: int) -> str:
        ep = eps[rank] = Endpoint(tdist.PrefixStore("own", store), rank, n, timeout=10, heartbeat_interval=30)
        try:
            formed.wait(10)
            if rank == 0:
                peer = eps[1]._peers[0]
                for tag, payload in ((1, b"small"), (2, bytes(range(256)) * (size // 256))):
                    deadline = time.monotonic() + 10
                    while tag not in peer.posted or not peer.rlock.locked():  # rank 1 waits, reading
                        assert time.monotonic() < deadline, "rank 1 never read its connection"
                    ep.send(1, tag, [payload])
                assert timed_out.wait(10)
                ep.send(1, 3, [b"later"])
                return "sent"
            on_data, on_data_in = ep._on_data, ep._on_data_in

            def spy_data(p: Any, tag: int, meta: bytes, payload: memoryview, seq: int = -1) -> None:
                delivered.append(("small", tag, threading.current_thread().name))
                on_data(p, tag, meta, payload, seq)

            def spy_data_in(p: Any, payload: memoryview) -> None:
                delivered.append(("large", -1, threading.current_thread().name))
                on_data_in(p, payload)

            ep._on_data = spy_data  # type: ignore[method-assign]
            ep._on_data_in = spy_data_in  # type: ignore[method-assign]
            small = ep.wait(ep.post_recv(0, 1), time.monotonic() + 10)
            big = bytearray(size)
            ep.wait(ep.post_recv(0, 2, memoryview(big)), time.monotonic() + 10)
            later = ep.post_recv(0, 3)
            with pytest.raises(DistTimeoutError):
                ep.wait(later, time.monotonic() + 0.2)
            timed_out.set()
            assert later.wait_finished(10), "the reader did not read on after the wait ended"
            assert small.data == b"small" and big == bytes(range(256)) * (size // 256) and later.data == b"later"
            return threading.current_thread().name
        finally:
            ep.close()

    waiter = run_threads(body, 2, timeout=40)[1]
    assert [(how, tag) for how, tag, _ in delivered] == [("small", 1), ("large", -1), ("small", 3)], delivered
    assert delivered[0][2] == waiter and delivered[1][2] == waiter, (waiter, delivered)
    assert delivered[2][2].startswith("tdist-rd-"), delivered


def test_a_frame_stuck_half_way_from_one_peer_holds_up_no_other_peer() -> None:
    # One reader thread reads every connection of a rank: it reads what a connection has and
    # moves on, inside a frame too, so rank 1's large message stuck half-way (a relay holds its
    # rest) keeps rank 2's message to the same rank waiting for nothing.
    store = tdist.HashStore()
    relays: list[_CuttingRelay] = []
    size = 1 << 20

    stuck = threading.Event()

    def body(rank: int, n: int) -> str:
        s = _Relayed("g", store, relays) if rank == 1 else tdist.PrefixStore("g", store)
        ep = Endpoint(s, rank, n, timeout=10, heartbeat_interval=0.2, stall_timeout=30)
        try:
            if rank == 1:
                return _send_held(ep, relays[0], size)
            if rank == 2:
                assert stuck.wait(20)
                ep.send(0, 8, [b"from rank 2"])
                return "sent"
            _await_arriving(ep)
            stuck.set()
            got = ep.wait(ep.post_recv(-1, 8), time.monotonic() + 10)  # (read by the reader thread)
            relays[0].cut.set()
            return f"{got.source}: {bytes(cast(bytearray, got.data)).decode()}"
        finally:
            ep.close()

    results = run_threads(body, 3, timeout=50)
    assert results[0] == "2: from rank 2", results


def test_a_send_to_a_peer_that_left_waits_for_its_goodbye_to_be_read_and_breaks_nothing() -> None:
    # Rank 0 leaves (GOODBYE, then it closes). Rank 1 writes to it before its reader has read
    # that GOODBYE: the write fails (EPIPE). The sender must not judge the loss itself (a loss
    # without a goodbye breaks the whole group): whoever reads the connection reads the goodbye,
    # then the end. Rank 1's reader is kept from reading until the send has failed.
    from .._sync import holds_for, inside, wait_until

    store = tdist.HashStore()
    eps: dict[int, Endpoint] = {}
    formed, closed = threading.Barrier(2), threading.Event()
    judged: list[str] = []

    def body(rank: int, n: int) -> Any:
        ep = eps[rank] = Endpoint(tdist.PrefixStore("bye", store), rank, n, timeout=10, heartbeat_interval=30)
        formed.wait(10)
        if rank == 0:
            ep.close()
            closed.set()
            return None
        p = ep._peers[0]
        assert p.rlock.acquire(timeout=10)  # (the reader cannot read rank 0's connection now)
        real_lost = ep._lost

        def lost(q: Any, exc: BaseException | None, what: str) -> Any:
            judged.append(threading.current_thread().name)
            return real_lost(q, exc, what)

        ep._lost = lost  # type: ignore[method-assign]
        try:
            assert closed.wait(10)
            outcome: list[BaseException] = []

            def send() -> None:
                try:
                    for _ in range(100):  # (the first writes may still go into the socket's buffer)
                        ep.send(0, 1, [b"x" * 65536])
                except BaseException as exc:
                    outcome.append(exc)

            sender = threading.Thread(target=send, name="sender")
            sender.start()
            wait_until(lambda: inside(sender, "_sendmsg") or outcome, 10, "the sender writes")
            holds_for(lambda: "sender" not in judged, 0.3, "the sender judged the loss before the goodbye was read")
        finally:
            p.rlock.release()
            ep._arm(p)
        sender.join(10)
        assert outcome and isinstance(outcome[0], PeerError) and "left the process group" in str(outcome[0]), outcome
        broken = ep.broken
        ep.close()
        return broken

    assert run_threads(body, 2, timeout=40)[1] is None  # (an orderly leave breaks nothing)
