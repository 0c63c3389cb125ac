"""The store server: one selector loop over every client connection.

Theory of operation. One thread runs a ``selectors`` loop: it accepts connections (TCP, plus a
Unix-domain socket for clients on the same host, which is several times faster), reads bytes
into each connection's ``FrameDecoder`` and executes complete requests against one ``KVState``.
A request that must wait (``GET``/``WAIT``/``MULTI_GET`` on a missing key, ``QUEUE_POP`` on an
empty queue) parks a waiter on the first missing key and a timer; the connection reads no
further request until the waiter is answered, so replies stay in order. Any write that changes
a key re-checks the waiters parked on it. A connection that breaks the protocol gets an error
frame and is closed; nothing a client sends can stop the loop or touch other clients' keys.

The TCP port serves clients of torch's own ``TCPStore`` too, in torch's protocol
(``_torch_wire``): a client over TCP speaks first, tdist's with ``OPENING``, torch's with its
``VALIDATE``, and the first bytes decide (``_sniff``) how the connection is served from then on
(``_Conn.kind``). A torch client's queries act on the same data, in a namespace of torch's
clients (``_torch_key``: tdist's own keys are out of their reach), and its ``WAIT``s park as
tdist's do (without a deadline: its client cancels); a server with a secret serves torch's
clients only when told to (``torch_clients``). The Unix socket serves tdist's clients alone, and greets them at once.

The loop runs in a thread, or (the default for ``TCPStore``) in a process of its own that serves
nothing else, so a busy Python parent holding the GIL cannot slow the store down. That process is
a new interpreter, not a fork (see ``StoreServer.start``), and exits when its parent closes the
control pipe or dies. It takes tens of milliseconds to start, so the loop serves from a thread
of the parent meanwhile, and hands everything over to the process once it is up (``_hand_over``;
``_take_over`` on the other side): a master's store is up at once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import heapq
import itertools
import json
import logging
import marshal
import math
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from .._core import _process, auth
from .._core import spin as _spin
from .._core.errors import (
    AuthenticationError,
    DistNetworkError,
    RemoteProtocolError,
    StoreValueError,
)
from .._core.floods import FailureLog, Starvation
from .._core.net import literal_family
from .._core.peercred import check_unix_peer, unix_peer
from .._core.threads import QuickThread
from ._protocol import (
    DEFAULT_MAX_FRAME,
    FIELD_LEN,
    HEAD_FIELD,
    MAX_AUTH_FRAME,
    OPENING,
    PROTOCOL_VERSION,
    ErrorKind,
    Frame,
    FrameDecoder,
    Op,
    Status,
    decode_int,
    encode_frame,
    encode_int,
)
from ._state import KVState
from ._torch_wire import MAGIC as _TORCH_MAGIC
from ._torch_wire import TORCH_KEYS, Query, QueryDecoder, Reply, is_torch_opening

TYPE_CHECKING = False  # (typing is not imported at run time: see tdist/__init__)
if TYPE_CHECKING:
    from typing import Any

    from .._core.deadline import Clock

__all__ = ["StoreServer", "unix_address"]

log = logging.getLogger(__name__)

# Not larger: a bytes object above malloc's mmap threshold (128 KiB unless raised) costs an
# mmap and munmap per receive, 17 us for a 30-byte request
_RECV_SIZE = 1 << 16
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_RECV_MAX = 1 << 24
_MAX_BACKLOG_FRAMES = 4  # bytes buffered behind a blocked request, in units of max_frame
_MAX_UNAUTHED = 256  # connections waiting to authenticate; beyond, the oldest goes
# replies queued for a client that does not read them, beyond which its further requests wait
# (unread, in the kernel's buffers) until it does: what it costs the server stays bounded
_OUT_PAUSE = 1 << 22
_OPEN_WARNED = False
# servers started in this process (``start``): a forked child lets go of their descriptors
_started: weakref.WeakSet[StoreServer] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a child forked from a process that runs store servers (``os.fork``, multiprocessing's
    "fork"): no server thread runs here, and its copies of their descriptors would keep what
    they serve open: a listener that accepts and never answers, clients' connections whose end
    never comes once the real server is gone (a killed store seemed alive to its clients, who
    then waited for their timeouts instead of failing over). They go, in the child only."""
    for server in list(_started):
        server._forget()


os.register_at_fork(after_in_child=_forget_in_child)


_SET_QUIET = int(Op.SET_QUIET)
_CHECK_TRUE = encode_frame(Status.OK, (b"\x01",))
_CHECK_FALSE = encode_frame(Status.OK, (b"\x00",))
# what a connection is (``_Conn.kind``): a tdist client; one over TCP whose first bytes have not
# told yet; a client of torch's (``torch.distributed.TCPStore``, its own protocol: ``_torch_wire``)
_TDIST, _SNIFFING, _TORCH = 0, 1, 2
_BURST_PAUSE = 30e-6  # seconds that the loop rests after a wake-up for sets only (see serve_forever)
_BEAT_EVERY = 1.0  # seconds between beats to a standby when nothing changes
_FOLLOWER_BACKLOG = 64 << 20  # bytes queued for a standby that reads none: it is dropped
_OK_INT = struct.Struct("<IBIIq")  # an OK reply holding one integer field
_INT = struct.Struct("<q")
# the hand-over to the server's own process (``_hand_over``): the most descriptors one message
# carries (the kernel's SCM_MAX_FD), the size of the data's pieces, how long each step may take,
# and how long ``pid`` waits for the process to have taken over
_FDS_PER_MESSAGE = 250
_HANDOVER_CHUNK = 1 << 15
_HANDOVER_STEP = 10.0
_HANDOVER_WAIT = 60.0
# how long after its start the server starts its own process: the store's busiest moments are
# its first ones (a group forming, ranks meeting), and a new interpreter starting (tens of
# milliseconds of a core) would slow them
_SPAWN_AFTER = 0.1


_ANY = ("", "0.0.0.0", "::", "*")  # (hosts that bind every interface)


def port_taken(exc: BaseException) -> bool:
    """Whether ``exc``, a store server's failure to start, says that its port is taken."""
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE


def unix_address(port: int) -> str:
    """The abstract Unix-socket name a server on TCP ``port`` also listens on."""
    return f"\0tdist-store-{port}"


def _holder(name: str) -> str:
    """Who holds the abstract Unix socket ``name``, as far as a connection can tell."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(name)
        pid, uid = unix_peer(probe)
        return f"by pid {pid} of user {uid}"
    except OSError as exc:
        return f"by a process we cannot reach: {exc}"
    finally:
        probe.close()


def _decode_key(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise RemoteProtocolError(f"store key is not UTF-8: {raw[:40]!r}") from None


def _timeout_arg(raw: bytes) -> float | None:
    ms = decode_int(raw)
    return None if ms < 0 else ms / 1000.0


class _Waiter:
    __slots__ = ("conn", "deadline", "done", "keys", "op", "parked_on", "timeout")

    def __init__(self, conn: _Conn, op: int, keys: list[str], timeout: float | None, now: float) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.timeout = timeout
        self.deadline = None if timeout is None else now + timeout
        self.done = False
        self.parked_on: str | None = None


class _Conn:
    __slots__ = (
        "addr",
        "authed",
        "blocked",
        "closed",
        "decoder",
        "follower",
        "kind",
        "nonce",
        "out",
        "paused",
        "queries",
        "seal",
        "sock",
        "writing",
    )

    def __init__(self, sock: socket.socket, addr: str, authed: bool, max_frame: int) -> None:
        self.sock = sock
        self.addr = addr
        self.authed = authed
        self.decoder = FrameDecoder(max_frame if authed else MAX_AUTH_FRAME)
        self.out = bytearray()
        self.blocked: _Waiter | None = None
        self.closed = False
        self.writing = False
        self.paused = False  # too many replies unread: its requests are not read (``_flush``)
        self.nonce = b""
        self.seal: auth.Seal | None = None  # tags our frames once the client proved the secret
        self.kind = _TDIST
        self.queries: QueryDecoder | None = None  # (a client of torch's: its requests)
        self.follower = False  # a standby: sent the data's changes, asks nothing more


class StoreServer:
    """A store server bound to ``host:port`` (``port=0`` picks a free port).

    Args:
        host: the address to bind; ``""``, ``"0.0.0.0"`` or ``"::"`` bind every interface.
        every_address: bind every interface all the same, once ``host`` is known to be an
            address or a name that resolves (``TCPStore``'s master: torch's server listens on
            every local address, whatever host name it is given).
        port: the TCP port; 0 picks a free one (read it back from ``port``).
        secret: the shared secret clients must prove; ``None`` reads ``TDIST_SECRET``, and with
            neither the store is open to anyone who can connect (as torch's is).
        max_frame: the largest request accepted, in bytes.
        unix: also listen on an abstract Unix socket for same-host clients.
        clock: the monotonic clock (injectable for tests).
        spin: seconds to keep polling after activity before sleeping, when serving in a
            process of its own (default: ``_core.spin``'s budget, ``TDIST_SPIN_US``).
        state: the data to serve (a standby taking over: ``_replica``); default empty.
        torch_clients: whether clients of torch's own ``TCPStore`` are served (over TCP, in
            torch's protocol: ``_torch_wire``). They prove no secret, so their keys live in a
            namespace of their own (``TORCH_KEYS`` before each: a tdist client reads torch's
            ``"/k"`` as ``"torch:/k"``), out of which they reach nothing. None (the default):
            served when the store requires no secret (it is open to anyone then anyway);
            True: served with a secret too (``tdist run``'s store, which torch programs use as
            torchrun's); False: refused.

    Raises:
        DistNetworkError: the address cannot be bound (in use, not local).
    """

    # tests hold the hand-over to the server's own process back until they set it (and wake the
    # loop: ``_send(b".")``), to hand over a server in a state of their making
    handover_gate: threading.Event | None = None

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: str | bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        unix: bool = True,
        clock: Clock = time.monotonic,
        auth_timeout: float = 10.0,
        backlog: int = 2048,
        listen_fd: int | None = None,
        spin: float | None = None,
        unix_fd: int | None = None,
        state: KVState | None = None,
        torch_clients: bool | None = None,
        every_address: bool = False,
    ) -> None:
        if every_address and listen_fd is None and host not in _ANY:
            self._resolve(host, port)  # (a name that does not resolve fails here, as before)
            host = ""
        self.host = host
        if spin is None:
            spin = _spin.SPIN
        self.spin = spin
        self.secret = auth.resolve_secret(secret)
        self.torch_clients = self.secret is None if torch_clients is None else torch_clients
        self.max_frame = max_frame
        self.auth_timeout = auth_timeout
        self._clock = clock
        self._state = KVState() if state is None else state
        # standbys that keep a copy of the data (``_replica``): the connection, the address it
        # serves at once it takes over
        self._followers: dict[_Conn, str] = {}
        self._parked: dict[str, list[_Waiter]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._dead_timers = 0  # timers of waiters answered (or gone) before their deadline
        self._seq = itertools.count()
        self._ready: deque[_Conn] = deque()
        self._burst = False  # the last wake-up brought only quiet sets (see serve_forever)
        self._conns: set[_Conn] = set()
        # connections that have not proved the secret yet, oldest first: the first to go when
        # descriptors run out or too many strangers wait (``_core.floods``)
        self._unauthed: dict[_Conn, None] = {}
        self._starvation = Starvation(f"store server on port {port}")
        self._failures = FailureLog(f"store server on port {port}", log)  # (strangers: no flood of lines)
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._proc: _process.Spawned | None = None
        # ``start("process")``: the connection to the process that takes over from the thread,
        # until it has (``_hand_over``) or failed to; ``_handed`` is set then
        self._successor: socket.socket | None = None
        self._handed_over = False
        self._handed = threading.Event()
        self._retired: float | None = None  # since when nobody is connected to a retired server
        self.retire_grace = 2.0
        self.idle_wait = 1.0  # the longest sleep of the loop with nothing due (tests lengthen it)
        self._idle = threading.Event()  # retired and nobody connected (or stopped): wait_idle
        self.listening = True  # (until stop_listening)
        self._status_r: int | None = None  # the server's answers to the control pipe
        self._control_r: int | None = None  # (the loop's end of the control pipe)
        self._status_w: int | None = None
        self._control_w: int | None = None
        self._listeners: list[socket.socket] = []
        self._adopted: list[_Conn] = []  # (``adopt``: served from the loop's start)
        # held by the loop while it serves (not while it waits for events), and by
        # ``serve_direct``, which serves this process's own client in the client's thread
        self._lock = threading.Lock()
        self._fdmap: dict[int, object] = {}
        self._ep: select.epoll | None = None
        self._looping = False  # the loop's thread serves (``serve_forever``)
        if listen_fd is not None:
            self._tcp = socket.socket(fileno=listen_fd)
            if not self._tcp.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                # (torch's takes a socket not listening yet, bound or not: an unbound one
                # listens on an ephemeral port of every address)
                self._tcp.listen(backlog)
        else:
            self._tcp = self._bind_tcp(host, port, backlog)
        self.port: int = self._tcp.getsockname()[1]
        self._starvation.label = f"store server on port {self.port}"
        self._listeners.append(self._tcp)
        self._unix: socket.socket | None = None
        if unix_fd is not None:
            self._unix = socket.socket(fileno=unix_fd)
            self._listeners.append(self._unix)
        elif unix:
            self._unix = self._bind_unix(self.port, backlog)
            if self._unix is not None:
                self._listeners.append(self._unix)
        self._handlers: dict[int, Callable[[_Conn, list[bytes]], None]] = {
            Op.SET: self._op_set,
            Op.GET: self._op_get,
            Op.ADD: self._op_add,
            Op.COMPARE_SET: self._op_compare_set,
            Op.WAIT: self._op_wait,
            Op.CHECK: self._op_check,
            Op.DELETE: self._op_delete,
            Op.NUM_KEYS: self._op_num_keys,
            Op.MULTI_GET: self._op_multi_get,
            Op.MULTI_SET: self._op_multi_set,
            Op.APPEND: self._op_append,
            Op.LIST_KEYS: self._op_list_keys,
            Op.QUEUE_PUSH: self._op_queue_push,
            Op.QUEUE_POP: self._op_queue_pop,
            Op.QUEUE_LEN: self._op_queue_len,
            Op.PING: self._op_ping,
            Op.FOLLOW: self._op_follow,
            Op.REPLICAS: self._op_replicas,
        }

    def adopt(self, sock: socket.socket) -> _Conn:
        """Serve ``sock`` as a client that has nothing to prove: one end of a socket pair whose
        other end a client in this very process holds (the master's own client, which holds the
        secret already, so its frames go untagged, as over any connection without a secret). No
        HELLO is sent on it. Call before ``start``: the loop takes it in as it starts. Returns
        the connection, for ``serve_direct``."""
        conn = _Conn(sock, "this process", True, self.max_frame)
        self._adopted.append(conn)
        self._conns.add(conn)
        return conn

    def serve_direct(self, conn: _Conn, request: bytes) -> bytes | None:
        """Serve one request of this process's own client (``conn``, from ``adopt``) in the
        caller's thread, as the loop would have served it from the socket pair: an in-process
        round trip through the loop's thread costs two thread wake-ups (90-100 us, most of
        what forming a group spends on rank 0's store calls), this none.

        Returns the reply's bytes: empty for a request that waits (its reply comes through the
        socket pair, sent by whoever sets what it waits for) or that has no reply (a quiet
        set). ``None``: not served, send it through the socket pair: the loop is serving
        others at this moment (it is awake, so that costs no wake-up, and the request takes its
        turn instead of waiting for a gap between their requests), something of this
        connection is still in the loop's hands (a request or a reply the socket holds), whose
        order the client must keep, or the server has stopped.
        """
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if (conn.closed or conn.blocked is not None or conn.out or conn.decoder.buffered
                    or self._stop_requested):
                return None
            try:
                frame = conn.decoder.parse_whole(request)
            except RemoteProtocolError:
                frame = None
            if frame is None:
                return None  # (the loop's path reports what is wrong with it)
            first = self._timers[0][0] if self._timers else None
            self._serve_waiting()  # (theirs came first)
            if conn.closed:
                return None
            try:
                self._dispatch_authed(conn, frame)
            except Exception as exc:  # a bug must cost one connection, not the store
                log.exception("store server on port %d: error serving %s", self.port, conn.addr)
                self._close(conn, f"internal error: {exc!r}")
                return None
            reply = bytes(conn.out)
            conn.out.clear()
            if self._ready:  # waiters of other clients that this request answered
                self._drain_ready()
            if self._timers and (first is None or self._timers[0][0] < first) and self._control_w is not None:
                # the loop may be asleep past this request's deadline: have it look again
                with contextlib.suppress(OSError):
                    os.write(self._control_w, b".")
            return reply
        finally:
            self._lock.release()

    # -- binding -------------------------------------------------------------------------------
    @staticmethod
    def _resolve(host: str, port: int) -> tuple[int, tuple[str, int]]:
        """The family and address that ``host`` (a name or an address) binds.

        Raises:
            DistNetworkError: a name that does not resolve.
        """
        if (literal := literal_family(host)) is not None:  # (no resolver: see _core.net)
            return literal, (host, port)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise DistNetworkError(
                f"cannot start a store server on {host}:{port}: the host name does not "
                f"resolve ({exc})"
            ) from exc
        family, _, _, _, sockaddr = infos[0]
        return family, (str(sockaddr[0]), int(sockaddr[1]))

    @staticmethod
    def _bind_tcp(host: str, port: int, backlog: int) -> socket.socket:
        if host in _ANY:
            # every address: IPv6 and IPv4 on one socket where the host has IPv6; IPv4 alone
            # where it has none (a host or container with IPv6 turned off: the module may be
            # there, and only the bind fails)
            tries: list[tuple[int, tuple[str, int]]] = [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))]
        else:
            tries = [StoreServer._resolve(host, port)]
        for i, (family, bind_addr) in enumerate(tries):
            sock = None
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
                if family == socket.AF_INET6 and host in _ANY:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(bind_addr)
                sock.listen(backlog)
                return sock
            except OSError as exc:
                if sock is not None:
                    sock.close()
                if i + 1 < len(tries) and exc.errno != errno.EADDRINUSE:
                    continue
                hint = (
                    "another process is using the port; pick another or pass port=0"
                    if exc.errno == errno.EADDRINUSE
                    else "check that the address belongs to this host"
                )
                why = f"{exc.strerror or exc}; {hint}"
                if host in _ANY:  # (bound as torch's server binds, on every address: torch's words)
                    raise DistNetworkError(f"The server socket has failed to listen on any local network address. port: {port}: {why}") from exc
                raise DistNetworkError(f"cannot start a store server on {host}:{port}: {why}") from exc
        raise AssertionError("unreachable")  # (the last try returns or raises)

    @staticmethod
    def _bind_unix(port: int, backlog: int) -> socket.socket | None:
        """The abstract Unix socket beside TCP ``port``; a name that is taken is an error: the
        clients of this host would reach whoever holds it first (which a stranger can do),
        never silently this server."""
        if os.environ.get("TDIST_STORE_UNIX", "1") == "0":
            return None
        name = unix_address(port)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            raise DistNetworkError(
                f"cannot start a store server on port {port}: its Unix socket @{name[1:]} is taken "
                f"({_holder(name)}); another store with this port number runs on this host, or "
                "someone else took the name: pick another port (or set TDIST_STORE_UNIX=0 on "
                "every process of the job)"
            ) from exc
        return sock

    # -- running -------------------------------------------------------------------------------
    def start(self, mode: str = "process") -> None:
        """Serve in the background: ``"process"`` (a new interpreter of its own) or
        ``"thread"``.

        The process is started fresh (``sys.executable``), not forked: a fork of a process
        with other threads (torch's, the caller's) copies locks that those threads may hold at
        that moment, and a child that then logs, or allocates through a library that keeps
        its own locks, waits on them forever. Its start takes some tens of milliseconds of a
        core (it imports only the server, not torch), so a thread of this process serves from
        the start, starts the process ``_SPAWN_AFTER`` seconds later, and hands over to it once
        it is up (``_hand_over``): clients connect and are answered at once, and notice nothing
        of the change. If the process cannot start or take over, the thread serves on.
        """
        if mode not in ("process", "thread"):
            raise ValueError(f"store server mode must be 'process' or 'thread', got {mode!r}")
        r, w = os.pipe()
        self._control_w = w
        self._status_r, self._status_w = os.pipe()
        self._control_r = r
        _started.add(self)
        if mode == "process":
            self._add_timer(self._clock() + _SPAWN_AFTER, functools.partial(self._spawn, r, self._status_w))
        else:
            self._handed.set()  # (nothing to hand over)
        # (not waiting for it to run: it does once this thread waits, see ``QuickThread``)
        self._thread = QuickThread(self._serve_and_close, f"tdist-store-{self.port}", (r,))
        self._thread.start()
        self._warn_if_open()

    def _warn_if_open(self) -> None:
        """Say once a process that its store server takes any client. After the server has
        started (for a master made to serve later, where its rendezvous wait first has nothing
        to do): a process's first log line costs its thread 0.1-0.2 ms, which the clients'
        first answers need not wait for."""
        global _OPEN_WARNED
        if self.secret is None and not _OPEN_WARNED:
            _OPEN_WARNED = True
            log.warning(
                "store server on %s:%d accepts any client: no secret given "
                "(pass secret= or set TDIST_SECRET to require one)",
                self.host or "*",
                self.port,
            )

    def _spawn(self, control_r: int, status_w: int) -> None:
        """Start the process that takes over from the thread (``_hand_over``; a timer of the
        loop). The thread reaches it through ``_successor``."""
        if not self.listening or self._retired is not None or self._stop_requested:
            self._handed.set()  # (stopping: not worth it)
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {
            "host": self.host,
            "handover": theirs.fileno(),
            "control": control_r,
            "status": status_w,
            "parent": os.getpid(),
            "secret": None if self.secret is None else self.secret.hex(),
            "torch_clients": self.torch_clients,
            "max_frame": self.max_frame,
            "auth_timeout": self.auth_timeout,
            "spin": self.spin,
            # (the server starts without site: it finds what it imports late, such as the
            # library behind the tags of large frames, where its parent did)
            "path": [p for p in sys.path if p],
        }
        boot_r, boot_w = os.pipe()
        try:
            # (its length first: a process forked meanwhile by another thread holds a copy of
            # the write end, so the server would wait for its end of file as long as that lives)
            boot = json.dumps(config).encode()
            os.write(boot_w, struct.pack("<I", len(boot)) + boot)  # (far below a pipe's capacity)
            os.close(boot_w)
            boot_w = -1
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            # (not ``subprocess.Popen``: see ``spawn``; a rank forked meanwhile made it wait)
            self._proc = _process.spawn(
                [sys.executable or "python3", "-S", "-c", _BOOT.format(root=root), str(boot_r)],
                pass_fds=[boot_r, control_r, status_w, theirs.fileno()],
            )
        except OSError as exc:
            log.warning("store server on port %d: cannot start a process of its own (%s): serving "
                        "from a thread of this process", self.port, exc)
            ours.close()
            self._handed.set()
            return
        finally:
            os.close(boot_r)
            if boot_w >= 0:
                os.close(boot_w)
            theirs.close()
        ours.setblocking(False)
        self._successor = ours
        if self._ep is not None:
            self._ep.register(ours.fileno(), select.EPOLLIN)
            self._fdmap[ours.fileno()] = ours

    def _forget(self) -> None:
        """``_forget_in_child``'s work for this server (the forked child's copies only; the
        parent and the server's own process are untouched, and this child never stops them)."""
        socks = [*self._listeners, *(c.sock for c in self._conns), *(c.sock for c in self._adopted)]
        if self._successor is not None:
            socks.append(self._successor)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
        if self._ep is not None:
            with contextlib.suppress(OSError):
                self._ep.close()
        for fd in (self._control_w, self._control_r, self._status_r, self._status_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._control_w = self._control_r = self._status_r = self._status_w = None
        self._listeners, self._conns, self._adopted = [], set(), []
        self._successor = None
        self._thread = self._proc = None
        self._stop_requested = True
        self._handed.set()

    def _serve_and_close(self, control_r: int, parent_pid: int | None = None) -> None:
        try:
            self.serve_forever(control_r, parent_pid=parent_pid)
        finally:
            self._failures.flush()
            self._control_r = None
            os.close(control_r)
            for sock in self._listeners:
                sock.close()
            if self._successor is not None:  # stopped before the process took over: it ends
                self._abandon_successor(None)
            self._handed.set()

    @property
    def pid(self) -> int | None:
        """The server's process id (``start("process")``) once it serves (this waits for the
        process to take over from the thread), else None."""
        if self.handover_pending:
            self._handed.wait(_HANDOVER_WAIT)
        proc = self._proc
        return proc.pid if proc is not None and self._handed_over else None

    @property
    def handover_pending(self) -> bool:
        """Whether its own process may still take over from the thread that serves
        (``start("process")``); once not, ``pid`` is known without waiting (None: the thread
        serves on)."""
        return self._thread is not None and not self._handed.is_set()

    def exit_status(self) -> int | None:
        """The server process's exit status (negative: killed by that signal) once it has
        exited; None while it serves, or when it serves in a thread."""
        proc = self._proc
        return proc.poll() if proc is not None and self._handed_over else None

    def _command(self, command: bytes, now: float) -> None:
        """What the control pipe says (one byte a command; any other, such as ``serve_direct``'s
        ".", only wakes the loop, which then looks at its timers again)."""
        for c in command:
            if c == ord("L") and self._listeners:  # stop listening
                self._unlisten()
            elif c == ord("R"):  # retired: stop once idle (see ``retire``)
                self._retired = now
            elif c == ord("A"):  # taken back: serve on, and say so
                self._retired = None
                self._idle.clear()
                if self._status_w is not None:
                    with contextlib.suppress(OSError):
                        os.write(self._status_w, b"a")

    def retire(self) -> None:
        """Serve on while anyone is connected, and stop (listeners first) once nobody has been
        for ``retire_grace`` seconds; ``reactivate`` takes it back meanwhile. What a store made
        for a process group does when the group is destroyed: a rank of the group that is
        quicker than its host to re-initialize may already be connected for the next one, and
        the host takes the same server back when it re-initializes."""
        self._send(b"R")

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until this retired server has nobody connected (or
        has stopped); whether it has. A process that hosts a group's store in a thread calls it
        as it exits: the group's other ranks, leaving the group themselves, are still answered
        (a thread serves no more once the interpreter finalizes)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        return self._idle.wait(timeout)

    def reactivate(self, timeout: float = 5.0) -> bool:
        """Take back a retired server; False when it has stopped already (or is stopping, or
        was told to stop listening)."""
        if self._status_r is None or not self.listening or not self._send(b"A"):
            return False
        ready = select.poll()
        ready.register(self._status_r, select.POLLIN)
        if not ready.poll(timeout * 1000):
            return False
        try:
            return os.read(self._status_r, 1) == b"a"
        except OSError:
            return False

    def _send(self, command: bytes) -> bool:
        if self._control_w is None:
            return False
        try:
            os.write(self._control_w, command)
        except OSError:
            return False
        return True

    def stop_listening(self) -> None:
        """Accept no new connection from now on (clients connected already are served on, and
        a new one is refused rather than served by a store about to stop)."""
        self.listening = False
        if self._control_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._control_w, b"L")

    def _unlisten(self) -> None:
        assert self._ep is not None
        for sock in self._listeners:
            fd = sock.fileno()
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(fd)
            self._fdmap.pop(fd, None)
            sock.close()
        self._listeners = []

    def stop(self, timeout: float = 5.0, wait: bool = True) -> None:
        """Stop serving and release the port; waits up to ``timeout`` seconds (``wait=False``:
        not at all, the server ends on its own moments later)."""
        if self._control_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._control_w)
            self._control_w = None
        if not wait:
            self._thread = self._proc = None
            return
        if self._thread is not None:
            if not sys.is_finalizing():  # (at interpreter exit a daemon thread runs no more)
                self._thread.join(timeout)
            self._thread = None
        else:
            for sock in self._listeners:
                sock.close()
        if self._proc is not None:
            proc, self._proc = self._proc, None
            if not self._handed_over:
                proc.kill()  # (it never served)
            try:
                proc.wait(timeout)
            except Exception:  # (subprocess.TimeoutExpired)
                proc.kill()
                proc.wait()
        for fd in (self._status_r, self._status_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status_r = self._status_w = None

    def _start_loop(self, control_fd: int | None) -> select.epoll:
        """The loop's epoll, with the listeners, the control pipe and the adopted clients (the
        lock held). The epoll is the one ``serve_until`` made, if it served first."""
        ep = self._ep
        if ep is None:
            ep = self._ep = select.epoll()
            self._fdmap = {}
            for sock in self._listeners:
                sock.setblocking(False)
                ep.register(sock.fileno(), select.EPOLLIN)
                self._fdmap[sock.fileno()] = sock
        if control_fd is not None:
            ep.register(control_fd, select.EPOLLIN)
            self._fdmap[control_fd] = None
        adopted, self._adopted = self._adopted, []
        for conn in adopted:
            if conn.closed:
                continue
            conn.sock.setblocking(False)
            self._conns.add(conn)
            ep.register(conn.sock.fileno(), select.EPOLLIN)
            self._fdmap[conn.sock.fileno()] = conn
        if self._ready:  # (taken over: what the clients sent, and their replies not sent yet)
            self._drain_ready()
        return ep

    def serve_forever(self, control_fd: int | None = None, parent_pid: int | None = None) -> None:
        """Run the loop in this thread until ``control_fd`` reads EOF (or the parent dies).

        After activity the loop polls without sleeping for up to ``spin`` seconds (only when it
        owns its process: in a thread it would fight the caller for the GIL), so that a
        client's next request finds it awake: a kernel wake-up costs more than the whole
        request. It polls as ``_core.spin`` says: without yielding for half of it, then with a
        few yields, then it sleeps. A wake-up that brought only ``set``s (which want no answer)
        is followed by a short pause (``_BURST_PAUSE``) out of the kernel's wait list: a client
        on this core that sets many keys would otherwise wake the loop with each one, and each
        wake-up takes the core from it (5.7 us a set instead of 2.3-3.1, measured with both
        pinned to one core of a busy host).
        """
        lock = self._lock
        lock.acquire()
        try:
            ep = self._start_loop(control_fd)
        except BaseException:
            lock.release()
            raise
        self._looping = True  # (``serve_until`` leaves the serving to this loop from now on)
        spin = self.spin if parent_pid is not None else 0.0
        clock = self._clock
        fdmap = self._fdmap
        serve = self._serve_conn
        last_active = 0.0
        yields = 0
        budget = _spin.Budget(spin)
        spinning = False  # polling for the next request since the last activity
        next_ppid_check = clock() + 1.0
        take_over = False  # the process that takes over from this thread is up
        try:
            while not self._stop_requested:
                lock.release()  # (``serve_direct`` serves while the loop waits)
                now = clock()
                quiet = now - last_active
                if spinning and quiet < budget.pure():
                    timeout = 0.0
                elif spinning and quiet < budget.seconds() and yields < _spin.YIELDS:
                    timeout = 0.0
                    yields += 1
                    os.sched_yield()  # a client sharing this core runs at once
                elif self._burst:
                    # the last wake-up brought only sets, which want no answer: let a client
                    # that shares this core go on writing them (each would wake this loop and
                    # take the core back from it), then take in what it wrote
                    self._burst = False
                    timeout = 0.0
                    time.sleep(_BURST_PAUSE)
                else:
                    if spinning:
                        budget.missed()
                        spinning = False
                    timeout = self.idle_wait
                    timers = self._timers
                    if timers:
                        timeout = min(timeout, max(0.0, timers[0][0] - now))
                try:
                    events = ep.poll(timeout)
                finally:
                    lock.acquire()
                if events:
                    if spinning:
                        budget.caught(yields > 0)
                    last_active = clock()
                    yields = 0
                    spinning = bool(spin)
                for fd, mask in events:
                    data = fdmap.get(fd)
                    if type(data) is _Conn:
                        serve(data, mask)
                    elif data is None:
                        if fd in fdmap:
                            try:
                                command: bytes | None = os.read(fd, 64)
                            except (BlockingIOError, InterruptedError):
                                command = None  # nothing to read after all
                            if command == b"":  # EOF: stop
                                self._stop_requested = True
                            elif command:
                                self._command(command, now)
                    elif data is self._successor:
                        take_over = self._successor_up()
                    elif isinstance(data, socket.socket):
                        self._accept(data)
                if self._timers:
                    self._run_timers()
                if self._ready:
                    self._drain_ready()
                if take_over and not self._stop_requested and (self.handover_gate is None or self.handover_gate.is_set()):
                    take_over = False
                    if self._hand_over():
                        break
                if self._retired is not None:
                    if self._conns:
                        self._retired = now
                    else:
                        self._idle.set()
                    if not self._conns and now - self._retired >= self.retire_grace:
                        # nobody has used it for a while: the listeners go first (a connection
                        # in their backlog is refused, never accepted and then dropped)
                        log.debug("store server on port %d: retired and idle: stopping", self.port)
                        self._unlisten()
                        break
                if parent_pid is not None and now >= next_ppid_check:
                    next_ppid_check = now + 1.0
                    if os.getppid() != parent_pid:
                        log.info("store server on port %d: parent %d exited", self.port, parent_pid)
                        break
        finally:
            for conn in list(self._conns):
                self._close(conn, None)
            ep.close()
            self._idle.set()
            lock.release()

    # -- the hand-over to the server's own process ------------------------------------------------
    def _hand_over(self) -> bool:
        """The process started to take over (``_spawn``) says it is up: give it everything, at
        this moment when the loop serves nothing (it holds ``_lock``). What goes: the listening
        sockets and every client's connection (their descriptors, ``SCM_RIGHTS``), what each
        client sent that is not served yet, the replies not sent yet, each session's tags, the
        waiting requests with what is left of their deadlines (in their order), the standby,
        and the data. The bytes the kernel holds for a connection stay where they are, read
        by whichever process reads the descriptor next. Two steps: the process says it holds
        everything (it serves nothing yet), then this thread lets go and tells it to serve;
        whatever fails before that leaves this thread serving, and the process is killed.
        Returns whether the process serves now."""
        sock = self._successor
        if sock is None:
            return False
        if not self.listening or self._retired is not None or self._tcp not in self._listeners:
            self._abandon_successor(None)  # (stopping: not worth it)
            return False
        conns = [c for c in self._conns if not c.closed]
        listeners = [self._tcp] + ([self._unix] if self._unix is not None and self._unix in self._listeners else [])
        fds = [s.fileno() for s in listeners] + [c.sock.fileno() for c in conns]
        payload = self._handover_state(conns, len(listeners))
        try:
            sock.settimeout(_HANDOVER_STEP)
            sock.send(marshal.dumps((len(fds), len(payload))))
            for i in range(0, len(fds), _FDS_PER_MESSAGE):
                socket.send_fds(sock, [b"f"], fds[i : i + _FDS_PER_MESSAGE])
            with memoryview(payload) as view:
                for i in range(0, len(payload), _HANDOVER_CHUNK):
                    sock.send(view[i : i + _HANDOVER_CHUNK])
            if sock.recv(1) != b"t":
                raise OSError("it did not take over")
            sock.send(b"g")
        except OSError as exc:
            self._abandon_successor(f"the hand-over failed: {exc}")
            return False
        # the process serves from here on: this thread's copies of everything go
        for conn in conns:
            conn.closed = True
            conn.sock.close()
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        self._conns.clear()
        self._unauthed.clear()
        self._followers.clear()
        self._parked.clear()
        self._timers.clear()
        self._ready.clear()
        self._state = KVState()
        sock.close()
        self._successor = None
        self._handed_over = True
        self._handed.set()
        log.debug("store server on port %d: its own process (pid %s) serves now", self.port, self.pid)
        return True

    def _successor_up(self) -> bool:
        """What the process that is to take over says: whether it is up (ready to take over)."""
        sock = self._successor
        if sock is None:
            return False
        try:
            said = sock.recv(16)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            said = b""
        if said == b"r":
            return True
        failed = self._proc is not None  # (else it never started: said already)
        self._abandon_successor(("it failed to start" if not said else f"it said {said!r}") if failed else None)
        return False

    def _handover_state(self, conns: list[_Conn], listeners: int) -> bytes:
        """What ``_take_over`` needs besides the descriptors (``marshal``: plain data only)."""
        index = {c: i for i, c in enumerate(conns)}
        now = self._clock()
        waiters = []
        for key, parked in self._parked.items():  # (in order: a queue's poppers stay in line)
            for w in parked:
                if not w.done and w.conn in index:
                    left = None if w.deadline is None else max(0.0, w.deadline - now)
                    waiters.append((index[w.conn], int(w.op), w.keys, w.timeout, left, key))
        state = self._state
        return marshal.dumps({
            "listeners": listeners,
            "data": state.data,
            "queues": {k: list(q) for k, q in state.queues.items()},
            "conns": [
                (c.addr, c.kind, c.authed, c.decoder.max_frame,
                 (c.decoder if c.queries is None else c.queries).unread(), bytes(c.out), c.nonce,
                 None if c.decoder.seal is None else c.decoder.seal.state(),
                 None if c.seal is None else c.seal.state(),
                 self._followers.get(c), c.follower)
                for c in conns
            ],
            "waiters": waiters,
        })

    def _abandon_successor(self, why: str | None) -> None:
        """The process will not take over (``why``; None: not needed): it goes, this thread
        serves on."""
        sock, self._successor = self._successor, None
        if sock is not None:
            fd = sock.fileno()
            if self._ep is not None and self._fdmap.pop(fd, None) is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._ep.unregister(fd)
            sock.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(_HANDOVER_STEP)
        if why is not None:
            log.warning("store server on port %d: its own process does not serve (%s): serving "
                        "from a thread of this process", self.port, why)
        self._handed.set()

    @classmethod
    def _take_over(cls, sock: socket.socket, cfg: dict[str, object]) -> StoreServer | None:
        """In the server's own process: receive what ``_hand_over`` sends and make the server
        that serves it, not serving yet (None: the parent went away)."""
        ready = select.poll()
        ready.register(sock, select.POLLIN)
        parent = cfg["parent"]
        while not ready.poll(1000):  # (the parent's thread starts when it gets to it)
            if os.getppid() != parent:
                return None
        sock.settimeout(_HANDOVER_STEP)
        head = sock.recv(64)
        if not head:
            return None
        nfds, size = marshal.loads(head)
        fds: list[int] = []
        while len(fds) < nfds:
            _, got, _, _ = socket.recv_fds(sock, 1, _FDS_PER_MESSAGE)
            if not got:
                return None
            fds.extend(got)
        payload = bytearray()
        while len(payload) < size:
            piece = sock.recv(_HANDOVER_CHUNK)
            if not piece:
                return None
            payload += piece
        state = marshal.loads(payload)
        listeners = state["listeners"]
        secret = cfg["secret"]
        assert isinstance(secret, (str, type(None))) and isinstance(cfg["host"], str)
        server = cls(
            cfg["host"],
            secret=bytes.fromhex(secret) if secret else b"",
            max_frame=int(cfg["max_frame"]),  # type: ignore[call-overload]
            auth_timeout=float(cfg["auth_timeout"]),  # type: ignore[arg-type]
            listen_fd=fds[0],
            unix_fd=fds[1] if listeners > 1 else None,
            unix=listeners > 1,
            spin=float(cfg["spin"]),  # type: ignore[arg-type]
            torch_clients=bool(cfg["torch_clients"]),
        )
        server._install(state, fds[listeners:])
        return server

    def _install(self, state: dict[str, Any], fds: list[int]) -> None:
        """Take in the clients, waiters and data that ``_handover_state`` described."""
        now = self._clock()
        self._state.data = state["data"]
        self._state.queues = {k: deque(v) for k, v in state["queues"].items()}
        conns: list[_Conn] = []
        parent = f"pid {os.getppid()}"
        for fd, (addr, kind, authed, max_frame, unread, out, nonce, rseal, sseal, follows, follower) in zip(
            fds, state["conns"], strict=True
        ):
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            conn = _Conn(sock, parent if addr == "this process" else addr, authed, max_frame)
            conn.kind = kind
            conn.decoder.seal = None if rseal is None else auth.Seal.resume(rseal)
            conn.seal = None if sseal is None else auth.Seal.resume(sseal)
            if kind == _TORCH:
                conn.queries = QueryDecoder(self.max_frame)
                conn.queries.feed(unread)
            else:
                conn.decoder.feed(unread)
            conn.out += out
            conn.nonce = nonce
            conn.follower = follower
            if follows is not None:
                self._followers[conn] = follows
            if not authed:
                self._unauthed[conn] = None
                self._add_timer(now + self.auth_timeout, functools.partial(self._auth_expired, conn))
            self._adopted.append(conn)
            if out or unread:
                self._ready.append(conn)
            conns.append(conn)
        for i, op, keys, timeout, left, key in state["waiters"]:
            waiter = _Waiter(conns[i], op, keys, timeout, now)
            waiter.deadline = None if left is None else now + left
            conns[i].blocked = waiter
            self._park_on(waiter, key)
            if waiter.deadline is not None:
                self._add_timer(waiter.deadline, functools.partial(self._expire, waiter))
        if self._followers:
            self._add_timer(now + _BEAT_EVERY, self._beat_followers)

    def _serve_conn(self, conn: _Conn, mask: int) -> None:
        """What epoll says of a client's connection: read its requests, send its replies."""
        try:
            if mask & _READABLE:
                self._on_readable(conn)
            if mask & select.EPOLLOUT and not conn.closed:
                self._flush(conn)
        except Exception as exc:  # a bug must cost one connection, not the store
            log.exception("store server on port %d: error serving %s", self.port, conn.addr)
            self._close(conn, f"internal error: {exc!r}")

    def _serve_waiting(self) -> None:
        """Serve what the other clients sent meanwhile (the lock held, in the thread of a
        direct request): the loop's thread shares the interpreter lock with this one, which
        may hold it for milliseconds of its own work, and they would wait that long. The
        control pipe and the timers stay the loop's."""
        ep = self._ep
        if ep is None:
            return
        try:
            events = ep.poll(0)
        except (OSError, ValueError):  # (closed: the loop has ended)
            return
        self._serve_clients(events)

    def _serve_clients(self, events: list[tuple[int, int]]) -> None:
        """What epoll said of the clients and the listeners (the lock held, outside the loop's
        thread): the control pipe and the successor's connection stay the loop's."""
        fdmap = self._fdmap
        for fd, mask in events:
            data = fdmap.get(fd)
            if type(data) is _Conn:
                self._serve_conn(data, mask)
            elif isinstance(data, socket.socket) and data is not self._successor:
                self._accept(data)

    def serve_until(
        self, done: Callable[[], bool], wake: socket.socket, seconds: float, idle: Callable[[], None] | None = None
    ) -> None:
        """Serve the clients in the caller's thread until ``done()`` or for ``seconds``, while
        the loop's thread does not serve yet (``start`` not called, or its thread not running
        yet); returns at once where the loop serves. ``wake``: a socket that is readable once
        ``done()`` may be true (the caller's end of its connection): the loop's thread, once it
        runs, may be the one that answers. ``idle()`` is called the first time there is
        nothing to serve (the others are not there yet): a moment nobody waits for.

        For the master's own client whose request waits for the other clients (a rendezvous:
        ``TCPStore._call_frame``): this thread serves them while it would wait anyway, where
        the loop's thread would first have to start and then take turns with this one for the
        interpreter lock. On a busy host a new thread waits 1-3 ms for a core about every other
        time, and the other ranks' requests, their connections' greetings first, would wait
        with it. The timers (the clients' deadlines) run here only before ``start``, which
        adds the loop's own timer."""
        if self._looping:
            return
        lock = self._lock
        deadline = self._clock() + seconds
        with lock:
            if self._looping or self._stop_requested:
                return
            ep = self._start_loop(None)
            either = select.poll()  # (the clients' events, or the answer)
            either.register(ep.fileno(), select.POLLIN)
            either.register(wake, select.POLLIN)
        while not done() and not self._looping:
            if idle is not None and not either.poll(0):
                idle()  # (nothing to do: the others are not there yet)
                idle = None
            now = self._clock()
            if now >= deadline:
                return
            timeout = deadline - now
            started = self._control_r is not None
            if self._timers and not started:
                timeout = min(timeout, max(0.0, self._timers[0][0] - now))
            try:
                either.poll(math.ceil(timeout * 1000))
                events = ep.poll(0)
            except (OSError, ValueError):  # (closed: the server stopped)
                return
            with lock:
                if self._looping or self._stop_requested:
                    return  # (what it read is the loop's now: epoll reports it again)
                self._serve_clients(events)
                if not started:
                    self._run_timers()
                if self._ready:
                    self._drain_ready()

    # -- connections ---------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                delay = self._starvation.backoff(exc)
                if delay is None:
                    log.warning("store server on port %d: accept failed: %s", self.port, exc)
                    return
                # out of descriptors: free one (a stranger's), leave the listeners alone a while
                self._shed_unauthed()
                self._rest_listeners(delay)
                return
            self._starvation.accepted()
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                addr = f"{peer[0]}:{peer[1]}"
            else:
                addr = "unix"
                try:
                    check_unix_peer(sock, f"store server on port {self.port}")
                except (AuthenticationError, OSError) as exc:
                    self._failures.warn("%s", exc)
                    sock.close()
                    continue
            conn = _Conn(sock, addr, self.secret is None, self.max_frame)
            self._conns.add(conn)
            assert self._ep is not None
            self._ep.register(sock.fileno(), select.EPOLLIN)
            self._fdmap[sock.fileno()] = conn
            conn.nonce = auth.make_nonce()
            if not conn.authed:
                self._unauthed[conn] = None
                if len(self._unauthed) > _MAX_UNAUTHED:
                    self._shed_unauthed()
            if addr == "unix":
                self._greet(conn)
            else:  # (over TCP the client speaks first: tdist's or torch's, ``_sniff``)
                conn.kind = _SNIFFING
            if self.secret is not None:
                self._add_timer(self._clock() + self.auth_timeout, functools.partial(self._auth_expired, conn))

    def _greet(self, conn: _Conn) -> None:
        """Send a tdist client the server's HELLO."""
        hello = [
            encode_int(PROTOCOL_VERSION),
            b"\x01" if self.secret is not None else b"\x00",
            conn.nonce,
            encode_int(self.port),
        ]
        self._out(conn, encode_frame(Op.HELLO, hello))
        self._flush(conn)

    def _sniff(self, conn: _Conn) -> None:
        """The first bytes of a TCP connection (in its decoder) say whose client it is: tdist's
        (``OPENING``: greet it) or torch's (its ``VALIDATE`` and ``PING`` with another nonce:
        serve it in torch's protocol, if this server serves those); anything else is closed."""
        head = conn.decoder.unread()
        if len(head) < len(OPENING) and OPENING.startswith(head):
            return
        if head.startswith(OPENING):
            conn.kind = _TDIST
            conn.decoder = FrameDecoder(conn.decoder.max_frame)
            conn.decoder.feed(head[len(OPENING) :])
            self._greet(conn)
            if conn.decoder.buffered and not conn.closed:
                self._process(conn)
            return
        torch = is_torch_opening(head)
        if torch is None:
            return
        if not torch:
            self._close(conn, f"not a store client: it opened with {head[:8]!r}")
            return
        if not self.torch_clients:
            self._failures.warn(
                "store server on port %d: refused a client of torch's TCPStore from %s: this "
                "store requires the job's secret, which torch's client cannot prove (use "
                "tdist's TCPStore)", self.port, conn.addr,
            )
            self._close(conn, None)
            return
        conn.kind = _TORCH
        conn.authed = True  # (to its own keys: ``_torch_key``)
        self._unauthed.pop(conn, None)
        conn.decoder = FrameDecoder(0)
        conn.queries = QueryDecoder(self.max_frame)
        conn.queries.feed(head)
        self._serve_torch(conn)

    def _shed_unauthed(self) -> None:
        """Close the oldest connection that has not authenticated yet (if any)."""
        for conn in self._unauthed:
            self._close(conn, "shed: too many connections waiting to authenticate, or no descriptors left")
            return

    def _rest_listeners(self, seconds: float) -> None:
        """Stop watching the listeners for ``seconds`` (they stay readable while connections
        wait in their backlog, and would spin the loop)."""
        assert self._ep is not None
        for sock in self._listeners:
            with contextlib.suppress(OSError, ValueError):
                self._ep.modify(sock.fileno(), 0)
        self._add_timer(self._clock() + seconds, self._watch_listeners)

    def _watch_listeners(self) -> None:
        assert self._ep is not None
        for sock in self._listeners:
            with contextlib.suppress(OSError, ValueError):
                self._ep.modify(sock.fileno(), select.EPOLLIN)

    def _auth_expired(self, conn: _Conn) -> None:
        if not conn.closed and not conn.authed:
            self._close(conn, f"no authentication within {self.auth_timeout:g} s")

    def _close(self, conn: _Conn, reason: str | None) -> None:
        if conn.closed:
            return
        conn.closed = True
        if reason is not None:
            log.info("store server on port %d: closing client %s: %s", self.port, conn.addr, reason)
        waiter = conn.blocked
        if waiter is not None:
            waiter.done = True
            self._unpark(waiter)
            conn.blocked = None
            self._timer_died(waiter)
        self._conns.discard(conn)
        self._unauthed.pop(conn, None)
        if self._followers and (at := self._followers.pop(conn, None)) is not None:
            # (info: at a job's end its keeper leaves first; a node's keeper starts another)
            log.info("store server on port %d: its standby at %s is gone (%s)", self.port, at, reason)
        # its buffers go now, not when a timer that still names the connection fires
        conn.decoder = FrameDecoder(0)
        conn.out = bytearray()
        fd = conn.sock.fileno()
        if self._fdmap.get(fd) is conn and self._ep is not None:
            del self._fdmap[fd]
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(fd)
        conn.sock.close()

    def _on_readable(self, conn: _Conn) -> None:
        size = _RECV_SIZE
        if conn.decoder.buffered:  # the rest of a large frame: take it in larger pieces
            pending = conn.decoder.pending_length()
            if pending is not None:
                size = max(_RECV_SIZE, min(pending + 4 - conn.decoder.buffered, _RECV_MAX))
        try:
            data = conn.sock.recv(size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(conn, f"receive failed: {exc}")
            return
        if not data:
            self._close(conn, "client closed the connection" if conn.decoder.buffered == 0
                        else "client closed the connection in the middle of a request")
            return
        if conn.kind:  # (not a tdist client, or not known yet)
            queries = conn.queries
            if queries is not None and conn.blocked is None and not conn.paused:
                try:
                    query = queries.parse_whole(data)
                except RemoteProtocolError:
                    query = None  # (the general path reports it)
                if query is not None:  # the common case: exactly one query arrived
                    if self._torch_query_or_close(conn, query):
                        self._flush(conn)
                    return
            if queries is not None:
                queries.feed(data)
                if conn.blocked is not None and queries.buffered > _MAX_BACKLOG_FRAMES * self.max_frame:
                    self._close(conn, "too many bytes sent behind a blocked request")
                    return
            else:
                conn.decoder.feed(data)
            self._process(conn)
            return
        if conn.blocked is None and conn.authed and not conn.paused:
            if len(data) > 4 and data[4] == _SET_QUIET and not conn.decoder.buffered:
                # a burst of ``set``s (they wait for no reply): applied straight from the bytes
                pos = self._apply_sets(conn, data)
                if pos == len(data) or conn.closed:
                    self._burst = True
                    return
                data = data[pos:]
            try:
                frame = conn.decoder.parse_whole(data)
            except RemoteProtocolError:
                frame = None  # the slow path below reports it
            if frame is not None:  # the common case: exactly one request arrived
                self._dispatch_authed(conn, frame)
                out = conn.out
                if out and conn.blocked is None and not conn.closed:
                    # _flush's common case inlined (the reply fits the socket: 1-2% of the
                    # 8-client throughput); anything else goes through _flush itself
                    try:
                        sent = conn.sock.send(out)
                    except OSError:
                        sent = 0
                    if sent == len(out) and not conn.writing:
                        out.clear()
                    else:
                        del out[:sent]
                        self._flush(conn)
                return
        conn.decoder.feed(data)
        if conn.blocked is not None and conn.decoder.buffered > _MAX_BACKLOG_FRAMES * self.max_frame:
            self._close(conn, "too many bytes sent behind a blocked request")
            return
        self._process(conn)

    def _apply_sets(self, conn: _Conn, data: bytes) -> int:
        """Apply the well-formed SET_QUIET frames at the head of ``data`` (nothing buffered
        before it), as ``_op_set_quiet`` would, without making a ``Frame`` of each: a client's
        burst of ``set``s costs the server a quarter of the general path's time. Returns where
        the run ends: another request, a partial frame, or one that the general path must judge
        (and answer) is left there."""
        decoder = conn.decoder
        seal = decoder.seal
        mac = 0 if seal is None else auth.TAG_SIZE
        limit = decoder.max_frame
        table = self._state.data
        head, value_len = HEAD_FIELD.unpack_from, FIELD_LEN.unpack_from
        size = len(data)
        pos = 0
        while pos + 17 <= size:
            body_len, code, count, key_len = head(data, pos)
            end = pos + 4 + body_len
            key_end = pos + 13 + key_len
            if (code != _SET_QUIET or count != 2 or body_len > limit or end + mac > size
                    or key_end + 4 > end or key_end + 4 + value_len(data, key_end)[0] != end):
                break
            try:
                key = data[pos + 13 : key_end].decode()
            except UnicodeDecodeError:
                break
            if seal is not None and not seal.check_trailed(data, pos, end):
                self._refuse(conn, ErrorKind.PROTOCOL, RemoteProtocolError(decoder.TAMPERED))
                return size
            table[key] = data[key_end + 4 : end]
            if self._followers:
                self._replicate(key)
            if self._parked:
                self._changed(key)
            pos = end + mac
        return pos

    def _refuse(self, conn: _Conn, kind: bytes, exc: Exception) -> None:
        """Answer a request that breaks the protocol with its error, then close the connection."""
        self._reply_error(conn, kind, str(exc))
        self._flush(conn)
        self._close(conn, str(exc))

    def _process(self, conn: _Conn) -> None:
        if conn.kind:
            if conn.kind == _TORCH:
                self._serve_torch(conn)
            else:
                self._sniff(conn)
            return
        while not conn.closed and conn.blocked is None:
            if len(conn.out) >= _OUT_PAUSE:  # replies pile up: the next request waits for room
                self._flush(conn)
                if conn.closed or conn.paused:
                    return
                continue
            try:
                frame = conn.decoder.next_frame()
            except RemoteProtocolError as exc:
                kind = ErrorKind.TOO_LARGE if "exceeds the limit" in str(exc) else ErrorKind.PROTOCOL
                if not conn.authed and kind == ErrorKind.TOO_LARGE:
                    kind = ErrorKind.AUTH
                    exc = RemoteProtocolError("the first frame must be a small AUTH frame")
                self._refuse(conn, kind, exc)
                return
            if frame is None:
                break
            self._dispatch(conn, frame)
        if not conn.closed:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        if out:
            try:
                sent = conn.sock.send(out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._close(conn, f"send failed: {exc}")
                return
            if sent == len(out):
                out.clear()
            else:
                del out[:sent]
        # (also with nothing left to send: a connection that waited for room stops waiting)
        want_write = bool(out)
        # a client that leaves its replies unread is read no further until it takes them in
        paused = len(out) >= _OUT_PAUSE
        if want_write != conn.writing or paused != conn.paused:
            resumed = conn.paused and not paused
            conn.writing = want_write
            conn.paused = paused
            events = (0 if paused else select.EPOLLIN) | (select.EPOLLOUT if want_write else 0)
            assert self._ep is not None
            self._ep.modify(conn.sock.fileno(), events)
            if resumed:  # the requests that it sent meanwhile, buffered already
                self._ready.append(conn)

    def _drain_ready(self) -> None:
        while self._ready:
            conn = self._ready.popleft()
            if not conn.closed:
                try:
                    self._process(conn)
                except Exception as exc:
                    log.exception("store server on port %d: error serving %s", self.port, conn.addr)
                    self._close(conn, f"internal error: {exc!r}")

    # -- requests ------------------------------------------------------------------------------
    def _dispatch(self, conn: _Conn, frame: Frame) -> None:
        if not conn.authed:
            self._authenticate(conn, frame)
            return
        self._dispatch_authed(conn, frame)

    def _dispatch_authed(self, conn: _Conn, frame: Frame) -> None:
        code, fields = frame
        handler = self._handlers.get(code)
        if handler is None and code == _SET_QUIET:
            try:
                self._op_set_quiet(fields)
            except (RemoteProtocolError, ValueError) as exc:
                self._out(conn, encode_frame(Status.ASYNC_ERROR, [ErrorKind.PROTOCOL, f"malformed SET: {exc}".encode()]))
            return
        if handler is None:
            self._reply_error(conn, ErrorKind.PROTOCOL, f"unknown store command {code}")
            log.info("store server on port %d: client %s sent unknown command %d",
                     self.port, conn.addr, code)
            return
        try:
            handler(conn, fields)
        except StoreValueError as exc:
            self._reply_error(conn, ErrorKind.VALUE, str(exc))
        except (RemoteProtocolError, IndexError, ValueError) as exc:
            msg = str(exc) if isinstance(exc, RemoteProtocolError) else (
                f"malformed {Op(code).name} request: {exc}")
            self._reply_error(conn, ErrorKind.PROTOCOL, msg)
            log.info("store server on port %d: client %s: %s", self.port, conn.addr, msg)

    def _authenticate(self, conn: _Conn, frame: Frame) -> None:
        assert self.secret is not None
        code, fields = frame
        ok = (
            code == Op.AUTH
            and len(fields) == 2
            and len(fields[0]) == auth.NONCE_SIZE
            and auth.verify(auth.client_proof(self.secret, conn.nonce, fields[0]), fields[1])
        )
        if not ok:
            self._reply_error(conn, ErrorKind.AUTH, "authentication failed: wrong or missing secret")
            self._flush(conn)
            self._failures.warn("store server on port %d: client %s failed authentication", self.port, conn.addr)
            self._close(conn, None)
            return
        conn.authed = True
        self._unauthed.pop(conn, None)
        conn.decoder.max_frame = self.max_frame
        self._out(conn, encode_frame(Op.AUTH_OK, [auth.server_proof(self.secret, conn.nonce, fields[0])]))
        # every frame from now on, both ways, carries the session's tag
        c2s, s2c = auth.session_keys(self.secret, conn.nonce, fields[0])
        conn.seal = auth.Seal(s2c)
        conn.decoder.seal = auth.Seal(c2s)

    @staticmethod
    def _out(conn: _Conn, frame: bytes) -> None:
        """Queue one frame for ``conn`` (tagged once the session is authenticated)."""
        conn.out += frame
        if conn.seal is not None:
            conn.out += conn.seal.tag(frame)

    def _reply(self, conn: _Conn, fields: list[bytes] | tuple[bytes, ...] = ()) -> None:
        self._out(conn, encode_frame(Status.OK, fields))

    def _reply_error(self, conn: _Conn, kind: bytes, message: str, extra: list[bytes] | None = None) -> None:
        self._out(conn, encode_frame(Status.ERROR, [kind, message.encode(), *(extra or [])]))

    @staticmethod
    def _nargs(fields: list[bytes], n: int, op: str) -> None:
        if len(fields) != n:
            raise RemoteProtocolError(f"{op} takes {n} fields, got {len(fields)}")

    def _op_set(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 2, "SET")
        key = _decode_key(f[0])
        self._state.set(key, f[1])
        self._reply(conn)
        if self._followers:
            self._replicate(key)
        self._changed(key)

    def _op_set_quiet(self, f: list[bytes]) -> None:
        if len(f) != 2:
            self._nargs(f, 2, "SET")
        key = _decode_key(f[0])
        self._state.data[key] = f[1]
        if self._followers:
            self._replicate(key)
        if self._parked:
            self._changed(key)

    def _op_get(self, conn: _Conn, f: list[bytes]) -> None:
        if len(f) != 2:
            self._nargs(f, 2, "GET")
        key = _decode_key(f[0])
        value = self._state.data.get(key)
        if value is not None:
            self._out(conn, encode_frame(Status.OK, (value,)))
        else:
            self._park(conn, Op.GET, [key], _timeout_arg(f[1]))

    def _op_add(self, conn: _Conn, f: list[bytes]) -> None:
        if len(f) != 2:
            self._nargs(f, 2, "ADD")
        try:
            key = f[0].decode()
        except UnicodeDecodeError:
            key = _decode_key(f[0])  # raises the clear error
        amount = f[1]
        value = self._state.add(key, _INT.unpack(amount)[0] if len(amount) == 8 else decode_int(amount))
        try:
            self._out(conn, _OK_INT.pack(_OK_INT.size - 4, Status.OK, 1, 8, value))
        except struct.error:
            self._out(conn, encode_frame(Status.OK, (encode_int(value),)))  # raises the clear error
        if self._followers:
            self._replicate(key)
        if self._parked:
            self._changed(key)

    def _op_compare_set(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 3, "COMPARE_SET")
        key = _decode_key(f[0])
        value, changed = self._state.compare_set(key, f[1], f[2])
        self._reply(conn, (value,))
        if changed:
            if self._followers:
                self._replicate(key)
            self._changed(key)

    def _op_wait(self, conn: _Conn, f: list[bytes]) -> None:
        if not f:
            raise RemoteProtocolError("WAIT needs a timeout field")
        keys = [_decode_key(k) for k in f[1:]]
        if not self._state.missing(keys):
            self._reply(conn)
        else:
            self._park(conn, Op.WAIT, keys, _timeout_arg(f[0]))

    def _op_check(self, conn: _Conn, f: list[bytes]) -> None:
        present = self._state.present
        if len(f) == 1:
            ok = present(_decode_key(f[0]))
        else:
            ok = all(present(_decode_key(k)) for k in f)
        self._out(conn, _CHECK_TRUE if ok else _CHECK_FALSE)

    def _op_delete(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 1, "DELETE")
        key = _decode_key(f[0])
        deleted = self._state.delete(key)
        self._reply(conn, (b"\x01" if deleted else b"\x00",))
        if deleted and self._followers:
            self._replicate(key)

    def _op_num_keys(self, conn: _Conn, f: list[bytes]) -> None:
        self._reply(conn, (encode_int(self._state.num_keys()),))

    def _op_multi_get(self, conn: _Conn, f: list[bytes]) -> None:
        if not f:
            raise RemoteProtocolError("MULTI_GET needs a timeout field")
        keys = [_decode_key(k) for k in f[1:]]
        if not self._state.missing_values(keys):
            data = self._state.data
            self._reply(conn, [data[k] for k in keys])
        else:
            self._park(conn, Op.MULTI_GET, keys, _timeout_arg(f[0]))

    def _op_multi_set(self, conn: _Conn, f: list[bytes]) -> None:
        if len(f) % 2:
            raise RemoteProtocolError("MULTI_SET takes key/value pairs")
        keys = [_decode_key(k) for k in f[0::2]]
        for key, value in zip(keys, f[1::2], strict=True):
            self._state.set(key, value)
        self._reply(conn)
        for key in keys:
            if self._followers:
                self._replicate(key)
            self._changed(key)

    def _op_append(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 2, "APPEND")
        key = _decode_key(f[0])
        self._state.append(key, f[1])
        self._reply(conn)
        if self._followers:
            self._replicate(key)
        self._changed(key)

    def _op_list_keys(self, conn: _Conn, f: list[bytes]) -> None:
        self._reply(conn, [k.encode() for k in self._state.list_keys()])

    def _op_queue_push(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 2, "QUEUE_PUSH")
        key = _decode_key(f[0])
        self._state.queue_push(key, f[1])
        self._reply(conn)
        if self._followers:
            self._replicate(key)
        self._changed(key, pushed=True)

    def _op_queue_pop(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 2, "QUEUE_POP")
        key = _decode_key(f[0])
        value = self._state.queue_pop(key)
        if value is not None:
            self._reply(conn, (value,))
            if self._followers:
                self._replicate(key)
            return
        timeout_ms = decode_int(f[1])
        if timeout_ms == -2:  # non-blocking
            self._reply_error(conn, ErrorKind.QUEUE_EMPTY, f"queue {key!r} is empty")
            return
        self._park(conn, Op.QUEUE_POP, [key], None if timeout_ms < 0 else timeout_ms / 1000.0)

    def _op_queue_len(self, conn: _Conn, f: list[bytes]) -> None:
        self._nargs(f, 1, "QUEUE_LEN")
        self._reply(conn, (encode_int(self._state.queue_len(_decode_key(f[0]))),))

    def _op_ping(self, conn: _Conn, f: list[bytes]) -> None:
        self._reply(conn, f)

    # -- torch's clients (``_torch_wire``) --------------------------------------------------------
    def _serve_torch(self, conn: _Conn) -> None:
        """Serve the queries a client of torch's sent, in order. While its ``WAIT`` waits,
        only a ``CANCEL_WAIT`` is taken (torch's client sends nothing else meanwhile); the rest
        wait their turn. A query that breaks the protocol, or names a key out of its reach,
        closes the connection (torch's protocol has no error reply: its client reports the
        lost connection)."""
        queries = conn.queries
        assert queries is not None
        while not conn.closed:
            if len(conn.out) >= _OUT_PAUSE:
                self._flush(conn)
                if conn.closed or conn.paused:
                    return
                continue
            if conn.blocked is not None and queries.peek() != Query.CANCEL_WAIT:
                break
            try:
                query = queries.next_query()
            except RemoteProtocolError as exc:
                self._torch_refuse(conn, exc)
                return
            if query is None:
                break
            if not self._torch_query_or_close(conn, query):
                return
        if not conn.closed:
            self._flush(conn)

    def _torch_query_or_close(self, conn: _Conn, query: tuple[int, list[bytes | int]]) -> bool:
        """Serve one query of a client of torch's; False: it broke the protocol, and its
        connection is closed."""
        try:
            self._torch_query(conn, *query)
        except (RemoteProtocolError, StoreValueError) as exc:
            self._torch_refuse(conn, exc)
            return False
        return True

    def _torch_refuse(self, conn: _Conn, exc: Exception) -> None:
        self._failures.warn("store server on port %d: torch client %s: %s", self.port, conn.addr, exc)
        self._flush(conn)
        self._close(conn, None)

    @staticmethod
    def _torch_key(raw: bytes | int) -> str:
        """The key a client of torch's names, in the namespace of torch's clients
        (``TORCH_KEYS``): tdist's own keys are out of its reach, whatever their names. (Its
        client's ``init/``, the count of clients that connected, is the server's own.)"""
        assert isinstance(raw, bytes)
        key = _decode_key(raw)
        return key if key == "init/" else TORCH_KEYS + key

    def _torch_names(self) -> list[bytes]:
        """The keys a client of torch's can name, as torch's server keeps them (its client
        strips the ``/`` it put before each): ``init/`` and those under ``TORCH_KEYS``."""
        return [
            (key if key == "init/" else key[len(TORCH_KEYS):]).encode()
            for key in self._state.data if key.startswith(TORCH_KEYS) or key == "init/"
        ]

    def _torch_query(self, conn: _Conn, kind: int, args: list[bytes | int]) -> None:
        state, out, key_of = self._state, conn.out, self._torch_key
        if kind == Query.PING:
            out += Reply.nonce(int(args[0]))
        elif kind in (Query.GET, Query.QUEUE_LEN, Query.QUEUE_POP):
            key = key_of(args[0])
            if kind == Query.GET:  # (torch's client waits first: a missing key reads empty)
                out += Reply.value(state.data.get(key, b""))
            elif kind == Query.QUEUE_LEN:
                out += Reply.number(state.queue_len(key))
            else:  # (never waits: torch's client waits for the queue first)
                out += Reply.number(state.queue_len(key))
                value = state.queue_pop(key)
                if value is not None:
                    out += Reply.value(value)
                    self._changes((key,), changed=False)
        elif kind in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
            keys = [key_of(k) for k in args]
            if kind == Query.CHECK:
                out += Reply.READY if not state.missing(keys) else Reply.NOT_READY
            elif kind == Query.MULTI_GET:
                for key in keys:
                    out += Reply.value(state.data.get(key, b""))
            elif not state.missing(keys):
                out += Reply.STOP_WAITING
            else:  # (no deadline here: torch's client gives up by CANCEL_WAIT)
                self._park(conn, Op.WAIT, keys, None)
        elif kind == Query.CANCEL_WAIT:
            waiter = conn.blocked
            if waiter is not None:
                waiter.done = True
                self._unpark(waiter)
                conn.blocked = None
            out += Reply.WAIT_CANCELED
        elif kind in (Query.SET, Query.APPEND, Query.QUEUE_PUSH):
            key = key_of(args[0])
            assert isinstance(args[1], bytes)
            if kind == Query.SET:
                state.set(key, args[1])
            elif kind == Query.APPEND:
                state.append(key, args[1])
            else:
                state.queue_push(key, args[1])
            self._changes((key,), pushed=kind == Query.QUEUE_PUSH)
        elif kind == Query.MULTI_SET:
            keys = [key_of(k) for k in args[0::2]]
            for key, item in zip(keys, args[1::2], strict=True):
                assert isinstance(item, bytes)
                state.set(key, item)
            self._changes(keys)
        elif kind == Query.ADD:
            key = key_of(args[0])
            out += Reply.number(state.add(key, int(args[1])))
            self._changes((key,))
        elif kind == Query.COMPARE_SET:
            key = key_of(args[0])
            assert isinstance(args[1], bytes) and isinstance(args[2], bytes)
            value, changed = state.compare_set(key, args[1], args[2])
            out += Reply.value(value)
            if changed:
                self._changes((key,))
        elif kind == Query.DELETE_KEY:
            key = key_of(args[0])
            deleted = state.delete(key)
            out += Reply.number(int(deleted))
            if deleted:
                self._changes((key,), changed=False)
        elif kind == Query.GETNUMKEYS:
            out += Reply.number(len(self._torch_names()))
        elif kind == Query.LIST_KEYS:
            out += Reply.values(self._torch_names())
        elif args[0] != _TORCH_MAGIC:  # VALIDATE (again)
            raise RemoteProtocolError("VALIDATE with the wrong magic number")

    def _changes(self, keys: list[str] | tuple[str, ...], *, changed: bool = True, pushed: bool = False) -> None:
        """``keys`` changed: to the standby, then to the requests waiting on them (not
        ``changed``: only the standby, for a key deleted or a queue popped)."""
        for key in keys:
            if self._followers:
                self._replicate(key)
            if changed and self._parked:
                self._changed(key, pushed=pushed)

    # -- standbys (``_replica``) ----------------------------------------------------------------
    def _op_follow(self, conn: _Conn, f: list[bytes]) -> None:
        """A standby asks for the data and every later change; it serves at ``f[0]`` (host:port)
        once this server is lost. One standby at a time: two would both take over. The reply
        says whether this server serves torch's clients, which the standby then serves too."""
        self._nargs(f, 1, "FOLLOW")
        address = f[0].decode(errors="replace")
        for other, at in self._followers.items():
            if not other.closed:
                self._reply_error(conn, ErrorKind.VALUE, f"the store already has a standby (at {at})")
                return
        if not self._followers:
            self._add_timer(self._clock() + _BEAT_EVERY, self._beat_followers)
        self._followers[conn] = address
        self._reply(conn, [b"\x01" if self.torch_clients else b"\x00"])  # (the standby serves them as this does)
        state = self._state
        for key in {**dict.fromkeys(state.data), **dict.fromkeys(state.queues)}:
            self._out(conn, self._key_frame(key))
        self._out(conn, encode_frame(Op.REPL_SYNCED, ()))
        conn.follower = True
        log.info("store server on port %d: a standby at %s follows it", self.port, address)

    def _op_replicas(self, conn: _Conn, f: list[bytes]) -> None:
        self._reply(conn, [at.encode() for at in self._followers.values()])

    def _key_frame(self, key: str) -> bytes:
        state = self._state
        value = state.data.get(key)
        queue = state.queues.get(key, ())
        return encode_frame(Op.REPL_KEY, [key.encode(), b"" if value is None else b"\x01", value or b"", *queue])

    def _replicate(self, key: str) -> None:
        """Send ``key``'s new state to the standby, before the reply to the change leaves."""
        frame = self._key_frame(key)
        for conn in list(self._followers):
            self._out(conn, frame)
            self._flush(conn)
            if len(conn.out) > _FOLLOWER_BACKLOG and not conn.closed:
                self._close(conn, "the standby does not keep up")

    def _beat_followers(self) -> None:
        if not self._followers:
            return
        frame = encode_frame(Op.REPL_BEAT, ())
        for conn in list(self._followers):
            self._out(conn, frame)
            self._flush(conn)
        self._add_timer(self._clock() + _BEAT_EVERY, self._beat_followers)

    # -- waiting -------------------------------------------------------------------------------
    def _park(self, conn: _Conn, op: int, keys: list[str], timeout: float | None) -> None:
        now = self._clock()
        waiter = _Waiter(conn, op, keys, timeout, now)
        conn.blocked = waiter
        if op == Op.QUEUE_POP:
            self._park_on(waiter, keys[0])
        else:
            self._park_on(waiter, self._missing(waiter)[0])
        if waiter.deadline is not None:
            self._add_timer(waiter.deadline, functools.partial(self._expire, waiter))

    def _missing(self, waiter: _Waiter) -> list[str]:
        if waiter.op == Op.WAIT:
            return self._state.missing(waiter.keys)
        return self._state.missing_values(waiter.keys)

    def _park_on(self, waiter: _Waiter, key: str) -> None:
        waiter.parked_on = key
        self._parked.setdefault(key, []).append(waiter)

    def _unpark(self, waiter: _Waiter) -> None:
        key = waiter.parked_on
        if key is None:
            return
        waiter.parked_on = None
        lst = self._parked.get(key)
        if lst is not None:
            with contextlib.suppress(ValueError):
                lst.remove(waiter)
            if not lst:
                del self._parked[key]

    def _changed(self, key: str, pushed: bool = False) -> None:
        """``key`` changed: answer the requests waiting on it that can be now. A push to its
        queue (``pushed``) wakes one of torch's clients' ``WAIT``s, as torch's server does
        (each would pop next: the others would find the queue empty)."""
        waiters = self._parked.pop(key, None)
        if not waiters:
            return
        state = self._state
        torch_woken = False
        for i, waiter in enumerate(waiters):
            if waiter.done:
                continue
            waiter.parked_on = None
            if waiter.op == Op.QUEUE_POP:
                value = state.queue_pop(key)
                if value is None:
                    # the queue ran dry: the rest wait on, in their order
                    rest = [w for w in waiters[i:] if not w.done]
                    for w in rest:
                        w.parked_on = key
                    if rest:
                        self._parked.setdefault(key, [])[:0] = rest
                    return
                if self._followers:
                    self._replicate(key)
                self._finish(waiter, (value,))
                continue
            missing = self._missing(waiter)
            if missing:
                self._park_on(waiter, missing[0])
                continue
            if pushed and waiter.conn.kind == _TORCH:
                if torch_woken:
                    self._park_on(waiter, key)
                    continue
                torch_woken = True
            if waiter.op == Op.WAIT:
                self._finish(waiter, ())
            else:
                data = state.data
                self._finish(waiter, [data[k] for k in waiter.keys])

    def _finish(self, waiter: _Waiter, fields: list[bytes] | tuple[bytes, ...]) -> None:
        waiter.done = True
        self._timer_died(waiter)
        conn = waiter.conn
        conn.blocked = None
        if conn.closed:
            return
        if conn.kind == _TORCH:
            conn.out += Reply.STOP_WAITING
        else:
            self._reply(conn, fields)
        self._ready.append(conn)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        self._unpark(waiter)
        waiter.done = True
        conn = waiter.conn
        conn.blocked = None
        if conn.closed:
            return
        missing = waiter.keys if waiter.op == Op.QUEUE_POP else self._missing(waiter)
        assert waiter.timeout is not None
        self._reply_error(
            conn,
            ErrorKind.TIMEOUT,
            f"timed out after {waiter.timeout * 1000:.0f} ms",
            [encode_int(round(waiter.timeout * 1000)), *(k.encode() for k in missing)],
        )
        self._ready.append(conn)

    def _add_timer(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), callback))

    def _timer_died(self, waiter: _Waiter) -> None:
        """``waiter`` is over before its deadline: its timer is dead weight in the heap until
        then (half an hour, by default; for ever, for an absurd timeout). Once dead timers are
        most of the heap, it is rebuilt without them."""
        if waiter.deadline is None:
            return
        self._dead_timers += 1
        if self._dead_timers > 64 and 2 * self._dead_timers > len(self._timers):
            # (in place: ``_run_timers`` may be iterating over this very list)
            self._timers[:] = [t for t in self._timers if not self._is_dead(t[2])]
            heapq.heapify(self._timers)
            self._dead_timers = 0

    def _is_dead(self, callback: Callable[[], None]) -> bool:
        return (
            isinstance(callback, functools.partial)
            and callback.func == self._expire
            and callback.args[0].done
        )

    def _run_timers(self) -> None:
        timers = self._timers
        if not timers:
            return
        now = self._clock()
        while timers and timers[0][0] <= now:
            _, _, callback = heapq.heappop(timers)
            if self._is_dead(callback):
                self._dead_timers = max(0, self._dead_timers - 1)
                continue
            callback()


# What the store server's own interpreter runs: tdist's errors without torch (``_process``),
# the server module alone, then ``_serve_spawned`` with the descriptor of its configuration.
_BOOT = (
    "import sys; sys.path.insert(0, {root!r})\n"
    "from tdist._core import _process; _process.TORCHLESS = True\n"
    "from tdist.store import _server; _server._serve_spawned(int(sys.argv[1]))"
)


def _serve_spawned(boot_fd: int) -> None:
    """The store server process (see ``StoreServer.start``): read the configuration its parent
    wrote, take over from the thread that serves meanwhile (``_take_over``), serve until the
    parent closes the control pipe or dies."""
    global _OPEN_WARNED
    def read_exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(boot_fd, n - len(data))
            if not chunk:
                os._exit(1)  # (its parent failed before it wrote it all)
            data += chunk
        return data

    cfg = json.loads(read_exactly(struct.unpack("<I", read_exactly(4))[0]))
    os.close(boot_fd)
    _process.close_other_fds([cfg["handover"], cfg["control"], cfg["status"]])
    sys.path.extend(p for p in cfg["path"] if p not in sys.path)
    # A ^C, and usually a SIGTERM, come to the whole process group at once (a terminal;
    # ``timeout``, ``kill -TERM -PGID``, Slurm's ``scancel``): they are for the parent, which
    # stops this server as it ends (or, gone, is missed within a second), and whose clean-up
    # (leaving a rendezvous, its workers' last requests) still needs the store
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Every rank waits on the store: when the cores are oversubscribed, it should get the CPU
    # first (lowering the nice value needs privileges; without them this is a no-op).
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, int(os.environ.get("TDIST_STORE_NICE", "-5")))
    _OPEN_WARNED = True  # (the parent said it already)
    code = 0
    try:
        handover = socket.socket(fileno=cfg["handover"])
        try:
            handover.send(b"r")
            server = StoreServer._take_over(handover, cfg)
            if server is not None:
                handover.send(b"t")  # (holding everything, serving nothing yet)
                if handover.recv(1) != b"g":
                    server = None
        except OSError:  # the parent stopped the store, or serves on from its thread
            server = None
        if server is None:
            os._exit(0)
        handover.close()
        server._status_w = cfg["status"]
        server._serve_and_close(cfg["control"], parent_pid=cfg["parent"])
    except BaseException:
        log.exception("store server process for port %s failed", cfg.get("host"))
        code = 1
    finally:
        os._exit(code)
