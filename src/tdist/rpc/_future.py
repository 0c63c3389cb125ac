"""The futures RPC hands out: ``torch.futures.Future``, with a ``then`` that keeps what its
callback raises.

torch's ``Future.then`` runs the callback in C++ and turns an exception it raises into a
``RuntimeError("Got the following error when running the callback: ValueError: ...")``: the type
and the object are gone. An ``@async_execution`` function that chains its reply with ``then``
(``rpc_async(...).then(check)``) would then send the caller a ``RuntimeError`` instead of the
``ValueError`` its callback raised. These futures run ``then`` callbacks through
``add_done_callback`` and fail the next future with the exception object itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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
                out.set_exception(exc)
                return
            out.set_result(value)

        self.add_done_callback(run)
        return out
