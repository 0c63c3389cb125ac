"""The backend interface: what a process-group backend implements, with torch's method names.

The API layer (``tdist.init_process_group``, ``all_reduce``, ...) checks arguments, maps group
ranks, and calls one of these methods with *group-local* ranks; the backend moves the bytes.
Every method returns a ``Work`` at once or after finishing; the API layer waits on it unless the
user asked for ``async_op``. Tensor arguments are lists as in torch's ``ProcessGroup`` (one
tensor per device; on CPU usually one, several for the ``*_multigpu`` forms).

Contract for implementations:
- Every operation has a deadline (``opts.timeout`` or the backend's timeout) and fails its
  ``Work`` with an error naming the operation and the peer when it expires or a peer dies.
- Operations issued by one thread on one backend complete in issue order on every rank
  (collectives are matched by their sequence number).
- Output tensors may be non-contiguous views; a backend writes only inside them.
- A backend that failed is *broken*: later calls fail at once with the original error.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ._types import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
)

if TYPE_CHECKING:
    import torch

    from ..store import Store

__all__ = ["Backend", "BackendCreator", "backend_creator", "register_backend_creator"]


class Backend(abc.ABC):
    """One rank's end of a process group: ``rank()`` of ``size()``.

    A backend that keeps a flight record (``c10d._flight_recorder``) exposes it as
    ``flight_recorder``; the others leave it ``None``.
    """

    flight_recorder: Any = None

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @abc.abstractmethod
    def name(self) -> str:
        """The backend's name (``"tcp"``, ``"mpi"``)."""

    # -- collectives -----------------------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> Work: ...

    @abc.abstractmethod
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...

    @abc.abstractmethod
    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> Work: ...

    @abc.abstractmethod
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> Work:
        """``output_tensors[i][r]`` receives rank r's ``input_tensors[i]`` (sizes may differ per rank)."""

    @abc.abstractmethod
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions) -> Work:
        """``all_gather_into_tensor``: ``output`` is ``size()`` inputs concatenated (or stacked)."""

    @abc.abstractmethod
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: GatherOptions,
    ) -> Work:
        """On the root ``output_tensors[0][r]`` receives rank r's input; elsewhere it is ``[]``."""

    @abc.abstractmethod
    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ScatterOptions,
    ) -> Work:
        """The root's ``input_tensors[0][r]`` goes to rank r's ``output_tensors[0]``."""

    @abc.abstractmethod
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions,
    ) -> Work:
        """``output_tensors[0]`` on rank r is the reduction over ranks of ``input_tensors[0][r]``."""

    @abc.abstractmethod
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> Work:
        """``reduce_scatter_tensor``: ``input`` is ``size()`` equal blocks."""

    @abc.abstractmethod
    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllToAllOptions,
    ) -> Work:
        """``input_tensors[r]`` goes to rank r, which writes it into its ``output_tensors[me]``."""

    @abc.abstractmethod
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions,
    ) -> Work:
        """``all_to_all_single``: splits along dim 0 (empty split lists mean equal splits)."""

    @abc.abstractmethod
    def barrier(self, opts: BarrierOptions) -> Work: ...

    # -- point to point --------------------------------------------------------------------------
    @abc.abstractmethod
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """Receive from whichever rank sends first; ``Work.source_rank()`` names it."""

    # -- lifetime --------------------------------------------------------------------------------
    def monitored_barrier(self, opts: BarrierOptions, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive (default: via ``barrier``)."""
        self.barrier(opts).wait()

    @abc.abstractmethod
    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default deadline of later operations."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release connections and threads; pending operations fail."""

    def abort(self) -> None:
        """Tear down at once (default: ``shutdown``)."""
        self.shutdown()


BackendCreator = Callable[["Store", int, int, timedelta], Backend]
_creators: dict[str, BackendCreator] = {}


def register_backend_creator(name: str, creator: BackendCreator) -> None:
    """Make ``init_process_group(backend=name)`` build backends with ``creator(store, rank,
    size, timeout)``; ``store`` is private to the group (a ``PrefixStore``)."""
    _creators[name.lower()] = creator


def backend_creator(name: str) -> BackendCreator | None:
    return _creators.get(name.lower())
