"""Making connections, for both transports: a process's listeners, dialling a peer, admitting one.

A process group's endpoint and the RPC messenger make their connections the same way, here:

* ``Listeners``: a TCP socket on the address other hosts reach us by and an abstract Unix
  socket (a random name) for processes of this host; ``address`` is what a peer needs to dial
  us (published in a store). Both listen before the address is published, so a refused
  connection means the peer is gone, not that it is not up yet.
* ``Dialer``: connect to a peer's address (the Unix socket on the same host and network
  namespace, else TCP), then run the connecting side of the authenticated handshake
  (``_handshake.Connection``) and check that the peer is the one we meant, from the owner's
  poll loop (several peers at once, no thread), or in the caller's thread (``run``).
* ``Doorway``: accept what waits on the listeners and run the accepting side of each
  handshake (``_handshake.Acceptance``) as its bytes come, from the owner's poll loop: no
  thread per handshake, each within its deadline, a bounded number at once (the flood rules of
  ``_core.floods``), so a silent stranger delays nobody; ``rule(id, token)`` decides who may
  join.

What the connection becomes (a ``_link.Link`` and its front end's bookkeeping) is the caller's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from .._core import peercred
from .._core.errors import (
    AuthenticationError,
    DistNetworkError,
    DistTimeoutError,
    PeerError,
    RemoteProtocolError,
)
from .._core.floods import FailureLog, Starvation
from . import _handshake
from ._link import host_id, tune_tcp

__all__ = ["Dialer", "Doorway", "Listeners", "PeerAddress"]

log = logging.getLogger(__name__)

PeerAddress = dict[str, Any]  # {"host": host id, "unix": name, "addr": ip, "port": int, "pid": int}

# a peer that refuses this many connection attempts in a row is gone (it listened before it
# published its address), not slow
_REFUSALS = 5
_RETRY = 0.02  # seconds between connection attempts
# a listener that closes this many connections in a row before its HELLO is no tdist peer (a
# full door sheds a few; about a second of attempts)
_RESETS = 50
_RECORD = 10.0  # seconds for each record of a handshake (the acceptor's answer)


class Listeners:
    """A TCP listener on ``advertise`` (with ``any_address``, on every address if that one
    cannot be bound; else that is an error) and an abstract Unix listener named
    ``prefix-<pid>-<random>``, both non-blocking.

    Raises:
        DistNetworkError: a listener could not be made.
    """

    def __init__(self, advertise: str, label: str, prefix: str, backlog: int = 128, any_address: bool = True) -> None:
        self.label = label
        tcp = socket.socket(socket.AF_INET6 if ":" in advertise else socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind((advertise, 0))
        except OSError as exc:  # (not an address of ours: listen on all, peers dial the advertised one)
            tcp.close()
            if not any_address:
                raise DistNetworkError(f"{label}: cannot listen on {advertise}: {exc}") from exc
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

    @property
    def sockets(self) -> tuple[socket.socket, socket.socket]:
        return (self.tcp, self.unix)

    def close(self) -> None:
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def where(info: PeerAddress, same_host: bool) -> str:
    """How messages name a peer's listener."""
    return f"unix:{info.get('unix')}" if same_host else f"{info.get('addr')}:{info.get('port')}"


class Dialer:
    """Dialling one peer, driven by the owner's poll loop (``run`` drives it in the caller's
    thread): connect to the peer at ``info`` (the Unix socket on the same host and network
    namespace, else TCP) without blocking, retrying every ``_RETRY`` seconds while the
    connection fails, then authenticate (``_handshake.Connection``; ``what`` names the peer,
    ``expect`` is its id). The acceptor's first record may take ``hello_within`` seconds
    (``None``: until ``deadline``; a process-group peer answers only once its owner is ready),
    its answer to ours ``_RECORD``, past ``deadline`` if need be (``_shake_by``).

    ``step()`` advances it as far as it goes without waiting and returns
    ``(socket, end, same_host, session)`` once connected (``end``: how messages name the
    peer's end, ``"unix"`` or ``addr:port``; the socket non-blocking), else None; ``wants()``
    says what to wait for next: ``(fd, poll events)``, or ``(-1, 0)`` while a retry's time has
    not come; ``until()`` when ``step`` is due even if nothing comes.

    Raises (from ``step``):
        DistTimeoutError: no connection before ``deadline``.
        PeerError: the peer refused it ``_REFUSALS`` times in a row: it has shut down or died.
        AuthenticationError: either side could not prove the secret.
        DistNetworkError: the handshake failed, or another process answered.
    """

    def __init__(
        self,
        info: PeerAddress,
        deadline: float,
        *,
        my_id: int,
        token: bytes,
        secret: bytes | None,
        expect: int,
        label: str,
        what: str,
        hello_within: float | None = None,
    ) -> None:
        self.info = info
        self._hello_within = hello_within
        self.deadline = deadline
        self.expect = expect
        self.same = info.get("host") == host_id() and bool(info.get("unix"))
        self.at = where(info, self.same)
        self.end = "unix" if self.same else f"{info['addr']}:{info['port']}"
        self.wake_at = 0.0
        self._my_id = my_id
        self._token = token
        self._secret = secret
        self._label = label
        self._what = what
        self._sock: socket.socket | None = None
        self._shaking: _handshake.Connection | None = None
        self._record_by = 0.0  # (the next handshake record's deadline)
        self._ready = select.poll()
        self._last: BaseException | None = None
        self._refused = 0
        self._resets = 0

    def wants(self) -> tuple[int, int]:
        if self._sock is None:
            return -1, 0
        return self._sock.fileno(), select.POLLIN if self._shaking is not None else select.POLLOUT

    def until(self) -> float:
        """When ``step`` is due even if nothing comes (a retry, a deadline)."""
        if self._sock is None:
            return min(self.wake_at, self.deadline)
        if self._shaking is not None:
            return self._shake_by(self._shaking)
        return self.deadline

    def _shake_by(self, shaking: _handshake.Connection) -> float:
        """When the handshake under way times out. Once the acceptor's HELLO is in and our JOIN
        out, it may have counted the connection made: only the WELCOME's own time limit ends it
        then, not the caller's deadline (a dialer that gave up there would leave the acceptor a
        connection that closes at once: a peer lost, to it). Before the HELLO, the caller's
        deadline holds: an acceptor that does not answer (stopped, stalled) is not waited for.
        (A dial for one call, ``hello_within``, sends its JOIN only after the HELLO, even
        without a secret: so the acceptor cannot have counted it made before.)"""
        return self._record_by if shaking.hello_in else min(self._record_by, self.deadline)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def run(self) -> tuple[socket.socket, str, bool, _handshake.Session | None]:
        """Dial in this thread, waiting as needed; returns what ``step`` does at the end."""
        ready = select.poll()
        try:
            while True:
                done = self.step()
                if done is not None:
                    return done
                fd, events = self.wants()
                wait = max(0.0, self.until() - time.monotonic())
                if fd < 0:
                    time.sleep(wait)
                    continue
                ready.register(fd, events)
                ready.poll(wait * 1000)
                ready.unregister(fd)
        except BaseException:
            self.close()
            raise

    def step(self) -> tuple[socket.socket, str, bool, _handshake.Session | None] | None:
        try:
            return self._step()
        except BaseException:
            self.close()
            raise

    def _step(self) -> tuple[socket.socket, str, bool, _handshake.Session | None] | None:
        now = time.monotonic()
        if self._sock is None:
            if now >= self.deadline:
                raise DistTimeoutError(f"{self._label}: could not connect to {self._what} at {self.at}: {self._last}")
            if now < self.wake_at:
                return None
            self._start()
            if self._sock is None:
                return None
        sock = self._sock
        if self._shaking is None:  # connecting
            if not self._ready.poll(0):
                if now >= self.deadline:
                    self._failed(TimeoutError("timed out"))
                return None
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._failed(OSError(err, os.strerror(err)))
                return None
            self._shake()
        shaking = cast(_handshake.Connection, self._shaking)
        try:
            hello = shaking.hello_in
            done = shaking.step()
            if done is None:
                if shaking.hello_in and not hello:  # (our JOIN is out: its answer is due soon)
                    self._record_by = now + _RECORD
                elif now >= self._shake_by(shaking):
                    raise TimeoutError("timed out")
                return None
        except (ConnectionResetError, BrokenPipeError) as exc:
            # closed without an answer: the acceptor shed it (its door was full), or is going;
            # another attempt tells which (a listener that does nothing else is no tdist peer)
            self._shaking = None
            self._resets += 1
            if self._resets > _RESETS:
                raise DistNetworkError(
                    f"{self._label}: {self._what} at {self.at} closed {self._resets} connections before "
                    f"the handshake began: {exc}"
                ) from exc
            self._failed(exc)
            return None
        except (OSError, RemoteProtocolError) as exc:
            raise self._handshake_failed(exc) from exc
        their, session = done
        if their != self.expect:
            raise DistNetworkError(f"{self._label}: expected {self._what} at {self.at}, found id {their}")
        self._sock = None  # (the caller's now)
        return sock, self.end, self.same, session

    def _start(self) -> None:
        """A new connection attempt (non-blocking)."""
        info = self.info
        if self.same:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = "\0" + info["unix"]
        else:
            family = socket.AF_INET6 if ":" in str(info["addr"]) else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            target = (info["addr"], info["port"])
        sock.setblocking(False)
        err = sock.connect_ex(target)
        if err not in (0, errno.EINPROGRESS):  # (a Unix listener's full backlog says EAGAIN: retry)
            sock.close()
            self._failed(OSError(err, os.strerror(err)))
            return
        if not self.same:
            tune_tcp(sock)
        self._sock = sock
        self._ready = select.poll()
        self._ready.register(sock.fileno(), select.POLLOUT)
        if err == 0 and self.same:  # (connected at once)
            self._shake()

    def _shake(self) -> None:
        """Connected: the handshake starts."""
        sock = cast(socket.socket, self._sock)
        pid = int(self.info["pid"]) if self.same and self.info.get("pid") else None
        try:
            self._shaking = _handshake.Connection(
                sock, self._my_id, self._token, self._secret, self._what, pid=pid, join_early=self._hello_within is None
            )
        except (OSError, RemoteProtocolError) as exc:
            raise self._handshake_failed(exc) from exc
        self._record_by = self.deadline if self._hello_within is None else time.monotonic() + self._hello_within
        self._ready = select.poll()
        self._ready.register(sock.fileno(), select.POLLIN)

    def _handshake_failed(self, exc: BaseException) -> DistNetworkError:
        return DistNetworkError(f"{self._label}: handshake with {self._what} at {self.at} failed: {exc}")

    def _failed(self, exc: OSError) -> None:
        """This attempt failed: another after ``_RETRY`` (or a final error)."""
        self.close()
        self._last = exc
        refused = exc.errno in (errno.ECONNREFUSED, errno.ENOENT)
        self._refused = self._refused + 1 if refused else 0
        if self._refused >= _REFUSALS:
            raise PeerError(
                f"{self._label}: {self._what} refused the connection at {self.at}: it has shut down or died",
                peer=self.expect,
            ) from exc
        self.wake_at = time.monotonic() + _RETRY


class Doorway:
    """Where the connections to ``listeners`` come in, driven by the owner's poll loop with no
    thread of its own or per handshake: ``fileno()`` is readable whenever something waits
    (a new connection, or a handshake's next bytes); ``service()`` then advances the
    handshakes under way (``_handshake.Acceptance``, each within ``timeout``), accepts what
    waits, and returns the connections that have joined, as ``(id, end, session, socket)``
    (``end``: ``"unix"`` or ``addr:port``; the socket non-blocking). ``rule(id, token)`` says
    who may join. The owner also calls ``service()`` once ``due()`` has come, readable or not
    (deadlines, a listener left alone for a while).

    Floods (``_core.floods``'s rules): at most ``limit`` handshakes at once; with the door
    full, a newcomer takes the place of the oldest (whose JOIN is read first if it is there:
    a member that answered is let in, not dropped). Out of descriptors, the oldest is dropped
    and the listener left alone for a while (``Starvation``).

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
        self._starvation = Starvation(label)
        self._listening: dict[int, socket.socket] = {}
        self._shaking: dict[int, _handshake.Acceptance] = {}  # handshakes under way, oldest first
        self._paused: dict[int, float] = {}  # listeners left alone until then (no descriptors)
        self._due = math.inf  # (``due()``: kept by ``service``, read by any thread)
        self._shed = 0
        self._failures = FailureLog(label, log)  # (whoever can connect: no flood of lines)
        self._closed = False
        self._ep = select.epoll()
        try:
            for s in listeners.sockets:
                self._ep.register(s.fileno(), select.EPOLLIN)
                self._listening[s.fileno()] = s
        except BaseException:
            self._ep.close()
            raise

    def fileno(self) -> int:
        return self._ep.fileno()

    @property
    def pending(self) -> int:
        """Handshakes under way."""
        return len(self._shaking)

    def due(self) -> float:
        """When ``service`` is due even if nothing is readable (``inf``: only once something
        is)."""
        return self._due

    def service(self) -> list[tuple[int, str, _handshake.Session | None, socket.socket]]:
        if not self._lock.acquire(blocking=False):
            return []
        try:
            if self._closed:
                return []
            joined: list[tuple[int, str, _handshake.Session | None, socket.socket]] = []
            listeners: list[socket.socket] = []
            for fd, _ in self._ep.poll(0):  # (the handshakes first: a member's JOIN may be in)
                acceptance = self._shaking.get(fd)
                if acceptance is not None:
                    self._step(acceptance, joined)
                elif fd in self._listening:
                    listeners.append(self._listening[fd])
            now = time.monotonic()
            for acceptance in list(self._shaking.values()):
                if now >= acceptance.deadline:
                    if not self._quiet():
                        self._failures.warn("%s: handshake with %s too slow; dropped", self._label, acceptance.what)
                    self._drop(acceptance)
            if now >= self._failures.due:
                self._failures.flush()
            for fd, until in list(self._paused.items()):
                if now >= until:
                    del self._paused[fd]
                    with contextlib.suppress(OSError):
                        self._ep.modify(fd, select.EPOLLIN)
            for listener in listeners:
                if listener.fileno() not in self._paused:
                    self._accept(listener, now, joined)
            self._due = min(
                [a.deadline for a in self._shaking.values()] + list(self._paused.values())
                + [self._failures.due], default=math.inf,
            )
            return joined
        finally:
            self._lock.release()

    def _accept(self, listener: socket.socket, now: float, joined: list[tuple[int, str, _handshake.Session | None, socket.socket]]) -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                delay = self._starvation.backoff(exc)
                if delay is None:  # (closed meanwhile)
                    if not self._quiet():
                        log.warning("%s: accepting a connection failed: %s", self._label, exc)
                    return
                self.shed_one()  # (out of descriptors: free one, leave the listener alone a while)
                self._paused[listener.fileno()] = now + delay
                with contextlib.suppress(OSError):
                    self._ep.modify(listener.fileno(), 0)
                return
            self._starvation.accepted()
            if self.pending >= self._limit:
                self._make_room(joined)
            self._admit(sock, addr)

    def _make_room(self, joined: list[tuple[int, str, _handshake.Session | None, socket.socket]]) -> None:
        """The door is full: the oldest handshake goes (let in if its JOIN is there)."""
        oldest = self._oldest()
        if oldest is None:
            return
        self._step(oldest, joined)
        if self._oldest() is oldest:  # (still waiting: dropped)
            self._drop(oldest)
            self._shed += 1
            if self._shed == 1:
                log.warning(
                    "%s: more than %d connections are in their handshake at once; dropping the oldest "
                    "(said once per episode)", self._label, self._limit,
                )

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        """A new connection: its handshake starts."""
        end = "unix" if sock.family == socket.AF_UNIX else f"{addr[0]}:{addr[1]}"
        try:
            if sock.family != socket.AF_UNIX:
                tune_tcp(sock)
            acceptance = _handshake.Acceptance(
                sock, self._my_id, self._secret, self._timeout, f"connection from {end}", admit=self._rule
            )
            self._ep.register(sock.fileno(), select.EPOLLIN)
        except (OSError, RemoteProtocolError, AuthenticationError) as exc:
            self._failed(sock, end, exc)
            return
        self._shaking[sock.fileno()] = acceptance

    def _oldest(self) -> _handshake.Acceptance | None:
        return next(iter(self._shaking.values()), None)

    def shed_one(self) -> bool:
        """Drop the oldest handshake under way (to free its descriptor); False if none."""
        oldest = self._oldest()
        if oldest is not None:
            self._drop(oldest)
        return oldest is not None

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
        who = end
        if end == "unix":  # (the kernel says which local process it was)
            try:
                pid, uid = peercred.unix_peer(sock)
                who = f"a local process (pid {pid}, uid {uid}) on the Unix socket"
            except OSError:
                who = "a local process on the Unix socket"
        with contextlib.suppress(OSError):
            sock.close()
        if isinstance(exc, AuthenticationError):
            self._failures.warn("%s: dropped a connection from %s: %s", self._label, who, exc)
        elif isinstance(exc, _handshake.Refused):
            self._failures.warn(
                "%s: refused a connection from %s claiming id %d: not of this job, or not expected",
                self._label, who, exc.peer,
            )
        elif isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            # the dialer gave up (its caller's deadline came first): nothing to warn about
            log.debug("%s: %s left during the handshake: %s", self._label, who, exc)
        elif isinstance(exc, Exception) and not self._quiet():
            self._failures.warn("%s: handshake with %s failed: %s", self._label, who, exc)

    def _forget(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        self._shaking.pop(fd, None)
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
            self._failures.flush()
            for acceptance in list(self._shaking.values()):
                self._drop(acceptance)
            self._listening.clear()
            self._ep.close()
