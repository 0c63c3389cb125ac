"""HMAC challenge-response on a shared secret, and the per-frame tags of the session after it;
sans-IO.

Theory of operation. The accepting side sends a random nonce; the connecting side answers with
its own nonce and ``HMAC(secret, "client" | server_nonce | client_nonce)``; the accepting side
checks it and answers ``HMAC(secret, "server" | client_nonce | server_nonce)`` so that the
connecting side knows it reached a holder of the secret too (a connecting side that holds a
secret refuses a peer that asks for none). Nothing else is read from a connection before this
succeeds. The secret comes from an argument or ``TDIST_SECRET``.

Proving the secret once is not enough: a relay between the two (a process that took a name or a
port first, a machine on the path) could pass the proofs through and then read and write what
it likes. So both sides derive keys from the secret and both nonces (``session_keys``: one per
direction), which the relay cannot, and every frame after the handshake carries a tag
(``Seal``): a keyed BLAKE2b of the frame and of its sequence number in that direction, so a
frame that was changed, injected, dropped, replayed or reflected fails the check and ends the
connection. Payloads of ``BULK`` bytes or more are hashed with SHA-256 first (twice BLAKE2b's
speed on CPUs with SHA instructions) and their digest is tagged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

TYPE_CHECKING = False  # (typing is not imported at run time: see tdist/__init__)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "BULK",
    "MAC_SIZE",
    "NONCE_SIZE",
    "TAG_SIZE",
    "Seal",
    "client_proof",
    "make_nonce",
    "new_secret",
    "resolve_secret",
    "server_proof",
    "session_keys",
    "verify",
]

NONCE_SIZE = 32
MAC_SIZE = 32
TAG_SIZE = 16
BULK = 1 << 16
SECRET_ENV = "TDIST_SECRET"
_SEQ = struct.Struct("<Q")


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret to use: the argument, else ``TDIST_SECRET``, else ``None`` (open)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        return None
    return bytes(secret)


def new_secret() -> str:
    """A fresh random secret for a job (hex text, safe in an environment variable)."""
    return os.urandom(32).hex()


def make_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"server" + client_nonce + server_nonce, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def session_keys(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """The keys of one authenticated connection: (connecting side to accepting side, accepting
    side to connecting side)."""
    both = server_nonce + client_nonce
    return (
        hmac.new(secret, b"tdist session c>s" + both, hashlib.sha256).digest(),
        hmac.new(secret, b"tdist session s>c" + both, hashlib.sha256).digest(),
    )


class Seal:
    """Tags, or checks, the frames of one direction of a session, in order (see the module
    docstring). One ``Seal`` per direction; its calls must follow the order of the frames on
    the wire (the caller holds the connection's send lock, or is its only reader).

    A frame is tagged as its head (header and metadata, one buffer) and its payload (any number
    of buffers, hashed as their concatenation).
    """

    __slots__ = ("_base", "seq")

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=key, digest_size=TAG_SIZE)
        self.seq = 0

    def tag(self, head: Any, payload: Sequence[Any] = (), nbytes: int = 0) -> bytes:
        """The tag of the next frame (``nbytes``: the payload's length)."""
        h = self._base.copy()
        h.update(_SEQ.pack(self.seq))
        self.seq += 1
        h.update(head)
        if nbytes >= BULK:
            bulk = hashlib.sha256()
            for part in payload:
                bulk.update(part)
            h.update(bulk.digest())
        else:
            for part in payload:
                h.update(part)
        return h.digest()

    def check(self, tag: Any, head: Any, payload: Sequence[Any] = (), nbytes: int = 0) -> bool:
        """Whether ``tag`` is the next frame's."""
        return hmac.compare_digest(self.tag(head, payload, nbytes), bytes(tag))
