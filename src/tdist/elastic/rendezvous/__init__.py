"""``tdist.elastic.rendezvous``: torchelastic's rendezvous API (``torch.distributed.elastic.rendezvous``).

A rendezvous gathers the nodes of a job, agrees on who is in it and gives each a rank:
``get_rendezvous_handler(RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes))``
then ``handler.next_rendezvous()`` -> ``RendezvousInfo(store, rank, world_size,
bootstrap_store_info)``. The names, defaults and errors are torch's; the handlers are ours:

- ``static``: every node is given its ``rank`` (``RendezvousParameters(..., rank=K)``); node 0
  hosts a TCPStore at the endpoint; the world size is ``max_nodes``.
- ``c10d``: the state lives in a TCPStore at the endpoint (port 29400 by default), hosted by the
  node that can bind it (its node sorts first: it is rank 0 of the rounds it is in); ``etcd``
  and ``etcd-v2``: the state lives in etcd (``EtcdStore``; port 2379 by default). Both are one
  handler, ``DynamicRendezvousHandler`` (``_dynamic``), that carries out the decisions of a
  state machine (``_state``, sans-IO: the theory of operation is there), as torch's
  ``dynamic_rendezvous``:

  - the nodes share one state record, changed by compare-and-set with a version as fencing
    token: the round, its participants, the wait list, the closed flag, the heartbeats;
  - a round completes at ``max_nodes`` at once, or ``last_call_timeout`` seconds (default 30)
    after ``min_nodes`` have joined; ranks follow the sorted order of the nodes' names, so the
    same nodes keep their ranks from round to round;
  - a node that comes while the round is complete waits in the wait list
    (``num_nodes_waiting()``, while the round has room) and joins the next round, which the
    members open by calling ``next_rendezvous()`` again (after a failure, or to admit the
    waiting nodes): each leaves its round and joins again;
  - a member beats every ``keep_alive_interval`` seconds (default 3; torch's 5); a node whose heartbeat
    stood still for ``keep_alive_max_attempt`` (default 3) intervals of an observer's own clock
    is dropped by that observer (no clock is compared across hosts);
  - ``join_timeout`` (default 600 s) bounds ``next_rendezvous()`` (``RendezvousTimeoutError``);
    ``set_closed()`` and ``shutdown()`` end the job's rendezvous for every node
    (``RendezvousClosedError`` afterwards).

  Rank 0 of each round publishes ``MASTER_ADDR``/``MASTER_PORT`` for the workers
  (``RendezvousStoreInfo``): its ``local_addr`` (or fully qualified host name) and a free port.

torch's module paths are there too: ``dynamic_rendezvous`` (``DynamicRendezvousHandler.from_backend``
and ``create_handler``: the same handler over a user's ``RendezvousBackend``, whose state it
polls while it waits), ``c10d_rendezvous_backend`` and ``etcd_rendezvous_backend`` (backends over
a c10d store and over tdist's ``EtcdStore``), ``static_tcp_rendezvous``, ``etcd_store``, and
``etcd_server`` (torch's own test helper).
"""

from __future__ import annotations

import logging
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from ..._core.errors import DistError
from ..._core.ports import free_port
from ...store._api import Store
from ...store._prefix import PrefixStore

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "get_rendezvous_handler",
    "rendezvous_handler_registry",
]

log = logging.getLogger(__name__)


# -- errors (torch's tree) --------------------------------------------------------------------
class RendezvousError(Exception):
    """The base of the rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed (``set_closed``): the job is over."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete in time."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous backend cannot be reached."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state is corrupt."""


class RendezvousGracefulExitError(RendezvousError):
    """The node was not admitted and should leave without an error."""


# -- what a rendezvous gives ------------------------------------------------------------------
@dataclass
class RendezvousStoreInfo:
    """Where the workers' store is: ``MASTER_ADDR`` and ``MASTER_PORT``."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"
    master_addr: str
    master_port: int

    @staticmethod
    def build(rank: int, store: Store, local_addr: str | None, server_port: int | None = None) -> RendezvousStoreInfo:
        """Rank 0 publishes its address (``local_addr``, else its fully qualified host name)
        and ``server_port`` (else a free port) in ``store``; every rank reads them."""
        if rank == 0:
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, (local_addr or socket.getfqdn()).encode())
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(server_port or free_port("")).encode())
        addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
        return RendezvousStoreInfo(addr, port)


class RendezvousInfo:
    """The result of ``next_rendezvous()``."""

    def __init__(self, store: Store, rank: int, world_size: int, bootstrap_store_info: RendezvousStoreInfo) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap_store_info = bootstrap_store_info

    @property
    def store(self) -> Store:
        """A store the round's nodes share."""
        return self._store

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        return self._bootstrap_store_info

    def __repr__(self) -> str:
        return f"RendezvousInfo(rank={self._rank}, world_size={self._world_size}, {self._bootstrap_store_info})"


class RendezvousHandler(ABC):
    """One node's handle on a job's rendezvous."""

    @abstractmethod
    def get_backend(self) -> str:
        """The backend's name."""

    @property
    def use_agent_store(self) -> bool:
        """Whether the store of ``next_rendezvous()`` is one the workers can share."""
        return False

    @abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; returns once it is complete.

        Raises:
            RendezvousClosedError: the rendezvous is closed. RendezvousTimeoutError: it did not
            complete in time. RendezvousConnectionError: the backend cannot be reached.
        """

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (the job is over)."""

    @abstractmethod
    def set_closed(self) -> None:
        """Close the rendezvous for every node."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """How many nodes wait for the next round (came after the current one closed)."""

    @abstractmethod
    def get_run_id(self) -> str:
        """The job's run id."""

    def shutdown(self) -> bool:
        """Release what the handler holds; True when it did."""
        return True


class RendezvousParameters:
    """What a handler is made from (torch's names and checks); backend options go in ``**kwargs``
    (``get``, ``get_as_bool``, ``get_as_int`` read them)."""

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(f"The minimum number of rendezvous nodes ({min_nodes}) must be greater than zero.")
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of rendezvous nodes ({max_nodes}) must be greater than or equal to the "
                f"minimum number of rendezvous nodes ({min_nodes})."
            )
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.config = kwargs
        self.local_addr = local_addr

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            if value.lower() in ("1", "true", "t", "yes", "y"):
                return True
            if value.lower() in ("0", "false", "f", "no", "n"):
                return False
        raise ValueError(f"The rendezvous configuration option '{key}' does not represent a valid boolean value.")

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError as exc:
            raise ValueError(f"The rendezvous configuration option '{key}' does not represent a valid integer value.") from exc


RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]


class RendezvousHandlerRegistry:
    """Handler creators by backend name."""

    def __init__(self) -> None:
        self._registry: dict[str, RendezvousHandlerCreator] = {}

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Register ``creator`` for ``backend`` (again with the same creator is fine).

        Raises:
            ValueError: an empty name, or a name registered with another creator.
        """
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        current = self._registry.get(backend)
        if current is not None and current != creator:
            raise ValueError(
                f"The rendezvous backend '{backend}' cannot be registered with '{creator}' as it is already "
                f"registered with '{current}'."
            )
        self._registry[backend] = creator

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """A handler for ``params.backend``.

        Raises:
            ValueError: the backend is not registered. RuntimeError: the handler made says it
            is of another backend.
        """
        try:
            creator = self._registry[params.backend]
        except KeyError:
            raise ValueError(
                f"The rendezvous backend '{params.backend}' is not registered. Did you forget to call `register`?"
            ) from None
        handler = creator(params)
        if handler.get_backend() != params.backend:
            raise RuntimeError(
                f"The rendezvous backend '{handler.get_backend()}' does not match the requested backend "
                f"'{params.backend}'."
            )
        return handler


rendezvous_handler_registry = RendezvousHandlerRegistry()


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler ``params`` asks for, from ``rendezvous_handler_registry``."""
    return rendezvous_handler_registry.create_handler(params)


# -- the handlers -----------------------------------------------------------------------------
def parse_rendezvous_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6 address]:port`` -> (host, port); ``default_port`` when
    none is given (a negative default: a port is required).

    Raises:
        ValueError: an empty endpoint, a port that is not a number from 0 to 65535, or a
            missing port that is required.
    """
    text = endpoint.strip()
    if not text:
        raise ValueError("The rendezvous endpoint is empty: give <host>[:<port>]")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # (a host name, or a bare IPv6 address)
        host, port = text, ""
    if not port:
        port_number = default_port
    else:
        try:
            port_number = int(port)
        except ValueError:
            raise ValueError(f"The port number of the rendezvous endpoint '{endpoint}' must be an integer.") from None
        if not 0 <= port_number < 65536:
            raise ValueError(f"The port number of the rendezvous endpoint '{endpoint}' must be from 0 to 65535.")
    if not host:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' names no host")
    if port_number < 0:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' needs a port: <host>:<port>")
    return host, port_number


class _StaticRendezvous(RendezvousHandler):
    def __init__(self, host: str, port: int, rank: int, world_size: int, run_id: str, timeout: timedelta) -> None:
        self._host, self._port = host, port
        self._rank, self._world_size, self._run_id = rank, world_size, run_id
        self._timeout = timeout
        self._store: Store | None = None

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> _StaticRendezvous:
        """The registry's ``static`` handler: ``params``' ``rank``, its endpoint, ``max_nodes``
        as the world size, ``timeout`` (seconds, default 60)."""
        rank = params.get_as_int("rank")
        if rank is None:
            raise ValueError("rank is absent in RendezvousParameters. Try add --node-rank to the cmd request")
        host, port = parse_rendezvous_endpoint(params.endpoint, -1)
        timeout = timedelta(seconds=params.get_as_int("timeout", 60) or 60)
        return cls(host, port, rank, params.max_nodes, params.run_id, timeout)

    def get_backend(self) -> str:
        return "static"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        from ...store._tcp import TCPStore

        if self._store is None:
            try:
                self._store = TCPStore(self._host, self._port, self._world_size, self._rank == 0, self._timeout, multi_tenant=True)
            except DistError as exc:
                raise RendezvousConnectionError(f"static rendezvous at {self._host}:{self._port}: {exc}") from exc
        info = RendezvousStoreInfo(self._host, self._port)
        return RendezvousInfo(PrefixStore(self._run_id, self._store), self._rank, self._world_size, info)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        """A static rendezvous has no state to close (as torch's)."""

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id


def _c10d_store_options(params: RendezvousParameters) -> tuple[str, int | None]:
    """torch's options of a c10d store: ``store_type`` tcp (default) or file (the endpoint is
    the file's path; none: a temporary file), ``read_timeout`` (seconds, > 0) of the TCP
    store's calls (None: not given).

    Raises:
        ValueError: another store type, or a read timeout that is not positive.
    """
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type not in ("tcp", "file"):
        raise ValueError("Invalid store type given. Currently only supports file and tcp.")
    read_timeout = params.get_as_int("read_timeout")
    if read_timeout is not None and read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    return store_type, read_timeout


def _rendezvous_file(params: RendezvousParameters) -> str:
    """The path of a c10d rendezvous's file store: the endpoint, else a new temporary file."""
    import tempfile

    path = params.endpoint
    if not path:
        try:
            fd, path = tempfile.mkstemp(prefix="tdist_rdzv_")
            os.close(fd)
        except OSError as exc:
            raise RendezvousError(f"c10d rendezvous: cannot create a file for the store: {exc}") from exc
    return path


def _create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The c10d rendezvous: the node at the endpoint hosts the store; another node keeps a
    standby of it (``store._replica``) that takes over if the host is lost, and every node's
    client fails over to it."""
    from ...store._replica import FailoverStore, StandbyKeeper
    from ...store._server import StoreServer
    from .._agent import _is_local_address

    store_type, read_timeout = _c10d_store_options(params)
    if store_type == "file":
        return _c10d_on_a_file(params)
    host, port = parse_rendezvous_endpoint(params.endpoint, 29400)
    timeout = timedelta(seconds=float(params.get("join_timeout", 600)) if read_timeout is None else read_timeout)
    is_host = params.get_as_bool("is_host")
    server = None
    if is_host or (is_host is None and _is_local_address(host)):
        try:
            server = StoreServer("" if params.max_nodes > 1 else host, port)
            server.start("thread")
            port = server.port
        except DistError as exc:
            if is_host:
                raise RendezvousConnectionError(f"c10d rendezvous: cannot host the store at {host}:{port}: {exc}") from exc
            server = None  # (another node of this host hosts it)
    try:
        store = FailoverStore(host, port, timeout=timeout)
    except DistError as exc:
        if server is not None:
            server.stop()
        raise RendezvousConnectionError(f"c10d rendezvous: the store at {host}:{port} cannot be reached: {exc}") from exc
    keeper = StandbyKeeper(store, hosting=server is not None, advertise=params.local_addr)

    def release() -> None:
        store.close()
        keeper.stop()
        if server is not None:
            server.stop()

    state = PrefixStore(f"torch.rendezvous.{params.run_id}", store)
    handler = DynamicRendezvousHandler("c10d", params, state, first=server is not None, on_shutdown=release, on_beat=keeper.upkeep)
    keeper.settle()
    return handler


def _c10d_on_a_file(params: RendezvousParameters) -> RendezvousHandler:
    """The c10d rendezvous over a ``FileStore`` (``store_type=file``): the nodes share the file
    at the endpoint (one host, or a shared file system)."""
    from ...store._file import FileStore

    path = _rendezvous_file(params)
    try:
        store = FileStore(path)
    except (DistError, OSError, ValueError) as exc:
        raise RendezvousConnectionError(f"c10d rendezvous: the file store at {path!r} cannot be used: {exc}") from exc
    state = PrefixStore(f"torch.rendezvous.{params.run_id}", store)
    return DynamicRendezvousHandler("c10d", params, state)


def _etcd_creator(backend: str) -> RendezvousHandlerCreator:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        import urllib.parse

        from ...store._etcd import EtcdStore

        host, port = parse_rendezvous_endpoint(params.endpoint, 2379)
        prefix = "/torchelastic/" + urllib.parse.quote(params.run_id, safe="")
        try:
            store = EtcdStore(host, port, prefix=prefix, timeout=timedelta(seconds=float(params.get("timeout", 60))))
        except DistError as exc:
            raise RendezvousConnectionError(f"{backend} rendezvous: {exc}") from exc
        # (no lease: the round's keys are shared, and a key's lease is its last writer's, so
        # one node's exit would take state the others still use)
        return DynamicRendezvousHandler(backend, params, store, on_shutdown=store.close)

    return create


from ._dynamic import DynamicRendezvousHandler  # noqa: E402  (it builds on the API above)

rendezvous_handler_registry.register("static", _StaticRendezvous.from_params)
rendezvous_handler_registry.register("c10d", _create_c10d_handler)
rendezvous_handler_registry.register("etcd", _etcd_creator("etcd"))
rendezvous_handler_registry.register("etcd-v2", _etcd_creator("etcd-v2"))
