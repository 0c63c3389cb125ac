"""``tdist.elastic.utils.data``: torch's ``ElasticDistributedSampler`` and ``CyclingIterator``
(torch's own classes: the sampler reads the rank and world size from ``torch.distributed``,
whose default group is tdist's, so it serves a program that formed its group with tdist)."""

from torch.distributed.elastic.utils.data import cycling_iterator, elastic_distributed_sampler
from torch.distributed.elastic.utils.data.cycling_iterator import CyclingIterator
from torch.distributed.elastic.utils.data.elastic_distributed_sampler import (
    ElasticDistributedSampler,
)

__all__ = ["CyclingIterator", "ElasticDistributedSampler", "cycling_iterator", "elastic_distributed_sampler"]
