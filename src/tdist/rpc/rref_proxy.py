"""RRef proxies (``torch.distributed.rpc.rref_proxy``): ``rref.rpc_sync().method(*args)`` runs
``method`` on the RRef's value, on its owner, through the RPC function the proxy was made with
(``rpc_sync``, ``rpc_async`` or ``remote``). An ``async_execution`` method is run as one."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ._execution import invoke_rref_method
from .constants import UNSET_RPC_TIMEOUT

__all__ = ["RRefProxy"]


def _invoke_rpc(rref: Any, rpc_api: Any, func_name: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
    from ._api import remote

    if rpc_api is remote:
        # the method is looked up first, on the value's type (asked of the owner once), so a
        # missing one raises AttributeError here, as torch's, not at to_here()
        kind = rref._get_type(timeout=timeout)
        if not issubclass(kind, (torch.jit.ScriptModule, torch._C.ScriptModule)):
            getattr(kind, func_name)
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
