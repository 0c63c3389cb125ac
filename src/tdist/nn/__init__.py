"""``torch.distributed.nn``: ``RemoteModule`` (a module that lives on another worker), and torch's
collectives that autograd differentiates (``tdist.nn.functional``).

``import tdist.nn`` then ``tdist.nn.RemoteModule``, or ``from tdist.nn.api.remote_module import
RemoteModule``, as with torch.
"""

from __future__ import annotations

from . import functional
from .api.remote_module import RemoteModule
from .functional import *  # noqa: F403 (torch.distributed.nn has them at its top too)

__all__ = ["RemoteModule", "functional", *functional.__all__]
