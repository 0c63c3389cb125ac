"""``tdist.optim.optimizer``: the module path of ``torch.distributed.optim.optimizer`` (its
``DistributedOptimizer``, tdist's)."""

from __future__ import annotations

from ._distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
