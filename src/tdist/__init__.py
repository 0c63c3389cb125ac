"""tdist: the torch.distributed stack, in Python. ``import tdist as dist``."""

from ._core.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
)
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .store._rendezvous import register_rendezvous_handler, rendezvous

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "QueueEmptyError",
    "Store",
    "TCPStore",
    "register_rendezvous_handler",
    "rendezvous",
]
