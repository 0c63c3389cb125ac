"""Point-to-point: ``send``/``recv``, ``isend``/``irecv``, and ``batch_isend_irecv`` of ``P2POp``.

Peers are global ranks (or ``group_dst``/``group_src``, ranks of ``group``); a receive without a
source takes the first message from any rank. ``batch_isend_irecv`` posts every receive before
any send, so that no send waits on a receive not yet posted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _checks as C
from ._group import NON_GROUP_MEMBER, GroupMember, canonical_rank, warn_not_in_group
from ._types import Work
from ._world import (
    GroupArg,
    _check_non_member_root,
    _global_rank_or_minus_one,
    _group_rank,
    _non_member_ranks,
    _not_member,
    _rank_map,
    _resolve,
    _to_global,
)

__all__ = [
    "P2POp",
    "batch_isend_irecv",
    "irecv",
    "isend",
    "recv",
    "send",
]


@C.meta_noop
def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: GroupArg = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work | None:
    """Send ``tensor`` to ``dst`` (a global rank; or ``group_dst``, a rank of ``group``) without
    waiting. The API does not refuse sending to oneself, as torch's; the tcp backend does, as
    gloo (a ``CollectiveArgumentError``, a ``RuntimeError`` as gloo's).

    Returns:
        The ``Work``; ``None`` on a non-member.

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``tag`` not an int.
        ValueError: ``dst`` is not in ``group``, or both/neither of ``dst``/``group_dst``.
        CollectiveArgumentError: ``group_dst`` out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    tag = C.check_tag(tag)
    if _not_member(group):
        _check_non_member_root("isend", dst, group_dst)
        warn_not_in_group("isend", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    peer = _group_rank(pg, dst, group_dst)
    C.check_peer_rank(peer, pg.size(), "isend", "destination")
    return pg.send([C.real_view(t)], peer, tag)


@C.meta_noop
def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupArg = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work | None:
    """Receive into ``tensor`` from ``src`` (a global rank; ``group_src``, a rank of ``group``;
    neither: any rank) without waiting.

    Returns:
        The ``Work`` (for any source, ``work.source_rank()`` is the sender's group rank);
        ``None`` on a non-member.

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``tag`` not an int.
        ValueError: ``src`` is not in ``group``.
        CollectiveArgumentError: ``group_src`` out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    tag = C.check_tag(tag)
    if _not_member(group):
        warn_not_in_group("irecv", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    if src is None and group_src is None:
        return pg.recv_anysource([C.real_view(t)], tag)
    peer = _group_rank(pg, src, group_src)
    C.check_peer_rank(peer, pg.size(), "irecv", "source")
    return pg.recv([C.real_view(t)], peer, tag)


@C.meta_noop
def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: GroupArg = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """Send ``tensor`` to ``dst`` and wait until it is sent.

    Raises:
        ValueError: ``dst`` is this rank ("Invalid destination rank: destination rank should
            not be the same as the rank of the current process."), or not in ``group``.
        TypeError: ``tensor`` is not a tensor.
    """
    t = C.as_tensor(tensor, "tensor")
    tag = C.check_tag(tag)
    if _not_member(group):  # (torch's send refuses it, where isend and recv warn and return)
        raise ValueError("Invalid process group specified")
    pg = _resolve(group)
    peer = _group_rank(pg, dst, group_dst)
    C.check_not_self_rank(pg.rank(), peer, "destination")
    C.check_peer_rank(peer, pg.size(), "isend", "destination")
    pg.send([C.real_view(t)], peer, tag).wait()


@C.meta_noop
def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupArg = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from ``src`` (``None``: any rank) and wait for it.

    Returns:
        The sender's global rank; -1 on a non-member.

    Raises:
        CollectiveArgumentError: ``src`` is this rank (a ``ValueError``, and a ``RuntimeError``
            as gloo's refusal in torch).
        ValueError: ``src`` is not in ``group``.
        TypeError: ``tensor`` is not a tensor.
    """
    t = C.as_tensor(tensor, "tensor")
    tag = C.check_tag(tag)
    if _not_member(group):
        warn_not_in_group("recv", _global_rank_or_minus_one())
        return -1
    pg = _resolve(group)
    if src is not None or group_src is not None:
        peer = _group_rank(pg, src, group_src)
        C.check_not_self_rank(pg.rank(), peer, "source")
        C.check_peer_rank(peer, pg.size(), "irecv", "source")
        pg.recv([C.real_view(t)], peer, tag).wait()
        return _to_global(pg, peer)
    work = pg.recv_anysource([C.real_view(t)], tag)
    work.wait()
    sender = work.source_rank()
    C.check_not_self_rank(pg.rank(), sender, "source")
    return _to_global(pg, sender)


class P2POp:
    """One operation of ``batch_isend_irecv`` (``torch.distributed.P2POp``).

    Args:
        op: ``isend`` or ``irecv``.
        tensor: what to send, or where to receive.
        peer: the peer's global rank.
        group: the group (default: the default group).
        tag: matches sends with receives.
        group_peer: the peer's rank in ``group`` (instead of ``peer``).

    Raises:
        ValueError: ``op`` is neither ``isend`` nor ``irecv``; both or neither peer given.
        TypeError: ``tensor`` is not a tensor.
    """

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: GroupArg = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op is not isend and op is not irecv:
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` or "
                "``torch.distributed.irecv``."
            )
        self.op = op
        self.tensor = C.as_tensor(tensor, "tensor")
        # on a non-member, as torch: peers map through the latest group it was left out of,
        # and batch_isend_irecv skips the op
        # (the group as the caller knows it: group.WORLD for None, as torch)
        self.group: Any = group if group is not None else GroupMember.WORLD
        pg = NON_GROUP_MEMBER if _not_member(group) else _resolve(group)
        ranks = _non_member_ranks("P2POp") if isinstance(pg, int) else _rank_map(pg)
        self.peer = canonical_rank(ranks, peer, group_peer, True, pg)
        self.tag = tag
        self.group_peer = canonical_rank(ranks, peer, group_peer, False, pg)

    def __repr__(self) -> str:
        me, pg_name = (-1, str(self.group)) if _not_member(self.group) else (
            self.group.rank(), self.group.group_name
        )
        name = getattr(self.op, "__name__", "op")
        src, dst = (me, self.group_peer) if "send" in name else (self.group_peer, me)
        return (
            f"P2POp({name} pg={pg_name}, group_src={src}, group_dst={dst},  "
            f"{self.tensor.shape}, {self.tensor.dtype})"
        )


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Issue every send and receive of ``p2p_op_list``; their order does not matter.

    Returns:
        One ``Work`` per operation (none for ops on a group this rank is not in, as torch).

    Raises:
        ValueError: not a non-empty list of ``P2POp``, or ops on different groups.
    """
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError(
            "Invalid ``p2p_op_list``. Each op is expected to to be of type ``torch.distributed.P2POp``."
        )
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list is empty; pass at least one P2POp")
    group = p2p_op_list[0].group
    if not all(group is p.group for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    if _not_member(group):
        warn_not_in_group("batch_isend_irecv", _global_rank_or_minus_one())
        return []
    works: list[Work | None] = [None] * len(p2p_op_list)
    # post every receive before any send, so that no send can wait on a receive not yet posted
    for i, p in enumerate(p2p_op_list):
        if p.op is irecv:
            works[i] = irecv(p.tensor, group=p.group, tag=p.tag, group_src=p.group_peer)
    for i, p in enumerate(p2p_op_list):
        if p.op is isend:
            works[i] = isend(p.tensor, group=p.group, tag=p.tag, group_dst=p.group_peer)
    return [w for w in works if w is not None]
