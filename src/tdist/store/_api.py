"""The ``Store`` API: torch.distributed's names and semantics, shared by every store.

Values are bytes; ``str`` values are UTF-8 encoded, as torch does. Keys are ``str``. Every
blocking call takes the store's timeout unless given one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .._core.deadline import to_seconds
from .._core.errors import DistStoreError, StoreValueError

__all__ = ["DEFAULT_TIMEOUT", "Store", "as_bytes", "check_key", "multi_get_within", "waits_in_chunks"]

DEFAULT_TIMEOUT = timedelta(seconds=300)


def as_bytes(value: str | bytes | bytearray | memoryview, what: str = "value") -> bytes:
    """Normalize a store value to bytes (``str`` is UTF-8 encoded).

    Raises:
        TypeError: for any other type.
    """
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):  # (a subclass, numpy's bytes_: stored and read back as bytes)
        return bytes(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {what} must be str or bytes, got {type(value).__name__}")


def key_list(keys: object, what: str) -> Sequence[str]:
    """``keys``, a list (or other sequence) of keys; one ``str`` is refused, as torch's binding
    refuses it (taken as its characters, ``wait("key")`` would wait for ``k``, ``e`` and ``y``).

    Raises:
        TypeError: ``keys`` is a str or bytes.
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{what}(): keys must be a list of str, got {type(keys).__name__}: {keys!r}")
    return keys  # type: ignore[return-value]


def check_key(key: object) -> str:
    """A store key: a ``str``, or ``bytes`` of UTF-8 (torch's binding takes both).

    Raises:
        TypeError: anything else.
    """
    if not isinstance(key, str):
        if isinstance(key, bytes):
            try:
                return key.decode()
            except UnicodeDecodeError:
                raise TypeError(f"store key must be str or UTF-8 bytes, got {key!r}") from None
        raise TypeError(f"store key must be str, got {type(key).__name__}: {key!r}")
    return key



def multi_get_within(store: Any, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
    """The values of ``keys``, waiting up to ``timeout`` for all of them: one waiting
    ``multi_get`` where the store's own timeout is ``timeout`` (the usual case: a group's store
    has the group's timeout), else a ``wait`` with it, then the ``multi_get``. Any store,
    torch's included.

    Raises:
        the store's timeout error: a key is still missing at the timeout.
    """
    within = getattr(store, "_multi_get_within", None)  # (tdist's TCPStore: a wait of any length in one request)
    if within is not None:
        return list(within(keys, timeout))
    if getattr(store, "timeout", None) != timeout:
        store.wait(list(keys), timeout)
    return list(store.multi_get(list(keys)))

def waits_in_chunks(store: Any) -> bool:
    """Whether ``store`` takes short waits cheaply and quietly (``Store._waits_in_chunks``)."""
    return bool(getattr(store, "_waits_in_chunks", False))


class Store:
    """Base class of every store; a Python subclass may implement the abstract methods.

    Thread-safety: every concrete store in tdist may be used from several threads at once.
    """

    # Whether a wait shorter than the store's timeout is cheap and quiet, and ends in tdist's
    # ``StoreTimeoutError``: a caller that waits long may then wait a second at a time, looking
    # around between its waits (tdist's own stores; not torch's, whose client logs each one)
    _waits_in_chunks = False

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self._timeout = self._check_timeout(timeout)

    @staticmethod
    def _check_timeout(timeout: timedelta | float) -> timedelta:
        if timeout is None:  # (torch's binding: a timedelta is required)
            raise TypeError("store timeout must be a datetime.timedelta (or seconds), got None")
        seconds = to_seconds(timeout)
        assert seconds is not None
        return timedelta(seconds=seconds)  # (at most FOREVER: timedelta.max is 31 years)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A store is a connection or a handle of this process, as torch's: it neither pickles
        nor copies (a copy sharing the socket or the file, closed when the copy goes, broke
        the original). ``clone()`` makes a new connection where there is one to make."""
        raise TypeError(f"cannot pickle {type(self).__name__!r} object")

    # -- timeouts ------------------------------------------------------------------------------
    @property
    def timeout(self) -> timedelta:
        """The default timeout of blocking calls."""
        try:
            return self._timeout
        except AttributeError:  # (a subclass whose __init__ did not call Store's)
            raise TypeError(f"{type(self).__name__}.__init__() must call Store.__init__()") from None

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default timeout of blocking calls (``get``, ``wait``, ...)."""
        self._timeout = self._check_timeout(timeout)

    def _timeout_seconds(self, timeout: timedelta | float | None) -> float:
        seconds = to_seconds(timeout, self._timeout.total_seconds())
        assert seconds is not None
        return seconds

    # -- the core API --------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``, replacing any old value."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set.

        Raises:
            StoreTimeoutError: the key did not appear in time.
        """
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if missing); returns the new value.

        Raises:
            StoreValueError: the key holds something that is not an integer.
        """
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``.

        A missing key counts as holding ``b""``. Returns the value after the call, except that a
        missing key with a non-empty ``expected_value`` returns ``expected_value`` (as torch).
        """
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` is set.

        Raises:
            StoreTimeoutError: naming the keys still missing when the timeout expired.
        """
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def num_keys(self) -> int:
        """The number of keys in the store."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    # -- the extended API ----------------------------------------------------------------------
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting for all of them."""
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set every key to the matching value."""
        if len(keys) != len(values):
            raise StoreValueError(f"multi_set: {len(keys)} keys but {len(values)} values; they must be of the same size")
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (set it if missing). This default, for a
        subclass that implements only the core API, reads what the key holds (``check``,
        ``get``) and goes through ``compare_set`` until no other writer came in between.

        A subclass without ``check`` gets torch's base class's way, ``compare_set`` alone: the
        first sets a missing key or says what it holds, each next one appends to what the last
        one said. (It cannot tell a key that holds ``value`` already from one it just set: such
        an append changes nothing, as torch's.)"""
        tail = as_bytes(value)
        try:
            expected = self.get(key) if self.check([key]) else b""  # (a missing key holds b"")
        except NotImplementedError:  # (no check: start from b"", which compare_set corrects)
            expected = b""
        while True:
            current = self.compare_set(key, expected, expected + tail)
            if current == expected + tail:
                return
            expected = current

    def list_keys(self) -> list[str]:
        """Every key in the store."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Push ``value`` at the tail of the queue ``key``."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the head of the queue ``key``, waiting up to the timeout if ``block``.

        Raises:
            QueueEmptyError: ``block`` is False and the queue is empty.
            StoreTimeoutError: nothing arrived in time.
        """
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def queue_len(self, key: str) -> int:
        """The number of values in the queue ``key``."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def has_extended_api(self) -> bool:
        """Whether the store has the queue and key-listing calls: every tdist store; a Python
        subclass where it implements them (``queue_push`` and the rest), as torch's base
        class says ``False``."""
        return type(self).queue_push is not Store.queue_push

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        """Block until ``world_size`` callers have called ``barrier`` with this ``key``."""
        if world_size < 1:
            raise ValueError(f"barrier: world_size must be positive, got {world_size}")
        arrived = self.add(f"{key}/arrived", 1)
        if arrived == world_size:
            self.set(f"{key}/done", b"1")
        elif arrived > world_size:
            raise DistStoreError(
                f"barrier {key!r}: {arrived} callers arrived for a world size of {world_size}; "
                "use a fresh key for each barrier"
            )
        self.wait([f"{key}/done"], timeout)

    def clone(self) -> Store:
        """A new handle on the same store, for use from another thread."""
        raise NotImplementedError("Not implemented.")  # (torch's words)

    def _torch_store(self) -> Any:
        """torch's store that this one hands its calls to (``None``: none, a store of tdist's
        own): its client is torch's C++ one (see ``c10d._desync.Responder``)."""
        return None
