"""Making connections, for both transports: a process's listeners, dialling a peer, admitting one.

A process group's endpoint and the RPC messenger make their connections the same way, here:

* ``Listeners``: a TCP socket on the address other hosts reach us by and an abstract Unix
  socket (a random name) for processes of this host; ``address`` is what a peer needs to dial
  us (published in a store). Both listen before the address is published, so a refused
  connection means the peer is gone, not that it is not up yet.
* ``dial``: connect to a peer's address (the Unix socket on the same host and network
  namespace, else TCP), then run the connecting side of the authenticated handshake
  (``_handshake.connect``) and check that the peer is the one we meant.
* ``Listeners.accept`` and ``admit``: accept what waits on a listener, each handshake in a
  thread of its own within its deadline (``_core.floods.Admission``: a silent stranger delays
  nobody), and run the accepting side; ``rule(id, token)`` decides who may join.

What the connection becomes (a ``_link.Link`` and its front end's bookkeeping) is the caller's.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
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
from .._core.floods import Admission, Starvation
from . import _handshake
from ._link import host_id, tune_tcp

__all__ = ["Listeners", "PeerAddress", "admit", "dial"]

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

    def accept(self, listener: socket.socket, admission: Admission) -> float | None:
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


def admit(
    sock: socket.socket,
    addr: Any,
    *,
    my_id: int,
    secret: bytes | None,
    timeout: float,
    label: str,
    rule: Callable[[int, bytes], bool],
    quiet: Callable[[], bool] = lambda: False,
) -> tuple[int, str, _handshake.Session | None] | None:
    """Run the accepting side of the handshake on an accepted socket (within ``timeout``);
    ``rule(id, token)`` says whether the connector may join. Returns the peer's id, how
    messages name its end (``"unix"`` or ``addr:port``) and the session; None when the
    connection was refused or failed (logged, unless ``quiet()``; the socket is closed)."""
    end = "unix" if sock.family == socket.AF_UNIX else f"{addr[0]}:{addr[1]}"
    try:
        sock.setblocking(True)
        if sock.family != socket.AF_UNIX:
            tune_tcp(sock)
        peer, _, session = _handshake.accept(sock, my_id, secret, timeout, f"connection from {end}", admit=rule)
    except AuthenticationError as exc:
        log.warning("%s: dropped a connection from %s: %s", label, end, exc)
        sock.close()
        return None
    except _handshake.Refused as exc:
        log.warning("%s: refused a connection from %s claiming id %d: not of this job, or not expected", label, end, exc.peer)
        sock.close()
        return None
    except (OSError, RemoteProtocolError, DistNetworkError) as exc:
        if not quiet():
            log.warning("%s: handshake with %s failed: %s", label, end, exc)
        sock.close()
        return None
    return peer, end, session
