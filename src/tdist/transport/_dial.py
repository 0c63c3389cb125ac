"""Making connections, for both transports: a process's listeners, dialling a peer, admitting one.

A process group's endpoint and the RPC messenger make their connections the same way, here:

* ``Listeners``: a TCP socket on the address other hosts reach us by and an abstract Unix
  socket (a random name) for processes of this host; ``address`` is what a peer needs to dial
  us (published in a store). Both listen before the address is published, so a refused
  connection means the peer is gone, not that it is not up yet.
* ``dial``: connect to a peer's address (the Unix socket on the same host and network
  namespace, else TCP), then run the connecting side of the authenticated handshake
  (``_handshake.connect``) and check that the peer is the one we meant.
* ``Doorway``: accept what waits on the listeners and run the accepting side of each
  handshake (``_handshake.Acceptance``) as its bytes come, from the owner's poll loop: no
  thread per handshake, each within its deadline, a bounded number at once (the flood rules of
  ``_core.floods``), so a silent stranger delays nobody; ``rule(id, token)`` decides who may
  join.

What the connection becomes (a ``_link.Link`` and its front end's bookkeeping) is the caller's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._core.errors import (
    AuthenticationError,
    DistNetworkError,
    DistTimeoutError,
    PeerError,
    RemoteProtocolError,
)
from .._core.floods import Starvation
from . import _handshake
from ._link import host_id, tune_tcp

__all__ = ["Doorway", "Listeners", "PeerAddress", "dial"]

log = logging.getLogger(__name__)

PeerAddress = dict[str, Any]  # {"host": host id, "unix": name, "addr": ip, "port": int, "pid": int}

# a peer that refuses this many connection attempts in a row is gone (it listened before it
# published its address), not slow
_REFUSALS = 5
_RETRY = 0.02  # seconds between connection attempts


class Listeners:
    """A TCP listener on ``advertise`` (any address if that one cannot be bound) and an
    abstract Unix listener named ``prefix-<pid>-<random>``, both non-blocking."""

    def __init__(self, advertise: str, label: str, prefix: str, backlog: int = 128) -> None:
        self.label = label
        tcp = socket.socket(socket.AF_INET6 if ":" in advertise else socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind((advertise, 0))
        except OSError:  # (not an address of ours: listen on all, peers dial the advertised one)
            tcp.close()
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind(("0.0.0.0", 0))
        tcp.listen(backlog)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # (a random name: taken means someone is in the way, never ours)
            unix.bind("\0" + name)
            unix.listen(backlog)
        except OSError as exc:
            unix.close()
            tcp.close()
            raise DistNetworkError(f"{label}: cannot listen on the Unix socket @{name}: {exc}") from exc
        for s in (tcp, unix):
            s.setblocking(False)
        self.tcp = tcp
        self.unix = unix
        self.address: PeerAddress = {
            "host": host_id(),
            "addr": advertise,
            "port": tcp.getsockname()[1],
            "unix": name,
            "pid": os.getpid(),
        }
        self._starvation = Starvation(label)

    @property
    def sockets(self) -> tuple[socket.socket, socket.socket]:
        return (self.tcp, self.unix)

    def accept(self, listener: socket.socket, admission: Doorway) -> float | None:
        """Accept every connection waiting on ``listener`` and start its handshake
        (``admission``). Returns None, or, when out of descriptors (one pending handshake was
        shed to free one), the seconds to leave the listener alone (``Starvation``).

        Raises:
            OSError: accepting failed for another reason (the listener was closed).
        """
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                delay = self._starvation.backoff(exc)
                if delay is None:
                    raise
                admission.shed_one()
                return delay
            self._starvation.accepted()
            admission.admit(sock, addr)

    def close(self) -> None:
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def where(info: PeerAddress, same_host: bool) -> str:
    """How messages name a peer's listener."""
    return f"unix:{info.get('unix')}" if same_host else f"{info.get('addr')}:{info.get('port')}"


def dial(
    info: PeerAddress,
    deadline: float,
    *,
    my_id: int,
    token: bytes,
    secret: bytes | None,
    expect: int,
    label: str,
    what: str,
) -> tuple[socket.socket, str, bool, _handshake.Session | None]:
    """Connect to the peer at ``info`` and authenticate (``what`` names it, ``expect`` is its
    id). Returns the blocking socket, how messages name its end (``"unix"`` or
    ``addr:port``), whether it is a same-host (Unix) connection, and the session.

    Raises:
        DistTimeoutError: no connection before ``deadline``.
        PeerError: the peer refused it ``_REFUSALS`` times: it has shut down or died.
        AuthenticationError: either side could not prove the secret.
        DistNetworkError: the handshake failed, or another process answered.
    """
    same = info.get("host") == host_id() and bool(info.get("unix"))
    at = where(info, same)
    last: BaseException | None = None
    refused = 0
    while True:
        budget = deadline - time.monotonic()
        if budget <= 0:
            raise DistTimeoutError(f"{label}: could not connect to {what} at {at}: {last}")
        try:
            if same:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(min(budget, 10.0))
                    sock.connect("\0" + info["unix"])
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((info["addr"], info["port"]), timeout=min(budget, 10.0))
                tune_tcp(sock)
            break
        except OSError as exc:
            last = exc
            refused = refused + 1 if isinstance(exc, (ConnectionRefusedError, FileNotFoundError)) else 0
            if refused >= _REFUSALS:
                raise PeerError(
                    f"{label}: {what} refused the connection at {at}: it has shut down or died", peer=expect
                ) from exc
            time.sleep(min(_RETRY, max(0.0, deadline - time.monotonic())))
    end = "unix" if same else f"{info['addr']}:{info['port']}"
    try:
        their, session = _handshake.connect(
            sock, my_id, token, secret, what, pid=int(info["pid"]) if same and info.get("pid") else None
        )
        if their != expect:
            raise DistNetworkError(f"{label}: expected {what} at {at}, found id {their}")
    except (OSError, RemoteProtocolError) as exc:
        sock.close()
        raise DistNetworkError(f"{label}: handshake with {what} at {at} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock, end, same, session


class Doorway:
    """Where the connections to ``listeners`` come in, driven by the owner's poll loop with no
    thread of its own or per handshake: ``fileno()`` is readable whenever something waits
    (a new connection, or a handshake's next bytes); ``service()`` then accepts what waits,
    advances the handshakes (``_handshake.Acceptance``, each within ``timeout``; at most
    ``limit`` at once, the oldest dropped for a new one: ``_core.floods``'s rules)
    and returns the connections that have joined, as ``(id, end, session, socket)`` (``end``:
    ``"unix"`` or ``addr:port``; the socket non-blocking). ``rule(id, token)`` says who may
    join. Call ``service()`` at least every ``timeout`` too, so that silent strangers go.

    Thread-safe: several threads may call ``service``; one does the work, the others return
    at once with nothing.
    """

    def __init__(
        self,
        listeners: Listeners,
        *,
        my_id: int,
        secret: bytes | None,
        label: str,
        rule: Callable[[int, bytes], bool],
        timeout: float = 10.0,
        limit: int = 64,
        quiet: Callable[[], bool] = lambda: False,
    ) -> None:
        self.listeners = listeners
        self._my_id = my_id
        self._secret = secret
        self._label = label
        self._rule = rule
        self._timeout = timeout
        self._limit = limit
        self._quiet = quiet
        self._lock = threading.Lock()
        self._ep = select.epoll()
        self._by_fd: dict[int, socket.socket | _handshake.Acceptance] = {}
        self._resting: dict[int, float] = {}  # listeners left alone until then (no descriptors)
        for s in listeners.sockets:
            self._ep.register(s.fileno(), select.EPOLLIN)
            self._by_fd[s.fileno()] = s
        self._shed = 0
        self._closed = False

    def fileno(self) -> int:
        return self._ep.fileno()

    @property
    def pending(self) -> int:
        """Handshakes under way."""
        return len(self._by_fd) - len(self.listeners.sockets)

    def service(self) -> list[tuple[int, str, _handshake.Session | None, socket.socket]]:
        if not self._lock.acquire(blocking=False):
            return []
        try:
            if self._closed:
                return []
            joined: list[tuple[int, str, _handshake.Session | None, socket.socket]] = []
            now = time.monotonic()
            for fd, until in list(self._resting.items()):
                if now >= until:
                    del self._resting[fd]
                    with contextlib.suppress(OSError):
                        self._ep.modify(fd, select.EPOLLIN)
            for fd, _ in self._ep.poll(0):
                item = self._by_fd.get(fd)
                if isinstance(item, socket.socket):
                    self._accept(item)
                elif item is not None:
                    self._step(item, joined)
            for item in list(self._by_fd.values()):
                if isinstance(item, _handshake.Acceptance) and now >= item.deadline:
                    if not self._quiet():
                        log.warning("%s: handshake with %s too slow; dropped", self._label, item.what)
                    self._drop(item)
            return joined
        finally:
            self._lock.release()

    def _accept(self, listener: socket.socket) -> None:
        try:
            delay = self.listeners.accept(listener, self)
        except OSError as exc:
            if not self._quiet():
                log.warning("%s: accepting a connection failed: %s", self._label, exc)
            return
        if delay is not None:  # out of descriptors: leave the listener alone a while
            self._resting[listener.fileno()] = time.monotonic() + delay
            with contextlib.suppress(OSError):
                self._ep.modify(listener.fileno(), 0)

    def admit(self, sock: socket.socket, addr: Any) -> None:
        """A new connection (``Listeners.accept``): its handshake starts."""
        end = "unix" if sock.family == socket.AF_UNIX else f"{addr[0]}:{addr[1]}"
        try:
            if sock.family != socket.AF_UNIX:
                tune_tcp(sock)
            acceptance = _handshake.Acceptance(
                sock, self._my_id, self._secret, self._timeout, f"connection from {end}", admit=self._rule
            )
        except (OSError, RemoteProtocolError, AuthenticationError) as exc:
            self._failed(sock, end, exc)
            return
        if self.pending >= self._limit:
            self.shed_one()
            self._shed += 1
            if self._shed == 1:
                log.warning(
                    "%s: more than %d connections are in their handshake at once; dropping the "
                    "oldest (said once per episode)", self._label, self._limit,
                )
        self._by_fd[sock.fileno()] = acceptance
        self._ep.register(sock.fileno(), select.EPOLLIN)

    def shed_one(self) -> bool:
        """Drop the oldest handshake under way (to free its descriptor); False if none."""
        for item in self._by_fd.values():
            if isinstance(item, _handshake.Acceptance):
                self._drop(item)
                return True
        return False

    def _step(self, acceptance: _handshake.Acceptance, joined: list[tuple[int, str, _handshake.Session | None, socket.socket]]) -> None:
        sock = acceptance.sock
        end = acceptance.what.removeprefix("connection from ")
        try:
            done = acceptance.step()
        except BaseException as exc:
            self._forget(sock)
            self._failed(sock, end, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if done is None:
            return
        self._forget(sock)
        peer, _, session = done
        joined.append((peer, end, session, sock))
        if self._shed and self.pending == 0:
            log.warning("%s: handshakes back to normal (%d connections dropped)", self._label, self._shed)
            self._shed = 0

    def _failed(self, sock: socket.socket, end: str, exc: BaseException) -> None:
        with contextlib.suppress(OSError):
            sock.close()
        if isinstance(exc, AuthenticationError):
            log.warning("%s: dropped a connection from %s: %s", self._label, end, exc)
        elif isinstance(exc, _handshake.Refused):
            log.warning(
                "%s: refused a connection from %s claiming id %d: not of this job, or not expected",
                self._label, end, exc.peer,
            )
        elif isinstance(exc, Exception) and not self._quiet():
            log.warning("%s: handshake with %s failed: %s", self._label, end, exc)

    def _forget(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        self._by_fd.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._ep.unregister(fd)

    def _drop(self, acceptance: _handshake.Acceptance) -> None:
        self._forget(acceptance.sock)
        with contextlib.suppress(OSError):
            acceptance.sock.close()

    def close(self) -> None:
        """Drop every handshake under way and stop (the listeners stay the caller's)."""
        with self._lock:
            self._closed = True
            for item in list(self._by_fd.values()):
                if isinstance(item, _handshake.Acceptance):
                    self._drop(item)
            self._by_fd.clear()
            self._ep.close()
