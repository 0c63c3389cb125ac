"""Agents' store helpers, as ``torch.distributed.elastic.utils.store`` has them, with its keys
(a tdist and a torch process may meet through them): ``synchronize`` (each rank's bytes to
every rank), ``get_all``, ``barrier`` and ``store_timeout``. Any store works, torch's too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["barrier", "get_all", "store_timeout", "synchronize"]


@contextlib.contextmanager
def store_timeout(store: Any, timeout: float) -> Iterator[None]:
    """``store``'s timeout set to ``timeout`` seconds for the block, then given back."""
    old = store.timeout
    store.set_timeout(timedelta(seconds=timeout))
    try:
        yield
    finally:
        store.set_timeout(old)


def _arrive(store: Any, world_size: int, key_prefix: str) -> str:
    """Count this caller in; the last of ``world_size`` sets the key that ends the wait.
    Returns that key."""
    last = f"{key_prefix}/last_member"
    if store.add(f"{key_prefix}/num_members", 1) == world_size:
        store.set(last, "<val_ignored>")
    return last


def get_all(store: Any, rank: int, prefix: str, world_size: int) -> list[bytes]:
    """The values of ``prefix0`` .. ``prefix<world_size - 1>``, waiting for all of them. Rank 0
    returns last (its process may host the store the others still read)."""
    values: list[bytes] = list(store.multi_get([f"{prefix}{i}" for i in range(world_size)]))
    done = _arrive(store, world_size, f"{prefix}/finished")
    if rank == 0:
        store.wait([done])
    return values


def synchronize(store: Any, data: bytes, rank: int, world_size: int, key_prefix: str, timeout: float = 300) -> list[bytes]:
    """Publish ``data`` as this rank's and return every rank's, in rank order, within
    ``timeout`` seconds."""
    with store_timeout(store, timeout):
        store.set(f"{key_prefix}{rank}", data)
        return get_all(store, rank, key_prefix, world_size)


def barrier(
    store: Any,
    world_size: int,
    key_prefix: str,
    barrier_timeout: float = 300,
    rank: int | None = None,
    rank_tracing_decoder: Any = None,
    trace_timeout: float = 10,
) -> None:
    """Wait until ``world_size`` callers have called this with ``key_prefix`` (a fresh prefix
    per barrier). With ``rank``, a timeout names the ranks that never came.

    Raises:
        the store's timeout error: not every caller came within ``barrier_timeout`` seconds.
    """
    with store_timeout(store, barrier_timeout):
        if rank is not None:
            store.set(f"{key_prefix}/rank_{rank}", "1")
        last = _arrive(store, world_size, key_prefix)
        try:
            store.wait([last])
        except Exception as exc:
            if rank is None:
                raise
            missing = [r for r in range(world_size) if not store.check([f"{key_prefix}/rank_{r}"])]
            raise type(exc)(f"{exc}; ranks that never reached barrier {key_prefix!r}: {missing}") from exc
