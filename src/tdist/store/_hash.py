"""``HashStore``: a store in one process's memory, for threads of that process.

The data is a ``KVState`` (the same semantics as the store server) behind one lock. Blocking
calls wait on a ``Condition`` of that lock, which every change that can make a key appear
notifies; each waiter re-checks its own keys against one monotonic deadline.

As in torch, a timeout of zero means "wait forever" (``Store::kNoTimeout``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

from .._core.errors import QueueEmptyError, StoreTimeoutError, StoreValueError
from ._api import DEFAULT_TIMEOUT, Store, as_bytes, check_key, key_list
from ._state import KVState, check_amount

__all__ = ["HashStore", "timeout_message"]

_T = TypeVar("_T")


def timeout_message(seconds: float, missing: Sequence[str], where: str, hint: str) -> str:
    """The text of a wait timeout, in the style every tdist store uses."""
    return f"wait timeout after {round(seconds * 1000)}ms, keys: {', '.join(missing)} ({where}; {hint})"


_HINT = "the thread that sets them may be slow, dead, or using other keys"


class _Shared:
    """What every clone of one ``HashStore`` shares: the data, its lock and its condition."""

    __slots__ = ("cond", "state")

    def __init__(self) -> None:
        self.state = KVState()
        self.cond = threading.Condition(threading.Lock())


class HashStore(Store):
    """A thread-safe store in this process's memory (``torch.distributed.HashStore``).

    Every method may be called from any thread; ``clone()`` returns another handle on the same
    data (with its own timeout).
    """

    _waits_in_chunks = True

    def __init__(self) -> None:
        super().__init__(DEFAULT_TIMEOUT)
        self._shared = _Shared()

    # -- helpers -------------------------------------------------------------------------------
    def _wait_for(
        self,
        ready: Callable[[KVState], list[str]],
        take: Callable[[KVState], _T],
        timeout: timedelta | float | None,
    ) -> _T:
        """Wait until ``ready`` (the keys still missing) is empty, then ``take`` under the lock.

        Raises:
            StoreTimeoutError: naming the keys still missing when the timeout expired.
        """
        seconds = self._timeout_seconds(timeout)
        shared = self._shared
        with shared.cond:
            missing = ready(shared.state)
            if not missing:
                return take(shared.state)
            deadline = None if seconds == 0 else time.monotonic() + seconds
            while True:
                if deadline is None:
                    shared.cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise StoreTimeoutError(
                            timeout_message(seconds, missing, "HashStore", _HINT)
                        )
                    shared.cond.wait(remaining)
                missing = ready(shared.state)
                if not missing:
                    return take(shared.state)

    @staticmethod
    def _unset(keys: list[str]) -> Callable[[KVState], list[str]]:
        # get/multi_get need a value: a key that only names a queue does not count
        return lambda state: [k for k in keys if k not in state.data]

    # -- the Store API -------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``, replacing any old value."""
        key, raw = check_key(key), as_bytes(value)
        with self._shared.cond:
            self._shared.state.set(key, raw)
            self._shared.cond.notify_all()

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set.

        Raises:
            StoreTimeoutError: the key was not set in time.
        """
        keys = [check_key(key)]
        return self._wait_for(self._unset(keys), lambda state: state.data[keys[0]], None)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if missing); returns the new value.

        Raises:
            StoreValueError: the key holds something that is not an integer (the store is
                unchanged and stays usable).
        """
        key = check_key(key)
        amount = check_amount(amount)
        with self._shared.cond:
            value = self._shared.state.add(key, amount)
            self._shared.cond.notify_all()
        return value

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (missing = ``b""``).

        Returns:
            The value after the call; for a missing key and a non-empty ``expected_value``,
            ``expected_value`` (as torch does).
        """
        key = check_key(key)
        expected, desired = as_bytes(expected_value), as_bytes(desired_value)
        with self._shared.cond:
            value, changed = self._shared.state.compare_set(key, expected, desired)
            if changed:
                self._shared.cond.notify_all()
        return value

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` is set (or is a non-empty queue).

        Raises:
            StoreTimeoutError: naming the keys still missing when the timeout expired.
        """
        keys = key_list(keys, "wait")
        wanted = [check_key(k) for k in keys]
        self._wait_for(lambda state: state.missing(wanted), lambda state: None, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set (or is a non-empty queue), without waiting."""
        keys = key_list(keys, "check")
        wanted = [check_key(k) for k in keys]
        with self._shared.cond:
            return not self._shared.state.missing(wanted)

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` (and a queue of that name); returns whether it existed."""
        key = check_key(key)
        with self._shared.cond:
            return self._shared.state.delete(key)

    def num_keys(self) -> int:
        """The number of keys (torch's HashStore: 1 after one ``set``)."""
        with self._shared.cond:
            return self._shared.state.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to the store's timeout for all of them.

        Raises:
            StoreTimeoutError: naming the keys still missing when the timeout expired.
        """
        keys = key_list(keys, "multi_get")
        wanted = [check_key(k) for k in keys]
        return self._wait_for(
            self._unset(wanted), lambda state: [state.data[k] for k in wanted], None
        )

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set every key to the matching value, all at once (no reader sees half of them)."""
        keys = key_list(keys, "multi_set")
        if len(keys) != len(values):
            raise StoreValueError(f"multi_set: {len(keys)} keys but {len(values)} values; they must be of the same size")
        pairs = [(check_key(k), as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        with self._shared.cond:
            for k, v in pairs:
                self._shared.state.set(k, v)
            self._shared.cond.notify_all()

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (set it if missing)."""
        key, raw = check_key(key), as_bytes(value)
        with self._shared.cond:
            self._shared.state.append(key, raw)
            self._shared.cond.notify_all()

    def list_keys(self) -> list[str]:
        """Every key in the store."""
        with self._shared.cond:
            return self._shared.state.list_keys()

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Push ``value`` at the tail of the queue ``key``."""
        key, raw = check_key(key), as_bytes(value)
        with self._shared.cond:
            self._shared.state.queue_push(key, raw)
            self._shared.cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the head of the queue ``key``, waiting up to the store's timeout if ``block``.

        Raises:
            QueueEmptyError: ``block`` is False and the queue is empty.
            StoreTimeoutError: nothing was pushed in time.
        """
        key = check_key(key)
        if not block:
            with self._shared.cond:
                value = self._shared.state.queue_pop(key)
            if value is None:
                raise QueueEmptyError(f"queue {key!r} is empty (HashStore)")
            return value

        def empty(state: KVState) -> list[str]:
            return [] if state.queue_len(key) else [key]

        def pop(state: KVState) -> bytes:
            value = state.queue_pop(key)
            assert value is not None
            return value

        return self._wait_for(empty, pop, None)

    def queue_len(self, key: str) -> int:
        """The number of values in the queue ``key``."""
        key = check_key(key)
        with self._shared.cond:
            return self._shared.state.queue_len(key)

    def clone(self) -> HashStore:
        """Another handle on the same data, with this handle's timeout."""
        other = HashStore.__new__(HashStore)
        Store.__init__(other, self._timeout)
        other._shared = self._shared
        return other

    def __repr__(self) -> str:
        return f"HashStore({self.num_keys()} keys)"
