"""``tdist.nn.functional``: torch's collectives that autograd differentiates
(``torch.distributed.nn.functional``), which run on tdist's groups as on gloo's."""

from __future__ import annotations

from torch.distributed.nn.functional import (
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
    "all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather", "reduce",
    "reduce_scatter", "scatter",
]  # fmt: skip
