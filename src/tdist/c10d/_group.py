"""Process groups and the registry of them: ``ProcessGroup``, ``GroupMember``, ``group``, and
the world state that ``init_process_group`` builds.

Theory of operation. A ``ProcessGroup`` is torch's user-facing handle: ``rank()``, ``size()``
and the collective methods with torch's names (``allreduce``, ``allgather``, ...), delegating
to one backend instance (``tdist.c10d._backend.Backend``) that works with group-local ranks.
In debug mode (``DebugLevel.DETAIL``) each collective is first checked against the other ranks'
calls (``_debug.CollectiveChecker``).

The world: everything ``init_process_group`` creates (the default group, every ``new_group``,
their global-to-group rank maps, stores and backend names) lives in one ``World`` object. A
process has one, as in torch: ``init_process_group`` while it is live raises, from whatever
thread. So that N ranks can run as N threads of one process (as the tests do), a thread that
says it is a rank of its own (``isolate_thread``; ``tdist.testing.run_threads`` does it for its
ranks) gets a world of its own instead, bound to it: it sees only the last one it made (none
once it is destroyed). Every other thread sees the process's world.

The rank-mapping helpers at the bottom are pure functions of a ``{global: group}`` map.

Thread-safety: the registry is guarded by a lock; a ``ProcessGroup`` may be used from several
threads, but collectives on one group must be issued in the same order on every rank.
"""

from __future__ import annotations

import enum
import logging
import operator
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from .._core.errors import DistBackendError, DistError
from ._backend import Backend as BackendImpl
from ._debug import CollectiveChecker, Fingerprint
from ._profiling import profiled
from ._types import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RedOpType,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
    as_red_op,
)

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "GroupInfo",
    "GroupMember",
    "ProcessGroup",
    "World",
    "chain_work",
    "current_world",
    "global_rank_of",
    "group",
    "group_rank_of",
    "isolate_thread",
    "new_world",
    "release_world",
]

log = logging.getLogger(__name__)

NON_GROUP_MEMBER = -100


# -- the ProcessGroup handle ---------------------------------------------------------------------
def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _as_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _even_split(t: torch.Tensor, size: int) -> list[int]:
    return [t.shape[0] // size] * size if t.dim() else []


def _copied_into(ts: Iterable[torch.Tensor]) -> None:
    """For the collectives that gloo ends with a ``copy_`` into each output (all_gather and
    all_gather_into_tensor, gather on the root, reduce_scatter in both forms, all_to_all,
    all_reduce_coalesced): autograd sees that copy as torch's does. In grad mode, a leaf that
    requires grad (or a view of one) is refused with autograd's own error, before anything is
    sent; any other output that requires grad gets the copy's ``grad_fn`` (nothing flows back
    through it), and its version moves on. Outside grad mode nothing changes, as in torch.
    (all_reduce, broadcast, scatter, all_to_all_single and recv write without a ``copy_``, in
    gloo as here: ``_d``.)"""
    if not torch.is_grad_enabled():
        return
    needing = [t for t in ts if t.requires_grad]
    needing.sort(key=lambda t: not t.is_leaf)  # (a refused leaf first: then nothing has changed)
    for t in needing:
        t.copy_(t.detach())  # (the same memory: only autograd's record of a copy)


def _d(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as the backend gets them: the same memory outside autograd (``.data``), as
    torch's C++ collectives write it: a parameter that requires grad may be broadcast into, the
    tensor's autograd version does not change (a loss all-reduced for logging may still be
    backpropagated, as with gloo), and an inference tensor may be written outside
    ``torch.inference_mode``."""
    out = []
    for t in ts:
        try:
            t._version  # noqa: B018 (an inference tensor has none: its views may not be written)
        except RuntimeError:
            out.append(_writable_alias(t))
            continue
        out.append(t.data)
    return out


def _writable_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor on an inference tensor's memory (same shape and strides), whose views
    may be written outside ``torch.inference_mode``, as torch's C++ collectives write it."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _dd(tss: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [_d(ts) for ts in tss]


def _tensors(x: Sequence[Any]) -> list[torch.Tensor]:
    """``x`` (a list of tensors, typed loosely where torch overloads a parameter) as a list."""
    return list(x)


def chain_work(
    works: Sequence[Work], op: str, finish: Callable[[], list[torch.Tensor]] | None = None
) -> Work:
    """A ``Work`` that completes when all of ``works`` have, after running ``finish``.

    ``finish`` (copy results out of staging buffers, say) runs once, in the thread that
    completes the last of ``works``; its return value is the result. A failure of any part
    fails the whole at once.
    """
    outer = Work(op)
    if not works:
        try:
            outer._complete(finish() if finish is not None else [])
        except BaseException as exc:
            outer._fail(exc)
        return outer
    remaining = [len(works)]
    lock = threading.Lock()

    def done(w: Work) -> None:
        exc = w.exception()
        if exc is not None:
            outer._fail(exc)
            return
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                result = finish() if finish is not None else [t for x in works for t in x._result]
            except BaseException as err:
                outer._fail(err)
                return
            outer._complete(result)

    for w in works:
        w.add_done_callback(done)
    return outer


class _GroupClass(type):
    """The class of ``ProcessGroup``: ``isinstance(g, tdist.ProcessGroup)`` holds for every
    group tdist hands out (``group.WORLD``, ``new_group``'s), which are torch's own
    ``ProcessGroup`` objects running on ours, as it does for them with ``torch.distributed``.
    tdist itself tells its own groups from torch's with ``is_ours``."""

    def __instancecheck__(cls, obj: object) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        return cls is ProcessGroup and isinstance(obj, torch.distributed.ProcessGroup)


def is_ours(obj: object) -> TypeGuard[ProcessGroup]:
    """Whether ``obj`` is one of tdist's own groups (not torch's, which ``isinstance`` counts)."""
    return type.__instancecheck__(ProcessGroup, obj)


class SplitMerge:
    """torch's ``ProcessGroup.split_group`` and ``merge_remote_group`` (C++ methods there), for
    our ``ProcessGroup`` and for torch's twin of a group (``_torch_pg``): ``_reshape`` makes the
    groups."""

    def split_group(
        self,
        ranks: Sequence[int],
        timeout: timedelta | None = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> Any:
        """A group of this group's ranks ``ranks``, made by its members alone (only they need
        call it); ``None`` on a rank not in it."""
        from ._reshape import split_one

        return split_one(self, ranks, timeout, opts, group_name, group_desc)

    def merge_remote_group(
        self,
        store: Any,
        size: int,
        timeout: timedelta = timedelta(minutes=30),
        group_name: str | None = None,
        group_desc: str | None = None,
    ) -> Any:
        """A group of ``size`` processes, met through ``store``: each caller's rank is the order
        in which it arrives there. The callers may come from different jobs; the group belongs
        to no world (as torch's)."""
        from ._reshape import merge_remote

        return merge_remote(self, store, size, timeout, group_name, group_desc)


def _rank_size(rank: int, size: int) -> tuple[None, int, int]:
    return None, rank, size


def _store_rank_size(store: Store, rank: int, size: int) -> tuple[Store, int, int]:
    return store, rank, size


class ProcessGroup(SplitMerge, metaclass=_GroupClass):
    """A group of ranks and its backend (``torch.distributed.ProcessGroup``).

    Made by ``init_process_group`` and ``new_group``; methods take group-local ranks and
    return ``Work``, as torch's do.

    Args:
        store: the group's store namespace.
        rank: this process's rank in the group.
        size: the number of ranks in the group.
    """

    class BackendType(enum.IntEnum):
        """torch's backend kinds (ours is ``CUSTOM``)."""

        UNDEFINED = 0
        GLOO = 1
        NCCL = 2
        UCC = 3
        MPI = 4
        XCCL = 5
        CUSTOM = 6

    # (torch's enum values are the class's attributes too: ``ProcessGroup.GLOO``)
    UNDEFINED = BackendType.UNDEFINED
    GLOO = BackendType.GLOO
    NCCL = BackendType.NCCL
    UCC = BackendType.UCC
    MPI = BackendType.MPI
    XCCL = BackendType.XCCL
    CUSTOM = BackendType.CUSTOM

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # torch's two overloads: ``ProcessGroup(rank, size)`` (a group of a Python backend of
        # its own, as torch's tests subclass it) and ``ProcessGroup(store, rank, size)``
        form = _rank_size if len(args) + len(kwargs) == 2 and "store" not in kwargs else _store_rank_size
        store, rank, size = form(*args, **kwargs)
        self._store: Store | None = store  # (None: the (rank, size) form)
        self._rank = int(rank)
        self._size = int(size)
        self._backend: BackendImpl | None = None
        self._backend_name = "undefined"
        self._group_name = ""
        self._group_desc = "undefined"
        self._checker: CollectiveChecker | None = None
        self._timeout = timedelta(minutes=30)
        self._mb_seq = 0
        self._lock = threading.Lock()
        self.bound_device_id: torch.device | None = None

    # -- identity ------------------------------------------------------------------------------
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return self._size

    def name(self) -> str:
        """The backend's name (``"gloo"`` where our tcp backend stands in for gloo); a Python
        subclass's ``getBackendName()`` where it has one, as torch's."""
        get = getattr(type(self), "getBackendName", None)
        if get is not None:
            return str(get(self))
        return self._backend_name

    def _get_backend_name(self) -> str:
        return self._backend_name

    @property
    def group_name(self) -> str:
        """The group's unique name (``"0"`` for the default group, then ``"1"``, ...)."""
        return self._group_name

    @property
    def group_desc(self) -> str:
        """The description given at creation (``"default_pg"`` for the default group)."""
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: Any = None) -> BackendImpl:
        """The backend object that runs this group's operations.

        Raises:
            DistError: the group has been destroyed.
        """
        if self._backend is None:
            raise DistError(f"process group {self._group_name!r} has no backend (destroyed?)")
        return self._backend

    def _register_backend(self, device: Any, backend_type: Any, backend: BackendImpl) -> None:
        self._backend = backend

    def _set_backend(
        self, backend: BackendImpl, name: str, timeout: timedelta, checker: CollectiveChecker | None
    ) -> None:
        self._backend = backend
        self._backend_name = name
        self._timeout = timeout
        self._checker = checker

    def get_group_store(self) -> Store:
        """The group's store namespace.

        Raises:
            RuntimeError: a group made as ``ProcessGroup(rank, size)`` has none.
        """
        if self._store is None:
            raise RuntimeError("this process group was made without a store (ProcessGroup(rank, size))")
        return self._store

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(name={self._group_name!r}, rank={self._rank}, size={self._size}, "
            f"backend={self._backend_name!r})"
        )

    # -- plumbing ------------------------------------------------------------------------------
    def _impl(self) -> BackendImpl:
        return self._get_backend()

    # -- collectives (torch's ProcessGroup methods) ----------------------------------------------
    @profiled("broadcast", "broadcast_")
    def broadcast(
        self, tensors: torch.Tensor | list[torch.Tensor], opts: BroadcastOptions | int | None = None
    ) -> Work:
        """Broadcast ``tensors`` from ``opts.rootRank`` (or ``broadcast(tensor, root)``)."""
        if not isinstance(opts, BroadcastOptions):
            opts = BroadcastOptions(rootRank=0 if opts is None else int(opts))
        tensors = _as_list(tensors)
        t = tensors[opts.rootTensor] if tensors else None
        if self._checker is not None:
            self._checker.check(
                Fingerprint(
                    "broadcast",
                    dtype=_dtype(t) if t is not None else None,
                    shape=_shape(t) if t is not None else None,
                    root=opts.rootRank,
                )
            )
        return self._impl().broadcast(_d(tensors), opts)

    @profiled("all_reduce", "allreduce_")
    def allreduce(
        self,
        tensors: torch.Tensor | list[torch.Tensor],
        opts: AllreduceOptions | ReduceOp | RedOpType | None = None,
    ) -> Work:
        """All-reduce ``tensors`` in place (``allreduce(tensors, op)`` works too)."""
        if not isinstance(opts, AllreduceOptions):
            opts = AllreduceOptions(reduceOp=as_red_op(RedOpType.SUM if opts is None else opts))
        tensors = _as_list(tensors)
        if self._checker is not None:
            self._checker.check(
                Fingerprint(
                    "all_reduce",
                    dtype=_dtype(tensors[0]) if tensors else None,
                    shape=_shape(tensors[0]) if tensors else None,
                    reduce_op=as_red_op(opts.reduceOp).name,
                )
            )
        return self._impl().allreduce(_d(tensors), opts)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None
    ) -> Work:
        """All-reduce several tensors of one dtype as one flat buffer."""
        opts = opts or AllreduceOptions()
        if not tensors:
            return Work.completed([], "allreduce_coalesced")
        _copied_into(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        inner = AllreduceOptions(reduceOp=opts.reduceOp, timeout=opts.timeout, asyncOp=opts.asyncOp)
        work = self.allreduce([flat], inner)

        def finish() -> list[torch.Tensor]:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.detach().copy_(flat[offset : offset + n].view(t.shape))
                offset += n
            return list(tensors)

        return chain_work([work], "allreduce_coalesced", finish)

    @profiled("reduce", "reduce_")
    def reduce(
        self,
        tensors: torch.Tensor | list[torch.Tensor],
        opts: ReduceOptions | int | None = None,
        op: ReduceOp | RedOpType = RedOpType.SUM,
    ) -> Work:
        """Reduce ``tensors`` into ``opts.rootRank`` (or ``reduce(tensor, root, op)``)."""
        if not isinstance(opts, ReduceOptions):
            opts = ReduceOptions(rootRank=0 if opts is None else int(opts), reduceOp=as_red_op(op))
        tensors = _as_list(tensors)
        t = tensors[opts.rootTensor] if tensors else None
        if self._checker is not None:
            self._checker.check(
                Fingerprint(
                    "reduce",
                    dtype=_dtype(t) if t is not None else None,
                    shape=_shape(t) if t is not None else None,
                    root=opts.rootRank,
                    reduce_op=as_red_op(opts.reduceOp).name,
                )
            )
        return self._impl().reduce(_d(tensors), opts)

    @profiled("all_gather", "allgather_")
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]] | list[torch.Tensor],
        input_tensors: list[torch.Tensor] | torch.Tensor,
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """``output_tensors[0][r]`` receives rank r's ``input_tensors[0]`` (sizes may differ)."""
        opts = opts or AllgatherOptions()
        if isinstance(input_tensors, torch.Tensor):
            outs: list[list[torch.Tensor]] = [_tensors(output_tensors)]
            ins = [input_tensors]
        else:
            outs = [list(o) for o in output_tensors]
            ins = list(input_tensors)
        if ins:
            if self._checker is not None:
                self._checker.check(
                    Fingerprint(
                        "all_gather",
                        dtype=_dtype(ins[0]),
                        sends=dict.fromkeys(range(self._size), _shape(ins[0])),
                        recvs={r: _shape(t) for r, t in enumerate(outs[0])},
                    )
                )
        _copied_into(t for o in outs for t in o)
        return self._impl().allgather(_dd(outs), _d(ins), opts)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``, in one exchange."""
        opts = opts or AllgatherOptions()
        dtype = input_list[0].dtype if input_list else torch.uint8
        flat_in = (
            torch.cat([t.reshape(-1) for t in input_list]) if input_list else torch.empty(0, dtype=dtype)
        )
        flat_outs = [
            torch.empty(sum(t.numel() for t in lst), dtype=dtype) for lst in output_lists
        ]
        work = self.allgather([flat_outs], [flat_in], opts)

        def finish() -> list[torch.Tensor]:
            for flat, lst in zip(flat_outs, output_lists, strict=True):
                offset = 0
                for t in lst:
                    n = t.numel()
                    t.detach().copy_(flat[offset : offset + n].view(t.shape))
                    offset += n
            return [t for lst in output_lists for t in lst]

        return chain_work([work], "allgather_coalesced", finish)

    @profiled("all_gather", "_allgather_base_")
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> Work:
        """``output`` is every rank's ``input`` concatenated (or stacked) in rank order."""
        opts = opts or AllgatherOptions()
        if self._checker is not None:
            self._checker.check(Fingerprint("all_gather_into_tensor", dtype=_dtype(input), shape=_shape(input)))
        _copied_into([output])
        return self._impl()._allgather_base(output.detach(), input.detach(), opts)

    all_gather_single = _allgather_base

    @profiled("gather", "gather_")
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]] | list[torch.Tensor],
        input_tensors: list[torch.Tensor] | torch.Tensor,
        opts: GatherOptions | int | None = None,
    ) -> Work:
        """On the root ``output_tensors[0][r]`` receives rank r's input."""
        if not isinstance(opts, GatherOptions):
            opts = GatherOptions(rootRank=0 if opts is None else int(opts))
        if isinstance(input_tensors, torch.Tensor):
            outs: list[list[torch.Tensor]] = [_tensors(output_tensors)] if output_tensors else []
            ins = [input_tensors]
        else:
            outs = [list(o) for o in output_tensors]
            ins = list(input_tensors)
        root = opts.rootRank
        if ins:
            if self._checker is not None:
                self._checker.check(
                    Fingerprint(
                        "gather",
                        dtype=_dtype(ins[0]),
                        root=root,
                        sends={root: _shape(ins[0])},
                        recvs={r: _shape(t) for r, t in enumerate(outs[0])} if outs else {},
                    )
                )
        if self.rank() == root:
            _copied_into(t for o in outs for t in o)
        return self._impl().gather(_dd(outs), _d(ins), opts)

    @profiled("scatter", "scatter_")
    def scatter(
        self,
        output_tensors: list[torch.Tensor] | torch.Tensor,
        input_tensors: list[list[torch.Tensor]] | list[torch.Tensor],
        opts: ScatterOptions | int | None = None,
    ) -> Work:
        """The root's ``input_tensors[0][r]`` goes to rank r's ``output_tensors[0]``."""
        if not isinstance(opts, ScatterOptions):
            opts = ScatterOptions(rootRank=0 if opts is None else int(opts))
        if isinstance(output_tensors, torch.Tensor):
            outs = [output_tensors]
            ins: list[list[torch.Tensor]] = [_tensors(input_tensors)] if input_tensors else []
        else:
            outs = list(output_tensors)
            ins = [list(i) for i in input_tensors]
        root = opts.rootRank
        if outs:
            if self._checker is not None:
                self._checker.check(
                    Fingerprint(
                        "scatter",
                        dtype=_dtype(outs[0]),
                        root=root,
                        sends={r: _shape(t) for r, t in enumerate(ins[0])} if ins else {},
                        recvs={root: _shape(outs[0])},
                    )
                )
        return self._impl().scatter(_d(outs), _dd(ins), opts)

    @profiled("reduce_scatter", "reduce_scatter_")
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor] | torch.Tensor,
        input_tensors: list[list[torch.Tensor]] | list[torch.Tensor],
        opts: ReduceScatterOptions | ReduceOp | RedOpType | None = None,
    ) -> Work:
        """Rank r's ``output_tensors[0]`` is the reduction of every rank's ``input_tensors[0][r]``."""
        if not isinstance(opts, ReduceScatterOptions):
            opts = ReduceScatterOptions(reduceOp=as_red_op(RedOpType.SUM if opts is None else opts))
        if isinstance(output_tensors, torch.Tensor):
            outs = [output_tensors]
            ins: list[list[torch.Tensor]] = [_tensors(input_tensors)]
        else:
            outs = list(output_tensors)
            ins = [list(i) for i in input_tensors]
        if outs:
            if self._checker is not None:
                self._checker.check(
                    Fingerprint(
                        "reduce_scatter",
                        dtype=_dtype(outs[0]),
                        reduce_op=as_red_op(opts.reduceOp).name,
                        sends={r: _shape(t) for r, t in enumerate(ins[0])} if ins else {},
                        recvs=dict.fromkeys(range(self._size), _shape(outs[0])),
                    )
                )
        _copied_into(outs)
        return self._impl().reduce_scatter(_d(outs), _dd(ins), opts)

    @profiled("reduce_scatter", "_reduce_scatter_base_")
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> Work:
        """``input`` is ``size()`` blocks; rank r's ``output`` is the reduction of block r."""
        opts = opts or ReduceScatterOptions()
        if self._checker is not None:
            self._checker.check(
                Fingerprint(
                    "reduce_scatter_tensor",
                    dtype=_dtype(output),
                    shape=_shape(output),
                    reduce_op=as_red_op(opts.reduceOp).name,
                )
            )
        _copied_into([output])
        return self._impl()._reduce_scatter_base(output.detach(), input.detach(), opts)

    reduce_scatter_single = _reduce_scatter_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> Work:
        """``outputs[i]`` is every rank's ``inputs[i]`` concatenated in rank order, for each
        pair: ``_allgather_base`` of every pair, one ``Work`` for them all."""
        if len(outputs) != len(inputs):
            raise ValueError(
                f"allgather_into_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs"
            )
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return chain_work(works, "allgather_into_tensor_coalesced", lambda: list(outputs))

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions | None = None
    ) -> Work:
        """``outputs[i]`` is the reduction of block r of every rank's ``inputs[i]`` (r: this
        rank), for each pair: ``_reduce_scatter_base`` of every pair, one ``Work`` for them all."""
        if len(outputs) != len(inputs):
            raise ValueError(
                f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs"
            )
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return chain_work(works, "reduce_scatter_tensor_coalesced", lambda: list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @profiled("all_to_all", "alltoall_")
    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        """``input_tensors[r]`` goes to rank r, into its ``output_tensors[me]``."""
        opts = opts or AllToAllOptions()
        if input_tensors:
            if self._checker is not None:
                self._checker.check(
                    Fingerprint(
                        "all_to_all",
                        dtype=_dtype(input_tensors[0]),
                        sends={r: _shape(t) for r, t in enumerate(input_tensors)},
                        recvs={r: _shape(t) for r, t in enumerate(output_tensors)},
                    )
                )
        _copied_into(output_tensors)
        return self._impl().alltoall(_d(output_tensors), _d(input_tensors), opts)

    @profiled("all_to_all", "alltoall_base_")
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        """``all_to_all_single``: splits along dim 0 (empty split lists mean equal splits)."""
        opts = opts or AllToAllOptions()
        if self._checker is not None:
            ins = input_split_sizes or _even_split(input, self._size)
            outs = output_split_sizes or _even_split(output, self._size)
            self._checker.check(
                Fingerprint(
                    "all_to_all_single",
                    dtype=_dtype(input),
                    sends={r: (int(n), *_shape(input)[1:]) for r, n in enumerate(ins)},
                    recvs={r: (int(n), *_shape(output)[1:]) for r, n in enumerate(outs)},
                )
            )
        return self._impl().alltoall_base(
            output.detach(), input.detach(), output_split_sizes, input_split_sizes, opts
        )

    all_to_all_single = alltoall_base

    @profiled("barrier", "barrier")
    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        """Complete once every rank of the group has called ``barrier``."""
        opts = opts or BarrierOptions()
        if self._checker is not None:
            self._checker.check(Fingerprint("barrier"))
        return self._impl().barrier(opts)

    @profiled("monitored_barrier", "monitored_barrier_")
    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier through the group's store that names the ranks that did not arrive.

        Rank 0 waits up to ``timeout`` for every other rank, then releases them with its
        verdict; a failure raises on every rank that arrived, naming the missing ranks.

        Raises:
            DistBackendError: ``"[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"``
                (torch's words) on rank 0, and on the others the same verdict; on a rank
                that rank 0 never answered, an error saying so.
        """
        timeout = self._timeout if timeout is None else timeout
        with self._lock:
            seq = self._mb_seq
            self._mb_seq += 1
        monitored_barrier_via_store(
            self.get_group_store(), self._rank, self._size, seq, timeout, wait_all_ranks,
            getattr(self._backend, "lost_peers", None),
        )

    # -- point to point ------------------------------------------------------------------------
    @profiled("send", "send")
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Work:
        """Send ``tensors[0]`` to group rank ``dstRank``."""
        return self._impl().send(_d(_as_list(tensors)), dstRank, tag)

    @profiled("recv", "recv_")
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Work:
        """Receive into ``tensors[0]`` from group rank ``srcRank``."""
        return self._impl().recv(_d(_as_list(tensors)), srcRank, tag)

    @profiled("recvAnySource", "recv_any_source_")
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """Receive into ``tensors[0]`` from whichever rank sends first."""
        return self._impl().recv_anysource(_d(_as_list(tensors)), tag)

    # -- lifetime ------------------------------------------------------------------------------
    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default deadline of later operations."""
        self._timeout = timeout
        self._impl().set_timeout(timeout)

    def shutdown(self) -> None:
        """Release the backend's connections and threads."""
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.shutdown()

    def abort(self) -> None:
        """Tear the backend down at once."""
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.abort()


# -- monitored barrier ---------------------------------------------------------------------------
def _ms(timeout: timedelta) -> int:
    return round(timeout.total_seconds() * 1000)


_MB_LOOK = 0.5  # seconds between two looks at the group's lost ranks while a monitored barrier waits


def _wait_unless_lost(
    store: Store, key: str, seconds: float, peer: int, lost: Callable[[], dict[int, str]] | None
) -> str | None:
    """Wait up to ``seconds`` for ``key``; None once it is there, else why not: ``peer``'s
    process is gone (``lost()``, looked at every ``_MB_LOOK`` seconds: a dead rank fails the
    barrier at once, as gloo's connection to it does, not at its timeout), or the time ran out.
    """
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        try:
            if remaining > 0:
                store.wait([key], timedelta(seconds=min(remaining, _MB_LOOK) if lost is not None else remaining))
                return None
            if store.check([key]):
                return None
            return "timed out"
        except TimeoutError:  # (a look's wait ended: is the peer gone? else look again, until the deadline)
            gone = lost() if lost is not None else {}
            if peer in gone and not store.check([key]):  # (what it left before it went counts)
                return f"its process is gone ({gone[peer]})"
            if time.monotonic() >= deadline:
                return "timed out"
        except DistError as exc:  # (the store itself failed: its host is gone, say)
            return f"the store failed: {exc}"


def monitored_barrier_via_store(
    store: Store, rank: int, size: int, seq: int, timeout: timedelta, wait_all_ranks: bool,
    lost: Callable[[], dict[int, str]] | None = None,
) -> None:
    """The monitored-barrier protocol over a store (see ``ProcessGroup.monitored_barrier``).

    Keys (under ``store``): ``mb/<seq>/arrive/<rank>`` set by every rank but 0;
    ``mb/<seq>/release`` set by rank 0 to ``ok`` or ``error:<message>``. ``lost``: the
    group's ranks known gone, with why (the backend's ``lost_peers``): they are not waited for.
    """
    prefix = f"monitored_barrier/{seq}/"
    release = prefix + "release"
    seconds = timeout.total_seconds()
    if rank != 0:
        store.set(f"{prefix}arrive/{rank}", b"1")
        # a little longer than rank 0 waits, so that its verdict arrives before we give up
        margin = max(5.0, 0.1 * seconds)  # (a loaded host delays rank 0; a dead rank 0 is seen at once: lost)
        why = _wait_unless_lost(store, release, seconds + margin, 0, lost)
        if why is not None:
            detail = f"no verdict within {_ms(timeout)} ms" if why == "timed out" else why
            raise DistBackendError(
                f"[Rank {rank}]: Rank {rank} successfully reached monitoredBarrier, but received "
                f"errors while waiting for send/recv from rank 0 ({detail}). Please check rank 0 "
                "logs for faulty rank."
            )
        verdict = store.get(release).decode()
        if verdict != "ok":
            raise DistBackendError(f"[Rank {rank}]: {verdict.removeprefix('error:')}")
        return
    deadline = time.monotonic() + seconds
    failed: list[int] = []
    gone: list[str] = []
    for r in range(1, size):
        why = _wait_unless_lost(store, f"{prefix}arrive/{r}", max(0.0, deadline - time.monotonic()), r, lost)
        if why is not None:
            failed.append(r)
            if why != "timed out":
                gone.append(f"rank {r}: {why}")
            if not wait_all_ranks:
                break
    if not failed:
        store.set(release, b"ok")
        for r in range(1, size):
            store.delete_key(f"{prefix}arrive/{r}")
        return
    if wait_all_ranks:
        message = (
            f"Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in "
            f"{_ms(timeout)} ms"
        )
    else:
        message = f"Rank {failed[0]} failed to pass monitoredBarrier in {_ms(timeout)} ms"
    if gone:
        message += f" ({'; '.join(gone)})"
    store.set(release, f"error:{message} (as reported by rank 0)".encode())
    raise DistBackendError(f"[Rank 0]: {message}")


# -- the world -----------------------------------------------------------------------------------
@dataclass
class GroupInfo:
    """What the world records about one group.

    Attributes:
        name: the group's unique name.
        backend: the backend name as requested and normalized (what ``get_backend`` returns).
        config: the device-to-backend string (what ``get_backend_config`` returns).
        store: the group's store namespace.
        ranks: global rank to group rank, for every member.
    """

    name: str
    backend: str
    config: str
    store: Store
    ranks: dict[int, int]


@dataclass
class World:
    """Everything one ``init_process_group`` made (see the module docstring)."""

    default_pg: ProcessGroup | None = None
    groups: dict[ProcessGroup, GroupInfo] = field(default_factory=dict)
    group_count: int = 0
    # groups counted above that torch has no twin of (an unsorted order): torch's counter,
    # where torch's default group runs on this world, misses them (see ``get_pg_count``)
    untwinned_count: int = 0
    local_sync_names: dict[tuple[int, ...], int] = field(default_factory=dict)
    # torch files the rank map of a group this rank is left out of under NON_GROUP_MEMBER, so
    # get_process_group_ranks(NON_GROUP_MEMBER) & co. answer for the latest such group
    non_member_ranks: dict[int, int] | None = None
    owned_store: Store | None = None
    init_method: str | None = None
    # torch's group that runs on each of our groups (see _torch_pg.mirror_group), and back
    torch_twins: dict[Any, ProcessGroup] = field(default_factory=dict)
    # torch's default group, where this world is torch's, taken over (see ``current_world``)
    adopted: Any = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def alive(self) -> bool:
        return self.default_pg is not None

    def info(self, pg: ProcessGroup) -> GroupInfo | None:
        return self.groups.get(pg)

    def twin_of(self, pg: ProcessGroup) -> Any:
        """torch's group that runs on our ``pg`` (``torch_twins``), or ``None``."""
        for twin, ours in self.torch_twins.items():
            if ours is pg:
                return twin
        return None


_registry_lock = threading.Lock()
_primary: World | None = None
_local = threading.local()


def isolate_thread() -> None:
    """Make this thread a rank of its own: its ``init_process_group`` makes a world for this
    thread alone, beside the process's (ranks run as threads of one process, as in tests)."""
    _local.isolated = True


def current_world() -> World | None:
    """The world this thread sees: an isolated thread's own (``None`` once destroyed), else the
    process's."""
    if getattr(_local, "isolated", False):
        mine: World | None = getattr(_local, "world", None)
        if mine is not None or getattr(_local, "made_one", False):
            return mine if mine is not None and mine.alive else None
    primary = _primary
    if primary is not None and primary.alive and (primary.adopted is None or primary.adopted is _torch_default()):
        return primary
    return _adopt_torch_default()


def _torch_default() -> Any:
    """torch's default group, if torch has one (``None`` if ``torch.distributed`` was never
    loaded)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return None if c10d is None else c10d._world.default_pg


def _adopt_torch_default() -> World | None:
    """A program made torch's default group with torch's ``init_process_group("tdist")``: tdist's
    functions take it for theirs (a world whose default group is a handle on that group's
    backend), until torch destroys it. ``None`` if torch's default group does not run on tdist."""
    global _primary
    torch_pg = _torch_default()
    if torch_pg is None:
        if _primary is not None and _primary.adopted is not None:  # (torch destroyed it)
            with _registry_lock:
                if _primary is not None and _primary.adopted is not None:
                    _unbind(_primary)
        return None
    from ._torch_pg import handle_on

    made = handle_on(torch_pg)
    if made is None:
        return None
    pg, info = made
    with _registry_lock:
        primary = _primary
        if primary is not None and primary.alive:
            if primary.adopted is None or primary.adopted is torch_pg:  # (another thread's)
                return primary
            _unbind(primary)
        world = World(default_pg=pg, adopted=torch_pg)
        world.groups[pg] = info
        world.torch_twins[torch_pg] = pg
        _primary = world
    return world


def thread_isolated() -> bool:
    """Whether this thread has a world of its own (a rank run as a thread), not the process's."""
    return bool(getattr(_local, "isolated", False))


def thread_has_world() -> bool:
    """Whether ``init_process_group`` here would make a second live world: this isolated
    thread's own is live, or (any other thread) the process's is."""
    if getattr(_local, "isolated", False):
        world = getattr(_local, "world", None)
        return world is not None and world.alive
    return current_world() is not None


def new_world() -> World:
    """A fresh world: the process's, or an isolated thread's own (and the process's too, if it
    has none live)."""
    global _primary
    world = World()
    with _registry_lock:
        if getattr(_local, "isolated", False):
            _local.world = world
            _local.made_one = True
        elif _primary is not None and _primary.alive:  # (a race with another thread)
            raise ValueError("trying to initialize the default process group twice!")
        if _primary is None or not _primary.alive:
            _primary = world
    return world


def publish_world(world: World, default_pg: ProcessGroup) -> None:
    """Make ``world`` live with its default group."""
    with _registry_lock:
        world.default_pg = default_pg


def release_world(world: World) -> None:
    """Mark ``world`` dead and unbind it (from this thread, and as the process's)."""
    with _registry_lock:
        _unbind(world)


def _unbind(world: World) -> None:
    global _primary
    world.default_pg = None
    world.groups.clear()
    world.torch_twins.clear()
    if _primary is world:
        _primary = None
    if getattr(_local, "world", None) is world:
        _local.world = None


class _WorldMeta(type):
    """Gives ``group`` and ``GroupMember`` the class property ``WORLD``."""

    @property
    def WORLD(cls) -> Any:
        """The default group; torch's twin of it where torch's default group runs on it (so that
        torch's modules take it too)."""
        world = current_world()
        if world is None or world.default_pg is None:
            return None
        twin = world.twin_of(world.default_pg)
        return world.default_pg if twin is None else twin


class group(metaclass=_WorldMeta):
    """``group.WORLD``: the default group (``None`` before ``init_process_group``)."""


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` and ``GroupMember.NON_GROUP_MEMBER`` (what non-members get)."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


# -- rank mapping (pure) -------------------------------------------------------------------------
def group_rank_of(ranks: Mapping[int, int], global_rank: int, label: object) -> int:
    """The group rank of ``global_rank``.

    Raises:
        ValueError: ``global_rank`` is not a member (torch's message).
    """
    if global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {label}")
    return ranks[global_rank]


def global_rank_of(ranks: Mapping[int, int], group_rank: int, label: object) -> int:
    """The global rank of ``group_rank``.

    Raises:
        ValueError: no member has that group rank (torch's message).
    """
    for g, r in ranks.items():
        if r == group_rank:
            return g
    raise ValueError(f"Group rank {group_rank} is not part of group {label}")


def _as_rank(rank: object) -> int:
    try:
        return operator.index(rank)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a rank must be an int, got {type(rank).__name__} {rank!r}") from None


def canonical_rank(
    ranks: Mapping[int, int] | None,
    global_rank: int | None,
    group_rank: int | None,
    return_global: bool,
    label: object,
) -> int:
    """Take either a global or a group rank, give the group (or global) rank.

    ``ranks`` is ``None`` for the default group, where the two coincide.

    Raises:
        ValueError: both or neither given, or a rank outside the group (torch's messages).
        TypeError: a rank that is not an integer (``src=0.0``: torch's argument check refuses
            it too, before anything is sent).
    """
    if global_rank is not None and type(global_rank) is not int:
        global_rank = _as_rank(global_rank)
    if group_rank is not None and type(group_rank) is not int:
        group_rank = _as_rank(group_rank)
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError("Can't specify both group_rank and global_rank")
        if not return_global or ranks is None:
            return group_rank
        return global_rank_of(ranks, group_rank, label)
    if global_rank is None:
        raise ValueError("Must specify global_rank or group_rank")
    if return_global or ranks is None:
        return global_rank
    return group_rank_of(ranks, global_rank, label)


def new_group_ranks(ranks: Sequence[int] | None, world_size: int, sort_ranks: bool = True) -> list[int]:
    """Validate and normalize ``new_group``'s ``ranks`` (``None``: every rank).

    Raises:
        ValueError: duplicates, too many, or out of range (torch's messages).
        TypeError: not a sequence of ints.
    """
    if ranks is None:
        return list(range(world_size))
    try:
        out = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise TypeError(f"new_group: ranks must be a list of ints, got {ranks!r}") from None
    if any(isinstance(r, bool) for r in ranks):
        raise TypeError(f"new_group: ranks must be a list of ints, got {ranks!r}")
    if sort_ranks:
        out = sorted(out)
    if len(set(out)) != len(out):
        raise ValueError(f"ranks list must not contain duplicate entries, got {out}")
    if len(out) > world_size:
        raise ValueError(
            "the new group's world size should be less or equal to the world size set by "
            "init_process_group"
        )
    for r in out:
        if r < 0 or r >= world_size:
            raise ValueError(
                f"Rank {r} is out of range. Valid ranks are 0 to {world_size - 1} "
                f"(world_size={world_size})"
            )
    return out


def subgroup_rank_lists(ranks: Sequence[int], group_size: int) -> list[list[int]]:
    """``new_subgroups``: cut ``ranks`` into consecutive lists of ``group_size``.

    Raises:
        ValueError: a size that is not positive, exceeds or does not divide the world size.
    """
    world_size = len(ranks)
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    if world_size < group_size:
        raise ValueError(
            f"The arg 'group_size' ({group_size}) must not exceed the world size ({world_size})"
        )
    if world_size % group_size != 0:
        raise ValueError(f"The world size ({world_size}) must be divisible by '{group_size=}'")
    return [list(ranks[i : i + group_size]) for i in range(0, world_size, group_size)]


def check_disjoint(ranks_per_subgroup_list: Sequence[Sequence[int]]) -> None:
    """``new_subgroups_by_enumeration``: no rank in two subgroups.

    Raises:
        ValueError: empty, or a rank in two lists (torch's messages).
    """
    if ranks_per_subgroup_list is None or len(ranks_per_subgroup_list) == 0:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: dict[int, Sequence[int]] = {}
    for ranks in ranks_per_subgroup_list:
        for r in ranks:
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {list(seen[r])} and {list(ranks)}")
            seen[r] = ranks


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tdist's own files


def warn_not_in_group(op_name: str, global_rank: int) -> None:
    """torch's warning for a non-member calling a collective on a sub-group."""
    frame, level = sys._getframe(1), 2  # (the caller's caller: the first frame outside tdist)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"Running {op_name} on global rank {global_rank} which does not belong to the given group.",
        stacklevel=level,
    )
