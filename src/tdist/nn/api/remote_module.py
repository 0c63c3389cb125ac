"""``RemoteModule``: an ``nn.Module`` made and run on another worker, over ``tdist.rpc``.

Theory of operation. The constructor asks the worker that ``remote_device`` names to build
``module_cls(*args, **kwargs)`` (``rpc.remote``: it returns at once, holding an ``RRef`` to the
module) and moves it to the device. ``forward`` runs the module's ``forward`` there through
``rpc_async`` (so inside a distributed autograd context the call is recorded and gradients flow
back to the remote parameters) and waits; ``forward_async`` returns the future. Parameters stay
remote: ``remote_parameters()`` gives RRefs to them, for ``DistributedOptimizer``. The methods of
``nn.Module`` that would need the module here raise ``ValueError``, as torch's do; ``train`` and
``eval`` run on the remote module. A ``RemoteModule`` travels in RPC arguments and results (its
module RRef is shared, as any RRef is), never through plain pickle, as in torch.

TorchScript module interfaces (torch's private ``_module_interface_cls``, on ``_RemoteModule``
and ``init_from_module_rref``): the worker scripts the module (``torch.jit.script``) and holds it
in an RRef typed by the interface, after checking that the module implements it, as torch does;
``is_scriptable`` is then True and the constructor waits for the module (torch's does too).
``forward``, ``forward_async``, ``remote_parameters``, ``train`` and ``eval`` work from Python on
such a module. What torch adds on top, calling a RemoteModule from inside TorchScript code, needs
TorchScript's own RPC operators, which are bound to torch's C++ agent: not supported here.

CUDA path (written against torch's logic, not run here): when the remote device is a CUDA device,
CPU tensors among the arguments are moved to it before ``forward``; without a device map to the
caller the result's tensors come back to the CPU.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import rpc
from ...rpc._agent import serialization_peer
from .. import _remote_device as _rd

__all__ = ["RemoteModule"]

# what travels when a RemoteModule is an RPC argument or result (torch's list)
_PICKLED_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable", "generated_methods", "module_rref")

# nn.Module methods that would need the module here (torch's list): they raise
_NOT_SUPPORTED = (
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
)


# -- what the module's worker runs -------------------------------------------------------------
def _create_module(module_cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    module.to(device)
    return module


def _create_module_with_interface(
    module_cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: str, module_interface_cls: Any
) -> Any:
    module = torch.jit.script(_create_module(module_cls, args, kwargs, device))
    return rpc.RRef(module, module_interface_cls)


def _set_training(module_rref: Any, mode: bool) -> None:
    module_rref.local_value().train(mode)


def _param_rrefs(module_rref: Any, recurse: bool) -> list[Any]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _remote_forward(module_rref: Any, device: str, is_device_map_set: bool, *args: Any, **kwargs: Any) -> Any:
    module = module_rref.local_value()
    dev = torch.device(device)
    if dev.type != "cuda":
        return module.forward(*args, **kwargs)
    # CUDA path (torch's logic; not run on this CPU-only machine): CPU tensors go to the
    # module's device; without a device map only CPU tensors may travel back
    args = tuple(_to_device(a, dev) for a in args)
    kwargs = {k: _to_device(v, dev) for k, v in kwargs.items()}
    out = module.forward(*args, **kwargs)
    if is_device_map_set:
        return out
    if isinstance(out, tuple):
        return tuple(_to_device(o, torch.device("cpu")) for o in out)
    return _to_device(out, torch.device("cpu"))


# -- the methods every RemoteModule gets (torch's non-scriptable template) ---------------------
def forward_async(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` on the module's worker; returns a ``torch.futures.Future`` of its result."""
    return rpc.rpc_async(self.module_rref.owner(), _remote_forward, (self.module_rref, self.device, self.is_device_map_set, *args), kwargs)


def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` on the module's worker; its result."""
    return forward_async(self, *args, **kwargs).wait()


_GENERATED_METHODS = (forward_async, forward)


def _not_supported(name: str) -> Callable[..., Any]:
    hint = ". Please use ``remote_parameters`` instead." if name == "parameters" else ""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule{hint}")

    method.__name__ = name
    method.__qualname__ = f"RemoteModule.{name}"
    return method


class _RemoteModule(nn.Module):
    """See ``RemoteModule``."""

    on: Any
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    generated_methods: tuple[Callable[..., Any], ...]
    module_rref: Any

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        _module_interface_cls: Any = None,
    ) -> None:
        super().__init__()
        self._prepare_init(remote_device, _module_interface_cls)
        args = args if args is not None else ()
        kwargs = kwargs if kwargs is not None else {}
        if _module_interface_cls is not None:  # scripted there; waits, as torch's does
            self.module_rref = rpc.rpc_sync(
                self.on, _create_module_with_interface, (module_cls, args, kwargs, self.device, _module_interface_cls)
            )
        else:
            self.module_rref = rpc.remote(self.on, _create_module, (module_cls, args, kwargs, self.device))
        self._install_generated_methods()

    def _prepare_init(self, remote_device: str, module_interface_cls: Any) -> None:
        if not rpc._is_current_rpc_agent_set():
            raise AssertionError("RemoteModule only works in RPC.")
        if module_interface_cls is not None and not getattr(module_interface_cls, "__torch_script_interface__", False):
            raise ValueError(
                f"module_interface_cls {module_interface_cls} must be a type object decorated by @torch.jit.interface"
            )
        parsed = _rd.parse(remote_device)
        self.on = parsed.worker_name if parsed.worker_name is not None else parsed.rank
        self.device = str(parsed.device)
        agent = rpc._get_current_rpc_agent()
        name = agent.resolve(self.on).name
        self.is_device_map_set = bool(getattr(agent, "device_maps", {}).get(name))
        self.is_scriptable = module_interface_cls is not None
        self.generated_methods = _GENERATED_METHODS

    def _install_generated_methods(self) -> None:
        for method in self.generated_methods:
            object.__setattr__(self, method.__name__, types.MethodType(method, self))

    def remote_parameters(self, recurse: bool = True) -> list[Any]:
        """RRefs to the remote module's parameters (and its submodules', with ``recurse``), e.g.
        for ``DistributedOptimizer``."""
        return rpc.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))  # type: ignore[no-any-return]

    def get_module_rref(self) -> Any:
        """The ``RRef`` to the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> Any:
        """``train(mode)`` on the remote module. Returns its result, a copy of the module, as
        torch's does; for a scripted module (which cannot travel), this RemoteModule."""
        if self.is_scriptable:
            rpc.rpc_sync(self.on, _set_training, (self.module_rref, mode))
            return self
        return self.module_rref.rpc_sync().train(mode)

    def eval(self) -> Any:
        """``eval()`` on the remote module (see ``train``)."""
        return self.train(False)

    def __getstate__(self) -> Any:
        raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC")

    def __reduce_ex__(self, protocol: Any) -> Any:
        if serialization_peer() is None:  # plain pickle: as torch, refused
            self.__getstate__()
        return (_remote_module_receiver, tuple(getattr(self, k) for k in _PICKLED_ATTRIBUTES))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: Any, _module_interface_cls: Any = None) -> RemoteModule:
        """A ``RemoteModule`` around an existing module ``RRef`` (several may share one module;
        the module's owner must be the worker ``remote_device`` names)."""
        m = object.__new__(RemoteModule)
        nn.Module.__init__(m)
        m._prepare_init(remote_device, _module_interface_cls)
        m.module_rref = module_rref
        m._install_generated_methods()
        return m


for _name in _NOT_SUPPORTED:
    setattr(_RemoteModule, _name, _not_supported(_name))


class RemoteModule(_RemoteModule):
    """A module built and run on another worker (``torch.distributed.nn.RemoteModule``).

    Args:
        remote_device: ``"<worker name>/<device>"`` or ``"rank:<rank>/<device>"``; the device
            may be left out (``"cpu"``).
        module_cls: the module's class (or any callable returning an ``nn.Module``), importable
            on that worker.
        args, kwargs: for ``module_cls``.

    Raises:
        AssertionError: RPC is not initialized. ValueError: ``remote_device`` cannot be parsed.
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(remote_device, module_cls, args, kwargs)


def _remote_module_receiver(*attrs: Any) -> RemoteModule:
    m = object.__new__(RemoteModule)
    nn.Module.__init__(m)
    for k, v in zip(_PICKLED_ATTRIBUTES, attrs, strict=True):
        object.__setattr__(m, k, v)
    m._install_generated_methods()
    return m
