"""Free ports: one that another process is least likely to take before its caller binds it."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_FREE_PORTS_FROM = 15000  # (``free_port`` draws from here to the ephemeral range)
_random = random.SystemRandom()  # (not the caller's seeded ``random``: forked ranks would agree)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may take it before the
    caller binds it).

    It is drawn at random below the kernel's ephemeral range (``ip_local_port_range``), where
    the kernel never puts a port of its own choosing: a port the kernel chose (``bind`` to port
    0, or the local end of an outgoing connection) went, now and then, to another process before
    the caller bound it ("Address already in use" in a loaded test run). Where that range leaves
    no room below it, the kernel chooses.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    if low > _FREE_PORTS_FROM + 1024:
        for _ in range(64):
            port = _random.randrange(_FREE_PORTS_FROM, low)
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # (in use, or in TIME_WAIT: another)
                return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
