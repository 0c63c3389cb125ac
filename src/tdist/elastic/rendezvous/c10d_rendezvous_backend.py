"""``tdist.elastic.rendezvous.c10d_rendezvous_backend``: torch's ``RendezvousBackend`` over a
c10d store, for ``DynamicRendezvousHandler.from_backend`` / ``create_handler``.

The state is one key of the store, ``torch.rendezvous.<run_id>``, written by the store's
``compare_set``; its value is the state in base64, and the value itself is the fencing token.
Until a state is written the key holds a marker that stands for "no state" (a store's ``get``
of a missing key would block).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from ..._core.errors import DistError
from ...store._api import Store
from ..events import NodeState, construct_and_record_rdzv_event
from . import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    _c10d_store_options,
    _rendezvous_file,
    parse_rendezvous_endpoint,
)
from .dynamic_rendezvous import RendezvousBackend, Token

__all__ = ["DEFAULT_PORT", "C10dRendezvousBackend", "create_backend"]

DEFAULT_PORT = 29400

_T = TypeVar("_T")
_NO_STATE = b"tdist:no-state"  # (not base64 of anything: a state never reads as it)


class C10dRendezvousBackend(RendezvousBackend):
    """A rendezvous backend in ``store`` (the key ``torch.rendezvous.<run_id>``).

    Raises:
        ValueError: an empty run id. RendezvousConnectionError: the store failed.
    """

    def __init__(self, store: Store, run_id: str) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._key = self._state_key(run_id)
        self._call(lambda: store.compare_set(self._key, b"", _NO_STATE))

    def _state_key(self, run_id: str) -> str:
        return "torch.rendezvous." + run_id

    @property
    def name(self) -> str:
        return "c10d"

    def _call(self, op: Callable[[], _T]) -> _T:
        try:
            return op()
        except (DistError, ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.") from exc

    def _decode(self, stored: bytes) -> tuple[bytes, Token] | None:
        if stored == _NO_STATE:
            return None
        try:
            return base64.b64decode(stored, validate=True), stored
        except binascii.Error as exc:
            raise RendezvousStateError("The state object is corrupt. See inner exception for details.") from exc

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decode(self._call(lambda: self._store.get(self._key)))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token and not isinstance(token, bytes):  # (not one of ours: it cannot match)
            current = self.get_state()
            return None if current is None else (*current, False)
        expected = token or _NO_STATE
        result = self._decode(self._call(lambda: self._store.compare_set(self._key, expected, base64.b64encode(state))))
        if result is None:
            return None
        stored, new_token = result
        return stored, new_token, stored == state


def _tcp_store(params: RendezvousParameters, read_timeout: int | None) -> Store:
    """A TCPStore at the endpoint, hosted here when ``is_host`` says so (None: when the
    endpoint is an address of this machine and its port is free)."""
    from ...store._tcp import TCPStore
    from .._agent import _is_local_address

    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    timeout = timedelta(seconds=60 if read_timeout is None else read_timeout)
    is_host = params.get_as_bool("is_host")
    if is_host or (is_host is None and _is_local_address(host)):
        try:
            return TCPStore(host, port, is_master=True, timeout=timeout, multi_tenant=True)
        except DistError as exc:
            if is_host:
                raise RendezvousConnectionError(f"c10d rendezvous: cannot host the store at {host}:{port}: {exc}") from exc
    try:
        return TCPStore(host, port, is_master=False, timeout=timeout)
    except DistError as exc:
        raise RendezvousConnectionError(f"c10d rendezvous: the store at {host}:{port} cannot be reached: {exc}") from exc


def create_backend(params: RendezvousParameters) -> tuple[C10dRendezvousBackend, Store]:
    """A ``C10dRendezvousBackend`` and its store, from ``params``: ``store_type`` tcp (default;
    the endpoint ``host[:port]``, port 29400 by default) or file (the endpoint is the file's
    path; none: a temporary file); ``read_timeout`` (seconds, default 60) of the TCP store's
    calls; ``is_host``: whether this node hosts the TCP store (default: when the endpoint is an
    address of this machine, and no other process there hosts it yet).

    Raises:
        ValueError: a bad option. RendezvousConnectionError: the store cannot be reached.
    """
    try:
        store_type, read_timeout = _c10d_store_options(params)
        store: Store
        if store_type == "file":
            from ...store._file import FileStore

            store = FileStore(_rendezvous_file(params))
        else:
            store = _tcp_store(params, read_timeout)
        return C10dRendezvousBackend(store, params.run_id), store
    except Exception as exc:
        construct_and_record_rdzv_event(params.run_id, f"{type(exc).__name__}: {exc}", NodeState.FAILED)
        raise
