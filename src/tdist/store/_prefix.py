"""``PrefixStore``: a namespace inside another store; every key becomes ``prefix/key``."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from ._api import Store, as_bytes, check_key, key_list, multi_get_within, waits_in_chunks

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """A view of ``store`` in which every key is ``f"{prefix}/{key}"`` (``torch.distributed.PrefixStore``).

    Every call is delegated to the underlying store, so ``PrefixStore`` is as thread-safe as
    that store; values reach it as bytes, as torch's hands them to a ``Store`` subclass. The timeout is the underlying store's: ``set_timeout`` changes it for every
    user of that store, as in torch. Prefix stores nest (``PrefixStore("b", PrefixStore("a",
    s))`` uses keys ``a/b/...``).

    Args:
        prefix: the namespace (may be empty: keys then start with ``/``, as in torch).
        store: the store to delegate to.
    """

    def __init__(self, prefix: str | bytes, store: Store) -> None:
        if isinstance(prefix, bytes):  # (torch's binding takes bytes for its std::string)
            prefix = prefix.decode()
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be str, got {type(prefix).__name__}")
        if store is None:
            raise ValueError("store argument cannot be None")  # (torch's words)
        if not isinstance(store, Store):  # (torch's store: wrapped; anything else: TypeError)
            from ._foreign import as_store

            try:
                store = as_store(store)
            except TypeError:
                raise TypeError(f"PrefixStore store must be a Store, got {type(store).__name__}") from None
        super().__init__(store.timeout)
        self._prefix = prefix
        self._store = store

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{check_key(key)}"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self._key(k) for k in keys]

    # -- what it wraps -------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """The namespace of this store's keys."""
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store this one delegates to (which may itself be a ``PrefixStore``)."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store down the chain that is not a ``PrefixStore`` (torch has this name)."""
        store = self._store
        while isinstance(store, PrefixStore):
            store = store._store
        return store

    # -- timeouts ------------------------------------------------------------------------------
    @property
    def timeout(self) -> timedelta:
        """The underlying store's default timeout."""
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the underlying store's default timeout (for every user of that store)."""
        self._store.set_timeout(timeout)

    # -- the Store API -------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``prefix/key``."""
        self._store.set(self._key(key), as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``prefix/key``, waiting up to the underlying store's timeout.

        Raises:
            StoreTimeoutError: the key was not set in time.
        """
        return self._store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``prefix/key``; returns the new value.

        Raises:
            StoreValueError: the key holds something that is not an integer.
        """
        return self._store.add(self._key(key), amount)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Compare-and-set ``prefix/key``; see ``Store.compare_set``."""
        return self._store.compare_set(self._key(key), as_bytes(expected_value), as_bytes(desired_value))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every ``prefix/key`` is set.

        Raises:
            StoreTimeoutError: naming the (prefixed) keys still missing.
        """
        keys = key_list(keys, "wait")
        self._store.wait(self._keys(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every ``prefix/key`` is set, without waiting."""
        keys = key_list(keys, "check")
        return self._store.check(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        """Delete ``prefix/key``; returns what the underlying store says about its existence."""
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        """The number of keys in the *underlying* store, all prefixes together (as torch)."""
        return self._store.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of every ``prefix/key``, waiting for all of them."""
        keys = key_list(keys, "multi_get")
        return self._store.multi_get(self._keys(keys))

    @property
    def _waits_in_chunks(self) -> bool:  # type: ignore[override]
        return waits_in_chunks(self._store)

    def _multi_get_within(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        """``multi_get`` waiting up to ``timeout`` (``_api.multi_get_within``: one request on
        tdist's ``TCPStore``)."""
        keys = key_list(keys, "multi_get")
        if type(self).multi_get is not PrefixStore.multi_get or type(self).wait is not PrefixStore.wait:
            self.wait(keys, timeout)  # (a subclass's own reads: they are what it says)
            return self.multi_get(keys)
        return multi_get_within(self._store, self._keys(keys), timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set every ``prefix/key`` to the matching value."""
        keys = key_list(keys, "multi_set")
        self._store.multi_set(self._keys(keys), [as_bytes(v) for v in values])

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``prefix/key``."""
        self._store.append(self._key(key), as_bytes(value))

    def list_keys(self) -> list[str]:
        """The keys under this prefix, with the prefix stripped."""
        head = f"{self._prefix}/"
        return [k[len(head) :] for k in self._store.list_keys() if k.startswith(head)]

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Push ``value`` on the queue ``prefix/key``."""
        self._store.queue_push(self._key(key), as_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the head of the queue ``prefix/key``; see ``Store.queue_pop``."""
        return self._store.queue_pop(self._key(key), block)

    def queue_len(self, key: str) -> int:
        """The length of the queue ``prefix/key``."""
        return self._store.queue_len(self._key(key))

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def clone(self) -> PrefixStore:
        """The same prefix over a clone of the underlying store."""
        return PrefixStore(self._prefix, self._store.clone())

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"
