"""One connection to a peer, as both front ends of the transport hold it: a process group's
``_endpoint._Peer`` and RPC's ``_messenger._Conn`` are ``Link``s with their own bookkeeping on
top.

Theory of operation. A link is an authenticated stream socket (``_handshake``) carrying
``_protocol`` frames, with:

- writing: ``frame`` makes a frame's buffers (sealed when the link has a session: the tag is the
  last buffer, or, for a payload of ``auth.BULK`` bytes or more, made piece by piece as the
  payload goes out, while it is in the cache) and ``write`` puts them on the socket whole,
  under ``send_lock``. The socket is non-blocking; when it takes no more, the caller's
  ``blocked`` waits (for room, within its deadline) or raises. Once part of a frame is out only
  the rest of it may follow, so a deadline stops a write only before its first byte; a frame
  that never left gives its sequence number back;
- reading: whoever reads the link holds ``rlock`` (a reader or poller thread, or a thread that
  waits for a message from this peer and reads it itself); ``ready`` polls the socket's
  readiness for that thread; ``pump`` reads what the socket has and hands its frames to the
  front end's callbacks (one read loop for both front ends); ``decoder`` holds its place
  between reads, inside a frame too; ``closed``: the link is out of its table (``_table``);
- cross-memory copies (same host): ``cma_ok`` says whether the peer may copy a large payload
  out of our memory (``DATA_CMA``); ``copies`` are the transfers it copies now, each a ``Copy``
  that its ``CMA_ACK`` (``copied``) or the link's loss (``release_copies``) ends;
- liveness: ``last_rx`` and ``last_tx`` (when anything last came and went) and ``tail`` (the
  unsent rest of a heartbeat, which the next write sends first) are ``_liveness.Heartbeats``'s.

Also here, for both front ends: which host a process is on (``host_id``), the address other
hosts reach it by (``advertised_address``), and the TCP options of a connection (``tune_tcp``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from .._core import auth
from .._core.errors import fresh
from .._core.net import literal_family
from .._core.peercred import unix_peer
from . import _handshake
from ._memory import cma_possible
from ._protocol import NEED_DATA, Arriving, Frame, FrameDecoder, Kind, pack_header, unpack_ack

__all__ = ["IOV_MAX", "Copy", "Link", "advertised_address", "host_id", "tune_tcp"]

IOV_MAX = 512  # buffers per ``sendmsg``


class Copy:
    """A cross-memory transfer that the peer copies out of our memory: ``done`` is set by its
    ``CMA_ACK`` (``err``: its errno, 0 when copied) or when the link is lost (``err`` -1)."""

    __slots__ = ("done", "err")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.err = 0


class Link:
    """One connection (see the module docstring).

    Args:
        peer: the peer's id (a rank, a worker id).
        sock: the connected, authenticated socket (made non-blocking here).
        addr: how messages name the peer's end (``"unix"`` or ``host:port``).
        same_host: a Unix connection to a process of this host (and network namespace).
        session: the handshake's session (frame tags) when the job has a secret.
        alloc: where the decoder puts the large payloads that nobody placed (``None``: the
            decoder's own choice).
    """

    __slots__ = (
        "addr", "closed", "cma_ok", "copies", "decoder", "fd", "last_rx", "last_tx", "peer", "ready", "rlock", "same_host",
        "send_lock", "session", "sock", "tail",
    )  # fmt: skip

    def __init__(
        self,
        peer: int,
        sock: socket.socket,
        addr: str,
        same_host: bool,
        session: _handshake.Session | None,
        alloc: Callable[[int], memoryview] | None = None,
    ) -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.addr = addr
        self.same_host = same_host
        self.cma_ok = same_host and cma_possible()
        self.copies: dict[int, Copy] = {}  # (by transfer id)
        self.session = session
        sock.setblocking(False)
        self.send_lock = threading.Lock()
        self.rlock = threading.Lock()
        self.ready = select.poll()
        self.ready.register(self.fd, select.POLLIN)
        seal = None if session is None else session.recv
        self.decoder = FrameDecoder(seal) if alloc is None else FrameDecoder(seal, alloc=alloc)
        now = time.monotonic()
        self.last_rx = now
        self.last_tx = now
        self.tail = b""
        self.closed = False  # out of its connection table (``_table``): its descriptor may be reused

    def local_pid(self) -> int | None:
        """The pid at the other end of a Unix socket, as this process's pid namespace numbers it
        (the kernel's word: ``SO_PEERCRED``); None on another socket, or a closed one."""
        with contextlib.suppress(OSError):
            if self.sock.family == socket.AF_UNIX:
                return unix_peer(self.sock)[0]
        return None

    def frame(
        self, kind: Kind, tag: int, meta: bytes = b"", payload: Sequence[memoryview] = (), nbytes: int = 0
    ) -> tuple[list[memoryview], auth.Tagging | None]:
        """One frame as buffers to ``write``, and its tagging when its payload is tagged as it
        goes (send lock held: tags follow the order of the frames on the wire)."""
        head = pack_header(kind, tag, nbytes, len(meta)) + meta
        parts = [memoryview(head), *(v for v in payload if v.nbytes)]
        if self.session is None:
            return parts, None
        if nbytes >= auth.BULK:
            return parts, self.session.send.start(head, nbytes)
        parts.append(memoryview(self.session.send.tag(head, parts[1:], nbytes)))
        return parts, None

    def copied(self, xfer: int, ack: bytes) -> None:
        """The peer's ``CMA_ACK`` of transfer ``xfer`` (its packed errno) came."""
        copy = self.copies.pop(xfer, None)
        if copy is not None:
            copy.err = unpack_ack(ack)
            copy.done.set()

    def release_copies(self) -> None:
        """The link is gone: the senders waiting for the peer's copies stop (``err`` -1)."""
        copies = list(self.copies.values())
        self.copies.clear()
        for copy in copies:
            copy.err = -1
            copy.done.set()

    def heartbeat(self) -> bytes:
        """A whole heartbeat frame (sealed where the link has a session)."""
        return b"".join(self.frame(Kind.HEARTBEAT, 0)[0])

    def write(
        self, parts: list[memoryview], tagging: auth.Tagging | None, blocked: Callable[[bool], None]
    ) -> None:
        """Write the frame ``parts`` (from ``frame``) whole, send lock held. ``blocked(started)``
        is called whenever the socket takes no more: it returns once there may be room, or
        raises (``started``: part of the frame is out, so only a lost or stalled peer may end
        the write now). A frame that did not start gives its sequence number back.

        Raises:
            OSError: the connection failed (the caller says how); what ``blocked`` raises.
        """
        sock = self.sock
        started = False
        untagged = parts[0].nbytes if tagging is not None else 0  # (the head: in the tag already)
        if self.tail:  # a heartbeat went out in part: its rest first, or the framing breaks
            parts = [memoryview(self.tail), *parts]
            untagged += len(self.tail)
            self.tail = b""
            started = True
        while parts:
            try:
                sent = sock.sendmsg(parts[:IOV_MAX])
            except (BlockingIOError, InterruptedError):
                try:
                    blocked(started)
                except BaseException:
                    if not started and self.session is not None:
                        self.session.send.seq -= 1  # (this frame never left: its number is free again)
                    raise
                continue
            started = True
            self.last_tx = time.monotonic()
            while sent and parts:
                n = parts[0].nbytes
                if sent >= n:
                    out = parts.pop(0)
                    sent -= n
                else:
                    out = parts[0][:sent]
                    parts[0] = parts[0][sent:]
                    sent = 0
                if tagging is not None:
                    if untagged >= out.nbytes:
                        untagged -= out.nbytes
                    else:
                        tagging.update(out[untagged:])
                        untagged = 0
            if not parts and tagging is not None:
                parts = [memoryview(tagging.digest())]
                tagging = None

    def put(
        self,
        parts: list[memoryview],
        tagging: auth.Tagging | None,
        deadline: float | None,
        failure: Callable[[float], BaseException | None],
        timed_out: Callable[[], BaseException],
        step: float,
    ) -> None:
        """``write``, with the wait both front ends make while the socket takes no more:
        ``step`` seconds at a time, until there is room, or ``failure(now)`` says why the
        peer cannot take the frame (lost, stalled), or ``deadline`` passes before the frame's
        first byte is out (``timed_out()``; once part of it is out only the rest may follow).

        Raises:
            OSError: the connection failed (the caller says how); what ``failure`` returns;
            ``timed_out()``.
        """

        def blocked(started: bool) -> None:
            while True:
                wait = step
                if deadline is not None and not started:
                    wait = max(0.0, min(step, deadline - time.monotonic()))
                if self.wait_writable(wait):
                    return
                now = time.monotonic()
                err = failure(now)
                if err is None and not started and deadline is not None and now >= deadline:
                    err = timed_out()
                if err is not None:
                    raise fresh(err)  # (often a peer's kept error: see ``fresh``)

        self.write(parts, tagging, blocked)

    def pump(
        self,
        on_frame: Callable[[Any, Frame], None],
        on_arriving: Callable[[Any, Arriving], None],
        stop: Callable[[], bool] | None = None,
        wait: float = 0.5,
    ) -> None:
        """Read what the socket has and hand out its frames in order, ``on_frame(link, frame)``
        and ``on_arriving(link, arriving)`` (which must ``place`` the payload), read lock
        held: whoever reads a link reads it here. Returns once nothing more is there, or
        the link is ``closed``; a short read took all there was, so a small frame costs one
        system call. A waiting thread (``stop`` given) waits inside a frame for its rest
        instead, ``wait`` seconds at a time, until ``stop()`` says to give up (or raises).

        Raises:
            ConnectionResetError without an ``errno``: the peer closed the connection (the
            end of the stream); OSError: it failed;
            RemoteProtocolError: the peer broke the protocol.
        """
        dec = self.decoder
        recv = self.sock.recv_into  # (not the descriptor's number: a closed link's may be reused)
        short = False
        while True:
            event = dec.next_event()
            if event is NEED_DATA:
                at_boundary = dec.at_boundary
                if short and at_boundary:
                    return
                buf = dec.buffer()
                try:
                    k = recv(buf)
                except BlockingIOError:
                    if at_boundary or stop is None:
                        return
                    # inside a frame, for a waiting thread: its rest is on the way
                    while not self.ready.poll(wait * 1000):
                        if stop():
                            return
                    continue
                if not k:
                    raise ConnectionResetError("connection closed" if at_boundary else "connection closed inside a frame")
                dec.received(k)
                self.last_rx = time.monotonic()
                short = k < buf.nbytes and not dec.placing
            elif type(event) is Arriving:
                on_arriving(self, event)
            else:
                on_frame(self, cast(Frame, event))
                if self.closed:
                    return

    def wait_writable(self, seconds: float) -> bool:
        """Whether the socket has room within ``seconds``."""
        p = select.poll()
        p.register(self.fd, select.POLLOUT)
        return bool(p.poll(seconds * 1000))


@functools.lru_cache(maxsize=1)
def _boot() -> str:
    """The host's name and boot id (fixed for the life of the process: read once)."""
    try:  # (os.read: a text file object's first opening in a process costs 50 us more)
        fd = os.open("/proc/sys/kernel/random/boot_id", os.O_RDONLY | os.O_CLOEXEC)
        try:
            boot = os.read(fd, 256).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}|{boot}"


def host_id() -> str:
    """Identifies this host and network namespace (ranks with equal ids share memory and
    abstract Unix sockets)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{_boot()}|{netns}"


def _store_host(store: Any) -> str | None:
    """The host name of the TCPStore under ``store`` (through prefix stores), if any."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str):
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def interface_address(name: str) -> str:
    """The address of network interface ``name``: its IPv4 address, else its first global IPv6
    one.

    Raises:
        DistNetworkError: this host has no interface ``name``, or it has no address (torch's
            gloo says "Unable to find address for: <name>").
    """
    import fcntl
    import struct

    from .._core.errors import DistNetworkError

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        siocgifaddr = 0x8915
        packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:  # (address, index, prefix length, scope, flags, name)
            fields = line.split()
            if len(fields) == 6 and fields[5] == name and fields[3] == "00":
                raw = bytes.fromhex(fields[0])
                return socket.inet_ntop(socket.AF_INET6, raw)
    raise DistNetworkError(f"Unable to find address for: {name} (the network interface that {_IFNAME_WHY})")


_IFNAME_WHY = "GLOO_SOCKET_IFNAME or TP_SOCKET_IFNAME names, which this host does not have with an address"


def advertised_address(store: Any, interface_var: str = "GLOO_SOCKET_IFNAME") -> str:
    """The address other hosts reach this rank by: ``TDIST_ADDR``, else the address of the
    first interface that the environment variable ``interface_var`` names (torch's
    ``GLOO_SOCKET_IFNAME`` for process groups, ``TP_SOCKET_IFNAME`` for RPC: a comma-separated
    list, as gloo's), else the local address of the route to the store's host, else loopback.

    Raises:
        DistNetworkError: ``interface_var`` names an interface this host does not have.
    """
    explicit = os.environ.get("TDIST_ADDR")
    if explicit:
        return explicit
    interfaces = [n.strip() for n in os.environ.get(interface_var, "").split(",") if n.strip()]
    if interfaces:
        return interface_address(interfaces[0])
    host = _store_host(store)
    if host:
        try:
            literal = literal_family(host)
            sockaddr: Any
            if literal is not None:  # (no resolver: see _core.net)
                family, sockaddr = literal, (host, 1)
            else:
                family, _, _, _, sockaddr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0])
        except OSError:
            pass
    return "127.0.0.1"


def tune_tcp(sock: socket.socket) -> None:
    """No Nagle delay for small frames; large kernel buffers for bulk transfers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = int(os.environ.get("TDIST_TCP_BUFFER", str(4 << 20)))
    if size > 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
