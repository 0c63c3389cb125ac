"""The point where distributed autograd plugs into RPC; RPC itself knows nothing of it.

Theory of operation. Inside a distributed autograd context (``tdist.autograd``) every
``rpc_sync``, ``rpc_async``, ``remote`` and ``to_here`` carries the context: the call goes out
wrapped in one of autograd's functions (the context id, an autograd message id and which
tensors require grad travel with it, and the callee runs the user's function in the context),
and the reply's tensors come back behind recv functions. RPC does not import ``tdist.autograd``
to do that, so the import graph runs one way, autograd -> rpc: ``tdist.autograd._context``
registers itself here (:func:`register`) as the last step of its import, and RPC asks
:data:`autograd` on the way out.

Until then :data:`autograd` is None, and rightly so: a context is opened by ``tdist.autograd``
alone, either by ``context()`` or by a wrapped call reaching a callee, whose function is one of
``tdist.autograd._context``'s and so imports it (and registers it) when the request is
unpickled, before it runs. A process that never imported it has no context, and every call goes
out as it is; the test on the path of every call is ``autograd is not None and
autograd.active``. The two rare calls that need autograd's answer even where no context was
ever opened (an owner asked for ``RRef.backward`` with a context id, which autograd checks in
torch's words; ``rpc._get_debug_info``'s figures) load it with :func:`load_autograd`.

Thread safety: :data:`autograd` is set once, by the thread that imports
``tdist.autograd._context``, before the import ends; any thread may read it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["AutogradHooks", "autograd", "load_autograd", "register"]


class AutogradHooks(Protocol):
    """What RPC asks of distributed autograd (``tdist.autograd._context``, the module, is it)."""

    active: int
    """Contexts known in this process; 0 lets a call skip the rest."""

    def record_call(self, dst: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], Any] | None:
        """For ``rpc_sync``/``rpc_async`` to worker ``dst``: the function and arguments to send
        instead and a function that turns the reply into the caller's result, or None (this
        thread has no context: send the call as it is)."""
        ...

    def record_remote(self, dst: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]] | None:
        """For ``remote()`` on worker ``dst``: the function and arguments to send instead, or
        None (no context in this thread)."""
        ...

    def to_here_with_autograd(self, rref: Any, timeout: float) -> tuple[bool, Any]:
        """``rref.to_here()`` recorded in this thread's context: ``(True, value)``, or
        ``(False, None)`` when this thread has none (fetch it as usual)."""
        ...

    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
        """The distributed backward pass of context ``context_id`` from ``roots``."""
        ...

    def _get_debug_info(self) -> dict[str, int]:
        """torch's figures: ``num_autograd_contexts``, ``num_current_backward_passes``."""
        ...


autograd: AutogradHooks | None = None
"""Distributed autograd, once ``tdist.autograd`` is imported in this process; else None."""


def register(hooks: AutogradHooks) -> None:
    """Make ``hooks`` the distributed autograd RPC calls ask (``tdist.autograd._context`` calls
    it when it is imported)."""
    global autograd
    autograd = hooks


def load_autograd() -> AutogradHooks:
    """:data:`autograd`, importing ``tdist.autograd`` first where no one has: for the calls that
    need its answer though no context was opened here. Never on the path of an RPC."""
    if autograd is None:
        importlib.import_module("..autograd", __package__)  # (its import registers it)
    if autograd is None:
        raise RuntimeError("tdist.autograd was imported but did not register its RPC hooks")
    return autograd
