"""``DistributedOptimizer``: one local ``torch.optim`` optimizer per worker that owns
parameters, stepped with the gradients of a distributed autograd context.

Theory of operation. The constructor groups the parameter RRefs by owner and creates, with
``rpc.remote``, a ``_LocalOptimizer`` on each owner over its parameters (the values of the
RRefs there). ``step(context_id)`` asks every owner at once to set each parameter's ``.grad``
from that worker's gradients in the context and step its optimizer (one step at a time per
local optimizer); it returns when all are done and raises the first error, naming the worker.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from .. import autograd as dist_autograd
from .. import rpc

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """On a parameters' owner: the optimizer over its parameters."""

    def __init__(self, optim_cls: Any, rrefs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.params = [r.local_value() for r in rrefs]
        self.optim = optim_cls(self.params, *args, **kwargs)
        self.lock = threading.Lock()

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with self.lock:
            for p in self.params:
                g = grads.get(p)
                p.grad = None if g is None else g.to(p.dtype)
            self.optim.step()


def _new_local(optim_cls: Any, rrefs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _LocalOptimizer:
    return _LocalOptimizer(optim_cls, rrefs, args, kwargs)


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
        TypeError: ``params_rref`` is not a list of RRefs.
    """

    def __init__(self, optimizer_class: Any, params_rref: list[Any], *args: Any, **kwargs: Any) -> None:
        by_owner: dict[Any, list[Any]] = defaultdict(list)
        for r in params_rref:
            if not isinstance(r, rpc.RRef):
                raise TypeError(f"params_rref must be a list of RRefs, got {type(r).__name__}")
            by_owner[r.owner()].append(r)
        self.optimizer_class = optimizer_class
        self.remote_optimizers = [
            rpc.remote(owner, _new_local, args=(optimizer_class, rrefs, args, kwargs)) for owner, rrefs in by_owner.items()
        ]

    def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` on every owner.

        Raises:
            RuntimeError: ``context_id`` is not a valid context here; any owner's error.
        """
        dist_autograd._retrieve_context(context_id)
        futs = [rpc.rpc_async(opt.owner(), _local_step, args=(opt, context_id)) for opt in self.remote_optimizers]
        errors = []
        for f in futs:
            try:
                f.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

