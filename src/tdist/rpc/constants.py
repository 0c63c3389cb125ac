"""RPC defaults, with the names and values of ``torch.distributed.rpc.constants``.

``DEFAULT_NUM_SEND_RECV_THREADS`` is the default of the ``PROCESS_GROUP`` backend, which torch
removed in 1.11 and which we keep.
"""

from __future__ import annotations

from datetime import timedelta

__all__: list[str] = []  # as in torch: nothing here is re-exported by ``rpc``

# For any RpcAgent.
DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_SHUTDOWN_TIMEOUT: float = 0

# For the TensorPipe agent.
DEFAULT_NUM_WORKER_THREADS: int = 16

# For the ProcessGroup agent.
DEFAULT_NUM_SEND_RECV_THREADS: int = 4

# The process group an agent builds must not time out when it sits idle for a long time.
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)

# An RPC call's timeout argument when the caller gave none: the agent's default applies.
UNSET_RPC_TIMEOUT: float = -1.0

# torch's private aliases (``rpc._DEFAULT_RPC_TIMEOUT_SEC`` ...)
_DEFAULT_RPC_TIMEOUT_SEC = DEFAULT_RPC_TIMEOUT_SEC
_DEFAULT_INIT_METHOD = DEFAULT_INIT_METHOD
_DEFAULT_NUM_WORKER_THREADS = DEFAULT_NUM_WORKER_THREADS
_UNSET_RPC_TIMEOUT = UNSET_RPC_TIMEOUT
