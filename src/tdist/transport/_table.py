"""One connection table for both front ends: a process's authenticated links to its peers.

A process group's endpoint (``_endpoint``) and the RPC messenger (``_messenger``) hold their
connections here, and make and take them the same way:

* **the table**: every link by descriptor (``by_fd``, what an epoll event names) and by peer
  (``peers``: the link a peer's messages go out on; ``links(peer)``: all of them, since two
  processes that dial each other at once keep both connections), and why a peer whose last
  link went was lost (``lost``), so that a later call names that loss instead of dialling a
  dead process;
* **one epoll set** (``ep``) of every link, registered one-shot (``EPOLLIN | EPOLLONESHOT``):
  each readable link wakes one reader, and is ``arm``ed again once it is read;
* **reading your own reply**: a thread that waits for a message from one peer ``take``s that
  link (its ``rlock``, and disarmed in ``ep``, so no reader thread is woken for it), reads it
  itself and ``give``s it back (armed again: what came meanwhile wakes a reader now);
* **making connections**: lazily (``connect``: the first message to a peer dials it, one dial
  per peer at a time; RPC), or all at once (``mesh``: dial some peers and let others in side
  by side in the caller's thread until every expected peer is there; a process group, whose
  ``init`` must fail where a connection cannot be made, as gloo's does), and letting in what
  comes to the listeners (``admit``, through a ``_dial.Doorway``). Every connection is
  authenticated (``_handshake``) before it is in the table.

What a link means (matching receives, delivering requests) is the front end's; the table
never reads a frame. Thread-safety: every method may be called from any thread; ``lock``
guards the maps (a link is ``closed`` once ``drop``ped, and its descriptor may then belong to
a new connection, so whoever changes its epoll registration checks that first, under it).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from .._core.errors import DistNetworkError, PeerError, fresh
from . import _handshake
from ._dial import Dialer, Doorway, PeerAddress
from ._link import Link

__all__ = ["ARMED", "Table"]

log = logging.getLogger(__name__)

# readable, one-shot: each event goes to one reader, who arms the link again when done
ARMED = select.EPOLLIN | select.EPOLLONESHOT
_DISARMED = select.EPOLLONESHOT
_MESH_LOOK = 1.0  # the longest poll of ``mesh`` between two looks at ``stopped``

L = TypeVar("L", bound=Link)


class Table(Generic[L]):
    """A process's links (see the module docstring).

    Args:
        make: ``make(peer, socket, end, same_host, session)`` makes the front end's link.
        my_id: this process's id, as peers know it.
        token: the 16 bytes that tie a connection to one group or job (``None`` until known:
            set ``token`` before dialling).
        secret: the job secret (``None``: open).
        label: how messages name this process.
        shut: why a link can no longer be added once the table is closed (an error message).
    """

    def __init__(
        self,
        make: Callable[[int, socket.socket, str, bool, _handshake.Session | None], L],
        *,
        my_id: int,
        token: bytes | None,
        secret: bytes | None,
        label: str,
        shut: str,
    ) -> None:
        self._make = make
        self.my_id = my_id
        self.token = token
        self.secret = secret
        self.label = label
        self._shut = shut
        self.lock = threading.Lock()
        self.by_fd: dict[int, L] = {}
        self.peers: dict[int, L] = {}  # (the link each peer's messages go out on)
        self._all: dict[int, list[L]] = {}
        self.lost: dict[int, PeerError] = {}  # peers whose last link failed, and why
        self.closing = False
        self.ep = select.epoll()
        self._dialing: dict[int, threading.Lock] = {}

    # -- the table -----------------------------------------------------------------------------
    def add(
        self,
        peer: int,
        sock: socket.socket,
        end: str,
        same: bool,
        session: _handshake.Session | None,
        outbound: bool = True,
    ) -> L:
        """Put a connection that has made its handshake in the table (and in ``ep``, armed):
        the peer's link for sending when ``outbound`` or when it has none.

        Raises:
            DistNetworkError: the table is closed (the socket is closed then).
        """
        link = self._make(peer, sock, end, same, session)  # (non-blocking from here)
        with self.lock:
            if self.closing:
                sock.close()
                raise DistNetworkError(f"{self.label}: {self._shut}")
            # (in the table before epoll: a reader woken for it at once must find it there)
            self.by_fd[link.fd] = link
            try:
                self.ep.register(link.fd, ARMED)
            except BaseException:
                del self.by_fd[link.fd]
                sock.close()
                raise
            self.lost.pop(peer, None)
            self._all.setdefault(peer, []).append(link)
            if outbound:
                self.peers[peer] = link
            else:
                self.peers.setdefault(peer, link)
        return link

    def drop(self, link: L, err: PeerError | None = None) -> bool | None:
        """Take ``link`` out of the table (``closed`` from now on; the socket is the caller's to
        close). Returns whether it was its peer's last link (then ``err``, if given, is why
        the peer is lost, until a new connection comes), or None when it was out already."""
        with self.lock:
            if link.closed:
                return None
            link.closed = True
            self.by_fd.pop(link.fd, None)
            with contextlib.suppress(OSError, ValueError):
                self.ep.unregister(link.fd)
            links = self._all.get(link.peer, [])
            if link in links:
                links.remove(link)
            if self.peers.get(link.peer) is link:
                del self.peers[link.peer]
                if links:
                    self.peers[link.peer] = links[0]
            last = not links
            if last:
                self._all.pop(link.peer, None)
                if err is not None and not self.closing:
                    self.lost[link.peer] = err
            return last

    def links(self, peer: int) -> list[L]:
        """The peer's links (a copy)."""
        return list(self._all.get(peer, ()))

    def only(self, peer: int) -> L | None:
        """The peer's one link, or None when it has none or several."""
        links = self._all.get(peer)
        if links is None:
            return None
        first = links[:2]  # (one step under the interpreter lock: a ``drop`` may change the list)
        return first[0] if len(first) == 1 else None

    def forget(self, peer: int) -> None:
        """Allow a new connection to a peer that was lost (a worker may come back)."""
        with self.lock:
            self.lost.pop(peer, None)

    # -- readiness -----------------------------------------------------------------------------
    def arm(self, link: L) -> None:
        """Let a reader wait for ``link`` again. Always after its read lock is given back: a
        reader woken while it was held skipped it (leaving it disarmed); arming it now raises
        the event again for whoever is free. (Not under ``lock``: arming a descriptor that a
        new link took over meanwhile only wakes a reader for nothing.)"""
        if not link.closed:
            try:
                self.ep.modify(link.fd, ARMED)
            except (OSError, ValueError):
                pass

    def disarm(self, link: L) -> bool:
        """Keep readers from waking for ``link`` (read lock held); False when it is closed."""
        with self.lock:  # not closed (its descriptor may belong to a new connection then)
            if link.closed:
                return False
            try:  # (not contextlib.suppress: this runs on every call)
                self.ep.modify(link.fd, _DISARMED)
            except (OSError, ValueError):
                return False
        return True

    def take(self, link: L) -> bool:
        """Take ``link`` for reading in this thread (its read lock, and disarmed): False when
        another thread reads it now, or it is closed."""
        if not link.rlock.acquire(blocking=False):
            return False
        if not self.disarm(link):
            link.rlock.release()
            return False
        return True

    def give(self, link: L) -> None:
        """Give back what ``take`` (or a reader) took: the read lock, then armed again."""
        link.rlock.release()
        self.arm(link)

    # -- making connections --------------------------------------------------------------------
    def dialer(
        self,
        peer: int,
        info: PeerAddress,
        deadline: float,
        what: str,
        hello_within: float | None = None,
    ) -> Dialer:
        assert self.token is not None, "the table's token is not known yet"
        return Dialer(
            info,
            deadline,
            my_id=self.my_id,
            token=self.token,
            secret=self.secret,
            expect=peer,
            label=self.label,
            what=what,
            hello_within=hello_within,
        )

    def connect(
        self,
        peer: int,
        lookup: Callable[[int], PeerAddress],
        deadline: float,
        what: str,
        hello_within: float | None = None,
    ) -> L:
        """The peer's link for sending, dialling it now (in this thread) when it has none; one
        dial per peer at a time, the others wait for it.

        Raises:
            PeerError: the peer was lost (and has not connected again), or is unknown
                (``lookup`` raises ``KeyError``), or refuses connections.
            DistNetworkError, AuthenticationError, DistTimeoutError: dialling failed.
        """
        link = self.peers.get(peer)
        if link is not None:
            return link
        with self.lock:
            if self.closing:
                raise DistNetworkError(f"{self.label}: {self._shut}")
            dialing = self._dialing.setdefault(peer, threading.Lock())
        with dialing:
            link = self.peers.get(peer)
            if link is not None:
                return link
            lost = self.lost.get(peer)
            if lost is not None:
                raise PeerError(str(lost), peer=peer)
            try:
                info = lookup(peer)
            except KeyError as exc:
                raise PeerError(
                    f"{self.label}: cannot reach {what}: {exc.args[0] if exc.args else exc}",
                    peer=peer,
                ) from None
            return self.add(peer, *self.dialer(peer, info, deadline, what, hello_within).run())

    def admit(self, doorway: Doorway, one_each: bool = False) -> list[L]:
        """Advance the handshakes at ``doorway`` and add the connections that joined
        (``one_each``: a second connection claiming a peer that has one is dropped). A
        connection that cannot be added goes, not the caller."""
        added: list[L] = []
        for peer, end, session, sock in doorway.service():
            if one_each and peer in self.peers:  # (two handshakes may claim one id: the first wins)
                log.warning("%s: a second connection claimed id %d; dropped", self.label, peer)
                sock.close()
                continue
            try:
                added.append(self.add(peer, sock, end, end == "unix", session, outbound=False))
            except DistNetworkError:  # (closed meanwhile: add closed it)
                pass
            except Exception as exc:  # (no descriptor for epoll, ...)
                log.warning("%s: could not take the connection of id %d: %s", self.label, peer, exc)
                with contextlib.suppress(OSError):
                    sock.close()
        return added

    def mesh(
        self,
        dial: dict[int, PeerAddress],
        doorway: Doorway | None,
        expect: Iterable[int],
        deadline: float,
        stopped: Callable[[], BaseException | None],
    ) -> list[int]:
        """Dial the peers of ``dial`` and let others in through ``doorway``, side by side in
        this thread (``Dialer``s driven by one poll: no thread per connection, and a silent
        stranger delays nobody), until every peer of ``expect`` has a link. Returns the peers
        still missing at ``deadline`` ([] when none). ``stopped()`` returns an error to raise
        when the caller gives up meanwhile.

        Raises:
            what dialling raises (``Dialer.step``), or ``stopped()``'s error; the links made so
            far are closed then.
        """
        dialers = {
            peer: self.dialer(peer, info, deadline, f"rank {peer}") for peer, info in dial.items()
        }
        want = set(expect)
        try:
            while True:
                stop = stopped()
                if stop is not None:
                    raise fresh(stop)  # (often a kept error: see ``fresh``)
                for peer, dialer in list(dialers.items()):
                    made = dialer.step()
                    if made is not None:
                        del dialers[peer]
                        self.add(peer, *made)
                if doorway is not None:
                    self.admit(doorway, one_each=True)
                missing = want - self.peers.keys()
                if not missing:
                    return []
                now = time.monotonic()
                if now >= deadline:
                    return sorted(missing)
                ready = select.poll()
                due = deadline
                if doorway is not None:
                    ready.register(doorway.fileno(), select.POLLIN)
                    due = min(due, doorway.due())
                for dialer in dialers.values():
                    fd, events = dialer.wants()
                    if fd >= 0:
                        ready.register(fd, events)
                    due = min(due, dialer.until())
                ready.poll(max(0.0, min(due - now, _MESH_LOOK)) * 1000)  # (``stopped`` is asked a second apart at most)
        except BaseException:
            for link in self.close():
                with contextlib.suppress(OSError):
                    link.sock.close()
            raise
        finally:
            for dialer in dialers.values():
                dialer.close()

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> list[L]:
        """No more links from now on: returns the links it held (``closed``; their sockets
        are the caller's to shut down and close, once nobody reads them)."""
        with self.lock:
            self.closing = True
            links = list(self.by_fd.values())
            self.by_fd.clear()
            self._all.clear()
            self.peers.clear()
        for link in links:
            link.closed = True
        return links
