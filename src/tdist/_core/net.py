"""Addresses written as numbers: what a numeric host is, without asking the resolver (whose
first call in a process loads its configuration and costs a tenth of a millisecond)."""

from __future__ import annotations

import socket

__all__ = ["literal_family", "literal_loopback"]


def literal_family(host: str) -> int | None:
    """``AF_INET`` or ``AF_INET6`` if ``host`` is an IP address written as numbers (an IPv6
    address may carry a ``%zone``), else None (a name, to be resolved)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host.split("%", 1)[0] if family == socket.AF_INET6 else host)
        except (OSError, ValueError):
            continue
        return family
    return None


def literal_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address written as numbers (``127.0.0.0/8``, ``::1``)."""
    family = literal_family(host)
    if family == socket.AF_INET:
        return host.startswith("127.")
    if family == socket.AF_INET6:
        return socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0]) == socket.inet_pton(socket.AF_INET6, "::1")
    return False
