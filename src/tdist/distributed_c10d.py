"""``tdist.distributed_c10d``: the module path of ``torch.distributed.distributed_c10d``.

Code that imports from torch's module (``from torch.distributed.distributed_c10d import
ProcessGroup``, ``dist.distributed_c10d._get_default_group()``) ports by changing the package
name. The names are the same objects as ``tdist``'s.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch

from ._public import *  # noqa: F403  (the module-level c10d API, by design)
from ._public import __all__ as _public
from .c10d._api import (
    _all_gather_base,
    _coalescing_manager,
    _CoalescingManager,
    _default_group,
    _not_member,
    _reduce_scatter_base,
    new_group,
)
from .c10d._group import GroupMember, current_world
from .c10d._world import (
    _resolve,
    get_backend_config,
    get_global_rank,
    get_process_group_ranks,
    get_rank,
)
from .c10d._world import _world as _world_of_this_thread
from .constants import default_pg_timeout

_log = logging.getLogger(__name__)

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


def _handle(world: Any, pg: Any) -> Any:
    """What the program holds for our group ``pg``: torch's twin of it where there is one."""
    twin = world.twin_of(pg)
    return pg if twin is None else twin


class _World:
    """torch's ``_world``: the registry of this process's groups, as torch's private maps
    (``pg_map``, ``pg_names``, ``pg_group_ranks``, ``pg_backend_config``, ``group_count``,
    ``tags_to_pg``, ``pg_to_tag``), read from tdist's world: each read is a fresh dict, keyed
    by the groups the program holds. For reading: groups are made with ``new_group``."""

    def _groups(self) -> list[tuple[Any, Any]]:
        world = current_world()
        if world is None or world.default_pg is None:
            return []
        with world.lock:
            return [(_handle(world, pg), info) for pg, info in world.groups.items()]

    @property
    def default_pg(self) -> Any:
        return GroupMember.WORLD

    @property
    def pg_map(self) -> dict[Any, tuple[str, Any]]:
        return {pg: (info.backend, info.store) for pg, info in self._groups()}

    @property
    def pg_names(self) -> dict[Any, str]:
        return {pg: info.name for pg, info in self._groups()}

    @property
    def pg_group_ranks(self) -> dict[Any, dict[int, int]]:
        return {pg: dict(info.ranks) for pg, info in self._groups()}

    @property
    def pg_backend_config(self) -> dict[Any, str]:
        return {pg: info.config for pg, info in self._groups()}

    @property
    def group_count(self) -> int:
        from .c10d._world import get_pg_count

        return get_pg_count()

    @property
    def pg_to_tag(self) -> dict[Any, str]:
        return {pg: _tags.get(pg, f"ptd:{info.name}") for pg, info in self._groups()}

    @property
    def tags_to_pg(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for pg, tag in self.pg_to_tag.items():
            out.setdefault(tag, []).append(pg)
            if tag.startswith("ptd:"):  # (torch files every group under "" too)
                out.setdefault("", []).append(pg)
        return out

    @property
    def pg_coalesce_state(self) -> dict[Any, list[Any]]:
        return {}

    @property
    def comms(self) -> list[Any]:
        return []

    @property
    def pg_config_info(self) -> list[dict[str, Any]]:
        size = _get_group_size(None)
        return [
            {
                "pg_name": info.name,
                "pg_desc": pg.group_desc,
                "backend_config": info.config,
                "ranks": list(info.ranks) if len(info.ranks) != size else [],
                "group_size": len(info.ranks),
                "group_count": self.group_count,
            }
            for pg, info in self._groups()
        ]


_world = _World()
_tags: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # user tags (_new_group_with_tag)

_WORLD_MAPS = {
    "_pg_map": "pg_map", "_pg_names": "pg_names", "_pg_group_ranks": "pg_group_ranks",
    "_pg_backend_config": "pg_backend_config", "_group_count": "group_count",
    "_tags_to_pg": "tags_to_pg", "_pg_to_tag": "pg_to_tag",
}


def __getattr__(name: str) -> Any:
    """torch's module-level maps (``_pg_map``, ``_pg_names``...): ``_world``'s, read now."""
    if name in _WORLD_MAPS:
        return getattr(_world, _WORLD_MAPS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


STORE_BASED_BARRIER_PREFIX = "store_based_barrier_key"
PG_WRAPPER_STORE_PREFIX = "pg_wrapper"
_GLOO_AVAILABLE = True  # (tdist's tcp backend serves "gloo")
_NCCL_AVAILABLE = False
_UCC_AVAILABLE = False
_XCCL_AVAILABLE = False
default_pg_nccl_timeout = None  # (no NCCL: torch's value where it has none)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WORLD_MAPS])


def _get_default_timeout(backend: Any) -> timedelta:
    """The timeout a group of ``backend`` gets when none is given: ``default_pg_timeout``
    (30 minutes) for every backend tdist serves."""
    return default_pg_timeout


def _get_pg_default_device(group: Any = None) -> torch.device:
    """The CPU: the device tdist's groups serve (torch's deprecated helper, with its warning).

    Raises:
        ValueError: no group given and no default group.
    """
    warnings.warn(
        "`_get_pg_default_device` will be deprecated, it only stays for backward-compatibility "
        "reason. If you need to find a device for object collectives, please use "
        "`_get_object_coll_device`. If you need to query the device types supported by group, "
        "please use `_device_capability(group)`. ",
        stacklevel=2,
    )
    _resolve(group)
    return torch.device("cpu")


def _get_object_coll_device(group: Any = None) -> str:
    """``"cpu"``: where object collectives of ``group`` stage their bytes."""
    _resolve(group)
    return "cpu"


def _device_capability(group: Any = None) -> list[str]:
    """The device types ``group`` serves: ``["cpu"]``."""
    _resolve(group)
    return ["cpu"]


def _get_group_size(group: Any) -> int:
    """The size of ``group`` (``None``: the default group's)."""
    return int(_resolve(group).size())


def _get_group_size_by_name(group_name: str) -> int:
    """The size of the group named ``group_name``."""
    return int(_resolve_process_group(group_name).size())


def _get_global_rank(group: Any, rank: int) -> int:
    """``get_global_rank`` under its old private name (deprecated, with torch's warning)."""
    warnings.warn(
        "`torch.distributed.distributed_c10d._get_global_rank` is deprecated, "
        "please use `torch.distributed.distributed_c10d.get_global_rank` instead",
        FutureWarning,
        stacklevel=2,
    )
    return get_global_rank(group, rank)


def _get_process_group_name(pg: Any) -> str:
    """The name of group ``pg`` (``"None"`` for what is not a group of this process, as torch)."""
    return _world.pg_names.get(pg, "None")


def _resolve_process_group(group_name: str) -> Any:
    """The group named ``group_name``.

    Raises:
        RuntimeError: no group of this process has that name (torch's words).
    """
    for pg, name in _world.pg_names.items():
        if name == group_name:
            return pg
    raise RuntimeError(f"Could not resolve the process group registered under the name {group_name}")


def _get_group_tag(pg: Any) -> str:
    """The tag of group ``pg`` (``"ptd:<name>"``, or the one it was made with).

    Raises:
        KeyError: ``pg`` is not a group of this process.
    """
    return _world.pg_to_tag[pg].removeprefix("user:")


def _find_pg_by_ranks_and_tag(tag: str, ranks: list[int]) -> Any:
    """A group with tag ``tag`` and exactly the global ranks ``ranks``, or ``None``."""
    if tag and not tag.startswith(("ptd:", "user:")):
        tag = f"user:{tag}"
    for pg in _world.tags_to_pg.get(tag, []):
        if pg.size() == len(ranks) and set(get_process_group_ranks(pg)) == set(ranks):
            return pg
    return None


def _new_group_with_tag(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    backend_options: Any = None,
    pg_tag: str | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
) -> Any:
    """``new_group``, filing the group under ``pg_tag`` (``_find_pg_by_ranks_and_tag`` finds it)."""
    pg = new_group(
        ranks, timeout, backend, backend_options,
        use_local_synchronization=use_local_synchronization, group_desc=group_desc, device_id=device_id,
    )
    if pg_tag and pg is not GroupMember.NON_GROUP_MEMBER and pg is not None:
        _tags[pg] = pg_tag if pg_tag.startswith(("ptd:", "user:")) else f"user:{pg_tag}"
    return pg


def _find_or_create_pg_by_ranks_and_tag(tag: str, ranks: list[int], stride: int) -> Any:
    """The group of this rank's block of ``stride`` ranks in ``ranks`` under ``tag``; made
    (with every rank of the block calling) where there is none.

    Raises:
        ValueError: ``len(ranks)`` not a multiple of ``stride``; no group and an empty tag.
        AssertionError: this rank is in no block (torch's type).
    """
    if len(ranks) % stride != 0:
        raise ValueError(f"Ranks length ({len(ranks)}) must be divisible by stride ({stride})")
    me = get_rank()
    mine = next((ranks[i : i + stride] for i in range(0, len(ranks), stride) if me in ranks[i : i + stride]), None)
    if mine is None:
        raise AssertionError("rankset doesn't include the current node")
    mine = sorted(mine)
    pg = _find_pg_by_ranks_and_tag(tag, mine)
    if pg is not None:
        return pg
    if tag == "":
        raise ValueError("Cannot automatically create PG with empty tag")
    return _new_group_with_tag(mine, pg_tag=tag)


def _get_pg_config(group: Any = None) -> dict[str, Any]:
    """torch's summary of ``group``: name, description, backend config, size and ranks."""
    pg = _handle_of(group)
    return {
        "pg_name": _get_process_group_name(pg),
        "pg_desc": pg.group_desc,
        "backend_config": get_backend_config(pg),
        "pg_size": _get_group_size(pg),
        "ranks": get_process_group_ranks(pg),
    }


def _get_all_pg_configs() -> list[dict[str, Any]]:
    """``_get_pg_config`` of every group of this process."""
    return [_get_pg_config(pg) for pg in _world.pg_map]


def _handle_of(group: Any) -> Any:
    """What the program holds for ``group`` (``None``: the default group)."""
    return _handle(_world_of_this_thread(), _resolve(group))


def _is_barrier_after_init() -> int:
    """``TORCH_DIST_INIT_BARRIER`` as an int (torch's switch; 0 when unset)."""
    return int(os.getenv("TORCH_DIST_INIT_BARRIER", "0"))


def _warn_not_in_group(op_name: str) -> None:
    """torch's warning for a rank calling ``op_name`` on a group it is not in."""
    from .c10d._group import warn_not_in_group
    from .c10d._world import _global_rank_or_minus_one

    warn_not_in_group(op_name, _global_rank_or_minus_one())


def _check_single_tensor(param: Any, param_name: str) -> None:
    """torch's check: ``param`` is a tensor (or a numpy array, which tdist takes too).

    Raises:
        TypeError: it is not (torch's words).
    """
    from .c10d._checks import as_tensor

    as_tensor(param, param_name)


def _check_tensor_list(param: Any, param_name: str) -> None:
    """torch's check: ``param`` is a list of tensors.

    Raises:
        TypeError: it is not (torch's words).
    """
    from .c10d._checks import as_tensor_list

    as_tensor_list(param, param_name)


def _object_to_tensor(obj: Any, device: Any, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``obj`` pickled (torch's format): a ``uint8`` tensor and a one-element ``int64`` tensor
    of its length, on ``device``."""
    from .c10d._objects import object_to_tensor

    data, size = object_to_tensor(obj)
    return data.to(device), size.to(device)


def _tensor_to_object(tensor: torch.Tensor, tensor_size: Any, group: Any) -> Any:
    """The object pickled in the first ``tensor_size`` bytes of ``tensor`` (unpickled: trust
    where it came from)."""
    from .c10d._objects import tensor_to_object

    return tensor_to_object(tensor, tensor_size)


def _store_based_barrier(
    rank: int,
    store: Any,
    group_name: str,
    rendezvous_count: int,
    timeout: timedelta,
    logging_interval: timedelta = timedelta(seconds=10),
) -> None:
    """Wait until ``rendezvous_count`` processes have come to this barrier of ``group_name``
    on ``store`` (torch's keys: ``store_based_barrier_key:<name>``).

    Raises:
        DistStoreError: ``timeout`` passed first; says how many came.
    """
    from ._core.errors import DistStoreError

    key = f"{STORE_BASED_BARRIER_PREFIX}:{group_name}"
    last = f"{key}:last_worker"
    if store.add(key, 1) == rendezvous_count:
        store.set(last, "1")
    step = max(logging_interval, timedelta(seconds=10 + rendezvous_count / 1000))
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([last], timedelta(seconds=max(0.0, min(step.total_seconds(), left))))
            return
        except (RuntimeError, TimeoutError) as exc:
            joined = store.add(key, 0)
            if time.monotonic() >= deadline:
                raise DistStoreError(
                    f"Timed out initializing process group in store based barrier on rank {rank}, for "
                    f"key: {key} (world_size={rendezvous_count}, num_workers_joined={joined}, "
                    f"timeout={timeout} error={exc})"
                ) from None
            _log.debug("rank %s waits in the store based barrier %s: %s of %s came", rank, key, joined, rendezvous_count)


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
