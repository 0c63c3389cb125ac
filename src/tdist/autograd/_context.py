"""Distributed autograd contexts, the send/recv functions and the backward pass (see the
package docstring)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "DistAutogradContext",
    "_current_context",
    "_is_valid_context",
    "_retrieve_context",
    "backward",
    "context",
    "get_gradients",
    "record_call",
    "record_remote",
    "to_here_with_autograd",
]

_lock = threading.Lock()
_contexts: dict[int, DistAutogradContext] = {}
_tls = threading.local()
_ids = itertools.count(1)
_msg_ids = itertools.count(1)
active = 0  # contexts open in this process (a cheap test for the RPC hot path)


def _rank() -> int:
    from ..rpc._agent import current_agent

    agent = current_agent()
    assert agent is not None
    return int(agent.rank)


class DistAutogradContext:
    """One distributed backward's state on this worker."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.lock = threading.Lock()
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, list[torch.Tensor]] = {}  # autograd message id -> sent tensors
        self.peers: set[int] = set()  # workers this context reached

    def _context_id(self) -> int:
        return self.id

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            old = self.grads.get(tensor)
            self.grads[tensor] = grad.detach().clone() if old is None else old + grad


def _new_id(rank: int) -> int:
    return (rank << 48) | next(_ids)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The context ``context_id`` on this worker.

    Raises:
        RuntimeError: there is none (torch's message).
    """
    with _lock:
        ctx = _contexts.get(context_id)
    if ctx is None:
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    return ctx


def _is_valid_context(context_id: int) -> None:
    """Nothing when ``context_id`` is a context of this worker (torch's behaviour).

    Raises:
        RuntimeError: it is not.
    """
    _retrieve_context(context_id)


def _current_context() -> DistAutogradContext:
    """This thread's context.

    Raises:
        RuntimeError: no context is active in this thread.
    """
    cid = getattr(_tls, "context_id", None)
    if cid is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please wrap your code using: `with torch.distributed.autograd.context() as context_id` to generate a valid context")
    return _retrieve_context(cid)


def _known_context(context_id: int) -> DistAutogradContext:
    """The context ``context_id``, made on first sight (a worker an RPC reached)."""
    global active
    with _lock:
        ctx = _contexts.get(context_id)
        if ctx is None:
            ctx = _contexts[context_id] = DistAutogradContext(context_id)
            active += 1
        return ctx


def _release(context_id: int, sender: int | None = None) -> None:
    """Drop the context here (its ``with`` exit, or an RPC from ``sender``, a worker it
    reached) and on the other workers it reached from here."""
    global active
    with _lock:
        ctx = _contexts.pop(context_id, None)
        if ctx is not None:
            active -= 1
    if ctx is not None:
        peers = sorted(ctx.peers - {sender})
        if peers:
            _release_on(peers, context_id)


@contextlib.contextmanager
def context() -> Iterator[int]:
    """``with context() as context_id``: a distributed autograd context for this thread.

    Raises:
        RuntimeError: this thread has a context already, or RPC is not initialized.
    """
    if getattr(_tls, "context_id", None) is not None:
        raise RuntimeError("Already have an autograd context id for this thread.")
    ctx = _known_context(_new_id(_rank()))
    _tls.context_id = ctx.id
    try:
        yield ctx.id
    finally:
        _tls.context_id = None
        _release(ctx.id)


def _release_on(peers: list[int], context_id: int) -> None:
    me = _rank()
    for p in peers:  # not waited for (a worker releasing it may be the one that asks us)
        with contextlib.suppress(Exception):  # a worker that is gone has nothing to release
            _internal_call(p, _release, (context_id, me))


def _internal_call(dst: int, func: Any, args: tuple[Any, ...]) -> Any:
    """``rpc_async(dst, func, args)`` that no context records (autograd's own messages)."""
    from .. import rpc

    prev = getattr(_tls, "context_id", None)
    _tls.context_id = None
    try:
        return rpc.rpc_async(dst, func, args=args)
    finally:
        _tls.context_id = prev


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in context ``context_id`` on this worker, by tensor.

    Raises:
        RuntimeError: no such context here.
    """
    ctx = _retrieve_context(context_id)
    with ctx.lock:
        return dict(ctx.grads)


# -- send / recv --------------------------------------------------------------------------------
def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists, dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _replace(obj: Any, new: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(new)
    if isinstance(obj, tuple):
        return tuple(_replace(x, new) for x in obj)
    if isinstance(obj, list):
        return [_replace(x, new) for x in obj]
    if isinstance(obj, dict):
        return {k: _replace(v, new) for k, v in obj.items()}
    return obj


class _Recv(torch.autograd.Function):
    """Tensors that came from worker ``src`` under message ``msg_id``: their gradient goes back
    there. The first input, a marker leaf, puts the outputs in the graph."""

    @staticmethod
    def forward(ctx: Any, marker: torch.Tensor, context_id: int, src: int, msg_id: int, *tensors: torch.Tensor) -> Any:
        ctx.route = (context_id, src, msg_id)
        return tuple(t.detach().clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        context_id, src, msg_id = ctx.route
        _retrieve_context(context_id)  # raises when the context is gone
        fut = _internal_call(src, _backward_from_send, (context_id, msg_id, list(grads)))
        sent = getattr(_tls, "sent", None)
        if sent is not None:
            sent.append((src, fut))
        else:  # not inside _run_backward's autograd call in this thread: wait here
            _wait_all([(src, fut)])
        return (None, None, None, None, *([None] * len(grads)))


def _mask(obj: Any) -> list[bool]:
    return [t.requires_grad for t in _tensors(obj)]


def _recv(context_id: int, src: int, msg_id: int, obj: Any, mask: list[bool]) -> Any:
    """``obj`` with the tensors that required grad at the sender behind a recv function."""
    tensors = _tensors(obj)
    chosen = [t for t, m in zip(tensors, mask, strict=True) if m]
    if not chosen:
        return obj
    marker = torch.empty(0, requires_grad=True)
    marker._tdist_recv_marker = True  # type: ignore[attr-defined]
    out = iter(_Recv.apply(marker, context_id, src, msg_id, *chosen))  # type: ignore[no-untyped-call]
    return _replace(obj, iter([next(out) if m else t for t, m in zip(tensors, mask, strict=True)]))


def _record_send(ctx: DistAutogradContext, dst: int, obj: Any) -> tuple[int, list[bool]]:
    msg_id = (_rank() << 48) | next(_msg_ids)
    mask = _mask(obj)
    with ctx.lock:
        if any(mask):
            ctx.sends[msg_id] = [t for t in _tensors(obj) if t.requires_grad]
        ctx.peers.add(dst)
    return msg_id, mask


def record_call(dst: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], Any] | None:
    """For an RPC made in a context: the call to send instead (it carries the context, and
    the tensors of the arguments and of the result that require grad get send and recv
    functions) and a function that turns its reply into the caller's result (None: outside a
    context, send it as it is)."""
    cid = getattr(_tls, "context_id", None)
    if cid is None:
        return None
    ctx = _retrieve_context(cid)
    msg_id, mask = _record_send(ctx, dst, (args, kwargs))

    def unwrap(reply: Any) -> Any:
        resp_id, resp_mask, value = reply
        if resp_id is None:
            return value
        return _recv(cid, dst, resp_id, value, resp_mask)

    return _call_with_autograd, (cid, _rank(), msg_id, mask, func, args, kwargs), unwrap


def _call_with_autograd(context_id: int, src: int, msg_id: int, mask: list[bool], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the callee: the arguments behind a recv, the call (in the context), its result
    recorded as a send."""
    ctx = _known_context(context_id)
    with ctx.lock:
        ctx.peers.add(src)
    args, kwargs = _recv(context_id, src, msg_id, (args, kwargs), mask)
    prev = getattr(_tls, "context_id", None)
    _tls.context_id = context_id
    try:
        result = func(*args, **kwargs)
    finally:
        _tls.context_id = prev
    if not any(_mask(result)):
        return (None, None, result)
    resp_id, resp_mask = _record_send(ctx, src, result)
    return (resp_id, resp_mask, result)


def _remote_with_autograd(context_id: int, src: int, msg_id: int, mask: list[bool], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the owner of a ``remote()`` made in a context: as ``_call_with_autograd``, but the
    result itself is the value (a ``to_here`` in a context records its send)."""
    ctx = _known_context(context_id)
    with ctx.lock:
        ctx.peers.add(src)
    args, kwargs = _recv(context_id, src, msg_id, (args, kwargs), mask)
    prev = getattr(_tls, "context_id", None)
    _tls.context_id = context_id
    try:
        return func(*args, **kwargs)
    finally:
        _tls.context_id = prev


def record_remote(dst: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]] | None:
    """For a ``remote()`` made in a context: the call to send instead (None: outside a
    context)."""
    cid = getattr(_tls, "context_id", None)
    if cid is None:
        return None
    msg_id, mask = _record_send(_retrieve_context(cid), dst, (args, kwargs))
    return _remote_with_autograd, (cid, _rank(), msg_id, mask, func, args, kwargs)


def _fetch_with_autograd(rref: Any, context_id: int, src: int) -> Any:
    """On an RRef's owner: its value, recorded as a send in the context when it requires grad."""
    value = rref.local_value()
    if not any(_mask(value)):
        return (None, None, value)
    ctx = _known_context(context_id)
    resp_id, resp_mask = _record_send(ctx, src, value)
    return (resp_id, resp_mask, value)


def to_here_with_autograd(rref: Any, timeout: float) -> tuple[bool, Any]:
    """``rref.to_here()`` inside a context (torch records autograd for every fetch there):
    ``(True, value)``, or ``(False, None)`` outside a context."""
    cid = getattr(_tls, "context_id", None)
    if cid is None:
        return False, None
    from .. import rpc

    owner = rref.owner()
    ctx = _retrieve_context(cid)
    with ctx.lock:
        ctx.peers.add(owner.id)
    resp_id, resp_mask, value = rpc.rpc_sync(owner, _fetch_with_autograd, args=(rref, cid, _rank()), timeout=timeout)
    if resp_id is None:
        return True, value
    return True, _recv(cid, owner.id, resp_id, value, resp_mask)


# -- backward -----------------------------------------------------------------------------------
def _leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors that require grad behind ``roots``, recv markers included."""
    seen: set[Any] = set()
    found: dict[int, torch.Tensor] = {}
    stack: list[Any] = []
    for r in roots:
        if r.grad_fn is None:
            found.setdefault(id(r), r)
        else:
            stack.append(r.grad_fn)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            found.setdefault(id(var), var)
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return list(found.values())


def _run_backward(ctx: DistAutogradContext, roots: list[torch.Tensor], grads: list[torch.Tensor], retain_graph: bool) -> None:
    """Autograd from ``roots`` here (leaf gradients into ``ctx``), then wait for the gradients it
    sent on to other workers to be carried through there."""
    inputs = _leaves(roots)
    # The gradients this pass sends on are this pass's to wait for: another thread may run a
    # backward in the same context meanwhile (a worker's gradients coming back while its own
    # pass still runs), and waiting for that pass's sends could wait for ourselves.
    outer = getattr(_tls, "sent", None)
    sent: list[tuple[int, Any]] = []
    _tls.sent = sent
    try:
        computed = torch.autograd.grad(roots, inputs, grads, retain_graph=retain_graph, allow_unused=True)
    finally:
        _tls.sent = outer
    for leaf, g in zip(inputs, computed, strict=True):
        if g is not None and not getattr(leaf, "_tdist_recv_marker", False):
            ctx.accumulate(leaf, g)
    _wait_all(sent)


def _wait_all(sent: list[tuple[int, Any]]) -> None:
    """Wait for the gradients sent on to be carried through on their workers; raises the
    first error."""
    from ..rpc._agent import current_agent

    agent = current_agent(required=False)
    errors = []
    for dst, fut in sent:
        try:  # the agent reads the reply in this thread where it can (no hand-off)
            agent.wait(fut, dst, None) if agent is not None else fut.wait()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _backward_from_send(context_id: int, msg_id: int, grads: list[Any]) -> None:
    """On a worker that sent tensors: the gradients of what it sent came back; carry on."""
    ctx = _retrieve_context(context_id)
    with ctx.lock:
        sent = ctx.sends.get(msg_id)
    if sent is None:
        raise RuntimeError(f"autograd context {context_id} has no send with message id {msg_id}")
    pairs = [(t, g) for t, g in zip(sent, grads, strict=True) if g is not None]
    if pairs:
        _run_backward(ctx, [t for t, _ in pairs], [g for _, g in pairs], retain_graph=True)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``.

    Raises:
        RuntimeError: unknown context, a root that is not a scalar or does not require grad,
            or an error on any worker the pass reached (naming it).
    """
    ctx = _retrieve_context(context_id)
    if not isinstance(roots, (list, tuple)) or not roots:
        raise RuntimeError("roots must be a non-empty list of tensors")
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"roots must be tensors, got {type(r).__name__}")
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if r.numel() != 1:
            raise RuntimeError(f"Non-scalar root tensors are not supported (got shape {tuple(r.shape)}); use a scalar loss")
    _run_backward(ctx, list(roots), [torch.ones_like(r) for r in roots], retain_graph)
