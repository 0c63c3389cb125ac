"""``torch.distributed.nn``: ``RemoteModule`` (a module that lives on another worker), and torch's
collectives that autograd differentiates (``tdist.nn.functional``).

``import tdist.nn`` then ``tdist.nn.RemoteModule``, or ``from tdist.nn.api.remote_module import
RemoteModule``, as with torch.
"""

from __future__ import annotations

from . import functional
from .api.remote_module import RemoteModule
from .functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)

__all__ = [
    "RemoteModule", "all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "functional",
    "gather", "reduce", "reduce_scatter", "scatter",
]  # fmt: skip
