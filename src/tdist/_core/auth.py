"""HMAC challenge-response on a shared secret, sans-IO.

Theory of operation: the accepting side sends a random nonce; the connecting side answers with
its own nonce and ``HMAC(secret, "client" | server_nonce | client_nonce)``; the accepting side
checks it and answers ``HMAC(secret, "server" | client_nonce | server_nonce)`` so that the
connecting side knows it reached a holder of the secret too. Nothing else is read from a
connection before this succeeds. The secret comes from an argument or ``TDIST_SECRET``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets as _secrets

__all__ = [
    "MAC_SIZE",
    "NONCE_SIZE",
    "client_proof",
    "make_nonce",
    "new_secret",
    "resolve_secret",
    "server_proof",
    "verify",
]

NONCE_SIZE = 32
MAC_SIZE = 32
SECRET_ENV = "TDIST_SECRET"


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
    return _secrets.token_hex(32)


def make_nonce() -> bytes:
    return _secrets.token_bytes(NONCE_SIZE)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"server" + client_nonce + server_nonce, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
