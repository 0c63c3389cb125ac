"""``tdist.distributed_c10d``: the module path of ``torch.distributed.distributed_c10d``.

Code that imports from torch's module (``from torch.distributed.distributed_c10d import
ProcessGroup``, ``dist.distributed_c10d._get_default_group()``) ports by changing the package
name. The names are the same objects as ``tdist``'s.
"""

from __future__ import annotations

from typing import Any

from ._public import *  # noqa: F403  (the module-level c10d API, by design)
from ._public import __all__ as _public
from .c10d._api import (
    _all_gather_base,
    _coalescing_manager,
    _CoalescingManager,
    _default_group,
    _not_member,
    _reduce_scatter_base,
)
from .c10d._group import GroupMember

__all__ = list(_public)


def _get_default_group() -> Any:
    """The default process group (torch's private helper, widely used): ``group.WORLD``.

    Raises:
        ValueError: the default group is not initialized (torch's error type).
    """
    _default_group()
    return GroupMember.WORLD


def _get_default_store() -> Any:
    """The default group's store (torch's private helper): its namespace of the store the
    group was made on, as torch's.

    Raises:
        ValueError: the default group is not initialized.
    """
    from .c10d._world import _world

    world = _world()
    default = _default_group()
    return world.groups[default].store


def _get_process_group_store(pg: Any) -> Any:
    """The store of group ``pg`` (torch's private helper): its namespace of the store the
    groups were made on, as torch's; ``pg`` may be torch's handle on a group of tdist's.

    Raises:
        ValueError: ``pg`` is not a live group of this process (torch fails on its lookup).
    """
    from .c10d._world import _from_torch, _world

    world = _world()
    ours = _from_torch(pg) or pg
    info = world.groups.get(ours) if not _not_member(ours) else None
    if info is None:
        raise ValueError(f"_get_process_group_store: {pg!r} is not a process group of this process")
    return info.store


def _rank_not_in_group(group: object) -> bool:
    """True when ``group`` is the placeholder a non-member holds (``GroupMember.NON_GROUP_MEMBER``);
    None (the default group) is never that."""
    return group is not None and _not_member(group)


__all_private__ = [
    "_all_gather_base",
    "_CoalescingManager",
    "_coalescing_manager",
    "_get_default_group",
    "_get_default_store",
    "_rank_not_in_group",
    "_reduce_scatter_base",
]
_ = (_all_gather_base, _reduce_scatter_base, _coalescing_manager, _CoalescingManager)
