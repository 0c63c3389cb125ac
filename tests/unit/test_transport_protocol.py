"""The peer wire protocol's codec (``transport._protocol``), with bytes alone: no sockets."""

from __future__ import annotations

import random

import pytest

from tdist._core import auth
from tdist._core.errors import LocalProtocolError, RemoteProtocolError
from tdist.transport._protocol import (
    NEED_DATA,
    Arriving,
    Frame,
    FrameDecoder,
    Kind,
    pack_ack,
    pack_cma,
    pack_header,
    unpack_ack,
    unpack_cma,
)

KEY = bytes(range(32))


def encode(frames: list[tuple[Kind, int, bytes, bytes]], seal: auth.Seal | None = None) -> bytes:
    """The bytes a sender writes for ``frames`` (kind, tag, meta, payload)."""
    out = bytearray()
    for kind, tag, meta, payload in frames:
        head = pack_header(kind, tag, len(payload), len(meta)) + meta
        out += head + payload
        if seal is not None:
            out += seal.tag(head, [payload], len(payload))
    return bytes(out)


def decode(dec: FrameDecoder, data: bytes, chunks: list[int] | None = None, place: str = "own") -> list[Frame]:
    """Every frame in ``data``, read ``chunks`` bytes at a time (as short reads would bring
    them); announced payloads are placed in fresh memory (``own``) or the decoder's (``alloc``)."""
    frames: list[Frame] = []
    pos = 0
    sizes = iter(chunks or [])
    while True:
        event = dec.next_event()
        if event is NEED_DATA:
            if pos == len(data):
                return frames
            buf = dec.buffer()
            n = min(buf.nbytes, len(data) - pos, next(sizes, len(data)))
            buf[:n] = data[pos : pos + n]
            dec.received(n)
            pos += n
        elif isinstance(event, Arriving):
            dec.place(memoryview(bytearray(event.nbytes)) if place == "own" else None)
        else:
            assert isinstance(event, Frame)
            # (a view of the decoder's buffer is valid until its next ``buffer()``: copy it)
            frames.append(event._replace(payload=memoryview(bytes(event.payload))))


def sample_frames(rng: random.Random) -> list[tuple[Kind, int, bytes, bytes]]:
    frames = []
    for size in (0, 4, 1000, (64 << 10) - 1, 64 << 10, 70_000, 300_000, 3):
        frames.append((Kind.DATA, rng.randrange(-(2**40), 2**40), rng.randbytes(rng.randrange(0, 40)), rng.randbytes(size)))
        frames.append((Kind.HEARTBEAT, 0, b"", b""))
    frames.append((Kind.CMA_ACK, 7, pack_ack(0), b""))
    frames.append((Kind.GOODBYE, 0, b"", b""))
    return frames


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("place", ["own", "alloc"])
def test_frames_come_out_whole_however_the_bytes_are_split(sealed: bool, place: str) -> None:
    rng = random.Random(5)
    frames = sample_frames(rng)
    data = encode(frames, auth.Seal(KEY) if sealed else None)
    splits: list[list[int] | None] = [None, [1] * 200 + [7] * 50 + [1 << 20] * 10, [rng.randrange(1, 90_000) for _ in range(400)]]
    for chunks in splits:
        dec = FrameDecoder(auth.Seal(KEY) if sealed else None)
        got = decode(dec, data, chunks, place)
        assert [(f.kind, f.tag, f.meta, bytes(f.payload)) for f in got] == [(k, t, m, p) for k, t, m, p in frames]
        assert dec.at_boundary


def test_a_large_payload_is_announced_and_read_into_the_placed_memory() -> None:
    payload = random.Random(1).randbytes(200_000)
    data = encode([(Kind.DATA, 9, b"fp", payload), (Kind.DATA, 10, b"", b"xy")])
    dec = FrameDecoder()
    dec.receive_data(data[:100])
    event = dec.next_event()
    assert event == Arriving(Kind.DATA, 9, b"fp", 200_000)
    target = bytearray(200_000 + 8)  # (larger than the payload: its first bytes are used)
    dec.place(memoryview(target))
    assert dec.placing and not dec.at_boundary
    assert dec.next_event() is NEED_DATA
    # the rest goes straight into the target, except a short tail read with what follows
    buf = dec.buffer()
    assert buf.obj is target
    dec.receive_data(data[100:])
    frame = dec.next_event()
    assert isinstance(frame, Frame) and frame.placed and frame.payload.obj is target
    assert bytes(target[:200_000]) == payload
    small = dec.next_event()
    assert isinstance(small, Frame) and not small.placed and bytes(small.payload) == b"xy"
    assert dec.next_event() is NEED_DATA and dec.at_boundary


def test_place_none_takes_memory_from_alloc() -> None:
    made: list[bytearray] = []

    def alloc(n: int) -> memoryview:
        made.append(bytearray(n + 3))
        return memoryview(made[-1])

    dec = FrameDecoder(alloc=alloc)
    dec.receive_data(encode([(Kind.DATA, 1, b"", b"z" * 100_000)])[:50])
    assert isinstance(dec.next_event(), Arriving)
    dec.place()
    assert len(made) == 1 and len(made[0]) == 100_003


def test_misuse_is_a_local_protocol_error() -> None:
    dec = FrameDecoder()
    with pytest.raises(LocalProtocolError):
        dec.place(None)
    dec.receive_data(encode([(Kind.DATA, 1, b"", b"q" * 100_000)])[:40])
    assert isinstance(dec.next_event(), Arriving)
    with pytest.raises(LocalProtocolError, match="placed"):
        dec.next_event()
    with pytest.raises(LocalProtocolError, match="100000 bytes"):
        dec.place(memoryview(bytearray(10)))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x63" + bytes(23), "unknown frame kind 99"),
        (pack_header(Kind.DATA, 0, 1 << 41), "exceeds the limit"),
        (pack_header(Kind.HEARTBEAT, 0, 4) + b"abcd", "carries no payload"),
        (pack_header(Kind.GOODBYE, 0, 1), "carries no payload"),
    ],
)
def test_a_bad_header_is_a_remote_protocol_error(data: bytes, match: str) -> None:
    dec = FrameDecoder()
    dec.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=match):
        dec.next_event()


@pytest.mark.parametrize("size", [10, 100_000])
def test_a_tampered_or_replayed_frame_fails_its_tag(size: int) -> None:
    frame = (Kind.DATA, 3, b"m", bytes(size))
    good = encode([frame], auth.Seal(KEY))
    for at in (0, 30, len(good) - 1):  # head, payload, tag
        bad = bytearray(good)
        bad[at] ^= 1
        dec = FrameDecoder(auth.Seal(KEY))
        with pytest.raises(RemoteProtocolError):
            decode(dec, bytes(bad))
    dec = FrameDecoder(auth.Seal(KEY))
    with pytest.raises(RemoteProtocolError, match="authentication tag"):
        decode(dec, good + good)  # (the second copy has the first one's sequence number)
    # a frame tagged with another key fails too
    with pytest.raises(RemoteProtocolError, match="authentication tag"):
        decode(FrameDecoder(auth.Seal(bytes(32))), good)


def test_an_eof_inside_a_frame_is_told_from_a_clean_close() -> None:
    dec = FrameDecoder()
    data = encode([(Kind.DATA, 1, b"", b"abc")])
    dec.receive_data(data[:10])
    assert dec.next_event() is NEED_DATA and not dec.at_boundary
    dec.receive_data(data[10:])
    assert isinstance(dec.next_event(), Frame)
    assert dec.at_boundary


def test_the_same_host_copy_descriptor_round_trips_and_is_checked() -> None:
    segments = [(0x7F00_0000_1000, 4096), (0x7F00_0000_9000, 1 << 30)]
    desc = pack_cma(77, 4242, segments, prefix_len=5)
    xfer, pid, segs, prefix = unpack_cma(desc + b"hello")
    assert (xfer, pid, segs, bytes(prefix)) == (77, 4242, segments, b"hello")
    assert unpack_cma(pack_cma(1, 2, []))[2] == []
    with pytest.raises(RemoteProtocolError, match="malformed"):
        unpack_cma(desc + b"hell")
    with pytest.raises(RemoteProtocolError, match="too short"):
        unpack_cma(desc[:10])
    assert unpack_ack(pack_ack(0)) == 0 and unpack_ack(pack_ack(13)) == 13
    with pytest.raises(RemoteProtocolError):
        unpack_ack(b"13")
