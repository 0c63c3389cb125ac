"""``tdist.rpc.functions``: decorators for functions that RPC runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

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
