"""Distributed autograd contexts, the send/recv functions and the backward pass (see the
package docstring).

RPC does not import this module: it is the implementation of RPC's hook point
(``rpc._hooks.AutogradHooks``: ``active``, ``record_call``, ``record_remote``,
``to_here_with_autograd``, ``backward``, ``_get_debug_info``) and registers itself there as the
last step of its import. The functions a recorded call sends (``_call_with_autograd``, ...) are
this module's, so a callee imports it, and registers it, when it unpickles the first one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import reprlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import rpc
from .._core.errors import fail_future, fresh
from ..c10d._threads import capped, usable_cores
from ..rpc import _agent as _agent_module
from ..rpc import _hooks
from ..rpc._agent import current_agent, wait_replies
from ..rpc._api import _mapped
from ..rpc._execution import _not_a_future, run_user_function
from ..rpc._future import _as_runtime_error

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
    "active",
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
_ids = itertools.count(0)  # (torch's first context id on a worker is its id << 48)
_msg_ids = itertools.count(1)
_pass_ids = itertools.count(1)
active = 0  # contexts open in this process (a cheap test for the RPC hot path)
_passes = 0  # backward passes running on this worker (started here or reached it)


_worker_id: int | None = None  # ``_init``'s: a worker's id without RPC (local-only contexts)


def _rank() -> int:
    """This worker's id: its RPC rank, else what ``_init`` gave, else its rank in the RPC
    group it last was in (torch's container keeps it after ``rpc.shutdown``).

    Raises:
        RuntimeError: none of these (torch's message).
    """
    agent = current_agent(required=False)
    if agent is not None:
        return int(agent.rank)
    if _worker_id is not None:
        return _worker_id
    if _agent_module.last_rank is not None:
        return _agent_module.last_rank
    raise RuntimeError("Need to initialize distributed autograd using torch.distributed.autograd.init()")


def _init(worker_id: int) -> None:
    """Give this process worker id ``worker_id`` for distributed autograd without RPC
    (torch's private ``_init``: contexts and local backward passes, as its tests use them).

    Raises:
        TypeError: not an int.
        RuntimeError: initialized already with another id (torch's message).
    """
    global _worker_id
    if not isinstance(worker_id, int) or isinstance(worker_id, bool):
        raise TypeError(f"_init(): worker_id must be an int, got {type(worker_id).__name__}")
    with _lock:
        if _worker_id is not None and _worker_id != worker_id:
            raise RuntimeError(
                f"Container is already initialized with worker_id: {_worker_id}, cannot initialize "
                f"with different worker_id: {worker_id}"
            )
        _worker_id = worker_id


def _get_max_id() -> int:
    """The largest context id this worker can make (its ids are ``worker_id << 48`` on)."""
    return ((_rank() + 1) << 48) - 1


class DistAutogradContext:
    """One distributed backward's state on this worker."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.lock = threading.Lock()
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, list[torch.Tensor]] = {}  # autograd message id -> sent tensors
        self.peers: set[int] = set()  # workers this context reached
        self.spent: dict[int, int] = {}  # send message id -> the pass without retain_graph that went through it

    def _context_id(self) -> int:
        return self.id

    def _known_worker_ids(self) -> set[int]:
        """The ids of the workers this context reached or was reached from (torch's method)."""
        with self.lock:
            return set(self.peers)


def _get_debug_info() -> dict[str, int]:
    """torch's figures: ``num_autograd_contexts`` (contexts known on this worker) and
    ``num_current_backward_passes`` (backward passes running here: started here, or carried on
    here from another worker)."""
    with _lock:
        return {"num_autograd_contexts": len(_contexts), "num_current_backward_passes": _passes}


def _pass_started() -> None:
    global _passes
    with _lock:
        _passes += 1


def _pass_done(*_: Any) -> None:
    global _passes
    with _lock:
        _passes -= 1


def _new_id(rank: int) -> int:
    return (rank << 48) | next(_ids)


def _bad_arguments(name: str, signature: str, *given: Any) -> TypeError:
    """The ``TypeError`` of a function given arguments of the wrong types, in the words of
    torch's bindings (which its tests match: "incompatible function arguments")."""
    shown = ", ".join(reprlib.repr(g) for g in given)
    return TypeError(
        f"{name}(): incompatible function arguments. The following argument types are supported:\n"
        f"    1. {signature}\n\nInvoked with: {shown}"
    )


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The context ``context_id`` on this worker.

    Raises:
        TypeError: ``context_id`` is not an int. RuntimeError: there is none (torch's message).
    """
    if not isinstance(context_id, int):
        raise _bad_arguments("_retrieve_context", "(context_id: int) -> DistAutogradContext", context_id)
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


class context:
    """``with context() as context_id``: a distributed autograd context for this thread
    (``torch.distributed.autograd.context``).

    Raises:
        RuntimeError: on entry, when this thread has a context already or RPC is not
            initialized.
    """

    def __enter__(self) -> int:
        self.autograd_context = _new_context()
        return self.autograd_context.id

    def __exit__(self, *exc: object) -> None:
        _release_context(self.autograd_context.id)


def _new_context() -> DistAutogradContext:
    """A new context, this thread's from now on (what ``context`` enters; torch's private
    ``_new_context``).

    Raises:
        RuntimeError: this thread has a context already, or no worker id (RPC, ``_init``).
    """
    if getattr(_tls, "context_id", None) is not None:
        raise RuntimeError("Already have an autograd context id for this thread.")
    ctx = _known_context(_new_id(_rank()))
    _tls.context_id = ctx.id
    return ctx


def _release_context(context_id: int) -> None:
    """Release context ``context_id`` here and on the workers it reached (what ``context``
    does on exit; torch's private ``_release_context``).

    Raises:
        RuntimeError: there is no such context here (torch's message).
    """
    if getattr(_tls, "context_id", None) == context_id:
        _tls.context_id = None
    with _lock:
        known = context_id in _contexts
    if not known:
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    _release(context_id)


def _release_on(peers: list[int], context_id: int) -> None:
    agent = current_agent()
    assert agent is not None
    me = int(agent.rank)
    for p in peers:  # one-way: not waited for (a worker releasing it may be the one that asks us)
        with contextlib.suppress(Exception):  # a worker that is gone has nothing to release
            agent.cast(p, _release, (context_id, me))


def _internal_call(dst: int, func: Any, args: tuple[Any, ...]) -> Any:
    """``rpc_async(dst, func, args)`` that no context records (autograd's own messages)."""
    prev = getattr(_tls, "context_id", None)
    _tls.context_id = None
    try:
        return rpc.rpc_async(dst, func, args=args)
    finally:
        _tls.context_id = prev


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in context ``context_id`` on this worker, by tensor.

    Raises:
        TypeError: ``context_id`` is not an int. RuntimeError: no such context here.
    """
    if not isinstance(context_id, int):
        raise _bad_arguments("get_gradients", "(context_id: int) -> dict[torch.Tensor, torch.Tensor]", context_id)
    ctx = _retrieve_context(context_id)
    with ctx.lock:
        return dict(ctx.grads)


# -- send / recv --------------------------------------------------------------------------------
def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists, dicts), in order."""
    out: list[torch.Tensor] = []
    _collect(obj, out)
    return out


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    # (one list filled in one walk: a call's arguments are walked on every recorded call)
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _collect(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, out)


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
        pass_id, retain = getattr(_tls, "pass_", None) or (0, True)
        fut = _internal_call(src, _backward_from_send, (context_id, msg_id, list(grads), pass_id, retain))
        sent = getattr(_tls, "sent", None)
        if sent is not None:
            sent.append((src, fut))
        else:  # not inside a pass's autograd call in this thread (a user's own): wait here
            wait_replies([(src, fut)])
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
    tensors = _tensors(obj)
    mask = [t.requires_grad for t in tensors]
    with ctx.lock:
        if any(mask):
            ctx.sends[msg_id] = [t for t, m in zip(tensors, mask, strict=True) if m]
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


def _run_in_context(context_id: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """``func(*args, **kwargs)`` with ``context_id`` as this thread's context: ``(is_async,
    result)`` as the agent runs a call."""
    prev = getattr(_tls, "context_id", None)
    _tls.context_id = context_id
    try:
        return run_user_function(func, args, kwargs)
    finally:
        _tls.context_id = prev


def _future_of(is_async: bool, result: Any, func: Any, then: Any) -> Any:
    """A future of ``then(value)``: at once, or when ``result`` (an ``async_execution``
    function's future) completes."""
    if not is_async:
        out: Any = torch.futures.Future()
        out.set_result(then(result))
        return out
    if not isinstance(result, torch._C.Future):
        raise _not_a_future(func, result)
    return _mapped(result, then)


def _call_with_autograd(context_id: int, src: int, msg_id: int, mask: list[bool], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the callee: the arguments behind a recv, the call (in the context), its result
    recorded as a send (a future, so that ``async_execution`` functions work as well)."""
    ctx = _known_context(context_id)
    with ctx.lock:
        ctx.peers.add(src)
    args, kwargs = _recv(context_id, src, msg_id, (args, kwargs), mask)
    is_async, result = _run_in_context(context_id, func, args, kwargs)

    def reply(value: Any) -> Any:
        if not any(_mask(value)):
            return (None, None, value)
        resp_id, resp_mask = _record_send(ctx, src, value)
        return (resp_id, resp_mask, value)

    return _future_of(is_async, result, func, reply)


def _remote_with_autograd(context_id: int, src: int, msg_id: int, mask: list[bool], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the owner of a ``remote()`` made in a context: as ``_call_with_autograd``, but the
    result itself is the value (a ``to_here`` in a context records its send)."""
    ctx = _known_context(context_id)
    with ctx.lock:
        ctx.peers.add(src)
    args, kwargs = _recv(context_id, src, msg_id, (args, kwargs), mask)
    is_async, result = _run_in_context(context_id, func, args, kwargs)
    return _future_of(is_async, result, func, lambda value: value)


# both reply through a future (marked as ``rpc.functions.async_execution`` marks its functions,
# without its wrapper)
for _fn in (_call_with_autograd, _remote_with_autograd):
    _fn._wrapped_async_rpc_function = _fn  # type: ignore[attr-defined]


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
    owner = rref.owner()
    ctx = _retrieve_context(cid)
    with ctx.lock:
        ctx.peers.add(owner.id)
    resp_id, resp_mask, value = rpc.rpc_sync(owner, _fetch_with_autograd, args=(rref, cid, _rank()), timeout=timeout)
    if resp_id is None:
        return True, value
    return True, _recv(cid, owner.id, resp_id, value, resp_mask)


# -- backward -----------------------------------------------------------------------------------
#
# A backward pass starts on one worker (``backward``) and goes on wherever a recv function's
# gradient goes: ``_backward_from_send`` on the worker that sent those tensors runs autograd from
# them, and so on. Every pass carries its id and the caller's ``retain_graph``. A worker may run
# several partial passes over one graph (a tensor used here and also sent away gets its
# gradients in two parts; a send may get partial gradients from several passes of its
# receiver), so they keep the graph (freed with the context), except where nothing can come
# back into it; a send that a pass without ``retain_graph`` went through refuses a later pass,
# as torch's freed graph would.

_SECOND_TIME = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward."
)


def _graph(roots: list[torch.Tensor]) -> tuple[list[torch.Tensor], set[Any]]:
    """The leaf tensors that require grad behind ``roots`` (recv markers included), and the
    graph's nodes."""
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
    return list(found.values()), seen


def _local_pass(ctx: DistAutogradContext, roots: list[torch.Tensor], grads: list[torch.Tensor], retain_graph: bool, pass_: tuple[int, bool]) -> list[tuple[int, Any]]:
    """Autograd from ``roots`` here (leaf gradients into ``ctx``); returns the gradients it sent
    on to other workers, as ``(worker, future)``, for the caller to wait for.

    The sends are this pass's own (thread-local, not the context's): another thread may run a
    pass in the same context meanwhile, and waiting for its sends could wait for ourselves."""
    inputs, _ = _graph(roots)
    outer = getattr(_tls, "sent", None), getattr(_tls, "pass_", None)
    sent: list[tuple[int, Any]] = []
    _tls.sent, _tls.pass_ = sent, pass_
    try:  # (when it fails half-way, what it sent on finishes on its own)
        _through_leaves(ctx, roots, inputs, grads, retain_graph)
    finally:
        _tls.sent, _tls.pass_ = outer
    return sent


#: Held while this process's ``.grad`` fields are lent out: a pass lends each leaf's ``.grad``
#: the context's gradient of it while the leaf's accumulation node runs, and
#: ``DistributedOptimizer``'s local step lends the context's gradients to ``.grad``. One at a
#: time in this process (torch's engine writes a leaf's ``.grad`` in C++ under a lock of its
#: own, which Python's ``.grad =`` does not take: a step that set ``.grad`` while another
#: thread's pass accumulated into it corrupted memory); re-entrant, for a pass that runs
#: another in its own thread.
leaves_lock = threading.RLock()


def _through_leaves(ctx: DistAutogradContext, roots: list[torch.Tensor], leaves: list[torch.Tensor], grads: list[torch.Tensor], retain_graph: bool) -> None:
    """Autograd from ``roots`` to ``leaves`` (recv markers among them: reaching one sends its
    gradients on), the leaves' gradients accumulated into ``ctx``, as torch's engine does for
    distributed autograd: each leaf's gradient-accumulation node runs, with its hooks, which is
    where DistributedDataParallel's reducer averages a gradient across its ranks (and where
    ``AccumulateGrad.register_hook``'s hooks run).

    A pass alone in this process runs as one backward, the leaves' ``.grad`` lent from the
    context (``_into_context``) throughout. A pass that runs beside others (a pipeline's
    micro-batches) runs in two steps, as torch's distributed engine captures a leaf's gradient
    and then runs its node's hooks: the graph's gradients first, into nothing shared
    (``autograd.grad``), at the same time as the others; then the leaves' accumulation nodes
    with their hooks, one pass at a time. (Two steps cost a pass of a small model a third more:
    an alias and a second backward call.) A leaf with hooks of its own (``Tensor.register_hook``)
    runs them in the first step, and would run them again in the second: such a pass runs as
    one backward."""
    if not leaves:
        return
    with _engine.computing() as (crowded, backlog):
        if not crowded or any(leaf._backward_hooks for leaf in leaves):
            _into_context(ctx, leaves, lambda: torch.autograd.backward(roots, grads, retain_graph=retain_graph, inputs=leaves))
            return
        with capped(1) if backlog else contextlib.nullcontext():
            computed: list[torch.Tensor | None] = list(torch.autograd.grad(roots, leaves, grads, retain_graph=retain_graph, allow_unused=True))
    reached = [(leaf, g) for leaf, g in zip(leaves, computed, strict=True) if g is not None and not getattr(leaf, "_tdist_recv_marker", False)]
    del computed
    if reached:
        chosen = [leaf for leaf, _ in reached]
        # (an alias's backward hands the gradient as it is, sparse too, to the leaf's own
        # accumulation node, hooks and all)
        views = [torch.ops.aten.alias(leaf) for leaf in chosen]
        _into_context(ctx, chosen, lambda: torch.autograd.backward(views, [g for _, g in reached], inputs=chosen))


def _into_context(ctx: DistAutogradContext, leaves: list[torch.Tensor], run: Callable[[], None]) -> None:
    """``run`` (a backward to ``leaves``) with each leaf's ``.grad`` lent the context's gradient
    of it: its accumulation node adds into that in place, and its hooks (DDP's reducer) see the
    context's gradient, as in torch, where the reducer reads and writes a variable's gradient
    in the current distributed autograd context. Each ``.grad`` is given back its value after,
    so that distributed autograd leaves ``.grad`` as it found it, as torch's does. (A tensor
    taken from ``get_gradients`` earlier sees later passes, as torch's.)"""
    real = [leaf for leaf in leaves if not getattr(leaf, "_tdist_recv_marker", False)]
    with leaves_lock:
        saved = [leaf.grad for leaf in leaves]
        with ctx.lock:
            lent = [ctx.grads.get(leaf) for leaf in real]
        for leaf in leaves:
            leaf.grad = None
        try:
            for leaf, g in zip(real, lent, strict=True):
                leaf.grad = g
            run()
            got = [leaf.grad for leaf in real]
        finally:
            for leaf, old in zip(leaves, saved, strict=True):
                leaf.grad = old
    with ctx.lock:
        for leaf, was, now in zip(real, lent, got, strict=True):
            if now is not None and now is not was:  # (the node's own new tensor, or a hook's)
                # a view (DDP's bucket, with ``gradient_as_bucket_view``) is not ours to keep
                ctx.grads[leaf] = now.detach().clone() if now._is_view() else now.detach()


class _Engine:
    """The threads that run the backward passes reaching this worker from others: one a core,
    two at least.

    torch's distributed engine runs them on its RPC pool, several at once: a pipeline's
    micro-batches reach a shard together, each too small a pass to keep the cores busy alone
    (pytorch/examples' ``rpc/pipeline``: its backward took 1.4x torch's time with these passes
    run one at a time). They run here on a few threads of their own, not on whichever RPC
    thread received them: each thread allocates from a memory arena of its own, and 24 passes
    spread over 24 threads faulted in fresh pages for every gradient, with twice torch's system
    time. While passes wait for a thread, each computes on one intra-op thread (``capped``):
    the passes alone keep the cores busy, and two of them, each with an OpenMP team, on two
    cores wait for each other's threads to be scheduled (``bench_pipeline.py``, micro-batches of one
    image: backward 4.4 s capped, 5.2 s not); a few passes at once keep their threads (of eight
    images, three at once: 1.6 s not capped, 1.9 s capped). A ``backward`` on the caller's thread counts
    as one of the passes running.
    Nothing is handed off while passes come one at a time (a parameter server's)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """As new (also in a forked child, which has none of the threads)."""
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._pending = 0  # passes submitted and not done
        self._running = 0  # passes computing (``computing``)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job``: here when no other pass is pending (a parameter server's one pass at a
        time: no hand-off), else on a pass thread."""
        with self._lock:
            self._pending += 1
            here = self._pending == 1
            start = not here and not self._started
            self._started |= start
        if start:
            for i in range(_threads()):
                threading.Thread(target=self._loop, name=f"tdist-backward-{i}", daemon=True).start()
        if here:
            self._run(job)
        else:
            self._jobs.put(job)

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        finally:
            with self._lock:
                self._pending -= 1

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            self._run(job)
            del job  # (not kept alive, with its tensors, while this thread waits)

    @contextlib.contextmanager
    def computing(self) -> Iterator[tuple[bool, bool]]:
        """Inside: this thread computes a pass. Yields whether another does too (or waits to),
        and whether passes wait for a thread (more are pending than run at once: the pass
        threads and one where it arrived)."""
        with self._lock:
            self._running += 1
            crowded = self._running > 1 or self._pending > 1
            backlog = self._pending > _threads() + 1
        try:
            yield crowded, backlog
        finally:
            with self._lock:
                self._running -= 1


def _threads() -> int:
    """How many pass threads (``_Engine``): one a core, two at least."""
    return max(2, usable_cores())


_engine = _Engine()
os.register_at_fork(after_in_child=_engine.reset)


def _when_all(sent: list[tuple[int, Any]]) -> Any:
    """A future done when every gradient sent on was carried through (the first error)."""
    out: Any = torch.futures.Future()
    if not sent:
        out.set_result(None)
        return out
    lock = threading.Lock()
    left = [len(sent)]
    errors: list[BaseException] = []

    def one(f: Any) -> None:
        try:
            f.wait()
        except BaseException as exc:
            errors.append(fresh(exc))  # (the list, which this frame holds, keeps it: see ``fresh``)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            if errors:
                fail_future(out, errors[0])
            else:
                out.set_result(None)

    for _, fut in sent:
        fut.add_done_callback(one)
    return out


def _backward_from_send(context_id: int, msg_id: int, grads: list[Any], pass_id: int = 0, retain: bool = True) -> Any:
    """On a worker that sent tensors: the gradients of what it sent came back; carry on, on a
    pass thread (``_Engine``). The reply waits (without holding a thread) until what this sends
    on is carried through."""
    ctx = _retrieve_context(context_id)
    with ctx.lock:
        sent = ctx.sends.get(msg_id)
        spent_by = ctx.spent.get(msg_id)
    if sent is None:
        raise RuntimeError(f"autograd context {context_id} has no send with message id {msg_id}")
    if spent_by is not None and spent_by != pass_id:
        raise RuntimeError(_SECOND_TIME)
    pairs = [(t, g) for t, g in zip(sent, grads, strict=True) if g is not None]
    if not pairs:
        return _when_all([])
    out: Any = torch.futures.Future()

    def failed(exc: BaseException) -> None:
        # (the worker where a pass fails says so, "Error on Node 1: ...", unless the pass began
        # here: its ``backward`` says it, once; the workers it passes on its way back do not)
        if isinstance(exc, Exception):
            exc = _node_failure(exc, prefix=pass_id >> 48 != _rank())
        fail_future(out, exc)

    def run() -> None:
        try:
            sent_on = _local_pass(ctx, [t for t, _ in pairs], [g for _, g in pairs], True, (pass_id, retain))
        except BaseException as exc:
            _pass_done()
            failed(exc)
            return
        if not retain:
            with ctx.lock:
                ctx.spent[msg_id] = pass_id

        def done(f: Any) -> None:
            _pass_done()
            try:
                f.wait()
            except BaseException as exc:
                fail_future(out, exc)  # (said by the worker where it failed)
                return
            out.set_result(None)

        _when_all(sent_on).add_done_callback(done)

    _pass_started()
    _engine.submit(run)
    return out


# (as ``_call_with_autograd``)
_backward_from_send._wrapped_async_rpc_function = _backward_from_send  # type: ignore[attr-defined]


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``.

    Raises:
        TypeError: ``roots`` is not a list of tensors (torch's binding).
        RuntimeError: unknown context, a root that is not a scalar or does not require grad,
            or an error on any worker the pass reached (naming it).
    """
    if (
        not isinstance(context_id, int)
        or not isinstance(roots, (list, tuple))
        or not all(isinstance(r, torch.Tensor) for r in roots)
    ):
        signature = "(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None"
        raise _bad_arguments("backward", signature, context_id, roots)
    ctx = _retrieve_context(context_id)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, r in enumerate(roots):  # (torch's checks and messages)
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if r.numel() != 1:
            raise RuntimeError(f"root {i} (shape {tuple(r.shape)}) is not a scalar, all roots need to be scalar")
        if r.grad_fn is None:
            raise RuntimeError(f"root {i} (a leaf tensor) does not have a valid gradient function.")
    roots = list(roots)
    retain = retain_graph
    if not retain:  # a tensor sent from here whose graph this pass goes through gets its
        # gradient from the other side later: that part of the graph must stay
        with ctx.lock:
            sent_nodes = {t.grad_fn for ts in ctx.sends.values() for t in ts if t.grad_fn is not None}
        retain = bool(sent_nodes) and bool(_graph(roots)[1] & sent_nodes)
    pass_ = ((_rank() << 48) | next(_pass_ids), retain_graph)
    _pass_started()
    try:
        wait_replies(_local_pass(ctx, roots, [torch.ones_like(r) for r in roots], retain, pass_))
    except Exception as exc:
        failure = _node_failure(exc)
        try:
            raise failure from failure.__cause__
        finally:  # (no cycle through this frame: see ``errors.fresh``)
            del failure
    finally:
        _pass_done()


def _node_failure(exc: Exception, prefix: bool = True) -> BaseException:
    """A failure of a pass on this worker as torch's engine raises it: a ``RuntimeError``
    "Error on Node N: ..." (N: this worker's id), whatever was raised (a callee's failure that
    comes back says "Error on Node 0: Error on Node 1: ...", as torch's). Here it is still its
    own type too where the two combine (``_as_runtime_error``; it pickles as itself), else (a
    plain ``Exception`` or ``RuntimeError``, a type that does not combine) a ``RuntimeError``
    caused by it. Without ``prefix``: ``exc`` itself, a plain ``Exception`` as a
    ``RuntimeError`` with its text (which an RPC reply carries as such)."""
    if prefix:
        text = f"Error on Node {_rank()}: {exc}"
        twin = _as_runtime_error(exc, text)
        if twin is not exc:
            return twin
    elif type(exc) is not Exception:
        return exc
    else:
        text = str(exc)
    failure = RuntimeError(text).with_traceback(exc.__traceback__)
    failure.__cause__ = exc
    return failure


# -- registration -------------------------------------------------------------------------------
# Last, so that a thread that finds this module imported (a callee unpickling one of the
# functions above) finds RPC's hooks set too. The module itself is the hooks: mypy checks it
# against ``rpc._hooks.AutogradHooks`` here.
from . import _context as _this  # noqa: E402  isort: skip

_hooks.register(_this)
