"""Distributed autograd and ``DistributedOptimizer`` on real processes (3 workers, both agents):
gradients through chains of RPCs match the same computation done locally, accumulate in the
context (not in ``.grad``), errors anywhere reach the caller, contexts are released on every
worker they reached, and the optimizer steps parameters on their owners as a local optimizer
would. ``TDIST_RPC_TEST_IMPL=torch`` runs the same scenarios on torch.distributed.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
import torch

from . import autograd_funcs as f
from ._rpc_harness import BACKENDS, TORCH, Worker, rpc, run

if TORCH:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
else:
    import tdist.autograd as dist_autograd  # type: ignore[no-redef]
    from tdist.optim import DistributedOptimizer  # type: ignore[assignment]

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", BACKENDS)]


def _local_reference(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    loss = ((a2 * b2 + a2).sin().sum() * 2 + a2.sum()) * 3
    loss.backward()
    assert a2.grad is not None and b2.grad is not None
    return a2.grad, b2.grad


def _gradients(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if w.rank == 0:
        torch.manual_seed(0)
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        ga, gb = _local_reference(a, b)
        # worker0 -> worker1 -> worker2 and back, rpc_sync
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync(w.peer(1), f.chain, args=(a, b, w.peer(2))) * 3
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            out["chain"] = torch.allclose(grads[a], ga) and torch.allclose(grads[b], gb)
            out["not_in_grad"] = a.grad is None and b.grad is None
            chain_cid = cid
        time.sleep(0.3)  # the release travels on (not awaited)
        out["released"] = [rpc.rpc_sync(p, f.context_released, args=(chain_cid,)) for p in w.others()]
        # rpc_async, the same tensors used twice: gradients add up
        with dist_autograd.context() as cid:
            r1 = rpc.rpc_async(w.peer(1), f.mul_add, args=(a, b)).wait()
            r2 = rpc.rpc_async(w.peer(2), f.mul_add, args=(a, b)).wait()
            dist_autograd.backward(cid, [(r1 + r2).sum()])
            grads = dist_autograd.get_gradients(cid)
            out["async_twice"] = torch.allclose(grads[a], 2 * (b.detach() + 1)) and torch.allclose(grads[b], 2 * a.detach())
        # remote() and to_here() record autograd too
        with dist_autograd.context() as cid:
            rref = rpc.remote(w.peer(1), f.mul_add, args=(a, b))
            dist_autograd.backward(cid, [rref.to_here().sum()])
            grads = dist_autograd.get_gradients(cid)
            out["remote"] = torch.allclose(grads[a], b.detach() + 1) and torch.allclose(grads[b], a.detach())
        # RRef.backward: the owner's value as the root, in a context
        with dist_autograd.context() as cid:
            rref = rpc.remote(w.peer(1), f.summed, args=(a, b))
            rref.backward(cid)
            grads = dist_autograd.get_gradients(cid)
            out["rref_backward"] = torch.allclose(grads[a], b.detach() + 1) and torch.allclose(grads[b], a.detach())
        local = rpc.RRef(torch.ones(3, requires_grad=True))
        rpc.RRef((local.local_value() * 2).sum()).backward()  # -1: local autograd on the owner
        out["rref_local"] = torch.equal(local.local_value().grad, torch.full((3,), 2.0))
    w.barrier()
    return out


def test_gradients_through_chains_of_rpcs_match_local_autograd(backend: str) -> None:
    out = run(_gradients, backend, world_size=3)[0]
    assert out["chain"] and out["not_in_grad"]
    assert out["released"] == [True, True]
    assert out["async_twice"]
    assert out["remote"]
    assert out["rref_backward"] and out["rref_local"]


def _two_passes(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    f.gate = w.shared["gate"]
    if w.rank == 0:
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        x, y = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
        # made before the replies, so local autograd runs them after the recv functions (it
        # runs the newest ready node first): each pass sleeps here after sending on
        sx, sy = f.slow(x, 0.4), f.slow(y, 0.8)
        with dist_autograd.context() as cid:
            r1 = rpc.rpc_sync(w.peer(1), f.gated, args=(a,))  # its backward waits for the gate
            r2 = rpc.rpc_sync(w.peer(2), f.slow_mul_add, args=(a, b, 1.5))  # its backward is slow
            errors: list[BaseException] = []

            def pass_(loss: torch.Tensor) -> None:
                try:
                    dist_autograd.backward(cid, [loss])
                except BaseException as exc:
                    errors.append(exc)

            first = threading.Thread(target=pass_, args=(r1.sum() + sx.sum(),))
            second = threading.Thread(target=pass_, args=(r2.sum() + sy.sum(),))
            first.start()
            time.sleep(0.1)  # the first pass has sent its gradients to worker1 and sleeps
            second.start()
            second.join(20)
            # the second pass returned only when the gradients it sent on were carried through
            # (it did not take the first pass's send, nor leave its own to the first pass)
            out["second_done"] = not second.is_alive()
            grads = dist_autograd.get_gradients(cid)
            out["second_grads"] = b in grads and torch.allclose(grads[b], a.detach())
            out["first_waits"] = first.is_alive()
            w.shared["gate"].set()
            first.join(20)
            out["first_done"] = not first.is_alive()
            grads = dist_autograd.get_gradients(cid)
            out["all_grads"] = torch.allclose(grads[a], b.detach() + 2)
            out["errors"] = [repr(e) for e in errors]
    w.barrier()
    return out


def test_a_pass_waits_for_its_own_sends_while_another_runs_in_the_same_context(backend: str) -> None:
    # (a backward that took another pass's sends as its own once deadlocked: the poller that
    # ran a worker's gradients waited for a reply that waited for that very poller)
    gate = multiprocessing.get_context("fork").Event()
    out = run(_two_passes, backend, world_size=3, shared={"gate": gate})[0]
    assert out == {
        "second_done": True,
        "second_grads": True,
        "first_waits": True,
        "first_done": True,
        "all_grads": True,
        "errors": [],
    }


def _errors(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if w.rank == 0:
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as cid:
            with pytest.raises(RuntimeError, match="Already have an autograd context id"):
                with dist_autograd.context():
                    pass
            with pytest.raises(RuntimeError, match="requires_grad not set on root"):
                dist_autograd.backward(cid, [torch.ones(())])
            y = rpc.rpc_sync(w.peer(1), f.explode_in_backward, args=(x,)).sum()
            try:
                dist_autograd.backward(cid, [y])
                out["remote_error"] = None
            except Exception as exc:
                out["remote_error"] = str(exc)
        with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
            dist_autograd.backward(cid, [x.sum()])
        with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
            dist_autograd.get_gradients(cid)
    w.barrier()
    return out


def test_errors_nested_context_unknown_context_and_a_remote_backward_failure(backend: str) -> None:
    out = run(_errors, backend, world_size=2)[0]
    assert out["remote_error"] is not None and "backward exploded on purpose" in out["remote_error"]


def _optimizer(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if w.rank == 0:
        owners = [w.peer(1), w.peer(2)]
        for optim_cls, kwargs in ((torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05})):
            rrefs = [rpc.remote(o, f.make_param, args=(f"p{i}", 10 + i)) for i, o in enumerate(owners)]
            local = [torch.nn.Parameter(r.to_here().detach().clone()) for r in rrefs]  # (made by now)
            local_opt = optim_cls(local, **kwargs)
            dist_opt = DistributedOptimizer(optim_cls, rrefs, **kwargs)
            x = torch.linspace(-1, 1, 4)
            for _ in range(3):
                with dist_autograd.context() as cid:
                    loss = sum(rpc.rpc_sync(o, f.use_param, args=(r, x)) for o, r in zip(owners, rrefs, strict=True))
                    dist_autograd.backward(cid, [loss])
                    dist_opt.step(cid)
                local_opt.zero_grad()
                sum(torch.tanh(p * x).sum() for p in local).backward()
                local_opt.step()
            after = [rpc.rpc_sync(o, f.param_value, args=(f"p{i}",)) for i, o in enumerate(owners)]
            out[optim_cls.__name__] = all(torch.allclose(d, loc.detach(), atol=1e-6) for d, loc in zip(after, local, strict=True))
    w.barrier()
    return out


def test_distributed_optimizer_steps_parameters_on_their_owners_as_a_local_one(backend: str) -> None:
    out = run(_optimizer, backend, world_size=3)[0]
    assert out == {"SGD": True, "Adam": True}
