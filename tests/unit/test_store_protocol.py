"""The store wire protocol and key-value semantics, with bytes alone (no sockets)."""

from __future__ import annotations

import random

import pytest

from tdist._core import auth
from tdist._core.errors import LocalProtocolError, RemoteProtocolError, StoreValueError
from tdist.store._protocol import (
    HEADER,
    FrameDecoder,
    Op,
    Status,
    decode_int,
    encode_frame,
    encode_int,
)
from tdist.store._state import KVState
from tdist.store._torch_wire import MAGIC, Query, QueryDecoder, is_torch_opening

FIELD_SETS = [
    (),
    (b"",),
    (b"key",),
    (b"key", b"value"),
    (b"a", b"", b"ccc"),
    tuple(bytes([i]) * i for i in range(20)),
    (b"x" * 100_000, b"y"),
]


@pytest.mark.parametrize("fields", FIELD_SETS)
def test_roundtrip(fields: tuple[bytes, ...]) -> None:
    data = encode_frame(Op.SET, fields)
    dec = FrameDecoder()
    dec.feed(data)
    frame = dec.next_frame()
    assert frame is not None
    assert frame.code == Op.SET
    assert frame.fields == list(fields)
    assert dec.next_frame() is None
    assert dec.buffered == 0
    whole = FrameDecoder().parse_whole(data)
    assert whole == frame


def test_byte_by_byte_and_batched() -> None:
    frames = [encode_frame(Op.ADD, (b"k", encode_int(i))) for i in range(50)]
    stream = b"".join(frames)
    dec = FrameDecoder()
    got = []
    for i in range(len(stream)):
        dec.feed(stream[i : i + 1])
        while (f := dec.next_frame()) is not None:
            got.append(decode_int(f.fields[1]))
    assert got == list(range(50))
    dec.feed(stream)
    batch = []
    while (f := dec.next_frame()) is not None:
        batch.append(f)
    assert len(batch) == 50


def test_parse_whole_declines_partial_or_multiple() -> None:
    one = encode_frame(Status.OK, (b"v",))
    dec = FrameDecoder()
    assert dec.parse_whole(one[:-1]) is None
    assert dec.parse_whole(one + one) is None
    dec.feed(one[:3])
    assert dec.parse_whole(one) is None  # something is buffered: must go the slow way


def test_oversized_frame_rejected_before_buffering() -> None:
    dec = FrameDecoder(max_frame=1000)
    dec.feed(HEADER.pack(10_000, Op.SET, 2))
    with pytest.raises(RemoteProtocolError, match="exceeds the limit of 1000"):
        dec.next_frame()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (HEADER.pack(5, Op.SET, 1000), "claims 1000 fields"),
        (HEADER.pack(5 + 4 + 2, Op.SET, 1) + (100).to_bytes(4, "little") + b"ab", "past the end"),
        (HEADER.pack(5 + 2, Op.SET, 0) + b"zz", "stray bytes"),
        ((2).to_bytes(4, "little") + b"\x01\x02", "shorter than its header"),
        (HEADER.pack(5 + 8, Op.SET, 2) + (2).to_bytes(4, "little") + b"abzz", "inside a field length"),
    ],
)
def test_malformed_frames(raw: bytes, match: str) -> None:
    dec = FrameDecoder()
    dec.feed(raw)
    with pytest.raises(RemoteProtocolError, match=match):
        dec.next_frame()


def test_random_bytes_never_crash_the_decoder() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        dec = FrameDecoder(max_frame=1 << 16)
        dec.feed(rng.randbytes(rng.randint(0, 64)))
        try:
            while dec.next_frame() is not None:
                pass
        except RemoteProtocolError:
            pass


def test_parse_whole_agrees_with_next_frame() -> None:
    # parse_whole has its own fast paths for one and two fields: on any single-frame input it
    # must return what the general decoder returns, or decline (None), or raise the same way
    rng = random.Random(99)
    for _ in range(3000):
        fields = [rng.randbytes(rng.randint(0, 12)) for _ in range(rng.randint(0, 3))]
        data = bytearray(encode_frame(rng.choice([Op.ADD, Op.GET, Status.OK]), fields))
        if rng.random() < 0.5:  # corrupt a byte of the header or a field length
            data[rng.randrange(min(len(data), 17))] = rng.randrange(256)
        raw = bytes(data)
        dec = FrameDecoder(max_frame=1 << 16)
        dec.feed(raw)
        try:
            expected = dec.next_frame()
            rest = dec.buffered
        except RemoteProtocolError:
            expected, rest = RemoteProtocolError, 0
        try:
            got = FrameDecoder(max_frame=1 << 16).parse_whole(raw)
        except RemoteProtocolError:
            assert expected is RemoteProtocolError, raw
            continue
        if got is not None:
            assert got == expected and rest == 0, raw


def test_ints() -> None:
    for v in (0, 1, -1, 2**63 - 1, -(2**63)):
        assert decode_int(encode_int(v)) == v
    with pytest.raises(LocalProtocolError):
        encode_int(2**63)
    with pytest.raises(RemoteProtocolError):
        decode_int(b"\x00" * 7)


def test_kv_semantics_match_torch() -> None:
    s = KVState()
    # compare_set: missing key with empty expected sets; with other expected returns expected
    assert s.compare_set("k", b"", b"v1") == (b"v1", True)
    assert s.compare_set("k", b"x", b"v2") == (b"v1", False)
    assert s.compare_set("k", b"v1", b"v3") == (b"v3", True)
    assert s.compare_set("nokey", b"abc", b"v") == (b"abc", False)
    assert "nokey" not in s.data
    assert s.add("c", 5) == 5
    assert s.add("c", -2) == 3
    assert s.data["c"] == b"3"
    s.set("n", b"abc")
    with pytest.raises(StoreValueError, match=r"'n'.*not an integer"):
        s.add("n", 1)
    assert s.data["n"] == b"abc"
    s.append("a", b"x")
    s.append("a", b"y")
    assert s.data["a"] == b"xy"
    assert s.delete("a") is True
    assert s.delete("a") is False
    s.queue_push("q", b"1")
    s.queue_push("q", b"2")
    assert s.present("q") and s.queue_len("q") == 2
    assert s.queue_pop("q") == b"1"
    assert s.queue_pop("q") == b"2"
    assert s.queue_pop("q") is None
    assert not s.present("q")
    assert sorted(s.list_keys()) == ["c", "k", "n"]
    assert s.num_keys() == 3


def test_auth_proofs() -> None:
    secret = b"s3cret"
    ns, nc = auth.make_nonce(), auth.make_nonce()
    proof = auth.client_proof(secret, ns, nc)
    assert auth.verify(auth.client_proof(secret, ns, nc), proof)
    assert not auth.verify(auth.client_proof(b"other", ns, nc), proof)
    # the two directions differ, so a proof cannot be reflected back
    assert auth.server_proof(secret, ns, nc) != proof
    assert auth.resolve_secret("abc") == b"abc"
    assert auth.resolve_secret(b"") is None


# bytes that torch's own client sent (recorded between it and torch's server): VALIDATE and
# PING as it connects, its ADD of "init/", then a set, a wait, a get, a multi_set, a cancel
TORCH_CLIENT_BYTES = (
    b"\x00\xce\xf7\x85<\r\x91m\x00\x00"
    b"\x04\x05\x00\x00\x00\x00\x00\x00\x00init/\x01\x00\x00\x00\x00\x00\x00\x00"
    b"\x01\x02\x00\x00\x00\x00\x00\x00\x00/k\x01\x00\x00\x00\x00\x00\x00\x00v"
    b"\x06\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00/k"
    b"\x03\x02\x00\x00\x00\x00\x00\x00\x00/k"
    b"\x0b\x02\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00/p"
    b"\x01\x00\x00\x00\x00\x00\x00\x001\x02\x00\x00\x00\x00\x00\x00\x00/q\x01\x00\x00\x00\x00\x00\x00\x002"
    b"\x0c"
)
TORCH_CLIENT_QUERIES = [
    (Query.VALIDATE, [MAGIC]),
    (Query.PING, [0x6D91]),
    (Query.ADD, [b"init/", 1]),
    (Query.SET, [b"/k", b"v"]),
    (Query.WAIT, [b"/k"]),
    (Query.GET, [b"/k"]),
    (Query.MULTI_SET, [b"/p", b"1", b"/q", b"2"]),
    (Query.CANCEL_WAIT, []),
]


@pytest.mark.parametrize("piece", [1, 3, 7, len(TORCH_CLIENT_BYTES)])
def test_torch_queries_decode_from_any_split_of_the_bytes(piece: int) -> None:
    dec = QueryDecoder(1 << 20)
    got = []
    for i in range(0, len(TORCH_CLIENT_BYTES), piece):
        dec.feed(TORCH_CLIENT_BYTES[i : i + piece])
        while (query := dec.next_query()) is not None:
            got.append(query)
    assert got == TORCH_CLIENT_QUERIES
    assert dec.buffered == 0 and dec.peek() is None


def test_torch_openings_and_bad_queries() -> None:
    assert is_torch_opening(TORCH_CLIENT_BYTES[:2]) is None
    assert is_torch_opening(TORCH_CLIENT_BYTES[:5]) is True
    assert is_torch_opening(b"TDS\x01") is False
    assert is_torch_opening(b"\x00\x01") is False
    for bad, match in (
        (b"\x63", "unknown torch TCPStore query type 99"),
        (b"\x03" + (1 << 21).to_bytes(8, "little"), "exceeds the limit"),
        (b"\x06" + (1 << 40).to_bytes(8, "little"), "names 1099511627776 keys"),
    ):
        dec = QueryDecoder(1 << 20)
        dec.feed(bad)
        with pytest.raises(RemoteProtocolError, match=match):
            dec.next_query()
    dec = QueryDecoder(1 << 20)
    dec.feed(b"\x03" + (4).to_bytes(8, "little") + b"/ab")  # (one byte of the key to come)
    assert dec.next_query() is None and dec.buffered == 12 and dec.peek() == Query.GET
    dec.feed(b"c")
    assert dec.next_query() == (Query.GET, [b"/abc"])
