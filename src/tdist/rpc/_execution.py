"""Running the user's functions where a request arrives: ``dispatch`` and ``run_user_function``
(torch operators, TorchScript functions, ``async_execution`` functions that return a future),
the methods of an RRef proxy (``invoke_rref_method``, run once the value they call is made), and
the record of an owned value that failed (``_OwnerError``). The agent's worker pool calls these;
which thread runs them is the agent's business.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from . import _builtins, _errors
from ._future import Future

__all__ = ["PICKLER_HINT", "dispatch", "failed", "invoke_rref_method", "run_user_function", "with_pickler_hint"]


def invoke_rref_method(rref: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What an RRef proxy runs on the owner: ``rref.local_value().name(*args, **kwargs)``."""
    return getattr(rref.local_value(), name)(*args, **kwargs)


def failed(exc: BaseException, agent: Any) -> Any:
    """The record of what a user function raised on this worker (``agent``), which is also
    printed to ``sys.stderr`` (the one at the time of the call), as torch's callee prints it."""
    record = _errors.capture(exc, agent.label)
    try:
        print(f"On {agent.get_worker_info()}:\n{record.exc_repr}\n{record.traceback}", file=sys.stderr)
    except Exception:  # (a closed or broken stderr: the caller still gets the error)
        pass
    return record


def _not_a_future(func: Any, result: Any) -> RuntimeError:
    return RuntimeError(
        f"Functions decorated with @rpc.async_function must return a torch.futures.Future object, "
        f"but got {type(result).__module__}.{type(result).__qualname__} (from {_errors.describe_call(func)})"
    )


PICKLER_HINT = (
    "Default RPC pickler does not serialize function code. Ensure that UDFs are defined on both "
    "caller and callee modules."
)


def with_pickler_hint(exc: BaseException) -> BaseException:
    """What unpickling a request raised, with torch's hint where a function, class or module
    the caller named is missing here (``AttributeError``, ``ImportError``): the same type, the
    hint after the message, the original as its cause; ``exc`` itself otherwise."""
    try:
        if type(exc) is AttributeError:
            hinted: BaseException = AttributeError(f"{exc} {PICKLER_HINT}")
        elif type(exc) in (ImportError, ModuleNotFoundError):
            assert isinstance(exc, ImportError)
            hinted = type(exc)(f"{exc} {PICKLER_HINT}", name=exc.name, path=exc.path)
        else:
            return exc
    except Exception:  # (a str() that fails: the error as it is)
        return exc
    hinted.__cause__ = exc
    return hinted


def _when_made(rref: Any, made: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A future of an RRef proxy's method call, run (on the worker pool) once the value it
    calls is made, however long that takes: the caller's deadline bounds the wait, as torch's."""
    out: Any = Future()

    def run() -> None:
        try:
            is_async, result = run_user_function(invoke_rref_method, (rref, name, args, kwargs), {})
        except BaseException as exc:
            out.set_exception(exc)
            return
        if not is_async:
            out.set_result(result)
        elif not isinstance(result, torch._C.Future):
            out.set_exception(_not_a_future(getattr(rref.local_value(), name), result))
        else:
            result.add_done_callback(lambda f: _forward(f, out))

    def schedule(_f: Any) -> None:
        try:
            rref._agent._to_pool(run)
        except BaseException as exc:  # (the agent is shutting down): the caller hears of it
            out.set_exception(exc)

    made.add_done_callback(schedule)
    return out


def _forward(src: Any, dst: Any) -> None:
    try:
        dst.set_result(src.wait())
    except BaseException as exc:
        dst.set_exception(exc)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """``run_user_function`` for a request as it arrived: an RRef proxy's call on a value not
    made yet runs once it is, holding no thread meanwhile (``_when_made``). (Wrapped calls, under
    a profiler or in a distributed autograd context, wait in ``local_value()`` instead.)"""
    if func is invoke_rref_method:
        rref, name, m_args, m_kwargs = args
        pending = rref._pending_owned()
        if pending is not None:
            return True, _when_made(rref, pending, name, m_args, m_kwargs)
    return run_user_function(func, args, kwargs)


def run_user_function(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """Run ``func``; returns ``(is_async, result)`` (a future when ``func`` is
    ``async_execution``)."""
    if func is invoke_rref_method:
        rref, name, args, kwargs = args
        func = getattr(rref.local_value(), name)
    if type(func) is types.BuiltinFunctionType:  # a torch operator: as torch's RPC runs it
        return False, _builtins.call(func, args, kwargs)
    if type(func) is torch.jit.ScriptFunction:
        try:
            return False, func(*args, **kwargs)
        except torch.jit.Error as exc:  # (not a RuntimeError; torch's RPC raises one)
            raise RuntimeError(str(exc)) from None
    is_async = bool(getattr(func, "_wrapped_async_rpc_function", None))
    return is_async, func(*args, **kwargs)


class _OwnerError:
    """An owned value that failed: fetches answer with the error."""

    __slots__ = ("record",)

    def __init__(self, record: Any) -> None:
        self.record = record


def _set_owner_error(fut: Any, record: Any) -> None:
    if not fut.done():
        fut.set_result(_OwnerError(record))


def _unwrap(exc: BaseException) -> BaseException:
    return exc
