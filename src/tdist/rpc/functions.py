"""``tdist.rpc.functions``: decorators for functions that RPC runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future``: the callee replies when that future
    completes, so the worker thread is free while it waits (``torch``'s decorator; put it
    innermost, under ``@staticmethod``/``@classmethod``).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


class _AsyncScript:
    """What RPC sends for ``async_execution`` over a TorchScript function: the function (by
    name) and the mark (the decorator's wrapper copies the script function's names, so it
    cannot travel by name itself)."""

    __slots__ = ("_wrapped_async_rpc_function",)

    def __init__(self, fn: Any) -> None:
        self._wrapped_async_rpc_function = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped_async_rpc_function(*args, **kwargs)

    def __reduce__(self) -> Any:
        return (_AsyncScript, (self._wrapped_async_rpc_function,))


def _sendable(func: Any) -> Any:
    """``func`` (an ``async_execution`` wrapper) as an RPC sends it: ``_AsyncScript`` when it
    wraps a TorchScript function, else itself."""
    fn = func._wrapped_async_rpc_function
    return _AsyncScript(fn) if isinstance(fn, torch.jit.ScriptFunction) else func
