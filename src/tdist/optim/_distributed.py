"""``DistributedOptimizer``: one local ``torch.optim`` optimizer per worker that owns
parameters, stepped with the gradients of a distributed autograd context.

Theory of operation. The constructor groups the parameter RRefs by owner and creates, over RPC,
a ``_LocalOptimizer`` on each owner over its parameters (the values of the RRefs there); it
waits for them, so a bad argument fails here. ``step(context_id)`` asks every owner at once to
step its optimizer with that worker's gradients in the context; it returns when all are done
and raises the first error, naming the worker. Steps in one process take turns (they go
through the parameters' ``.grad``).

Torch runs its eight built-in optimizers (SGD, Adam, AdamW, Adagrad, Adadelta, RMSprop, Rprop,
Adamax) as "functional" ones that take the gradients as arguments: their defaults differ a
little (SGD's ``lr`` is 0.01, Adamax's 0.001), they refuse a few arguments, and they leave
``.grad`` alone. Here the same ``torch.optim`` classes behave that way (``is_functional_optim``):
the gradients are lent to ``.grad`` for the step and the old values put back. Any other
optimizer class gets torch's plain behaviour: the context's gradients are set as ``.grad``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from .. import autograd as dist_autograd
from .. import rpc
from ..autograd._context import leaves_lock
from ..rpc._agent import wait_replies

__all__ = ["DistributedOptimizer"]

# torch's functional optimizers: the defaults that differ from torch.optim's, and the
# arguments they do not take
_FUNCTIONAL: dict[type, tuple[dict[str, Any], frozenset[str]]] = {
    torch.optim.SGD: ({"lr": 0.01}, frozenset({"differentiable"})),
    torch.optim.Adam: ({}, frozenset({"capturable", "differentiable", "decoupled_weight_decay"})),
    torch.optim.AdamW: ({}, frozenset({"capturable", "differentiable"})),
    torch.optim.Adagrad: ({}, frozenset({"differentiable"})),
    torch.optim.Adadelta: ({}, frozenset({"capturable", "differentiable"})),
    torch.optim.RMSprop: ({}, frozenset({"capturable", "differentiable"})),
    torch.optim.Rprop: ({}, frozenset({"capturable", "differentiable"})),
    torch.optim.Adamax: ({"lr": 0.001}, frozenset({"capturable", "differentiable"})),
}

# steps of this process's local optimizers take turns with each other and with its distributed
# backward passes: both lend gradients to .grad (see leaves_lock)
_step_lock = leaves_lock


class _LocalOptimizer:
    """On a parameters' owner: the optimizer over its parameters."""

    def __init__(self, optim_cls: Any, functional: bool, rrefs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.params = [r.local_value() for r in rrefs]
        self.functional = functional
        # torch's functional optimizers take any tensor, torch.optim only leaves: a non-leaf
        # one is stepped through a detached alias of its memory (it gets no gradient in a
        # context, where only leaves accumulate one, so it stays as it is, as in torch)
        self.targets = [p.detach() if functional and not p.is_leaf else p for p in self.params]
        self.optim = optim_cls(self.targets, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _step_lock:
            if not self.functional:  # torch's plain path: every gradient here becomes .grad
                for param, grad in grads.items():
                    param.grad = grad
                self.optim.step()
                return
            # as a functional optimizer: the parameters that have a gradient step with it,
            # the others not at all, and .grad stays as it was
            targets = self.targets
            kept = [t.grad for t in targets]
            try:
                for p, t in zip(self.params, targets, strict=True):
                    g = grads.get(p)
                    t.grad = None if g is None else g.to(t.dtype)
                self.optim.step()
            finally:
                for t, old in zip(targets, kept, strict=True):
                    t.grad = old


def _new_local(optim_cls: Any, functional: bool, rrefs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return rpc.RRef(_LocalOptimizer(optim_cls, functional, rrefs, args, kwargs))


def _local_step(local: Any, context_id: int) -> None:
    local.local_value().step(context_id)


class DistributedOptimizer:
    """Step parameters spread over workers with the gradients of a distributed autograd
    context (``torch.distributed.optim.DistributedOptimizer``).

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` class, made on every owner.
        params_rref: RRefs to the parameters (``nn.Parameter`` or tensors), any owners.
        *args, **kwargs: the optimizer's arguments (``lr=``...).

    Raises:
        TypeError: ``params_rref`` is not a list of RRefs; an argument the optimizer does not
            take. Any error making an optimizer on an owner.
    """

    def __init__(self, optimizer_class: Any, params_rref: list[Any], *args: Any, **kwargs: Any) -> None:
        by_owner: dict[Any, list[Any]] = defaultdict(list)
        for r in params_rref:
            if not isinstance(r, rpc.RRef):
                raise TypeError(f"params_rref must be a list of RRefs, got {type(r).__name__}")
            by_owner[r.owner()].append(r)
        self.optimizer_class = optimizer_class
        functional = _FUNCTIONAL.get(optimizer_class)
        self.is_functional_optim = functional is not None
        if functional is not None:
            defaults, refused = functional
            for k in refused & kwargs.keys():
                raise TypeError(f"{optimizer_class.__name__}.__init__() got an unexpected keyword argument '{k}'")
            if not args:
                kwargs = {**defaults, **kwargs}
        calls = [
            (owner.id, rpc.rpc_async(owner, _new_local, args=(optimizer_class, self.is_functional_optim, rrefs, args, kwargs)))
            for owner, rrefs in by_owner.items()
        ]
        self.remote_optimizers = wait_replies(calls)

    def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` on every owner.

        Raises:
            RuntimeError: ``context_id`` is not a valid context here; any owner's error.
        """
        dist_autograd._retrieve_context(context_id)
        calls = []
        for opt in self.remote_optimizers:
            owner = opt.owner()
            calls.append((owner.id, rpc.rpc_async(owner, _local_step, args=(opt, context_id))))
        wait_replies(calls)
