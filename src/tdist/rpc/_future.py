"""The futures RPC hands out: ``torch.futures.Future``, with a ``then`` that keeps what its
callback raises.

torch's ``Future.then`` runs the callback in C++ and turns an exception it raises into a
``RuntimeError("Got the following error when running the callback: ValueError: ...")``: the type
and the object are gone. An ``@async_execution`` function that chains its reply with ``then``
(``rpc_async(...).then(check)``) would then send the caller a ``RuntimeError`` instead of the
``ValueError`` its callback raised. These futures run ``then`` callbacks through
``add_done_callback`` and fail the next future with an exception that is both: an instance of
the callback's exception type and of ``RuntimeError`` (so code written for torch's
``except RuntimeError`` catches it, and ``except ValueError`` as well), with torch's message,
which pickles as the callback's exception itself (what a remote caller gets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._core.errors import fail_future, fresh
from ._errors import plain_type, runtime_twin

__all__ = ["Future"]


class Future(torch.futures.Future[Any]):
    """A ``torch.futures.Future`` (every method and check of torch's applies) whose ``then``
    fails the future it returns with the exception the callback raised, as that object."""

    def then(self, callback: Callable[[Any], Any]) -> Future:
        """A future of ``callback(self)``, run when this one completes; it fails with what
        ``callback`` raises (that exception itself, not a ``RuntimeError`` with its text)."""
        out = Future()

        def run(done: Any) -> None:
            try:
                value = callback(done)
            except BaseException as exc:
                out.set_exception(_as_runtime_error(exc))
                return
            out.set_result(value)

        self.add_done_callback(run)
        return out

    def set_exception(self, result: BaseException) -> None:
        """torch's, whose ``wait()`` and ``value()`` raise a copy of ``result`` each time
        (``errors.fail_future``: torch's raise the object it keeps, which then holds every
        waiter's frames for good)."""
        fail_future(self, result)


_BOTH: dict[type[BaseException], type[BaseException] | None] = {}


def _reduce_to_original(self: BaseException) -> Any:
    return self._tdist_original.__reduce__()  # type: ignore[attr-defined]


def _torch_text(self: BaseException) -> str:
    text = getattr(self, "_tdist_text", None)
    if text is not None:
        return str(text)
    original = self._tdist_original  # type: ignore[attr-defined]
    return f"Got the following error when running the callback: {type(original).__name__}: {original}"


def _as_runtime_error(exc: BaseException, text: str | None = None) -> BaseException:
    """``exc`` as an instance of a class derived from its own type and ``RuntimeError`` (see
    the module docstring), whose message is ``text`` (default: torch's for a callback);
    ``exc`` itself where it is a ``RuntimeError`` already (with a ``text``: ``RuntimeError``
    itself), not an ``Exception``, or of a type that cannot be combined (``Exception`` itself,
    for one)."""
    # (a remote error, which ``_errors.rebuild`` made a RuntimeError too, counts as its own type)
    kind = plain_type(type(exc))
    if not isinstance(exc, Exception) or (issubclass(kind, RuntimeError) and (text is None or kind is RuntimeError)):
        return exc
    both = runtime_twin(kind, {"__reduce__": _reduce_to_original, "__str__": _torch_text}, _BOTH)
    if both is None:
        return exc
    try:
        out = both.__new__(both, *exc.args)
        out.__dict__.update(getattr(exc, "__dict__", {}))
        out.args = exc.args
    except Exception:  # (a constructor of its own that __new__ cannot mimic)
        return exc
    out._tdist_original = fresh(exc)  # type: ignore[attr-defined]  # (no frames: see ``errors.fresh``)
    out._tdist_text = text  # type: ignore[attr-defined]
    out.__cause__ = exc.__cause__
    out.__context__ = exc.__context__
    return out.with_traceback(exc.__traceback__)
