"""The session's frame tags (sans-IO): a frame passes only as it was sent, in its place."""

from __future__ import annotations

import array
import os

import pytest

from tdist._core import auth

pytestmark = pytest.mark.timeout(30)


def _pair() -> tuple[auth.Seal, auth.Seal]:
    key = os.urandom(32)
    return auth.Seal(key), auth.Seal(key)


@pytest.mark.parametrize("size", [0, 100, auth.BULK - 1, auth.BULK, 3 * auth.BULK + 7])
def test_a_frame_checks_as_sent_and_fails_changed_in_one_byte(size: int) -> None:
    send, recv = _pair()
    payload = bytearray(os.urandom(size))
    tag = send.tag(b"head", [memoryview(payload)], size)
    assert recv.check(tag, b"head", [bytes(payload)], size)
    if size:
        payload[size // 2] ^= 1
        tag2 = send.tag(b"head", [memoryview(payload)], size)
        payload[size // 2] ^= 1  # the receiver sees the original bytes: not what was tagged
        assert not recv.check(tag2, b"head", [bytes(payload)], size)


def test_a_payload_tags_as_the_concatenation_of_its_buffers_whatever_their_format() -> None:
    send, recv = _pair()
    floats = array.array("f", range(auth.BULK))  # 4 * BULK bytes, a bulk payload
    tail = b"tail" * 10
    n = len(floats) * 4 + len(tail)
    tag = send.tag(b"h", [memoryview(floats), tail], n)
    assert recv.check(tag, b"h", [memoryview(floats).cast("B").tobytes() + tail], n)


def test_a_replayed_reordered_or_reflected_frame_fails() -> None:
    key = os.urandom(32)
    big = os.urandom(2 * auth.BULK)
    for payload in (b"small", big):
        send, recv = auth.Seal(key), auth.Seal(key)
        first = send.tag(b"a", [payload], len(payload))
        second = send.tag(b"b", [payload], len(payload))
        assert not recv.check(second, b"b", [payload], len(payload))  # out of order
        recv = auth.Seal(key)
        assert recv.check(first, b"a", [payload], len(payload))
        assert not recv.check(first, b"a", [payload], len(payload))  # replayed
    # the two directions of one session have different keys: a frame sent back fails
    c2s, s2c = auth.session_keys(b"secret", os.urandom(32), os.urandom(32))
    tag = auth.Seal(c2s).tag(b"x", [big], len(big))
    assert not auth.Seal(s2c).check(tag, b"x", [big], len(big))


def test_another_key_fails() -> None:
    big = os.urandom(auth.BULK)
    tag = auth.Seal(os.urandom(32)).tag(b"x", [big], len(big))
    assert not auth.Seal(os.urandom(32)).check(tag, b"x", [big], len(big))
