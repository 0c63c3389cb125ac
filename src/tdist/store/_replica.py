"""A store that outlives the host of its server: a standby that keeps a copy, and clients that
fail over to it.

Theory of operation. A ``StoreStandby`` runs on another host than the store server. It connects
to the server as a client (proving the job's secret), asks to ``FOLLOW`` it, and receives a copy
of the data, then every change as the key's new state (``REPL_KEY``: its value and its queue),
in the order the server made them. The server sends each change to the standby before the reply
to the client that made it leaves, so a change a client has seen answered is on its way to the
standby (in the kernel's buffers when the server's process is killed; only the loss of the
server's whole host in that instant can lose it). Nothing changes for a second: the server sends
a beat.

When the connection to the server ends (the server's process died: its kernel closes it), or
nothing arrived for ``silence`` seconds (the host or the network is gone), the standby takes
over: it serves its copy on the port it listens on from the start. Until then it answers
nobody: a client that tries it early waits in its backlog (never answered from a stale copy),
and a client refused there knows that the standby is gone too. A server has one standby at a
time: two would both take over.

A ``FailoverStore`` is a client that knows the standby: ``refresh()`` asks the server for its
standby's address (a launcher does it on every heartbeat). When the server is lost, the next
call connects to the standby (waiting while it takes over) and runs again there: calls that give
the same result when run twice (``get``, ``set``, ``compare_set``, ``wait``, ``add`` of 0...)
go on as if nothing happened. A call that is not (``add``, ``append``, ``queue_push``/``queue_pop``) may or
may not have been applied when the server was lost: it raises ``DistNetworkError`` saying so,
and the next call goes to the standby.

A network partition that separates the standby from a server that is still alive makes two
servers; the rendezvous keeps working on the one its members reach (its state changes by
compare-and-set), and a standby takes over only after ``silence`` seconds without a beat.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from .._core.errors import AuthenticationError, DistError, DistNetworkError
from ._api import DEFAULT_TIMEOUT, Store
from ._protocol import Op
from ._server import StoreServer
from ._state import KVState
from ._tcp import TCPStore

__all__ = ["FailoverStore", "StandbyKeeper", "StoreStandby"]

log = logging.getLogger(__name__)

_SILENCE = 10.0  # seconds without a beat from the server before a standby takes over
_GATHER = 0.005  # seconds a standby that has caught up lets the next changes gather


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class StoreStandby:
    """A standby of the store server at ``host:port`` (see the module).

    Args:
        host, port: the server to follow.
        listen_host: the address to serve at when taking over (default: every interface).
        advertise: the host name clients use to reach this standby (default: this host's
            address on the connection to the server).
        secret: the job's secret (default ``TDIST_SECRET``).
        timeout: how long to try to reach the server.
        silence: seconds without a word from the server before taking over.
        on_takeover: called (in the standby's thread) with the new server once it serves.

    Raises:
        DistNetworkError: the server cannot be reached.
        DistStoreError: the server has a standby already (or does not take one).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        listen_host: str = "",
        advertise: str | None = None,
        secret: str | bytes | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        silence: float = _SILENCE,
        on_takeover: Callable[[StoreServer], None] | None = None,
    ) -> None:
        self._secret = secret
        self._silence = silence
        self._on_takeover = on_takeover
        self._listen_host = listen_host
        self._state = KVState()
        self._torch_clients = False  # (whether the server followed serves torch's clients: FOLLOW's reply)
        self.server: StoreServer | None = None
        self._stop = threading.Event()
        self.synced = threading.Event()
        # (listening from the start; nobody is accepted until the take-over)
        self._sock = StoreServer._bind_tcp(listen_host, 0, 2048)
        self.port: int = self._sock.getsockname()[1]
        try:
            self._client = TCPStore(host, port, timeout=timeout, secret=secret)
            try:
                if advertise is None:
                    conn = self._client._sock
                    advertise = host
                    if conn is not None and conn.family != socket.AF_UNIX:
                        advertise = str(conn.getsockname()[0])
                self.address = f"{advertise}:{self.port}"
                said = self._client._call(Op.FOLLOW, [self.address.encode()])
                self._torch_clients = bool(said) and said[0] == b"\x01"
            except BaseException:
                self._client.close()
                raise
        except BaseException:
            self._sock.close()
            raise
        self._primary = f"{host}:{port}"
        self._thread = threading.Thread(target=self._follow, name=f"tdist-store-standby-{self.port}", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        """Whether this standby has taken over (``server`` serves its copy)."""
        return self.server is not None

    def _follow(self) -> None:
        client = self._client
        sock, decoder = client._sock, client._decoder
        assert sock is not None
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        state = self._state
        last = time.monotonic()
        why = "the server closed the connection"
        try:
            while not self._stop.is_set():
                frame = decoder.next_frame()
                if frame is None:
                    if not poller.poll(250):
                        if time.monotonic() - last > self._silence:
                            why = f"no word from the server for {self._silence:g} s"
                            break
                        continue
                    try:
                        data = sock.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        break
                    decoder.feed(data)
                    last = time.monotonic()
                    if len(data) < 1 << 16:
                        # (caught up: let changes gather in the socket for a moment rather than
                        # waking for each one, which costs the server's host the CPU it needs)
                        self._stop.wait(_GATHER)
                    continue
                code, fields = frame
                if code == Op.REPL_KEY:
                    key = fields[0].decode()
                    if fields[1]:
                        state.data[key] = fields[2]
                    else:
                        state.data.pop(key, None)
                    if len(fields) > 3:
                        state.queues[key] = deque(fields[3:])
                    else:
                        state.queues.pop(key, None)
                elif code == Op.REPL_SYNCED:
                    self.synced.set()
        except (OSError, DistError, ValueError, IndexError) as exc:
            why = f"the stream from the server broke: {exc}"
        if self._stop.is_set():
            return
        if not self.synced.is_set():
            log.warning("store standby of %s: lost the server before its copy was complete (%s): not taking over",
                        self._primary, why)
            self._sock.close()
            return
        self._take_over(why)

    def _take_over(self, why: str) -> None:
        with contextlib.suppress(Exception):
            self._client.close()
        try:
            server = StoreServer(
                self._listen_host, listen_fd=self._sock.detach(), secret=self._secret, state=self._state,
                torch_clients=self._torch_clients,  # (as the server it follows: tdist run's store serves them)
            )
            # (``serving`` before it serves: a client it answers finds it serving)
            self.server = server
            server.start("thread")
        except Exception as exc:
            self.server = None
            log.error("store standby of %s: could not take over: %s", self._primary, exc)
            return
        log.warning("store standby: the store server at %s was lost (%s); serving its data at %s now",
                    self._primary, why, self.address)
        if self._on_takeover is not None:
            self._on_takeover(server)

    def stop(self) -> None:
        """Stop following, and stop serving if it took over."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._client.close()
        self._thread.join(2.0)
        if self.server is not None:
            self.server.stop()
        else:
            self._sock.close()


# calls that a second run leaves as the first left them
_ONCE = frozenset({"add", "append", "queue_push", "queue_pop"})


class FailoverStore(Store):
    """A ``TCPStore`` client of the server at ``host:port`` that fails over to its standby
    (see the module).

    Args:
        host, port: the store server.
        timeout: the default timeout of blocking calls.
        secret: the job's secret (default ``TDIST_SECRET``).
    """

    def __init__(self, host: str, port: int, *, timeout: timedelta = DEFAULT_TIMEOUT, secret: str | bytes | None = None) -> None:
        super().__init__(timeout)
        self._secret = secret
        self._lock = threading.Lock()
        self._store = TCPStore(host, port, timeout=timeout, secret=secret)
        self._at = f"{host}:{port}"
        self._standbys: list[str] = []

    @property
    def address(self) -> str:
        """The server this client uses now (``host:port``)."""
        return self._at

    def standbys(self) -> list[str]:
        """The standbys this client would fail over to, as last learned."""
        return list(self._standbys)

    def refresh(self) -> list[str]:
        """Ask the server for its standbys and remember them; returns them."""
        fields = self._call("replicas", lambda s: s._call(Op.REPLICAS, []))
        standbys = [f.decode() for f in fields]
        with self._lock:
            self._standbys = [s for s in standbys if s != self._at]
        return standbys

    def _fail_over(self, failed: TCPStore, exc: DistError) -> bool:
        """Go over to a standby after ``failed`` lost ``exc``: False if there is none (the
        caller raises ``exc``, which is not raised here: a frame that holds the error it raises
        makes a cycle, see ``errors.fresh``)."""
        with self._lock:
            if self._store is not failed:
                return True  # (another thread did it)
            targets = list(self._standbys)
            if not targets:
                return False
            # (a standby takes over the moment it sees the server go, or after ``_SILENCE``;
            # until then it holds our connection unanswered; one that refuses it is gone)
            patience = min(self._timeout.total_seconds(), 2 * _SILENCE)
            deadline = time.monotonic() + patience
            last = str(exc)  # (its text: an error kept in a local makes a cycle, ``errors.fresh``)
            while targets and time.monotonic() < deadline:
                for target in list(targets):
                    host, port = _split(target)
                    try:
                        socket.create_connection((host, port), timeout=1.0).close()
                    except ConnectionRefusedError as err:
                        targets.remove(target)
                        last = str(err)
                        continue
                    except OSError as err:
                        last = str(err)
                        continue
                    try:
                        store = TCPStore(host, port, timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
                                         secret=self._secret)
                    except AuthenticationError:
                        raise
                    except DistError as err:
                        last = str(err)
                        continue
                    store.set_timeout(self._timeout)
                    log.warning("store client: the store at %s was lost (%s); using its standby at %s",
                                self._at, exc, target)
                    with contextlib.suppress(Exception):
                        failed.close()
                    self._store, self._at = store, target
                    self._standbys = [t for t in targets if t != target]
                    return True
                time.sleep(0.05)
            self._standbys = targets
            raise DistNetworkError(
                f"the store at {self._at} was lost ({exc}) and no standby ({', '.join(self._standbys or ['none left'])}) "
                f"took over within {patience:g} s (last error: {last})"
            ) from exc

    def _call(self, name: str, call: Callable[[TCPStore], Any]) -> Any:
        store = self._store
        try:
            return call(store)
        except AuthenticationError:
            raise
        except DistError as exc:
            # lost, or stalled (its connection is then given up): the server may be gone
            if not isinstance(exc, DistNetworkError) and store._broken is None:
                raise
            if not self._fail_over(store, exc):
                raise
            if name in _ONCE:
                raise DistNetworkError(
                    f"the store at {store.host}:{store.port} was lost during {name}, which may or may not "
                    f"have been applied; this client now uses the standby at {self._at}"
                ) from exc
            return call(self._store)

    # -- the Store API -------------------------------------------------------------------------
    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._store.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        # (a set is not answered: one that went to a server that is gone would be lost, so the
        # failover client asks for the answer of every set)
        self._call("set", lambda s: s.multi_set([key], [value]))

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", lambda s: s.get(key)))

    def add(self, key: str, amount: int) -> int:
        # (adding 0 reads the counter: safe to run twice)
        return int(self._call("add" if amount else "read", lambda s: s.add(key, amount)))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return bytes(self._call("compare_set", lambda s: s.compare_set(key, expected_value, desired_value)))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._call("wait", lambda s: s.wait(keys, timeout) if timeout is not None else s.wait(keys))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", lambda s: s.check(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", lambda s: s.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._call("num_keys", lambda s: s.num_keys()))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return list(self._call("multi_get", lambda s: s.multi_get(keys)))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._call("multi_set", lambda s: s.multi_set(keys, values))

    def append(self, key: str, value: str | bytes) -> None:
        self._call("append", lambda s: s.append(key, value))

    def list_keys(self) -> list[str]:
        return list(self._call("list_keys", lambda s: s.list_keys()))

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._call("queue_push", lambda s: s.queue_push(key, value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return bytes(self._call("queue_pop", lambda s: s.queue_pop(key, block)))

    def queue_len(self, key: str) -> int:
        return int(self._call("queue_len", lambda s: s.queue_len(key)))

    def close(self) -> None:
        self._store.close()

    def __repr__(self) -> str:
        return f"FailoverStore({self._at}, standbys={self._standbys})"


class StandbyKeeper:
    """Keeps one standby of ``store``'s server on some node of a job: each node calls
    ``upkeep()`` now and then (a launcher: on every heartbeat). A node that hosts the server
    keeps none; on the others, the first to find the server without a standby starts one here
    (the server takes one only), and each client learns where it is.

    Args:
        store: this node's client of the job's store.
        hosting: this node hosts the server.
        advertise: the host name the other nodes reach this one by (default: the address of
            this node's connection to the server).
    """

    def __init__(self, store: FailoverStore, *, hosting: bool, advertise: str | None = None) -> None:
        self._store, self._hosting, self._advertise = store, hosting, advertise
        self._lock = threading.Lock()
        self.standby: StoreStandby | None = None

    def upkeep(self) -> None:
        """Learn the server's standby; start one here if it has none (errors are logged)."""
        with self._lock:
            try:
                standbys = self._store.refresh()
            except DistError as exc:
                log.debug("store standby: cannot ask the store for its standby: %s", exc)
                return
            mine = self.standby
            if self._hosting or (mine is not None and (mine.serving or mine.address in standbys)):
                return  # (this node hosts the server, or keeps its standby)
            if mine is not None:  # (it followed a server that is gone)
                mine.stop()
                self.standby = None
            if standbys:
                return
            host, port = _split(self._store.address)
            try:
                self.standby = StoreStandby(host, port, advertise=self._advertise, secret=self._store._secret,
                                            timeout=timedelta(seconds=5))
            except DistError as exc:  # (another node was quicker)
                log.debug("store standby: none here: %s", exc)
                return
            with contextlib.suppress(DistError):
                self._store.refresh()

    def settle(self, timeout: float = 2.0) -> bool:
        """``upkeep`` until this node's client knows a standby to fail over to (one of the
        nodes starts it at once), or this node hosts the server; whether it does. Call it once
        at the start: a server lost before its standby is known is not survived."""
        end = time.monotonic() + timeout
        while True:
            self.upkeep()
            if self._hosting or self._store.standbys() or (self.standby is not None and self.standby.serving):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop this node's standby (and the server it became)."""
        with self._lock:
            if self.standby is not None:
                self.standby.stop()
                self.standby = None
