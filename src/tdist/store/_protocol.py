"""The store wire protocol, sans-IO: bytes in, frames out; frames in, bytes out.

Theory of operation. Every message in either direction is one frame::

    u32 body_length | u8 code | u32 field_count | field_count x (u32 length | bytes)

little-endian, where ``body_length`` counts everything after itself. ``code`` is an ``Op`` for a
request and a ``Status`` for a reply; integers travel as 8-byte signed fields. Over TCP the
client speaks first, with ``OPENING``: the server's TCP port also serves torch's own clients,
which speak first too (``_torch_wire``), and the first bytes tell the two apart. ``OPENING`` is
what torch's client sends first (``VALIDATE``, then ``PING``) with a nonce torch's never sends,
so that torch's own server, reached by mistake, answers at once (it echoes the nonce), where it
would otherwise wait for ever. Then (at once, over the Unix socket, which only tdist's clients
use) the connection opens with the server's ``HELLO`` (protocol version, whether a secret is required, a nonce, the
server's TCP port); when a secret is required the client's first frame must be ``AUTH`` and is
limited to ``MAX_AUTH_FRAME`` bytes, so nothing larger is read before the peer is trusted.
After ``AUTH_OK`` every frame in either direction is followed by a tag of ``auth.TAG_SIZE``
bytes from the session's keys (``_core.auth``: derived from the secret and both nonces), which
the receiver checks before it reads the frame.
Requests on one connection are answered in order, one reply each, except ``SET_QUIET`` (a
``set`` that, as torch's, does not wait for a round trip): it is answered only if it fails, with
an ``ASYNC_ERROR`` frame that the client reads before its next reply. A blocking request (``GET``,
``WAIT``, ``MULTI_GET``, ``QUEUE_POP``) carries its timeout, and the server itself answers
``ERROR timeout`` when it expires, so the connection never falls out of step.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum

from .._core import auth
from .._core.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "MAX_AUTH_FRAME",
    "OPENING",
    "OPENING_ECHO",
    "PROTOCOL_VERSION",
    "ByteQueue",
    "ErrorKind",
    "Frame",
    "FrameDecoder",
    "Op",
    "Status",
    "decode_int",
    "encode_frame",
    "encode_int",
]

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME = 1 << 30  # 1 GiB
MAX_AUTH_FRAME = 256
# what a tdist client sends first over TCP: torch's client's opening (VALIDATE with torch's magic
# number, PING), with a nonce torch's client never sends (its PING sends its pid, below 2**22);
# torch's server answers it with the nonce, ``OPENING_ECHO``
OPENING_ECHO = b"TDS1"
OPENING = b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x0d" + OPENING_ECHO

HEADER = struct.Struct("<IBI")  # body_length, code, field_count
FIELD_LEN = struct.Struct("<I")
INT = struct.Struct("<q")
# body_length counts code + field_count + fields
_BODY_FIXED = HEADER.size - 4


class Op(IntEnum):
    HELLO = 1
    AUTH = 2
    AUTH_OK = 3
    SET = 10
    GET = 11
    ADD = 12
    COMPARE_SET = 13
    WAIT = 14
    CHECK = 15
    DELETE = 16
    NUM_KEYS = 17
    MULTI_GET = 18
    MULTI_SET = 19
    APPEND = 20
    LIST_KEYS = 21
    QUEUE_PUSH = 22
    QUEUE_POP = 23
    QUEUE_LEN = 24
    PING = 25
    SET_QUIET = 26  # SET with no reply unless it fails (then an ASYNC_ERROR frame)
    FOLLOW = 27  # a standby asks for the data and every later change (``_replica``)
    REPLICAS = 28  # the standbys' addresses, for a client's failover
    # what a server sends its standby, after the OK of FOLLOW
    REPL_KEY = 40  # key, whether it has a value, the value, the items of its queue
    REPL_SYNCED = 41  # the copy of the data is complete; changes follow
    REPL_BEAT = 42  # nothing changed for a while: the server is alive


class Status(IntEnum):
    OK = 100
    ERROR = 101
    ASYNC_ERROR = 102  # the failure of an earlier request that has no reply of its own


class ErrorKind:
    """The first field of an ``ERROR`` reply."""

    TIMEOUT = b"timeout"
    VALUE = b"value"
    QUEUE_EMPTY = b"queue_empty"
    PROTOCOL = b"protocol"
    AUTH = b"auth"
    TOO_LARGE = b"too_large"


class Frame(tuple[int, list[bytes]]):
    """A decoded frame: ``(code, fields)``, also as ``.code`` and ``.fields``. (A plain tuple
    class: ``typing.NamedTuple`` would cost the store server's own process the import of
    ``typing``.)"""

    __slots__ = ()

    def __new__(cls, code: int, fields: list[bytes]) -> Frame:
        return tuple.__new__(cls, (code, fields))

    @property
    def code(self) -> int:
        return self[0]

    @property
    def fields(self) -> list[bytes]:
        return self[1]


def encode_int(value: int) -> bytes:
    try:
        return INT.pack(value)
    except struct.error as exc:
        raise LocalProtocolError(f"integer {value} does not fit in 64 bits") from exc


def decode_int(field: bytes) -> int:
    if len(field) != INT.size:
        raise RemoteProtocolError(f"expected an 8-byte integer field, got {len(field)} bytes")
    value: int = INT.unpack(field)[0]
    return value


HEAD_FIELD = struct.Struct("<IBII")  # a frame's header and its first field's length


def encode_frame(code: int, fields: Sequence[bytes] = ()) -> bytes:
    """One frame as bytes."""
    n = len(fields)
    if n == 1:
        f0 = fields[0]
        return HEAD_FIELD.pack(9 + len(f0), code, 1, len(f0)) + f0
    if n == 2:
        f0, f1 = fields
        return b"".join((HEAD_FIELD.pack(13 + len(f0) + len(f1), code, 2, len(f0)), f0, FIELD_LEN.pack(len(f1)), f1))
    parts = [b""]
    body = _BODY_FIXED
    pack_len = FIELD_LEN.pack
    for f in fields:
        n = len(f)
        parts.append(pack_len(n))
        parts.append(f)
        body += 4 + n
    if body > 0xFFFFFFFF:
        raise LocalProtocolError(f"frame of {body} bytes is larger than the protocol allows")
    parts[0] = HEADER.pack(body, code, len(fields))
    return b"".join(parts)


def parse_body(code: int, count: int, body: memoryview | bytes, start: int, end: int) -> Frame:
    """Split the fields of a frame whose fields lie in ``body[start:end]``."""
    if count > (end - start) >> 2:
        raise RemoteProtocolError(f"frame claims {count} fields in {end - start} bytes")
    fields: list[bytes] = []
    append = fields.append
    unpack = FIELD_LEN.unpack_from
    pos = start
    copy = not isinstance(body, bytes)
    try:
        for _ in range(count):
            (n,) = unpack(body, pos)
            pos += 4
            field = body[pos : pos + n]
            pos += n
            append(bytes(field) if copy else field)  # type: ignore[arg-type]
    except struct.error:
        raise RemoteProtocolError("frame ends inside a field length") from None
    if pos != end:
        if pos > end:
            raise RemoteProtocolError("a field runs past the end of its frame")
        raise RemoteProtocolError(f"{end - pos} stray bytes after the last field of a frame")
    return Frame(code, fields)


class ByteQueue:
    """Received bytes not taken yet: a decoder's buffer (``FrameDecoder``, and
    ``_torch_wire.QueryDecoder`` for torch's protocol)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def unread(self) -> bytes:
        """The bytes fed and not yet taken."""
        return bytes(self._buf[self._pos :])

    def _taken(self, end: int) -> None:
        """The bytes up to ``end`` are taken: the buffer is emptied once all are, and its
        head is dropped once it is most of a large buffer."""
        buf = self._buf
        self._pos = end
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end > (1 << 20) and end > len(buf) // 2:
            del buf[:end]
            self._pos = 0


class FrameDecoder(ByteQueue):
    """Accumulates received bytes and yields complete frames.

    ``max_frame`` bounds the body length a peer may announce; a larger announcement raises
    ``RemoteProtocolError`` before any of it is buffered. Once ``seal`` is set (the session's
    receiving ``auth.Seal``), every frame must be followed by its tag, checked before the frame
    is read; a frame that fails it raises ``RemoteProtocolError``.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__()
        self.max_frame = max_frame
        self.seal: auth.Seal | None = None

    def parse_whole(self, data: bytes) -> Frame | None:
        """Fast path: ``data`` is exactly one frame and nothing is buffered; else ``None``.

        A ``None`` leaves the decoder unchanged: feed the data and use ``next_frame``.
        """
        n = len(data)
        if self._pos != len(self._buf) or n < HEADER.size:
            return None
        if self.seal is not None:  # (the frame, then its tag)
            n -= auth.TAG_SIZE
            if n < HEADER.size:
                return None
            body_len = FIELD_LEN.unpack_from(data, 0)[0]
            if body_len + 4 != n or body_len > self.max_frame:
                return None
            self._check(data, 0, n)
        if n >= HEAD_FIELD.size:  # the common shapes (one or two fields) without the general loop
            body_len, code, count, n0 = HEAD_FIELD.unpack_from(data, 0)
            if body_len + 4 != n or body_len > self.max_frame:
                return None
            if count == 1 and n0 + HEAD_FIELD.size == n:
                return Frame(code, [data[HEAD_FIELD.size : n]])
            end0 = HEAD_FIELD.size + n0
            if count == 2 and end0 + 4 <= n and FIELD_LEN.unpack_from(data, end0)[0] + end0 + 4 == n:
                return Frame(code, [data[HEAD_FIELD.size : end0], data[end0 + 4 : n]])
            return parse_body(code, count, data, HEADER.size, n)
        body_len, code, count = HEADER.unpack_from(data, 0)
        if body_len + 4 != n or body_len > self.max_frame:
            return None
        return parse_body(code, count, data, HEADER.size, n)

    TAMPERED = (
        "a frame failed its authentication tag: the connection was tampered with (or the "
        "peer is not the one that proved the secret)"
    )

    def _check(self, data: bytes | memoryview, start: int, end: int) -> None:
        """The tag after ``data[start:end]`` (one frame) must be that frame's."""
        if not self.seal.check_trailed(data, start, end):  # type: ignore[union-attr]
            raise RemoteProtocolError(self.TAMPERED)

    def pending_length(self) -> int | None:
        """The announced body length of the frame being received, if its header is in."""
        if len(self._buf) - self._pos < 4:
            return None
        n: int = FIELD_LEN.unpack_from(self._buf, self._pos)[0]
        return n

    def next_frame(self) -> Frame | None:
        """The next complete frame, or ``None`` when more bytes are needed.

        Raises:
            RemoteProtocolError: the bytes cannot be a frame (too large, malformed).
        """
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if avail < 4:
            return None
        body_len, code, count = (
            HEADER.unpack_from(buf, pos) if avail >= HEADER.size else (FIELD_LEN.unpack_from(buf, pos)[0], 0, 0)
        )
        if body_len > self.max_frame:
            raise RemoteProtocolError(
                f"frame of {body_len} bytes exceeds the limit of {self.max_frame} bytes"
            )
        if body_len < _BODY_FIXED:
            raise RemoteProtocolError(f"frame body of {body_len} bytes is shorter than its header")
        mac = 0 if self.seal is None else auth.TAG_SIZE
        if avail < 4 + body_len + mac:
            return None
        end = pos + 4 + body_len
        with memoryview(buf) as view:
            if mac:
                self._check(view, pos, end)
            frame = parse_body(code, count, view, pos + HEADER.size, end)
        self._taken(end + mac)
        return frame
