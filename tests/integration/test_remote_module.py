"""``RemoteModule`` (``torch.distributed.nn``) on real processes, over both agents: building the
module on another worker, ``forward``/``forward_async``, parameters as RRefs, distributed
autograd with ``DistributedOptimizer``, passing it in RPCs, what it refuses. Over the
TENSORPIPE agent (RemoteModule only makes RPC calls, which the main suite runs on both)."""

from __future__ import annotations

import pickle

import pytest
import torch

from . import rpc_funcs as f
from ._rpc_harness import BACKENDS, TORCH, Worker, rpc, run

if TORCH:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.nn import RemoteModule
    from torch.distributed.nn.api.remote_module import _RemoteModule
    from torch.distributed.optim import DistributedOptimizer
else:
    import tdist.autograd as dist_autograd  # type: ignore[no-redef]
    from tdist.nn import RemoteModule  # type: ignore[assignment]
    from tdist.nn.api.remote_module import _RemoteModule  # type: ignore[assignment]
    from tdist.optim import DistributedOptimizer  # type: ignore[assignment]

# RemoteModule is plain RPC calls (agent-agnostic): one agent keeps the suite's time down
pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", BACKENDS[:1])]


def _remote_module(w: Worker) -> None:
    if w.rank == 0:
        x = torch.ones(4, 3)
        rm = RemoteModule("worker1/cpu", f.Affine, args=(3, 2))
        expected = torch.full((4, 2), 3.5)
        assert torch.equal(rm(x), expected)
        assert torch.equal(rm.forward(x, scale=2.0), expected * 2)
        fut = rm.forward_async(x)
        assert isinstance(fut, torch._C.Future) and torch.equal(fut.wait(), expected)
        assert rm.get_module_rref().owner_name() == "worker1"

        params = rm.remote_parameters()
        assert len(params) == 2 and all(p.owner_name() == "worker1" for p in params)
        assert torch.equal(params[0].to_here(), torch.ones(2, 3))

        # gradients reach the remote parameters; the optimizer steps them there
        with dist_autograd.context() as cid:
            loss = rm(x).sum()
            dist_autograd.backward(cid, [loss])
            opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters(), lr=0.1)
            opt.step(cid)
        training, weight, bias = rpc.rpc_sync("worker1", f.module_state, args=(rm.get_module_rref(),))
        assert torch.allclose(weight, torch.full((2, 3), 1.0 - 0.4)) and torch.allclose(bias, torch.full((2,), 0.5 - 0.4))

        # sent to a third worker, which runs the same remote module
        out = rpc.rpc_sync("worker2", f.call_module, args=(rm, x))
        assert torch.allclose(out, rm(x))

        # train/eval run on the remote module
        assert training
        rm.eval()
        assert rpc.rpc_sync("worker1", f.module_state, args=(rm.get_module_rref(),))[0] is False
        rm.train()
        assert rpc.rpc_sync("worker1", f.module_state, args=(rm.get_module_rref(),))[0] is True

        # another RemoteModule on the same module; the rank form of the device
        shared = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
        assert torch.allclose(shared.forward(x), rm(x))  # (torch's cannot be called as shared(x))
        by_rank = RemoteModule("rank:2/cpu", f.Affine, args=(3, 1))
        assert by_rank.get_module_rref().owner_name() == "worker2"
        assert torch.equal(by_rank(torch.ones(1, 3)), torch.full((1, 1), 3.5))

        # what needs the module here is refused, as in torch
        for method, args in (("parameters", ()), ("state_dict", ()), ("to", ("cpu",)), ("zero_grad", ())):
            with pytest.raises(ValueError, match=f"Method ``{method}`` not supported for RemoteModule"):
                getattr(rm, method)(*args)
        with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule"):
            pickle.dumps(rm)
        with pytest.raises(ValueError, match="Could not parse remote_device"):
            RemoteModule("a/b/c", f.Affine, args=(3, 2))
        with pytest.raises(RuntimeError, match="device type at start of device string: foo"):
            RemoteModule("worker1/foo", f.Affine, args=(3, 2))  # torch.device's own error
        with pytest.raises(ValueError, match="Please use ``remote_parameters`` instead"):
            rm.parameters()
        with pytest.raises(ValueError, match="returns an instance of"):  # not a module: the owner says so
            RemoteModule("worker1", f.add, args=(1, 2)).get_module_rref().to_here()
    w.barrier()


def test_remote_module(backend: str) -> None:
    run(_remote_module, backend, world_size=3)


def _scripted_remote_module(w: Worker) -> None:
    if w.rank == 0:
        x = torch.ones(4, 3)
        # torch's private TorchScript interface: the owner scripts the module, behind an RRef
        # typed by the interface
        rm = _RemoteModule("worker1/cpu", f.Affine, args=(3, 2), _module_interface_cls=f.AffineInterface)
        assert rm.is_scriptable
        assert torch.equal(rm.forward(x, 1.0), torch.full((4, 2), 3.5))
        assert torch.equal(rm.forward_async(x, 2.0).wait(), torch.full((4, 2), 7.0))
        assert rm.get_module_rref()._get_type() is torch._C.ScriptModule
        shared = _RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref(), f.AffineInterface)
        assert shared.is_scriptable and torch.equal(shared.forward(x, 1.0), torch.full((4, 2), 3.5))

        # an RRef to a ScriptModule needs the interface, and one the module implements
        scripted = f.scripted_affine()
        with pytest.raises(RuntimeError, match="must provide its ModuleInterface type hint"):
            rpc.RRef(scripted)
        with pytest.raises(RuntimeError, match=r"is not a subtype of the type hint: .*OtherInterface"):
            rpc.RRef(scripted, f.OtherInterface)
        assert rpc.RRef(scripted, f.AffineInterface)._get_type() is torch._C.ScriptModule
        with pytest.raises(RuntimeError, match="type_hint should only be specified"):
            rpc.RRef(torch.ones(1), f.AffineInterface)
        with pytest.raises(RuntimeError, match=r"is not a subtype of the type hint: .*OtherInterface"):
            _RemoteModule("worker1/cpu", f.Affine, args=(3, 2), _module_interface_cls=f.OtherInterface)
        with pytest.raises(ValueError, match=r"must be a type object decorated by @torch\.jit\.interface"):
            _RemoteModule("worker1/cpu", f.Affine, args=(3, 2), _module_interface_cls=f.Affine)
        if not TORCH:  # where torch's fail (its owner holds a bare C++ module)
            assert len(rm.remote_parameters()) == 2
            assert rm.eval() is rm
            assert rpc.rpc_sync("worker1", f.module_state, args=(rm.get_module_rref(),))[0] is False
            assert rpc.rpc_sync("worker2", f.call_module, args=(rm, x)).shape == (4, 2)
    w.barrier()


def test_scripted_remote_module(backend: str) -> None:
    run(_scripted_remote_module, backend, world_size=3)
