"""RPC messages, sans-IO.

Theory of operation. An RPC message rides in one transport frame: the frame's tag is the
message id, its metadata is one byte naming the kind below, its payload is the
``transport.serialization`` encoding of the body (tensors out of band). A request
(``CALL``, ``REMOTE``, ``FETCH``, ``JOIN``) is answered by exactly one ``REPLY_OK`` or
``REPLY_ERR`` carrying the request's id; ``RREF``, ``LEAVE`` and ``CAST`` are one-way::

    CALL       (func, args, kwargs)                 -> REPLY_OK result | REPLY_ERR record
    REMOTE     (rref_id, fork_id, func, args, kwargs) -> REPLY_OK None once the value is set
    FETCH      rref_id                              -> REPLY_OK value (when it is ready)
                                                       or REPLY_OK_ACK (remote_tag, value, remote_reply)
    RREF       an RRef protocol message (fork request, accept, delete)
    JOIN       (id, name, address)                  -> REPLY_OK None (dynamic membership)
    LEAVE      id                                   (a worker leaves a dynamic group)
    CAST       (func, args, kwargs)                 (run there, nothing answers: tdist's own
                                                     notices, e.g. an autograd context's release)

``REPLY_ERR`` carries an ``_errors.RemoteExceptionRecord``. ``REPLY_OK_ACK`` answers a fetch and
also the ``REMOTE`` of id ``remote_tag`` (``REPLY_OK None``): the owner sends it when the fetch
came before it answered the ``remote()``, the common ``remote(...).to_here()``.
"""

from __future__ import annotations

import enum

from .._core.errors import RemoteProtocolError

__all__ = ["REQUESTS", "MsgKind", "decode_meta", "encode_meta"]


class MsgKind(enum.IntEnum):
    CALL = 1
    REMOTE = 2
    FETCH = 3
    RREF = 4
    JOIN = 5
    LEAVE = 6
    CAST = 7
    REPLY_OK = 16
    REPLY_ERR = 17
    REPLY_OK_ACK = 18


REQUESTS = frozenset({MsgKind.CALL, MsgKind.REMOTE, MsgKind.FETCH, MsgKind.JOIN})
_META = {k: bytes([int(k)]) for k in MsgKind}
_BY_BYTE = {int(k): k for k in MsgKind}


def encode_meta(kind: MsgKind) -> bytes:
    return _META[kind]


def decode_meta(meta: bytes) -> MsgKind:
    """The kind a frame's metadata names.

    Raises:
        RemoteProtocolError: not one byte naming a known kind.
    """
    if len(meta) != 1 or meta[0] not in _BY_BYTE:
        raise RemoteProtocolError(f"not an RPC message (metadata {meta[:8]!r})")
    return _BY_BYTE[meta[0]]
