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
    from . import distributed_c10d as distributed_c10d
    from . import elastic as elastic
    from . import optim as optim
    from . import rpc as rpc
    from ._public import *  # noqa: F403
    from ._public import __all__ as __all__
    from ._public import _all_gather_base as _all_gather_base
    from ._public import _reduce_scatter_base as _reduce_scatter_base

# torch's package has these loaded; ours imports them on first use
_SUBMODULES = ("autograd", "elastic", "optim", "rpc")


def _load() -> None:
    public = importlib.import_module(f"{__name__}._public")
    names = globals()
    for name in (*public.__all__, "_all_gather_base", "_reduce_scatter_base", "__all__"):  # (__all__, the mark, last)
        names.setdefault(name, getattr(public, name))


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # ``from tdist import cli``: the import system asks us first; a submodule is its to
        # import (not a reason to load every public name, and torch with them)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if "__all__" not in globals():
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    if "__all__" not in globals():
        _load()
    return sorted({*globals(), *_SUBMODULES})
