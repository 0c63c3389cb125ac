"""Distributed autograd (``torch.distributed.autograd``): gradients through RPC calls.

Theory of operation (torch's FAST mode). Inside ``with context() as context_id``, every RPC
(``rpc_sync``, ``rpc_async``, ``remote``, and ``to_here``) carries the context: the tensors of
its arguments that require grad are recorded as a *send* on the caller (under an autograd
message id) and rebuilt on the callee as outputs of a *recv* function; the result's tensors
that require grad are recorded as a send on the callee and rebuilt on the caller behind a recv
function. ``backward(context_id, roots)`` runs torch autograd from the
roots on this worker; when a recv function's backward runs, it sends the gradient over RPC to
the worker that sent the tensors, which runs autograd from that send in the same context, and
so on across workers. ``backward`` returns when every worker's part has finished; an error
anywhere is raised on the caller with the worker named. Gradients of leaf tensors accumulate in
the context of the worker that owns them (``get_gradients``), never in ``.grad``. Leaving the
``with`` block releases the context on every worker it reached.

Torch records a reply only when the request carried tensors that require grad (or for
``to_here``); here every call inside a context does, so that a parameter server's output comes
back differentiable whatever the inputs.

RPC does not import this package; this package imports RPC and, when imported, plugs into it
(``rpc._hooks``): a process that never imports it has no context, and its calls go out as they
are. A callee that receives a recorded call imports it with the call's function.
"""

from __future__ import annotations

from ._context import (
    DistAutogradContext,
    _current_context,
    _get_debug_info,
    _get_max_id,
    _init,
    _is_valid_context,
    _new_context,
    _release_context,
    _retrieve_context,
    backward,
    context,
    get_gradients,
)


def is_available() -> bool:
    """True: distributed autograd is always built here (torch's ``is_available``)."""
    return True


__all__ = [
    "DistAutogradContext",
    "_current_context",
    "_get_debug_info",
    "_get_max_id",
    "_init",
    "_is_valid_context",
    "_new_context",
    "_release_context",
    "_retrieve_context",
    "backward",
    "context",
    "get_gradients",
    "is_available",
]
