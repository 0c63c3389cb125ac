"""The registry of RPC backends (``torch.distributed.rpc.backend_registry``).

A backend is a name and two handlers: one builds its options object from keyword arguments
(:func:`construct_rpc_backend_options`), the other builds and returns its agent
(:func:`init_backend`, called by ``init_rpc`` with ``store, name, rank, world_size,
rpc_backend_options``). ``TENSORPIPE`` and ``PROCESS_GROUP`` are registered at import.

``BackendType`` is an ``Enum`` with one member per backend, whose value is the backend's
:data:`BackendValue`. As in torch, registering a backend *rebuilds* the enum with the new member
first, so look it up through this module (``backend_registry.BackendType``) rather than keeping
the class. Two additions over torch keep older references useful:

* every generation of ``BackendType`` subclasses :class:`BackendTypeBase`, so a member taken
  before a later registration still passes ``isinstance(member, BackendTypeBase)`` (use that
  name in annotations too: ``BackendType`` is a variable, not a type);
* when the parent package (``tdist.rpc``) holds the ``BackendType`` that a registration
  replaces, it is rebound to the new one, so ``rpc.BackendType.MINE`` works after
  ``register_backend("MINE", ...)`` (under torch it raises ``AttributeError``).

Thread-safety: registration is serialized by a lock; look-ups read one module attribute.
"""

from __future__ import annotations

import collections
import enum
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any, cast

from ..store import Store
from . import constants as rpc_constants
from ._options import (
    DeviceType,
    ProcessGroupRpcBackendOptions,
    TensorPipeRpcBackendOptions,
    create_device_list,
    create_reverse_mapping,
    validate_device_maps,
)

__all__ = [
    "BackendType",
    "BackendValue",
    "backend_registered",
    "construct_rpc_backend_options",
    "init_backend",
    "register_backend",
]

BackendValue = collections.namedtuple(
    "BackendValue", ["construct_rpc_backend_options_handler", "init_backend_handler"]
)

# torch's private names, for code ported from torch that imports them from here.
_validate_device_maps = validate_device_maps
_create_device_list = create_device_list
_create_reverse_mapping = create_reverse_mapping

_BACKEND_TYPE_DOC = """An enum class of available backends.

    ``BackendType.TENSORPIPE`` (the default) and ``BackendType.PROCESS_GROUP`` are built in.
    Additional ones can be registered using the
    :func:`~tdist.rpc.backend_registry.register_backend` function.
"""


class _BackendTypeMeta(enum.EnumMeta):
    # Members are found by the normal attribute lookup; this only runs for a name that is not a
    # member. It says so to mypy (so ``BackendType.TENSORPIPE`` type-checks although the members
    # are made at run time) and keeps Python 3.11's AttributeError on every Python version.
    def __getattr__(cls, name: str) -> Any:
        raise AttributeError(name)


class BackendTypeBase(enum.Enum, metaclass=_BackendTypeMeta):
    """The base every generation of ``BackendType`` derives from; it has no members."""

    def __repr__(self) -> str:
        return f"BackendType.{self.name}"


def _build_backend_type(members: dict[str, Any]) -> type[BackendTypeBase]:
    # The functional API on a member-less Enum subclass makes a subclass of it.
    make = cast(Callable[..., type[BackendTypeBase]], BackendTypeBase)
    new = make("BackendType", members, module=__name__, qualname="BackendType")
    new.__doc__ = _BACKEND_TYPE_DOC
    return new


BackendType: type[BackendTypeBase] = _build_backend_type({})

_lock = threading.Lock()


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` is registered as an RPC backend.

    Args:
        backend_name: the name given to :func:`register_backend`.

    Returns:
        True if the backend has been registered, else False.
    """
    return backend_name in BackendType.__members__


def register_backend(
    backend_name: str,
    construct_rpc_backend_options_handler: Callable[..., Any],
    init_backend_handler: Callable[..., Any],
) -> BackendTypeBase:
    """Register a new RPC backend; ``BackendType`` is rebuilt with it as its first member.

    As in torch, a backend whose two handlers equal an existing backend's becomes an alias of
    it: the name resolves to the member registered later, and the earlier name no longer
    appears when iterating ``BackendType``.

    Args:
        backend_name: the member name (``BackendType.<backend_name>``).
        construct_rpc_backend_options_handler: called as ``handler(rpc_timeout, init_method,
            **kwargs)`` by :func:`construct_rpc_backend_options`; returns an options object.
        init_backend_handler: called as ``handler(store, name, rank, world_size,
            rpc_backend_options)`` by :func:`init_backend`; returns the started agent.

    Returns:
        The new ``BackendType`` member.

    Raises:
        RuntimeError: ``backend_name`` is already registered.
    """
    global BackendType
    with _lock:
        if backend_registered(backend_name):
            raise RuntimeError(f"RPC backend {backend_name}: already registered")
        previous = BackendType
        members: dict[str, Any] = {
            backend_name: BackendValue(
                construct_rpc_backend_options_handler=construct_rpc_backend_options_handler,
                init_backend_handler=init_backend_handler,
            )
        }
        members.update((m.name, m.value) for m in previous)
        BackendType = _build_backend_type(members)
        # `from .backend_registry import BackendType` in the package took the class of that
        # moment; point it at the new one so `rpc.BackendType.<new>` works. Read the package's
        # __dict__ so a module __getattr__ there is neither called nor shadowed.
        package = sys.modules.get(__name__.rpartition(".")[0])
        if package is not None and vars(package).get("BackendType") is previous:
            vars(package)["BackendType"] = BackendType
        return BackendType[backend_name]


def construct_rpc_backend_options(
    backend: BackendTypeBase,
    rpc_timeout: float = rpc_constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = rpc_constants.DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> Any:
    """Build ``backend``'s options object through its registered handler.

    Args:
        backend: a ``BackendType`` member.
        rpc_timeout: default timeout of an RPC, in seconds.
        init_method: rendezvous URL.
        **kwargs: backend-specific options (for ``TENSORPIPE``: ``num_worker_threads``,
            ``device_maps``, ``devices``, ``_transports``, ``_channels``). As in torch, the
            built-in handlers ignore names they do not know.

    Returns:
        What the handler returns (an ``RpcBackendOptions`` for the built-in backends).
    """
    return backend.value.construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)


def init_backend(backend: BackendTypeBase, *args: Any, **kwargs: Any) -> Any:
    """Build and return ``backend``'s agent through its registered handler.

    Args:
        backend: a ``BackendType`` member.
        *args: passed on; ``init_rpc`` passes ``store, name, rank, world_size,
            rpc_backend_options``.
        **kwargs: passed on.

    Returns:
        What the handler returns: the agent.
    """
    return backend.value.init_backend_handler(*args, **kwargs)


def _load_agent_class(module: str, name: str) -> Any:
    # Imported at first use: the agents pull in the transport and the worker pool, which
    # building options or checking arguments should not need.
    return getattr(importlib.import_module(module, __package__), name)


# -- TENSORPIPE -------------------------------------------------------------------------------------
def _tensorpipe_construct_rpc_backend_options_handler(
    rpc_timeout: float,
    init_method: str,
    num_worker_threads: int = rpc_constants.DEFAULT_NUM_WORKER_THREADS,
    _transports: list[str] | None = None,
    _channels: list[str] | None = None,
    device_maps: dict[str, dict[DeviceType, DeviceType]] | None = None,
    devices: list[DeviceType] | None = None,
    **kwargs: Any,
) -> TensorPipeRpcBackendOptions:
    # torch drops device_maps and devices here (they fall into **kwargs); we pass them on.
    return TensorPipeRpcBackendOptions(
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        num_worker_threads=num_worker_threads,
        _transports=_transports,
        _channels=_channels,
        device_maps=device_maps,
        devices=devices,
    )


def _tensorpipe_init_backend_handler(
    store: Store,
    name: str,
    rank: int,
    world_size: int | None,
    rpc_backend_options: TensorPipeRpcBackendOptions,
) -> Any:
    if not isinstance(store, Store):
        raise TypeError(f"`store` must be a c10d::Store. {store}")
    if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
        raise TypeError(
            f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. {rpc_backend_options}"
        )
    agent_class = _load_agent_class("._tensorpipe", "TensorPipeAgent")
    return agent_class(store, name, rank, world_size, rpc_backend_options)


# -- PROCESS_GROUP ----------------------------------------------------------------------------------
def _process_group_construct_rpc_backend_options_handler(
    rpc_timeout: float,
    init_method: str,
    num_send_recv_threads: int = rpc_constants.DEFAULT_NUM_SEND_RECV_THREADS,
    **kwargs: Any,
) -> ProcessGroupRpcBackendOptions:
    return ProcessGroupRpcBackendOptions(
        num_send_recv_threads=num_send_recv_threads,
        rpc_timeout=rpc_timeout,
        init_method=init_method,
    )


def _process_group_init_backend_handler(
    store: Store,
    name: str,
    rank: int,
    world_size: int | None,
    rpc_backend_options: ProcessGroupRpcBackendOptions,
) -> Any:
    if not isinstance(store, Store):
        raise TypeError(f"`store` must be a c10d::Store. {store}")
    if not isinstance(rpc_backend_options, ProcessGroupRpcBackendOptions):
        raise TypeError(
            "`rpc_backend_options` must be a `ProcessGroupRpcBackendOptions`. "
            f"{rpc_backend_options}"
        )
    agent_class = _load_agent_class("._pg_agent", "ProcessGroupAgent")
    return agent_class(store, name, rank, world_size, rpc_backend_options)


# Registered oldest first, as torch 1.x did, so iteration (newest first) gives TENSORPIPE first.
register_backend(
    "PROCESS_GROUP",
    _process_group_construct_rpc_backend_options_handler,
    _process_group_init_backend_handler,
)
register_backend(
    "TENSORPIPE",
    _tensorpipe_construct_rpc_backend_options_handler,
    _tensorpipe_init_backend_handler,
)
