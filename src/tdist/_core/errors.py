"""The tdist exception tree.

One root, shallow, with torch-compatible bases where torch users catch them::

    DistError (RuntimeError)                 torch.distributed.DistError
    ├── DistBackendError                     a collective or backend failed
    │   ├── PeerError                        a named peer died, stalled or broke the protocol
    │   └── CollectiveMismatchError (ValueError)  ranks called different collectives
    ├── DistNetworkError                     a connection could not be made or was lost
    │   └── AuthenticationError              the peer did not prove the shared secret
    ├── DistStoreError                       a store operation failed
    │   ├── StoreTimeoutError (TimeoutError) keys did not appear in time
    │   ├── StoreValueError (ValueError)     a value was not what the command needs
    │   └── QueueEmptyError                  queue_pop(block=False) on an empty queue
    ├── ProtocolError                        bytes that break a wire protocol
    │   ├── LocalProtocolError               we were asked to send something invalid
    │   └── RemoteProtocolError              the peer sent something invalid
    └── DistTimeoutError (TimeoutError)      any other deadline that expired

Each class that names a torch class on the right also derives from it, so code that catches
torch's (``except torch.distributed.DistStoreError``) catches ours too (except in the ``tdist``
command's own process, which runs no user code and does not import torch: ``_process``). ``TimeoutError`` here is
the builtin (an ``OSError``): ``except TimeoutError`` catches every tdist timeout. OS errors are translated into this tree once, at the I/O boundary, and chained
with ``from``.
"""

from __future__ import annotations

import sys

from . import _process

TYPE_CHECKING = False  # (typing is not imported at run time: see tdist/__init__)

if TYPE_CHECKING or not _process.TORCHLESS or "torch" in sys.modules:
    from torch.distributed import DistBackendError as _TorchBackendError
    from torch.distributed import DistError as _TorchDistError
    from torch.distributed import DistNetworkError as _TorchNetworkError
    from torch.distributed import DistStoreError as _TorchStoreError
    from torch.distributed import QueueEmptyError as _TorchQueueEmptyError
else:  # the `tdist` command's own process: torch's tree, without importing torch (see _process)

    class _TorchDistError(RuntimeError):
        """Stands in for ``torch.distributed.DistError``."""

    class _TorchBackendError(_TorchDistError):
        """Stands in for ``torch.distributed.DistBackendError``."""

    class _TorchNetworkError(_TorchDistError):
        """Stands in for ``torch.distributed.DistNetworkError``."""

    class _TorchStoreError(_TorchDistError):
        """Stands in for ``torch.distributed.DistStoreError``."""

    class _TorchQueueEmptyError(_TorchStoreError):
        """Stands in for ``torch.distributed.QueueEmptyError``."""

__all__ = [
    "AuthenticationError",
    "CollectiveMismatchError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "LocalProtocolError",
    "PeerError",
    "ProtocolError",
    "QueueEmptyError",
    "RemoteProtocolError",
    "StoreTimeoutError",
    "StoreValueError",
]


class DistError(_TorchDistError):
    """Root of every error raised by tdist (``torch.distributed.DistError``)."""


class DistBackendError(DistError, _TorchBackendError):
    """A process-group backend or collective failed (``torch.distributed.DistBackendError``)."""


class PeerError(DistBackendError):
    """A peer died, stalled, or broke the protocol. ``peer`` names it."""

    def __init__(self, message: str, peer: object = None) -> None:
        super().__init__(message)
        self.peer = peer


class CollectiveMismatchError(DistBackendError, ValueError):
    """Ranks called different collectives, or the same one with arguments that do not fit.

    Raised by the ``TDIST_DEBUG=DETAIL`` check before a collective (``c10d._debug``) and by the
    shared-memory arena, which compares every rank's description of each operation
    (``c10d._shm``); both modules re-export it.
    """


class DistNetworkError(DistError, _TorchNetworkError):
    """A connection could not be made or was lost (``torch.distributed.DistNetworkError``)."""


class AuthenticationError(DistNetworkError):
    """The other side did not prove knowledge of the job's shared secret."""


class DistStoreError(DistError, _TorchStoreError):
    """A store operation failed (``torch.distributed.DistStoreError``)."""


class StoreTimeoutError(DistStoreError, TimeoutError):
    """Keys awaited in a store did not appear before the timeout."""


class StoreValueError(DistStoreError, ValueError):
    """A stored value cannot be used as the command needs (``add`` on a non-number)."""


class QueueEmptyError(DistStoreError, _TorchQueueEmptyError):
    """``queue_pop(block=False)`` found the queue empty (``torch.distributed.QueueEmptyError``)."""


class ProtocolError(DistError):
    """Bytes that break a wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to produce something the protocol cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""


class DistTimeoutError(DistError, TimeoutError):
    """A deadline expired."""
