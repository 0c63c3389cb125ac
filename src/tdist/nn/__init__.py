"""``torch.distributed.nn``'s RPC part: ``RemoteModule`` (a module that lives on another worker).

``import tdist.nn`` then ``tdist.nn.RemoteModule``, or ``from tdist.nn.api.remote_module import
RemoteModule``, as with torch.
"""

from __future__ import annotations

from .api.remote_module import RemoteModule

__all__ = ["RemoteModule"]
