"""``TCPStore``: the client, and the server it starts when it is the master.

A client keeps one connection and makes one request at a time on it (a lock serializes threads;
``clone()`` gives a thread its own connection). On the server's host it connects over the
server's abstract Unix socket, which is several times faster than loopback TCP.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import ipaddress
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

from .._core import auth, patience, spin
from .._core.errors import (
    AuthenticationError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
    StoreTimeoutError,
    StoreValueError,
    fresh,
)
from .._core.net import literal_loopback
from .._core.peercred import check_unix_peer
from ._api import DEFAULT_TIMEOUT, Store, as_bytes, check_key, key_list
from ._protocol import (
    DEFAULT_MAX_FRAME,
    HEAD_FIELD,
    OPENING,
    OPENING_ECHO,
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
from ._server import StoreServer, _Conn, port_taken, unix_address
from ._state import check_amount

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._foreign import ForeignStore

__all__ = ["TCPStore", "TorchServerError"]

log = logging.getLogger(__name__)

_INIT_KEY = "init/"
# how long past a blocking request's own timeout the client waits for the server's answer
_GRACE = 5.0
_CLOSE_PING = 5.0  # the most seconds close() waits for the server to confirm the last sets
_ATTEMPT = 5.0  # the most seconds one attempt to connect to the store may take
_WILDCARD = ("", "0.0.0.0", "::", "*")
_POLL_MAX = 86400.0  # seconds: the longest one poll() waits (a wait of timedelta.max polls again)


def _the_agents_port(port: int, exc: DistNetworkError) -> bool:
    """Whether a master could not bind ``port`` because the elastic agent's store holds it:
    ``TORCHELASTIC_USE_AGENT_STORE`` is set (torchrun's and ``tdist run``'s workers; "1" or
    "true", any case, as torch reads it) and ``port`` is ``MASTER_PORT``, which is taken."""
    return (
        port != 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() in ("1", "true")
        and os.environ.get("MASTER_PORT", "").strip() == str(port)
        and port_taken(exc)
    )

_INT_FIELD = struct.Struct("<Iq")  # a length-prefixed integer field
_INT = struct.Struct("<q")
_SET_QUIET = int(Op.SET_QUIET)

# the pid, refreshed in a forked child (os.getpid() is a system call on every use)
_current_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _current_pid.__setitem__(0, os.getpid()))

_thread_servers: set[int] = set()  # ids of servers running in a thread of this process
_tenants_lock = threading.Lock()
_tenants: dict[tuple[str, int], tuple[StoreServer, int]] = {}
# multi-tenant servers whose last store was closed: serving on until idle (``StoreServer.retire``)
_retired: dict[tuple[str, int], StoreServer] = {}
_EXIT_DRAIN = 2.0  # the most seconds an exiting process waits for its retired servers' clients


_drained_in: int | None = None  # the process whose end drained its retired servers already


@atexit.register
def _drain_retired_servers() -> None:
    """At exit, a group's store served from a thread here answers the group's other ranks until
    they have left it too (their ``destroy_process_group`` releases their rank through it), for
    at most ``_EXIT_DRAIN`` seconds in all; else they would wait for this process to be gone.
    Once per process: it runs as an ``atexit`` handler and as a ``multiprocessing`` finalizer
    (below), and a process that ends normally runs both."""
    global _drained_in
    if _drained_in == os.getpid():
        return
    _drained_in = os.getpid()
    deadline = time.monotonic() + _EXIT_DRAIN
    for server in list(_retired.values()):
        if id(server) in _thread_servers:
            server.wait_idle(max(0.0, deadline - time.monotonic()))


_drain_registered_in: int | None = None  # the process that registered the drain below


def _drain_also_in_multiprocessing_children() -> None:
    """Run ``_drain_retired_servers`` at the end of a process that ``multiprocessing`` started,
    too: such a process ends with ``os._exit`` once its target returns (``fork`` and
    ``forkserver``), which runs ``multiprocessing``'s finalizers but no ``atexit`` handler."""
    global _drain_registered_in
    if _drain_registered_in == os.getpid():
        return
    _drain_registered_in = os.getpid()
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _drain_retired_servers, exitpriority=100)


@functools.lru_cache(maxsize=64)
def _is_local(host: str) -> bool:
    """Whether ``host`` names an address of this machine (in this network namespace)."""
    if host in _WILDCARD or literal_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
                return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _client_spin() -> float:
    """Seconds a client polls for a reply before sleeping (``_core.spin``); none while this
    process serves a store from a thread, which the spinning caller would starve of the GIL."""
    if _thread_servers:
        return 0.0
    return spin.SPIN


# where a master started in this context serves (``serving_in_a_thread``); None: the default
_mode_here: contextvars.ContextVar[str | None] = contextvars.ContextVar("tdist_store_server_mode", default=None)


def _server_mode() -> str:
    mode = os.environ.get("TDIST_STORE_SERVER") or _mode_here.get() or "process"
    return mode if mode in ("process", "thread") else "process"


@contextlib.contextmanager
def serving_in_a_thread() -> Iterator[None]:
    """Masters started inside serve from a thread of this process, not a process of their
    own (``TDIST_STORE_SERVER`` set by the user wins). For stores used only to form a group:
    a thread costs nothing to start, a process tens of milliseconds."""
    token = _mode_here.set("thread")
    try:
        yield
    finally:
        _mode_here.reset(token)


class TorchServerError(DistNetworkError):
    """tdist's store client reached torch's own ``TCPStore`` server (which speaks only torch's
    protocol): said at once, not retried."""


class TCPStore(Store):
    """A store served over TCP by the master (``is_master=True``) and reached by clients.

    Args:
        host_name: the server's host name or address. The master listens on every address
            of its host, as torch's does (another host may reach it by an address that the
            name does not resolve to here, e.g. a hostname that ``/etc/hosts`` gives as
            127.0.1.1); a name that does not resolve is an error at once.
        port: the server's port; the master may pass 0 for a free one (read ``port``).
        world_size: the number of store users; with ``wait_for_workers`` the master waits for
            all of them to connect.
        is_master: start the server (in a process of its own by default, so that a
            busy parent cannot slow it, and from a thread of this process until that process
            is up, so that the store is up at once; ``TDIST_STORE_SERVER=thread`` keeps it in
            the thread).
        timeout: the default timeout of connecting and of blocking calls.
        wait_for_workers: see ``world_size``.
        multi_tenant: masters in one process with the same host and port share one server.
        master_listen_fd: a socket for the server to use (listening already, or bound, or not even bound: then it listens on an ephemeral port), as torch's.
        use_libuv: torch's choice of server implementation; tdist's store has one, so it is
            recorded (``libuvBackend`` says it, as torch's) and changes nothing.
        secret: the job's shared secret (default ``TDIST_SECRET``); without one the store is
            open to anyone who can connect, as torch's is.

    Raises:
        DistNetworkError: the server cannot be reached or bound.
        AuthenticationError: the secrets do not match.
        StoreTimeoutError: the master's wait for workers expired.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        secret: str | bytes | None = None,
        max_frame: int | None = None,
        _clone: bool = False,
        _serve_later: bool = False,
    ) -> None:
        super().__init__(timeout)
        self._use_libuv = bool(use_libuv)
        if not isinstance(host_name, str):
            raise TypeError(f"TCPStore host_name must be str, got {type(host_name).__name__}")
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"TCPStore port must be int, got {type(port).__name__}")
        if not 0 <= port < 65536:
            raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
        if world_size is not None and world_size < 1 and world_size != -1:
            raise ValueError(
                "TCPStore world size cannot be 0" if world_size == 0  # (torch's words)
                else f"TCPStore world_size must be positive (or -1: any number), got {world_size}"
            )
        if world_size == -1:
            world_size = None
        if not is_master and port == 0:
            raise ValueError("TCPStore: a client (is_master=False) needs the server's port, not 0")
        self._host = host_name
        self._secret = auth.resolve_secret(secret)
        self._is_master = is_master
        self._world_size = world_size
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._spin_poll = select.poll()  # readiness of _sock, for spinning
        self._add_prefix: tuple[str | None, bytes] = (None, b"")  # the last add's key and frame start
        self._decoder = FrameDecoder()
        self._send_seal: auth.Seal | None = None  # the session's tags (a store with a secret)
        self._recv_seal: auth.Seal | None = None
        self._transport = "tcp"
        self._pid = os.getpid()
        self._broken: DistError | None = None
        self._server: StoreServer | None = None
        self._tenant_key: tuple[str, int] | None = None
        self._closed = False
        self._quiet_sent = False
        self._budget = spin.Budget(_client_spin())
        # a clone's server was up when the original connected: a refusal means it is gone
        # (waiting the timeout for it would only delay the error, e.g. a desync diagnosis)
        self._refused_is_final = _clone
        self._own: socket.socket | None = None  # (a master serving from a thread: ``_start_server``)
        self._own_conn: _Conn | None = None  # (the server's side of it)
        # a master's own client of the server it serves from a thread: requests served in the
        # caller's thread (``StoreServer.serve_direct``); the socket pair carries the rest
        self._direct: tuple[StoreServer, _Conn] | None = None
        # (``_serve_later``: a master's server made and bound, whose loop ``_serve_now`` starts)
        self._unstarted: tuple[StoreServer, str] | None = None
        if is_master:
            try:
                self._start_server(host_name, port, multi_tenant, master_listen_fd, max_frame, _serve_later)
            except DistNetworkError as exc:
                if not _the_agents_port(port, exc):
                    raise
                # under an elastic agent whose store holds MASTER_PORT, a master of that port
                # joins it as a client, as torch's does (a worker's own `is_master=rank == 0`)
                self._is_master = is_master = False
                self._port = port
        else:
            self._port = port
        self._connect_host = "127.0.0.1" if host_name in _WILDCARD else host_name
        try:
            try:
                self._connect(self._timeout_seconds(None))
            except TorchServerError:
                if not self._join_torchs_server(wait_for_workers):
                    raise
                return
            if world_size is not None and wait_for_workers:
                self._serve_now()  # (a master that waits for its workers serves them first)
                joined = self.add(_INIT_KEY, 1)
                if is_master and joined < world_size:
                    self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------
    def _join_torchs_server(self, wait_for_workers: bool) -> bool:
        """The server is torch's own (torchrun's agent store, a program's torch master): serve
        this store through torch's client of it, as ``tdist.TCPStore`` code ported from
        ``torch.distributed`` expects (``_OnTorchsServer``). Not for a client that holds a
        secret (torch's server proves none: refused, as any server that asks for none), nor in
        a process that must not load torch (``_process.TORCHLESS``). Whether it could."""
        from .._core import _process

        if self._secret is not None or _process.TORCHLESS:
            return False
        from torch._C._distributed_c10d import TCPStore as TorchTCPStore

        from ._foreign import ForeignStore

        client = TorchTCPStore(
            self._connect_host, self._port, self._world_size, False, self._timeout,
            wait_for_workers=wait_for_workers,
        )
        self.__class__ = _OnTorchsServer
        self._foreign = ForeignStore(client)
        self._transport = "torch"
        log.debug("TCPStore client for %s: torch's own server: joined with torch's client", self._addr)
        return True

    def _start_server(
        self, host: str, port: int, multi_tenant: bool, listen_fd: int | None, max_frame: int | None,
        later: bool = False,
    ) -> None:
        key = (host, port)
        with _tenants_lock:
            if multi_tenant and port != 0 and key in _tenants:
                server, refs = _tenants[key]
                _tenants[key] = (server, refs + 1)
                self._server, self._tenant_key, self._port = server, key, server.port
                return
            for k, s in list(_retired.items()):  # (those that stopped on their own: reaped)
                if s.exit_status() is not None:
                    del _retired[k]
                    s.stop()
            retired = _retired.pop(key, None) if multi_tenant else None
            if retired is not None:
                # the store of a group destroyed here: take it back (a quicker rank may be
                # connected to it for this very group already) unless it has stopped
                if retired.secret == self._secret and retired.reactivate():
                    _tenants[key] = (retired, 1)
                    self._server, self._tenant_key, self._port = retired, key, retired.port
                    return
                _thread_servers.discard(id(retired))
                retired.stop()  # (its port is free once it has)
            server = StoreServer(
                host,
                port,
                secret=self._secret,
                listen_fd=listen_fd,
                max_frame=DEFAULT_MAX_FRAME if max_frame is None else max_frame,
                every_address=True,
            )
            mode = _server_mode()
            # this client's connection to the server: a socket pair, served as one that has
            # nothing to prove (it holds the secret already), so forming a group costs no
            # connect, accept and handshake; while a thread of this process serves (in "process"
            # mode, until the server's own process takes over) its requests are served in the
            # caller's thread (``_serve_direct``), and it does not spin for their replies
            self._own, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._own_conn = server.adopt(theirs)
            if later:
                self._unstarted = (server, mode)
            else:
                self._start_serving(server, mode)
            self._budget.spin = 0.0
            self._server, self._port = server, server.port
            if multi_tenant:
                self._tenant_key = (host, server.port)
                _tenants[self._tenant_key] = (server, 1)
                if port == 0:
                    _tenants[key] = (server, 1)

    @staticmethod
    def _start_serving(server: StoreServer, mode: str) -> None:
        server.start(mode)
        if mode == "thread":
            _thread_servers.add(id(server))

    def _serve_now(self) -> None:
        """Start serving, for a master made with ``_serve_later`` (else nothing). Until then
        its own requests are served in the caller's thread (``_serve_direct``), and the others'
        wait in the kernel's backlog; the first of its own requests whose reply must come from
        the server's loop starts it, as does ``close``: one that waits for a key (the caller
        serves the others itself meanwhile, ``StoreServer.serve_until``, and starts the thread
        at the first moment it has nothing to serve, or else once it has its answer), or any
        that could not be served here.

        For the rank that hosts a group's store in a thread: its own first requests of the
        rendezvous go first, then it serves the others' while it waits for them, and the
        thread's start falls where nobody waits for it. Started first, the thread's start
        (0.3-0.6 ms here, and 1-3 ms about every other time on a busy host) came before those
        requests, and the requests of the ranks that connected meanwhile waited for it, then
        for the caller's Python to let go of the interpreter lock."""
        unstarted, self._unstarted = self._unstarted, None
        if unstarted is not None:
            self._start_serving(*unstarted)

    def _wait_for_workers(self, world_size: int) -> None:
        timeout = self._timeout_seconds(None)
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            joined = self.add(_INIT_KEY, 0)
            if joined >= world_size:
                return
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(  # (torch's words first)
                    f"Timed out after {round(timeout)} seconds waiting for clients. {joined}/{world_size} "
                    f"clients joined. (TCPStore master on {self._host}:{self._port}; check that every "
                    "rank was started and reaches this address)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    @property
    def _addr(self) -> str:
        return f"{self._host}:{self._port}"

    def _connect(self, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        # A master that is not listening yet (refused) is tried again every 0.25-2 ms for the
        # first 0.1 s: ranks start together, and a loaded host delays the master's bind by
        # milliseconds (doubling from 1 ms had a rank sleep 15 ms for a master up after 2). Then,
        # and for any other error, the delay doubles to 0.5 s, so that many ranks waiting for a
        # late master do not flood its host.
        delay = 0.00025
        words = patience.Words()
        last_exc: BaseException | None = None
        own, self._own = self._own, None
        own_conn, self._own_conn = self._own_conn, None
        self._direct = None
        if own is not None and os.getpid() != self._pid:  # (a forked child: its parent's pair)
            own = None
        try_unix = own is None and _is_local(self._connect_host) and os.environ.get("TDIST_STORE_UNIX", "1") != "0"
        while True:
            sock: socket.socket | None = None
            try:
                if own is not None:
                    sock, own = own, None
                    self._transport = "unix"
                    self._send_seal = self._recv_seal = None
                    if own_conn is not None and self._server is not None:
                        self._direct = (self._server, own_conn)
                elif try_unix:
                    sock = self._try_unix(deadline)
                if sock is None:
                    # (5 s an attempt at most: a host that drops the packets would hold one
                    # attempt for the kernel's SYN retries, about two minutes, past any warning)
                    remaining = max(0.05, min(deadline - time.monotonic(), _ATTEMPT))
                    sock = socket.create_connection((self._connect_host, self._port), timeout=remaining)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._transport = "tcp"
                    sock.sendall(OPENING)  # (over TCP the client speaks first: ``_protocol``)
                    self._handshake(sock, deadline, opened=True)
                sock.setblocking(False)
                self._sock = sock
                self._spin_poll = select.poll()
                self._spin_poll.register(sock, select.POLLIN)
                self._decoder = FrameDecoder()
                self._decoder.seal = self._recv_seal
                self._quiet_sent = False
                self._pid = os.getpid()
                return
            except (AuthenticationError, TorchServerError):
                if sock is not None:
                    sock.close()
                raise
            except (OSError, DistNetworkError) as exc:
                if sock is not None:
                    sock.close()
                last_exc = fresh(exc)  # (a copy: no cycle through this frame, ``errors.fresh``)
                if self._refused_is_final and isinstance(exc, ConnectionRefusedError):
                    break
            now = time.monotonic()
            if now + delay > deadline:
                break
            if words.due(now - start):  # (a master late by 30 s is no longer the usual start-up skew)
                log.warning(
                    "TCPStore client: still trying to connect to the store at %s (%.0f s so far; last error: %s); is "
                    "the master process running, and are the host and port (MASTER_ADDR/MASTER_PORT) right? "
                    "(it gives up after %g s)", self._addr, now - start, last_exc, timeout,
                )
            time.sleep(delay)
            early = now - start < 0.1 and isinstance(last_exc, (ConnectionRefusedError, FileNotFoundError))
            delay = min(delay * 2, 0.002) if early else min(max(delay, 0.001) * 2, 0.5)
        raise DistNetworkError(
            f"could not connect to the store at {self._addr} within {timeout:g} s "
            f"(last error: {last_exc}); check that the master process is running and that "
            "the host and port (MASTER_ADDR/MASTER_PORT) are right"
        ) from last_exc

    def _try_unix(self, deadline: float) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        try:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            sock.connect(unix_address(self._port))
            try:  # (before a byte is read: a stranger holding the name can neither serve nor stall us)
                check_unix_peer(sock, f"the store's Unix socket @{unix_address(self._port)[1:]}")
            except AuthenticationError as exc:
                _warn_once(f"TCPStore client for {self._addr}: {exc}; using TCP")
                sock.close()
                return None
            self._transport = "unix"
            port = self._handshake(sock, deadline)
        except (OSError, DistNetworkError) as exc:
            sock.close()
            if isinstance(exc, AuthenticationError):
                raise
            return None
        if port != self._port:  # not our server: another one shares the port number
            sock.close()
            return None
        return sock

    def _handshake(self, sock: socket.socket, deadline: float, opened: bool = False) -> int:
        """Read HELLO, prove the secret if asked; returns the server's TCP port. ``opened``:
        this client sent ``OPENING``, which torch's own server answers with ``OPENING_ECHO``.

        Raises:
            TorchServerError: the server is torch's own ``TCPStore`` server.
        """
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        decoder = FrameDecoder(4096)
        if opened:
            head = b""
            while len(head) < len(OPENING_ECHO):
                data = sock.recv(65536)
                if not data:
                    raise DistNetworkError(f"the store at {self._addr} closed the connection during handshake")
                head += data
            if head.startswith(OPENING_ECHO):
                raise TorchServerError(
                    f"the store at {self._addr} is torch's own TCPStore server, not tdist's: "
                    "torch's client (torch.distributed.TCPStore) joins it, as tdist's env:// and "
                    "PrefixStore do when given one; or serve the store with tdist "
                    "(tdist.TCPStore(is_master=True), `tdist run`), which serves both clients"
                )
            decoder.feed(head)
        hello = self._read_frame(sock, decoder, "handshake")
        if hello.code != Op.HELLO or len(hello.fields) != 4:
            raise DistNetworkError(f"{self._addr} did not answer as a tdist store server")
        version = decode_int(hello.fields[0])
        if version != PROTOCOL_VERSION:
            raise DistNetworkError(
                f"store at {self._addr} speaks protocol version {version}, we speak "
                f"{PROTOCOL_VERSION}: run the same tdist version everywhere"
            )
        needs_auth = hello.fields[1] == b"\x01"
        port = decode_int(hello.fields[3])
        self._send_seal = self._recv_seal = None
        if self._secret is not None and not needs_auth:
            raise AuthenticationError(
                f"the store at {self._addr} does not ask for the secret this process holds: it is "
                "not this job's store (or was started without the secret); refused"
            )
        if needs_auth:
            if self._secret is None:
                raise AuthenticationError(
                    f"the store at {self._addr} requires a secret: pass secret= or set "
                    "TDIST_SECRET to the job's secret"
                )
            nonce = auth.make_nonce()
            sock.sendall(encode_frame(Op.AUTH, [nonce, auth.client_proof(self._secret, hello.fields[2], nonce)]))
            reply = self._read_frame(sock, decoder, "authentication")
            if reply.code != Op.AUTH_OK or not auth.verify(
                auth.server_proof(self._secret, hello.fields[2], nonce), reply.fields[0] if reply.fields else b""
            ):
                raise AuthenticationError(
                    f"the store at {self._addr} rejected our secret (or could not prove its "
                    "own): every process of the job must use the same TDIST_SECRET"
                )
            # every frame from now on, both ways, carries the session's tag
            c2s, s2c = auth.session_keys(self._secret, hello.fields[2], nonce)
            self._send_seal, self._recv_seal = auth.Seal(c2s), auth.Seal(s2c)
        return port

    def _read_frame(self, sock: socket.socket, decoder: FrameDecoder, what: str) -> Frame:
        while True:
            frame = decoder.next_frame()
            if frame is not None:
                return frame
            data = sock.recv(65536)
            if not data:
                raise DistNetworkError(f"the store at {self._addr} closed the connection during {what}")
            decoder.feed(data)

    # -- requests ------------------------------------------------------------------------------
    def _call(self, op: Op, fields: Sequence[bytes], wait: float | None = None) -> list[bytes]:
        """One request/reply. ``wait`` is the server-side timeout of a blocking request."""
        return self._call_frame(op, encode_frame(op, fields), wait)

    def _call_frame(self, op: Op, frame_bytes: bytes, wait: float | None = None, io_timeout: float | None = None) -> list[bytes]:
        """``_call`` of a request already encoded (``io_timeout``: the most seconds to wait for
        the reply, instead of the store's timeout)."""
        if io_timeout is None:
            io_timeout = self._timeout.total_seconds() if wait is None else wait + _GRACE
        deferred: DistError | None = None
        with self._lock:
            sock = self._sock
            if sock is None or self._pid != _current_pid[0]:  # (closed or broken: no socket)
                sock = self._ready_socket(op)
            reply = None if self._direct is None else self._serve_direct(frame_bytes)
            if reply is not None and not reply and self._direct is not None:
                # served, and waits for the others: serve them here meanwhile, where the
                # server's thread has not started or does not run yet (``serve_until``); a
                # master made to serve later starts that thread at the first moment there is
                # nothing to serve (its start costs nobody then), serving on until it runs
                started = time.monotonic()
                self._direct[0].serve_until(self._reply_in, sock, io_timeout, self._serve_now)
                io_timeout = max(0.0, io_timeout - (time.monotonic() - started))
            if not reply and self._unstarted is not None:
                self._serve_now()  # (its reply comes from the server's loop)
            if reply:
                frame = self._direct_frame(reply)
                if frame.code == Status.OK:
                    return frame.fields
                raise self._error(op, frame, wait)
            if self._send_seal is not None:
                frame_bytes += self._send_seal.tag(frame_bytes)
            try:
                if reply is None:  # (empty: served, and waits; its reply comes through the socket)
                    try:
                        sent = sock.send(frame_bytes)
                    except BlockingIOError:
                        sent = 0
                    if sent != len(frame_bytes):
                        self._send(sock, frame_bytes[sent:], io_timeout)
                while True:
                    frame = self._read_reply(sock, io_timeout)
                    if frame.code != Status.ASYNC_ERROR:
                        break
                    if deferred is None:  # an earlier quiet set failed: report it now
                        deferred = self._error(Op.SET, frame, None, " (an earlier set)")
                self._quiet_sent = False
            except TimeoutError as exc:
                raise self._stalled(op, io_timeout, "answer", exc) from exc
            except OSError as exc:
                raise self._lost(op, exc) from exc
        if deferred is not None:
            raise fresh(deferred)  # (not the local: see ``fresh``)
        if frame.code == Status.OK:
            return frame.fields
        raise self._error(op, frame, wait)

    def _reply_in(self) -> bool:
        """Whether a reply waits to be read (``_call_frame``, the lock held)."""
        return bool(self._decoder.buffered) or bool(self._spin_poll.poll(0))

    def _serve_direct(self, frame_bytes: bytes) -> bytes | None:
        """A request served by the server this master hosts in a thread, in this thread (the
        lock held): see ``StoreServer.serve_direct``. ``None``: send it through the socket.
        Not while a quiet set sent through the socket may still be unread there: a request
        served here would overtake it."""
        direct = self._direct
        if direct is None or self._quiet_sent or self._broken is not None:
            return None
        reply = direct[0].serve_direct(direct[1], frame_bytes)
        if reply is None and direct[1].closed:  # (the server's own process serves it now)
            self._direct = None
            self._budget.spin = _client_spin()
        return reply

    def _quiet_direct(self, op: Op, frame_bytes: bytes) -> bool:
        """A request without a reply (a quiet set) served here (``_serve_direct``): whether it
        was; its failure, served here, is raised now."""
        reply = self._serve_direct(frame_bytes)
        if reply:
            raise self._error(op, self._direct_frame(reply), None)
        return reply is not None

    def _direct_frame(self, reply: bytes) -> Frame:
        frame = self._decoder.parse_whole(reply)
        if frame is None:
            self._decoder.feed(reply)
            frame = self._decoder.next_frame()
            assert frame is not None, "a direct reply is one whole frame"
        return frame

    def _call_quiet(self, op: Op, fields: Sequence[bytes]) -> None:
        """Send a request that has no reply unless it fails.

        Like torch, ``set`` does not wait for a round trip; unlike torch, a server that is
        already gone is noticed here, and a failure of the request at the next call.
        """
        frame_bytes = encode_frame(op, fields)
        with self._lock:
            sock = self._ready_socket(op)
            if self._direct is not None and self._quiet_direct(op, frame_bytes):
                return
            if self._send_seal is not None:
                frame_bytes += self._send_seal.tag(frame_bytes)
            try:
                # Over a Unix socket a send to a closed peer fails at once (EPIPE); over TCP
                # the first send after the server closed still succeeds, so look for its EOF.
                if self._transport == "tcp":
                    self._check_open(sock)
            except OSError as exc:
                raise self._lost(op, exc) from exc
            self._send_rest(op, sock, frame_bytes)

    def _send_rest(self, op: Op, sock: socket.socket, data: bytes) -> None:
        """Send the bytes of a quiet request, within the store's timeout (the lock held)."""
        io_timeout = self._timeout.total_seconds()
        try:
            self._send(sock, data, io_timeout)
            self._quiet_sent = True
        except TimeoutError as exc:
            raise self._stalled(op, io_timeout, "take", exc) from exc
        except OSError as exc:
            raise self._lost(op, exc) from exc

    @staticmethod
    def _check_open(sock: socket.socket) -> None:
        try:
            data = sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        if not data:
            raise ConnectionResetError("connection closed by the server")

    def _ready_socket(self, op: Op) -> socket.socket:
        broken = self._broken
        if broken is not None:
            # (a fresh error that names this request: the first one's text named its own)
            raise type(broken)(f"{op.name.removesuffix('_QUIET')} cannot be sent: {broken}") from broken
        if self._closed:
            raise DistStoreError(f"TCPStore client for {self._addr} is closed")
        if self._sock is None or self._pid != _current_pid[0]:
            self._reconnect()
        assert self._sock is not None
        return self._sock

    def _stalled(self, op: Op, io_timeout: float, verb: str, exc: BaseException) -> DistError:
        err = StoreTimeoutError(
            f"the store at {self._addr} did not {verb} {op.name} within {io_timeout:g} s; "
            "the server may be stalled or overloaded"
        )
        err.__cause__ = fresh(exc)  # (kept with the error, without the frames: see ``fresh``)
        self._fail(err)
        return err

    def _lost(self, op: Op, exc: BaseException) -> DistError:
        err = DistNetworkError(
            f"lost the connection to the store at {self._addr} during {op.name} ({exc}); "
            "the server process may have exited or the network failed"
        )
        err.__cause__ = fresh(exc)  # (kept with the error, without the frames: see ``fresh``)
        self._fail(err)
        return err

    def _send(self, sock: socket.socket, data: bytes, io_timeout: float) -> None:
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        deadline = time.monotonic() + io_timeout
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(min(remaining, _POLL_MAX) * 1000):
                if time.monotonic() >= deadline:
                    raise TimeoutError("send timed out")
                continue
            try:
                sent = sock.send(view)
            except BlockingIOError:
                continue
            view = view[sent:]

    def _read_reply(self, sock: socket.socket, io_timeout: float) -> Frame:
        """The next frame: spin briefly (replies usually come within microseconds), then sleep."""
        decoder = self._decoder
        buffered = decoder.buffered
        if buffered:
            frame = decoder.next_frame()
            if frame is not None:
                return frame
        budget = self._budget
        spinning = budget.seconds()
        if spinning and not buffered:
            # the common case, kept tight: nothing buffered, the reply due in microseconds
            # (poll(0) where a failed recv would raise: an exception costs more than the call);
            # ``_core.spin``'s policy: poll, then yield a few times, then sleep
            ready, recv, perf = self._spin_poll.poll, sock.recv, time.perf_counter
            now = perf()
            pure, until = now + budget.pure(), now + spinning
            yields = 0
            while True:
                if not ready(0):
                    now = perf()
                    if now < pure:
                        continue
                    if now < until and yields < spin.YIELDS:
                        yields += 1
                        os.sched_yield()  # a server sharing this core gets it at once
                        continue
                    break
                try:
                    data = recv(65536)
                except BlockingIOError:
                    continue
                if not data:
                    raise ConnectionResetError("connection closed by the server")
                budget.caught(yields > 0)
                frame = decoder.parse_whole(data)
                if frame is not None:
                    return frame
                decoder.feed(data)
                frame = decoder.next_frame()
                if frame is not None:
                    return frame
                break
        # sleep until the reply is readable (the socket's own poller, registered at connect),
        # then read: where the spin above found nothing, or did not run, a read first would only
        # fail (an exception, and a system call, for each reply)
        poll = self._spin_poll.poll
        slept = spinning == 0.0 or not buffered
        if slept:
            budget.missed()
        deadline = time.monotonic() + io_timeout
        while True:
            if slept:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not poll(min(remaining, _POLL_MAX) * 1000):
                    if time.monotonic() >= deadline:
                        raise TimeoutError("no reply")
                    continue
            pending = decoder.pending_length()
            size = 65536 if pending is None else max(65536, min(pending + 4 - decoder.buffered, 1 << 24))
            try:
                data = sock.recv(size)
            except BlockingIOError:
                if not slept:
                    budget.missed()
                    slept = True
                continue
            if not data:
                raise ConnectionResetError("connection closed by the server")
            if not slept and spinning:
                budget.caught()
            frame = decoder.parse_whole(data)
            if frame is not None:
                return frame
            decoder.feed(data)
            frame = decoder.next_frame()
            if frame is not None:
                return frame

    def _fail(self, err: DistError) -> None:
        self._broken = fresh(err)  # (``err`` is raised: see ``fresh``)
        self._direct = None
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _reconnect(self) -> None:
        # a forked child must not share its parent's connection
        self._sock = None
        self._connect(self._timeout_seconds(None))

    def _error(self, op: Op, frame: Frame, wait: float | None, context: str = "") -> DistError:
        fields = frame.fields
        kind = fields[0] if fields else b""
        message = (fields[1].decode(errors="replace") if len(fields) > 1 else "unknown error") + context
        if kind == ErrorKind.TIMEOUT:
            ms = decode_int(fields[2]) if len(fields) > 2 else 0
            missing = [k.decode(errors="replace") for k in fields[3:]]
            return StoreTimeoutError(
                f"wait timeout after {ms}ms, keys: {', '.join(missing)} "
                f"({op.name} on the store at {self._addr}; the process that sets them may be "
                "slow, dead, or using other keys)"
            )
        if kind == ErrorKind.VALUE:
            return StoreValueError(message)
        if kind == ErrorKind.QUEUE_EMPTY:
            return QueueEmptyError(message)
        if kind == ErrorKind.AUTH:
            return AuthenticationError(f"store at {self._addr}: {message}")
        if kind == ErrorKind.TOO_LARGE:
            err = DistStoreError(f"store at {self._addr} refused {op.name}: {message}")
            self._fail(err)
            return err
        return DistStoreError(f"store at {self._addr} refused {op.name}: {message}")

    def _wait_ms(self, timeout: timedelta | float | None) -> tuple[bytes, float]:
        seconds = self._timeout_seconds(timeout)
        return encode_int(round(seconds * 1000)), seconds

    # -- the Store API -------------------------------------------------------------------------
    @property
    def host(self) -> str:
        """The server's host name, as given."""
        return self._host

    @property
    def port(self) -> int:
        """The server's TCP port (the chosen one when created with port 0)."""
        return self._port

    @property
    def libuvBackend(self) -> bool:
        """``use_libuv`` as given (torch's: whether its libuv server serves; True by default)."""
        return self._use_libuv

    def set(self, key: str, value: str | bytes) -> None:
        if type(key) is str and type(value) is bytes and self._transport == "unix":
            # the common case, kept tight: one send to the Unix socket, which takes it whole
            frame = encode_frame(_SET_QUIET, (key.encode(), value))
            with self._lock:
                sock = self._sock
                if sock is not None and self._pid == _current_pid[0] and self._broken is None and not self._closed:
                    if self._direct is not None and self._quiet_direct(Op.SET_QUIET, frame):
                        return
                    if self._send_seal is not None:
                        frame += self._send_seal.tag(frame)
                    try:
                        sent = sock.send(frame)
                    except OSError:  # (full, or the server gone: the general path tells)
                        sent = 0
                    if sent == len(frame):
                        self._quiet_sent = True
                    else:  # (the rest, with the general path's deadline and errors)
                        self._send_rest(Op.SET_QUIET, sock, frame[sent:])
                    return
        self._call_quiet(Op.SET_QUIET, (check_key(key).encode(), as_bytes(value)))

    def get(self, key: str) -> bytes:
        ms, seconds = self._wait_ms(None)
        return self._call(Op.GET, (check_key(key).encode(), ms), seconds)[0]

    def add(self, key: str, amount: int) -> int:
        if type(amount) is not int:
            amount = check_amount(amount)
        last_key, prefix = self._add_prefix
        if key != last_key or type(key) is not str:  # (a counter is usually added to again)
            k = check_key(key).encode()
            prefix = HEAD_FIELD.pack(21 + len(k), Op.ADD, 2, len(k)) + k
            self._add_prefix = (key, prefix)
        try:  # encode_frame(Op.ADD, (k, encode_int(amount))) in one step
            frame = prefix + _INT_FIELD.pack(8, amount)
        except struct.error:
            check_amount(amount)  # (raises the clear error)
            raise
        reply = self._call_frame(Op.ADD, frame)[0]
        if len(reply) == 8:
            value: int = _INT.unpack(reply)[0]
            return value
        return decode_int(reply)  # raises the clear error

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        fields = (check_key(key).encode(), as_bytes(expected_value), as_bytes(desired_value))
        return self._call(Op.COMPARE_SET, fields)[0]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        keys = key_list(keys, "wait")
        ms, seconds = self._wait_ms(timeout)
        self._call(Op.WAIT, (ms, *(check_key(k).encode() for k in keys)), seconds)

    def check(self, keys: Sequence[str]) -> bool:
        keys = key_list(keys, "check")
        return self._call(Op.CHECK, [check_key(k).encode() for k in keys])[0] == b"\x01"

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, (check_key(key).encode(),))[0] == b"\x01"

    def num_keys(self) -> int:
        return decode_int(self._call(Op.NUM_KEYS, ())[0])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = key_list(keys, "multi_get")
        ms, seconds = self._wait_ms(None)
        return self._call(Op.MULTI_GET, (ms, *(check_key(k).encode() for k in keys)), seconds)

    _waits_in_chunks = True

    def _multi_get_within(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        """``multi_get`` that waits up to ``timeout`` rather than the store's own: one request
        (``_api.multi_get_within``)."""
        if type(self).multi_get is not TCPStore.multi_get or type(self).wait is not TCPStore.wait:
            self.wait(keys, timeout)  # (a subclass's own reads: they are what it says)
            return self.multi_get(keys)
        keys = key_list(keys, "multi_get")
        ms, seconds = self._wait_ms(timeout)
        return self._call(Op.MULTI_GET, (ms, *(check_key(k).encode() for k in keys)), seconds)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        keys = key_list(keys, "multi_set")
        if len(keys) != len(values):
            raise StoreValueError(f"multi_set: {len(keys)} keys but {len(values)} values; they must be of the same size")
        fields: list[bytes] = []
        for k, v in zip(keys, values, strict=True):
            fields.append(check_key(k).encode())
            fields.append(as_bytes(v))
        self._call(Op.MULTI_SET, fields)

    def append(self, key: str, value: str | bytes) -> None:
        self._call(Op.APPEND, (check_key(key).encode(), as_bytes(value)))

    def list_keys(self) -> list[str]:
        # like torch, the workers' join counter is counted by num_keys but not listed
        return [k.decode() for k in self._call(Op.LIST_KEYS, ()) if k != b"init/"]

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._call(Op.QUEUE_PUSH, (check_key(key).encode(), as_bytes(value)))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        if not block:
            return self._call(Op.QUEUE_POP, (check_key(key).encode(), encode_int(-2)))[0]
        ms, seconds = self._wait_ms(None)
        return self._call(Op.QUEUE_POP, (check_key(key).encode(), ms), seconds)[0]

    def queue_len(self, key: str) -> int:
        return decode_int(self._call(Op.QUEUE_LEN, (check_key(key).encode(),))[0])

    def ping(self, payload: bytes = b"") -> bytes:
        """A round trip to the server (for health checks and benchmarks)."""
        fields = self._call(Op.PING, (payload,) if payload else ())
        return fields[0] if fields else b""

    def clone(self) -> TCPStore:
        """A new client connection to the same server, for use from another thread. (The server
        was up: a refused connection raises at once, not after the timeout.)"""
        return TCPStore(
            self._connect_host,
            self._port,
            None,
            False,
            self._timeout,
            wait_for_workers=False,
            secret=self._secret,
            _clone=True,
        )

    @property
    def transport(self) -> str:
        """How this client reaches the server: ``"unix"`` or ``"tcp"``."""
        return self._transport

    # -- lifetime ------------------------------------------------------------------------------
    def _stop_accepting(self) -> bool:
        """Have the server this master hosts refuse new connections (its clients are served on);
        False when there is nothing to stop: not a master, or a server other stores share."""
        if self._server is None:
            return False
        with _tenants_lock:
            if self._tenant_key is not None:
                entry = _tenants.get(self._tenant_key)
                if entry is not None and entry[1] > 1:
                    return False
        self._server.stop_listening()
        return True

    def close(self) -> None:
        """Close the connection; a master also stops its server (when no tenant shares it)."""
        if self._closed:
            return
        if self._quiet_sent and self._sock is not None and self._pid == os.getpid() and not sys.is_finalizing():
            # make sure the server has taken every set before we go; report what failed (not
            # at interpreter exit: a server thread of this process no longer runs then)
            try:
                self._call_frame(Op.PING, encode_frame(Op.PING, ()), io_timeout=min(self._timeout.total_seconds(), _CLOSE_PING))
            except DistError as exc:
                log.warning("TCPStore client for %s: while closing: %s", self._addr, exc)
        if getattr(self, "_rdzv_claim", None) is not None and not sys.is_finalizing():
            from ._rendezvous import release_claim  # (its rank goes with it)

            release_claim(self)
        self._closed = True
        # wait (briefly) for a call in flight on another thread rather than close under it
        locked = self._lock.acquire(timeout=5.0)
        try:
            for sock in (self._sock, self._own):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
            self._sock = self._own = None
            self._direct = None
        finally:
            if locked:
                self._lock.release()
        if self._unstarted is not None and self._pid == os.getpid():
            self._serve_now()  # (so that it stops, or retires, as any other: a failed rendezvous)
        self._release_server(wait=True)

    def _release_server(self, wait: bool) -> None:
        """Give up the server this master started or shares: the last of a multi-tenant
        server's stores retires it (it serves on while anyone is connected, and the next
        master of the same address in this process takes it back); any other stops it
        (``wait``: until its port is free)."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._tenant_key is not None:
            if not _tenants_lock.acquire(blocking=wait):
                return  # (a finalizer that would wait: the process's end stops it)
            try:
                entry = _tenants.get(self._tenant_key)
                if entry is not None and entry[1] > 1:
                    for k, (s, refs) in list(_tenants.items()):
                        if s is server:
                            _tenants[k] = (s, refs - 1)
                    return
                for k, (s, _) in list(_tenants.items()):
                    if s is server:
                        del _tenants[k]
                        _retired[k] = server
                server.retire()
            finally:
                _tenants_lock.release()
            if wait and id(server) in _thread_servers:
                _drain_also_in_multiprocessing_children()
            return
        _thread_servers.discard(id(server))
        server.stop(wait=wait)

    def __del__(self) -> None:
        # A finalizer runs at whatever allocation the collector picks, in any thread: no network
        # I/O, no waiting, no lock the interrupted code may hold. ``close()`` is the orderly way
        # (it confirms the last sets); here the descriptors go, and a server this store alone
        # hosts is told to stop (it ends on its own, with its process).
        with contextlib.suppress(Exception):
            self._closed = True
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            self._release_server(wait=False)

    def __repr__(self) -> str:
        role = "master" if self._is_master else "client"
        return f"TCPStore({self._addr}, {role}, via {self._transport})"


class _OnTorchsServer(TCPStore):
    """A ``TCPStore`` client whose server is torch's own: every call goes to torch's client of it
    (``TCPStore._join_torchs_server``), through ``ForeignStore``, which raises tdist's errors.
    Its ``transport`` is ``"torch"``."""

    _foreign: ForeignStore

    @property
    def _t(self) -> ForeignStore:
        if self._closed:
            raise DistNetworkError(f"TCPStore client for {self._addr} is closed")
        return self._foreign

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._foreign.set_timeout(timeout)

    _waits_in_chunks = False  # (torch's client logs every wait that times out)

    def _multi_get_within(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        if self.timeout != timeout:
            self._t.wait(list(keys), timeout)
        return self._t.multi_get(keys)

    def set(self, key: str, value: str | bytes) -> None:
        self._t.set(key, value)

    def get(self, key: str) -> bytes:
        return self._t.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._t.add(key, amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._t.compare_set(key, expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._t.wait(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._t.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._t.delete_key(key)

    def num_keys(self) -> int:
        return self._t.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._t.multi_get(keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._t.multi_set(keys, values)

    def append(self, key: str, value: str | bytes) -> None:
        self._t.append(key, value)

    def list_keys(self) -> list[str]:
        return self._t.list_keys()

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._t.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._t.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        return self._t.queue_len(key)

    def ping(self, payload: bytes = b"") -> bytes:
        self._t.check(["init/"])  # (torch's client has no ping: a round trip all the same)
        return payload

    def clone(self) -> TCPStore:
        return TCPStore(self._connect_host, self._port, None, False, self._timeout, wait_for_workers=False)

    def _torch_store(self) -> object:
        return self._foreign.wrapped

