"""tdist: the torch.distributed stack, in Python. ``import tdist as dist``.

The top-level names (``dist.init_process_group``, ``dist.TCPStore``, ...) live in
``tdist._public`` and are loaded on first use, all at once: ``import tdist`` alone imports
nothing heavy, so the ``tdist`` command's own process (the launcher, which never touches a
tensor) starts without importing torch. Once loaded they are plain module attributes.
"""

from __future__ import annotations

import importlib
import importlib.util

TYPE_CHECKING = False  # (not typing's: importing typing costs the store server process 15 ms)

if TYPE_CHECKING:
    from . import autograd as autograd
    from . import constants as constants
    from . import distributed_c10d as distributed_c10d
    from . import elastic as elastic
    from . import master_worker as master_worker
    from . import optim as optim
    from . import rpc as rpc
    from ._public import *  # noqa: F403
    from ._public import __all__ as __all__
    from ._public import _all_gather_base as _all_gather_base
    from ._public import _clear_group_cache as _clear_group_cache
    from ._public import _coalescing_manager as _coalescing_manager
    from ._public import _CoalescingManager as _CoalescingManager
    from ._public import _reduce_scatter_base as _reduce_scatter_base
    from ._public import _register_stream as _register_stream

# torch's package has these loaded; ours imports them on first use (and master_worker, torch
# 0.3's master-worker mode)
_SUBMODULES = ("autograd", "constants", "distributed_c10d", "elastic", "flight_recorder", "master_worker", "optim", "rpc")


def _load() -> None:
    public = importlib.import_module(f"{__name__}._public")
    names = globals()
    private = (
        "_all_gather_base", "_reduce_scatter_base", "_clear_group_cache", "_register_stream",
        "_coalescing_manager", "_CoalescingManager", "_rank_not_in_group", "_get_default_group",
        "_get_process_group_name",
        *public.TORCH_PRIVATE,
    )
    c10d = public.distributed_c10d
    for name in (*public.__all__, *private, "__all__"):  # (__all__, the mark, last)
        names.setdefault(name, getattr(public, name) if hasattr(public, name) else getattr(c10d, name))


def __getattr__(name: str) -> object:
    if name in _SUBMODULES or name in _aliases.ALIASED:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "rendezvous":  # (a function and a module, as torch's: the module is callable)
        return importlib.import_module(f"{__name__}.rendezvous")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # ``from tdist import cli``: the import system asks us first; a submodule is its to
        # import (not a reason to load every public name, and torch with them)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if "__all__" not in globals():
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_backend(store: object, rank: int, size: int, timeout: object) -> object:
    """torch's creator for ``backend="tdist"``: builds a torch ProcessGroup on tdist's transport."""
    return importlib.import_module(f"{__name__}.c10d._torch_pg")._create(store, rank, size, timeout)


def _register_with_torch() -> None:
    """``torch.distributed.init_process_group(backend="tdist")`` works once tdist is imported.

    The name is registered through torch's plug-in point (``Backend.register_backend``) now if
    torch is loaded, else the moment its import ends. ``import tdist`` itself imports no torch
    (the launcher never needs it), and registering imports nothing of tdist's: the process
    group's own module loads when torch first asks for a group. Registering also makes tdist
    the backend torch gives CPU tensors when it forms a group with no backend named (its device
    meshes do): ``_aliases.default_world_on_tdist``.
    """
    import contextlib
    import sys
    import threading

    def register(torch: object) -> None:
        backend = getattr(getattr(torch, "distributed", None), "Backend", None)
        if backend is not None and "tdist" not in backend.backend_list:
            backend.register_backend("tdist", _torch_backend, devices=["cpu"])
            _aliases.default_world_on_tdist()

    torch = sys.modules.get("torch")
    if torch is not None:
        register(torch)
        return

    lookup = threading.local()

    class _WhenTorchLoaded:
        """A finder that finds nothing of its own: when torch is looked up, it hands the
        import system torch's own spec with a loader that registers once torch has loaded.
        It stays until then (a ``find_spec("torch")`` probe that imports nothing, as some
        libraries make, must not use it up), and leaves once torch is in."""

        @staticmethod
        def find_spec(name: str, path: object = None, target: object = None) -> object:
            if name != "torch" or getattr(lookup, "busy", False):
                return None
            lookup.busy = True  # (the lookup below, in this thread, finds torch's own spec)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                lookup.busy = False
            loader = None if spec is None else spec.loader
            if spec is None or loader is None:
                return spec
            inner = loader.exec_module

            def exec_module(module: object) -> None:
                inner(module)  # type: ignore[arg-type]
                with contextlib.suppress(ValueError):  # (another thread's import took it out)
                    sys.meta_path.remove(_WhenTorchLoaded)  # type: ignore[arg-type]
                register(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    if not any(getattr(f, "__name__", "") == "_WhenTorchLoaded" for f in sys.meta_path):  # (a reload)
        sys.meta_path.insert(0, _WhenTorchLoaded)  # type: ignore[arg-type]


_aliases = importlib.import_module(f"{__name__}._aliases")
_register_with_torch()
_aliases.install()  # (torch's training stack's module paths: tdist.fsdp, tdist.checkpoint, ...)


def __dir__() -> list[str]:
    if "__all__" not in globals():
        _load()
    return sorted({*globals(), *_SUBMODULES})


def _load_with_torch() -> None:
    """Where torch is loaded already (a training program's ``import torch`` came first), load
    the process-group machinery now, as ``import torch`` loads torch.distributed: its 20 ms of
    imports are not paid inside ``init_process_group``. Without torch (the launcher, the store
    server), nothing more is imported."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", True):
        return
    if getattr(getattr(torch, "distributed", None), "is_available", lambda: False)():
        _load()
        for name in ("c10d._tcp_backend", "c10d._shm", "c10d._torch_pg"):
            importlib.import_module(f"{__name__}.{name}")
        importlib.import_module("encodings.idna")  # (the first name lookup's, 1 ms)


_load_with_torch()


def _under_tdist_run() -> None:
    """A worker of ``tdist run`` (``TDIST_STATUS_DIR``): what ``tdist status`` and ``tdist
    dump`` read (``tdist.elastic._inspect.worker_side``), and with ``--metrics-port``
    (``TDIST_METRICS_FD``) the thread that reports its counts (``tdist.elastic._metrics``)."""
    import os

    if os.environ.get("TDIST_STATUS_DIR"):
        importlib.import_module(f"{__name__}.elastic._inspect").worker_side()
    if os.environ.get("TDIST_METRICS_FD"):
        importlib.import_module(f"{__name__}.elastic._metrics").worker_side()


_under_tdist_run()
