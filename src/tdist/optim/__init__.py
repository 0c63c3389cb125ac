"""``tdist.optim``: ``DistributedOptimizer`` (``torch.distributed.optim``)."""

from __future__ import annotations

from ._distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
