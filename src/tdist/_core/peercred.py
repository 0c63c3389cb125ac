"""Who is at the other end of a Unix socket (``SO_PEERCRED``), and the rule every tdist
connection over one applies: the other end must be a process of this user.

A Unix socket's name is no proof of who listens on it: an abstract name (``@tdist-store-<port>``)
can be bound by any local user first, and a relay there could pass a handshake through. The
kernel tells both ends who the other one is, so a stranger is refused before a byte is read or
written, and the side that finds one says so at once instead of waiting for a timeout.
"""

from __future__ import annotations

import os
import socket
import struct

from .errors import AuthenticationError

__all__ = ["check_unix_peer", "unix_peer"]

_UCRED = struct.Struct("3i")  # pid, uid, gid


def unix_peer(sock: socket.socket) -> tuple[int, int]:
    """The ``(pid, uid)`` at the other end of a connected Unix socket (the listener's, seen
    from the connecting side)."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def check_unix_peer(sock: socket.socket, what: str, pid: int | None = None) -> None:
    """On a Unix socket: the other end must be a process of this user (and ``pid``, when
    given). Nothing to check on other sockets (their peers prove the job's secret).

    Raises:
        AuthenticationError: a process of another user (or another process) is there.
    """
    if sock.family != socket.AF_UNIX:
        return
    their_pid, uid = unix_peer(sock)
    if uid != os.getuid():
        raise AuthenticationError(
            f"{what}: the Unix socket's other end is pid {their_pid} of user {uid}, not of this "
            f"job's user {os.getuid()}; refused (another user may have taken the socket's name)"
        )
    if pid is not None and their_pid != pid:
        raise AuthenticationError(f"{what}: the Unix socket's other end is pid {their_pid}, not {pid}; refused")
