"""The collectives: ``broadcast``, ``all_reduce``, ``reduce``, ``all_gather`` (and its single-tensor
forms), ``gather``, ``scatter``, ``reduce_scatter`` (and its single-tensor forms),
``all_to_all`` (and ``all_to_all_single``), ``barrier`` and ``monitored_barrier``.

Each checks its arguments (``_checks``), resolves the group and the root (``_world``), takes real
views of complex tensors, and calls the ``ProcessGroup`` method with torch's options record;
with ``async_op`` the ``Work`` comes back at once, else it is waited on here.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from . import _checks as C
from ._group import warn_not_in_group
from ._reduce import sparse_all_reduce
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
from ._world import (
    GroupArg,
    _check_non_member_root,
    _check_valid_timeout,
    _from_torch,
    _global_rank_or_minus_one,
    _group_rank,
    _not_member,
    _resolve,
)

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
]


# -- helpers ---------------------------------------------------------------------------------------
def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


# -- torch's coalescing manager ---------------------------------------------------------------------
class _CoalescingManager:
    """What ``_coalescing_manager`` yields: the works of the block (``wait()`` waits for them)."""

    def __init__(self) -> None:
        self.works: list[Work] = []

    def append(self, work: Work | None = None) -> None:
        if work:
            self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


_coalescing = threading.local()  # .active: (group, manager) of this thread's async_ops block


@contextlib.contextmanager
def _coalescing_manager(
    group: GroupArg = None, device: torch.device | None = None, async_ops: bool = False
) -> Iterator[_CoalescingManager]:
    """torch's ``_coalescing_manager``: the block's ``all_reduce``, ``all_gather_into_tensor``
    and ``reduce_scatter_tensor`` on ``group``, as one batch.

    With ``async_ops``, those calls return at once even without ``async_op`` (their works go
    to the manager; ``cm.wait()`` waits for them), as torch's defer them to the block's end;
    without it, each is done when it returns. Unlike torch's, a call with ``async_op=True``
    gets its real ``Work`` (torch's gives one whose ``wait`` raises), and ``device`` needs no
    backend support (gloo raises). Other operations in the block run as usual.

    Raises:
        ValueError: a block for this group is open already in this thread (torch's message).
    """
    pg = _resolve(group)
    outer = getattr(_coalescing, "active", None)
    if outer is not None and outer[0] is pg:
        raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
    cm = _CoalescingManager()
    _coalescing.active = (pg, cm) if async_ops else outer
    try:
        yield cm
    finally:
        _coalescing.active = outer


def _finish_coalesced(pg: Any, work: Work, async_op: bool) -> Work | None:
    """``_finish`` for the operations torch coalesces: in an ``async_ops`` block of ``pg``'s
    the work goes to its manager."""
    active = getattr(_coalescing, "active", None)
    if active is not None and active[0] is pg:
        active[1].append(work)
        return work if async_op else None
    return _finish(work, async_op)


def _red_op(op: object) -> RedOpType:
    try:
        return as_red_op(op)
    except ValueError as exc:
        raise TypeError(str(exc)) from None


def _set_async(opts: Any, async_op: bool) -> Any:
    opts.asyncOp = async_op
    return opts


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"`torch.distributed.{old}` is deprecated. Please use `torch.distributed.{new}` instead.",
        FutureWarning,
        stacklevel=3,
    )


# -- collectives -----------------------------------------------------------------------------------
@C.meta_noop
def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``tensor`` of rank ``src`` (global; or ``group_src``) into ``tensor`` everywhere.

    Returns:
        The ``Work`` if ``async_op``, else ``None`` (also on a non-member).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``src`` not in ``group``; both/neither of ``src``/``group_src``.
        CollectiveArgumentError: the root is out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        _check_non_member_root("broadcast", src, group_src)
        warn_not_in_group("broadcast", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    root = _group_rank(pg, src, group_src)
    C.check_root_rank(root, pg.size(), "broadcast", "src")
    opts = _set_async(BroadcastOptions(rootRank=root, rootTensor=0), async_op)
    return _finish(pg.broadcast([C.real_view(t)], opts), async_op)


@C.meta_noop
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` across the group, in place on every rank.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``op`` not a ``ReduceOp``.
        ValueError: an op that is meaningless on complex tensors (torch's message).
        CollectiveArgumentError: BAND/BOR/BXOR on a floating-point tensor.
    """
    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.sparse_coo:  # (as gloo)
        return _sparse_all_reduce(tensor, op, group, async_op)
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        warn_not_in_group("all_reduce", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    if t.is_complex():
        C.check_complex_op(red, [t], "all_reduce")
        t = torch.view_as_real(t)
    elif red >= RedOpType.BAND:
        C.check_bitwise_dtype(red, [t], "all_reduce")
    pg = _resolve(group)
    opts = AllreduceOptions()  # fields set directly: this is the latency-critical path
    opts.reduceOp = red
    opts.asyncOp = async_op
    return _finish_coalesced(pg, pg.allreduce([t], opts), async_op)


def _sparse_all_reduce(tensor: torch.Tensor, op: ReduceOp | RedOpType, group: GroupArg, async_op: bool) -> Work | None:
    """``all_reduce`` of a sparse COO tensor: the sum of every rank's entries (SUM only, as gloo);
    done before this returns (a completed Work if ``async_op``)."""
    if _not_member(group):
        warn_not_in_group("all_reduce", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    sparse_all_reduce(tensor, _red_op(op), pg.size(), lambda outs, inp: pg.allgather([outs], [inp]).wait())
    return Work.completed([tensor], "all_reduce") if async_op else None


@C.meta_noop
def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into rank ``dst``'s ``tensor``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError, ValueError, CollectiveArgumentError: as ``all_reduce`` and ``broadcast``.
    """
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        _check_non_member_root("reduce", dst, group_dst)
        warn_not_in_group("reduce", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    C.check_complex_op(red, [t], "reduce")
    C.check_bitwise_dtype(red, [t], "reduce")
    pg = _resolve(group)
    root = _group_rank(pg, dst, group_dst)
    C.check_root_rank(root, pg.size(), "reduce", "dst")
    opts = _set_async(ReduceOptions(reduceOp=red, rootRank=root, rootTensor=0), async_op)
    return _finish(pg.reduce([C.real_view(t)], opts), async_op)


@C.meta_noop
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``tensor_list[r]`` receives rank r's ``tensor``; sizes may differ per rank (tdist; gloo
    rejects that), as long as ``tensor_list[r]`` matches rank r's ``tensor``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not a list of tensors / not a tensor.
        ValueError: mixed dtypes (torch's message).
        CollectiveArgumentError: ``tensor_list`` does not have one entry per rank.
    """
    outs = C.as_tensor_list(tensor_list, "tensor_list")
    C.check_written(outs, "all_gather", "tensor_list")
    t = C.as_tensor(tensor, "tensor")
    C.ensure_same_dtype(outs, t)
    if _not_member(group):
        warn_not_in_group("all_gather", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    C.check_list_len(outs, pg.size(), "all_gather", "output tensor list")
    opts = _set_async(AllgatherOptions(), async_op)
    return _finish(pg.allgather([C.real_views(outs)], [C.real_view(t)], opts), async_op)


@C.meta_noop
def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor`` is every rank's ``input_tensor`` concatenated along dim 0 (shape
    ``(size * n, ...)``) or stacked (``(size, n, ...)``), in rank order.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: different dtypes.
        CollectiveArgumentError: ``output_tensor`` has neither shape.
    """
    out = C.as_tensor(output_tensor, "output_tensor")
    C.check_written(out, "all_gather_single", "output_tensor")
    inp = C.as_tensor(input_tensor, "input_tensor")
    if _not_member(group):
        warn_not_in_group("all_gather_single", _global_rank_or_minus_one())
        return None
    C.ensure_same_dtype(out, inp)
    pg = _resolve(group)
    C.check_all_gather_single(out, inp, pg.size(), "all_gather_into_tensor")
    opts = _set_async(AllgatherOptions(), async_op)
    return _finish_coalesced(pg, pg._allgather_base(C.real_view(out), C.real_view(inp), opts), async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``all_gather_single`` under its older name (deprecated in torch 2.13, with its warning)."""
    _deprecated("all_gather_into_tensor", "all_gather_single")
    return all_gather_single(output_tensor, input_tensor, group, async_op)


def _all_gather_base(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``all_gather_single`` under torch's private name."""
    warnings.warn(
        "`torch.distributed._all_gather_base` is a private function and will be deprecated. "
        "Please use `torch.distributed.all_gather_single` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return all_gather_single(output_tensor, input_tensor, group, async_op)


@C.meta_noop
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Rank ``dst`` (default global rank 0) receives every rank's ``tensor`` in ``gather_list``
    (given on ``dst`` only, same-sized tensors).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: ``gather_list`` missing on ``dst`` or given elsewhere; mixed dtypes.
        CollectiveArgumentError: wrong length or sizes, root out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    outs = C.as_tensor_list(gather_list, "gather_list") if gather_list else []
    C.check_written(outs, "gather", "gather_list")
    C.ensure_same_dtype(t, outs)
    if _not_member(group):
        warn_not_in_group("gather", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    implied = dst is None and group_dst is None
    if implied:
        dst = 0
    root = _group_rank(pg, dst, group_dst)
    C.check_root_rank(root, pg.size(), "gather", "dst")
    C.check_rooted_list(pg.rank(), root, outs, "gather", "gather_list", pg.size(), implied)
    C.check_same_numel(outs, t, "gather", "gather_list")
    opts = _set_async(GatherOptions(rootRank=root), async_op)
    output = [C.real_views(outs)] if pg.rank() == root else []
    return _finish(pg.gather(output, [C.real_view(t)], opts), async_op)


@C.meta_noop
def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Rank r's ``tensor`` receives ``scatter_list[r]`` of rank ``src`` (default global rank 0).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: ``scatter_list`` missing on ``src`` or given elsewhere; mixed dtypes.
        CollectiveArgumentError: wrong length or sizes, root out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    ins = C.as_tensor_list(scatter_list, "scatter_list") if scatter_list else []
    C.check_written(t, "scatter", "tensor")
    C.ensure_same_dtype(t, ins)
    implied = src is None and group_src is None
    if implied:
        src = 0
    if _not_member(group):
        _check_non_member_root("scatter", src, group_src)
        warn_not_in_group("scatter", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    root = _group_rank(pg, src, group_src)
    C.check_root_rank(root, pg.size(), "scatter", "src")
    C.check_rooted_list(pg.rank(), root, ins, "scatter", "scatter_list", pg.size(), implied)
    C.check_same_numel(ins, t, "scatter", "scatter_list")
    opts = _set_async(ScatterOptions(rootRank=root), async_op)
    inputs = [C.real_views(ins)] if pg.rank() == root else []
    return _finish(pg.scatter([C.real_view(t)], inputs, opts), async_op)


@C.meta_noop
def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Rank r's ``output`` is the reduction over ranks of their ``input_list[r]``; sizes may
    differ per rank (as gloo), as long as ``input_list[r]`` has rank r's ``output``'s size on
    every rank.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError, ValueError: as ``all_reduce``; mixed dtypes.
        CollectiveArgumentError: ``input_list`` of the wrong length, or its entry for this rank
            not of ``output``'s shape.
    """
    out = C.as_tensor(output, "output")
    C.check_written(out, "reduce_scatter", "output")
    ins = C.as_tensor_list(input_list, "input_list")
    C.ensure_same_dtype(out, ins)
    if _not_member(group):
        warn_not_in_group("reduce_scatter", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    C.check_complex_op(red, [out], "reduce_scatter")
    C.check_bitwise_dtype(red, [out], "reduce_scatter")
    pg = _resolve(group)
    C.check_list_len(ins, pg.size(), "reduce_scatter", "input tensor list")
    C.check_own_entry(ins, pg.rank(), out, "reduce_scatter", "input_list")
    opts = _set_async(ReduceScatterOptions(reduceOp=red), async_op)
    return _finish(pg.reduce_scatter([C.real_view(out)], [C.real_views(ins)], opts), async_op)


@C.meta_noop
def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``input`` is ``size`` blocks (concatenated along dim 0, or stacked); rank r's
    ``output`` is the reduction over ranks of block r.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError, ValueError: as ``all_reduce``; different dtypes.
        CollectiveArgumentError: ``input`` is not ``size`` blocks of ``output``'s shape.
    """
    out = C.as_tensor(output, "output")
    C.check_written(out, "reduce_scatter_single", "output")
    inp = C.as_tensor(input, "input")
    if _not_member(group):
        warn_not_in_group("reduce_scatter_single", _global_rank_or_minus_one())
        return None
    C.ensure_same_dtype(out, inp)
    red = _red_op(op)
    C.check_complex_op(red, [out], "reduce_scatter")
    C.check_bitwise_dtype(red, [out], "reduce_scatter")
    pg = _resolve(group)
    C.check_reduce_scatter_single(out, inp, pg.size(), "reduce_scatter_tensor")
    opts = _set_async(ReduceScatterOptions(reduceOp=red), async_op)
    return _finish_coalesced(pg, pg._reduce_scatter_base(C.real_view(out), C.real_view(inp), opts), async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter_single`` under its older name (deprecated in torch 2.13, with its warning)."""
    _deprecated("reduce_scatter_tensor", "reduce_scatter_single")
    return reduce_scatter_single(output, input, op, group, async_op)


def _reduce_scatter_base(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter_single`` under torch's private name."""
    warnings.warn(
        "`torch.distributed._reduce_scatter_base` is a private function and will be deprecated. "
        "Please use `torch.distributed.reduce_scatter_single` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return reduce_scatter_single(output, input, op, group, async_op)


@C.meta_noop
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``input_tensor_list[r]`` goes to rank r, which receives it in its
    ``output_tensor_list[me]``; sizes may differ per pair (tdist; gloo rejects that).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not lists of tensors.
        ValueError: mixed dtypes.
        CollectiveArgumentError: a list without one entry per rank.
    """
    if _not_member(group):
        warn_not_in_group("all_to_all", _global_rank_or_minus_one())
        return None
    outs = C.as_tensor_list(output_tensor_list, "output_tensor_list")
    C.check_written(outs, "all_to_all", "output_tensor_list")
    ins = C.as_tensor_list(input_tensor_list, "input_tensor_list")
    C.ensure_same_dtype(outs, ins)
    pg = _resolve(group)
    C.check_list_len(outs, pg.size(), "all_to_all", "output tensor list")
    C.check_list_len(ins, pg.size(), "all_to_all", "input tensor list")
    opts = _set_async(AllToAllOptions(), async_op)
    return _finish(pg.alltoall(C.real_views(outs), C.real_views(ins), opts), async_op)


@C.meta_noop
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0 (by ``input_split_sizes``, or equally), send part r to rank
    r, and concatenate what arrives into ``output`` (split by ``output_split_sizes``).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: different dtypes.
        CollectiveArgumentError: split sizes that do not fit dim 0 or the group.
    """
    if _not_member(group):
        warn_not_in_group("all_to_all_single", _global_rank_or_minus_one())
        return None
    out = C.as_tensor(output, "output")
    C.check_written(out, "all_to_all_single", "output")
    inp = C.as_tensor(input, "input")
    C.ensure_same_dtype(out, inp)
    pg = _resolve(group)
    out_splits = C.check_split_sizes(out, output_split_sizes, pg.size(), "all_to_all_single", "output")
    in_splits = C.check_split_sizes(inp, input_split_sizes, pg.size(), "all_to_all_single", "input")
    opts = _set_async(AllToAllOptions(), async_op)
    work = pg.alltoall_base(C.real_view(out), C.real_view(inp), out_splits, in_splits, opts)
    return _finish(work, async_op)


def barrier(
    group: GroupArg = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: timedelta | None = None,
) -> Work | None:
    """Wait until every rank of ``group`` has called ``barrier``.

    Args:
        group: the group (default: the default group).
        async_op: return a ``Work`` instead of waiting.
        device_ids: accepted for compatibility (CPU only).
        timeout: this barrier's deadline (default: the group's).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    if _not_member(group):
        warn_not_in_group("barrier", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    opts = BarrierOptions()
    if timeout is not None:
        opts.timeout = _check_valid_timeout(timeout)
    if isinstance(device_ids, list):
        opts.device_ids = device_ids
    return _finish(pg.barrier(_set_async(opts, async_op)), async_op)


def monitored_barrier(
    group: GroupArg = None,
    timeout: timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 waits for every other rank; on failure it raises ``"[Rank 0]: Rank 1 failed to
    pass monitoredBarrier in 1000 ms"`` (with ``wait_all_ranks``, ``"Ranks 1, 2 failed ..."``),
    as torch does, and tells the ranks that did arrive, which raise the same verdict.

    Args:
        group: the group (default: the default group).
        timeout: a ``timedelta`` (a float is taken as seconds, with torch's warning); default:
            the group's timeout.
        wait_all_ranks: collect every missing rank instead of failing at the first.

    A group of ``torch.distributed`` on the ``tdist`` backend is served too: torch's own
    ``monitored_barrier`` refuses every backend but gloo by name.

    Raises:
        DistBackendError: ranks did not arrive in time.
        TypeError: ``timeout`` is neither a ``timedelta`` nor a float.
    """
    if _from_torch(group) is None and isinstance(group, torch.distributed.ProcessGroup):
        if isinstance(timeout, float | int):
            timeout = timedelta(seconds=timeout)
        group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)  # (None: the group's own)
        return
    if _not_member(group):
        warn_not_in_group("monitored_barrier", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    if isinstance(timeout, float):
        warnings.warn(
            "Please specify timeout arg as a timedelta. "
            f"Converting current value of {timeout} assuming it represents seconds",
            stacklevel=2,
        )
        timeout = timedelta(seconds=timeout)
    if timeout is not None:
        _check_valid_timeout(timeout)
    pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
