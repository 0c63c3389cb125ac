"""Backend names: torch's ``Backend`` string class, ``BackendConfig``, and which implementation
runs a name.

``Backend("GLOO") == "gloo"``: names are lowercase strings, as in torch, so user code that
compares ``dist.get_backend()`` with ``"gloo"`` or ``dist.Backend.GLOO`` keeps working.

Which implementation serves a name (``implementation_for``):

* ``"gloo"``, ``"tcp"``, ``"undefined"`` (no backend given) and ``"cpu:gloo"``-style strings run
  our ``tcp`` backend: it stands in for gloo on CPU;
* ``"nccl"``, ``"ucc"``, ``"xccl"`` are not built in (torch's "doesn't have NCCL built in");
* ``"mpi"`` runs whatever registered itself as ``mpi`` (else torch's "doesn't have MPI");
* anything registered with ``Backend.register_backend`` or ``register_backend_creator`` runs
  its creator.

``get_backend()`` reports the name that was asked for, normalized exactly as torch does
(``"gloo"`` for ``init_process_group("gloo")``, ``"undefined"`` when no backend was given,
``"tcp"`` for ``init_process_group("tcp")``), so comparisons written for torch give the
answers they give under torch.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "Backend",
    "BackendConfig",
    "get_default_backend_for_device",
    "implementation_for",
    "is_backend_available",
]

log = logging.getLogger(__name__)

_lock = threading.Lock()


class _Plugin(NamedTuple):
    creator_fn: Callable[..., Any]
    extended_api: bool


class Backend(str):
    """An enum-like class of backend names (``torch.distributed.Backend``).

    ``Backend(name)`` returns the lowercase name (a plain ``str``), ``Backend.GLOO == "gloo"``.
    ``TCP`` is ours: the pure-Python backend that stands in for gloo.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    FAKE = "fake"
    TCP = "tcp"
    TDIST = "tdist"  # (the name torch knows tdist's backend by: the same tcp backend here)

    _BackendPlugin = _Plugin
    _plugins: dict[str, _Plugin] = {}

    backend_list = [UNDEFINED, GLOO, NCCL, XCCL, UCC, MPI, FAKE, TCP, TDIST]

    default_device_backend_map: dict[str, str] = {
        "cpu": GLOO,
        "cuda": NCCL,
        "xpu": XCCL,
        "mps": GLOO,
    }

    backend_capability: dict[str, list[str]] = {
        GLOO: ["cpu", "cuda"],
        NCCL: ["cuda"],
        XCCL: ["xpu"],
        UCC: ["cpu", "cuda"],
        MPI: ["cpu", "cuda"],
        FAKE: ["cpu", "cuda", "hpu", "xpu"],
        TCP: ["cpu"],
        TDIST: ["cpu"],
    }

    def __new__(cls, name: str) -> Backend:  # returns a plain str, as torch's does
        """The lowercase backend name (``Backend("GLOO")`` is ``"gloo"``).

        Raises:
            ValueError: ``name`` is not a string (torch's message).
        """
        if not isinstance(name, str):
            raise ValueError("Backend constructor parameter must be string-ish")
        value = getattr(Backend, name.upper(), Backend.UNDEFINED)
        if not isinstance(value, str) or value == Backend.UNDEFINED:
            value = name.lower()
        return value  # type: ignore[return-value]

    @classmethod
    def register_backend(
        cls,
        name: str,
        func: Callable[..., Any],
        extended_api: bool = False,
        devices: str | list[str] | None = None,
    ) -> None:
        """Register a backend under ``name`` (torch's plug-in API).

        Args:
            name: the name ``init_process_group(backend=...)`` will use.
            func: ``func(store, group_rank, group_size, timeout)`` returning a backend object:
                one with the ``tdist.c10d._backend.Backend`` methods, or one of torch's (its
                ``ProcessGroupGloo``, a C++ extension's, a Python subclass of its
                ``ProcessGroup``), which gets torch's options (``c10d._foreign_backend``). The
                store is a torch ``Store``, as torch's ``init_process_group`` gives. With
                ``extended_api``, ``func(dist_backend_options, pg_options)``.
            extended_api: whether ``func`` takes the extended arguments.
            devices: the device types the backend serves (``None``: cpu and cuda, with a
                warning, as torch).
        """
        lower = name.lower()
        with _lock:
            if not hasattr(Backend, name.upper()):
                setattr(Backend, name.upper(), lower)
            if lower not in Backend.backend_list:
                Backend.backend_list.append(lower)
            if devices is not None:
                for device in [devices] if isinstance(devices, str) else devices:
                    current = Backend.default_device_backend_map.get(device)
                    if current is None or (current == "fake" and lower != "fake"):
                        Backend.default_device_backend_map[device] = lower
            if devices is None:
                warnings.warn(
                    f"Device capability of {name} unspecified, assuming `cpu` and `cuda` or `xpu`. Please "
                    "specify it via the `devices` argument of `register_backend`.",
                    stacklevel=2,
                )
                Backend.backend_capability[lower] = ["cpu", "cuda"]
            elif isinstance(devices, str):
                Backend.backend_capability[lower] = [devices]
            else:
                Backend.backend_capability[lower] = list(devices)
            Backend._plugins[name.upper()] = _Plugin(func, extended_api)


class BackendConfig:
    """The device-to-backend map of a group (``torch.distributed.BackendConfig``)."""

    def __init__(self, backend: str) -> None:
        self.device_backend_map: dict[str, str] = {}
        backend = str(backend)
        if backend == Backend.UNDEFINED:
            # no accelerator is driven here: CPU, served by gloo (our tcp)
            self.device_backend_map["cpu"] = Backend(Backend.default_device_backend_map["cpu"])
        elif backend.lower() in Backend.backend_list:
            supported = Backend.backend_capability.get(backend.lower(), ["cpu", "cuda"])
            self.device_backend_map = dict.fromkeys(supported, Backend(backend))
        elif ":" in backend:
            self.device_backend_map = parse_device_backend_string(backend)
        else:
            warnings.warn(
                f"Device capability of {backend} unknown, assuming `cpu` and `cuda`. You can "
                "specify it in `device:backend` format in `init_process_group` call.",
                stacklevel=2,
            )
            value = Backend(backend)
            self.device_backend_map = {"cpu": value, "cuda": value, "xpu": value}

    def __repr__(self) -> str:
        return ",".join(f"{device}:{backend}" for device, backend in self.device_backend_map.items())

    def get_device_backend_map(self) -> dict[str, str]:
        """The backend name of each device type."""
        return self.device_backend_map


def parse_device_backend_string(backend: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` to ``{"cpu": "gloo", "cuda": "nccl"}``.

    Raises:
        ValueError: a pair that is not ``device:backend``, or a device named twice.
    """
    usage = (
        f"The custom backend string argument is invalid: {backend}. The backend string must be "
        'in the format "<device_type1>:<backend1>,<device_type2>:<backend2>...", e.g. '
        "'cpu:gloo,cuda:nccl'"
    )
    out: dict[str, str] = {}
    for pair in backend.lower().split(","):
        parts = pair.split(":")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"Invalid device:backend pairing: {pair}. {usage}")
        device, name = parts[0].strip(), parts[1].strip()
        if device in out:
            raise ValueError(f"Duplicate device type {device} in backend string: {backend}. {usage}")
        out[device] = Backend(name)
    return out


_NOT_BUILT_IN = {
    Backend.NCCL: "NCCL",
    Backend.UCC: "UCC",
    Backend.XCCL: "XCCL",
}

#: names served by our tcp backend
_TCP_NAMES = frozenset({Backend.UNDEFINED, Backend.GLOO, Backend.TCP, Backend.TDIST})


def implementation_for(backend: str) -> str:
    """The registered implementation that serves ``backend`` for CPU tensors.

    ``"gloo"``, ``"undefined"`` and ``"tcp"`` give ``"tcp"``; a ``device:backend`` string uses
    its ``cpu`` entry (or its only entry); other names are returned as they are, lowercase.

    Raises:
        RuntimeError: a backend torch ships that tdist has not built in (NCCL, UCC, XCCL).
    """
    name: str = Backend(backend)
    if ":" in name:
        mapping = parse_device_backend_string(name)
        if "cpu" in mapping:
            name = mapping["cpu"]
        elif len(set(mapping.values())) == 1:
            name = next(iter(mapping.values()))
        else:
            raise ValueError(
                f"backend {backend!r} names no backend for cpu; tdist runs every collective on "
                "CPU tensors: add a cpu entry, e.g. 'cpu:gloo'"
            )
    if name in _TCP_NAMES:
        return Backend.TCP
    if name in _NOT_BUILT_IN:
        raise RuntimeError(
            f"Distributed package doesn't have {_NOT_BUILT_IN[name]} built in: tdist drives CPU "
            "tensors only; use backend='gloo' (served by tdist's tcp backend)"
        )
    return name


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` (a name or a ``device:backend`` string) can be used here."""
    from ._backend import backend_creator

    def one(name: str) -> bool:
        name = name.lower()
        if name in _TCP_NAMES:
            return True
        if name in _NOT_BUILT_IN:
            return False
        if name == Backend.MPI:
            from ._world import is_mpi_available

            return is_mpi_available()
        return name.upper() in Backend._plugins or backend_creator(name) is not None

    if ":" in backend:
        return all(one(b) for b in parse_device_backend_string(backend).values())
    return one(backend)


def get_default_backend_for_device(device: Any) -> str:
    """The default backend name for ``device`` (``"gloo"`` for ``"cpu"``), as torch.

    Raises:
        ValueError: no backend is registered for the device type.
    """
    import torch

    device_str = device.type if isinstance(device, torch.device) else torch.device(device).type
    backend = Backend.default_device_backend_map.get(device_str)
    if backend is None:
        raise ValueError(f"Default backend not registered for device : {device}")
    return backend
