"""``torch.distributed.rpc.internal``'s helpers that user code reaches for: the call modes, the
name a profiled call gets, and ``serialize``/``deserialize`` to torch's "pickle + tensor table"
form (tensors travel beside the pickle, in a list)."""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import threading
from enum import Enum
from typing import Any

import torch

__all__ = ["PythonUDF", "RPCExecMode", "RemoteException", "deserialize", "serialize"]


class RPCExecMode(Enum):
    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])
RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])


def _build_rpc_profiling_key(exec_type: RPCExecMode, func_name: str, current_worker_name: str, dst_worker_name: str) -> str:
    """The name a profiled RPC is recorded under (torch's)."""
    return f"rpc_{exec_type.value}#{func_name}({current_worker_name} -> {dst_worker_name})"


_tables = threading.local()


def _tensor_receiver(index: int) -> torch.Tensor:
    return _tables.recv[index]  # type: ignore[no-any-return]


def _tensor_reducer(tensor: torch.Tensor) -> Any:
    _tables.send.append(tensor)
    return (_tensor_receiver, (len(_tables.send) - 1,))


def serialize(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``obj`` as a pickle whose tensors are left out, and the list of those tensors."""
    _tables.send = []
    try:
        f = io.BytesIO()
        p = pickle.Pickler(f)
        p.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _tensor_reducer}
        p.dump(obj)
        return f.getvalue(), _tables.send
    finally:
        del _tables.send


def deserialize(binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
    """The object ``serialize`` made, its tensors taken from ``tensor_table``."""
    _tables.recv = tensor_table
    try:
        return pickle.loads(binary_data)
    finally:
        del _tables.recv
