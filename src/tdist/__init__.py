"""tdist: the torch.distributed stack, in Python. ``import tdist as dist``."""

from ._core.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
)
from .store import Store, TCPStore

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "QueueEmptyError",
    "Store",
    "TCPStore",
]
