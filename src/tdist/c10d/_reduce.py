"""Element-wise reductions on torch tensors, shared by the backends and the API layer."""

from __future__ import annotations

import torch

from ._types import RedOpType

__all__ = ["reduce_into"]


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: RedOpType) -> None:
    """``dst = op(dst, src)`` element-wise, in place (AVG reduces as SUM)."""
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
        torch.minimum(dst, src, out=dst)
    elif op == RedOpType.MAX:
        torch.maximum(dst, src, out=dst)
    elif op == RedOpType.BAND:
        dst.bitwise_and_(src)
    elif op == RedOpType.BOR:
        dst.bitwise_or_(src)
    elif op == RedOpType.BXOR:
        dst.bitwise_xor_(src)
    else:
        raise ValueError(f"unsupported reduction {op!r}")
