"""Workers that import ``tdist.rpc`` alone (fresh processes: from the forkserver, and this module imports no
autograd) take part in distributed autograd all the same: a callee loads ``tdist.autograd``, and
plugs it into RPC, when a recorded call reaches it, before the call runs, so the calls it makes
in turn are recorded too; an owner that never loaded it, asked for ``RRef.backward`` with a
context id, answers as autograd does (torch's message)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from ._rpc_harness import TORCH, Worker, rpc, run

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(TORCH, reason="tdist's own hook point (tdist.rpc._hooks)"),
]


def _state() -> tuple[bool, bool]:
    """(whether ``tdist.autograd`` is loaded in this process, whether RPC has its hooks)."""
    from tdist.rpc import _hooks

    return any(m.split(".")[:2] == ["tdist", "autograd"] for m in sys.modules), _hooks.autograd is not None


def _summed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b + a).sum()


def _mul_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b + a


def _chain(a: torch.Tensor, b: torch.Tensor, third: str) -> torch.Tensor:
    """On the middle worker: a call of its own to ``third``, in the caller's context."""
    return rpc.rpc_sync(third, _mul_add, args=(a, b)).sin().sum() * 2 + a.sum()


def _scenario(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {"start": _state()}
    w.barrier()  # (no worker has been called yet)
    if w.rank != 0:
        return out
    import tdist.autograd as dist_autograd

    torch.manual_seed(0)
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    # worker2 owns a scalar made outside any context, and is asked for RRef.backward in a
    # context it never saw
    rref = rpc.remote(w.peer(2), _summed, args=(a.detach(), b.detach()))
    with dist_autograd.context() as stale:
        pass
    try:
        rref.backward(stale)
    except RuntimeError as exc:
        out["stale"] = (stale, str(exc))
    out["worker2_after_stale"] = rpc.rpc_sync(w.peer(2), _state)
    # worker0 -> worker1 -> worker2: worker1 first hears of autograd with this call
    out["worker1_before"] = rpc.rpc_sync(w.peer(1), _state)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync(w.peer(1), _chain, args=(a, b, w.peer(2)))
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ((a2 * b2 + a2).sin().sum() * 2 + a2.sum()).backward()  # the same, on one worker
    assert a2.grad is not None and b2.grad is not None
    out["grads_match"] = torch.allclose(grads[a], a2.grad) and torch.allclose(grads[b], b2.grad)
    out["worker1_after"] = rpc.rpc_sync(w.peer(1), _state)
    return out


def test_workers_without_autograd_load_it_when_a_recorded_call_reaches_them() -> None:
    results = run(_scenario, "tensorpipe", world_size=3, start_method="forkserver", timeout=80)
    assert [r["start"] for r in results] == [(False, False)] * 3
    first = results[0]
    stale, message = first["stale"]
    assert message.startswith(f"Could not find autograd context with id: {stale}")
    assert first["worker2_after_stale"] == (True, True)
    assert first["worker1_before"] == (False, False)
    assert first["grads_match"] is True
    assert first["worker1_after"] == (True, True)
