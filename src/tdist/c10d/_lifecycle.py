"""The life cycle of process groups: ``init_process_group``, ``new_group`` (and subgroups),
``destroy_process_group``.

Making a group builds its store namespace (torch's key layout: ``"<name>/"`` inside the base
store, the backend's ``"cpu/"`` inside that), its backend (a built-in one, or a plug-in
registered with ``Backend.register_backend``), its ``ProcessGroup`` handle, and registers it
in this thread's ``World`` (``_group``). Where torch is loaded, the default group and the groups
``new_group`` hands out get torch twins (``_torch_pg``), so torch's own code runs on them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from .._core.errors import DistBackendError
from ..constants import default_pg_timeout
from ..store import PrefixStore, Store
from ..store._rendezvous import release_claim, rendezvous
from ..store._tcp import serving_in_a_thread
from ._backend import Backend as BackendImpl
from ._backend import backend_creator
from ._backend_config import Backend, BackendConfig, implementation_for
from ._debug import CollectiveChecker, DebugLevel, get_debug_level
from ._group import (
    NON_GROUP_MEMBER,
    GroupInfo,
    ProcessGroup,
    World,
    check_disjoint,
    current_world,
    is_ours,
    new_group_ranks,
    new_world,
    publish_world,
    release_world,
    subgroup_rank_lists,
    thread_has_world,
    thread_isolated,
)
from ._world import (
    GroupArg,
    _check_valid_timeout,
    _default_group,
    _from_torch,
    _not_member,
    _world,
    get_process_group_ranks,
    get_rank,
)

__all__ = [
    "default_pg_timeout",
    "destroy_process_group",
    "init_process_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
]

log = logging.getLogger(__name__)



class _DistributedBackendOptions:
    """What an extended-API backend creator receives (torch's ``_DistributedBackendOptions``)."""

    def __init__(
        self, store: Any, group_rank: int, group_size: int, timeout: timedelta, group_id: str,
        global_ranks_in_group: list[int],
    ) -> None:
        self.store = store
        self.group_rank = group_rank
        self.group_size = group_size
        self.timeout = timeout
        self.group_id = group_id
        self.global_ranks_in_group = global_ranks_in_group


# (store, rank, size, timeout, name, global ranks, ``gone``: why a member is known gone, or None)
_Creator = Callable[[Store, int, int, timedelta, str, list[int], Callable[[int], str | None] | None], BackendImpl]


def mpi4py_installed() -> bool:
    """Whether mpi4py can be imported (looked up, not imported: importing it starts MPI)."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


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
            store: Store, rank: int, size: int, timeout: timedelta, name: str, ranks: list[int],
            gone: Callable[[int], str | None] | None = None,
        ) -> BackendImpl:
            from ._foreign_backend import ForeignBackend, is_torchs
            from ._torch_pg import StoreForTorch

            # (a torch Store, as torch's own init_process_group hands its creators: one of
            # torch's backends, a C++ extension's, takes nothing else; tdist's take it too)
            given = StoreForTorch(store)
            if extended:
                opts = _DistributedBackendOptions(given, rank, size, timeout, name, ranks)
                backend_obj = fn(opts, pg_options)
            else:
                backend_obj = fn(given, rank, size, timeout)
            if is_torchs(backend_obj):  # (it takes torch's options, and gives torch's works)
                return ForeignBackend(backend_obj, rank, size)
            result: BackendImpl = backend_obj
            return result

        return make_plugin
    creator = backend_creator(impl)
    if creator is None and impl == Backend.MPI and mpi4py_installed():
        from ._mpi_backend import ProcessGroupMPI

        return ProcessGroupMPI.create
    if creator is None and impl == Backend.TCP:
        from . import _tcp_backend  # noqa: F401  (registers "tcp" and "gloo")

        creator = backend_creator(impl)
    if creator is None:
        if impl == Backend.TCP:
            raise RuntimeError("the tcp backend did not register itself (tdist.c10d._tcp_backend)")
        if impl == Backend.MPI:
            raise RuntimeError(
                "Distributed package doesn't have MPI built in: tdist's mpi backend runs on "
                "mpi4py, which is not installed (pip install 'tdist[mpi]', or mpi4py with an MPI "
                "library)"
            )
        raise AssertionError(
            f"Unknown c10d backend type {impl.upper()}; use gloo (or tcp), or register one "
            "with Backend.register_backend"
        )
    found = creator

    def make(
        store: Store, rank: int, size: int, timeout: timedelta, name: str, ranks: list[int],
        gone: Callable[[int], str | None] | None = None,
    ) -> BackendImpl:
        if getattr(found, "takes_gone", False):
            return found(store, rank, size, timeout, name=name, gone=gone)  # type: ignore[call-arg]
        return found(store, rank, size, timeout)

    return make


def _gone_in_world(world: World, ranks: list[int]) -> Callable[[int], str | None] | None:
    """For a new group of global ``ranks`` in ``world``: ``gone(group_rank)``, why the default
    group knows that member gone (its process died, or it left), else None. For the default
    group itself (none yet): why its rendezvous knows the process that claimed the rank gone
    (``claims_gone``: in this pid space), where a rendezvous made the store."""
    default = world.default_pg
    if default is None:
        from ..store._rendezvous import claims_gone

        return claims_gone(world.owned_store, len(ranks)) if world.owned_store is not None else None

    def gone(group_rank: int) -> str | None:
        try:
            impl = default._impl()
            lost = getattr(impl, "lost_peers", None)
            if lost is None:
                return None
            why: str | None = lost().get(ranks[group_rank])
            return why
        except Exception:  # (a destroyed default group: nothing known)
            return None

    return gone


def _display_name(backend: str, impl: BackendImpl) -> str:
    """What ``ProcessGroup.name()`` says: ``"gloo"`` where our tcp backend stands in for it
    (``"tdist"`` where it was asked for by that name, as torch's group of it says)."""
    if implementation_for(backend) == Backend.TCP and Backend(backend) not in (Backend.TCP, Backend.TDIST):
        return Backend.GLOO
    if Backend(backend) == Backend.TDIST:
        return Backend.TDIST
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
    impl = creator(
        PrefixStore("cpu/", prefix_store), group_rank, size, timeout, name, global_ranks,
        _gone_in_world(world, global_ranks),
    )
    recorder = getattr(impl, "flight_recorder", None)
    if recorder is not None:  # (the flight record names the group as torch's does)
        recorder.identify(name, desc, global_ranks)
    checker = None
    if get_debug_level() == DebugLevel.DETAIL:
        checker = CollectiveChecker(
            PrefixStore("tdist_debug", prefix_store), group_rank, size, timeout, name,
            lost=getattr(impl, "lost_peers", None), broken=getattr(impl, "broken_by", None),
            fail=getattr(impl, "break_group", None),
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


def _incarnation(store: Store, rank: int, joined: int | None = None) -> int:
    """How many times rank ``rank`` has made a default group on ``store`` (this one included).

    A group made again on the same store after ``destroy_process_group`` gets a fresh key
    namespace from it, so no rank can read a key its predecessor left behind. Every rank counts
    its own, so ranks agree as long as they all re-initialize together. A store that a
    rendezvous made has that count already (``joined``: the round of its checked join, which
    every rank of the group shares by construction): no store round trip.
    """
    if joined is not None:
        return joined
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
    _ranks: list[int] | None = None,
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
        _ranks: torch's: the group's ranks, whose hash then names the group (not ``"0"``).

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
        if not isinstance(store, Store):  # (torch's store, made by code not ported yet)
            from ..store._foreign import as_store

            store = as_store(store)
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
        if implementation_for(backend_name) == Backend.MPI and creator is not None and mpi4py_installed():
            # (rank and world size are MPI's; the store too, unless a rendezvous was asked for)
            from ._mpi_backend import mpi_world, mpi_world_store

            # (MASTER_ADDR alone, without MASTER_PORT, is no rendezvous asked for: torch's MPI
            # backend reads neither)
            asked = store is not None or init_method != "env://" or {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys()
            if not asked:
                store, rank, world_size = mpi_world_store(rank, world_size, timeout)
                world.owned_store = store
                store = PrefixStore("default_pg", store)
            else:
                rank, world_size = mpi_world(rank, world_size)
        joined: int | None = None
        if store is None:
            assert init_method is not None
            # rank 0 hosts the group's store in a thread, as torch does: a process of its own
            # costs tens of milliseconds to start, and a group's store is busy only while
            # groups form (under ``tdist run`` the launcher's store serves instead)
            with serving_in_a_thread():
                store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            world.owned_store = store  # (its claim of this rank goes with the group)
            joined = getattr(store, "_rdzv_round", None)
            store = PrefixStore("default_pg", store)
        if not 0 <= rank < world_size:
            raise ValueError(
                f"Invalid rank {rank} for world size {world_size}: ranks go from 0 to world_size - 1"
            )
        incarnation = _incarnation(store, rank, joined)
        if incarnation > 1:
            store = PrefixStore(f"tdist_incarnation_{incarnation}", store)
        if _ranks:  # (as torch: the hash of the ranks and of the number of groups, none yet)
            text = "_".join([*map(str, _ranks), str(len(world.groups))])
            name = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        else:
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

            twin = mirror_default_group(pg, PrefixStore("torch", store), timeout, _ranks)
            if twin is not None:
                world.torch_twins[twin] = pg
    except BaseException:
        for g in list(world.groups):
            _shutdown_quietly(g)
        if world.owned_store is not None:
            # (as ``destroy_process_group`` does: a store served from a thread here retires,
            # answering the other ranks, which learn of this failure through it, until they
            # have left, even while this process exits)
            release_claim(world.owned_store)
            with contextlib.suppress(Exception):
                world.owned_store.close()  # type: ignore[attr-defined]
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
        AssertionError: ``None`` with nothing to destroy (torch's type).
        ValueError: ``group`` is not a live group of this world (torch's message), also when
            the default group is gone already.
    """
    if _not_member(group):
        return
    world = current_world()
    if world is None:
        if group is not None:  # (torch looks it up in its map of groups, empty now)
            raise ValueError("Invalid process group specified")
        raise AssertionError(
            "Process group cannot be None: the default process group has not been initialized "
            "(or was destroyed already)"
        )
    pg = world.default_pg if group is None else _from_torch(group) or group
    if not is_ours(pg) or pg not in world.groups:
        raise ValueError("Invalid process group specified")
    if world.adopted is not None:  # (torch's groups, torch's to destroy: it shuts them down)
        twin, everything = world.twin_of(pg), pg is world.default_pg
        if everything:
            release_world(world)
        else:
            with world.lock:
                del world.groups[pg]
                world.torch_twins.pop(twin, None)
        torch.distributed.destroy_process_group(None if everything else twin)
        return
    if pg is world.default_pg:
        from ._torch_pg import forget_default_group

        forget_default_group(pg)
        with world.lock:
            groups = sorted(world.groups, key=lambda g: world.groups[g].name, reverse=True)
        for g in groups:
            _shutdown_quietly(g)
        store = world.owned_store
        if store is not None:
            release_claim(store)
            # Closed now, not when the collector finds it (it sits in reference cycles): a
            # store served from a thread here retires, answering the other ranks until they
            # have left, even while this process exits (its finalization stops the thread).
            with contextlib.suppress(Exception):
                store.close()  # type: ignore[attr-defined]
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


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
    *,
    _split: bool = False,
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
    if world.adopted is not None:  # (torch's world: torch makes the group, tdist's functions take it)
        return torch.distributed.new_group(  # type: ignore[no-any-return]
            ranks, timeout, backend, pg_options, use_local_synchronization, group_desc, None, sort_ranks
        )
    dinfo = world.groups[default]
    backend_name = Backend(backend) if backend else dinfo.backend
    timeout = default_pg_timeout if timeout is None else timeout
    _check_valid_timeout(timeout)
    creator = _creator_for(backend_name, pg_options)
    global_rank = default.rank()
    if use_local_synchronization:
        if backend_name == Backend.MPI and not _split:  # (torch's rule; a split's members make
            # the communicator alone, as MPI lets them: ``split_group`` works on every backend)
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
    twinned = world.twin_of(default) is not None
    if twinned and members != sorted(members) and not use_local_synchronization:
        with world.lock:
            world.untwinned_count += 1
    if twinned and members == sorted(members):
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


def _destroy_all_worlds_for_tests() -> None:
    """Destroy the world this thread sees, if any (test fixtures' clean-up)."""
    while current_world() is not None:
        try:
            destroy_process_group()
        except Exception as exc:
            log.warning("cleaning up a process group failed: %s", exc)
            break

