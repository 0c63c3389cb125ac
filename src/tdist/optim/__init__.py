"""``tdist.optim``: ``DistributedOptimizer`` (``torch.distributed.optim``), and torch's optimizers
that run over a process group (``ZeroRedundancyOptimizer``, ``PostLocalSGDOptimizer``,
``as_functional_optim``), which run on tdist's groups as on gloo's."""

from __future__ import annotations

from torch.distributed.optim import (
    PostLocalSGDOptimizer,
    ZeroRedundancyOptimizer,
    as_functional_optim,
)

from ._distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer", "as_functional_optim"]
