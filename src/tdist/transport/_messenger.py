"""Message connections between named processes that come and go: the RPC agent's transport.

Theory of operation. Every process listens (an abstract Unix socket for processes of its host,
TCP for the others) and connects lazily to a peer the first time it sends to it (the
connection table both front ends share, ``_table.Table``: its ``connect``). Connections
are authenticated (``_handshake``) before a frame is read. Frames are ``_protocol``'s: a 24-byte
header, metadata, payload. A payload is a list of buffers written with scatter-gather
``sendmsg``; between processes of one host, a message whose out-of-band buffers are large
travels as ``DATA_CMA``: the frame carries the buffers' addresses and the receiver copies them
with ``process_vm_readv`` straight into fresh memory (one copy, no socket), then acks; the
sender's ``send`` returns only then, so a sender may change its tensors as soon as ``send``
returns and the receiver still gets the values they had when it was called (no torn tensor).

Reading. Poller threads wait on an ``epoll`` set (one-shot registrations) and drains ready
connections. A thread that waits for a reply from one peer may read that peer's connection
itself (``read_until``): it takes the connection's read lock, and the poller skips the
connection while it is held, so the reply reaches the waiting thread with no thread hand-off.
Whoever reads a frame delivers it through ``on_message`` (from the thread that read it).
A poller that just answered a caller (``send(answer=True)``) keeps that connection's read lock
and polls it for up to ``_POLLER_SPIN`` before it sleeps, when nothing else of the process runs
(``quiet``), the requests after an answer on it come that soon (``_core.spin``'s rule, on those
gaps: sporadic traffic costs no CPU), and what it just ran took less than that budget: a request
that computed for longer leaves torch's intra-op threads spinning for a while (OpenMP's wait
policy) and its caller computing too, and a poller polling then left them one core of two (a
parameter server, pytorch/examples', at 0.62-0.69x torch's steps/s; 0.86-1.01x since). A
caller's next request then costs its sender no wake-up of a sleeping thread. A thread that
claims the connection meanwhile asks the poller to let go (``yield_req``). A thread waiting for
its reply polls by the same policy, learnt per call site (``read_until(budget=)``).

Holding. A poller leaves the connection it read disarmed while it delivers what it read and
runs the request it kept (``_held``): what comes meanwhile on that connection (a caller's next
request, a fetch right behind a ``remote()``) waits for this poller, which reads on when it is
done, instead of waking another poller that would fight it for the GIL. A guard thread, ticking
only while holds happen, arms again a connection held longer than ``_HOLD_MAX`` (a request that
blocks, maybe on the very next message) and leaves that connection unheld for ``_HOLD_OFF``.
(Earlier versions also read ahead on a held connection before running the request, and let a
``remote()``'s reply wait for the fetch behind it: measured against this, idle and on a busy
host, they gained nothing, and went.)

Failure. EOF or a reset loses the connection; a heartbeat thread writes a small frame on quiet
connections and calls a peer stalled when nothing has come from it for ``stall_timeout``
seconds. Either way ``on_peer_lost(peer, error, graceful)`` tells the owner once, with a
``PeerError`` naming the peer; a peer that sent ``GOODBYE`` first left on purpose.

Order: frames of one connection are read in order and delivered in order within what one
thread read at once; two threads may deliver two such batches side by side, so a receiver must
not depend on the order of deliveries (RPC requests run concurrently anyway, and the RRef
protocol needs causal order only).

Thread-safety: ``send``, ``read_until``, ``close`` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from .._core import spin
from .._core.errors import (
    DistNetworkError,
    DistTimeoutError,
    PeerError,
    RemoteProtocolError,
)
from . import _handshake
from ._dial import Doorway, Listeners, PeerAddress
from ._link import Copy, Link, host_id
from ._liveness import STALL_CAUSES, Heartbeats, still_running
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
from ._table import ARMED, Table

__all__ = ["Messenger", "Payload", "PeerAddress"]

log = logging.getLogger(__name__)

_DATA = int(Kind.DATA)
# how long a thread waiting for a reply polls its socket before sleeping in the kernel, and how
# long a poller that delivered messages from a peer polls that connection for the next ones
# before it sleeps in epoll (a request that comes meanwhile costs its sender no wake-up): the
# one spin budget of ``_core.spin``
_SPIN = spin.SPIN
_POLLER_SPIN = spin.SPIN
# how long a poller may keep the connection it read disarmed while it delivers and runs what it
# read before the guard arms it again (0: never held); the guard ticks at this period while
# holds happen, so a held connection is armed again within 1.5 periods
_HOLD_MAX = 0.005
# a connection the guard had to arm again is not held for this long (its requests block)
_HOLD_OFF = 0.25
# how long a thread that claims a connection waits for the poller waiting on it to let go: the
# interpreter's switch interval, within which that poller gets the interpreter lock to see it
_YIELD = sys.getswitchinterval()

# a DATA payload (one buffer) or a DATA_CMA payload ([prefix, *buffers])
Payload = memoryview | list[memoryview]


class _Conn(Link):
    """A link to one peer process, with RPC's bookkeeping."""

    __slots__ = (
        "answered_at",
        "budget",
        "gaps",
        "goodbye",
        "hold_off",
        "spinner",
        "yield_req",
    )  # fmt: skip

    def __init__(self, peer: int, sock: socket.socket, addr: str, same_host: bool, session: _handshake.Session | None = None) -> None:
        # (DATA_CMA prefixes and large payloads in fresh memory: received tensors keep them)
        super().__init__(peer, sock, addr, same_host, session, alloc=fresh_buffer)
        self.goodbye = False
        self.spinner = False  # a poller holds rlock, polling for the next message
        self.answered_at = 0.0  # when a poller last answered on it (0: a request came since)
        # how soon its caller's next requests came after an answer: a poller that answered
        # waits for the next one (``_await_next``) only while they come within the budget
        self.gaps = spin.Budget(_POLLER_SPIN)
        self.yield_req = False  # a thread that wants rlock asks that poller to let go
        self.hold_off = 0.0  # not held before this time (the guard had to arm it)
        self.budget = spin.Budget(_SPIN)  # a waiting caller's spin for its reply (read_until)


def _place_fresh(c: Link, _event: Arriving) -> None:
    c.decoder.place(None)  # (fresh memory: a received tensor may keep it)


class _ThreadState(threading.local):
    """What each thread keeps here; the class holds the defaults (a missing attribute of a
    plain ``threading.local`` costs an exception on every look)."""

    batch: list[tuple[int, int, bytes, Payload]] | None = None
    lost: list[tuple[int, PeerError, bool]] | None = None
    answered: bool = False
    delivering: bool = False
    poller: bool = False  # this thread is a poller thread


class Messenger:
    """This process's end of the message connections.

    Args:
        my_id: this process's id (a worker id); peers address it by id.
        label: how messages name this process (e.g. ``"worker0 (id 0)"``).
        token: 16 bytes shared by every member of the job; connections with another token are
            refused.
        secret: the job secret (``None``: open).
        lookup: ``lookup(peer)`` returns the peer's ``PeerAddress`` (raises ``KeyError`` when
            the peer is unknown).
        describe: ``describe(peer)`` names a peer in messages.
        on_message: ``on_message(peer, tag, meta, payload)`` for every DATA frame, called from
            the thread that read it.
        on_peer_lost: ``on_peer_lost(peer, error, graceful)`` once per peer whose last
            connection went away.
        advertise: the IP address other hosts reach us by.
        heartbeat_interval, stall_timeout: seconds.
        on_batch_end: called by a poller after it delivered what it read (it may run a
            request there).
        max_pollers: the most poller threads.
        quiet: ``quiet()`` says whether nothing else of this process runs (no request on
            another thread): only then does a poller that answered a caller poll its connection
            for the next request (``_POLLER_SPIN``) rather than sleep at once, since polling
            holds the GIL most of the time.
    """

    def __init__(
        self,
        my_id: int,
        label: str,
        token: bytes,
        secret: bytes | None,
        lookup: Callable[[int], PeerAddress],
        describe: Callable[[int], str],
        on_message: Callable[[int, int, bytes, Payload], None],
        on_peer_lost: Callable[[int, PeerError, bool], None],
        advertise: str = "127.0.0.1",
        heartbeat_interval: float = 1.0,
        stall_timeout: float = 5.0,
        on_batch_end: Callable[[], None] | None = None,
        max_pollers: int = 17,
        quiet: Callable[[], bool] | None = None,
    ) -> None:
        assert len(token) == TOKEN_SIZE
        self.my_id = my_id
        self.label = label
        self.token = token
        self.secret = secret
        self.lookup = lookup
        self.describe = describe
        self.on_message = on_message
        self.on_peer_lost = on_peer_lost
        self.heartbeat_interval = heartbeat_interval
        self.stall_timeout = stall_timeout
        self.on_batch_end = on_batch_end
        self.quiet = quiet
        self._max_pollers = max(2, max_pollers)
        self._pollers = 2
        self._busy_pollers = 0
        self._inline = 0
        self._tls = _ThreadState()
        self.host = host_id()
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._table: Table[_Conn] = Table(_Conn, my_id=my_id, token=token, secret=secret, label=label, shut="the RPC agent is shut down")
        self._conns = self._table.by_fd
        self._xfer = itertools.count(1)
        self._closing = False
        self._ctrl: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # connections a poller left disarmed while it delivers what it read, and since when
        self._held: dict[_Conn, float] = {}
        self._holds = 0  # holds so far (the guard idles when it stops growing)
        self._guard_on = False
        self._guard_wake = threading.Event()
        # handshakes side by side, each within its deadline, a bounded number at once

        self._listeners = Listeners(advertise, f"{label} (RPC listener)", "tdist-rpc", any_address=False)
        self.address: PeerAddress = self._listeners.address
        # (handshakes advance in the pollers, each within 10 s, a bounded number at once)
        try:
            self._doorway = Doorway(
                self._listeners, my_id=my_id, secret=secret, label=f"{label} (RPC listener)",
                rule=lambda _peer, their_token: their_token == token, quiet=lambda: self._closing,
            )
        except BaseException:
            self._listeners.close()
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ep = self._table.ep  # (the connections', the doorway's and the wake-up pipe's)
        self._ep.register(self._doorway.fileno(), ARMED)
        self._ep.register(self._wake_r, select.EPOLLIN)
        self._heartbeats = Heartbeats(
            f"tdist-rpc-hb-{my_id}", self.heartbeat_interval, self.stall_timeout, lambda: self._conns.values(),
            lambda c: cast(_Conn, c).closed,
            lambda c, silent: self._stalled(cast(_Conn, c), silent),
        )
        self._ctrl_thread = threading.Thread(target=self._ctrl_loop, name=f"tdist-rpc-ctrl-{my_id}", daemon=True)
        self._threads = [
            threading.Thread(target=self._poll_loop, name=f"tdist-rpc-poll-{my_id}-0", daemon=True),
            threading.Thread(target=self._poll_loop, name=f"tdist-rpc-poll-{my_id}-1", daemon=True),
            self._ctrl_thread,
            threading.Thread(target=self._guard, name=f"tdist-rpc-guard-{my_id}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._heartbeats.start()

    # -- connections ---------------------------------------------------------------------------
    def is_connected(self, peer: int) -> bool:
        return peer in self._table.peers

    def connect(self, peer: int, deadline: float | None) -> None:
        """Make sure a connection to ``peer`` exists (connecting now if needed).

        Raises:
            PeerError: the peer was lost before.
            DistNetworkError, AuthenticationError, DistTimeoutError: connecting failed.
        """
        self._conn_for(peer, deadline)

    def _conn_for(self, peer: int, deadline: float | None) -> _Conn:
        c = self._table.peers.get(peer)
        if c is not None:
            return c
        return self._table.connect(
            peer, self.lookup, deadline if deadline is not None else time.monotonic() + 60.0, self.describe(peer), hello_within=10.0
        )

    def _let_in(self) -> None:
        """Advance the handshakes of connections to our listeners (a poller; see ``Doorway``)
        and take in those that joined."""
        try:
            self._table.admit(self._doorway)
        finally:
            if not self._closing:
                with contextlib.suppress(OSError, ValueError):
                    self._ep.modify(self._doorway.fileno(), ARMED)

    # -- sending -------------------------------------------------------------------------------
    def send(self, peer: int, tag: int, meta: bytes, parts: list[memoryview], deadline: float | None, answer: bool = False) -> None:
        """Send one message: ``parts`` is ``serialization.dumps`` output (header, pickle,
        out-of-band buffers).

        Returns when the peer no longer needs ``parts``: the caller may change the tensors
        they view at once, and the peer still gets the values they had at the call. Small
        messages are with the kernel by then; large buffers to a process of this host go by
        cross-memory copy (the peer copies them straight out of our memory), so ``send`` waits
        until the peer says it has copied them. That wait has no deadline once the message is
        out (the peer may be copying): it ends with the peer's answer, or with the connection
        (a peer that stops answering is lost within ``stall_timeout``).

        Raises:
            PeerError: the peer is gone.
            DistNetworkError, DistTimeoutError: connecting or writing failed.
        """
        c = self._conn_for(peer, deadline)
        if answer:  # a poller that answers a caller waits a little for its next request
            self._tls.answered = True
        bufs = parts[2:]
        if c.cma_ok and bufs and sum(b.nbytes for b in bufs) >= CMA_MIN:
            addrs = [address(b) for b in bufs]
            if all(a is not None for a in addrs) and self._send_cma(c, tag, meta, parts, addrs, deadline):
                return
        self._write(c, Kind.DATA, tag, meta, parts, deadline)

    def _send_cma(self, c: _Conn, tag: int, meta: bytes, parts: list[memoryview], addrs: list[Any], deadline: float | None) -> bool:
        """Send ``parts`` as ``DATA_CMA`` and wait until the peer has copied its buffers;
        False when the peer may not read our memory (then nothing was delivered: send it
        plainly, as every later message to it)."""
        bufs = parts[2:]
        xfer = next(self._xfer)
        prefix = parts[0].nbytes + parts[1].nbytes
        desc = pack_cma(xfer, self.pid, [(a, b.nbytes) for a, b in zip(addrs, bufs, strict=True)], prefix)
        copied = c.copies[xfer] = Copy()
        try:
            self._write(c, Kind.DATA_CMA, tag, meta, [memoryview(desc), parts[0], parts[1]], deadline)
            self._await_copy(c, copied)
        finally:
            c.copies.pop(xfer, None)
        if copied.err:
            c.cma_ok = False
            log.info("%s: cross-memory copy to %s refused (%s); using the socket", self.label, self.describe(c.peer), os.strerror(copied.err))
            return False
        return True

    def _await_copy(self, c: _Conn, copied: Copy) -> None:
        """Wait for the peer's ``CMA_ACK`` of ``copied``, reading ``c`` in this thread when
        nobody else does (this thread may be the poller that would read it)."""
        while not copied.done.is_set():
            if c.closed:
                raise self._error_for(c)
            if not self.read_until(c.peer, copied.done.is_set, None):
                copied.done.wait(0.05)  # another thread reads it, and sets ``done``
        if copied.err < 0:  # the connection was lost first
            raise self._error_for(c)

    def _write(self, c: _Conn, kind: Kind, tag: int, meta: bytes, payload: list[memoryview], deadline: float | None) -> None:
        """Write one frame whole (``Link.write``): a lost or stalled peer ends it, the deadline
        only before its first byte."""
        with c.send_lock:
            if c.closed:
                raise self._error_for(c)
            parts = [p for p in payload if p.nbytes]
            frame, tagging = c.frame(kind, tag, meta, parts, sum(p.nbytes for p in parts))
            try:
                c.put(
                    frame, tagging, deadline, lambda now: self._unwritable(c, now),
                    lambda: DistTimeoutError(f"{self.label}: writing to {self.describe(c.peer)} timed out"), 0.1,
                )
            except (PeerError, DistTimeoutError):
                raise
            except OSError as exc:
                self._lose(c, exc)
                raise self._error_for(c) from exc

    def _unwritable(self, c: _Conn, now: float) -> PeerError | None:
        """Why ``c`` cannot take a frame now (lost, or stalled: then it is lost), or None."""
        if not c.closed and now - c.last_rx > self.stall_timeout:
            self._stalled(c, now - c.last_rx)
        return self._error_for(c) if c.closed else None

    def _stalled(self, c: _Conn, silent: float) -> None:
        """Nothing has come on ``c`` for ``silent`` seconds, past the stall timeout: lose it,
        unless its peer is a process of this host that runs all the same (busy in one call that
        holds its interpreter lock: ``_liveness.still_running``)."""
        pid = c.local_pid() if c.same_host else None  # (the kernel's word: no store request)
        if pid is not None and still_running(pid):
            return
        self._lose(c, None, stalled=silent)

    def _error_for(self, c: _Conn) -> PeerError:
        # a fresh exception each time: a stored one would grow its traceback with every raise
        lost = self._table.lost.get(c.peer)
        return PeerError(str(lost) if lost else f"{self.label}: connection to {self.describe(c.peer)} is closed", peer=c.peer)

    def _send_ctrl(self, c: _Conn, kind: Kind, tag: int, meta: bytes = b"") -> None:
        with contextlib.suppress(PeerError, DistNetworkError, DistTimeoutError):
            self._write(c, kind, tag, meta, [], time.monotonic() + self.stall_timeout)

    # -- reading -------------------------------------------------------------------------------
    def claim(self, peer: int) -> Any:
        """Take ``peer``'s connection for reading in this thread, before sending a request
        whose reply this thread will wait for (so no poller wakes for the reply). Returns a
        token for ``read_until``, or None when that is not possible now."""
        c = self._table.only(peer)
        if c is None:
            return None
        if not c.rlock.acquire(blocking=False):
            if not c.spinner:
                return None
            c.yield_req = True  # a poller waits there for the next message: it lets go at once
            got = c.rlock.acquire(timeout=_YIELD)
            c.yield_req = False
            if not got:
                return None
        if not self._table.disarm(c):  # (disarmed: pollers leave it to us)
            c.rlock.release()
            return None
        return c

    def release(self, token: Any) -> None:
        """Give back a ``claim`` that was not passed to ``read_until``."""
        if token is not None:
            self._table.give(token)

    def read_until(self, peer: int, done: Callable[[], bool], deadline: float | None, claimed: Any = None, budget: spin.Budget | None = None) -> bool:
        """Read ``peer``'s connection in this thread until ``done()`` (or the deadline).

        Returns False when another thread is reading that connection (or there is not exactly
        one): then wait some other way. Frames read here are delivered from this thread, after
        the connection is released (a callback that blocks must not keep it from others).
        ``claimed``: a token from ``claim`` (always given back here). ``budget``: how this
        wait polls before it sleeps, and learns (``_core.spin``; the connection's own when
        None).
        """
        # the one spin policy (``_core.spin``), learning per call site or connection: while
        # the replies keep coming after the budget (the callee computes for longer), a caller
        # sleeps at once rather than take a core from that work. It never yields: on a busy
        # host a yield hands the core to the other work while the reply comes (rpc_sync p50
        # 200 us against 49 us without)
        c = claimed
        if budget is None:
            c = c if c is not None else self._table.only(peer)
            budget = c.budget if c is not None else spin.Budget(0.0)
        start = time.monotonic()
        spin_until = start + budget.seconds()
        slept = False
        batch: list[tuple[int, int, bytes, Payload]] = []
        while claimed is not None or not done():
            c = claimed if claimed is not None else self.claim(peer)
            claimed = None
            if c is None:
                return False
            self._tls.batch = batch
            lost: list[tuple[int, PeerError, bool]] = []
            self._tls.lost = lost
            try:
                p: Any = None
                while not batch:
                    if c.closed or not self._drain(c):
                        break
                    if batch or done():  # done: the reply came another way (a second connection)
                        break
                    now = time.monotonic()
                    if now < spin_until:
                        # poll(0) until readable: a failed recv raises, which costs more
                        ready, clock = c.ready.poll, time.monotonic
                        while not ready(0) and clock() < spin_until and not done():
                            pass
                        continue
                    if deadline is not None and now >= deadline:
                        break
                    if p is None:
                        p = select.poll()
                        p.register(c.fd, select.POLLIN)
                    wait = 0.05 if deadline is None else max(0.0, min(0.05, deadline - now))
                    slept = True
                    p.poll(wait * 1000)
            finally:
                self._tls.batch = None
                self._table.give(c)
            # requests read here are not this thread's to run (it waits for a reply, maybe
            # inside a poller's delivery): they go to the pool
            self._deliver_batch(batch, lost, as_poller=False)
            if c.closed or not done():
                if c.closed or (deadline is not None and time.monotonic() >= deadline):
                    return done()
        if slept:
            budget.ended(time.monotonic() - start)
        else:
            budget.caught()
        return True

    def _deliver_batch(self, batch: list[tuple[int, int, bytes, Payload]], lost: list[tuple[int, PeerError, bool]], as_poller: bool) -> None:
        """Deliver what this thread read (``as_poller``: as a poller does, so a request may be
        kept to run here), then report the connections lost meanwhile."""
        delivering = self._tls.delivering
        self._tls.delivering = as_poller
        try:
            for item in batch:
                self.on_message(*item)
        finally:
            self._tls.delivering = delivering
            batch.clear()
            self._report_lost(lost)

    def in_poller(self) -> bool:
        """Whether this thread is one of the poller threads (delivering a batch)."""
        return bool(self._tls.delivering)

    def busy(self) -> bool:
        """Whether a poller thread is running a request (``run_inline``)."""
        return self._inline > 0

    def run_inline(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a request, which may block) in this poller thread."""
        with self._lock:
            self._inline += 1
        try:
            fn()
        finally:
            with self._lock:
                self._inline -= 1

    def _occupied(self) -> None:
        # Several threads wait on one epoll set with one-shot registrations, so each ready
        # connection goes to exactly one of them. A poller that delivers messages (callbacks
        # may block) or runs a request is occupied; when it was the last free one, one more is
        # started (up to max_pollers), so that messages never wait for a callback or request.
        with self._lock:
            self._busy_pollers += 1
            spawn = self._pollers - self._busy_pollers < 1 and self._pollers < self._max_pollers and not self._closing
            if spawn:
                self._pollers += 1
                t = threading.Thread(target=self._poll_loop, name=f"tdist-rpc-poll-{self.my_id}-{self._pollers - 1}", daemon=True)
                self._threads.append(t)
        if spawn:
            t.start()

    def _free(self) -> None:
        with self._lock:
            self._busy_pollers -= 1

    def _report_lost(self, lost: list[tuple[int, PeerError, bool]]) -> None:
        """Tell of peers whose connection ended while this thread read (after their last
        messages were delivered)."""
        for report in lost:
            self.on_peer_lost(*report)
        lost.clear()

    def _poll_loop(self) -> None:
        door = self._doorway.fileno()
        batch: list[tuple[int, int, bytes, Payload]] = []
        lost: list[tuple[int, PeerError, bool]] = []
        spun: _Conn | None = None  # a connection read next (rlock held, disarmed)
        self._tls.poller = True
        while not self._closing:
            if spun is not None:
                events = [(spun.fd, 0)]
            else:
                try:
                    events = self._ep.poll(max(0.0, min(1.0, self._doorway.due() - time.monotonic())), 1)
                except InterruptedError:
                    continue
                except (OSError, ValueError):
                    return
                if not events and time.monotonic() >= self._doorway.due():
                    self._let_in()  # (handshakes past their deadline go; a listener rested enough)
            for fd, _ in events:
                if fd == self._wake_r:
                    if self._closing:
                        return
                    continue
                if fd == door:
                    self._let_in()
                    continue
                if spun is not None:
                    c, spun = spun, None
                else:
                    c = self._conns.get(fd)  # type: ignore[assignment]
                    if c is None or not c.rlock.acquire(blocking=False):
                        continue  # a waiting thread reads it and re-arms it
                if c.answered_at:  # the first read since an answer: how long the caller took
                    c.gaps.ended(time.monotonic() - c.answered_at)
                    c.answered_at = 0.0
                self._tls.batch = batch
                self._tls.lost = lost
                held = False
                try:
                    self._drain(c)
                except Exception:  # a bug must not kill the poller: drop this connection only
                    log.exception("%s: reading from %s failed", self.label, self.describe(c.peer))
                    self._lose(c, None)
                finally:
                    self._tls.batch = None
                    c.rlock.release()
                    if batch and _HOLD_MAX > 0 and not c.closed:
                        held = self._hold(c)
                    if not held:
                        self._table.arm(c)
                # deliver after the read lock is free again (a thread that waits for a reply
                # may read the connection meanwhile); the connection itself stays disarmed
                # while held (see "Holding")
                if not batch:
                    self._report_lost(lost)
                    continue
                self._occupied()
                self._tls.answered = False
                ran_from = time.monotonic()
                try:
                    self._tls.delivering = True
                    for item in batch:
                        self.on_message(*item)
                except Exception:
                    log.exception("%s: delivering a message failed", self.label)
                finally:
                    self._tls.delivering = False
                    batch.clear()
                    self._report_lost(lost)
                try:
                    if self.on_batch_end is not None:
                        self.on_batch_end()
                except Exception:
                    log.exception("%s: running a request failed", self.label)
                finally:
                    self._free()
                # still held (not armed by the guard meanwhile): arming it is ours to do
                held = held and self._held.pop(c, None) is not None
                # (after a request that ran longer than the budget nothing waits, and the gap
                # to the next request is not measured either: the gaps learn from quick ones)
                if _POLLER_SPIN > 0 and self._tls.answered and self._busy_pollers == 0 and (self.quiet is None or self.quiet()) and time.monotonic() - ran_from < _POLLER_SPIN:
                    spun = self._await_next(c, held)
                elif held:
                    spun = self._read_on(c)
        if spun is not None:  # closing: close() waits for every read lock
            spun.rlock.release()

    def _hold(self, c: _Conn) -> bool:
        """Leave ``c`` disarmed while this poller delivers what it read (see "Holding");
        False when ``c`` is not to be held now."""
        now = time.monotonic()
        if now < c.hold_off:
            return False
        self._held[c] = now
        self._holds += 1
        if not self._guard_on:
            self._guard_on = True
            self._guard_wake.set()
        return True

    def _read_on(self, c: _Conn) -> _Conn | None:
        """After delivering what was read from held ``c``: ``c`` with its read lock taken when
        more has come (read it next, still disarmed), else None with ``c`` armed again."""
        if not c.closed and c.rlock.acquire(blocking=False):
            if c.ready.poll(0):
                return c
            c.rlock.release()
        self._table.arm(c)
        return None

    def _guard(self) -> None:
        """Arm again the connections held longer than ``_HOLD_MAX / 2`` (checked every
        ``_HOLD_MAX``, only while holds happen: asleep otherwise)."""
        seen, still = -1, 0
        while not self._closing:
            if not self._guard_on:
                self._guard_wake.wait()
                self._guard_wake.clear()
                continue
            time.sleep(_HOLD_MAX)
            now = time.monotonic()
            for c, since in list(self._held.items()):
                if now - since >= _HOLD_MAX / 2 and self._held.pop(c, None) is not None:
                    c.hold_off = now + _HOLD_OFF  # its requests block: not held for a while
                    self._table.arm(c)
            if self._holds != seen:
                seen, still = self._holds, 0
            else:
                still += 1
                if still * _HOLD_MAX > 0.1 and not self._held:  # no hold for 0.1 s: sleep
                    self._guard_on = False
                    if self._holds != seen or self._held:  # one came meanwhile: go on
                        self._guard_on = True

    def _await_next(self, c: _Conn, held: bool = False) -> _Conn | None:
        """After delivering ``c``'s messages: poll it for up to ``_POLLER_SPIN`` (holding its
        read lock, disarmed in epoll, so no sleeping poller is woken for it). Returns ``c``,
        still held, when something came; None (released, re-armed) when nothing came or a
        thread asks for the connection (``claim``). ``held``: ``c`` was held (disarmed) while
        its messages were delivered."""
        c.answered_at = time.monotonic()
        budget = c.gaps.seconds()
        if not budget:  # its next requests seldom come that soon: waiting would catch nothing
            return self._read_on(c) if held else None
        if c.closed or not c.rlock.acquire(blocking=False):
            if held:
                self._table.arm(c)
            return None
        ready, clock = c.ready.poll, time.monotonic
        if ready(0):  # something came while the batch ran: read it here (a poller that it woke
            return c  # finds the connection taken and leaves it)
        if not self._table.disarm(c):
            c.rlock.release()
            return None
        c.spinner = True
        until = clock() + budget
        try:
            while not c.yield_req:
                if ready(0):
                    return c
                if clock() >= until or self._closing:
                    break
        finally:
            c.spinner = False
        # (re-armed also when handed over: armed while claimed wakes a poller for nothing at
        # worst, disarmed while nobody reads it would lose the connection)
        c.yield_req = False
        c.rlock.release()
        self._table.arm(c)
        return None

    def _drain(self, c: _Conn) -> bool:
        """Read whatever is available on ``c`` and deliver complete frames (rlock held).
        Returns False when the connection is gone."""
        try:
            c.pump(self._frame, _place_fresh)
        except OSError as exc:  # (no errno: the end of the stream, which needs no detail)
            self._lose(c, exc if exc.errno is not None else None)
        except RemoteProtocolError as exc:
            log.warning("%s: %s broke the protocol: %s", self.label, self.describe(c.peer), exc)
            self._lose(c, exc)
        return not c.closed

    def _frame(self, c: _Conn, event: Frame) -> None:
        kind = event.kind
        if kind == _DATA:
            # owned (tensors will view it), and straight to its reader
            payload = event.payload
            self._deliver(c.peer, event.tag, event.meta, payload if event.placed else memoryview(bytearray(payload)))
        elif kind == Kind.HEARTBEAT:
            pass
        elif kind == Kind.DATA_CMA:
            self._on_cma(c, event.tag, event.meta, event.payload)
        elif kind == Kind.CMA_ACK:
            c.copied(event.tag, event.meta)
        elif kind == Kind.GOODBYE:
            c.goodbye = True
        else:
            log.debug("%s: ignored frame kind %d from %s", self.label, kind, self.describe(c.peer))

    def _deliver(self, peer: int, tag: int, meta: bytes, payload: Payload) -> None:
        batch = self._tls.batch
        if batch is not None:
            batch.append((peer, tag, meta, payload))
        else:
            self.on_message(peer, tag, meta, payload)

    def _on_cma(self, c: _Conn, tag: int, meta: bytes, payload: memoryview) -> None:
        xfer, pid, segs, prefix_view = unpack_cma(payload)
        prefix = memoryview(bytearray(prefix_view))
        bufs: list[memoryview] = []
        err = 0
        for addr, n in segs:
            dest = fresh_buffer(n)
            if n:
                err = cma_read(pid, [(addr, n)], dest)
                if err:
                    break
            bufs.append(dest)
        ack = pack_ack(err)
        self._ctrl.put(lambda: self._send_ctrl(c, Kind.CMA_ACK, xfer, ack))
        if not err:
            self._deliver(c.peer, tag, meta, [prefix, *bufs])

    # -- failure -------------------------------------------------------------------------------
    def _lose(self, c: _Conn, exc: BaseException | None, stalled: float | None = None) -> None:
        if c.closed:
            return
        graceful = c.goodbye or self._closing
        what = self.describe(c.peer)
        if stalled is not None:
            err = PeerError(
                f"{self.label}: {what} has sent nothing for {stalled:.1f} s (no heartbeat): it is "
                f"stalled ({STALL_CAUSES[c.same_host]}); TDIST_HEARTBEAT_TIMEOUT={self.stall_timeout:g} s",
                peer=c.peer,
            )
        elif graceful:
            err = PeerError(f"{self.label}: {what} left (shut down its RPC agent)", peer=c.peer)
        else:
            detail = f": {exc}" if exc is not None else ""
            pid = None
            with contextlib.suppress(Exception):
                pid = self.lookup(c.peer).get("pid")
            err = PeerError(
                f"{self.label}: connection to {what}{f' (pid {pid})' if pid else ''} at {c.addr} was "
                f"lost{detail}; the process died or closed its socket",
                peer=c.peer,
            )
        last = self._table.drop(c, err)
        if last is None:  # (another thread lost it first)
            return
        c.release_copies()
        with contextlib.suppress(OSError):
            c.sock.close()
        if last and not self._closing:
            report = (c.peer, err, graceful and stalled is None)
            pending = self._tls.lost
            if self._tls.batch is not None and pending is not None:
                pending.append(report)  # after the messages this thread read are delivered
            else:
                # from a writer or the heartbeat thread: user callbacks run on the ctrl thread,
                # never under a send lock or in place of heartbeats
                self._ctrl.put(lambda: self.on_peer_lost(*report))

    def forget(self, peer: int) -> None:
        """Allow a new connection to ``peer`` (a worker that left may come back)."""
        self._table.forget(peer)

    def _ctrl_loop(self) -> None:
        while True:
            job = self._ctrl.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("%s: control message failed", self.label)

    # -- closing -------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Say goodbye to every peer, close every connection and stop the threads."""
        with self._lock:
            if self._closing:
                return
            conns = list(self._conns.values())
        if self._ctrl_thread is not threading.current_thread():
            # acks of copies already made go out before the goodbye (a sender waits for them)
            flushed = threading.Event()
            self._ctrl.put(flushed.set)
            flushed.wait(min(timeout, 2.0))
        for c in conns:
            self._send_ctrl(c, Kind.GOODBYE, 0)
        with self._lock:
            self._closing = True
            conns = self._table.close()  # (with ``_closing``: no dial starts after it)
        for c in conns:
            c.release_copies()
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        self._heartbeats.stop()
        self._guard_wake.set()
        self._doorway.close()
        self._ctrl.put(None)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")  # never read: wakes every poller
        end = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))
        self._heartbeats.join(max(0.0, end - time.monotonic()))
        for c in conns:
            # only now: a reader still inside recv must not see its descriptor reused
            if c.rlock.acquire(timeout=max(0.0, end - time.monotonic())):
                c.rlock.release()
            with contextlib.suppress(OSError):
                c.sock.close()
        self._listeners.close()
        with contextlib.suppress(OSError):
            self._ep.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

