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

This module only gathers the names; they live in ``_world`` (resolving groups and ranks, the
rank and group queries, availability), ``_lifecycle`` (``init_process_group``, ``new_group``,
``destroy_process_group``), ``_p2p`` (``send``/``recv``, ``batch_isend_irecv``),
``_collectives`` (``all_reduce`` and the other collectives, ``barrier``), ``_legacy`` (the
deprecated coalesced and ``*_multigpu`` forms, torch 0.3's names) and ``_objects`` (the object collectives).
"""

from __future__ import annotations

from ._collectives import _all_gather_base as _all_gather_base
from ._collectives import _coalescing_manager as _coalescing_manager
from ._collectives import _CoalescingManager as _CoalescingManager
from ._collectives import _reduce_scatter_base as _reduce_scatter_base
from ._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from ._legacy import (
    AllreduceCoalescedOptions,
    all_gather_coalesced,
    all_gather_multigpu,
    all_reduce_coalesced,
    all_reduce_multigpu,
    broadcast_multigpu,
    dist_backend,
    reduce_multigpu,
    reduce_scatter_multigpu,
)
from ._legacy import _clear_group_cache as _clear_group_cache
from ._legacy import _register_stream as _register_stream
from ._lifecycle import _destroy_all_worlds_for_tests as _destroy_all_worlds_for_tests
from ._lifecycle import (
    default_pg_timeout,
    destroy_process_group,
    init_process_group,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from ._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ._p2p import (
    P2POp,
    batch_isend_irecv,
    irecv,
    isend,
    recv,
    send,
)
from ._reshape import SHRINK_ABORT, SHRINK_DEFAULT, shrink_group, split_group
from ._world import _default_group as _default_group
from ._world import _not_member as _not_member
from ._world import (
    get_backend,
    get_backend_config,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    is_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
)

__all__ = [
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
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
    "dist_backend",
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
    "shrink_group",
    "split_group",
]
