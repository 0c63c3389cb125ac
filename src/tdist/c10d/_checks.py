"""Argument checks of the module-level API: pure functions, no process group, no I/O.

Each check raises torch's error type with torch's message where torch's Python layer raises one
(``TypeError`` for a non-tensor, ``ValueError`` for mixed dtypes or a misplaced ``gather_list``),
and a ``CollectiveArgumentError`` where torch leaves the check to gloo, which raises a bare
``RuntimeError`` (a root rank out of range, a list of the wrong length, sizes that do not add
up). ``CollectiveArgumentError`` is both a ``RuntimeError`` (what torch users catch) and a
``ValueError`` (what it is), and its messages name the operation, the argument and the value.

numpy arrays are accepted wherever a tensor is: ``as_tensor`` wraps them with
``torch.from_numpy``, which shares memory, so results written into the tensor land in the array.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from .._core.errors import DistBackendError
from ._shm._tensors import overlaps
from ._types import RedOpType, Work

__all__ = [
    "CollectiveArgumentError",
    "as_tensor",
    "as_tensor_list",
    "check_all_gather_single",
    "check_bitwise_dtype",
    "check_list_len",
    "check_not_self_rank",
    "check_own_entry",
    "check_reduce_scatter_single",
    "check_root_rank",
    "check_rooted_list",
    "check_split_sizes",
    "check_tag",
    "check_written",
    "ensure_same_dtype",
    "real_view",
    "real_views",
    "supports_complex",
]


class CollectiveArgumentError(DistBackendError, ValueError):
    """An argument a collective cannot work with (where torch's gloo raises ``RuntimeError``)."""


def _is_numpy(obj: object) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def as_tensor(param: object, param_name: str) -> torch.Tensor:
    """``param`` as a tensor: a tensor as is, a numpy array as a tensor sharing its memory.

    Raises:
        TypeError: anything else (torch's message).
        ValueError: a numpy array torch cannot view (negative strides, read-only).
    """
    if isinstance(param, torch.Tensor):
        if param.layout is not torch.strided or not param.is_cpu:
            dense_cpu(_caller(), [param])
        return param
    if _is_numpy(param):
        arr: Any = param
        if not arr.flags.writeable:
            # from_numpy warns and shares read-only memory that a collective would write into
            arr_desc = f"a read-only numpy array (shape {arr.shape}, dtype {arr.dtype})"
            raise ValueError(
                f"Invalid function argument. Parameter `{param_name}` is {arr_desc}; pass a "
                "writable array (np.require(a, requirements='W')) or a tensor"
            )
        try:
            return torch.from_numpy(arr)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"Invalid function argument. Parameter `{param_name}` is a numpy array that torch "
                f"cannot share ({exc}); pass np.ascontiguousarray(a) or a tensor"
            ) from exc
    raise TypeError(
        f"Invalid function argument. Expected parameter `{param_name}` of type torch.Tensor\n"
        f"             but got {type(param)} instead."
    )


def as_tensor_list(param: object, param_name: str) -> list[torch.Tensor]:
    """``param`` as a list of tensors (numpy arrays wrapped); the list itself must be a list.

    Raises:
        TypeError: not a list, or an element that is neither a tensor nor a numpy array.
    """
    if not isinstance(param, list):
        raise TypeError(
            f"Invalid function argument. Expected parameter `{param_name}` of type "
            f"List[torch.Tensor]\n             but got {type(param)} instead."
        )
    if not all(isinstance(p, torch.Tensor) or _is_numpy(p) for p in param):
        raise TypeError(
            f"Invalid function argument. Expected parameter `{param_name}` of type "
            f"List[torch.Tensor]\n             but got {type(param)} with elements of type "
            f"{[type(p) for p in param]}."
        )
    return [as_tensor(p, param_name) for p in param]


class OnMeta(DistBackendError):
    """A tensor on the meta device reached a collective (raised by ``as_tensor`` before
    anything is sent; ``meta_noop`` turns it into torch's no-op)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _meta_result(name: str, kwargs: dict[str, Any]) -> Any:
    """What a public collective ``name`` returns on meta tensors: ``None``, a completed
    ``Work`` where one is asked for (``async_op``, ``isend``, ``irecv``), -1 for ``recv``'s
    sender."""
    if name in ("isend", "irecv") or kwargs.get("async_op"):
        return Work.completed([], name)
    return -1 if name == "recv" else None


def meta_noop(fn: _F, result: Callable[[str, dict[str, Any]], Any] = _meta_result) -> _F:
    """``fn``, doing nothing on tensors on the meta device, as torch's meta kernels of the
    collectives (a model not yet materialised, FSDP's deferred init): where ``OnMeta`` is
    raised (before anything is sent, so the ranks stay in step) it returns ``result(name of
    fn, its keyword arguments)``."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OnMeta:
            return result(name, kwargs)

    return wrapper  # type: ignore[return-value]


def _caller() -> str:
    """The public function (``all_reduce``...) that called ``as_tensor``, for an error."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_name in ("as_tensor", "as_tensor_list", "<listcomp>", "_caller"):
        frame = frame.f_back
    return frame.f_code.co_name


def _as_iterable(obj: torch.Tensor | Sequence[torch.Tensor]) -> Iterable[torch.Tensor]:
    return obj if isinstance(obj, (list, tuple)) else (obj,)


def ensure_same_dtype(*tensors: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """All tensors share one dtype (a complex tensor matches its real element type), as torch.

    Raises:
        CollectiveArgumentError: torch's message, naming the two dtypes (a ``ValueError``, as
            torch's Python check raises, and a ``RuntimeError``, as gloo's check raises).
    """
    last: torch.dtype | None = None
    for tensor in itertools.chain.from_iterable(map(_as_iterable, tensors)):
        dtype = tensor.dtype
        if dtype.is_complex:
            dtype = torch.float32 if dtype == torch.complex64 else torch.complex128
        if last is None:
            last = dtype
        elif last != dtype:
            raise CollectiveArgumentError(
                f"Invalid usage of tensors with different dtypesFound {last} and  {tensor.dtype}"
            )


def supports_complex(reduceOp: RedOpType) -> bool:  # torch spells the parameter so
    """Whether ``reduceOp`` is meaningful on complex tensors viewed as pairs of reals (torch's rule)."""
    return reduceOp not in (
        RedOpType.MAX,
        RedOpType.MIN,
        RedOpType.PRODUCT,
        RedOpType.BAND,
        RedOpType.BOR,
        RedOpType.BXOR,
    )


def real_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as reals (``view_as_real``, same memory); any other as is."""
    return torch.view_as_real(t) if t.is_complex() else t


def real_views(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [real_view(t) for t in ts]


def check_complex_op(op: RedOpType, tensors: Sequence[torch.Tensor], what: str) -> None:
    """Raises ``CollectiveArgumentError`` (torch's message) for an op that is garbage on
    complex values: the ``ValueError`` torch's ``all_reduce`` raises and the ``RuntimeError``
    gloo raises for the other reductions."""
    if any(t.is_complex() for t in tensors) and not supports_complex(op):
        raise CollectiveArgumentError(f"{what} does not support {op} on complex tensors")


def check_bitwise_dtype(op: RedOpType, tensors: Sequence[torch.Tensor], what: str) -> None:
    """BAND/BOR/BXOR need integral (or bool) tensors, as gloo.

    Raises:
        CollectiveArgumentError: gloo's message, with the operation and the dtype.
    """
    if op not in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        return
    for t in tensors:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            raise CollectiveArgumentError(
                f"{what}: Cannot use ReduceOp.{op.name} with non-integral dtype ({t.dtype})"
            )


def check_int(value: object, what: str) -> int:
    if type(value) is int:  # (the common case, before the slower checks)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}: {value!r}")
    return int(value)


def check_tag(tag: object) -> int:
    """Tags are ints (torch's bindings reject anything else with a ``TypeError``)."""
    return check_int(tag, "tag")


def check_root_rank(group_rank: int, size: int, what: str, name: str) -> None:
    """A root (``src``/``dst``) is a rank of the group.

    Raises:
        CollectiveArgumentError: ``"broadcast: invalid root rank: 5 ..."`` (gloo's words first).
    """
    if not 0 <= group_rank < size:
        raise CollectiveArgumentError(
            f"{what}: invalid root rank: {group_rank} ({name} must be a rank of the group, "
            f"0 to {size - 1})"
        )


def check_peer_rank(group_rank: int, size: int, what: str, name: str) -> None:
    """A point-to-point peer is a rank of the group.

    Raises:
        CollectiveArgumentError: naming the argument and the valid range.
    """
    if not 0 <= group_rank < size:
        raise CollectiveArgumentError(
            f"{what}: invalid {name} rank {group_rank}: the group has ranks 0 to {size - 1}"
        )


def check_not_self_rank(my_rank: int, rank: int, rank_type: str) -> None:
    """``send``/``recv`` to or from oneself would never complete (torch's message).

    Raises:
        CollectiveArgumentError: ``"Invalid destination rank: destination rank should not be
            ..."``; a ``ValueError`` as torch's ``send`` raises, and a ``RuntimeError`` as
            torch's ``recv`` (whose gloo pair to itself is not connected) raises.
    """
    if my_rank == rank:
        raise CollectiveArgumentError(
            f"Invalid {rank_type} rank: {rank_type} rank should not be the same as "
            "the rank of the current process."
        )


def check_list_len(items: Sequence[object], size: int, what: str, name: str) -> None:
    """A per-rank list has one entry per rank of the group.

    Raises:
        CollectiveArgumentError: naming the list, its length and the group size.
    """
    if len(items) != size:
        raise CollectiveArgumentError(
            f"{what}: invalid {name} size {len(items)}: it must hold one tensor per rank "
            f"of the group ({size})"
        )


def check_rooted_list(
    my_rank: int, root: int, items: Sequence[object] | None, what: str, name: str, size: int,
    root_implied: bool = False,
) -> None:
    """A list given on the root only (``gather_list``, ``scatter_list``), of the group's size.
    ``root_implied``: the caller gave no root (``dst``/``src``), so it is rank 0.

    Raises:
        ValueError: the list is missing on the root or given elsewhere (torch's messages; where
            the root was implied, followed by how torch 0.3, which took a rank that gave the
            list for the root, differs).
        CollectiveArgumentError: wrong length on the root.
    """
    role = "destination" if what == "gather" else "source"
    arg = "dst" if what == "gather" else "src"
    hint = (
        f" ({arg} was not given, so the {role} is rank 0, as in torch 2; torch 0.3's {what} took "
        f"the rank that gives {name} for the {role}: pass {arg}= on every rank)"
        if root_implied else ""
    )
    if my_rank == root:
        if not items:
            raise ValueError(f"Argument ``{name}`` must be specified on {role} rank.{hint}")
        check_list_len(items, size, what, name)
    elif items:
        raise ValueError(f"Argument ``{name}`` must NOT be specified on non-{role} ranks.{hint}")


def check_same_numel(tensors: Sequence[torch.Tensor], ref: torch.Tensor, what: str, name: str) -> None:
    """Every tensor of ``tensors`` has the shape of ``ref`` (gather/scatter/reduce_scatter)."""
    for i, t in enumerate(tensors):
        if t.shape != ref.shape:
            raise CollectiveArgumentError(
                f"{what}: invalid tensor size at index {i} of {name} (expected "
                f"{tuple(ref.shape)}, got {tuple(t.shape)})"
            )


def check_own_entry(
    tensors: Sequence[torch.Tensor], rank: int, ref: torch.Tensor, what: str, name: str
) -> None:
    """This rank's entry of a per-rank list has the shape of ``ref`` (``reduce_scatter``: the
    other entries may have other sizes, each that of its rank's output, as gloo's; the
    backends check them across ranks).

    Raises:
        CollectiveArgumentError: naming the index, the expected and the given shape.
    """
    t = tensors[rank]
    if t.shape != ref.shape:
        raise CollectiveArgumentError(
            f"{what}: invalid tensor size at index {rank} of {name} (this rank's entry must have "
            f"the output's shape {tuple(ref.shape)}, got {tuple(t.shape)})"
        )


def check_all_gather_single(output: torch.Tensor, input: torch.Tensor, size: int, what: str) -> None:
    """``output`` is ``size`` inputs concatenated (``size * n, ...``) or stacked (``size, ...``).

    Raises:
        CollectiveArgumentError: the output's shape is neither.
    """
    _check_cat_or_stack(output, input, size, what, "output", "input")


def check_reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, size: int, what: str) -> None:
    """``input`` is ``size`` outputs concatenated or stacked.

    Raises:
        CollectiveArgumentError: the input's shape is neither.
    """
    _check_cat_or_stack(input, output, size, what, "input", "output")


def _check_cat_or_stack(
    big: torch.Tensor, small: torch.Tensor, size: int, what: str, big_name: str, small_name: str
) -> None:
    shape = tuple(small.shape)
    stacked = (size, *shape)
    if shape:
        concatenated: tuple[int, ...] = (size * shape[0], *shape[1:])
    else:
        concatenated = (size,)
    if tuple(big.shape) not in (stacked, concatenated):
        raise CollectiveArgumentError(
            f"{what}: {big_name} tensor size must be equal to world_size times {small_name} tensor "
            f"size: {small_name} is {tuple(small.shape)} and the group has {size} ranks, so "
            f"{big_name} must be {concatenated} (concatenated) or {stacked} (stacked), got "
            f"{tuple(big.shape)}"
        )


def check_split_sizes(
    tensor: torch.Tensor, split_sizes: Sequence[int] | None, size: int, what: str, name: str
) -> list[int]:
    """The dim-0 split of ``tensor`` for ``all_to_all_single``: given sizes, or equal parts.

    Returns:
        The split sizes, one per rank.

    Raises:
        CollectiveArgumentError: wrong count, negative sizes, a sum other than dim 0, or an
            even split of a dim 0 the group size does not divide.
    """
    rows = tensor.shape[0] if tensor.dim() > 0 else tensor.numel()
    if isinstance(split_sizes, torch.Tensor):  # (torch's bindings take no tensor there either)
        raise TypeError(f"{what}: {name}_split_sizes must be a list of ints, not a tensor")
    if not split_sizes:
        if tensor.numel() == 0:  # (nothing travels: any split will do, as torch's)
            return [rows // size] * (size - 1) + [rows - rows // size * (size - 1)]
        if rows % size != 0:
            raise CollectiveArgumentError(
                f"{what}: dim 0 of {name} ({rows}) is not divisible by the group size ({size}); "
                f"pass {name}_split_sizes for an uneven split"
            )
        return [rows // size] * size
    sizes = [check_int(s, f"{what}: {name}_split_sizes entries") for s in split_sizes]
    if len(sizes) != size:
        raise CollectiveArgumentError(
            f"{what}: Number of tensor splits not equal to group size: {name}_split_sizes has "
            f"{len(sizes)} entries, but the group has {size} ranks"
        )
    if any(s < 0 for s in sizes):
        raise CollectiveArgumentError(f"{what}: {name}_split_sizes must not be negative, got {sizes}")
    if sum(sizes) != rows:
        raise CollectiveArgumentError(
            f"{what}: Split sizes doesn't match total dim 0 size: {name}_split_sizes {sizes} "
            f"add up to {sum(sizes)}, but dim 0 of {name} is {rows}"
        )
    return sizes


def check_written(tensors: torch.Tensor | Sequence[torch.Tensor], what: str, name: str) -> None:
    """Where a collective writes each rank's own data, no two elements of ``name`` may share
    memory (an expanded tensor), as torch's ``copy_`` refuses; refused here before anything
    is sent, so that no rank goes on alone.

    Raises:
        CollectiveArgumentError: torch's words, with the operation and the argument.
    """
    for t in _as_iterable(tensors):
        if not t.is_contiguous() and overlaps(t):
            raise CollectiveArgumentError(
                f"{what}: unsupported operation: more than one element of the written-to tensor "
                f"refers to a single memory location ({name}: shape {tuple(t.shape)}, stride "
                f"{t.stride()}). Please clone() the tensor before performing the operation."
            )


def dense_cpu(op: str, *tensor_lists: Sequence[torch.Tensor]) -> None:
    """Refuse, before any rank sends a byte, what tdist's backends cannot serve: a tensor off
    the CPU (``RuntimeError``, torch's type for a device with no backend), or a sparse one
    (``NotImplementedError``, as gloo, which reduces sparse tensors in ``all_reduce`` only).
    A tensor on the meta device raises ``OnMeta``, which ``meta_noop`` turns into nothing."""
    for tensors in tensor_lists:
        for t in tensors:
            if t.device.type != "cpu":
                if t.is_meta:
                    raise OnMeta(f"{op}: a tensor on the meta device")
                raise RuntimeError(
                    f"tdist: {op} got a tensor on {t.device}; tdist serves CPU tensors only. Move "
                    "it with .cpu(), or give that device a backend of its own "
                    '(backend="cpu:tdist,cuda:nccl")'
                )
            if t.layout != torch.strided:
                raise NotImplementedError(
                    f"tdist: {op} does not take {t.layout} tensors (as gloo, only all_reduce "
                    "does, with ReduceOp.SUM); send .to_dense(), or the indices() and values()"
                )
