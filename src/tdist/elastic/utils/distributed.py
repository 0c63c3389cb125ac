"""``torch.distributed.elastic.utils.distributed``'s helpers: a store for a group of agents
(``create_c10d_store``), a free port, a socket holding one."""

from __future__ import annotations

import errno
import logging
import socket
from datetime import timedelta
from typing import Any

from ..._core.ports import free_port

__all__ = ["create_c10d_store", "get_free_port", "get_socket_with_port"]

log = logging.getLogger(__name__)

# (torch's key prefix of the check that every member joined: a torch and a tdist agent agree)
_TCP_STORE_INIT = "_tcp_store/num_members"


def _address_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a bind to a port that is taken."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.EADDRINUSE:
            return True
        seen = seen.__cause__
    return False


def create_c10d_store(
    is_server: bool,
    server_addr: str,
    server_port: int = -1,
    world_size: int = 1,
    timeout: float = 600,
    wait_for_workers: bool = True,
    retries: int = 3,
    use_libuv: bool | None = None,
) -> Any:
    """A ``tdist.TCPStore`` at ``server_addr:server_port`` that ``world_size`` members share,
    as torch's: the server (``is_server``) serves it, and with ``wait_for_workers`` every member
    returns once all ``world_size`` have joined.

    Args:
        is_server: this member serves the store.
        server_addr: the server's address.
        server_port: its port; -1: a free one, tried up to ``retries`` times (one member only).
        world_size: the members.
        timeout: seconds for the store's operations and for the members to join.
        wait_for_workers: wait until every member has joined.
        retries: attempts at a free port that turns out to be taken (``server_port`` -1).
        use_libuv: deprecated and ignored, as torch's.

    Returns:
        The store.

    Raises:
        ValueError: ``server_port`` -1 with several members (they could not find the port).
        RuntimeError: the port is taken (``DistNetworkError``).
        TimeoutError: not every member joined within ``timeout``.
    """
    from ... import TCPStore
    from .store import barrier

    if use_libuv is not None:
        log.warning("create_c10d_store: use_libuv is deprecated and ignored (tdist's store has one implementation)")
    if server_port == -1 and world_size > 1:
        raise ValueError(
            f"server_port must be specified when world_size > 1, got server_port={server_port}, world_size={world_size}"
        )
    attempt = 1
    while True:
        port = server_port if server_port != -1 else get_free_port()
        log.info("creating a store on %s:%d (world_size %d, is_server %s, timeout %s s)",
                 server_addr, port, world_size, is_server, timeout)
        try:
            store = TCPStore(server_addr, port, world_size, is_server, timedelta(seconds=timeout), wait_for_workers)
        except RuntimeError as exc:
            if not _address_in_use(exc):
                raise
            if server_port != -1 or attempt >= retries:  # (a port of the caller's is not retried)
                raise RuntimeError(f"on {server_addr}, port: {port} already in use") from exc
            log.warning("port %d already in use, attempt [%d/%d]", port, attempt, retries)
            attempt += 1
            continue
        if wait_for_workers:  # (every member, clients too, returns once all have joined)
            try:
                barrier(store, world_size, key_prefix=_TCP_STORE_INIT, barrier_timeout=timeout)
            except TimeoutError as exc:
                store.close()
                raise TimeoutError(f"timed out waiting for all {world_size} members to join") from exc
        return store


def get_socket_with_port() -> socket.socket:
    """A listening TCP socket on a free port of this host (the caller closes it when the port
    is to be used)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    sock.listen(0)
    return sock


def get_free_port() -> int:
    """A port that was free a moment ago (the rendezvous's pick of one: ``_core.ports``)."""
    return free_port("")
