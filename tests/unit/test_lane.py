"""A shared-memory lane's ring, producer and consumer in one process (the same memfd mapped
twice, as two processes map it)."""

from __future__ import annotations

import os
import struct

import pytest

from tdist._core.errors import DistError, RemoteProtocolError
from tdist.transport._lane import CAPACITY, MAX_RECORD, RECORD, Lane

pytestmark = pytest.mark.timeout(30)


def pair() -> tuple[Lane, Lane]:
    producer = Lane.create()
    return producer, Lane.open(os.getpid(), producer.fd)


def put(lane: Lane, seq: int, tag: int, payload: bytes, meta: bytes = b"") -> bool:
    return lane.put(seq, tag, meta, [memoryview(payload)], len(payload))


def take(lane: Lane) -> tuple[int, int, bytes, bytes] | None:
    rec = lane.peek()
    if rec is None:
        return None
    out = (rec.seq, rec.tag, rec.meta, bytes(rec.payload))
    lane.pop(rec)
    return out


def test_records_come_out_in_order_with_their_tag_meta_and_payload() -> None:
    p, c = pair()
    assert not c.ready() and c.peek() is None
    assert put(p, 0, 7, b"abcd")
    assert put(p, 1, 8, b"", meta=b"fingerprint")
    assert p.put(2, 9, b"m", [memoryview(b"xy"), memoryview(b""), memoryview(b"z")], 3)  # scatter-gather
    assert c.ready()
    assert take(c) == (0, 7, b"", b"abcd")
    assert take(c) == (1, 8, b"fingerprint", b"")
    assert take(c) == (2, 9, b"m", b"xyz")
    assert take(c) is None and not c.ready()
    p.close()
    assert p.fd == -1


def test_a_full_lane_refuses_until_the_consumer_takes_and_records_wrap_around() -> None:
    p, c = pair()
    body = bytes(range(256)) * 40

    def payload(seq: int) -> bytes:  # about 10 KiB, a size of its own: the ring's end falls inside records
        return body[: 10000 + seq % 97]

    seq = 0
    while put(p, seq, 1, payload(seq)):
        seq += 1
    assert 0 < seq * 10000 <= CAPACITY
    assert not put(p, seq, 1, b"x" * 8000)  # full, also for a smaller record that needs room
    # round after round past the ring's end: every record whole, the padding skipped
    taken = 0
    for _ in range(5 * CAPACITY // 10000):
        got = take(c)
        assert got is not None
        assert got[0] == taken and got[3] == payload(taken)
        taken += 1
        while put(p, seq, 1, payload(seq)):
            seq += 1
    # the rest of the records, in order
    while (got := c.peek()) is not None:
        assert got.seq == taken
        c.pop(got)
        taken += 1
    assert taken == seq


def test_a_record_larger_than_the_limit_is_refused() -> None:
    p, c = pair()
    room = MAX_RECORD - RECORD.size
    assert not put(p, 0, 1, b"x" * (room + 1))
    assert put(p, 0, 1, b"x" * room)
    assert take(c) == (0, 1, b"", b"x" * room)


def test_sleepers_are_counted_by_the_consumer_and_seen_by_the_producer() -> None:
    p, c = pair()
    assert p.sleepers() == 0
    c.sleep(1)
    c.sleep(1)
    assert p.sleepers() == 2
    c.sleep(-1)
    c.sleep(-1)
    assert p.sleepers() == 0


def test_a_ring_that_holds_nonsense_is_a_protocol_error() -> None:
    p, c = pair()
    assert put(p, 0, 1, b"abc")
    RECORD.pack_into(p._buf, 0, 0, 1, 1 << 30, 0)  # a length beyond what was written
    with pytest.raises(RemoteProtocolError, match="beyond what was written"):
        c.peek()


def test_what_is_not_a_lane_is_not_opened() -> None:
    with pytest.raises(DistError, match="cannot open"):
        Lane.open(os.getpid(), 1 << 20)  # no such descriptor
    fd = os.memfd_create("not-a-lane")
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(DistError, match="not a tdist lane"):
            Lane.open(os.getpid(), fd)
        p = Lane.create()
        struct.pack_into("<Q", p._mm, 8, 99)  # another version
        with pytest.raises(DistError, match="not a tdist lane of this version"):
            Lane.open(os.getpid(), p.fd)
    finally:
        os.close(fd)
