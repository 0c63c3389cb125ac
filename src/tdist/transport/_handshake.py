"""The authenticated opening of a peer connection.

The records are ``_protocol``'s HELLO / JOIN / WELCOME: the accepting side sends a nonce, the
connecting side names itself (an id and a 16-byte token that ties the connection to one group
or RPC job) and proves the shared secret, the accepting side proves it back (without a secret,
the JOIN goes at once, not after the HELLO: it has nothing to prove). Nothing but these
fixed-size records is read before the proof is checked, so a stranger's bytes never reach a
decoder, let alone ``pickle``. With a secret, both sides then hold a ``Session``: the keys that
tag every later frame in each direction (``_core.auth``), so a relay that passed the proofs
through can neither read a key it lacks nor change or inject a frame.

Both sides are state machines on non-blocking sockets that their owner's poll loop drives, a
read at a time: ``Connection`` (the connecting side; ``_dial.Dialer``, and ``connect`` drives
one in the caller's thread) and ``Acceptance`` (``_dial.Doorway``), so neither a listener nor a
process that dials several peers needs a thread per handshake.

On a Unix socket both sides first check who the other end is (``SO_PEERCRED``): a process of
another user is refused before a byte is read or written, so a name taken by a stranger can
neither serve nor stall a job (the connecting side learns it at once, not at a timeout).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable

from .._core import auth
from .._core.errors import AuthenticationError, RemoteProtocolError
from .._core.peercred import check_unix_peer
from ._protocol import HELLO, JOIN, MAGIC, VERSION, WELCOME, check_magic

__all__ = ["REFUSED", "REJECTED", "Acceptance", "Connection", "Refused", "Session", "connect"]

ZERO_PROOF = b"\0" * 32
REJECTED = 0xFFFFFFFF  # the id a WELCOME carries when authentication failed
REFUSED = 0xFFFFFFFE  # ... when the connector proved the secret but may not join (``admit``)


class Session:
    """The frame tags of one authenticated connection: ``send`` seals what we write,
    ``recv`` checks what we read."""

    __slots__ = ("recv", "send")

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self.send = auth.Seal(send_key)
        self.recv = auth.Seal(recv_key)


class Connection:
    """The connecting side of one connection, driven by the owner's poll loop: ``sock`` (a
    connected socket) is made non-blocking; call ``step()`` whenever it is readable: it sends
    the JOIN once the HELLO is in and returns the acceptor's ``(id, session)`` (the session
    with a secret only) once the WELCOME is in, None meanwhile. Deadlines are the owner's.

    ``pid``: the process expected at the other end of a Unix socket. ``join_early``: without a
    secret, the JOIN goes at once, not after the HELLO (see below).

    Raises (from the constructor or ``step``):
        AuthenticationError: either side could not prove the secret, or a Unix socket's other
            end is not ours.
        RemoteProtocolError: the acceptor is not a tdist peer of this version.
        OSError: the connection failed.
    """

    __slots__ = ("_buf", "_got", "_joined", "_my_id", "_nonce_c", "_nonce_s", "_secret", "_token", "sock", "what")

    def __init__(
        self,
        sock: socket.socket,
        my_id: int,
        token: bytes,
        secret: bytes | None,
        what: str,
        pid: int | None = None,
        join_early: bool = True,
    ) -> None:
        check_unix_peer(sock, what, pid)
        sock.setblocking(False)
        self.sock = sock
        self.what = what
        self._my_id = my_id
        self._token = token
        self._secret = secret
        self._buf = bytearray(HELLO.size)
        self._got = 0
        self._nonce_s = b""  # (the HELLO's, once it is in)
        self._nonce_c = auth.make_nonce()
        # Without a secret the JOIN proves nothing and needs nothing of the HELLO: it goes at
        # once, so that the acceptor can answer its HELLO's JOIN as soon as it has sent it
        # (half a round trip, a wake-up of each side, less); the HELLO is still checked. Not for
        # a dialler that may give up before the WELCOME (``join_early=False``): after its JOIN
        # the acceptor may count the connection made, and it would see it close at once.
        self._joined = secret is None and join_early
        if self._joined:
            _send_record(sock, JOIN.pack(MAGIC, VERSION, my_id, token, self._nonce_c, ZERO_PROOF), what)

    @property
    def hello_in(self) -> bool:
        """The acceptor's HELLO came (and our JOIN went)."""
        return bool(self._nonce_s)

    def _read(self) -> bool:
        """Read into ``_buf``; True once it is full."""
        view = memoryview(self._buf)
        while self._got < len(self._buf):
            try:
                k = self.sock.recv_into(view[self._got:])
            except (BlockingIOError, InterruptedError):
                return False
            if k == 0:
                raise ConnectionResetError("connection closed during the handshake")
            self._got += k
        return True

    def step(self) -> tuple[int, Session | None] | None:
        what, secret = self.what, self._secret
        if not self._nonce_s:
            if not self._read():
                return None
            magic, version, auth_required, nonce_s = HELLO.unpack(self._buf)
            check_magic(magic, version, what)
            if auth_required and secret is None:
                raise AuthenticationError(f"{what} requires the job secret; set TDIST_SECRET on every process")
            if secret is not None and not auth_required:
                raise AuthenticationError(
                    f"{what} does not ask for the job secret that this process holds: it is not a member "
                    "of this job (or was started without TDIST_SECRET); refused"
                )
            self._nonce_s = nonce_s
            if not self._joined:
                proof = ZERO_PROOF if secret is None else auth.client_proof(secret, nonce_s, self._nonce_c)
                _send_record(self.sock, JOIN.pack(MAGIC, VERSION, self._my_id, self._token, self._nonce_c, proof), what)
                self._joined = True
            self._buf = bytearray(WELCOME.size)
            self._got = 0
        if not self._read():
            return None
        magic, version, their_id, their_proof = WELCOME.unpack(self._buf)
        check_magic(magic, version, what)
        if their_id == REJECTED:
            raise AuthenticationError(
                f"{what} rejected our proof of the job secret: every process must use the same TDIST_SECRET"
            )
        if their_id == REFUSED:
            raise Refused(f"{what} did not let us in: we belong to another job or group, or are not expected", -1)
        if secret is None:
            return int(their_id), None
        nonce_s, nonce_c = self._nonce_s, self._nonce_c
        if not auth.verify(auth.server_proof(secret, nonce_s, nonce_c), their_proof):
            raise AuthenticationError(f"{what} could not prove the job secret")
        c2s, s2c = auth.session_keys(secret, nonce_s, nonce_c)
        return int(their_id), Session(c2s, s2c)


def connect(
    sock: socket.socket, my_id: int, token: bytes, secret: bytes | None, what: str, pid: int | None = None,
    timeout: float = 10.0,
) -> tuple[int, Session | None]:
    """Run the connecting side (``Connection``) on ``sock`` in this thread, each record within
    ``timeout`` seconds; returns the acceptor's id and, with a secret, the session. The socket
    is left non-blocking.

    Raises:
        AuthenticationError, RemoteProtocolError, OSError: as ``Connection``; an acceptor too
        slow raises ``TimeoutError``.
    """
    connection = Connection(sock, my_id, token, secret, what, pid)
    ready = select.poll()
    ready.register(sock.fileno(), select.POLLIN)
    while True:
        done = connection.step()
        if done is not None:
            return done
        if not ready.poll(timeout * 1000):
            raise TimeoutError(f"{what}: no answer within {timeout:g} s during the handshake")


class Refused(RemoteProtocolError):
    """The connector proved the secret but may not join (another group, an unexpected id)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class Acceptance:
    """The accepting side of one connection, driven by the owner's poll loop: no thread per
    handshake, so strangers on a port cost a few bytes each, not a thread. ``sock`` is made
    non-blocking and gets the HELLO at once; call ``step()`` whenever it is readable: it
    returns the connector's ``(id, token, session)`` (the session with a secret only) once the
    handshake is done, None while the JOIN is still coming. ``deadline`` (monotonic) is the
    owner's to enforce.

    ``admit(id, token)`` decides, once the secret is proven and before we answer, whether the
    connector may join; a refused one is told so (``REFUSED``) and closed.

    Raises (from the constructor or ``step``):
        AuthenticationError: the connector did not prove the secret (it has been told so), or
            a Unix socket's other end is not ours.
        Refused: ``admit`` said no.
        RemoteProtocolError, OSError: not a tdist peer, or the connection failed.
    """

    __slots__ = ("_admit", "_buf", "_got", "_my_id", "_nonce", "_secret", "deadline", "sock", "what")

    def __init__(
        self,
        sock: socket.socket,
        my_id: int,
        secret: bytes | None,
        timeout: float,
        what: str,
        admit: Callable[[int, bytes], bool] | None = None,
    ) -> None:
        check_unix_peer(sock, what)
        self.sock = sock
        self.what = what
        self.deadline = time.monotonic() + timeout
        self._my_id = my_id
        self._secret = secret
        self._admit = admit
        self._buf = bytearray(JOIN.size)
        self._got = 0
        self._nonce = auth.make_nonce()
        sock.setblocking(False)
        _send_record(sock, HELLO.pack(MAGIC, VERSION, 1 if secret else 0, self._nonce), what)

    def step(self) -> tuple[int, bytes, Session | None] | None:
        view = memoryview(self._buf)
        while self._got < JOIN.size:
            try:
                k = self.sock.recv_into(view[self._got:])
            except (BlockingIOError, InterruptedError):
                return None
            if k == 0:
                raise ConnectionResetError("connection closed during the handshake")
            self._got += k
        magic, version, peer, token, nonce_c, proof = JOIN.unpack(self._buf)
        what, secret, nonce_s = self.what, self._secret, self._nonce
        check_magic(magic, version, what)
        if secret is not None and not auth.verify(auth.client_proof(secret, nonce_s, nonce_c), proof):
            with contextlib.suppress(OSError, RemoteProtocolError):
                _send_record(self.sock, WELCOME.pack(MAGIC, VERSION, REJECTED, ZERO_PROOF), what)
            raise AuthenticationError(f"{what} failed authentication (wrong or missing TDIST_SECRET)")
        if self._admit is not None and not self._admit(int(peer), bytes(token)):
            # (said, so that the connector stops; a connection closed without a word was shed
            # by a full door, and its connector tries again)
            with contextlib.suppress(OSError, RemoteProtocolError):
                _send_record(self.sock, WELCOME.pack(MAGIC, VERSION, REFUSED, ZERO_PROOF), what)
            raise Refused(f"{what}: refused a connection claiming id {peer}", int(peer))
        server_proof = auth.server_proof(secret, nonce_s, nonce_c) if secret else ZERO_PROOF
        _send_record(self.sock, WELCOME.pack(MAGIC, VERSION, self._my_id, server_proof), what)
        if secret is None:
            return int(peer), bytes(token), None
        c2s, s2c = auth.session_keys(secret, nonce_s, nonce_c)
        return int(peer), bytes(token), Session(s2c, c2s)


def _send_record(sock: socket.socket, record: bytes, what: str) -> None:
    """One handshake record on a non-blocking socket (it fits: nothing else was written)."""
    if sock.send(record) != len(record):
        raise RemoteProtocolError(f"{what}: the connection took only part of a handshake record")
