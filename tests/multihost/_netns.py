"""Several hosts on one machine: network namespaces on a bridge, made and removed by the tests.

Each host is a namespace with one veth into a bridge that lives in a "switch" namespace, and an
address 10.77.0.<i+1>/24 that exists only inside these namespaces.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    ns: str
    addr: str
    ifname: str  # its interface (gloo needs GLOO_SOCKET_IFNAME to find it)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts joined by a bridge; removed on exit."""
    tag = f"td{os.getpid() % 100000}"
    switch = f"{tag}sw"
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        result = []
        for i in range(n):
            ns = f"{tag}h{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            host_if, sw_if = f"{tag}e{i}", f"{tag}s{i}"
            _ip("link", "add", host_if, "type", "veth", "peer", "name", sw_if)
            _ip("link", "set", host_if, "netns", ns)
            _ip("link", "set", sw_if, "netns", switch)
            _ip("-n", switch, "link", "set", sw_if, "master", "br0")
            _ip("-n", switch, "link", "set", sw_if, "up")
            addr = f"10.77.0.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", host_if)
            _ip("-n", ns, "link", "set", host_if, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            result.append(Host(ns, addr, host_if))
        yield result
    finally:
        for ns in reversed(made):
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", ns)


def command(host: Host, argv: list[str]) -> list[str]:
    """``argv`` run inside ``host``'s namespace."""
    return ["ip", "netns", "exec", host.ns, *argv]
