"""Element-wise reductions on torch tensors, shared by the backends and the API layer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import dense_cpu
from ._types import RedOpType

__all__ = ["reduce_into", "sparse_all_reduce"]


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: RedOpType, src_first: bool = False) -> None:
    """``dst = op(dst, src)`` element-wise, in place (AVG reduces as SUM); ``op(src, dst)`` with
    ``src_first``.

    The order matters for MIN and MAX alone, and only in bits: on a tie of +0.0 and -0.0, or of
    two NaNs, ``torch.maximum`` keeps its second operand. Two ranks that both combine the same
    two partial results (an exchange of a recursive-doubling all_reduce) end with the same bits
    only if both put the same one first: the lower ranks' (``src_first`` where ``src`` came
    from a lower rank)."""
    if op in (RedOpType.SUM, RedOpType.AVG):
        if dst.dtype == torch.bool:
            dst.logical_or_(src)
        else:
            dst.add_(src)
    elif op == RedOpType.PRODUCT:
        if dst.dtype == torch.bool:
            dst.logical_and_(src)
        else:
            dst.mul_(src)
    elif op == RedOpType.MIN:
        torch.minimum(*((src, dst) if src_first else (dst, src)), out=dst)
    elif op == RedOpType.MAX:
        torch.maximum(*((src, dst) if src_first else (dst, src)), out=dst)
    elif op == RedOpType.BAND:
        dst.bitwise_and_(src)
    elif op == RedOpType.BOR:
        dst.bitwise_or_(src)
    elif op == RedOpType.BXOR:
        dst.bitwise_xor_(src)
    else:
        raise ValueError(f"unsupported reduction {op!r}")


def sparse_all_reduce(
    t: torch.Tensor, op: object, size: int, all_gather: Callable[[list[torch.Tensor], torch.Tensor], object]
) -> None:
    """The sum of every rank's sparse COO tensor, into ``t`` (gloo's one sparse collective).

    The ranks exchange their entries (the counts, then indices and values padded to the
    largest count) through ``all_gather(outputs, input)`` and each adds them up.
    """
    if op != RedOpType.SUM:
        raise RuntimeError(f"tdist: all_reduce of a sparse tensor supports ReduceOp.SUM only, got {op}")
    mine = t.coalesce()
    dense_cpu("all_reduce", [mine.values()])
    idx, val = mine.indices(), mine.values()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    all_gather(counts, torch.tensor([idx.shape[1]]))
    k = [int(c) for c in counts]
    pad_i = torch.zeros(idx.shape[0], max(k), dtype=idx.dtype)
    pad_v = torch.zeros((max(k), *val.shape[1:]), dtype=val.dtype)
    pad_i[:, : idx.shape[1]] = idx
    pad_v[: val.shape[0]] = val
    all_i = [torch.empty_like(pad_i) for _ in range(size)]
    all_v = [torch.empty_like(pad_v) for _ in range(size)]
    all_gather(all_i, pad_i)
    all_gather(all_v, pad_v)
    total = torch.sparse_coo_tensor(
        torch.cat([i[:, :c] for i, c in zip(all_i, k, strict=True)], dim=1),
        torch.cat([v[:c] for v, c in zip(all_v, k, strict=True)]),
        t.shape,
        check_invariants=True,  # (indices from peers: out of bounds is an error, not a crash)
    ).coalesce()
    t.copy_(total)
