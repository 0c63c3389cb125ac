"""What the distributed autograd tests run on their callees (importable by name everywhere)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ._rpc_harness import TORCH, rpc

if TORCH:
    import torch.distributed.autograd as dist_autograd
else:
    import tdist.autograd as dist_autograd  # type: ignore[no-redef]

_params: dict[str, torch.nn.Parameter] = {}
gate: Any = None  # a multiprocessing Event a scenario sets on every worker (``gated``)


def mul_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b + a


_meeting = threading.Barrier(2)


def meet_in_backward(x: torch.Tensor) -> torch.Tensor:
    """``x * 2``, whose backward waits (10 s at most) for another backward pass on this worker
    to reach the same point."""
    y = x * 2

    def meet(g: torch.Tensor) -> torch.Tensor:
        try:
            _meeting.wait(10)
        except threading.BrokenBarrierError:
            raise RuntimeError("no other backward pass came while this one ran") from None
        return g

    y.register_hook(meet)
    return y


def summed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b + a).sum()


def chain(a: torch.Tensor, b: torch.Tensor, third: str) -> torch.Tensor:
    """Through a third worker and back: ``sum(sin(a * b + a)) * 2 + sum(a)``."""
    c = rpc.rpc_sync(third, mul_add, args=(a, b))
    return c.sin().sum() * 2 + a.sum()


class _Raise(torch.autograd.Function):
    """Its backward raises the exception its forward was given."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, error: Exception) -> torch.Tensor:
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise ctx.error


def explode_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _Raise.apply(x, ValueError("backward exploded on purpose")) * 2  # type: ignore[no-untyped-call]


def fail_in_backward(x: torch.Tensor) -> torch.Tensor:
    """A plain ``Exception`` in the backward (torch's tests' "Simulate error")."""
    return _Raise.apply(x, Exception("Simulate error on backward pass")) * 2  # type: ignore[no-untyped-call]


slow_started = threading.Event()  # set as the backward of a ``slow`` starts (in this process)


class _Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        slow_started.set()
        time.sleep(ctx.seconds)
        return g, None


def slow(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """``x``, whose backward takes ``seconds``."""
    return _Slow.apply(x, seconds)  # type: ignore[no-untyped-call,no-any-return]


def slow_mul_add(a: torch.Tensor, b: torch.Tensor, seconds: float) -> torch.Tensor:
    return slow(a * b + a, seconds)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if not gate.wait(30):
            raise RuntimeError("the gate was never opened")
        return g


def gated(x: torch.Tensor) -> torch.Tensor:
    """``x``, whose backward waits until ``gate`` is set."""
    return _Gated.apply(x)  # type: ignore[no-untyped-call,no-any-return]


def make_param(name: str, seed: int) -> torch.nn.Parameter:
    """A parameter this worker owns (kept here, returned as the value of an RRef)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(4, generator=g))
    _params[name] = p
    return p


def param_value(name: str) -> torch.Tensor:
    return _params[name].detach().clone()


def use_param(rref: Any, x: torch.Tensor) -> torch.Tensor:
    """The forward of a parameter server: ``sum(tanh(param * x))`` with the owner's parameter."""
    return torch.tanh(rref.local_value() * x).sum()


def context_released(context_id: int) -> bool:
    """Whether this worker has let go of the context (torch raises for an unknown one)."""
    try:
        dist_autograd._is_valid_context(context_id)
    except RuntimeError:
        return True
    return False


def known_worker_ids(context_id: int) -> list[int]:
    """The workers this worker's part of the context knows (torch's private method)."""
    return sorted(dist_autograd._retrieve_context(context_id)._known_worker_ids())


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@rpc.functions.async_execution
def async_mul_add(to: str, a: torch.Tensor, b: torch.Tensor) -> Any:
    """``mul_add`` on ``to``, chained through a future (an ``async_execution`` function)."""
    return rpc.rpc_async(to, mul_add, args=(a, b)).then(lambda f: f.wait() * 1)


@rpc.functions.async_execution
def async_square(x: torch.Tensor) -> Any:
    fut: Any = torch.futures.Future()
    fut.set_result(x * x)
    return fut


@rpc.functions.async_execution
def not_a_future(x: Any) -> Any:
    return x


def fail_forward(message: str) -> None:
    raise ValueError(message)


def stage(x: torch.Tensor, hops: int, rank: int, world: int) -> torch.Tensor:
    """``x`` through ``hops`` workers after this one (each multiplies by its own constant and
    adds a sine): a chain of nested RPCs whose backward crosses them all."""
    y = torch.sin(x) * (rank + 2)
    if hops == 0:
        return y
    nxt = (rank + 1) % world
    return rpc.rpc_sync(f"worker{nxt}", stage, args=(y, hops - 1, nxt, world)) + y


def stage_reference(x: torch.Tensor, hops: int, rank: int, world: int) -> torch.Tensor:
    y = torch.sin(x) * (rank + 2)
    if hops == 0:
        return y
    nxt = (rank + 1) % world
    return stage_reference(y, hops - 1, nxt, world) + y


def param_grad(name: str) -> Any:
    g = _params[name].grad
    return None if g is None else g.detach().clone()


class PlainSGD(torch.optim.SGD):
    """Not one of torch's functional optimizers: DistributedOptimizer's plain path."""
