"""Python objects as byte tensors for the object collectives (``all_gather_object``, ...).

Objects are pickled with the standard pickler, as torch does, into a ``uint8`` tensor; the
receiving side is told the exact byte count first, so padding never reaches the unpickler.
Unpickling runs arbitrary code: the object collectives are for peers you trust, as in torch.

The object collectives themselves (``all_gather_object``, ``gather_object``,
``broadcast_object_list``, ``scatter_object_list``, ``send_object_list``, ``recv_object_list``)
run over the tensor collectives of ``_collectives`` and ``_p2p``: sizes first, then the bytes
(padded to the longest where the collective needs equal sizes). Where the backend sends objects
itself (``send_object``/``recv_object``), the point-to-point forms hand it the list.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from . import _checks as C
from ._collectives import all_gather, broadcast, gather, scatter
from ._group import warn_not_in_group
from ._p2p import recv, send
from ._world import (
    GroupArg,
    _check_non_member_root,
    _global_rank_or_minus_one,
    _group_rank,
    _not_member,
    _resolve,
    _to_global,
)

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "object_to_tensor",
    "objects_to_tensor",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
    "tensor_to_object",
    "tensor_to_objects",
]


def object_to_tensor(obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Pickle ``obj``.

    Returns:
        ``(bytes, size)``: a ``uint8`` tensor of the pickle and a one-element ``int64`` tensor
        holding its length.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled.
    """
    f = io.BytesIO()
    pickle.Pickler(f).dump(obj)
    data = bytearray(f.getbuffer())
    byte_tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return byte_tensor, torch.tensor([byte_tensor.numel()], dtype=torch.long)


def tensor_to_object(tensor: torch.Tensor, size: int | torch.Tensor) -> Any:
    """Unpickle the first ``size`` bytes of the ``uint8`` tensor ``tensor``."""
    n = int(size.item()) if isinstance(size, torch.Tensor) else int(size)
    flat = tensor.detach().reshape(-1)[:n].to(torch.uint8).contiguous().cpu()
    return pickle.Unpickler(io.BytesIO(flat.numpy().tobytes())).load()


def objects_to_tensor(objs: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pickle each object; returns the concatenated bytes and an ``int64`` tensor of sizes."""
    parts = [object_to_tensor(o) for o in objs]
    if not parts:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.long)
    data = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    return data, torch.cat([p[1] for p in parts])


def tensor_to_objects(data: torch.Tensor, sizes: torch.Tensor) -> list[Any]:
    """Split ``data`` by ``sizes`` and unpickle each piece (the inverse of ``objects_to_tensor``)."""
    out = []
    offset = 0
    for n in sizes.tolist():
        out.append(tensor_to_object(data[offset : offset + n], n))
        offset += n
    return out


# -- object collectives ----------------------------------------------------------------------------
def _short_list(what: str, name: str, have: int, need: int) -> IndexError:
    return IndexError(f"{what}: {name} has {have} entries, but the group has {need} ranks")


def all_gather_object(object_list: list[Any], obj: Any, group: GroupArg = None) -> None:
    """``object_list[r]`` receives rank r's ``obj`` (pickled; trust your peers).

    Raises:
        IndexError: ``object_list`` is shorter than the group (after the exchange, as torch).
    """
    if _not_member(group):
        warn_not_in_group("all_gather_object", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    data, size = object_to_tensor(obj)
    n = pg.size()
    sizes = torch.zeros(n, dtype=torch.long)
    all_gather([sizes[i : i + 1] for i in range(n)], size, group=pg)
    outputs = [torch.empty(int(s), dtype=torch.uint8) for s in sizes.tolist()]
    all_gather(outputs, data, group=pg)
    if len(object_list) < n:
        raise _short_list("all_gather_object", "object_list", len(object_list), n)
    for i, t in enumerate(outputs):
        object_list[i] = tensor_to_object(t, t.numel())


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: GroupArg = None,
    group_dst: int | None = None,
) -> None:
    """Rank ``dst`` (default global rank 0) receives every rank's ``obj`` in
    ``object_gather_list`` (given on ``dst`` only).

    Raises:
        ValueError: ``object_gather_list`` missing on ``dst`` or given elsewhere.
        IndexError: ``object_gather_list`` shorter than the group.
    """
    if dst is None and group_dst is None:
        dst = 0
    if _not_member(group):
        _check_non_member_root("gather_object", dst, group_dst)
        warn_not_in_group("gather_object", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    root = _group_rank(pg, dst, group_dst)
    C.check_root_rank(root, pg.size(), "gather_object", "dst")
    me, n = pg.rank(), pg.size()
    if me == root and not object_gather_list:
        raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
    if me != root and object_gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    data, size = object_to_tensor(obj)
    sizes = torch.zeros(n, dtype=torch.long)
    all_gather([sizes[i : i + 1] for i in range(n)], size, group=pg)
    longest = int(sizes.max().item())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    outputs = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)] if me == root else None
    gather(padded, gather_list=outputs, group=pg, group_dst=root)
    if me != root:
        return
    assert object_gather_list is not None and outputs is not None
    if len(object_gather_list) < n:
        raise _short_list("gather_object", "object_gather_list", len(object_gather_list), n)
    for i, t in enumerate(outputs):
        object_gather_list[i] = tensor_to_object(t, int(sizes[i]))


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: GroupArg = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list`` on every rank by rank ``src``'s (default global rank 0); every
    rank passes a list of the same length.
    """
    if src is None and group_src is None:
        src = 0
    if _not_member(group):
        _check_non_member_root("broadcast_object_list", src, group_src)
        warn_not_in_group("broadcast_object_list", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    root = _group_rank(pg, src, group_src)
    C.check_root_rank(root, pg.size(), "broadcast_object_list", "src")
    if pg.rank() == root:
        data, sizes = objects_to_tensor(object_list)
    else:
        sizes = torch.empty(len(object_list), dtype=torch.long)
    broadcast(sizes, group=pg, group_src=root)
    if pg.rank() != root:
        data = torch.empty(int(sizes.sum().item()), dtype=torch.uint8)
    broadcast(data, group=pg, group_src=root)
    if pg.rank() != root:
        for i, o in enumerate(tensor_to_objects(data, sizes)):
            object_list[i] = o


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: GroupArg = None,
    group_src: int | None = None,
) -> None:
    """``scatter_object_output_list[0]`` of rank r receives rank ``src``'s
    ``scatter_object_input_list[r]``.

    Raises:
        ValueError: the output list is empty, or the input list missing on ``src``.
    """
    if src is None and group_src is None:
        src = 0
    if _not_member(group):
        _check_non_member_root("scatter_object_list", src, group_src)
        warn_not_in_group("scatter_object_list", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    root = _group_rank(pg, src, group_src)
    C.check_root_rank(root, pg.size(), "scatter_object_list", "src")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    me, n = pg.rank(), pg.size()
    inputs: list[torch.Tensor] | None = None
    sizes: list[torch.Tensor] | None = None
    longest = torch.zeros(1, dtype=torch.long)
    if me == root:
        if scatter_object_input_list is None:
            raise ValueError("source rank must provide non-None scatter_object_input_list")
        C.check_list_len(scatter_object_input_list, n, "scatter_object_list", "scatter_object_input_list")
        pairs = [object_to_tensor(o) for o in scatter_object_input_list]
        longest[0] = max(int(p[1]) for p in pairs)
        inputs = []
        for data, _ in pairs:
            padded = torch.zeros(int(longest[0]), dtype=torch.uint8)
            padded[: data.numel()] = data
            inputs.append(padded)
        sizes = [p[1] for p in pairs]
    broadcast(longest, group=pg, group_src=root)
    out = torch.empty(int(longest[0]), dtype=torch.uint8)
    scatter(out, scatter_list=inputs, group=pg, group_src=root)
    size = torch.zeros(1, dtype=torch.long)
    scatter(size, scatter_list=sizes, group=pg, group_src=root)
    scatter_object_output_list[0] = tensor_to_object(out, int(size[0]))


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: GroupArg = None,
    device: torch.device | None = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst`` (sizes first, then the pickles).

    Raises:
        ValueError: ``dst`` is this rank, or this rank is not in ``group`` ("Invalid process
            group specified", as torch's).
    """
    if _not_member(group):  # (torch's looks up the peer first, which a non-member cannot)
        raise ValueError("Invalid process group specified")
    pg = _resolve(group)
    peer = _group_rank(pg, dst, group_dst)
    C.check_not_self_rank(pg.rank(), peer, "destination")
    impl = pg._get_backend()
    if hasattr(impl, "send_object"):
        # one message, tensors and arrays inside the objects out of band (no copies)
        impl.send_object(list(object_list), peer)
        return
    data, sizes = objects_to_tensor(object_list)
    send(sizes, group=pg, group_dst=peer)
    send(data, group=pg, group_dst=peer)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: GroupArg = None,
    device: torch.device | None = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive ``len(object_list)`` objects from ``src`` (``None``: from any rank, which torch
    documents but does not do) into ``object_list``.

    Returns:
        The sender's global rank; -1 on a non-member.

    Raises:
        ValueError: ``src`` is this rank.
    """
    if _not_member(group):
        if src is not None or group_src is not None:  # (as torch's: the peer is looked up first)
            raise ValueError("Invalid process group specified")
        warn_not_in_group("recv_object_list", _global_rank_or_minus_one())
        return -1
    pg = _resolve(group)
    impl = pg._get_backend()
    if hasattr(impl, "recv_object"):
        if src is None and group_src is None:
            peer = -1
        else:
            peer = _group_rank(pg, src, group_src)
            C.check_not_self_rank(pg.rank(), peer, "source")
        objs, source = impl.recv_object(peer)
        if not isinstance(objs, list) or len(objs) != len(object_list):
            raise ValueError(
                f"recv_object_list: rank {source} sent {len(objs) if isinstance(objs, list) else 'no'} "
                f"objects but object_list has {len(object_list)} slots"
            )
        object_list[:] = objs
        return _to_global(pg, source)
    sizes = torch.empty(len(object_list), dtype=torch.long)
    if src is None and group_src is None:
        sender = recv(sizes, group=pg)
        peer = _group_rank(pg, sender, None)
    else:
        peer = _group_rank(pg, src, group_src)
        C.check_not_self_rank(pg.rank(), peer, "source")
        sender = recv(sizes, group=pg, group_src=peer)
    data = torch.empty(int(sizes.sum().item()), dtype=torch.uint8)
    recv(data, group=pg, group_src=peer)
    for i, o in enumerate(tensor_to_objects(data, sizes)):
        object_list[i] = o
    return sender
