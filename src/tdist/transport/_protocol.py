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
up; ``GOODBYE`` says the peer is closing on purpose. Only ``DATA`` and ``DATA_CMA`` frames
carry a payload.

Lanes (process groups, one host). Small messages to a peer of the same host go through a
shared-memory ring (``_lane``) that the sender announces with a ``LANE`` frame (tag: the ring's
descriptor in the sender, opened through ``/proc``) and uses once the peer has answered
``LANE_OK`` (it has mapped the ring, which then outlives the sender). From the ``LANE`` frame
on, every message to that peer
has a sequence number, in the lane's record or, on the socket, as the first 8 bytes of the
meta of a ``DATA_SEQ`` or ``DATA_CMA_SEQ`` frame (otherwise ``DATA`` and ``DATA_CMA``), so the
receiver matches messages in the order they were sent, whichever way each went.

One same-host copy format, for process groups and RPC alike. A ``DATA_CMA`` payload is::

    transfer id u64 | sender pid u32 | segment count u32 | prefix length u64
    then per segment: address u64 | length u64
    then the prefix: bytes that travel inline, in front of the copied segments

and the message it stands for is the prefix followed by the segments. The receiver answers
``CMA_ACK`` with the transfer id as tag and ``meta`` = errno i32 (0: copied; else the sender
resends the message as ``DATA``).

When a connection has a session (the job has a secret), every frame is followed by a 16-byte
tag over its head (header and metadata) and payload (``_core.auth.Seal``).

Decoding is ``FrameDecoder``'s: bytes in, frames out, no sockets. Its reader owns the socket
and asks the decoder where the next bytes go (``buffer()``): a small frame is parsed out of
the decoder's own buffer, which a read fills as far as the socket has bytes (a small frame
costs one system call); a large payload is announced first (``Arriving``) so that the reader
can place it (``place()``), in a posted receive's own memory for instance, and is then read
straight into it.
"""

from __future__ import annotations

import enum
import mmap
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .._core import auth
from .._core.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "CMA_ACK",
    "CMA_DESC",
    "CMA_SEG",
    "FRAME_HEADER",
    "HELLO",
    "JOIN",
    "KINDS",
    "MAGIC",
    "NEED_DATA",
    "TOKEN_SIZE",
    "VERSION",
    "WELCOME",
    "Arriving",
    "Frame",
    "FrameDecoder",
    "FrameHeader",
    "Kind",
    "pack_ack",
    "pack_cma",
    "pack_header",
    "unpack_ack",
    "unpack_cma",
    "unpack_header",
]

MAGIC = b"TDPE"
VERSION = 3  # (2: one same-host copy format for process groups and RPC; 3: lanes)
TOKEN_SIZE = 16
MAX_META = 0xFFFF
MAX_PAYLOAD = 1 << 40

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
    LANE = 7  # the sender's shared-memory lane to this peer (tag: its descriptor; ``_lane``)
    DATA_SEQ = 8  # DATA after a LANE: meta starts with the message's u64 sequence number
    DATA_CMA_SEQ = 9  # DATA_CMA after a LANE, likewise
    LANE_OK = 10  # the receiver of a LANE has mapped it (tag 0), or cannot (tag 1, meta: why)


# DATA_CMA payload: transfer id, sender pid, segment count, prefix length; the segments; the prefix
CMA_DESC = struct.Struct("<QIIQ")
CMA_SEG = struct.Struct("<QQ")
CMA_ACK = struct.Struct("<i")  # CMA_ACK meta: errno (0: copied)


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
    if nbytes and kind not in _WITH_PAYLOAD:
        raise RemoteProtocolError(f"frame kind {Kind(kind).name} carries no payload, got {nbytes} bytes")
    return FrameHeader(kind, meta_len, tag, nbytes)


KINDS = frozenset(int(k) for k in Kind)
_WITH_PAYLOAD = frozenset((Kind.DATA, Kind.DATA_CMA, Kind.DATA_SEQ, Kind.DATA_CMA_SEQ))


def check_magic(magic: bytes, version: int, what: str) -> None:
    if magic != MAGIC:
        raise RemoteProtocolError(f"{what}: not a tdist peer (magic {magic!r})")
    if version != VERSION:
        raise RemoteProtocolError(
            f"{what}: peer speaks protocol version {version}, we speak {VERSION}; run the same "
            "tdist version on every rank"
        )


# -- the same-host copy format ------------------------------------------------------------------
def pack_cma(xfer: int, pid: int, segments: Sequence[tuple[int, int]], prefix_len: int = 0) -> bytes:
    """A ``DATA_CMA`` payload's descriptor: the segments ``(address, length)`` the receiver
    copies out of process ``pid``; ``prefix_len`` inline bytes follow it in the payload."""
    return CMA_DESC.pack(xfer, pid, len(segments), prefix_len) + b"".join(CMA_SEG.pack(a, n) for a, n in segments)


def unpack_cma(payload: bytes | bytearray | memoryview) -> tuple[int, int, list[tuple[int, int]], memoryview]:
    """A ``DATA_CMA`` payload's transfer id, sender pid, segments and inline prefix (a view
    of ``payload``).

    Raises:
        RemoteProtocolError: the descriptor's sizes do not add up to the payload.
    """
    view = memoryview(payload)
    if view.nbytes < CMA_DESC.size:
        raise RemoteProtocolError(f"cross-memory descriptor of {view.nbytes} bytes is too short")
    xfer, pid, nseg, prefix_len = CMA_DESC.unpack_from(view, 0)
    start = CMA_DESC.size + nseg * CMA_SEG.size
    if start + prefix_len != view.nbytes:
        raise RemoteProtocolError(
            f"malformed cross-memory descriptor: {nseg} segments and a {prefix_len}-byte prefix "
            f"in a {view.nbytes}-byte payload"
        )
    segments = [CMA_SEG.unpack_from(view, CMA_DESC.size + i * CMA_SEG.size) for i in range(nseg)]
    return xfer, pid, segments, view[start:]


def pack_ack(errno: int) -> bytes:
    """A ``CMA_ACK``'s metadata: 0 (copied) or the errno that stopped the copy."""
    return CMA_ACK.pack(errno)


def unpack_ack(meta: bytes) -> int:
    """The errno of a ``CMA_ACK`` (0: copied).

    Raises:
        RemoteProtocolError: ``meta`` is not one.
    """
    if len(meta) != CMA_ACK.size:
        raise RemoteProtocolError(f"a cross-memory ack of {len(meta)} bytes (expected {CMA_ACK.size})")
    return int(CMA_ACK.unpack(meta)[0])


# -- decoding -----------------------------------------------------------------------------------
class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()  # (``next_event``: read more into ``buffer()`` first)


class Frame(NamedTuple):
    """A whole frame (its tag checked). ``payload`` is the placed buffer when the frame was
    announced (``placed``); else a view of the decoder's buffer, valid until the decoder's
    next ``buffer()`` call: copy what must outlive it."""

    kind: int
    tag: int
    meta: bytes
    payload: memoryview
    placed: bool


class Arriving(NamedTuple):
    """A frame with a large payload whose head has come: ``place`` its payload before the next
    ``next_event``; a ``Frame`` with ``placed`` set follows when the payload is in."""

    kind: int
    tag: int
    meta: bytes
    nbytes: int


def _bytearray_view(n: int) -> memoryview:
    return memoryview(bytearray(n))


class FrameDecoder:
    """The frames of one connection's byte stream, sans-IO (see the module docstring).

    Its reader loops::

        event = decoder.next_event()
        NEED_DATA -> n = sock.recv_into(decoder.buffer()); decoder.received(n)  (0: EOF)
        Arriving  -> decoder.place(memory of event.nbytes bytes, or None: ``alloc``'s)
        Frame     -> deliver it

    A payload of ``direct`` bytes or more, or one that would not fit the decoder's buffer of
    ``size`` bytes, is announced and placed; the rest of the frame is read straight into the
    placed memory, except its last bytes when they are fewer than ``direct`` (read with what
    follows, one system call). With a ``seal`` (the session's receiving ``auth.Seal``) every
    frame's tag is checked before the frame is returned; a large payload is tagged as it
    arrives, while it is in the cache.

    Raises (``next_event``):
        RemoteProtocolError: a bad header, a payload over ``max_payload``, a failed tag. The
            connection must go.
        LocalProtocolError: ``next_event`` before an announced payload was placed.

    Not thread-safe: one reader at a time.
    """

    __slots__ = (
        "_alloc",
        "_announced",
        "_dest",
        "_direct",
        "_end",
        "_got",
        "_into_dest",
        "_mac_len",
        "_max",
        "_rx",
        "_seal",
        "_size",
        "_start",
        "_tagging",
    )

    def __init__(
        self,
        seal: auth.Seal | None = None,
        *,
        alloc: Callable[[int], memoryview] = _bytearray_view,
        size: int = 256 << 10,
        direct: int = 64 << 10,
        max_payload: int = MAX_PAYLOAD,
    ) -> None:
        self._seal = seal
        self._mac_len = 0 if seal is None else auth.TAG_SIZE
        self._alloc = alloc
        self._size = size
        self._direct = min(direct, size)
        self._max = max_payload
        # (anonymous memory: its pages come as frames reach them; a bytearray's are zeroed at
        # once, 120-160 us for 256 KiB, which every new connection paid while its group formed)
        self._rx = memoryview(mmap.mmap(-1, size))
        self._start = 0  # bytes not parsed yet: ``_rx[_start:_end]``
        self._end = 0
        self._announced: tuple[int, int, bytes, int] | None = None  # kind, tag, meta, nbytes
        self._dest: memoryview | None = None  # the placed payload being filled
        self._got = 0  # (how much of it is in)
        self._tagging: auth.Tagging | None = None
        self._into_dest = False  # the last ``buffer()`` was the placed payload

    @property
    def at_boundary(self) -> bool:
        """No frame is partly read (an EOF now is a clean close)."""
        return self._start == self._end and self._announced is None

    @property
    def placing(self) -> bool:
        """A placed payload is being read."""
        return self._dest is not None

    def buffer(self) -> memoryview:
        """Where the next bytes from the connection go; then say how many came (``received``)."""
        d = self._dest
        if d is not None and d.nbytes - self._got >= self._direct and self._start == self._end:
            self._into_dest = True
            return d[self._got :]
        self._into_dest = False
        start = self._start
        if start == self._end:
            self._start = self._end = 0
        elif start and self._size - self._end < self._direct:  # move the partial frame to the front
            n = self._end - start
            self._rx[:n] = self._rx[start : self._end]
            self._start, self._end = 0, n
        return self._rx[self._end :]

    def received(self, n: int) -> None:
        """``n`` bytes came into the last ``buffer()``."""
        if self._into_dest:
            d = self._dest
            assert d is not None
            if self._tagging is not None:
                self._tagging.update(d[self._got : self._got + n])
            self._got += n
        else:
            self._end += n

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` in (as reads would put it): for tests and in-memory streams. Take the
        events as they come: a buffer holds ``size`` bytes at most."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            buf = self.buffer()
            n = min(buf.nbytes, view.nbytes)
            if not n:
                raise LocalProtocolError("the decoder's buffer is full: take its events first")
            buf[:n] = view[:n]
            self.received(n)
            view = view[n:]

    def place(self, view: memoryview | None = None) -> None:
        """Where the payload of the frame just announced goes: ``view`` (writable, at least the
        payload's size; its first bytes are used) or, with None, memory from ``alloc``."""
        if self._announced is None or self._dest is not None:
            raise LocalProtocolError("place() without an announced frame")
        n = self._announced[3]
        dest = (self._alloc(n) if view is None else view)[:n]
        if dest.nbytes != n:
            raise LocalProtocolError(f"a payload of {n} bytes placed in {dest.nbytes} bytes")
        self._dest = dest
        self._got = 0

    def next_event(self) -> Frame | Arriving | _NeedData:
        """The next frame, an announced payload to place, or ``NEED_DATA``."""
        if self._announced is not None:
            return self._fill()
        start = self._start
        avail = self._end - start
        hs = FRAME_HEADER.size
        if avail < hs:
            return NEED_DATA
        rx = self._rx
        kind, meta_len, tag, nbytes = FRAME_HEADER.unpack_from(rx, start)
        if kind not in KINDS or nbytes > self._max or (nbytes and kind not in _WITH_PAYLOAD):
            unpack_header(rx[start : start + hs], self._max)  # (raises, saying what is wrong)
        body = start + hs + meta_len
        mac_len = self._mac_len
        total = hs + meta_len + nbytes + mac_len
        if nbytes < self._direct and total <= self._size:
            if avail < total:
                return NEED_DATA
            payload = rx[body : body + nbytes]
            end = body + nbytes
            if mac_len and not self._seal.check(rx[end : end + mac_len], rx[start:body], (payload,), nbytes):  # type: ignore[union-attr]
                raise _tampered()
            self._start = end + mac_len
            return Frame(kind, tag, bytes(rx[start + hs : body]), payload, False)
        if avail < hs + meta_len:
            return NEED_DATA
        meta = bytes(rx[start + hs : body])
        if mac_len:
            self._tagging = self._seal.start(rx[start:body], nbytes)  # type: ignore[union-attr]
        self._start = body
        self._announced = (kind, tag, meta, nbytes)
        return Arriving(kind, tag, meta, nbytes)

    def _fill(self) -> Frame | _NeedData:
        """The placed payload takes what the buffer holds of it; the frame, once whole."""
        d = self._dest
        if d is None:
            raise LocalProtocolError("next_event() before the announced payload was placed")
        got = self._got
        start = self._start
        k = min(d.nbytes - got, self._end - start)
        if k:
            d[got : got + k] = self._rx[start : start + k]
            if self._tagging is not None:
                self._tagging.update(d[got : got + k])
            got = self._got = got + k
            start = self._start = start + k
        if got < d.nbytes:
            return NEED_DATA
        mac_len = self._mac_len
        if mac_len:
            if self._end - start < mac_len:
                return NEED_DATA
            assert self._tagging is not None
            if not self._tagging.matches(self._rx[start : start + mac_len]):
                raise _tampered()
            self._start = start + mac_len
            self._tagging = None
        kind, tag, meta, _ = self._announced  # type: ignore[misc]
        self._announced = None
        self._dest = None
        return Frame(kind, tag, meta, d, True)


def _tampered() -> RemoteProtocolError:
    return RemoteProtocolError(
        "a frame failed its authentication tag: the connection was tampered with (or the peer is "
        "not the process that proved the secret)"
    )
