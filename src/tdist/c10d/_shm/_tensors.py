"""The torch side of the arena: reduction kernels checked once per dtype, flat views of
the tensors a collective is given, and the check that they are dense CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._types import RedOpType

Reducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

_REDUCERS: dict[RedOpType, Reducer] = {
    RedOpType.SUM: lambda a, b, out: torch.add(a, b, out=out),
    RedOpType.AVG: lambda a, b, out: torch.add(a, b, out=out),
    RedOpType.PRODUCT: lambda a, b, out: torch.mul(a, b, out=out),
    RedOpType.MIN: lambda a, b, out: torch.minimum(a, b, out=out),
    RedOpType.MAX: lambda a, b, out: torch.maximum(a, b, out=out),
    RedOpType.BAND: lambda a, b, out: torch.bitwise_and(a, b, out=out),
    RedOpType.BOR: lambda a, b, out: torch.bitwise_or(a, b, out=out),
    RedOpType.BXOR: lambda a, b, out: torch.bitwise_xor(a, b, out=out),
}

_reducer_cache: dict[tuple[torch.dtype, RedOpType], Reducer | Exception] = {}


def _reducer(dtype: torch.dtype, op: RedOpType, what: str) -> Reducer:
    """The binary kernel for ``op`` on ``dtype``, checked once per pair on two elements.

    Raises:
        ValueError: ``op`` cannot reduce ``dtype`` (complex MIN/MAX, bitwise ops on floats,
            integer AVG, PREMUL_SUM, a dtype torch has no kernel for).
    """
    key = (dtype, op)
    cached = _reducer_cache.get(key)
    if cached is None:
        cached = _make_reducer(dtype, op)
        _reducer_cache[key] = cached
    if isinstance(cached, Exception):
        raise ValueError(f"{what}: {cached}")
    return cached


def _make_reducer(dtype: torch.dtype, op: RedOpType) -> Reducer | Exception:
    fn = _REDUCERS.get(op)
    if fn is None:
        return ValueError(f"the shared-memory arena does not support ReduceOp.{op.name}")
    if dtype.is_complex and op in (RedOpType.MIN, RedOpType.MAX):
        return ValueError(f"ReduceOp.{op.name} is not defined on complex tensors ({dtype})")
    if op in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) and (
        dtype.is_floating_point or dtype.is_complex
    ):
        return ValueError(f"ReduceOp.{op.name} needs an integer or bool tensor, got {dtype}")
    if op is RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        # gloo refuses AVG outright; NCCL truncates. Refusing is the least surprising.
        return ValueError(
            f"ReduceOp.AVG needs a floating-point or complex tensor, got {dtype} "
            "(use SUM and divide)"
        )
    try:
        a = torch.zeros(2, dtype=dtype)
        fn(a, a, torch.empty(2, dtype=dtype))
        if op is RedOpType.AVG:
            a.div_(2)
    except Exception as exc:  # torch has no kernel for this dtype
        return ValueError(f"cannot apply ReduceOp.{op.name} to {dtype}: {exc}")
    return fn


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view of ``t``'s elements in order, or a contiguous copy (then True: copy back,
    with ``copy_back``)."""
    if t.is_contiguous():
        return t.view(-1), False
    if overlaps(t):
        return t.reshape(-1).clone(), True
    try:
        return t.view(-1), False  # a strided 1-D view (x[::2], m[:, 1]) needs no copy
    except RuntimeError:
        return t.reshape(-1), True


def overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: an expanded tensor (stride 0), an
    ``unfold``ed or ``as_strided`` view whose rows overlap. (Sufficient, not necessary: the
    dims sorted by stride, each must step past all the memory of the dims below it.)"""
    if t.is_contiguous():  # (the usual case, at C speed: its elements are apart)
        return False
    extent = 1  # elements spanned by the dims taken so far
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride < extent:
            return True
        extent += stride * (n - 1)
    return False


def copy_back(dst: torch.Tensor, values: torch.Tensor) -> None:
    """``dst.copy_(values)`` for a result worked on in a contiguous copy, ``values`` holding
    ``dst``'s elements in order; also where elements of ``dst`` share memory (which
    ``copy_`` refuses): each memory location takes the value of one of the elements on it.
    For what ``all_reduce``, ``reduce`` and ``broadcast`` leave in a tensor, those elements
    agree (they were one value on every rank), as gloo's results do."""
    if not overlaps(dst):
        dst.copy_(values.view(dst.shape))
        return
    if dst.numel() == 0:
        return
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(dst.shape, dst.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(n) * stride
    offsets = offsets.reshape(-1)
    memory = dst.as_strided((int(offsets.max()) + 1,), (1,))
    memory.index_put_((offsets,), values.reshape(-1))


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu or t.layout != torch.strided:
        raise ValueError(
            f"{what}: the shared-memory arena takes dense CPU tensors, got {t.device} {t.layout}"
        )
    return t
