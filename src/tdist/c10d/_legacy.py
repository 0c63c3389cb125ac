"""Deprecated and multi-device forms: ``all_reduce_coalesced``, ``all_gather_coalesced``, the
``*_multigpu`` functions of older torch, and torch 0.3's names (``dist_backend``,
``_clear_group_cache``, ``_register_stream``).

The ``*_multigpu`` functions (removed from torch 2.x) work on lists of tensors on one rank:
they reduce or copy locally and run one collective per list position.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from . import _checks as C
from ._collectives import (
    _finish,
    _red_op,
    _set_async,
    all_gather,
    all_reduce,
    broadcast,
    reduce,
    reduce_scatter,
)
from ._group import chain_work, warn_not_in_group
from ._reduce import reduce_into
from ._types import AllgatherOptions, AllreduceOptions, RedOpType, ReduceOp, Work
from ._world import (
    GroupArg,
    _global_rank_or_minus_one,
    _not_member,
    _resolve,
    _to_global,
    is_initialized,
)

__all__ = [
    "AllreduceCoalescedOptions",
    "all_gather_coalesced",
    "all_gather_multigpu",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "broadcast_multigpu",
    "dist_backend",
    "reduce_multigpu",
    "reduce_scatter_multigpu",
]


class AllreduceCoalescedOptions(AllreduceOptions):
    """Options of ``allreduce_coalesced`` (torch's record type)."""


def all_reduce_coalesced(
    tensors: torch.Tensor | list[torch.Tensor],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Any:
    """All-reduce several tensors of one dtype in one exchange (deprecated in torch).

    Returns:
        A ``torch.futures.Future`` if ``async_op`` (as torch), else ``None``.
    """
    warnings.warn(
        "`torch.distributed.all_reduce_coalesced` will be deprecated. If you must use it, please "
        "revisit our documentation later at "
        "https://pytorch.org/docs/main/distributed.html#collective-functions",
        FutureWarning,
        stacklevel=2,
    )
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    ts = C.as_tensor_list(tensors, "tensor")
    C.ensure_same_dtype(ts)
    if _not_member(group):
        warn_not_in_group("all_reduce_coalesced", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    C.check_complex_op(red, ts, "all_reduce")
    C.check_bitwise_dtype(red, ts, "all_reduce")
    pg = _resolve(group)
    opts = _set_async(AllreduceCoalescedOptions(reduceOp=red), async_op)
    work = pg.allreduce_coalesced(C.real_views(ts), opts)
    if async_op:
        return work.get_future()
    work.wait()
    return None


def _check_coalesced_slots(outs: list[list[torch.Tensor]], ins: list[torch.Tensor], size: int) -> None:
    """Every rank's list of slots matches the inputs, one by one, in shape and dtype (gloo's
    checks, in its order and words, each with the rest of tdist's account).

    Raises:
        CollectiveArgumentError: the first slot that does not.
    """
    what = "all_gather_coalesced"
    if len(outs) != size:
        raise C.CollectiveArgumentError(
            f"{what}: output lists should be equal to world size (got {len(outs)} lists of output_tensor_lists for a "
            f"group of {size} ranks)"
        )
    for r, lst in enumerate(outs):
        if len(lst) != len(ins):
            raise C.CollectiveArgumentError(
                f"{what}: invalid output size: (expected length {len(ins)}, got {len(lst)}) in the list of rank {r}"
            )
        for i, (t, x) in enumerate(zip(lst, ins, strict=True)):
            if t.shape != x.shape:
                raise C.CollectiveArgumentError(
                    f"{what}: invalid size of output tensor at index {i} (expected length {tuple(x.shape)}, got "
                    f"{tuple(t.shape)}) in the list of rank {r}"
                )
            if t.dtype != x.dtype:
                raise C.CollectiveArgumentError(
                    f"{what}: invalid tensor type at index {i} (expected {x.dtype}, got {t.dtype}) in the list of rank {r}"
                )


def all_gather_coalesced(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: GroupArg = None,
    async_op: bool = False,
) -> Any:
    """``output_tensor_lists[r][i]`` receives rank r's ``input_tensor_list[i]`` (deprecated in
    torch).

    Returns:
        A ``torch.futures.Future`` if ``async_op`` (as torch), else ``None``.
    """
    warnings.warn(
        "`torch.distributed.all_gather_coalesced` will be deprecated. If you must use it, please "
        "revisit our documentation later at "
        "https://pytorch.org/docs/main/distributed.html#collective-functions",
        FutureWarning,
        stacklevel=2,
    )
    if _not_member(group):
        warn_not_in_group("all_gather_coalesced", _global_rank_or_minus_one())
        return None
    ins = C.as_tensor_list(input_tensor_list, "input_tensor_list")
    C.ensure_same_dtype(ins)
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    outs = [C.as_tensor_list(lst, "output_tensor_lists") for lst in output_tensor_lists]
    for lst in outs:
        C.ensure_same_dtype(lst)
    pg = _resolve(group)
    _check_coalesced_slots(outs, ins, pg.size())
    opts = _set_async(AllgatherOptions(), async_op)
    work = pg.allgather_coalesced([C.real_views(lst) for lst in outs], C.real_views(ins), opts)
    if async_op:
        return work.get_future()
    work.wait()
    return None


def _local_reduce(tensors: Sequence[torch.Tensor], op: RedOpType) -> torch.Tensor:
    """The element-wise reduction of ``tensors`` on this rank (a new tensor); AVG is the mean."""
    acc = tensors[0].detach().clone()
    for t in tensors[1:]:
        reduce_into(acc, t, op)
    if op == RedOpType.AVG and len(tensors) > 1:
        acc.div_(len(tensors))
    return acc


def _copy_out(work: Work, src: torch.Tensor, dsts: Sequence[torch.Tensor], op: str, async_op: bool) -> Work | None:
    def finish() -> list[torch.Tensor]:
        for d in dsts:
            if d is not src:
                d.detach().copy_(src)
        return list(dsts)

    return _finish(chain_work([work], op, finish), async_op)


@C.meta_noop
def all_reduce_multigpu(
    tensor_list: list[torch.Tensor],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """All-reduce over every tensor of ``tensor_list`` on every rank; each receives the result.

    Every rank passes the same number of tensors (any device, CPU included).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ts = C.as_tensor_list(tensor_list, "tensor_list")
    if not ts:
        raise ValueError("all_reduce_multigpu: tensor_list is empty")
    C.ensure_same_dtype(ts)
    if _not_member(group):
        warn_not_in_group("all_reduce_multigpu", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    local = _local_reduce(ts, red)
    work = all_reduce(local, red, group, async_op=True)
    assert work is not None
    return _copy_out(work, local, ts, "all_reduce_multigpu", async_op)


@C.meta_noop
def broadcast_multigpu(
    tensor_list: list[torch.Tensor],
    src: int,
    group: GroupArg = None,
    async_op: bool = False,
    src_tensor: int = 0,
) -> Work | None:
    """Copy ``tensor_list[src_tensor]`` of rank ``src`` into every tensor of every rank.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ts = C.as_tensor_list(tensor_list, "tensor_list")
    if not 0 <= src_tensor < len(ts):
        raise ValueError(f"broadcast_multigpu: src_tensor {src_tensor} is not an index of tensor_list")
    if _not_member(group):
        warn_not_in_group("broadcast_multigpu", _global_rank_or_minus_one())
        return None
    lead = ts[src_tensor]
    work = broadcast(lead, src, group, async_op=True)
    assert work is not None
    return _copy_out(work, lead, ts, "broadcast_multigpu", async_op)


@C.meta_noop
def reduce_multigpu(
    tensor_list: list[torch.Tensor],
    dst: int,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
    dst_tensor: int = 0,
) -> Work | None:
    """Reduce every tensor of every rank into ``tensor_list[dst_tensor]`` of rank ``dst``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ts = C.as_tensor_list(tensor_list, "tensor_list")
    if not 0 <= dst_tensor < len(ts):
        raise ValueError(f"reduce_multigpu: dst_tensor {dst_tensor} is not an index of tensor_list")
    C.ensure_same_dtype(ts)
    if _not_member(group):
        warn_not_in_group("reduce_multigpu", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    local = _local_reduce(ts, red)
    work = reduce(local, dst, red, group, async_op=True)
    assert work is not None
    pg = _resolve(group)
    is_root = _to_global(pg, pg.rank()) == dst
    return _copy_out(work, local, [ts[dst_tensor]] if is_root else [], "reduce_multigpu", async_op)


@C.meta_noop
def all_gather_multigpu(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Every ``output_tensor_lists[i]`` receives, at ``r * k + j``, rank r's
    ``input_tensor_list[j]`` (``k`` tensors per rank).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ins = C.as_tensor_list(input_tensor_list, "input_tensor_list")
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    outs = [C.as_tensor_list(lst, "output_tensor_lists") for lst in output_tensor_lists]
    if _not_member(group):
        warn_not_in_group("all_gather_multigpu", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    k, size = len(ins), pg.size()
    if len(outs) != k or any(len(lst) != k * size for lst in outs):
        raise C.CollectiveArgumentError(
            f"all_gather_multigpu: expected {k} output lists (one per input tensor) of "
            f"{k * size} tensors (inputs per rank x group size), got {[len(x) for x in outs]}"
        )
    if k == 0:
        return _finish(Work.completed([], "all_gather_multigpu"), async_op)
    works = []
    for j in range(k):
        target = [outs[0][r * k + j] for r in range(size)]
        w = all_gather(target, ins[j], group, async_op=True)
        assert w is not None
        works.append(w)

    def finish() -> list[torch.Tensor]:
        for lst in outs[1:]:
            for d, s in zip(lst, outs[0], strict=True):
                d.detach().copy_(s)
        return [t for lst in outs for t in lst]

    return _finish(chain_work(works, "all_gather_multigpu", finish), async_op)


@C.meta_noop
def reduce_scatter_multigpu(
    output_tensor_list: list[torch.Tensor],
    input_tensor_lists: list[list[torch.Tensor]],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_list[j]`` of rank r receives the reduction over every rank and every
    ``i`` of ``input_tensor_lists[i][r * k + j]`` (``k`` tensors per rank).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    outs = C.as_tensor_list(output_tensor_list, "output_tensor_list")
    if not isinstance(input_tensor_lists, list):
        raise TypeError("Invalid function argument: input_tensor_lists should be a list")
    ins = [C.as_tensor_list(lst, "input_tensor_lists") for lst in input_tensor_lists]
    if _not_member(group):
        warn_not_in_group("reduce_scatter_multigpu", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    pg = _resolve(group)
    k, size = len(outs), pg.size()
    if len(ins) != k or any(len(lst) != k * size for lst in ins):
        raise C.CollectiveArgumentError(
            f"reduce_scatter_multigpu: expected {k} input lists (one per output tensor) of "
            f"{k * size} tensors (outputs per rank x group size), got {[len(x) for x in ins]}"
        )
    if k == 0:
        return _finish(Work.completed([], "reduce_scatter_multigpu"), async_op)
    local = [_local_reduce([lst[c] for lst in ins], red) for c in range(k * size)]
    works = []
    for j in range(k):
        w = reduce_scatter(outs[j], [local[r * k + j] for r in range(size)], red, group, async_op=True)
        assert w is not None
        works.append(w)
    return _finish(chain_work(works, "reduce_scatter_multigpu", lambda: list(outs)), async_op)


# -- torch 0.3's names ---------------------------------------------------------------------------
class dist_backend:
    """torch 0.3's backend numbers (``torch.distributed.dist_backend``); tdist's ``tcp`` is
    ``TCP`` (and serves ``"gloo"``)."""

    UNDEFINED = -1
    TCP = 0
    MPI = 1
    GLOO = 2
    NCCL = 3


def _clear_group_cache(group: GroupArg = None) -> None:
    """torch 0.3's: free the NCCL communicators and CUDA events ``group`` cached. tdist's groups
    cache neither (CPU only), so there is nothing to free; the group is checked as every
    function checks it.

    Raises:
        ValueError: the default group is not initialized (``group`` left as the default).
    """
    if not _not_member(group):
        _resolve(group)


def _register_stream(stream: Any) -> None:
    """torch 0.3's: register a CUDA stream with the backend. A no-op in tdist, which drives CPU
    tensors only and has no streams to synchronize with.

    Raises:
        RuntimeError: neither a process group nor master-worker mode is initialized (torch
            0.3's check and words).
    """
    mw = sys.modules.get("tdist._master_worker")
    if not is_initialized() and getattr(mw, "_job", None) is None:
        raise RuntimeError("torch.distributed needs to be initialized first")
