"""``tdist.rpc``: remote procedure calls and remote references (``torch.distributed.rpc``).

``import tdist.rpc as rpc`` runs code written for ``torch.distributed.rpc`` on CPU tensors.
The TENSORPIPE backend (default) runs over tdist's transport (Unix sockets and cross-memory
copies on one host, TCP across hosts); PROCESS_GROUP runs over a tdist process group.
"""

from __future__ import annotations

import sys

from ..store import Store
from . import _api as api  # torch's module name: rpc.api._ignore_rref_leak
from . import _options, backend_registry, functions
from ._agent import RpcAgent
from ._api import _get_current_rpc_agent as _get_current_rpc_agent
from ._api import _get_debug_info as _get_debug_info
from ._api import _is_current_rpc_agent_set as _is_current_rpc_agent_set
from ._api import _rref_context_get_debug_info as _rref_context_get_debug_info
from ._api import _set_rpc_timeout as _set_rpc_timeout
from ._api import _wait_all as _wait_all
from ._api import enable_gil_profiling as enable_gil_profiling
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
from ._calls import RpcTimeoutError
from ._errors import RemoteError
from ._options import ProcessGroupRpcBackendOptions, RpcBackendOptions, TensorPipeRpcBackendOptions
from ._rref import RRef
from ._worker_info import WorkerInfo
from .backend_registry import (
    BackendType,
    BackendValue,
    backend_registered,
    construct_rpc_backend_options,
    init_backend,
    register_backend,
)
from .constants import _DEFAULT_INIT_METHOD as _DEFAULT_INIT_METHOD
from .constants import _DEFAULT_NUM_WORKER_THREADS as _DEFAULT_NUM_WORKER_THREADS
from .constants import _DEFAULT_RPC_TIMEOUT_SEC as _DEFAULT_RPC_TIMEOUT_SEC
from .constants import _UNSET_RPC_TIMEOUT as _UNSET_RPC_TIMEOUT
from .constants import DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from .server_process_global_profiler import (
    _server_process_global_profile as _server_process_global_profile,
)

# the agents load with the package (as torch's do), not inside the first init_rpc
from . import _pg_agent  # noqa: F401  isort: skip
from ._tensorpipe import TensorPipeAgent  # isort: skip

PyRRef = RRef  # torch's name for the class of the RRefs it receives

# torch's module paths: ``import torch.distributed.rpc.api`` / ``.options`` reach the same
# modules here (``rpc.api._ignore_rref_leak = False`` sets the switch shutdown reads)
options = _options
sys.modules[f"{__name__}.api"] = api
sys.modules[f"{__name__}.options"] = options

__all__ = [
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "BackendType",
    "BackendValue",
    "ProcessGroupRpcBackendOptions",
    "PyRRef",
    "RRef",
    "RemoteError",
    "RpcAgent",
    "RpcBackendOptions",
    "RpcTimeoutError",
    "Store",
    "TensorPipeAgent",
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
    "options",
    "register_backend",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
