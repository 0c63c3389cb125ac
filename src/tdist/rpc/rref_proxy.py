"""RRef proxies (``torch.distributed.rpc.rref_proxy``): ``rref.rpc_sync().method(*args)`` runs
``method`` on the RRef's value, on its owner, through the RPC function the proxy was made with
(``rpc_sync``, ``rpc_async`` or ``remote``). An ``async_execution`` method is run as one."""

from __future__ import annotations

from functools import partial
from typing import Any

from ._execution import invoke_rref_method
from .constants import UNSET_RPC_TIMEOUT

__all__ = ["RRefProxy"]


def _invoke_rpc(rref: Any, rpc_api: Any, func_name: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
    return rpc_api(rref.owner(), invoke_rref_method, args=(rref, func_name, args, kwargs), timeout=timeout)


class RRefProxy:
    """``rref.<api>(timeout)``: attribute access gives a function that calls that method of the
    value on its owner through ``rpc_api``."""

    def __init__(self, rref: Any, rpc_api: Any, timeout: float = UNSET_RPC_TIMEOUT) -> None:
        self.rref = rref
        self.rpc_api = rpc_api
        self.rpc_timeout = timeout

    def __getattr__(self, func_name: str) -> Any:
        return partial(_invoke_rpc, self.rref, self.rpc_api, func_name, self.rpc_timeout)
