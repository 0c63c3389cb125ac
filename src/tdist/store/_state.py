"""Key-value semantics shared by the store server and ``HashStore``: pure, no I/O, no locks.

Callers serialize access (the server's single loop, or ``HashStore``'s lock). Each mutating
method returns nothing; callers learn which keys changed from the method they called.
"""

from __future__ import annotations

import operator
import re
from collections import deque

from .._core.errors import StoreValueError

__all__ = ["KVState", "check_amount", "parse_counter", "wrap_int64"]


def wrap_int64(value: int) -> int:
    """``value`` as a signed 64-bit integer (a counter wraps around, as torch's stores'
    ``int64_t`` does)."""
    if -(1 << 63) <= value < (1 << 63):
        return value
    return ((value + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def check_amount(amount: object) -> int:
    """``add``'s ``amount`` as an int of 64 bits: an int, or what stands for one (``__index__``:
    a numpy integer, a one-element integer tensor, a bool), as torch's binding of ``int64_t``
    takes it.

    Raises:
        TypeError: nothing an int stands for (a float, a string), or outside the signed
            64-bit range.
    """
    if type(amount) is not int:
        try:
            amount = operator.index(amount)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"add: amount must be int, got {type(amount).__name__}") from None
    assert isinstance(amount, int)
    if not -(1 << 63) <= amount < (1 << 63):
        raise TypeError(f"add: amount {amount} does not fit in a signed 64-bit integer")
    return amount


_DECIMAL = re.compile(rb"\s*[+-]?[0-9]+\s*")


def parse_counter(key: str, raw: bytes) -> int:
    """The integer stored at ``key``: decimal text of a signed 64-bit integer, as torch stores
    it (``add`` and ``set``).

    Raises:
        StoreValueError: anything else (torch's parse fails on a number out of range too).
    """
    if _DECIMAL.fullmatch(raw):
        value = int(raw)
        if -(1 << 63) <= value < (1 << 63):
            return value
    shown = raw[:40]
    raise StoreValueError(
        f"add: key {key!r} holds {shown!r}{'...' if len(raw) > 40 else ''}, which is not an "
        "integer of 64 bits; add only works on keys created by add or set to decimal text"
    )


class KVState:
    """The data of a store: a dict of bytes and a dict of FIFO queues."""

    __slots__ = ("data", "queues")

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}

    def present(self, key: str) -> bool:
        """Set, or a non-empty queue (``wait``/``check`` work on queues, as in torch)."""
        return key in self.data or bool(self.queues.get(key))

    def missing(self, keys: list[str]) -> list[str]:
        """Keys that ``wait`` still waits for (a non-empty queue counts as present)."""
        return [k for k in keys if not self.present(k)]

    def missing_values(self, keys: list[str]) -> list[str]:
        """Keys that ``get``/``multi_get`` still wait for (queues do not count)."""
        data = self.data
        return [k for k in keys if k not in data]

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def add(self, key: str, amount: int) -> int:
        data = self.data
        raw = data.get(key)
        if raw is None:
            value = amount
        else:
            # (plain digits short enough for 64 bits, the usual counter: int() at once)
            value = (int(raw) if raw.isdigit() and len(raw) < 19 else parse_counter(key, raw)) + amount
        if not -(1 << 63) <= value < (1 << 63):
            value = wrap_int64(value)
        data[key] = b"%d" % value
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> tuple[bytes, bool]:
        """Returns (value reported to the caller, whether the key changed)."""
        current = self.data.get(key)
        if current is None:
            if expected == b"":
                self.data[key] = desired
                return desired, True
            return expected, False
        if current == expected:
            self.data[key] = desired
            return desired, True
        return current, False

    def append(self, key: str, value: bytes) -> None:
        self.data[key] = self.data.get(key, b"") + value

    def delete(self, key: str) -> bool:
        # as torch: a queue of the same name is not a key and stays
        return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.data)

    def list_keys(self) -> list[str]:
        return list(self.data)

    def queue_push(self, key: str, value: bytes) -> None:
        self.queues.setdefault(key, deque()).append(value)

    def queue_pop(self, key: str) -> bytes | None:
        q = self.queues.get(key)
        if not q:
            return None
        value = q.popleft()
        if not q:
            del self.queues[key]
        return value

    def queue_len(self, key: str) -> int:
        q = self.queues.get(key)
        return len(q) if q else 0
