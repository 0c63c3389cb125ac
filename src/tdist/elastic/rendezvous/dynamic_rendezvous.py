"""``tdist.elastic.rendezvous.dynamic_rendezvous``: torch's module path of the dynamic
rendezvous, with tdist's implementation (``_dynamic``, ``_state``).

Besides the handler the c10d and etcd backends make, torch's API lets a program bring its own
state holder: a ``RendezvousBackend`` (``get_state()``, ``set_state(state, token)``: a
compare-and-set whose fencing token is opaque to the handler) and a ``Store`` that the rounds'
nodes share::

    store = TCPStore(host, port, is_master=...)
    backend = C10dRendezvousBackend(store, "my_run_id")
    handler = DynamicRendezvousHandler.from_backend(
        run_id="my_run_id", store=store, backend=backend, min_nodes=2, max_nodes=4)

The handler then keeps its state through the backend (``_BackendStateStore``: the state
executor's compare-and-set mapped onto ``set_state`` with the token last seen) and gives each
round's nodes ``store`` under the prefix ``torch.rendezvous.<run_id>.<round>``. A backend has
no way to wake a waiter, so a node that waits for the state to change reads it again every
few milliseconds at first, then every 0.1 s.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from ...store._api import Store, as_bytes
from ..events import NodeState, construct_and_record_rdzv_event
from . import RendezvousParameters
from ._dynamic import DynamicRendezvousHandler

__all__ = ["DynamicRendezvousHandler", "RendezvousBackend", "RendezvousSettings", "RendezvousTimeout", "Token", "create_handler"]

Token = Any
"""A backend's fencing token: opaque to the handler, handed back to ``set_state``."""


class RendezvousBackend(ABC):
    """Where a rendezvous state lives: one record, changed by compare-and-set."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The backend's name (the handler's ``get_backend()``)."""

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its fencing token; None while there is none.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the state is corrupt.
        """

    @abstractmethod
    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored state's token is ``token`` (None: if there is no state
        yet); returns the state stored after the call, its token and whether the write took.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the state is corrupt.
        """


class RendezvousTimeout:
    """The timeouts of a rendezvous (None: torch's default): ``join`` (600 s) bounds
    ``next_rendezvous``; ``last_call`` (30 s) is how long a round that has ``min_nodes`` waits
    for more; ``close`` (30 s) bounds ``set_closed``/``shutdown``; ``heartbeat`` (5 s) bounds a
    keep-alive.

    Raises:
        ValueError: a timeout that is not positive.
    """

    _DEFAULTS: ClassVar[dict[str, timedelta]] = {
        "join": timedelta(seconds=600),
        "last_call": timedelta(seconds=30),
        "close": timedelta(seconds=30),
        "heartbeat": timedelta(seconds=5),
    }

    def __init__(
        self,
        join: timedelta | None = None,
        last_call: timedelta | None = None,
        close: timedelta | None = None,
        heartbeat: timedelta | None = None,
    ) -> None:
        given = {"join": join, "last_call": last_call, "close": close, "heartbeat": heartbeat}
        values: dict[str, timedelta] = {}
        for name, value in given.items():
            value = self._DEFAULTS[name] if value is None else value
            if value <= timedelta(0):
                raise ValueError(f"The {name} timeout ({value}) must be positive.")
            values[name] = value
        self._join, self._last_call = values["join"], values["last_call"]
        self._close, self._heartbeat = values["close"], values["heartbeat"]

    @property
    def join(self) -> timedelta:
        return self._join

    @property
    def last_call(self) -> timedelta:
        return self._last_call

    @property
    def close(self) -> timedelta:
        return self._close

    @property
    def heartbeat(self) -> timedelta:
        return self._heartbeat

    def __repr__(self) -> str:
        return f"RendezvousTimeout(join={self._join}, last_call={self._last_call}, close={self._close}, heartbeat={self._heartbeat})"


@dataclass(repr=False, eq=False, frozen=True)
class RendezvousSettings:
    """A rendezvous's settings (torch's record)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    timeout: RendezvousTimeout
    keep_alive_interval: timedelta
    keep_alive_max_attempt: int


_POLL_FIRST, _POLL_MOST = 0.005, 0.1  # (how often a waiter reads a backend's state: doubling)


class _BackendStateStore(Store):
    """The part of the ``Store`` API the state executor uses, over a ``RendezvousBackend``:
    ``compare_set`` of the state is ``set_state`` with the token of the state expected (the one
    last seen, else read again); the change markers are not kept (``set``/``delete_key`` do
    nothing) and ``wait_for_change`` polls ``get_state`` instead. One per handler (it remembers
    the last state seen and its token)."""

    def __init__(self, backend: RendezvousBackend) -> None:
        super().__init__()
        self.backend = backend
        self._raw, self._token = b"", None  # the state last seen and its token

    def _seen(self, result: tuple[Any, ...] | None) -> bytes:
        if result is None:
            self._raw, self._token = b"", None
        else:
            self._raw, self._token = bytes(result[0]), result[1]
        return self._raw

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected, desired = as_bytes(expected_value), as_bytes(desired_value)
        token: Token | None = None
        if expected:
            if expected != self._raw or self._token is None:
                current = self._seen(self.backend.get_state())
                if current != expected:
                    return current  # (lost: the state is another's)
            token = self._token
        return self._seen(self.backend.set_state(desired, token))

    def get(self, key: str) -> bytes:
        return self._seen(self.backend.get_state())

    def set(self, key: str, value: str | bytes) -> None:
        """(the change markers: a backend has none)"""

    def delete_key(self, key: str) -> bool:
        return False

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self.wait_for_change(list(keys), self._timeout_seconds(timeout))

    def wait_for_change(self, keys: list[str], seconds: float) -> None:
        """Return once the backend's state differs from the one last seen, or after
        ``seconds``."""
        end = time.monotonic() + seconds
        delay = _POLL_FIRST
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(delay, left))
            result = self.backend.get_state()
            if (b"" if result is None else bytes(result[0])) != self._raw:
                return
            delay = min(delay * 2, _POLL_MOST)


def _timeout_option(params: RendezvousParameters, name: str) -> timedelta | None:
    value = params.get(f"{name}_timeout")
    if value is None:
        return None
    return value if isinstance(value, timedelta) else timedelta(seconds=float(value))


def create_handler(store: Store, backend: RendezvousBackend, params: RendezvousParameters) -> DynamicRendezvousHandler:
    """A ``DynamicRendezvousHandler`` over ``backend`` whose rounds share ``store``, from
    ``params``: ``join_timeout`` (600 s), ``last_call_timeout`` (30 s), ``close_timeout``
    (30 s), ``heartbeat_timeout`` (5 s), ``keep_alive_interval`` (5 s),
    ``keep_alive_max_attempt`` (3).

    Raises:
        ValueError: a timeout that is not positive. TypeError: an option given as None.
    """
    try:
        timeout = RendezvousTimeout(*(_timeout_option(params, n) for n in ("join", "last_call", "close", "heartbeat")))
        interval = params.get("keep_alive_interval", 5)
        attempts = params.get_as_int("keep_alive_max_attempt", 3)
        if interval is None:
            raise TypeError("You passed 'keep_alive_interval=None' as a rendezvous configuration option")
        if attempts is None:
            raise TypeError("You passed 'keep_alive_max_attempt=None' as a rendezvous configuration option")
        return DynamicRendezvousHandler.from_backend(
            params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
            keep_alive_interval=float(interval), keep_alive_max_attempt=attempts,
        )
    except Exception as exc:
        construct_and_record_rdzv_event(params.run_id, f"{type(exc).__name__}: {exc}", NodeState.FAILED)
        raise
