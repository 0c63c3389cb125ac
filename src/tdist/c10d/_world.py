"""Which group, which rank: this thread's world and the questions asked of it.

A group argument is resolved here (``None`` and ``group.WORLD``: the default group; a torch
group that is the twin of one of ours: ours; ``GroupMember.NON_GROUP_MEMBER``: this rank is
not a member) and ranks are translated between global and group ranks. The query functions
(``get_rank``, ``get_world_size``, ``get_backend``, ``get_process_group_ranks``, ...) and the
availability checks (``is_initialized``, ``is_gloo_available``, ...) live here too; making and
destroying groups is ``_lifecycle``'s.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from ._backend import backend_creator
from ._backend_config import Backend
from ._group import (
    NON_GROUP_MEMBER,
    ProcessGroup,
    World,
    canonical_rank,
    current_world,
    global_rank_of,
    group_rank_of,
    is_ours,
)

__all__ = [
    "get_backend",
    "get_backend_config",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "is_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
]

_NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)

GroupArg = ProcessGroup | int | None


# -- helpers ---------------------------------------------------------------------------------------
def _world() -> World:
    world = current_world()
    if world is None:
        raise ValueError(_NOT_INITIALIZED)
    return world


def _default_group() -> ProcessGroup:
    world = _world()
    assert world.default_pg is not None
    return world.default_pg


def _global_rank_or_minus_one() -> int:
    world = current_world()
    return -1 if world is None or world.default_pg is None else world.default_pg.rank()


def _not_member(group: object) -> bool:
    return isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER


def _resolve(group: object) -> ProcessGroup:
    """``group`` as a ``ProcessGroup`` (``None`` and ``group.WORLD``: the default group).

    Raises:
        ValueError: not initialized, a torch group that is not (or no longer) the twin of
            one of ours, or not a process group at all (torch's type: it looks any other
            object up in its map of groups and finds nothing).
    """
    if group is None:
        return _default_group()
    if is_ours(group):
        return group
    if isinstance(group, torch.distributed.ProcessGroup):
        twin = _from_torch(group)
        if twin is None:  # (torch's own, or the twin of a group destroyed since)
            raise ValueError(
                f"Group {group} is not registered, please create group with "
                "torch.distributed.new_group API"
            )
        return twin
    raise ValueError(
        f"group must be a ProcessGroup (from init_process_group or new_group), None or "
        f"group.WORLD, got {type(group).__name__}: {group!r}"
    )


def _from_torch(group: object) -> ProcessGroup | None:
    """Our group that torch's group ``group`` runs on, if it is the twin of one of ours (the
    default group, or one ``new_group`` handed out) or a group of torch's on the tdist backend:
    ``None`` otherwise."""
    world = current_world()
    if world is None or not isinstance(group, torch.distributed.ProcessGroup):
        return None
    ours = world.torch_twins.get(group)
    if ours is None:  # (a group that belongs to no world: a merged one)
        ours = getattr(group, "_tdist_standalone", None)
    if ours is None:  # (one that torch's new_group(backend="tdist") made: a handle on it)
        from ._torch_pg import handle_on

        made = handle_on(group)
        if made is not None:
            ours, info = made
            with world.lock:
                world.groups[ours] = info
                world.torch_twins[group] = ours
    return ours


def _rank_map(pg: ProcessGroup) -> dict[int, int] | None:
    """The global-to-group map of ``pg``; ``None`` for the default group (identity).

    Raises:
        ValueError: ``pg`` is not registered in this world (destroyed, or another world's).
    """
    world = _world()
    if pg is world.default_pg:
        return None
    info = world.groups.get(pg)
    if info is None:
        raise ValueError(
            f"Group {pg} is not registered, please create group with torch.distributed.new_group API"
        )
    return info.ranks


def _group_rank(pg: ProcessGroup, global_rank: int | None, group_rank: int | None) -> int:
    return canonical_rank(_rank_map(pg), global_rank, group_rank, False, pg)


def _check_non_member_root(what: str, global_rank: int | None, group_rank: int | None) -> None:
    """On a non-member, check a root or peer rank as a member does, before returning.

    torch maps the rank first, on every rank, so an argument that is wrong for the group
    (both or neither of ``src``/``group_src``, a global rank outside the group) raises on the
    ranks left out of it too, not only on its members; as in ``get_group_rank``, a non-member
    maps it with the latest group ``new_group`` left it out of.

    Raises:
        ValueError: both or neither rank given, or ``global_rank`` not in that group.
        TypeError: a rank that is not an integer.
    """
    if global_rank is None or group_rank is not None:  # (no group's map needed to refuse it)
        canonical_rank(None, global_rank, group_rank, False, NON_GROUP_MEMBER)
    else:
        label = "GroupMember.NON_GROUP_MEMBER (the latest group new_group left this rank out of)"
        canonical_rank(_non_member_ranks(what), global_rank, None, False, label)


def _to_global(pg: ProcessGroup, group_rank: int) -> int:
    ranks = _rank_map(pg)
    return group_rank if ranks is None else global_rank_of(ranks, group_rank, pg)


def _check_valid_timeout(timeout: object) -> timedelta:
    if not isinstance(timeout, timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout}")
    return timeout


# -- availability ----------------------------------------------------------------------------------
def is_available() -> bool:
    """Whether the distributed package is available (always: tdist is it)."""
    return True


def is_gloo_available() -> bool:
    """True: tdist's ``tcp`` backend serves ``backend="gloo"``."""
    return True


def is_nccl_available() -> bool:
    """False: tdist drives CPU tensors only."""
    return False


def is_ucc_available() -> bool:
    """False: no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: no XCCL backend."""
    return False


def is_mpi_available() -> bool:
    """Whether the ``mpi`` backend can run: mpi4py is installed (or an ``mpi`` backend
    registered itself)."""
    from ._lifecycle import mpi4py_installed

    return backend_creator("mpi") is not None or "MPI" in Backend._plugins or mpi4py_installed()


def is_initialized() -> bool:
    """Whether the default process group has been initialized (in this thread's world)."""
    return current_world() is not None


def is_torchelastic_launched() -> bool:
    """Whether this process was started by ``tdist run``/torchrun (``TORCHELASTIC_RUN_ID`` set)."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """The rank of this process on its node (``LOCAL_RANK``), else ``fallback_rank``.

    Raises:
        RuntimeError: ``LOCAL_RANK`` is unset and no ``fallback_rank`` was given.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow "
        "`get_node_local_rank` to work, assuming you are not running in a multi-device context "
        "and want the code to run locally instead."
    )


# -- the world's groups and ranks ------------------------------------------------------------------
def get_rank(group: GroupArg = None) -> int:
    """This process's rank in ``group`` (default: the default group); -1 for a non-member.

    Raises:
        ValueError: not initialized, or ``group`` is not registered.
    """
    if _not_member(group):
        return -1
    default = _default_group()
    pg = _resolve(group)
    if pg is default:
        return default.rank()
    return get_group_rank(pg, default.rank())


def get_world_size(group: GroupArg = None) -> int:
    """The number of ranks in ``group``; -1 for a non-member.

    Raises:
        ValueError: not initialized.
    """
    if _not_member(group):
        return -1
    return _resolve(group).size()


def get_backend(group: GroupArg = None) -> str:
    """The backend name of ``group`` as given to ``init_process_group``/``new_group``,
    normalized as torch does (``"gloo"``, ``"undefined"`` when none was given, ``"tcp"``).

    Raises:
        ValueError: not initialized, a non-member, or an unregistered group.
    """
    if _not_member(group):
        raise ValueError("Invalid process group specified")
    pg = _resolve(group)
    info = _world().groups.get(pg)
    if info is None:
        raise ValueError(
            f"Process group {pg} is not initialized in the world group map. Please initialize "
            "the group first."
        )
    return Backend(info.backend)


def get_backend_config(group: GroupArg = None) -> str:
    """The device-to-backend string of ``group`` (``"cpu:gloo"``).

    Raises:
        ValueError: not initialized, a non-member, or an unregistered group.
    """
    if _not_member(group):
        raise ValueError("Invalid process group specified")
    info = _world().groups.get(_resolve(group))
    if info is None:
        raise ValueError("Invalid process group specified")
    return info.config


def get_pg_count() -> int:
    """The number of process groups created in this world (torch's counter).

    Where torch's default group runs on this world, torch's own counter, which also counts the
    groups torch's modules made without tdist (a device mesh's), and the few of tdist's that
    torch has no twin of."""
    world = current_world()
    if world is None:
        return 0
    if world.default_pg is not None and world.twin_of(world.default_pg) is not None:
        return int(torch.distributed.get_pg_count()) + world.untwinned_count
    return world.group_count


def _non_member_ranks(what: str) -> dict[int, int]:
    """The rank map torch answers for ``NON_GROUP_MEMBER``: the latest group left out of.

    Raises:
        ValueError: this rank was never left out of a group.
    """
    ranks = _world().non_member_ranks
    if ranks is None:
        raise ValueError(
            f"{what}: this rank holds GroupMember.NON_GROUP_MEMBER but was never left out of a "
            f"group made by new_group, so it names no group"
        )
    return ranks


def get_group_rank(group: ProcessGroup | int, global_rank: int) -> int:
    """The rank in ``group`` of global rank ``global_rank`` (identity for the default group,
    and, as torch, for ``None`` before ``init_process_group``).

    As in torch, ``GroupMember.NON_GROUP_MEMBER`` stands for the latest group that ``new_group``
    left this rank out of.

    Raises:
        ValueError: ``global_rank`` is not a member, or ``group`` is not registered.
    """
    if group is None:
        if _global_rank_or_minus_one() < 0:  # (torch: ``group is GroupMember.WORLD``, both None)
            return global_rank
        # (as torch: the default group is ``group.WORLD`` here, not None)
        raise ValueError("Group None is not registered, please create group with torch.distributed.new_group API")
    if _not_member(group):
        return group_rank_of(_non_member_ranks("get_group_rank"), global_rank, group)
    pg = _resolve(group)
    ranks = _rank_map(pg)
    return global_rank if ranks is None else group_rank_of(ranks, global_rank, pg)


def get_global_rank(group: ProcessGroup | int, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (identity for the default group,
    and, as torch, for ``None`` before ``init_process_group``).

    As in torch, ``GroupMember.NON_GROUP_MEMBER`` stands for the latest group that ``new_group``
    left this rank out of.

    Raises:
        ValueError: no such rank in ``group``, or ``group`` is not registered.
    """
    if group is None:
        if _global_rank_or_minus_one() < 0:  # (torch: ``group is GroupMember.WORLD``, both None)
            return group_rank
        # (as torch: the default group is ``group.WORLD`` here, not None)
        raise ValueError("Group None is not registered, please create group with torch.distributed.new_group API")
    if _not_member(group):
        return global_rank_of(_non_member_ranks("get_global_rank"), group_rank, group)
    return _to_global(_resolve(group), group_rank)


def get_process_group_ranks(group: GroupArg) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order.

    As in torch, ``GroupMember.NON_GROUP_MEMBER`` stands for the latest group that ``new_group``
    left this rank out of (so ``get_rank() in get_process_group_ranks(g)`` works on every rank).

    Raises:
        ValueError: not initialized, an unregistered group, or ``NON_GROUP_MEMBER`` on a rank
            that was never left out of a group.
    """
    if _not_member(group):
        ranks = _non_member_ranks("get_process_group_ranks")
    else:
        pg = _resolve(group)
        info = _world().groups.get(pg)
        if info is None:
            raise ValueError(f"Group {pg} is not registered")
        ranks = info.ranks
    return sorted(ranks, key=lambda g: ranks[g])
