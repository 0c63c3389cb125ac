"""``tdist.elastic.utils.api``: the module path of torch's helpers for launchers: an
environment variable that must be set, a listening socket on a free port, and torchrun's
``${local_rank}`` macro."""

from __future__ import annotations

import os
import socket
from typing import Any

from .._policy import LOCAL_RANK_MACRO, substitute_local_rank

__all__ = ["get_env_variable_or_raise", "get_socket_with_port", "macros"]


def get_env_variable_or_raise(env_name: str) -> str:
    """The value of ``env_name``.

    Raises:
        ValueError: it is not set (torch's message).
    """
    value = os.environ.get(env_name)
    if value is None:
        raise ValueError(f"Environment variable {env_name} expected, but not set")
    return value


def get_socket_with_port() -> socket.socket:
    """A socket listening on a free port of ``localhost`` (the first address family that
    binds); the caller closes it.

    Raises:
        RuntimeError: no family could bind.
    """
    for family, kind, proto, _, _ in socket.getaddrinfo("localhost", None, socket.AF_UNSPEC, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(("localhost", 0))
            sock.listen(0)
            return sock
        except OSError:
            sock.close()
    raise RuntimeError("Failed to create a socket")


class macros:  # (torch's name)
    """torchrun's argument macros: ``local_rank`` is ``${local_rank}``."""

    local_rank = LOCAL_RANK_MACRO

    @staticmethod
    def substitute(args: list[Any], local_rank: str) -> list[Any]:
        """``args`` with the macro replaced by ``local_rank`` in each ``str`` one."""
        return substitute_local_rank(args, local_rank)
