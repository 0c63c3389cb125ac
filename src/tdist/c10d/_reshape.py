"""Groups made from a group that exists: ``split_group`` and ``shrink_group`` (torch 2.13's).

``split_group(parent_pg, split_ranks)`` cuts a group into disjoint sub-groups in one call; every
rank of the parent calls it, and each gets the sub-group it is in (``None`` if in none). torch
serves it on NCCL and XCCL only (on CPU it raises); here it works on every backend, over the
parent's store (only the members of one split meet to make it).

``shrink_group(ranks_to_exclude, group)`` makes a group of the ranks that remain, after some
died or must go, without the excluded ranks taking part: they may be dead. The survivors meet in
a fresh namespace of the group's store and connect among themselves; nothing is sent to the
excluded ranks. The old group is ended locally (its failed operations raised already). Shrinking
the default group renumbers the ranks (``get_rank()`` is then the rank among the survivors),
makes the new group the default (torch's default group moves with it), and ends every other
group, whose ranks no longer mean anything, as torch does. torch serves this on NCCL only; gloo
raises ``TypeError``. The group's store must be alive: a store served by an excluded rank's
process is gone with it (``tdist run`` serves it from the launcher, which outlives its workers).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from ..store import PrefixStore
from ._backend_config import Backend
from ._group import GroupInfo, ProcessGroup, World, current_world, publish_world, thread_isolated
from ._lifecycle import (
    _creator_for,
    _make_group,
    _shutdown_quietly,
    default_pg_timeout,
    destroy_process_group,
    new_group,
)
from ._world import _default_group, _resolve, _world

__all__ = ["SHRINK_ABORT", "SHRINK_DEFAULT", "shrink_group", "split_group"]

log = logging.getLogger(__name__)

#: ``shrink_group``'s flags (torch's values): end the old group's operations in the usual way,
#: or abort them first
SHRINK_DEFAULT = 0
SHRINK_ABORT = 1


def _members(info: GroupInfo) -> list[int]:
    """The global ranks of a group, in group-rank order."""
    return sorted(info.ranks, key=info.ranks.__getitem__)


def split_group(
    parent_pg: Any = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: timedelta | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> Any:
    """Split ``parent_pg`` (default: the default group) into the groups ``split_ranks`` lists.

    Every rank of the parent calls it with the same ``split_ranks``: lists of the parent's group
    ranks, which must not overlap. Only the members of each split meet to make it.

    Args:
        parent_pg: the group to split.
        split_ranks: a list of lists of group ranks of ``parent_pg``.
        timeout: the new group's operation deadline (default 30 minutes).
        pg_options: passed to an extended-API plug-in backend.
        group_desc: the description (default ``"<parent's desc>:split:<n>"``).
        backend: must name the parent's backend (one backend per group here).

    Returns:
        The group this rank is in, or ``None`` if it is in no split.

    Raises:
        ValueError: ``split_ranks`` empty or invalid (an empty, oversized or overlapping split,
            duplicate or out-of-range ranks), an unknown parent, or another backend.
    """
    if split_ranks is None or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    world = _world()
    if world.adopted is not None:  # (torch's world: torch's to split)
        return torch.distributed.split_group(
            parent_pg, [list(s) for s in split_ranks], timeout, pg_options, group_desc, backend
        )
    parent = _resolve(parent_pg)
    info = world.groups.get(parent)
    if info is None:
        raise ValueError(f"Group {parent_pg} is not registered")
    if backend is not None and Backend(str(backend).split(":")[-1]) != Backend(info.backend):
        raise ValueError(
            f"Backend mismatch: the parent group's backend is {info.backend!r}, requested "
            f"{backend!r}. Backend names must match when splitting a group."
        )
    world_size, size, me = _default_group().size(), parent.size(), parent.rank()
    mine: list[int] | None = None
    seen: dict[int, list[int]] = {}
    for split in split_ranks:
        split = list(split)
        if len(split) == 0:
            raise ValueError("the split group cannot be empty")
        if len(split) > world_size:
            raise ValueError(
                "the split group's size should be less or equal to the world_size set by init_process_group"
            )
        if len(split) != len(set(split)):
            raise ValueError("the split group cannot have duplicate ranks")
        for r in split:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size:
                raise ValueError(
                    f"rank {r!r} of split {split} is not a group rank of the parent (0 to {size - 1})"
                )
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both split {seen[r]} and {split}")
            seen[r] = split
        if me in split and mine is None:
            mine = sorted(split)
    count = getattr(parent, "_tdist_splits", 0)  # (counted on every rank, a member or not)
    parent._tdist_splits = count + 1  # type: ignore[attr-defined]
    if mine is None:
        return None
    if group_desc is None:
        group_desc = f"{parent.group_desc}:split:{count}"
    members = _members(info)
    return new_group(
        [members[r] for r in mine],
        timeout=default_pg_timeout if timeout is None else timeout,
        backend=info.backend,
        pg_options=pg_options,
        use_local_synchronization=True,
        group_desc=group_desc,
        _split=True,
    )


def _split_ranks(ranks: Sequence[int], size: int) -> list[int]:
    """``ProcessGroup.split_group``'s ``ranks``, checked as torch checks them (``RuntimeError``,
    its words), sorted."""
    ranks = list(ranks)
    if not ranks:
        raise RuntimeError(
            "Split ranks cannot be empty. Please provide a non-empty list of ranks to split the group."
        )
    if len(ranks) > size:
        raise RuntimeError(
            "the split group's size should be no larger than the world_size set by init_process_group"
        )
    if len(set(ranks)) != len(ranks):
        raise RuntimeError(
            "Split ranks should not have duplicates. Please provide a non-duplicate list of ranks to "
            "split the group."
        )
    for r in ranks:
        if not 0 <= int(r) < size:
            raise RuntimeError(f"split rank {r} is not a rank of the group (0 to {size - 1})")
    return sorted(int(r) for r in ranks)


def split_one(
    parent: Any,
    ranks: Sequence[int],
    timeout: timedelta | None,
    opts: Any,
    group_name: str | None,
    group_desc: str | None,
) -> Any:
    """``ProcessGroup.split_group`` (ours and torch's twin's): the group of ``parent``'s group
    ranks ``ranks``, made by its members alone; ``None`` on a rank outside it.

    A registered parent's split is registered as ``new_group`` registers a group (tdist's
    functions and torch's take it; a twin's split is a twin); there ``group_name`` is not used,
    since a group's name is the world's to give. A group that belongs to no world (a merged
    one) splits into another such group, named ``group_name`` (default
    ``"<name>:split:[ranks]"``), in its store's namespace of that name.
    """
    mine = _split_ranks(ranks, parent.size())
    if parent.rank() not in mine:
        return None
    desc = group_desc if group_desc is not None else f"{parent.group_desc}:split:{mine}"
    timeout = default_pg_timeout if timeout is None else timeout
    world = current_world()
    ours = _resolve_quietly(parent)
    info = None if ours is None or world is None else world.groups.get(ours)
    if info is not None:
        members = _members(info)
        return new_group(
            [members[r] for r in mine], timeout=timeout, backend=info.backend, pg_options=opts,
            use_local_synchronization=True, group_desc=desc, _split=True,
        )
    if ours is None:
        raise ValueError(f"Group {parent} is not a group of tdist's")
    name = group_name if group_name is not None else f"{parent.group_name}:split:{mine}"
    made = _standalone(
        PrefixStore(f"{name}/", ours.get_group_store()), mine.index(parent.rank()), len(mine), timeout,
        name, desc,
    )
    return made if not _is_twin(parent) else _twin_of_standalone(made)


def merge_remote(
    parent: Any,
    store: Any,
    size: int,
    timeout: timedelta,
    group_name: str | None,
    group_desc: str | None,
) -> Any:
    """``ProcessGroup.merge_remote_group`` (ours and torch's twin's): a group of ``size``
    callers met through ``store`` (each one's rank: the order of its arrival,
    ``store.add("mergeGroupRank", 1) - 1``), on tdist's tcp backend, in ``store``'s namespace
    ``"<name>/"``. It belongs to no world, as torch's; the callers may come from several jobs.

    Raises:
        ValueError: ``size`` is not positive, or more than ``size`` callers came.
    """
    from ..store import Store

    if int(size) <= 0:
        raise ValueError(f"merge_remote_group: size must be positive, got {size}")
    if not isinstance(store, Store):  # (torch's store, from code not ported yet)
        from ..store._foreign import as_store

        store = as_store(store)
    rank = int(store.add("mergeGroupRank", 1)) - 1
    if rank >= size:
        raise ValueError(f"merge_remote_group: {rank + 1} processes came to merge into a group of {size}")
    name = group_name if group_name is not None else f"{parent.group_name}:merge"
    desc = group_desc if group_desc is not None else f"{parent.group_desc}:merge"
    made = _standalone(PrefixStore(f"{name}/", store), rank, int(size), timeout, name, desc)
    return made if not _is_twin(parent) else _twin_of_standalone(made)


def _resolve_quietly(group: Any) -> ProcessGroup | None:
    """Our group behind ``group`` (ours, a twin, or a group that belongs to no world)."""
    standalone = getattr(group, "_tdist_standalone", None)
    if standalone is not None:
        return standalone  # type: ignore[no-any-return]
    try:
        return _resolve(group)
    except (ValueError, TypeError):
        return None


def _is_twin(group: Any) -> bool:
    return isinstance(group, torch.distributed.ProcessGroup)


def _standalone(store: Any, rank: int, size: int, timeout: timedelta, name: str, desc: str) -> ProcessGroup:
    """A group on tdist's tcp backend that belongs to no world (``store``: its namespace)."""
    from ._lifecycle import _display_name

    pg = ProcessGroup(store, rank, size)
    pg._set_group_name(name)
    pg._set_group_desc(desc)
    impl = _creator_for(Backend.GLOO, None)(PrefixStore("cpu/", store), rank, size, timeout, name, list(range(size)), None)
    pg._set_backend(impl, _display_name(Backend.GLOO, impl), timeout, None)
    return pg


def _twin_of_standalone(pg: ProcessGroup) -> Any:
    """torch's face of a group that belongs to no world: it stops the backend when shut down,
    and tdist's functions take it (``_world._from_torch``)."""
    from ._torch_pg import TorchProcessGroup

    twin = TorchProcessGroup(None, pg.rank(), pg.size(), pg._timeout, pg._get_backend())
    twin._owned = True
    twin.setGroupName(pg.group_name)
    twin.setGroupDesc(pg.group_desc)
    twin._tdist_standalone = pg
    return twin


def _check_exclusions(ranks_to_exclude: Any, shrink_flags: Any, size: int, me: int) -> set[int]:
    """torch's checks of ``shrink_group``'s arguments, with its messages."""
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(
            f"ranks_to_exclude must be a list, but got {type(ranks_to_exclude).__name__}. "
            "Example: [1, 3, 5] to exclude ranks 1, 3, and 5."
        )
    if not ranks_to_exclude:
        raise ValueError(
            "ranks_to_exclude cannot be empty. To shrink a group, you must specify at least "
            "one rank to exclude. Example: [failed_rank_id]"
        )
    if not isinstance(shrink_flags, int) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(
            f"Invalid shrink_flags value: {shrink_flags}. Must be one of: SHRINK_DEFAULT "
            f"({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}). Use SHRINK_ABORT to abort "
            "ongoing operations before shrinking."
        )
    if size <= 1:
        raise ValueError(
            f"Cannot shrink a process group with size {size}. Group must have at least 2 ranks to support shrinking."
        )
    excluded: set[int] = set()
    for i, r in enumerate(ranks_to_exclude):
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(
                f"All elements in ranks_to_exclude must be integers. Element at index {i} is {type(r).__name__}: {r}"
            )
        if not 0 <= r < size:
            raise ValueError(
                f"Rank {r} at index {i} is out of bounds for group size {size}. Valid ranks are in range [0, {size - 1}]."
            )
        if r in excluded:
            raise ValueError(
                f"Duplicate rank {r} found in ranks_to_exclude at index {i}. Each rank can only be excluded once."
            )
        excluded.add(r)
    if len(excluded) >= size:
        raise ValueError(
            f"Cannot exclude all {size} ranks from process group. At least one rank must remain. "
            f"Excluding {len(excluded)} ranks."
        )
    if me in excluded:
        raise RuntimeError(
            f"Current rank {me} is in the exclusion list and should not call shrink_group(). Only "
            "non-excluded ranks should participate in the shrinking operation. Excluded ranks "
            "should terminate their processes instead."
        )
    return excluded


def shrink_group(
    ranks_to_exclude: list[int],
    group: Any = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options: Any | None = None,
) -> Any:
    """A group of ``group``'s ranks (default: the default group) but ``ranks_to_exclude``.

    Only the remaining ranks call it (the excluded ones may be dead), with the same list. The
    old group is ended here, locally (``SHRINK_ABORT``: aborted first). Shrinking the default
    group makes the new group the default one, with the remaining ranks renumbered from 0 in
    their old order, and ends every other group.

    Args:
        ranks_to_exclude: group ranks of ``group`` to leave out.
        group: the group to shrink.
        shrink_flags: ``SHRINK_DEFAULT`` or ``SHRINK_ABORT``.
        pg_options: passed to an extended-API plug-in backend.

    Returns:
        The new group (for the default group: the new default, as ``group.WORLD`` gives it).

    Raises:
        TypeError: ``ranks_to_exclude`` is not a list of ints.
        ValueError: empty, out of range or duplicate ranks, all ranks, bad flags, a group of
            one rank.
        RuntimeError: this rank is in ``ranks_to_exclude``.
        DistError: the survivors could not form the new group (a store that is gone, a
            deadline).
    """
    world = _world()
    if world.adopted is not None:  # (torch's world: torch's to shrink)
        return torch.distributed.shrink_group(ranks_to_exclude, group, shrink_flags, pg_options)
    target = _resolve(group)
    excluded = _check_exclusions(ranks_to_exclude, shrink_flags, target.size(), target.rank())
    info = world.groups[target]
    remaining = [g for g in _members(info) if info.ranks[g] not in excluded]
    abort = shrink_flags == SHRINK_ABORT
    if target is world.default_pg:
        return _shrink_default(world, target, info, remaining, abort, pg_options)
    new = new_group(
        remaining,
        timeout=target._timeout,
        backend=info.backend,
        pg_options=pg_options,
        use_local_synchronization=True,
        group_desc=f"{info.name}:shrunk",
        sort_ranks=False,
    )
    _end(target, abort)
    return new


def _end(pg: ProcessGroup, abort: bool) -> None:
    """End ``pg`` here, without a word to its peers."""
    if abort:
        try:
            pg.abort()
        except Exception as exc:
            log.warning(
                "rank %d: aborting process group %r failed: %s", pg.rank(), pg.group_name, exc
            )
    destroy_process_group(pg)


def _shrink_default(
    world: World,
    old: ProcessGroup,
    info: GroupInfo,
    remaining: list[int],
    abort: bool,
    pg_options: Any,
) -> Any:
    others = [g for g in world.groups if g is not old]
    if others:
        log.warning(
            "Shrinking default group will destroy %d other process groups: %s. This is necessary "
            "because shrinking the default group reassigns global ranks, making existing groups "
            "inconsistent.",
            len(others),
            ", ".join(world.groups[g].name for g in others),
        )
    for g in others:
        _end(g, abort)
    rank = remaining.index(old.rank())
    digest = hashlib.sha1("_".join(map(str, remaining)).encode(), usedforsecurity=False).hexdigest()
    # (the old group's namespace holds the new one: a later shrink nests in it, never meets it)
    new = _make_group(
        world,
        info.store,
        rank,
        list(range(len(remaining))),
        info.backend,
        _creator_for(info.backend, pg_options),
        f"shrunk_{digest}",
        old._timeout,
        "default:shrunken",
    )
    if torch.distributed.is_available():
        from ._torch_pg import forget_default_group

        forget_default_group(old)
    if abort:
        old.abort()
    _shutdown_quietly(old)
    with world.lock:
        del world.groups[old]
        for t in [t for t, g in world.torch_twins.items() if g is old]:
            del world.torch_twins[t]
    publish_world(world, new)
    log.info(
        "rank %d of the shrunk default group (was %d; %d ranks left)",
        rank,
        remaining[rank],
        len(remaining),
    )
    if not thread_isolated() and torch.distributed.is_available():
        from ._torch_pg import mirror_default_group

        twin = mirror_default_group(new, PrefixStore("torch", new.get_group_store()), old._timeout)
        if twin is not None:
            with world.lock:
                world.torch_twins[twin] = new
            return twin
    return new
