"""torch's stores (``torch.distributed.TCPStore``, ``HashStore``, ``FileStore``, a Python
``torch.distributed.Store``) where tdist takes a store: ``as_store`` wraps one in
``ForeignStore``, a tdist ``Store`` that hands every call to it. ``PrefixStore`` and
``init_process_group(store=...)`` wrap a torch store this way, so code ported one file at a time
can pass tdist the store another component made with torch."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ._api import Store

__all__ = ["ForeignStore", "as_store"]


def as_store(store: object) -> Store:
    """``store`` as a tdist ``Store``: itself, or torch's store wrapped.

    Raises:
        TypeError: ``store`` is neither.
    """
    if isinstance(store, Store):
        return store
    c10d = sys.modules.get("torch.distributed")
    torch_store = getattr(c10d, "Store", None)
    if torch_store is not None and isinstance(store, torch_store):
        return ForeignStore(store)
    raise TypeError(f"expected a tdist or torch.distributed Store, got {type(store).__name__}")


def _as_ours(exc: BaseException) -> BaseException:
    """tdist's error for torch's store error ``exc`` (a timeout, an empty queue, a lost
    connection), with its message; ``exc`` itself if it is none of torch's."""
    from .._core import errors

    c10d = sys.modules.get("torch.distributed")
    text = str(exc)
    if isinstance(exc, errors.DistError) or c10d is None or not isinstance(exc, c10d.DistError):
        return exc
    if isinstance(exc, c10d.QueueEmptyError):
        return errors.QueueEmptyError(text)
    if isinstance(exc, c10d.DistNetworkError):
        return errors.DistNetworkError(text)
    if isinstance(exc, c10d.DistStoreError):
        lowered = text.lower()
        if "timeout" in lowered or "timed out" in lowered:
            return errors.StoreTimeoutError(text)
        return errors.DistStoreError(text)
    return errors.DistError(text)


class ForeignStore(Store):
    """A torch store seen as a tdist ``Store`` (see the module docstring). Its timeout is the
    wrapped store's; its errors are tdist's (``StoreTimeoutError``, ``QueueEmptyError``, ...),
    which are torch's too."""

    def __init__(self, store: Any) -> None:
        super().__init__(store.timeout)
        self._store = store

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        """``fn(*args)``, torch's store errors raised as tdist's (which are torch's too), so that
        code catching either, tdist's own among it, sees them."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            ours = _as_ours(exc)
            if ours is exc:
                raise
            try:
                raise ours from exc
            finally:  # (no cycle through this frame: the callers' frames, and what they hold,
                del ours  # torch's stores with their threads among it, go when the error goes)

    @property
    def wrapped(self) -> Any:
        """torch's store."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout  # type: ignore[no-any-return]

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(self._check_timeout(timeout))

    def set(self, key: str, value: str | bytes) -> None:
        self._call(self._store.set, key, value)

    def get(self, key: str) -> bytes:
        return self._call(self._store.get, key)  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        return self._call(self._store.add, key, amount)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call(self._store.compare_set, key, expected_value, desired_value)  # type: ignore[no-any-return]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._call(self._store.wait, list(keys))
        else:
            self._call(self._store.wait, list(keys), self._check_timeout(timeout))

    def check(self, keys: Sequence[str]) -> bool:
        return self._call(self._store.check, list(keys))  # type: ignore[no-any-return]

    def delete_key(self, key: str) -> bool:
        return self._call(self._store.delete_key, key)  # type: ignore[no-any-return]

    def num_keys(self) -> int:
        return self._call(self._store.num_keys)  # type: ignore[no-any-return]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return list(self._call(self._store.multi_get, list(keys)))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._call(self._store.multi_set, list(keys), list(values))

    def append(self, key: str, value: str | bytes) -> None:
        self._call(self._store.append, key, value)

    def list_keys(self) -> list[str]:
        return list(self._call(self._store.list_keys))

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._call(self._store.queue_push, key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._call(self._store.queue_pop, key, block)  # type: ignore[no-any-return]

    def queue_len(self, key: str) -> int:
        return self._call(self._store.queue_len, key)  # type: ignore[no-any-return]

    def has_extended_api(self) -> bool:
        return bool(self._store.has_extended_api())

    def clone(self) -> Store:
        return ForeignStore(self._store.clone())

    def _torch_store(self) -> Any:
        return self._store
