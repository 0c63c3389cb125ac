"""Fault injectors shared by the transport tests."""

from __future__ import annotations

import threading
from typing import Any


class ShortOnce:
    """A socket whose next ``send`` takes only part of what it is given, as a socket with
    little room left does."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.cut = threading.Event()

    def send(self, data: bytes, *flags: int) -> int:
        if not self.cut.is_set():
            self.cut.set()
            return int(self._sock.send(data[:10], *flags))
        return int(self._sock.send(data, *flags))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
