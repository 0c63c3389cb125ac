"""``tdist.rpc``: remote procedure calls and remote references (``torch.distributed.rpc``).

``import tdist.rpc as rpc`` runs code written for ``torch.distributed.rpc`` on CPU tensors.
The TENSORPIPE backend (default) runs over tdist's transport (Unix sockets and cross-memory
copies on one host, TCP across hosts); PROCESS_GROUP runs over a tdist process group.
"""

from __future__ import annotations

from . import _api as api  # torch's module name: rpc.api._ignore_rref_leak
from . import backend_registry, functions
from ._agent import RpcTimeoutError, WorkerInfo
from ._api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from ._errors import RemoteError
from ._options import ProcessGroupRpcBackendOptions, RpcBackendOptions, TensorPipeRpcBackendOptions
from ._rref import RRef
from .backend_registry import (
    BackendType,
    BackendValue,
    backend_registered,
    construct_rpc_backend_options,
    init_backend,
    register_backend,
)
from .constants import DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

# the agents load with the package (as torch's do), not inside the first init_rpc
from . import _pg_agent, _tensorpipe  # noqa: F401  isort: skip

__all__ = [
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "BackendType",
    "BackendValue",
    "ProcessGroupRpcBackendOptions",
    "RRef",
    "RemoteError",
    "RpcBackendOptions",
    "RpcTimeoutError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "api",
    "backend_registered",
    "backend_registry",
    "construct_rpc_backend_options",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_backend",
    "init_rpc",
    "is_available",
    "register_backend",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
