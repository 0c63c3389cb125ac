"""``torch.distributed.elastic.utils.distributed``'s helpers: a free port, a socket holding one."""

from __future__ import annotations

import socket

__all__ = ["get_free_port", "get_socket_with_port"]


def get_socket_with_port() -> socket.socket:
    """A listening TCP socket on a free port of this host (the caller closes it when the port
    is to be used)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    sock.listen(0)
    return sock


def get_free_port() -> int:
    """A port that was free a moment ago (the rendezvous's pick of one)."""
    from ..rendezvous import _free_port

    return _free_port()
