"""torch's ``TCPStore`` wire protocol, the server's half, sans-IO: bytes in, queries out.

Theory of operation. torch's client (``torch.distributed.TCPStore(..., is_master=False)``,
C++) speaks first: it opens every connection with ``VALIDATE`` and a magic number, then
``PING`` with a nonce that the server echoes. A query is a ``QueryType`` byte and its
arguments, with no length in front of the whole: a key or a value is a ``u64`` length and its
bytes, a count of keys a ``u64``, a number an ``i64`` (little-endian, the byte order of every
machine torch runs on). Replies have no header either: each query's reply has a shape of its
own (``Reply``), and ``SET``, ``APPEND``, ``MULTI_SET`` and ``QUEUE_PUSH`` have none. A
``WAIT`` on keys not set yet is answered when they are (``STOP_WAITING``); the client that
gives up sends ``CANCEL_WAIT``, which is answered ``WAIT_CANCELED`` whatever came before it.
torch's client puts ``/`` before every key of its caller; its only key of its own is
``init/``, which it adds one to as it connects. tdist's server keeps the keys of torch's clients
in a namespace of their own, ``TORCH_KEYS`` (they prove no secret).

tdist's store server speaks this beside its own protocol on its TCP port
(``StoreServer``: the first bytes of a connection tell the two apart), so that
``torch.distributed.TCPStore`` clients, and torch's ``env://`` under ``tdist run``, use a tdist
store as they would torch's. Read from torch's ``TCPStore.cpp`` and ``TCPStoreLibUvBackend.cpp``
and checked against torch's own client byte by byte.
"""

from __future__ import annotations

import struct

from .._core.errors import RemoteProtocolError
from ._protocol import ByteQueue

__all__ = ["MAGIC", "TORCH_KEYS", "Query", "QueryDecoder", "Reply", "is_torch_opening"]

MAGIC = 0x3C85F7CE
# what tdist's server puts before the keys torch's clients name (``StoreServer._torch_key``):
# theirs live apart from tdist's, and a tdist client reads torch's "/k" as "torch:/k"
TORCH_KEYS = "torch:"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
# the most keys one CHECK/WAIT/MULTI_GET/MULTI_SET may name (torch's server has a limit too)
MAX_KEYS = 1 << 16


class Query:
    """torch's ``QueryType`` values."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17


# a query's arguments, in order: k = a key or value (u64 length, bytes), q = an i64, u = a u32,
# n = a u64 count of keys that follow, m = a u64 count of key/value pairs that follow
_SHAPES: dict[int, str] = {
    Query.VALIDATE: "u",
    Query.SET: "kk",
    Query.COMPARE_SET: "kkk",
    Query.GET: "k",
    Query.ADD: "kq",
    Query.CHECK: "n",
    Query.WAIT: "n",
    Query.GETNUMKEYS: "",
    Query.DELETE_KEY: "k",
    Query.APPEND: "kk",
    Query.MULTI_GET: "n",
    Query.MULTI_SET: "m",
    Query.CANCEL_WAIT: "",
    Query.PING: "u",
    Query.QUEUE_PUSH: "kk",
    Query.QUEUE_POP: "k",
    Query.QUEUE_LEN: "k",
    Query.LIST_KEYS: "",
}


def is_torch_opening(head: bytes | bytearray) -> bool | None:
    """Whether a connection's first bytes are torch's client's ``VALIDATE``: True, False, or
    None while fewer than its five bytes are in and they agree so far."""
    opening = bytes([Query.VALIDATE]) + _U32.pack(MAGIC)
    n = min(len(head), len(opening))
    if bytes(head[:n]) != opening[:n]:
        return False
    return True if n == len(opening) else None


class QueryDecoder(ByteQueue):
    """Accumulates a torch client's bytes and yields its complete queries, as
    ``(query type, arguments)``: bytes for keys and values, ints for numbers.

    ``max_size`` bounds each key and value a client announces; a larger one, an unknown query
    type or too many keys raises ``RemoteProtocolError`` before anything of it is buffered.
    """

    def __init__(self, max_size: int) -> None:
        super().__init__()
        self.max_frame = max_size

    def peek(self) -> int | None:
        """The type of the next query, if a byte of it is in."""
        return self._buf[self._pos] if self._pos < len(self._buf) else None

    def next_query(self) -> tuple[int, list[bytes | int]] | None:
        """The next complete query, or ``None`` when more bytes are needed.

        Raises:
            RemoteProtocolError: the bytes cannot be a query of torch's (an unknown type, a
                key or value larger than allowed, too many keys).
        """
        buf = self._buf
        got = _parse(buf, self._pos, len(buf), self.max_frame)
        if got is None:
            return None
        kind, args, pos = got
        self._taken(pos)
        return kind, args

    def parse_whole(self, data: bytes) -> tuple[int, list[bytes | int]] | None:
        """Fast path: ``data`` is exactly one query and nothing is buffered; else ``None``,
        and the decoder is unchanged (feed the data and use ``next_query``).

        Raises:
            RemoteProtocolError: as ``next_query``.
        """
        if self._pos != len(self._buf):
            return None
        got = _parse(data, 0, len(data), self.max_frame)
        if got is None or got[2] != len(data):
            return None
        return got[0], got[1]


def _parse(buf: bytes | bytearray, pos: int, end: int, limit: int) -> tuple[int, list[bytes | int], int] | None:
    """The query at ``buf[pos:end]``: its type, its arguments and where it ends; None when it is
    not all in."""
    if pos >= end:
        return None
    kind = buf[pos]
    shape = _SHAPES.get(kind)
    if shape is None:
        raise RemoteProtocolError(f"unknown torch TCPStore query type {kind}")
    pos += 1
    args: list[bytes | int] = []
    for part in shape:
        if part == "k":
            got = _field(buf, pos, end, limit)
            if got is None:
                return None
            args.append(got[0])
            pos = got[1]
        elif part == "q":
            if end - pos < 8:
                return None
            args.append(_I64.unpack_from(buf, pos)[0])
            pos += 8
        elif part == "u":
            if end - pos < 4:
                return None
            args.append(_U32.unpack_from(buf, pos)[0])
            pos += 4
        else:  # "n" keys, "m" key/value pairs
            if end - pos < 8:
                return None
            count = _U64.unpack_from(buf, pos)[0]
            if count > MAX_KEYS:
                raise RemoteProtocolError(f"torch TCPStore query names {count} keys (at most {MAX_KEYS})")
            pos += 8
            for _ in range(count * (2 if part == "m" else 1)):
                got = _field(buf, pos, end, limit)
                if got is None:
                    return None
                args.append(got[0])
                pos = got[1]
    return kind, args, pos


def _field(buf: bytes | bytearray, pos: int, end: int, limit: int) -> tuple[bytes, int] | None:
    """A key or value at ``buf[pos:end]`` (its ``u64`` length, its bytes) and where it ends."""
    if end - pos < 8:
        return None
    size = _U64.unpack_from(buf, pos)[0]
    if size > limit:
        raise RemoteProtocolError(f"torch TCPStore key or value of {size} bytes exceeds the limit of {limit} bytes")
    pos += 8
    if end - pos < size:
        return None
    return bytes(buf[pos : pos + size]), pos + size


class Reply:
    """The bytes of torch's replies."""

    STOP_WAITING = b"\x00"
    WAIT_CANCELED = b"\x01"
    READY = b"\x00"
    NOT_READY = b"\x01"

    @staticmethod
    def value(data: bytes) -> bytes:
        return _U64.pack(len(data)) + data

    @staticmethod
    def number(n: int) -> bytes:
        return _I64.pack(n)

    @staticmethod
    def values(items: list[bytes]) -> bytes:
        """A count, then each item as ``value`` (``LIST_KEYS``' reply)."""
        return _U64.pack(len(items)) + b"".join(_U64.pack(len(v)) + v for v in items)

    @staticmethod
    def nonce(n: int) -> bytes:
        return _U32.pack(n)
