"""The module-level API of ``torch.distributed``: ``init_process_group``, ``all_reduce``, ...

Theory of operation. Each function checks its arguments (``_checks``, torch's error types and
messages), maps global ranks to group ranks (``_group``), turns numpy arrays into tensors that
share their memory and complex tensors into real views (as torch does), and calls the group's
``ProcessGroup`` method, which delegates to the backend. With ``async_op=True`` the ``Work`` is
returned at once; otherwise the function waits on it and returns ``None``, as torch.

A rank that is not a member of ``group`` (it holds ``GroupMember.NON_GROUP_MEMBER``) gets
torch's warning and ``None`` (``-1`` from ``get_rank``/``get_world_size``/``recv``).

Where tdist goes beyond torch (deliberately, documented on each function): ``all_gather`` and
``all_to_all`` accept tensors of different sizes per rank; ``all_gather_into_tensor`` accepts
the stacked output form on CPU; ``recv_object_list(src=None)`` receives from any source;
``recv`` from oneself raises instead of hanging; ``monitored_barrier`` releases every rank
with rank 0's verdict instead of leaving them to time out.

The ``*_multigpu`` functions of older torch (removed from torch 2.x) work on lists of tensors
on one rank: they reduce or copy locally and run one collective per list position.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from .._core.errors import DistBackendError
from ..store import PrefixStore, Store
from ..store._rendezvous import release_claim, rendezvous
from ..store._tcp import serving_in_a_thread
from . import _checks as C
from ._backend import Backend as BackendImpl
from ._backend import backend_creator
from ._backend_config import Backend, BackendConfig, implementation_for
from ._debug import CollectiveChecker, DebugLevel, get_debug_level
from ._group import (
    NON_GROUP_MEMBER,
    GroupInfo,
    GroupMember,
    ProcessGroup,
    World,
    canonical_rank,
    chain_work,
    check_disjoint,
    current_world,
    global_rank_of,
    group_rank_of,
    new_group_ranks,
    new_world,
    publish_world,
    release_world,
    subgroup_rank_lists,
    thread_has_world,
    thread_isolated,
    warn_not_in_group,
)
from ._objects import object_to_tensor, objects_to_tensor, tensor_to_object, tensor_to_objects
from ._reduce import reduce_into, sparse_all_reduce
from ._types import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    RedOpType,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
    as_red_op,
)

__all__ = [
    "AllreduceCoalescedOptions",
    "P2POp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_multigpu",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_multigpu",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_backend_config",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_multigpu",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
]

log = logging.getLogger(__name__)

#: torch's default timeout of process groups (gloo's; NCCL's 10 minutes does not apply here)
default_pg_timeout = timedelta(minutes=30)

_NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)

GroupArg = ProcessGroup | int | None


class AllreduceCoalescedOptions(AllreduceOptions):
    """Options of ``allreduce_coalesced`` (torch's record type)."""


class _DistributedBackendOptions:
    """What an extended-API backend creator receives (torch's ``_DistributedBackendOptions``)."""

    def __init__(
        self, store: Store, group_rank: int, group_size: int, timeout: timedelta, group_id: str,
        global_ranks_in_group: list[int],
    ) -> None:
        self.store = store
        self.group_rank = group_rank
        self.group_size = group_size
        self.timeout = timeout
        self.group_id = group_id
        self.global_ranks_in_group = global_ranks_in_group


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
        ValueError: not initialized, or a torch group that is not (or no longer) the twin of
            one of ours.
        TypeError: not a process group.
    """
    if group is None:
        return _default_group()
    if isinstance(group, ProcessGroup):
        return group
    if isinstance(group, torch.distributed.ProcessGroup):
        twin = _from_torch(group)
        if twin is None:  # (torch's own, or the twin of a group destroyed since)
            raise ValueError(
                f"Group {group} is not registered, please create group with "
                "torch.distributed.new_group API"
            )
        return twin
    raise TypeError(
        f"group must be a ProcessGroup (from init_process_group or new_group), None or "
        f"group.WORLD, got {type(group).__name__}: {group!r}"
    )


def _from_torch(group: object) -> ProcessGroup | None:
    """Our group that torch's group ``group`` runs on, if it is the twin of one of ours (the
    default group, or one ``new_group`` handed out): ``None`` otherwise."""
    world = current_world()
    if world is None or not isinstance(group, torch.distributed.ProcessGroup):
        return None
    return world.torch_twins.get(group)


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


def _to_global(pg: ProcessGroup, group_rank: int) -> int:
    ranks = _rank_map(pg)
    return group_rank if ranks is None else global_rank_of(ranks, group_rank, pg)


def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def _check_valid_timeout(timeout: object) -> timedelta:
    if not isinstance(timeout, timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout}")
    return timeout


def _red_op(op: object) -> RedOpType:
    try:
        return as_red_op(op)
    except ValueError as exc:
        raise TypeError(str(exc)) from None


def _set_async(opts: Any, async_op: bool) -> Any:
    opts.asyncOp = async_op
    return opts


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"`torch.distributed.{old}` is deprecated. Please use `torch.distributed.{new}` instead.",
        FutureWarning,
        stacklevel=3,
    )


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
    """Whether an ``mpi`` backend has registered itself."""
    return backend_creator("mpi") is not None or "MPI" in Backend._plugins


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


# -- process groups --------------------------------------------------------------------------------
_Creator = Callable[[Store, int, int, timedelta, str, list[int]], BackendImpl]


def _creator_for(backend: str, pg_options: Any) -> _Creator:
    """How to build a backend for the (normalized) name ``backend``; fails before any I/O.

    Raises:
        RuntimeError: a backend torch has that tdist does not (NCCL, UCC, XCCL, MPI).
        AssertionError: an unknown name (torch's type).
    """
    impl = implementation_for(backend)
    plugin = Backend._plugins.get(impl.upper())
    if plugin is not None:
        fn, extended = plugin.creator_fn, plugin.extended_api

        def make_plugin(
            store: Store, rank: int, size: int, timeout: timedelta, name: str, ranks: list[int]
        ) -> BackendImpl:
            if extended:
                opts = _DistributedBackendOptions(store, rank, size, timeout, name, ranks)
                backend_obj: BackendImpl = fn(opts, pg_options)
            else:
                backend_obj = fn(store, rank, size, timeout)
            return backend_obj

        return make_plugin
    creator = backend_creator(impl)
    if creator is None and impl == Backend.TCP:
        from . import _tcp_backend  # noqa: F401  (registers "tcp" and "gloo")

        creator = backend_creator(impl)
    if creator is None:
        if impl == Backend.TCP:
            raise RuntimeError("the tcp backend did not register itself (tdist.c10d._tcp_backend)")
        if impl == Backend.MPI:
            raise RuntimeError(
                "Distributed package doesn't have MPI built in. MPI is only included if you "
                "build PyTorch from source on a host that has MPI installed."
            )
        raise AssertionError(
            f"Unknown c10d backend type {impl.upper()}; use gloo (or tcp), or register one "
            "with Backend.register_backend"
        )
    found = creator

    def make(
        store: Store, rank: int, size: int, timeout: timedelta, name: str, ranks: list[int]
    ) -> BackendImpl:
        return found(store, rank, size, timeout)

    return make


def _display_name(backend: str, impl: BackendImpl) -> str:
    """What ``ProcessGroup.name()`` says: ``"gloo"`` where our tcp backend stands in for it."""
    if implementation_for(backend) == Backend.TCP and Backend(backend) != Backend.TCP:
        return Backend.GLOO
    try:
        return impl.name()
    except Exception:
        return Backend(backend)


def _make_group(
    world: World,
    base_store: Store,
    group_rank: int,
    global_ranks: list[int],
    backend: str,
    creator: _Creator,
    name: str,
    timeout: timedelta,
    desc: str,
) -> ProcessGroup:
    """Build one group's store namespace, backend and handle, and register it in ``world``.

    Keys follow torch's layout: the group's namespace is ``"<name>/"`` inside ``base_store``,
    the backend's ``"cpu/"`` inside that, and debug checks use ``"tdist_debug"`` beside it.
    """
    size = len(global_ranks)
    prefix_store = PrefixStore(f"{name}/", base_store)
    pg = ProcessGroup(prefix_store, group_rank, size)
    pg._set_group_name(name)
    pg._set_group_desc(desc)
    impl = creator(PrefixStore("cpu/", prefix_store), group_rank, size, timeout, name, global_ranks)
    checker = None
    if get_debug_level() == DebugLevel.DETAIL:
        checker = CollectiveChecker(
            PrefixStore("tdist_debug", prefix_store), group_rank, size, timeout, name
        )
    pg._set_backend(impl, _display_name(backend, impl), timeout, checker)
    with world.lock:
        world.groups[pg] = GroupInfo(
            name=name,
            backend=Backend(backend),
            config=str(BackendConfig(backend)),
            store=prefix_store,
            ranks={g: i for i, g in enumerate(global_ranks)},
        )
    log.info(
        "rank %d: process group %r ready (%d ranks, backend %s%s)",
        group_rank, name, size, pg.name(), ", debug checks on" if checker else "",
    )
    return pg


def _store_based_barrier(store: Store, key: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """``TORCH_DIST_INIT_BARRIER=1``: wait for every rank after making a group."""
    try:
        store.barrier(f"store_based_barrier_key:{key}", world_size, timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise DistBackendError(
            f"Timed out initializing process group in store based barrier on rank {rank}, for "
            f"key: store_based_barrier_key:{key} (world_size={world_size}, timeout={timeout})"
        ) from exc


def _incarnation(store: Store, rank: int) -> int:
    """How many times rank ``rank`` has made a default group on ``store`` (this one included).

    A group made again on the same store after ``destroy_process_group`` gets a fresh key
    namespace from it, so no rank can read a key its predecessor left behind. Every rank counts
    its own, so ranks agree as long as they all re-initialize together.
    """
    return int(store.add(f"tdist_incarnation/rank_{rank}", 1))


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
) -> None:
    """Initialize the default process group (torch's rules and messages).

    Give either ``store`` (with ``rank`` and ``world_size``) or ``init_method`` (a URL;
    default ``env://``). A rendezvous-made store is namespaced ``PrefixStore("default_pg",
    store)`` as in torch; a given store is used as it is.

    Args:
        backend: ``"gloo"``, ``"tcp"`` (both served by tdist's tcp backend), ``"cpu:gloo"``,
            or a registered name; any case; ``None`` means tcp on CPU.
        init_method: ``env://``, ``tcp://host:port``, ``file:///path`` or a registered scheme.
        timeout: the deadline of every operation of the group (default 30 minutes).
        world_size: the number of processes (required with ``store``).
        rank: this process's rank (required with ``store``).
        store: a key-value store every rank can reach.
        group_name: ignored, as in torch.
        pg_options: passed to extended-API plug-in backends.
        device_id: torch's accelerator binding; tdist drives CPU only, so any device raises.

    Raises:
        ValueError: the default group exists already ("trying to initialize the default
            process group twice!"), a ``device_id`` was given, or a rendezvous error.
        AssertionError: ``store`` with ``init_method``, or without ``rank``/``world_size``.
        TypeError: ``timeout`` is not a ``timedelta``.
        RuntimeError: a backend that is not built in (NCCL, UCC, XCCL, MPI).
    """
    if thread_has_world():
        raise ValueError("trying to initialize the default process group twice!")
    if store is not None and init_method is not None:
        raise AssertionError("Cannot specify both init_method and store.")
    if store is not None:
        if not world_size > 0:
            raise AssertionError("world_size must be positive if using store")
        if not rank >= 0:
            raise AssertionError("rank must be non-negative if using store")
    elif init_method is None:
        init_method = "env://"
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        raise ValueError(
            "device_id is an int, but no accelerator support is found from the current "
            "compilation. tdist drives CPU tensors only; leave device_id unset."
        )
    if device_id is not None:
        raise ValueError(
            f"init_process_group device_id parameter must be an accelerator with an index, got "
            f"{device_id}; tdist drives CPU tensors only, leave device_id unset."
        )
    backend_name = Backend(Backend.UNDEFINED if backend is None else backend)
    timeout = default_pg_timeout if timeout is None else timeout
    _check_valid_timeout(timeout)
    creator = _creator_for(backend_name, pg_options)

    world = new_world()
    try:
        if store is None:
            assert init_method is not None
            # rank 0 hosts the group's store in a thread, as torch does: a process of its own
            # costs tens of milliseconds to start, and a group's store is busy only while
            # groups form (under ``tdist run`` the launcher's store serves instead)
            with serving_in_a_thread():
                store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            world.owned_store = store  # (its claim of this rank goes with the group)
            store = PrefixStore("default_pg", store)
        if not 0 <= rank < world_size:
            raise ValueError(
                f"Invalid rank {rank} for world size {world_size}: ranks go from 0 to world_size - 1"
            )
        incarnation = _incarnation(store, rank)
        if incarnation > 1:
            store = PrefixStore(f"tdist_incarnation_{incarnation}", store)
        name = str(world.group_count)
        world.group_count += 1
        pg = _make_group(
            world, store, rank, list(range(world_size)), backend_name, creator, name, timeout,
            "default_pg",
        )
        world.init_method = init_method
        publish_world(world, pg)
        if not thread_isolated() and torch.distributed.is_available():  # (torch's: one per process)
            from ._torch_pg import mirror_default_group

            twin = mirror_default_group(pg, PrefixStore("torch", store), timeout)
            if twin is not None:
                world.torch_twins[twin] = pg
    except BaseException:
        for g in list(world.groups):
            _shutdown_quietly(g)
        release_world(world)
        raise
    if os.getenv("TORCH_DIST_INIT_BARRIER", "0") == "1":
        _store_based_barrier(store, name, rank, world_size, timeout)


def _shutdown_quietly(pg: ProcessGroup) -> None:
    try:
        pg.shutdown()
    except Exception as exc:  # one group failing to stop must not keep the others running
        log.warning("rank %d: shutting down process group %r failed: %s", pg.rank(), pg.group_name, exc)


def destroy_process_group(group: ProcessGroup | int | None = None) -> None:
    """Destroy ``group``; with ``None`` (or ``group.WORLD``) every group and the default one.

    After destroying the default group, ``init_process_group`` may be called again.

    Raises:
        AssertionError: nothing to destroy (torch's type).
        ValueError: ``group`` is not a live group of this world (torch's message).
    """
    if _not_member(group):
        return
    world = current_world()
    if world is None:
        raise AssertionError(
            "Process group cannot be None: the default process group has not been initialized "
            "(or was destroyed already)"
        )
    pg = world.default_pg if group is None else _from_torch(group) or group
    if not isinstance(pg, ProcessGroup) or pg not in world.groups:
        raise ValueError("Invalid process group specified")
    if pg is world.default_pg:
        from ._torch_pg import forget_default_group

        forget_default_group(pg)
        with world.lock:
            groups = sorted(world.groups, key=lambda g: world.groups[g].name, reverse=True)
        for g in groups:
            _shutdown_quietly(g)
        if world.owned_store is not None:
            release_claim(world.owned_store)
        release_world(world)
        log.info("default process group destroyed")
        return
    _shutdown_quietly(pg)
    with world.lock:
        del world.groups[pg]
        twin = world.twin_of(pg)
        if twin is not None:
            del world.torch_twins[twin]
    if twin is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group(twin)


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
    """The number of process groups created in this world (torch's counter)."""
    world = current_world()
    return 0 if world is None else world.group_count


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
    """The rank in ``group`` of global rank ``global_rank`` (identity for the default group).

    As in torch, ``GroupMember.NON_GROUP_MEMBER`` stands for the latest group that ``new_group``
    left this rank out of.

    Raises:
        ValueError: ``global_rank`` is not a member, or ``group`` is not registered.
    """
    if _not_member(group):
        return group_rank_of(_non_member_ranks("get_group_rank"), global_rank, group)
    pg = _resolve(group)
    ranks = _rank_map(pg)
    return global_rank if ranks is None else group_rank_of(ranks, global_rank, pg)


def get_global_rank(group: ProcessGroup | int, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (identity for the default group).

    As in torch, ``GroupMember.NON_GROUP_MEMBER`` stands for the latest group that ``new_group``
    left this rank out of.

    Raises:
        ValueError: no such rank in ``group``, or ``group`` is not registered.
    """
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


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
) -> ProcessGroup | int | None:
    """Create a group of ``ranks`` (every rank of the default group must call it, in the same
    order, unless ``use_local_synchronization``).

    Each group gets its own store namespace and backend instance with group-local ranks.

    Args:
        ranks: the global ranks of the members (``None``: all).
        timeout: the group's operation deadline (default 30 minutes, as torch).
        backend: default: the default group's.
        pg_options: for extended-API plug-in backends.
        use_local_synchronization: only members call ``new_group``; non-members get ``None``.
        group_desc: a description (``group_desc`` of the group).
        device_id: must be ``None`` (CPU only).
        sort_ranks: sort ``ranks`` (group rank order) or keep the given order.

    Returns:
        The new ``ProcessGroup`` on members; ``GroupMember.NON_GROUP_MEMBER`` on the others
        (``None`` with ``use_local_synchronization``).

    Raises:
        ValueError: not initialized, duplicate or out-of-range ranks (torch's messages).
        TypeError: ``timeout`` is not a ``timedelta``.
    """
    world = _world()
    default = _default_group()
    if device_id is not None:
        raise ValueError(f"new_group: device_id {device_id} given; tdist drives CPU tensors only")
    dinfo = world.groups[default]
    backend_name = Backend(backend) if backend else dinfo.backend
    timeout = default_pg_timeout if timeout is None else timeout
    _check_valid_timeout(timeout)
    creator = _creator_for(backend_name, pg_options)
    global_rank = default.rank()
    if use_local_synchronization:
        if backend_name == Backend.MPI:
            raise ValueError("MPI backend doesn't support use_local_synchronization=True")
        if ranks is not None and global_rank not in ranks:
            return None
    members = new_group_ranks(ranks, default.size(), sort_ranks)
    with world.lock:
        if use_local_synchronization:
            key = tuple(members)
            count = world.local_sync_names.get(key, 0)
            world.local_sync_names[key] = count + 1
            text = "_".join(map(str, members)) + f"_{count}"
            name = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        else:
            name = str(world.group_count)
            world.group_count += 1
    member = global_rank in members
    pg = None
    if member:
        pg = _make_group(
            world, dinfo.store, members.index(global_rank), members, backend_name, creator, name,
            timeout, "undefined" if group_desc is None else group_desc,
        )
    # torch's default group runs on ours: hand out torch's twin, unless torch's new_group,
    # which sorts, would order the ranks otherwise
    if world.twin_of(default) is not None and members == sorted(members):
        from ._torch_pg import mirror_group

        twin = mirror_group(pg, members, timeout, group_desc, use_local_synchronization)
        if pg is not None:
            with world.lock:
                world.torch_twins[twin] = pg
            pg = twin
    if pg is None:
        with world.lock:
            world.non_member_ranks = {g: i for i, g in enumerate(members)}
        return NON_GROUP_MEMBER
    if os.getenv("TORCH_DIST_INIT_BARRIER", "0") == "1":
        if use_local_synchronization:
            _store_based_barrier(world.groups[pg].store, name, global_rank, len(members), timeout)
        else:
            _store_based_barrier(dinfo.store, name, global_rank, default.size(), timeout)
    return pg


def new_subgroups(
    group_size: int | None = None,
    group: GroupArg = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | int | None, list[ProcessGroup | int | None]]:
    """Cut ``group`` (default: everyone) into consecutive subgroups of ``group_size`` ranks.

    Returns:
        ``(the subgroup of this rank, all subgroups)``.

    Raises:
        ValueError: no ``group_size`` (there is no CUDA device count to default to), or one
            that is not positive or does not divide the world size.
    """
    if group_size is None:
        raise ValueError(
            "Default group size only takes effect when CUDA is available.If your subgroup using "
            "a backend that does not depend on CUDA,please pass in 'group_size' correctly."
        )
    lists = subgroup_rank_lists(get_process_group_ranks(group), group_size)
    return new_subgroups_by_enumeration(
        lists, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc
    )


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | int | None, list[ProcessGroup | int | None]]:
    """Create one subgroup per list of global ranks (the lists must not overlap).

    Returns:
        ``(the subgroup of this rank or None, all subgroups)``.

    Raises:
        ValueError: empty, or a rank in two lists (torch's messages).
    """
    check_disjoint(ranks_per_subgroup_list)
    me = get_rank()
    subgroups: list[ProcessGroup | int | None] = []
    mine: ProcessGroup | int | None = None
    for ranks in ranks_per_subgroup_list:
        sub = new_group(
            ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc
        )
        subgroups.append(sub)
        if me in ranks:
            mine = sub
            log.info("Rank %s is assigned to subgroup %s", me, list(ranks))
    return mine, subgroups


# -- point to point --------------------------------------------------------------------------------
def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: GroupArg = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work | None:
    """Send ``tensor`` to ``dst`` (a global rank; or ``group_dst``, a rank of ``group``) without
    waiting. Sending to oneself is allowed, as in torch.

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
        warn_not_in_group("isend", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    peer = _group_rank(pg, dst, group_dst)
    C.check_peer_rank(peer, pg.size(), "isend", "destination")
    return pg.send([C.real_view(t)], peer, tag)


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
    if _not_member(group):
        warn_not_in_group("send", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    peer = _group_rank(pg, dst, group_dst)
    C.check_not_self_rank(pg.rank(), peer, "destination")
    work = isend(t, group=pg, tag=tag, group_dst=peer)
    if work is not None:
        work.wait()


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
        ValueError: ``src`` is this rank (tdist raises; torch would hang), or not in ``group``.
        TypeError: ``tensor`` is not a tensor.
    """
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        warn_not_in_group("recv", _global_rank_or_minus_one())
        return -1
    pg = _resolve(group)
    if src is not None or group_src is not None:
        peer = _group_rank(pg, src, group_src)
        C.check_not_self_rank(pg.rank(), peer, "source")
        work = irecv(t, group=pg, tag=tag, group_src=peer)
        assert work is not None
        work.wait()
        return _to_global(pg, peer)
    work = irecv(t, group=pg, tag=tag)
    assert work is not None
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


# -- collectives -----------------------------------------------------------------------------------
def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``tensor`` of rank ``src`` (global; or ``group_src``) into ``tensor`` everywhere.

    Returns:
        The ``Work`` if ``async_op``, else ``None`` (also on a non-member).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``src`` not in ``group``; both/neither of ``src``/``group_src``.
        CollectiveArgumentError: the root is out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        warn_not_in_group("broadcast", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    root = _group_rank(pg, src, group_src)
    C.check_root_rank(root, pg.size(), "broadcast", "src")
    opts = _set_async(BroadcastOptions(rootRank=root, rootTensor=0), async_op)
    return _finish(pg.broadcast([C.real_view(t)], opts), async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` across the group, in place on every rank.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``op`` not a ``ReduceOp``.
        ValueError: an op that is meaningless on complex tensors (torch's message).
        CollectiveArgumentError: BAND/BOR/BXOR on a floating-point tensor.
    """
    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.sparse_coo:  # (as gloo)
        return _sparse_all_reduce(tensor, op, group, async_op)
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        warn_not_in_group("all_reduce", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    if t.is_complex():
        C.check_complex_op(red, [t], "all_reduce")
        t = torch.view_as_real(t)
    elif red >= RedOpType.BAND:
        C.check_bitwise_dtype(red, [t], "all_reduce")
    pg = _resolve(group)
    opts = AllreduceOptions()  # fields set directly: this is the latency-critical path
    opts.reduceOp = red
    opts.asyncOp = async_op
    return _finish(pg.allreduce([t], opts), async_op)


def _sparse_all_reduce(tensor: torch.Tensor, op: ReduceOp | RedOpType, group: GroupArg, async_op: bool) -> Work | None:
    """``all_reduce`` of a sparse COO tensor: the sum of every rank's entries (SUM only, as gloo);
    done before this returns (a completed Work if ``async_op``)."""
    if _not_member(group):
        warn_not_in_group("all_reduce", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    sparse_all_reduce(tensor, _red_op(op), pg.size(), lambda outs, inp: pg.allgather([outs], [inp]).wait())
    return Work.completed([tensor], "all_reduce") if async_op else None


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into rank ``dst``'s ``tensor``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError, ValueError, CollectiveArgumentError: as ``all_reduce`` and ``broadcast``.
    """
    t = C.as_tensor(tensor, "tensor")
    if _not_member(group):
        warn_not_in_group("reduce", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    C.check_complex_op(red, [t], "reduce")
    C.check_bitwise_dtype(red, [t], "reduce")
    pg = _resolve(group)
    root = _group_rank(pg, dst, group_dst)
    C.check_root_rank(root, pg.size(), "reduce", "dst")
    opts = _set_async(ReduceOptions(reduceOp=red, rootRank=root, rootTensor=0), async_op)
    return _finish(pg.reduce([C.real_view(t)], opts), async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``tensor_list[r]`` receives rank r's ``tensor``; sizes may differ per rank (tdist; gloo
    rejects that), as long as ``tensor_list[r]`` matches rank r's ``tensor``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not a list of tensors / not a tensor.
        ValueError: mixed dtypes (torch's message).
        CollectiveArgumentError: ``tensor_list`` does not have one entry per rank.
    """
    outs = C.as_tensor_list(tensor_list, "tensor_list")
    t = C.as_tensor(tensor, "tensor")
    C.ensure_same_dtype(outs, t)
    if _not_member(group):
        warn_not_in_group("all_gather", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    C.check_list_len(outs, pg.size(), "all_gather", "output tensor list")
    opts = _set_async(AllgatherOptions(), async_op)
    return _finish(pg.allgather([C.real_views(outs)], [C.real_view(t)], opts), async_op)


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor`` is every rank's ``input_tensor`` concatenated along dim 0 (shape
    ``(size * n, ...)``) or stacked (``(size, n, ...)``), in rank order.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: different dtypes.
        CollectiveArgumentError: ``output_tensor`` has neither shape.
    """
    out = C.as_tensor(output_tensor, "output_tensor")
    inp = C.as_tensor(input_tensor, "input_tensor")
    if _not_member(group):
        warn_not_in_group("all_gather_single", _global_rank_or_minus_one())
        return None
    C.ensure_same_dtype(out, inp)
    pg = _resolve(group)
    C.check_all_gather_single(out, inp, pg.size(), "all_gather_into_tensor")
    opts = _set_async(AllgatherOptions(), async_op)
    return _finish(pg._allgather_base(C.real_view(out), C.real_view(inp), opts), async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``all_gather_single`` under its older name (deprecated in torch 2.13, with its warning)."""
    _deprecated("all_gather_into_tensor", "all_gather_single")
    return all_gather_single(output_tensor, input_tensor, group, async_op)


def _all_gather_base(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``all_gather_single`` under torch's private name."""
    warnings.warn(
        "`torch.distributed._all_gather_base` is a private function and will be deprecated. "
        "Please use `torch.distributed.all_gather_single` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return all_gather_single(output_tensor, input_tensor, group, async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Rank ``dst`` (default global rank 0) receives every rank's ``tensor`` in ``gather_list``
    (given on ``dst`` only, same-sized tensors).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: ``gather_list`` missing on ``dst`` or given elsewhere; mixed dtypes.
        CollectiveArgumentError: wrong length or sizes, root out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    outs = C.as_tensor_list(gather_list, "gather_list") if gather_list else []
    C.ensure_same_dtype(t, outs)
    if _not_member(group):
        warn_not_in_group("gather", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    if dst is None and group_dst is None:
        dst = 0
    root = _group_rank(pg, dst, group_dst)
    C.check_root_rank(root, pg.size(), "gather", "dst")
    C.check_rooted_list(pg.rank(), root, outs, "gather", "gather_list", pg.size())
    C.check_same_numel(outs, t, "gather", "gather_list")
    opts = _set_async(GatherOptions(rootRank=root), async_op)
    output = [C.real_views(outs)] if pg.rank() == root else []
    return _finish(pg.gather(output, [C.real_view(t)], opts), async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Rank r's ``tensor`` receives ``scatter_list[r]`` of rank ``src`` (default global rank 0).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: ``scatter_list`` missing on ``src`` or given elsewhere; mixed dtypes.
        CollectiveArgumentError: wrong length or sizes, root out of range.
    """
    t = C.as_tensor(tensor, "tensor")
    ins = C.as_tensor_list(scatter_list, "scatter_list") if scatter_list else []
    C.ensure_same_dtype(t, ins)
    if _not_member(group):
        warn_not_in_group("scatter", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    if src is None and group_src is None:
        src = 0
    root = _group_rank(pg, src, group_src)
    C.check_root_rank(root, pg.size(), "scatter", "src")
    C.check_rooted_list(pg.rank(), root, ins, "scatter", "scatter_list", pg.size())
    C.check_same_numel(ins, t, "scatter", "scatter_list")
    opts = _set_async(ScatterOptions(rootRank=root), async_op)
    inputs = [C.real_views(ins)] if pg.rank() == root else []
    return _finish(pg.scatter([C.real_view(t)], inputs, opts), async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Rank r's ``output`` is the reduction over ranks of their ``input_list[r]``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError, ValueError: as ``all_reduce``; mixed dtypes.
        CollectiveArgumentError: ``input_list`` of the wrong length or sizes.
    """
    out = C.as_tensor(output, "output")
    ins = C.as_tensor_list(input_list, "input_list")
    C.ensure_same_dtype(out, ins)
    if _not_member(group):
        warn_not_in_group("reduce_scatter", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    C.check_complex_op(red, [out], "reduce_scatter")
    C.check_bitwise_dtype(red, [out], "reduce_scatter")
    pg = _resolve(group)
    C.check_list_len(ins, pg.size(), "reduce_scatter", "input tensor list")
    C.check_same_numel(ins, out, "reduce_scatter", "input_list")
    opts = _set_async(ReduceScatterOptions(reduceOp=red), async_op)
    return _finish(pg.reduce_scatter([C.real_view(out)], [C.real_views(ins)], opts), async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``input`` is ``size`` blocks (concatenated along dim 0, or stacked); rank r's
    ``output`` is the reduction over ranks of block r.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError, ValueError: as ``all_reduce``; different dtypes.
        CollectiveArgumentError: ``input`` is not ``size`` blocks of ``output``'s shape.
    """
    out = C.as_tensor(output, "output")
    inp = C.as_tensor(input, "input")
    if _not_member(group):
        warn_not_in_group("reduce_scatter_single", _global_rank_or_minus_one())
        return None
    C.ensure_same_dtype(out, inp)
    red = _red_op(op)
    C.check_complex_op(red, [out], "reduce_scatter")
    C.check_bitwise_dtype(red, [out], "reduce_scatter")
    pg = _resolve(group)
    C.check_reduce_scatter_single(out, inp, pg.size(), "reduce_scatter_tensor")
    opts = _set_async(ReduceScatterOptions(reduceOp=red), async_op)
    return _finish(pg._reduce_scatter_base(C.real_view(out), C.real_view(inp), opts), async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter_single`` under its older name (deprecated in torch 2.13, with its warning)."""
    _deprecated("reduce_scatter_tensor", "reduce_scatter_single")
    return reduce_scatter_single(output, input, op, group, async_op)


def _reduce_scatter_base(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter_single`` under torch's private name."""
    warnings.warn(
        "`torch.distributed._reduce_scatter_base` is a private function and will be deprecated. "
        "Please use `torch.distributed.reduce_scatter_single` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return reduce_scatter_single(output, input, op, group, async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``input_tensor_list[r]`` goes to rank r, which receives it in its
    ``output_tensor_list[me]``; sizes may differ per pair (tdist; gloo rejects that).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not lists of tensors.
        ValueError: mixed dtypes.
        CollectiveArgumentError: a list without one entry per rank.
    """
    if _not_member(group):
        warn_not_in_group("all_to_all", _global_rank_or_minus_one())
        return None
    outs = C.as_tensor_list(output_tensor_list, "output_tensor_list")
    ins = C.as_tensor_list(input_tensor_list, "input_tensor_list")
    C.ensure_same_dtype(outs, ins)
    pg = _resolve(group)
    C.check_list_len(outs, pg.size(), "all_to_all", "output tensor list")
    C.check_list_len(ins, pg.size(), "all_to_all", "input tensor list")
    opts = _set_async(AllToAllOptions(), async_op)
    return _finish(pg.alltoall(C.real_views(outs), C.real_views(ins), opts), async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0 (by ``input_split_sizes``, or equally), send part r to rank
    r, and concatenate what arrives into ``output`` (split by ``output_split_sizes``).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.

    Raises:
        TypeError: not tensors.
        ValueError: different dtypes.
        CollectiveArgumentError: split sizes that do not fit dim 0 or the group.
    """
    if _not_member(group):
        warn_not_in_group("all_to_all_single", _global_rank_or_minus_one())
        return None
    out = C.as_tensor(output, "output")
    inp = C.as_tensor(input, "input")
    C.ensure_same_dtype(out, inp)
    pg = _resolve(group)
    out_splits = C.check_split_sizes(out, output_split_sizes, pg.size(), "all_to_all_single", "output")
    in_splits = C.check_split_sizes(inp, input_split_sizes, pg.size(), "all_to_all_single", "input")
    opts = _set_async(AllToAllOptions(), async_op)
    work = pg.alltoall_base(C.real_view(out), C.real_view(inp), out_splits, in_splits, opts)
    return _finish(work, async_op)


def barrier(
    group: GroupArg = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: timedelta | None = None,
) -> Work | None:
    """Wait until every rank of ``group`` has called ``barrier``.

    Args:
        group: the group (default: the default group).
        async_op: return a ``Work`` instead of waiting.
        device_ids: accepted for compatibility (CPU only).
        timeout: this barrier's deadline (default: the group's).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    if _not_member(group):
        warn_not_in_group("barrier", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    opts = BarrierOptions()
    if timeout is not None:
        opts.timeout = _check_valid_timeout(timeout)
    if isinstance(device_ids, list):
        opts.device_ids = device_ids
    return _finish(pg.barrier(_set_async(opts, async_op)), async_op)


def monitored_barrier(
    group: GroupArg = None,
    timeout: timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 waits for every other rank; on failure it raises ``"[Rank 0]: Rank 1 failed to
    pass monitoredBarrier in 1000 ms"`` (with ``wait_all_ranks``, ``"Ranks 1, 2 failed ..."``),
    as torch does, and tells the ranks that did arrive, which raise the same verdict.

    Args:
        group: the group (default: the default group).
        timeout: a ``timedelta`` (a float is taken as seconds, with torch's warning); default:
            the group's timeout.
        wait_all_ranks: collect every missing rank instead of failing at the first.

    A group of ``torch.distributed`` on the ``tdist`` backend is served too: torch's own
    ``monitored_barrier`` refuses every backend but gloo by name.

    Raises:
        DistBackendError: ranks did not arrive in time.
        TypeError: ``timeout`` is neither a ``timedelta`` nor a float.
    """
    if _from_torch(group) is None and isinstance(group, torch.distributed.ProcessGroup):
        if isinstance(timeout, float | int):
            timeout = timedelta(seconds=timeout)
        group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)  # (None: the group's own)
        return
    if _not_member(group):
        warn_not_in_group("monitored_barrier", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    if isinstance(timeout, float):
        warnings.warn(
            "Please specify timeout arg as a timedelta. "
            f"Converting current value of {timeout} assuming it represents seconds",
            stacklevel=2,
        )
        timeout = timedelta(seconds=timeout)
    if timeout is not None:
        _check_valid_timeout(timeout)
    pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


# -- deprecated and multi-device forms ---------------------------------------------------------
def all_reduce_coalesced(
    tensors: torch.Tensor | list[torch.Tensor],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Any:
    """All-reduce several tensors of one dtype in one exchange (deprecated in torch).

    Returns:
        A ``torch.futures.Future`` if ``async_op`` (as torch), else ``None``.
    """
    warnings.warn(
        "`torch.distributed.all_reduce_coalesced` will be deprecated. If you must use it, please "
        "revisit our documentation later at "
        "https://pytorch.org/docs/main/distributed.html#collective-functions",
        FutureWarning,
        stacklevel=2,
    )
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    ts = C.as_tensor_list(tensors, "tensor")
    C.ensure_same_dtype(ts)
    if _not_member(group):
        warn_not_in_group("all_reduce_coalesced", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    C.check_complex_op(red, ts, "all_reduce")
    C.check_bitwise_dtype(red, ts, "all_reduce")
    pg = _resolve(group)
    opts = _set_async(AllreduceCoalescedOptions(reduceOp=red), async_op)
    work = pg.allreduce_coalesced(C.real_views(ts), opts)
    if async_op:
        return work.get_future()
    work.wait()
    return None


def all_gather_coalesced(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: GroupArg = None,
    async_op: bool = False,
) -> Any:
    """``output_tensor_lists[r][i]`` receives rank r's ``input_tensor_list[i]`` (deprecated in
    torch).

    Returns:
        A ``torch.futures.Future`` if ``async_op`` (as torch), else ``None``.
    """
    warnings.warn(
        "`torch.distributed.all_gather_coalesced` will be deprecated. If you must use it, please "
        "revisit our documentation later at "
        "https://pytorch.org/docs/main/distributed.html#collective-functions",
        FutureWarning,
        stacklevel=2,
    )
    if _not_member(group):
        warn_not_in_group("all_gather_coalesced", _global_rank_or_minus_one())
        return None
    ins = C.as_tensor_list(input_tensor_list, "input_tensor_list")
    C.ensure_same_dtype(ins)
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    outs = [C.as_tensor_list(lst, "output_tensor_lists") for lst in output_tensor_lists]
    for lst in outs:
        C.ensure_same_dtype(lst)
    C.ensure_same_dtype(ins, [t for lst in outs for t in lst])
    pg = _resolve(group)
    C.check_list_len(outs, pg.size(), "all_gather_coalesced", "output_tensor_lists")
    opts = _set_async(AllgatherOptions(), async_op)
    work = pg.allgather_coalesced([C.real_views(lst) for lst in outs], C.real_views(ins), opts)
    if async_op:
        return work.get_future()
    work.wait()
    return None


def _local_reduce(tensors: Sequence[torch.Tensor], op: RedOpType) -> torch.Tensor:
    """The element-wise reduction of ``tensors`` on this rank (a new tensor); AVG is the mean."""
    acc = tensors[0].detach().clone()
    for t in tensors[1:]:
        reduce_into(acc, t, op)
    if op == RedOpType.AVG and len(tensors) > 1:
        acc.div_(len(tensors))
    return acc


def _copy_out(work: Work, src: torch.Tensor, dsts: Sequence[torch.Tensor], op: str, async_op: bool) -> Work | None:
    def finish() -> list[torch.Tensor]:
        for d in dsts:
            if d is not src:
                d.detach().copy_(src)
        return list(dsts)

    return _finish(chain_work([work], op, finish), async_op)


def all_reduce_multigpu(
    tensor_list: list[torch.Tensor],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """All-reduce over every tensor of ``tensor_list`` on every rank; each receives the result.

    Every rank passes the same number of tensors (any device, CPU included).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ts = C.as_tensor_list(tensor_list, "tensor_list")
    if not ts:
        raise ValueError("all_reduce_multigpu: tensor_list is empty")
    C.ensure_same_dtype(ts)
    if _not_member(group):
        warn_not_in_group("all_reduce_multigpu", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    local = _local_reduce(ts, red)
    work = all_reduce(local, red, group, async_op=True)
    assert work is not None
    return _copy_out(work, local, ts, "all_reduce_multigpu", async_op)


def broadcast_multigpu(
    tensor_list: list[torch.Tensor],
    src: int,
    group: GroupArg = None,
    async_op: bool = False,
    src_tensor: int = 0,
) -> Work | None:
    """Copy ``tensor_list[src_tensor]`` of rank ``src`` into every tensor of every rank.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ts = C.as_tensor_list(tensor_list, "tensor_list")
    if not 0 <= src_tensor < len(ts):
        raise ValueError(f"broadcast_multigpu: src_tensor {src_tensor} is not an index of tensor_list")
    if _not_member(group):
        warn_not_in_group("broadcast_multigpu", _global_rank_or_minus_one())
        return None
    lead = ts[src_tensor]
    work = broadcast(lead, src, group, async_op=True)
    assert work is not None
    return _copy_out(work, lead, ts, "broadcast_multigpu", async_op)


def reduce_multigpu(
    tensor_list: list[torch.Tensor],
    dst: int,
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
    dst_tensor: int = 0,
) -> Work | None:
    """Reduce every tensor of every rank into ``tensor_list[dst_tensor]`` of rank ``dst``.

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ts = C.as_tensor_list(tensor_list, "tensor_list")
    if not 0 <= dst_tensor < len(ts):
        raise ValueError(f"reduce_multigpu: dst_tensor {dst_tensor} is not an index of tensor_list")
    C.ensure_same_dtype(ts)
    if _not_member(group):
        warn_not_in_group("reduce_multigpu", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    local = _local_reduce(ts, red)
    work = reduce(local, dst, red, group, async_op=True)
    assert work is not None
    pg = _resolve(group)
    is_root = _to_global(pg, pg.rank()) == dst
    return _copy_out(work, local, [ts[dst_tensor]] if is_root else [], "reduce_multigpu", async_op)


def all_gather_multigpu(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Every ``output_tensor_lists[i]`` receives, at ``r * k + j``, rank r's
    ``input_tensor_list[j]`` (``k`` tensors per rank).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    ins = C.as_tensor_list(input_tensor_list, "input_tensor_list")
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    outs = [C.as_tensor_list(lst, "output_tensor_lists") for lst in output_tensor_lists]
    if _not_member(group):
        warn_not_in_group("all_gather_multigpu", _global_rank_or_minus_one())
        return None
    pg = _resolve(group)
    k, size = len(ins), pg.size()
    if len(outs) != k or any(len(lst) != k * size for lst in outs):
        raise C.CollectiveArgumentError(
            f"all_gather_multigpu: expected {k} output lists (one per input tensor) of "
            f"{k * size} tensors (inputs per rank x group size), got {[len(x) for x in outs]}"
        )
    if k == 0:
        return _finish(Work.completed([], "all_gather_multigpu"), async_op)
    works = []
    for j in range(k):
        target = [outs[0][r * k + j] for r in range(size)]
        w = all_gather(target, ins[j], group, async_op=True)
        assert w is not None
        works.append(w)

    def finish() -> list[torch.Tensor]:
        for lst in outs[1:]:
            for d, s in zip(lst, outs[0], strict=True):
                d.detach().copy_(s)
        return [t for lst in outs for t in lst]

    return _finish(chain_work(works, "all_gather_multigpu", finish), async_op)


def reduce_scatter_multigpu(
    output_tensor_list: list[torch.Tensor],
    input_tensor_lists: list[list[torch.Tensor]],
    op: ReduceOp | RedOpType = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_list[j]`` of rank r receives the reduction over every rank and every
    ``i`` of ``input_tensor_lists[i][r * k + j]`` (``k`` tensors per rank).

    Returns:
        The ``Work`` if ``async_op``, else ``None``.
    """
    outs = C.as_tensor_list(output_tensor_list, "output_tensor_list")
    if not isinstance(input_tensor_lists, list):
        raise TypeError("Invalid function argument: input_tensor_lists should be a list")
    ins = [C.as_tensor_list(lst, "input_tensor_lists") for lst in input_tensor_lists]
    if _not_member(group):
        warn_not_in_group("reduce_scatter_multigpu", _global_rank_or_minus_one())
        return None
    red = _red_op(op)
    pg = _resolve(group)
    k, size = len(outs), pg.size()
    if len(ins) != k or any(len(lst) != k * size for lst in ins):
        raise C.CollectiveArgumentError(
            f"reduce_scatter_multigpu: expected {k} input lists (one per output tensor) of "
            f"{k * size} tensors (outputs per rank x group size), got {[len(x) for x in ins]}"
        )
    if k == 0:
        return _finish(Work.completed([], "reduce_scatter_multigpu"), async_op)
    local = [_local_reduce([lst[c] for lst in ins], red) for c in range(k * size)]
    works = []
    for j in range(k):
        w = reduce_scatter(outs[j], [local[r * k + j] for r in range(size)], red, group, async_op=True)
        assert w is not None
        works.append(w)
    return _finish(chain_work(works, "reduce_scatter_multigpu", lambda: list(outs)), async_op)


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
    if _not_member(group):
        warn_not_in_group("gather_object", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    if dst is None and group_dst is None:
        dst = 0
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
    if _not_member(group):
        warn_not_in_group("broadcast_object_list", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    if src is None and group_src is None:
        src = 0
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
    if _not_member(group):
        warn_not_in_group("scatter_object_list", _global_rank_or_minus_one())
        return
    pg = _resolve(group)
    if src is None and group_src is None:
        src = 0
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
        ValueError: ``dst`` is this rank.
    """
    if _not_member(group):
        warn_not_in_group("send_object_list", _global_rank_or_minus_one())
        return
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


def _destroy_all_worlds_for_tests() -> None:
    """Destroy the world this thread sees, if any (test fixtures' clean-up)."""
    while current_world() is not None:
        try:
            destroy_process_group()
        except Exception as exc:
            log.warning("cleaning up a process group failed: %s", exc)
            break

