"""The peer wire protocol, sans-IO.

Theory of operation. A connection opens with a handshake, then carries frames. The accepting
side speaks first::

    acceptor  -> HELLO   magic "TDPE", version u16, auth_required u8, nonce[32]
    connector -> JOIN    magic, version, rank u32, group token[16], nonce[32], proof[32]
    acceptor  -> WELCOME magic, version, rank u32, proof[32]

``proof`` is the HMAC of ``_core.auth`` (zeros when the group has no secret); the group token
ties the connection to one process group, so ranks of two groups sharing a port cannot cross.
Nothing but these fixed-size records is read before the peer is authenticated.

After the handshake every frame is a 24-byte header, ``meta_len`` bytes of metadata and
``nbytes`` bytes of payload::

    kind u8 | pad u8 | meta_len u16 | pad u32 | tag i64 | nbytes u64

``DATA`` frames carry a message for a posted receive (matched by peer and tag in order);
between processes of one host a large message is a ``DATA_CMA`` frame instead: it names the
sender's memory, the receiver copies it straight into the destination with
``process_vm_readv`` (one copy, no socket) and answers ``CMA_ACK``, and only then does the send
return. A receiver that may not read the sender's memory acks with an errno and the sender
resends the message as plain ``DATA``;
``meta`` describes it (for collectives: the operation's fingerprint, compared on arrival so that
mismatched calls fail loudly instead of corrupting data). ``HEARTBEAT`` frames keep an idle
connection proven alive; ``ABORT`` carries a reason (in ``meta``) when a peer gives the group
up; ``GOODBYE`` says the peer is closing on purpose.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from .._core.errors import RemoteProtocolError

__all__ = [
    "CMA_HEAD",
    "CMA_SEG",
    "FRAME_HEADER",
    "HELLO",
    "JOIN",
    "KINDS",
    "MAGIC",
    "TOKEN_SIZE",
    "VERSION",
    "WELCOME",
    "FrameHeader",
    "Kind",
    "pack_header",
    "unpack_header",
]

MAGIC = b"TDPE"
VERSION = 1
TOKEN_SIZE = 16
MAX_META = 0xFFFF

HELLO = struct.Struct("<4sHB32s")
JOIN = struct.Struct(f"<4sHI{TOKEN_SIZE}s32s32s")
WELCOME = struct.Struct("<4sHI32s")
FRAME_HEADER = struct.Struct("<BxHxxxxqQ")


class Kind(enum.IntEnum):
    DATA = 1
    HEARTBEAT = 2
    ABORT = 3
    GOODBYE = 4
    DATA_CMA = 5  # a DATA message whose payload the receiver copies from the sender's memory
    CMA_ACK = 6  # the receiver has copied it (tag: transfer id; meta: b"" or an errno)


# DATA_CMA payload: transfer id, sender pid, segment count, total bytes; then the segments
CMA_HEAD = struct.Struct("<QIIQ")
CMA_SEG = struct.Struct("<QQ")


class FrameHeader(NamedTuple):
    kind: int
    meta_len: int
    tag: int
    nbytes: int


def pack_header(kind: Kind, tag: int, nbytes: int, meta_len: int = 0) -> bytes:
    return FRAME_HEADER.pack(kind, meta_len, tag, nbytes)


def unpack_header(data: bytes | bytearray | memoryview, max_payload: int) -> FrameHeader:
    """Decode a frame header.

    Raises:
        RemoteProtocolError: an unknown kind or a payload larger than ``max_payload``.
    """
    kind, meta_len, tag, nbytes = FRAME_HEADER.unpack(data)
    if kind not in KINDS:
        raise RemoteProtocolError(f"unknown frame kind {kind}")
    if nbytes > max_payload:
        raise RemoteProtocolError(f"frame of {nbytes} bytes exceeds the limit of {max_payload}")
    return FrameHeader(kind, meta_len, tag, nbytes)


KINDS = frozenset(int(k) for k in Kind)


def check_magic(magic: bytes, version: int, what: str) -> None:
    if magic != MAGIC:
        raise RemoteProtocolError(f"{what}: not a tdist peer (magic {magic!r})")
    if version != VERSION:
        raise RemoteProtocolError(
            f"{what}: peer speaks protocol version {version}, we speak {VERSION}; run the same "
            "tdist version on every rank"
        )
