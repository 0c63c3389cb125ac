"""One rank's end of a process group's mesh of connections.

Theory of operation. At start every rank listens (TCP on the address other hosts reach it by,
plus an abstract Unix socket for ranks of the same host), publishes its address in the group's
store, then connects to every lower rank and accepts every higher one (a full mesh, as gloo
builds it). Each connection is authenticated (``_protocol`` handshake) before any frame is read.

Each connection is a ``_link.Link`` in the connection table both front ends share
(``_table.Table``: the mesh is its ``mesh``). One reader thread waits on its epoll set of every
connection (one-shot registrations) and reads what comes on a readable one, matching frames, in
order, to the receives posted for that peer and tag: the payload goes straight into the
destination memory of a posted receive, or into a fresh buffer kept until a receive is posted.
It reads what is there and moves on, inside a frame too (the decoder keeps its place), so one
peer's slow frame holds up no other peer. A thread that waits for a message (or an ack) from one
peer reads that peer's connection itself (``_read_own``), as the RPC messenger's callers do: it
takes the connection's read lock and disarms its registration, so the message reaches it with
no thread hand-off (the reader takes the connection back when the waiter arms it again).
Because every connection is always read by someone, a blocking send can never deadlock against
its peer. Senders write with scatter-gather ``sendmsg`` under the connection's send lock.

Lanes (``enable_lanes``, which the backend calls when its shared-memory arena is up): a small
message to a peer of this host goes into a shared-memory ring (``_lane``) instead of the
socket. Its waiter polls the rings it may hear from for the spin budget (``_core.spin``), then
counts itself asleep there, and the producer wakes it with a frame on the socket, which its
reader answers by reading the ring. Every message to a peer that has our lane is numbered, and
the receiver matches lane and socket messages in their numbers' order (``_turn``).

Failure: EOF or a reset marks the peer dead, and every receive waiting on it fails at once with
a ``PeerError`` naming the rank, its address and the operation; the reader thread's heartbeat
rounds send a small frame on every connection quiet for ``heartbeat_interval``, so a peer that
stops without closing (SIGSTOP, a hung host) is reported as stalled once nothing has come from it
for ``stall_timeout`` seconds. ``abort(reason)`` tells every peer that this rank gives the group
up, so that ranks waiting on a third rank do not wait for their timeout.

Thread-safety: ``send``, ``post_recv`` and ``wait`` may be called from any thread. Messages
between two ranks with the same tag are delivered in the order they were sent.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

from .._core import auth, patience, spin
from .._core._process import gone_here, pid_space
from .._core.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistError,
    DistNetworkError,
    DistTimeoutError,
    PeerError,
    RemoteProtocolError,
    StoreTimeoutError,
    fresh,
)
from .._core.threads import QuickThread
from ..store._api import multi_get_within, waits_in_chunks
from . import _handshake
from ._dial import Doorway, Listeners, PeerAddress
from ._lane import MAX_RECORD, RECORD, Lane, Record
from ._link import Copy, Link, advertised_address, host_id
from ._liveness import (
    GROUP_STALL,
    STALL_CAUSES,
    Heartbeats,
    default_interval,
    default_stall_timeout,
    still_running,
)
from ._memory import CMA_MIN, address, cma_read, fresh_buffer
from ._protocol import (
    TOKEN_SIZE,
    Arriving,
    Frame,
    Kind,
    pack_ack,
    pack_cma,
    unpack_cma,
)
from ._table import Table

__all__ = ["Endpoint", "RecvHandle"]

log = logging.getLogger(__name__)

_SEQ = struct.Struct("<Q")  # a numbered socket message's number, in front of its meta
_NUMBERED = {Kind.DATA: Kind.DATA_SEQ, Kind.DATA_CMA: Kind.DATA_CMA_SEQ}
_FAILED = "ep/failed"  # a rank that failed to form the group says so here (``publish_failure``)
# how long a reader waits for the receive of a cross-memory message before buffering it
_CMA_DEFER = 0.005


def _publish(store: Any, rank: int, why: str) -> None:
    """Say in ``store`` that ``rank`` ``why`` (``"failed to form it: ..."``), unless another
    rank's failure was said first. Never raises."""
    with contextlib.suppress(Exception):
        store.compare_set(_FAILED, "", json.dumps({"rank": rank, "why": why[:2000]}))


class RecvHandle:
    """A posted receive: completes when a matching message has landed in ``buffer``.

    Its completion is a latch made of one lock, held until then (an ``Event`` is a Condition
    and two locks: its set and wait cost several times as much on the 4-byte ping-pong's path).
    """

    __slots__ = (
        "_latch", "at_most", "buffer", "data", "error", "expect_meta", "finished", "meta", "nbytes", "peer",
        "source", "tag", "what",
    )

    def __init__(
        self, peer: int, tag: int, buffer: memoryview | None, expect_meta: bytes | None, what: str, at_most: bool = False
    ) -> None:
        self.peer = peer  # -1: any source
        self.tag = tag
        self.buffer = buffer
        self.at_most = at_most  # (a shorter message fills the start of ``buffer``)
        self.expect_meta = expect_meta
        self.what = what
        self.finished = False
        self._latch = _allocate_lock()
        self._latch.acquire()
        self.error: DistError | None = None
        self.source = -1
        self.data: bytes | bytearray | memoryview | None = None
        self.meta = b""
        self.nbytes = 0

    def _finish(self, source: int, error: DistError | None = None) -> None:
        if self.finished:
            return
        self.source = source
        self.error = error
        self.finished = True
        try:
            self._latch.release()
        except RuntimeError:  # (finished by two threads at once: the first one's result stands)
            pass

    def wait_finished(self, timeout: float) -> bool:
        """Whether it finished within ``timeout`` seconds."""
        if self.finished:
            return True
        if not self._latch.acquire(timeout=timeout):
            return False
        self._latch.release()  # (open for good: a later wait returns at once)
        return True


class _Pending:
    """A message that arrived (or is arriving) before its receive was posted."""

    __slots__ = ("data", "done", "handle", "meta", "nbytes")

    def __init__(self, meta: bytes, nbytes: int) -> None:
        self.meta = meta
        self.nbytes = nbytes
        self.data: memoryview | None = None
        self.done = False
        self.handle: RecvHandle | None = None


def _numbered(meta: bytes) -> tuple[int, bytes]:
    """A numbered frame's number and its own meta."""
    if len(meta) < _SEQ.size:
        raise RemoteProtocolError("a numbered frame without its number")
    return _SEQ.unpack_from(meta)[0], meta[_SEQ.size:]


class _Peer(Link):
    """A link to one rank of the group, with the group's matching state."""

    def __init__(self, rank: int, sock: socket.socket, addr: str, same_host: bool, session: _handshake.Session | None) -> None:
        super().__init__(rank, sock, addr, same_host, session)
        self.rank = rank
        self.error: DistError | None = None
        self.said_goodbye = False
        self.posted: dict[int, deque[RecvHandle]] = {}
        self.unexpected: dict[int, deque[_Pending]] = {}
        self.budget = spin.Budget()  # (a waiter's spin there)
        self.read_over = False  # the connection broke the protocol or ended: nobody reads on
        # the message whose payload is being read (its receive, or the early arrival a
        # receive may take over meanwhile): if the connection goes, that receive fails with it
        self.arriving: RecvHandle | _Pending | None = None
        self.arriving_error: DistError | None = None  # (why that receive fails once it is in)
        # shared-memory lanes (``enable_lanes``): ours to the peer and the peer's to us, and the
        # sequence numbers that order what goes by lane and what by socket
        self.lane_ok = False  # may small messages to this peer go by lane?
        self.lane_out: Lane | None = None
        self.lane_ready = False  # has the peer mapped ``lane_out`` (``LANE_OK``)?
        self.tx_seq = 0  # the number of the next message to the peer, once ``lane_out`` exists
        self.lane_in: Lane | None = None
        self.rx_seq = 0  # the number of the next message from the peer to match

    def describe(self) -> str:
        return f"rank {self.rank} ({self.addr})"


class Endpoint:
    """This rank's connections to every other rank of a group.

    Args:
        store: the group's private store (addresses are published in it).
        rank: this rank in the group.
        size: the group's size.
        timeout: seconds to build the mesh.
        secret: the job's secret (default ``TDIST_SECRET``); peers must prove it.
        heartbeat_interval: seconds between heartbeats on a quiet connection.
        stall_timeout: seconds without a byte from a peer before a waiter calls it stalled.
        name: a label for messages (the group's name).
        connect_later: return once every rank's address is known (``peer_host`` and the like
            answer); the caller must call ``connected()`` before anything else, and this rank
            accepts and makes its connections only then (what the caller does before it, all
            ranks have done before any rank's ``connected()`` returns).
        extra: JSON-able data published with this rank's address; every peer's is in
            ``peer_extras`` once the constructor returns (one exchange through the store for
            the group's other set-up too: the backend's shared-memory arena).
        gone: ``gone(peer)``: why ``peer`` is known gone (its process died, say: a sub-group's
            parent knows), or None. A peer whose address does not come and that is gone fails
            the wait at once, naming it, where it would wait out ``timeout``.

    Raises:
        DistNetworkError, AuthenticationError, DistTimeoutError: the mesh could not be built
        (with ``connect_later``, from ``connected()``).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        timeout: float = 300.0,
        secret: str | bytes | None = None,
        heartbeat_interval: float | None = None,
        stall_timeout: float | None = None,
        name: str = "",
        connect_later: bool = False,
        extra: Any = None,
        gone: Callable[[int], str | None] | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.name = name
        self._label = f"rank {rank}"
        self.secret = auth.resolve_secret(secret)
        self.heartbeat_interval = heartbeat_interval or default_interval()
        self.stall_timeout = stall_timeout or default_stall_timeout(GROUP_STALL)
        self.host_id = host_id()
        self._lock = threading.Lock()
        self._posted_cv = threading.Condition(self._lock)  # notified when a receive is posted
        # the connections (``_table``: by rank, by descriptor, and the one epoll set of them all)
        self._table: Table[_Peer] = Table(
            _Peer, my_id=rank, token=None, secret=self.secret, label=self._label,
            shut=f"the process group {name!r} was destroyed",
        )
        self._peers = self._table.peers
        self._any_posted: dict[int, deque[RecvHandle]] = {}
        self._broken: DistError | None = None
        self._closing = False
        self._peer_hosts: dict[int, str] = {}
        self._peer_pids: dict[int, int] = {}
        self._peer_spaces: dict[int, str] = {}  # (each peer's pid space: ``_process.pid_space``)
        self.peer_extras: dict[int, Any] = {}  # (each peer's ``extra``)
        self._xfer_ids = itertools.count(1)
        self._pid = os.getpid()
        self._acks: queue.SimpleQueue[tuple[_Peer, Kind, int, bytes] | None] | None = None
        self._ack_thread: threading.Thread | None = None
        self._copying = 0  # cross-memory copies whose ack is not queued yet
        self._copying_cv = threading.Condition()
        # (stalls are found by the operations waiting on a peer, which name themselves)
        self._heartbeats = Heartbeats(
            f"tdist-hb-{name}-{rank}", self.heartbeat_interval, self.stall_timeout,
            lambda: self._peers.values(),
            lambda p: cast(_Peer, p).error is not None,
        )
        # the connections are made by ``connected()``, in the owner's thread, from what
        # ``_build_mesh`` left in ``_to_mesh`` (the listeners and the peers' addresses); then the
        # reader thread starts on them (``_read_loop``). ``_meshed`` is clear while they are made.
        # (``connect_later``: nothing is accepted or connected before the owner calls
        # ``connected()``: a connection needs both ends there, so no rank's set-up ends before
        # every other rank has done what precedes its ``connected()``, e.g. opened this rank's
        # arena descriptors, which a rank that destroys its group at once would otherwise close
        # under it; accepting at once let a higher rank finish before a lower one joined. Made in
        # the owner's thread, not a thread of their own: two thread hand-offs fewer while a
        # group forms, each a wake-up on this machine's critical path)
        self._to_mesh: tuple[Listeners, dict[int, PeerAddress], float, float] | None = None
        self._meshed = threading.Event()
        self._meshed.set()
        self._lanes_in: tuple[_Peer, ...] = ()  # peers whose lane to us is open
        # the reader thread waits on ``_ep`` (every connection, one-shot) for a readable one; a
        # thread waiting for a message from one peer reads that connection itself (``_read_own``,
        # holding its ``rlock``) and disarms it in ``_ep`` meanwhile, so the reader is not woken
        self._ep = self._table.ep
        self._by_fd = self._table.by_fd
        self._reader: threading.Thread | None = None
        self._budget = spin.Budget()  # (a waiter's spin on the lanes)
        self._gone = gone
        self._formation_store: Any = None  # (the group's store, while the connections are made)
        if size > 1:
            self._build_mesh(store, timeout, extra)
        if not connect_later:
            self.connected()

    def connected(self) -> None:
        """Make the connections to every peer (``connect_later``; in this thread, within the
        endpoint's timeout), then start the reader thread on them. Nothing once they are made,
        or after ``close()``.

        Raises:
            DistNetworkError, AuthenticationError, DistTimeoutError: the mesh could not be built.
        """
        with self._lock:
            to_mesh, self._to_mesh = self._to_mesh, None
            if to_mesh is None:
                return
            self._meshed.clear()  # (a ``close()`` meanwhile waits for it)
        try:
            self._connect_mesh(*to_mesh)
            # (not waiting for it to run: it does once this thread waits, see ``QuickThread``)
            self._reader = QuickThread(self._read_loop, f"tdist-rd-{self.name}-{self.rank}")
            self._reader.start()
        finally:
            self._formation_store = None  # (the store is the owner's; the endpoint keeps none)
            self._meshed.set()

    def add_tick(self, tick: Callable[[], None]) -> None:
        """Have ``tick()`` called on each heartbeat round (by the reader thread, every
        ``min(heartbeat_interval, stall_timeout / 2) / 2`` seconds once the connections are
        made); it must not raise."""
        self._heartbeats.add_tick(tick)

    def enable_lanes(self) -> None:
        """Let small messages to peers of this host go through shared-memory lanes (``_lane``)
        from now on. For a caller that knows the machine keeps x86's store order and that
        these processes may open each other's descriptors through ``/proc`` (the backend's
        shared-memory arena proves both)."""
        for q, p in self._peers.items():
            if self.same_host(q) and self._peer_pids.get(q, 0) > 0:
                p.lane_ok = True

    # -- building the mesh ---------------------------------------------------------------------
    def _build_mesh(self, store: Any, timeout: float, extra: Any) -> None:
        deadline = time.monotonic() + timeout
        listeners = Listeners(advertised_address(store), self._label, f"tdist-ep-{self.rank}", max(16, self.size))
        if self.rank == 0:
            self._token = secrets.token_bytes(TOKEN_SIZE)
            store.set("ep/token", self._token)
        info: dict[str, Any] = dict(listeners.address)
        info["ps"] = pid_space()  # (where its pid means its process: ``_formation_trouble``)
        if extra is not None:
            info["x"] = extra
        store.set(f"ep/{self.rank}", json.dumps(info))
        self._formation_store = store
        try:  # (every rank's address first, in one request: the group's other set-up may go on while we connect)
            peers = [peer for peer in range(self.size) if peer != self.rank]
            keys = [f"ep/{peer}" for peer in peers] + ([] if self.rank == 0 else ["ep/token"])
            got = self._wait_for_addresses(store, keys, peers, deadline, timeout)
            if self.rank != 0:
                self._token = got.pop()
            self._table.token = self._token
            infos = {peer: json.loads(raw) for peer, raw in zip(peers, got, strict=True)}
        except BaseException:
            listeners.close()
            raise
        for peer, pinfo in infos.items():
            self._peer_hosts[peer] = pinfo["host"]
            self._peer_pids[peer] = int(pinfo["pid"])
            self._peer_spaces[peer] = str(pinfo.get("ps", ""))
            self.peer_extras[peer] = pinfo.get("x")
        self._to_mesh = (listeners, infos, deadline, timeout)  # (made by ``connected()``)

    def _wait_for_addresses(self, store: Any, keys: list[str], peers: list[int], deadline: float, timeout: float) -> list[bytes]:
        """The values of ``keys`` (the peers' addresses), waited for a second at a time (one
        request each, on tdist's stores): a peer that is known gone, or a rank that failed to
        form the group (``publish_failure``), fails the wait at once, naming it (else the
        store's wait runs out the group's timeout, naming a key); a wait of 30 s names the
        ranks it waits for, then every minute. On torch's store (whose client logs each wait
        that times out) one wait, unless the owner knows members gone (``gone``)."""
        chunks = waits_in_chunks(store)
        if not chunks and self._gone is None:
            return list(store.multi_get(keys))
        start = deadline - timeout
        words = patience.Words()
        while True:
            left = deadline - time.monotonic()
            step = timedelta(seconds=max(0.001, min(1.0, left)))
            try:
                if chunks:
                    return list(multi_get_within(store, keys, step))
                store.wait(keys, step)
                return list(store.multi_get(keys))
            except StoreTimeoutError:
                if left <= 1.0:
                    raise
            trouble = self._formation_trouble(store, peers, "never published its address", addresses=True)
            if trouble is not None:
                raise fresh(trouble)  # (not the local: see ``fresh``)
            if words.due(time.monotonic() - start):  # (only then: a look at every peer's address)
                self._say_who_is_late(start, timeout, [peer for peer in peers if not store.check([f"ep/{peer}"])])

    def _group(self) -> str:
        return f"process group {self.name!r}" if self.name else "a process group"

    def _say_who_is_late(self, start: float, timeout: float, late: list[int]) -> None:
        """Forming the group (since ``start``) has waited long: say for whom."""
        log.warning(
            "rank %d: forming %s has waited %.0f s for rank(s) %s, which have not come to it yet "
            "(it times out after %s)", self.rank, self._group(), time.monotonic() - start, late,
            timedelta(seconds=round(timeout)),
        )

    def _formation_trouble(self, store: Any, peers: list[int], doing: str, addresses: bool = False) -> PeerError | None:
        """Why forming the group cannot end well, where that is known: a rank said it failed
        to form it (``publish_failure``), or a rank of ``peers`` is gone (the owner's ``gone``,
        or its process, where its pid means one here: ``_process.gone_here``). Costs one store
        request, and more only where it finds one (``addresses``: whether the gone rank had
        published its address)."""
        try:
            raw = store.multi_get([_FAILED]) if store.check([_FAILED]) else None
        except DistError:
            raw = None
        if raw:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                failed = json.loads(raw[0])
                peer = int(failed["rank"])
                if peer != self.rank:
                    return PeerError(f"rank {self.rank}: forming {self._group()}: rank {peer} {failed['why']}", peer=peer)
        for peer in peers:
            why = self._gone(peer) if self._gone is not None else None
            if why is None and peer in self._peer_pids:
                why = gone_here(self._peer_pids[peer], self._peer_spaces.get(peer, ""))
            if why is None:
                continue
            if addresses:
                with contextlib.suppress(DistError):
                    if store.check([f"ep/{peer}"]):
                        doing = "published its address"
            # (said in the store too: a rank that cannot see it for itself learns it)
            _publish(store, peer, f"{doing}, and it is gone: {why} (as rank {self.rank} found)")
            return PeerError(f"rank {self.rank}: forming {self._group()}: rank {peer} {doing}, and it is gone: {why}", peer=peer)
        return None

    @staticmethod
    def publish_failure(store: Any, rank: int, error: BaseException) -> None:
        """Tell the other ranks forming a group on ``store`` that this rank failed to, and why
        (the first failure said is the one they name): they fail at once, where they would
        wait for it until the group's timeout. Never raises."""
        _publish(store, rank, f"failed to form it: {type(error).__name__}: {error}")

    def _connect_mesh(self, listeners: Listeners, infos: dict[int, PeerAddress], deadline: float, timeout: float) -> None:
        """Dial every lower rank and let every higher one in, all side by side in this thread
        (``_dial.Dialer``s and a ``Doorway``: no thread per connection, and a silent or slow
        stranger on the port delays nobody)."""
        doorway = None
        try:
            if self.rank < self.size - 1:
                doorway = Doorway(
                    listeners, my_id=self.rank, secret=self.secret, label=f"{self._label} ({self.name})",
                    rule=lambda rank, token: token == self._token and self.rank < rank < self.size and rank not in self._peers,
                    timeout=max(0.1, min(10.0, deadline - time.monotonic())),
                    limit=max(64, self.size),  # (every higher rank at once, and room for strangers)
                )
            missing = self._table.mesh(
                {peer: infos[peer] for peer in range(self.rank)}, doorway,
                (peer for peer in range(self.size) if peer != self.rank), deadline,
                self._mesh_watch(self._formation_store, deadline, timeout),
            )
            if missing:
                raise DistTimeoutError(
                    f"rank {self.rank}: timed out after {timeout:g} s building connections; no "
                    f"connection with rank(s) {missing}: are they running and in this group?"
                )
        except BaseException:
            self._closing = True  # (so ``close()`` has nothing left to do: it is done here)
            for p in self._table.close():
                with contextlib.suppress(OSError):
                    p.sock.close()
            self._ep.close()  # (no reader starts after a failed mesh)
            raise
        finally:
            if doorway is not None:
                doorway.close()
            listeners.close()

    def _mesh_watch(self, store: Any, deadline: float, timeout: float) -> Callable[[], BaseException | None]:
        """What ``Table.mesh`` asks between its polls while the connections are made (at most
        a second apart): the group destroyed meanwhile, and, once a second, whether a rank not
        connected yet is known gone or failed (``_formation_trouble``); a wait of 30 s (since
        forming began) names the ranks it waits for, then every minute."""
        start = deadline - timeout
        next_look = time.monotonic() + 1.0
        words = patience.Words()

        def watch() -> BaseException | None:
            nonlocal next_look
            destroyed = self._destroyed()
            if destroyed is not None or store is None:
                return destroyed
            now = time.monotonic()
            if now < next_look:
                return None
            next_look = now + 1.0
            late = sorted(set(range(self.size)) - {self.rank} - self._peers.keys())
            if not late:
                return None
            trouble = self._formation_trouble(store, late, "has not connected")
            if trouble is None and words.due(now - start):
                self._say_who_is_late(start, timeout, late)
            return trouble

        return watch

    def _destroyed(self) -> DistError | None:
        if self._closing:
            return DistError(f"rank {self.rank}: the process group {self.name!r} was destroyed")
        return None

    # -- public API ----------------------------------------------------------------------------
    def same_host(self, peer: int) -> bool:
        return self._peer_hosts.get(peer) == self.host_id

    def peer_host(self, peer: int) -> str:
        """The host id of ``peer`` (equal ids: same host and network namespace)."""
        return self._peer_hosts.get(peer, "")

    def peer_pid(self, peer: int) -> int:
        """``peer``'s pid where it means a process of this pid space (else -1: a container of
        this host with pids of its own, say)."""
        if self._peer_spaces.get(peer, pid_space()) != pid_space():
            return -1
        return self._peer_pids.get(peer, -1)

    def untaken_tags(self, peer: int, below: int) -> list[int]:
        """The tags (below ``below``) of the messages from ``peer`` that no receive took yet
        (``-1``: from any peer), for a receive's error: a tag that differs is the usual cause."""
        peers = list(self._peers.values()) if peer < 0 else [p for p in [self._peers.get(peer)] if p is not None]
        return sorted({t for p in peers for t, q in list(p.unexpected.items()) if t < below and q})

    def stale(self, mask: int, below: int) -> tuple[int, bytes] | None:
        """A message no receive took whose tag has ``mask`` set and a sequence number (the tag's
        bits from 24 up, under ``mask``) below ``below``: its sender and meta; None where
        there is none. (A collective's messages are all taken by the time it ends on a rank
        that made the same call: one left over is the sign of another call.)"""
        for q, p in list(self._peers.items()):
            if not p.unexpected:
                continue
            with self._lock:
                for tag, pending in p.unexpected.items():
                    if pending and tag & mask and (tag & (mask - 1)) >> 24 < below:
                        return q, pending[0].meta
        return None

    def lost_peers(self) -> dict[int, str]:
        """The peers whose connection is gone (their process died, or left), or that have sent
        nothing for ``stall_timeout`` (stalled: failed now, as a wait on them fails them; for
        waits that go through no connection, as the store's), with why."""
        now = time.monotonic()
        for p in list(self._peers.values()):
            if p.error is None:
                self._stalled(p, "a wait for it", now)
        return {q: str(p.error) for q, p in list(self._peers.items()) if p.error is not None}

    @property
    def broken(self) -> DistError | None:
        return self._broken

    def send(
        self,
        peer: int,
        tag: int,
        buffers: Sequence[bytes | bytearray | memoryview],
        meta: bytes = b"",
        deadline: float | None = None,
        what: str = "send",
    ) -> None:
        """Send one message (the concatenation of ``buffers``) to ``peer`` with ``tag``.

        Returns once the bytes are with the kernel. Raises PeerError if the peer is dead or
        stalls, DistTimeoutError at the deadline.
        """
        p = self._peer(peer, what)
        views = [memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in buffers]
        nbytes = sum(v.nbytes for v in views)
        if p.lane_ok and RECORD.size + len(meta) + nbytes <= MAX_RECORD:
            with p.send_lock:
                if self._lane_put(p, tag, meta, views, nbytes, deadline, what):
                    return
                self._send_frame(p, Kind.DATA, tag, meta, views, nbytes, deadline, what)  # (the lane is full)
            return
        if p.cma_ok and nbytes >= CMA_MIN and self._send_cma(p, tag, views, nbytes, meta, deadline, what):
            return
        with p.send_lock:
            self._send_frame(p, Kind.DATA, tag, meta, views, nbytes, deadline, what)

    def _send_frame(
        self,
        p: _Peer,
        kind: Kind,
        tag: int,
        meta: bytes,
        views: list[memoryview],
        nbytes: int,
        deadline: float | None,
        what: str,
    ) -> None:
        """One ``DATA`` or ``DATA_CMA`` frame by socket (send lock held); its numbered form
        when the peer has our lane."""
        if p.lane_out is None:
            self._sendmsg(p, *p.frame(kind, tag, meta, views, nbytes), deadline, what)
            return
        seq = p.tx_seq
        p.tx_seq += 1
        try:
            self._sendmsg(p, *p.frame(_NUMBERED[kind], tag, _SEQ.pack(seq) + meta, views, nbytes), deadline, what)
        except DistTimeoutError:  # (nothing went out: its number is free again)
            p.tx_seq = seq
            raise

    def _lane_put(
        self, p: _Peer, tag: int, meta: bytes, views: list[memoryview], nbytes: int, deadline: float | None, what: str
    ) -> bool:
        """Put one message in our lane to ``p`` (send lock held); False if it is full."""
        lane = p.lane_out
        if lane is None:
            try:
                lane = Lane.create()
            except OSError as exc:
                log.info("rank %d: no shared-memory lane to rank %d (%s); sending by socket", self.rank, p.rank, exc)
                p.lane_ok = False
                return False
            p.lane_out = lane  # (before the frame: the answer may come at once)
            p.tx_seq = 0  # (numbers start with the frame, as the peer's count does)
            try:  # (the peer opens it when this frame comes; messages are numbered from here on)
                self._sendmsg(p, *p.frame(Kind.LANE, lane.fd), deadline, what)
            except BaseException:
                p.lane_out = None
                lane.close()
                raise
            return False  # (until the peer has mapped it, by socket: a lane may outlive us only then)
        if not p.lane_ready or not lane.put(p.tx_seq, tag, meta, views, nbytes):
            return False
        p.tx_seq += 1
        if lane.sleepers():  # a waiter of the peer sleeps: any frame wakes its reader, which reads the lane
            self._sendmsg(p, *p.frame(Kind.HEARTBEAT, 0), None, what)
        return True

    def _send_cma(
        self,
        p: _Peer,
        tag: int,
        views: list[memoryview],
        nbytes: int,
        meta: bytes,
        deadline: float | None,
        what: str,
    ) -> bool:
        """Let ``p`` copy the message out of our memory; False if it may not (send inline)."""
        segments = []
        for v in views:
            if not v.nbytes:
                continue
            addr = address(v)
            if addr is None:
                return False
            segments.append((addr, v.nbytes))
        xfer = next(self._xfer_ids)
        desc = pack_cma(xfer, self._pid, segments)
        with self._lock:
            copy = p.copies[xfer] = Copy()
        try:
            with p.send_lock:
                self._send_frame(p, Kind.DATA_CMA, tag, meta, [memoryview(desc)], len(desc), deadline, what)
            # the peer reads our buffers now: they must stay untouched until it says so (its
            # ack read here when nobody else reads the connection: no hand-off from the reader)
            done = copy.done
            self._read_own(p, done.is_set, deadline, what, lambda: self._send_timed_out(p, what))
            step = max(0.05, self.heartbeat_interval / 2)
            while not done.wait(step):
                if p.error is not None:
                    raise fresh(p.error)
                now = time.monotonic()
                stalled = self._stalled(p, what, now)
                if stalled is not None:
                    raise fresh(stalled)
                if deadline is not None and now >= deadline:
                    raise self._send_timed_out(p, what)
        finally:
            with self._lock:
                p.copies.pop(xfer, None)
        if copy.err < 0:  # (the connection was lost first)
            raise fresh(p.error or self._lost(p, None, what))
        if copy.err:
            log.info(
                "rank %d: rank %d cannot read this process's memory (%s); sending inline from now on",
                self.rank, p.rank, os.strerror(copy.err),
            )
            p.cma_ok = False
            return False
        return True

    def post_recv(
        self,
        peer: int,
        tag: int,
        buffer: memoryview | None = None,
        expect_meta: bytes | None = None,
        what: str = "recv",
        at_most: bool = False,
    ) -> RecvHandle:
        """Post a receive from ``peer`` (-1: any source) for ``tag``.

        ``buffer`` (writable, contiguous) receives the payload, which must be exactly its size
        (with ``at_most``: at most its size, filling its start, as gloo's receive); with
        ``None`` the payload is kept as ``handle.data`` (``nbytes``: the payload's size).
        """
        handle = RecvHandle(peer, tag, buffer, expect_meta, what, at_most)
        with self._lock:
            if self._broken is not None:
                handle._finish(peer, self._broken)
                return handle
            if peer >= 0:
                p = self._peers.get(peer)
                if p is None:
                    raise ValueError(f"rank {self.rank}: no peer rank {peer} in a group of {self.size}")
                if p.lane_in is not None:
                    self._drain(p)
                if self._take_unexpected(p, handle):
                    return handle
                if p.error is not None:
                    handle._finish(peer, p.error)
                    return handle
                p.posted.setdefault(tag, deque()).append(handle)
                self._posted_cv.notify_all()
            else:
                for p in self._lanes_in:
                    self._drain(p)
                for p in self._peers.values():
                    if self._take_unexpected(p, handle):
                        return handle
                self._any_posted.setdefault(tag, deque()).append(handle)
                self._posted_cv.notify_all()
        return handle

    def wait(self, handle: RecvHandle, deadline: float | None, what: str | None = None) -> RecvHandle:
        """Block until ``handle`` completes; raise its error, a stall or the deadline."""
        if not handle.finished:
            lanes = self._lanes_for(handle) if self._lanes_in else ()
            if lanes:
                self._spin(handle, lanes)
                if not handle.finished:
                    self._sleep_on(handle, lanes, deadline, what)
            elif handle.peer >= 0:
                p = self._peers.get(handle.peer)
                if p is not None and p.error is None and p.lane_in is None:
                    self._read_own(
                        p, lambda: handle.finished, deadline, what or handle.what, lambda: self._timed_out(handle, what)
                    )
        return self._wait(handle, deadline, what)

    def _sleep_on(self, handle: RecvHandle, lanes: tuple[_Peer, ...], deadline: float | None, what: str | None) -> None:
        """Wait for ``handle`` counted among the sleepers of ``lanes``: their producers wake
        this process's readers, which read the lanes (``_lane_put``)."""
        for p in lanes:
            with self._lock:
                cast(Lane, p.lane_in).sleep(1)
        try:
            self._poll_lanes(lanes)  # (what came before the count was seen)
            self._wait(handle, deadline, what)
        finally:
            for p in lanes:
                with self._lock:
                    cast(Lane, p.lane_in).sleep(-1)

    def _wait(self, handle: RecvHandle, deadline: float | None, what: str | None) -> RecvHandle:
        step = max(0.05, self.heartbeat_interval / 2)
        while not handle.wait_finished(step if deadline is None else max(0.0, min(step, deadline - time.monotonic()))):
            if self._lanes_in:  # (a lane that opened while this waiter slept has no count of it)
                self._poll_lanes(self._lanes_for(handle))
                if handle.finished:
                    break
            now = time.monotonic()
            if handle.peer >= 0:
                p = self._peers.get(handle.peer)
                if p is not None and not handle.finished:
                    self._stalled(p, what or handle.what, now)
            if deadline is not None and now >= deadline and not handle.finished:
                raise self._timed_out(handle, what)
        failure = handle.error
        if failure is not None:
            if isinstance(failure, PeerError):
                # say which operation the failure hit; the cause stays attached
                raise PeerError(f"{what or handle.what} failed: {failure}", peer=failure.peer) from failure
            raise fresh(failure)
        return handle

    def _send_timed_out(self, p: _Peer, what: str) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(f"rank {self.rank}: {what} to rank {p.rank} timed out")

    def _timed_out(self, handle: RecvHandle, what: str | None) -> CollectiveTimeoutError:
        src = "any rank" if handle.peer < 0 else f"rank {handle.peer}"
        return CollectiveTimeoutError(f"rank {self.rank}: {what or handle.what} timed out waiting for {src} (tag {handle.tag})")

    def abort(self, reason: str) -> None:
        """Give the group up: tell every peer why, fail everything pending here."""
        err = PeerError(f"rank {self.rank} aborted the group: {reason}", peer=self.rank)
        self._break(err)
        meta = reason.encode()[:60000]
        for p in list(self._peers.values()):
            if p.error is None and p.send_lock.acquire(timeout=1.0):
                try:
                    self._sendmsg(p, *p.frame(Kind.ABORT, 0, meta), time.monotonic() + 1.0, "abort")
                except (DistError, OSError):
                    pass
                finally:
                    p.send_lock.release()

    def close(self) -> None:
        """Say goodbye to every peer and close the connections."""
        if self._closing:
            return
        with self._lock:
            self._closing = True  # (a mesh being made meanwhile sees it: ``_destroyed``)
            to_mesh, self._to_mesh = self._to_mesh, None
        if to_mesh is not None:  # (closed before connected(): nothing was connected)
            to_mesh[0].close()
        self._meshed.wait(2.0)
        self._heartbeats.stop()
        # A receive may be complete here while its sender still waits for our ack (the ack leaves
        # from the ack thread a moment later): send every ack before the goodbye, or the sender
        # sees us leave in the middle of its send.
        with self._copying_cv:
            self._copying_cv.wait_for(lambda: self._copying == 0, timeout=2.0)
        if self._acks is not None:
            self._acks.put(None)
            if self._ack_thread is not None and self._ack_thread is not threading.current_thread():
                self._ack_thread.join(2.0)
        for p in list(self._peers.values()):
            if p.error is None and p.send_lock.acquire(timeout=1.0):
                try:
                    self._sendmsg(p, *p.frame(Kind.GOODBYE, 0), time.monotonic() + 1.0, "close")
                except (DistError, OSError):
                    pass
                finally:
                    p.send_lock.release()
        for p in list(self._peers.values()):
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_RDWR)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        self._ep.close()
        for p in list(self._peers.values()):
            with contextlib.suppress(OSError):
                p.sock.close()
            if p.lane_out is not None:  # (the peer's mapping stays valid: the memory goes with it)
                p.lane_out.close()
        self._heartbeats.join(2.0)
        self._break(DistError(f"rank {self.rank}: the process group {self.name!r} was destroyed"))
        self._table.close()

    # -- internals -----------------------------------------------------------------------------
    def _peer(self, peer: int, what: str) -> _Peer:
        if self._broken is not None:
            raise fresh(self._broken)
        p = self._peers.get(peer)
        if p is None:
            raise ValueError(f"rank {self.rank}: no peer rank {peer} in a group of {self.size}")
        if p.error is not None:
            raise fresh(p.error)
        return p

    def _sendmsg(
        self,
        p: _Peer,
        parts: list[memoryview],
        tagging: auth.Tagging | None,
        deadline: float | None,
        what: str,
        quiet: bool = False,
    ) -> None:
        """Write the frame ``parts`` (``p.frame``'s) whole, send lock held (``Link.put``): a
        stalled or lost peer ends it, the deadline only before its first byte."""
        try:
            p.put(
                parts, tagging, deadline, lambda now: p.error or self._broken or self._stalled(p, what, now),
                lambda: self._send_timed_out(p, what), max(0.05, self.heartbeat_interval / 2),
            )
        except DistError:
            raise
        except OSError as exc:
            if quiet:  # (the reader finds the loss once it has read what came before it)
                raise DistNetworkError(f"rank {self.rank}: {what}: {exc}") from exc
            # The peer closed its end. What it sent before (a GOODBYE: an orderly leave, which
            # breaks nothing) may still wait unread: whoever reads the connection reads it, then
            # the end, and judges the loss; wait a moment for that rather than call a peer that
            # left a failure that breaks the group (a rank's write raced its own reading of the
            # GOODBYE under load, and broke an RPC agent's group when one worker left)
            end = time.monotonic() + 1.0
            while p.error is None and not p.read_over and not self._closing and time.monotonic() < end:
                time.sleep(0.001)
            raise fresh(self._lost(p, exc, what)) from exc

    def _stalled(self, p: _Peer, what: str, now: float) -> DistError | None:
        """If nothing has come from ``p`` for ``stall_timeout``: fail it (every waiter on it
        hears) and return the error; else None."""
        silent = now - p.last_rx
        if silent <= self.stall_timeout:
            return None
        local = self.same_host(p.rank)
        if local and still_running(p.local_pid() or self.peer_pid(p.rank)):
            return None  # busy in one call that holds its interpreter lock (``_liveness``)
        err = PeerError(
            f"rank {self.rank}: {p.describe()} has sent nothing for {silent:.1f} s (no heartbeat) "
            f"during {what}: it is stalled ({STALL_CAUSES[local]}); "
            f"TDIST_HEARTBEAT_TIMEOUT={self.stall_timeout:g} s",
            peer=p.rank,
        )
        self._fail_peer(p, err)
        return p.error or err

    def _lost(self, p: _Peer, exc: BaseException | None, what: str) -> DistError:
        if p.error is not None:
            return p.error
        if self._closing:
            err: DistError = DistError(f"rank {self.rank}: process group {self.name!r} is closed")
        elif p.said_goodbye:
            # an orderly leave: only what needs this peer fails; the group is not broken
            err = PeerError(
                f"rank {self.rank}: {p.describe()} left the process group (destroy_process_group "
                f"or exit) while {what} needed it",
                peer=p.rank,
            )
            self._fail_peer(p, err, break_group=False)
            return err
        else:
            detail = f": {exc}" if exc is not None else ""
            pid = self._peer_pids.get(p.rank)
            err = PeerError(
                f"rank {self.rank}: connection to {p.describe()}{f', pid {pid}' if pid else ''} was "
                f"lost{detail}; the process died or closed its socket",
                peer=p.rank,
            )
        if exc is not None:  # (kept with the error, without the frames: see ``fresh``)
            err.__cause__ = fresh(exc)
        self._fail_peer(p, err)
        return err

    def _fail_peer(self, p: _Peer, err: DistError, break_group: bool = True) -> None:
        with self._lock:
            if p.error is not None:
                return
            p.error = err
            p.release_copies()  # (a sender waiting for the peer's copy raises ``err``)
            failed = [h for q in p.posted.values() for h in q]
            p.posted.clear()
            # the receive of the message that was arriving when the connection went
            arriving, p.arriving = p.arriving, None
            if isinstance(arriving, _Pending):
                arriving = arriving.handle
            if arriving is not None:
                failed.append(arriving)
            if break_group:
                # a group that lost a member cannot finish collectives: any-source receives go too
                failed += [h for q in self._any_posted.values() for h in q]
                self._any_posted.clear()
                if self._broken is None and not self._closing:
                    self._broken = err
        for h in failed:
            h._finish(p.rank, err)

    def _break(self, err: DistError) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = err
            peers = list(self._peers.values())  # (the mesh may add to it meanwhile, under the table's lock)
            failed = [h for p in peers for q in p.posted.values() for h in q]
            failed += [h for q in self._any_posted.values() for h in q]
            for p in peers:
                p.posted.clear()
            self._any_posted.clear()
        for h in failed:
            h._finish(h.peer, err)

    def _take_unexpected(self, p: _Peer, handle: RecvHandle) -> bool:
        """Under the lock: match ``handle`` with a message from ``p`` that came early."""
        q = p.unexpected.get(handle.tag)
        if not q:
            return False
        pending = q.popleft()
        if not q:
            del p.unexpected[handle.tag]
        if pending.done:
            self._deliver_copy(p.rank, pending, handle)
        elif p.error is not None:  # it was arriving when the connection went
            handle._finish(p.rank, p.error)
        else:
            pending.handle = handle  # the reader completes it when the payload is in
        return True

    def _deliver_copy(self, source: int, pending: _Pending, handle: RecvHandle) -> None:
        handle.meta = pending.meta
        handle.nbytes = pending.nbytes
        err = self._check(source, handle, pending.meta, pending.nbytes)
        data = pending.data
        assert data is not None
        n = pending.nbytes
        if err is None and handle.buffer is not None:
            handle.buffer[:n] = data
        elif err is None:
            handle.data = data
        handle._finish(source, err)

    def _check(self, source: int, handle: RecvHandle, meta: bytes, nbytes: int) -> DistError | None:
        if handle.expect_meta is not None and meta != handle.expect_meta:
            return CollectiveMismatchError(
                f"rank {self.rank}: mismatched calls: rank {source} sent {meta.decode(errors='replace')} "
                f"while this rank expects {handle.expect_meta.decode(errors='replace')}; every rank "
                "must call the same collectives in the same order with the same shapes and dtypes"
            )
        held = -1 if handle.buffer is None else handle.buffer.nbytes
        if held >= 0 and (nbytes > held if handle.at_most else nbytes != held):
            return CollectiveMismatchError(
                f"rank {self.rank}: {handle.what}: rank {source} sent {nbytes} bytes but the "
                f"receiving tensor holds {'only ' if handle.at_most else ''}{held} bytes (tag "
                f"{handle.tag}); sizes or dtypes differ between the ranks"
            )
        return None

    def _read_loop(self) -> None:
        """The endpoint's reader (its own thread): reads and delivers what comes on every
        connection that is readable and that no waiting thread reads (``_read_own``). It reads
        what is there and moves on, inside a frame too (the decoder keeps its place), so one
        peer's slow frame keeps nobody else's messages waiting."""
        ep = self._ep
        by_fd = self._by_fd
        beats = self._heartbeats
        period = beats.period
        next_round = time.monotonic() + period
        while True:
            try:
                events = ep.poll(max(0.0, next_round - time.monotonic()))
            except InterruptedError:
                continue
            except (OSError, ValueError):  # (closed: the endpoint is gone)
                return
            now = time.monotonic()
            if now >= next_round and not self._closing:  # (the heartbeats ride on this thread)
                beats.round(now)
                next_round = now + period
            if not events:
                if self._closing:
                    for q in by_fd.values():
                        if not q.read_over:
                            self._read_failed(q, ConnectionResetError("closing"))
                    return
                continue
            for fd, _ in events:
                p = by_fd.get(fd)
                if p is None or p.read_over or not p.rlock.acquire(blocking=False):
                    continue  # (a waiting thread reads it, and arms it again when done)
                try:
                    p.pump(self._on_frame, self._on_arriving)
                except (OSError, RemoteProtocolError) as exc:
                    self._read_failed(p, exc)
                except Exception as exc:  # a bug must not end the reader of every peer
                    log.exception("rank %d: reading from %s failed", self.rank, p.describe())
                    self._read_failed(p, exc)
                finally:
                    p.rlock.release()
                    self._arm(p)
            if all(q.read_over for q in by_fd.values()):
                return  # (every connection has ended: nothing more will come)

    def _read_failed(self, p: _Peer, exc: BaseException) -> None:
        """Reading ``p``'s connection failed (``exc``): fail what waits on the peer."""
        p.read_over = True
        if p.lane_in is not None:  # what the peer put in its lane before it went is delivered
            with contextlib.suppress(RemoteProtocolError), self._lock:
                self._drain(p)
        if not self._closing:
            arriving = p.arriving
            what = arriving.what if isinstance(arriving, RecvHandle) else "a pending operation"
            err = self._lost(p, None if isinstance(exc, ConnectionResetError) else exc, what)
            log.debug("rank %d: %s", self.rank, err)
        else:
            self._fail_peer(p, DistError(f"rank {self.rank}: process group {self.name!r} is closed"))

    def _arm(self, p: _Peer) -> None:
        """Let ``p``'s reader wait for the connection again (after its read lock is given back:
        what came while it was held wakes the reader now); not once its reading has ended."""
        if not p.read_over:
            self._table.arm(p)

    def _on_own_frame(self, p: _Peer, event: Frame) -> None:
        """``_on_frame`` for a frame that a waiting thread read (``_read_own``)."""
        self._on_frame(p, event, False)

    def _on_frame(self, p: _Peer, event: Frame, reader: bool = True) -> None:
        """Deliver one whole frame (``reader``: read by the reader thread, not a waiter)."""
        kind = event.kind
        if kind == Kind.DATA:
            if event.placed:
                self._on_data_in(p, event.payload)
            else:
                self._on_data(p, event.tag, event.meta, event.payload)
        elif kind == Kind.DATA_SEQ:
            if event.placed:
                self._on_data_in(p, event.payload)
            else:
                seq, meta = _numbered(event.meta)
                self._on_data(p, event.tag, meta, event.payload, seq)
        elif kind == Kind.DATA_CMA:
            self._on_cma(p, event.tag, event.meta, bytes(event.payload), -1, reader)
        elif kind == Kind.DATA_CMA_SEQ:
            seq, meta = _numbered(event.meta)
            self._on_cma(p, event.tag, meta, bytes(event.payload), seq, reader)
        elif kind == Kind.LANE:
            self._on_lane(p, event.tag)
        elif kind == Kind.LANE_OK:
            self._on_lane_ok(p, event.tag, event.meta)
        elif kind == Kind.CMA_ACK:
            with self._lock:
                p.copied(event.tag, event.meta)
        elif kind == Kind.ABORT:
            reason = event.meta.decode(errors="replace")
            err: DistError = PeerError(f"rank {self.rank}: rank {p.rank} aborted the group: {reason}", peer=p.rank)
            self._fail_peer(p, err)
            self._break(err)
        elif kind == Kind.GOODBYE:
            p.said_goodbye = True
        lane = p.lane_in  # (a frame may be a wake-up: see ``_lane_put``)
        if lane is not None and lane.ready():
            with self._lock:
                self._drain(p)

    def _read_own(
        self, p: _Peer, done: Callable[[], bool], deadline: float | None, what: str, timed_out: Callable[[], DistTimeoutError]
    ) -> None:
        """Wait until ``done()`` (a receive from ``p`` finished, or ``p``'s ack came) by reading
        ``p``'s connection in this thread, so that the message comes with no hand-off from the
        reader thread; polls first, for the spin budget (``_core.spin``). Returns at once when
        another thread reads the connection now (then the reader delivers it), and when ``p``
        stalls or is lost (the caller finds out how); raises ``timed_out()`` at the deadline."""
        if p.read_over or not self._table.take(p):  # (disarmed: the reader leaves it to us)
            return
        try:
            ready = p.ready.poll

            def stop() -> bool:  # (after a quiet while: a stall ends the wait, the deadline raises)
                now = time.monotonic()
                if self._stalled(p, what, now) is not None:
                    return True
                if deadline is not None and now >= deadline and not done():
                    raise timed_out()
                return done()

            def inside() -> bool:  # (waiting inside a frame for its rest)
                if self._closing:
                    raise ConnectionResetError("closing")
                return stop()

            spun = False
            while not done() and not p.read_over and p.error is None:
                try:
                    p.pump(self._on_own_frame, self._on_arriving, inside, self.heartbeat_interval)
                except DistTimeoutError:
                    raise
                except (OSError, RemoteProtocolError) as exc:
                    self._read_failed(p, exc)
                    return
                if done():
                    return
                if not spun:
                    spun = True
                    if p.budget.poll(lambda: bool(ready(0))):
                        continue
                step = self.heartbeat_interval / 2
                if deadline is not None:
                    step = max(0.0, min(step, deadline - time.monotonic()))
                if not ready(step * 1000) and stop():
                    return
        finally:
            p.rlock.release()
            self._arm(p)

    def _on_data(self, p: _Peer, tag: int, meta: bytes, payload: memoryview, seq: int = -1) -> None:
        """A small message, whole (``payload``: the decoder's memory, copied out here; ``seq``:
        its number, when the peer has a lane to us)."""
        with self._lock:
            self._turn(p, seq)
            handle, _ = self._match(p, tag)
            if handle is None:
                self._keep(p, tag, meta, payload)
            self._turned(p, seq)
        if handle is not None:
            self._fill(p, handle, meta, payload)

    def _keep(self, p: _Peer, tag: int, meta: bytes, payload: memoryview) -> None:
        """Under the lock: a small message that came before its receive, copied out."""
        pending = _Pending(meta, payload.nbytes)
        data = pending.data = fresh_buffer(payload.nbytes)
        data[:] = payload
        pending.done = True
        p.unexpected.setdefault(tag, deque()).append(pending)

    def _fill(self, p: _Peer, handle: RecvHandle, meta: bytes, payload: memoryview) -> None:
        """A small message into its matched receive (checked against it first)."""
        nbytes = payload.nbytes
        handle.meta = meta
        handle.nbytes = nbytes
        err = self._check(p.rank, handle, meta, nbytes)
        if err is None:
            if handle.buffer is not None:
                handle.buffer[:nbytes] = payload
            else:
                handle.data = bytearray(payload)
        handle._finish(p.rank, err)

    def _on_arriving(self, p: _Peer, event: Arriving) -> None:
        """A large message's head: its payload goes straight into its receive's buffer when
        one is posted (else into a buffer it waits in; ``_on_data_in`` when it is in)."""
        dec = p.decoder
        tag, meta, nbytes = event.tag, event.meta, event.nbytes
        seq = -1
        if event.kind == Kind.DATA_SEQ:
            seq, meta = _numbered(meta)
        elif event.kind != Kind.DATA:  # (a long cross-memory descriptor)
            dec.place(None)
            return
        with self._lock:
            self._turn(p, seq)
            handle, _ = self._match(p, tag)
            pending: _Pending | None = None
            if handle is None:
                pending = _Pending(meta, nbytes)
                p.unexpected.setdefault(tag, deque()).append(pending)
            p.arriving = handle or pending
            self._turned(p, seq)
        if handle is not None:
            handle.meta = meta
            handle.nbytes = nbytes
            err = p.arriving_error = self._check(p.rank, handle, meta, nbytes)
            dec.place(handle.buffer if err is None else None)
            return
        assert pending is not None
        pending.data = fresh_buffer(nbytes)  # (``done`` tells when it is in)
        dec.place(pending.data)

    def _on_data_in(self, p: _Peer, payload: memoryview) -> None:
        """The payload of the large message ``p.arriving`` is in."""
        waiting: RecvHandle | None = None
        with self._lock:
            arriving, p.arriving = p.arriving, None
            if isinstance(arriving, _Pending):
                arriving.done = True
                waiting = arriving.handle
        if isinstance(arriving, RecvHandle):
            err, p.arriving_error = p.arriving_error, None
            if err is None and arriving.buffer is None:
                arriving.data = cast(bytearray, payload.obj)  # (the decoder's own: exactly its size)
            arriving._finish(p.rank, err)
        elif arriving is not None and waiting is not None:
            self._deliver_copy(p.rank, arriving, waiting)

    def _on_cma(self, p: _Peer, tag: int, meta: bytes, desc: bytes, seq: int, reader: bool) -> None:
        with self._copying_cv:
            self._copying += 1
        try:
            self._on_cma_counted(p, tag, meta, desc, seq, _CMA_DEFER if reader else 0.0)
        finally:
            with self._copying_cv:
                self._copying -= 1
                self._copying_cv.notify_all()

    def _on_cma_counted(self, p: _Peer, tag: int, meta: bytes, desc: bytes, seq: int, defer: float) -> None:
        xfer, pid, segments, prefix = unpack_cma(desc)
        if prefix.nbytes:
            raise RemoteProtocolError("a process group's cross-memory message carries no inline prefix")
        nbytes = sum(n for _, n in segments)
        # The sender waits for our ack anyway: give its receive a moment to be posted, so the
        # data goes straight to the destination (one copy instead of two, no buffer). The lane's
        # later messages wait meanwhile (``_turn``: this one is matched first). Not when a
        # waiting thread reads (``defer`` 0): that thread may be the one to post it.
        deadline = time.monotonic() + defer
        with self._posted_cv:
            self._turn(p, seq)
            handle, from_any = self._match(p, tag)
            while handle is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._posted_cv.wait(remaining)
                handle, from_any = self._match(p, tag)
            if handle is not None:
                self._turned(p, seq)
        if handle is not None:
            status = self._cma_into(p, handle, from_any, tag, pid, segments, meta, nbytes)
        else:
            status = self._cma_buffer(p, tag, pid, segments, meta, nbytes, seq)
        ack_meta = pack_ack(status)
        # Never block the reader on a send: if both ranks stream large messages at each other,
        # a reader waiting for its send lock (held by a sender stuck on a full socket, because
        # the other reader waits the same way) deadlocks the pair. A small thread sends acks.
        self._ack_queue().put((p, Kind.CMA_ACK, xfer, ack_meta))

    def _ack_queue(self) -> queue.SimpleQueue[tuple[_Peer, Kind, int, bytes] | None]:
        with self._lock:
            if self._acks is None:
                self._acks = queue.SimpleQueue()
                self._ack_thread = threading.Thread(
                    target=self._ack_loop, args=(self._acks,), name=f"tdist-ack-{self.name}-{self.rank}", daemon=True
                )
                self._ack_thread.start()
            return self._acks

    def _ack_loop(self, acks: queue.SimpleQueue[tuple[_Peer, Kind, int, bytes] | None]) -> None:
        """Send the readers' answers (``CMA_ACK``, ``LANE_OK``)."""
        while True:
            item = acks.get()
            if item is None:
                return
            p, kind, tag, meta = item
            with p.send_lock, contextlib.suppress(DistError):  # (a loss is reported)
                # (a peer that sent us its lane and left at once is no loss: what it sent is read)
                self._sendmsg(
                    p, *p.frame(kind, tag, meta), None, f"answering rank {p.rank} ({kind.name})",
                    quiet=kind == Kind.LANE_OK,
                )

    def _cma_into(
        self,
        p: _Peer,
        handle: RecvHandle,
        from_any: bool,
        tag: int,
        pid: int,
        segments: list[tuple[int, int]],
        meta: bytes,
        nbytes: int,
    ) -> int:
        """Copy a cross-memory message into a matched receive; returns 0 or an errno."""
        handle.meta = meta
        handle.nbytes = nbytes
        err = self._check(p.rank, handle, meta, nbytes)
        if err is not None:
            handle._finish(p.rank, err)
            return 0
        data: memoryview | None = None
        if handle.buffer is not None:
            status = cma_read(pid, segments, handle.buffer[:nbytes])
        else:
            data = fresh_buffer(nbytes)
            status = cma_read(pid, segments, data) if nbytes else 0
        if status:
            # the sender resends inline: this receive waits for that, first in line
            with self._lock:
                queue = self._any_posted if from_any else p.posted
                queue.setdefault(tag, deque()).appendleft(handle)
            return status
        if data is not None:
            handle.data = data
        handle._finish(p.rank, None)
        return 0

    def _cma_buffer(
        self, p: _Peer, tag: int, pid: int, segments: list[tuple[int, int]], meta: bytes, nbytes: int, seq: int
    ) -> int:
        """Keep a cross-memory message whose receive is not posted yet; returns 0 or an errno."""
        try:
            data = fresh_buffer(nbytes)
            status = cma_read(pid, segments, data) if nbytes else 0
        except BaseException:
            with self._lock:
                self._turned(p, seq)
            raise
        if status:
            with self._lock:
                self._turned(p, seq)
            return status
        pending = _Pending(meta, nbytes)
        pending.data = data
        pending.done = True
        with self._lock:
            handle, _ = self._match(p, tag)
            if handle is None:
                p.unexpected.setdefault(tag, deque()).append(pending)
            self._turned(p, seq)
        if handle is not None:
            self._deliver_copy(p.rank, pending, handle)
        return 0

    # -- lanes ----------------------------------------------------------------------------------
    def _on_lane(self, p: _Peer, fd: int) -> None:
        """The peer's lane to us: map it and say so (its messages are numbered from here on,
        and go by lane once our ``LANE_OK`` is in)."""
        pid = self._peer_pids.get(p.rank, 0)
        try:
            lane: Lane | None = Lane.open(pid, fd)
        except DistError as exc:
            log.info("rank %d: cannot use rank %d's shared-memory lane (%s); it sends by socket", self.rank, p.rank, exc)
            lane = None
            answer: tuple[int, bytes] = (1, str(exc).encode()[:4000])
        else:
            answer = (0, b"")
        with self._lock:
            p.rx_seq = 0
            if lane is not None:
                p.lane_in = lane
                self._lanes_in = (*self._lanes_in, p)
        self._ack_queue().put((p, Kind.LANE_OK, *answer))

    def _on_lane_ok(self, p: _Peer, refused: int, why: bytes) -> None:
        """The peer's answer to our ``LANE``."""
        lane = p.lane_out
        if lane is None:
            raise RemoteProtocolError(f"rank {p.rank} answered a lane that was never offered")
        if refused:
            log.info("rank %d: rank %d cannot map our lane (%s); sending by socket", self.rank, p.rank, why.decode(errors="replace"))
            p.lane_ok = False
        else:
            p.lane_ready = True
        lane.close()  # (the peer's mapping holds the memory now)

    def _turn(self, p: _Peer, seq: int) -> None:
        """Under the lock, before the socket message numbered ``seq`` (-1: not numbered) is
        matched: match the lane's messages sent before it."""
        if seq < 0:
            return
        self._drain(p)
        if p.rx_seq != seq:
            raise RemoteProtocolError(
                f"rank {p.rank}'s message number {seq} came while number {p.rx_seq} is missing from its lane"
            )

    def _turned(self, p: _Peer, seq: int) -> None:
        """Under the lock, once the socket message numbered ``seq`` is matched (or kept): the
        lane's next messages may go."""
        if seq >= 0:
            p.rx_seq = seq + 1
            self._drain(p)

    def _drain(self, p: _Peer) -> None:
        """Under the lock: match the messages in ``p``'s lane whose turn it is."""
        lane = p.lane_in
        if lane is None:
            return
        while True:
            rec = lane.peek()
            if rec is None or rec.seq != p.rx_seq:  # (none, or a socket message's turn)
                return
            self._deliver_record(p, rec)
            lane.pop(rec)
            p.rx_seq += 1

    def _deliver_record(self, p: _Peer, rec: Record) -> None:
        """Under the lock: one message out of a lane, to its receive or kept (copied out)."""
        handle, _ = self._match(p, rec.tag)
        if handle is None:
            self._keep(p, rec.tag, rec.meta, rec.payload)
        else:
            self._fill(p, handle, rec.meta, rec.payload)

    def _lanes_for(self, handle: RecvHandle) -> tuple[_Peer, ...]:
        if handle.peer < 0:
            return self._lanes_in
        p = self._peers.get(handle.peer)
        return (p,) if p is not None and p.lane_in is not None else ()

    def _poll_lanes(self, lanes: tuple[_Peer, ...]) -> None:
        for p in lanes:
            lane = p.lane_in
            if lane is not None and lane.ready():
                with self._lock:
                    self._drain(p)

    def progress(self, handle: RecvHandle) -> bool:
        """Whether ``handle`` has finished, after matching what the lanes it may come by hold."""
        if not handle.finished and self._lanes_in:
            self._poll_lanes(self._lanes_for(handle))
        return handle.finished

    def _spin(self, handle: RecvHandle, lanes: tuple[_Peer, ...]) -> None:
        """Poll the lanes ``handle`` may come by for the spin budget (``_core.spin``)."""
        poll = self._poll_lanes

        def done() -> bool:
            poll(lanes)
            return handle.finished

        self._budget.poll(done)

    def _match(self, p: _Peer, tag: int) -> tuple[RecvHandle | None, bool]:
        """Under the lock: the receive a message from ``p`` with ``tag`` goes to."""
        q = p.posted.get(tag)
        if q:
            handle = q.popleft()
            if not q:
                del p.posted[tag]
            return handle, False
        aq = self._any_posted.get(tag)
        if aq:
            handle = aq.popleft()
            if not aq:
                del self._any_posted[tag]
            return handle, True
        return None, False
