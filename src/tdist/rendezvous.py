"""``tdist.rendezvous``: the module path of ``torch.distributed.rendezvous``.

Code that registers its own ``init_method`` scheme (``from torch.distributed.rendezvous import
register_rendezvous_handler``) ports by changing the package name. As in torch, ``rendezvous``
is also the package's function: whichever of the two ``tdist.rendezvous`` names (the function,
or this module once imported), calling it runs the function.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .store._rendezvous import (
    RendezvousHandler,
    _create_c10d_store,
    _env_rendezvous_handler,
    _file_rendezvous_handler,
    _rendezvous_handlers,
    _tcp_rendezvous_handler,
    register_rendezvous_handler,
    rendezvous,
)

__all__ = ["RendezvousHandler", "register_rendezvous_handler", "rendezvous"]

_ = (
    _create_c10d_store, _env_rendezvous_handler, _file_rendezvous_handler, _rendezvous_handlers,
    _tcp_rendezvous_handler,
)


class _Callable(types.ModuleType):
    """This module, callable as the function it is named after."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return rendezvous(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable
