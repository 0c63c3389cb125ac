"""The names of ``tdist``'s top level (``dist.init_process_group``, ``dist.TCPStore``...).

``tdist/__init__.py`` loads them from here on first use.
"""

from ._core.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
)
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .store._rendezvous import register_rendezvous_handler, rendezvous

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "QueueEmptyError",
    "Store",
    "TCPStore",
    "register_rendezvous_handler",
    "rendezvous",
]

# -- process groups and collectives: the module-level API of torch.distributed --------------------
from .c10d._api import (
    SHRINK_ABORT,
    SHRINK_DEFAULT,
    AllreduceCoalescedOptions,
    P2POp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_multigpu,
    all_gather_object,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_reduce_multigpu,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_multigpu,
    broadcast_object_list,
    default_pg_timeout,
    destroy_process_group,
    dist_backend,
    gather,
    gather_object,
    get_backend,
    get_backend_config,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    irecv,
    is_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    isend,
    monitored_barrier,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    recv,
    recv_object_list,
    reduce,
    reduce_multigpu,
    reduce_scatter,
    reduce_scatter_multigpu,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    scatter_object_list,
    send,
    send_object_list,
    shrink_group,
    split_group,
)
from .c10d._api import (
    _all_gather_base as _all_gather_base,
)
from .c10d._api import (
    _clear_group_cache as _clear_group_cache,
)
from .c10d._api import (
    _coalescing_manager as _coalescing_manager,
)
from .c10d._api import (
    _CoalescingManager as _CoalescingManager,
)
from .c10d._api import (
    _reduce_scatter_base as _reduce_scatter_base,
)
from .c10d._api import (
    _register_stream as _register_stream,
)
from .c10d._backend_config import (
    Backend,
    BackendConfig,
    get_default_backend_for_device,
    is_backend_available,
)
from .c10d._checks import supports_complex
from .c10d._debug import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from .c10d._group import GroupMember, ProcessGroup, group
from .c10d._profiling import record_comm
from .c10d._types import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
)

__all__ += [
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "AllToAllOptions",
    "AllgatherOptions",
    "AllreduceCoalescedOptions",
    "AllreduceOptions",
    "Backend",
    "BackendConfig",
    "BarrierOptions",
    "BroadcastOptions",
    "DebugLevel",
    "GatherOptions",
    "GroupMember",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "ReduceOptions",
    "ReduceScatterOptions",
    "ScatterOptions",
    "Work",
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
    "get_debug_level",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
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
    "record_comm",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_multigpu",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "set_debug_level",
    "set_debug_level_from_env",
    "shrink_group",
    "split_group",
    "supports_complex",
]

# -- debugging one rank, and torch's device meshes (which run on tdist's groups) ------------------
import functools  # noqa: E402
from typing import Any  # noqa: E402

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh  # noqa: E402

from ._aliases import default_world_on_tdist as _default_world_on_tdist  # noqa: E402
from .c10d._breakpoint import breakpoint  # noqa: E402


@functools.wraps(_torch_init_device_mesh)
def init_device_mesh(*args: Any, **kwargs: Any) -> DeviceMesh:
    # torch's, except that the world group it forms when there is none is tdist's (as for a
    # program that imports tdist.device_mesh: tdist._aliases.default_world_on_tdist)
    _default_world_on_tdist()
    return _torch_init_device_mesh(*args, **kwargs)


__all__ += ["DeviceMesh", "breakpoint", "init_device_mesh"]

# -- torch's own classes and helpers that DDP, its comm hooks and libraries name through
# torch.distributed (``def hook(state, bucket: dist.GradBucket)``, which DDP checks is torch's
# class): the same objects, as they belong to torch's autograd and DDP, not to a transport --------
import torch as _torch  # noqa: E402
from torch._C._distributed_c10d import _DEFAULT_FIRST_BUCKET_BYTES as _DEFAULT_FIRST_BUCKET_BYTES  # noqa: E402
from torch._C._distributed_c10d import BuiltinCommHookType, GradBucket, Logger, Reducer  # noqa: E402
from torch._C._distributed_c10d import _broadcast_coalesced as _broadcast_coalesced  # noqa: E402
from torch._C._distributed_c10d import (  # noqa: E402
    _compute_bucket_assignment_by_size as _compute_bucket_assignment_by_size,
)
from torch._C._distributed_c10d import _make_nccl_premul_sum as _make_nccl_premul_sum  # noqa: E402
from torch._C._distributed_c10d import _register_builtin_comm_hook as _register_builtin_comm_hook  # noqa: E402
from torch._C._distributed_c10d import _register_comm_hook as _register_comm_hook  # noqa: E402
from torch._C._distributed_c10d import (  # noqa: E402
    _verify_params_across_processes as _verify_params_across_processes,
)

# torch's reduction vocabulary itself, so that an op goes both ways: tdist's functions take
# torch's (``as_red_op``) and torch's take tdist's (``tdist.ReduceOp.MAX`` is torch's)
from torch.distributed import ReduceOp as ReduceOp  # noqa: E402
from torch.distributed import reduce_op as reduce_op  # noqa: E402
from torch.distributed.distributed_c10d import GroupName, ProcessGroupGloo  # noqa: E402
from torch.distributed.remote_device import _remote_device as _remote_device  # noqa: E402

RankType = int | _torch.SymInt  # (torch.distributed's alias)

__all__ += ["BuiltinCommHookType", "GradBucket", "GroupName", "Logger", "ProcessGroupGloo", "RankType", "Reducer"]
#: torch's private names of the section above, which ``tdist`` has as well (not in ``__all__``)
TORCH_PRIVATE = (
    "_DEFAULT_FIRST_BUCKET_BYTES", "_broadcast_coalesced", "_compute_bucket_assignment_by_size",
    "_make_nccl_premul_sum", "_register_builtin_comm_hook", "_register_comm_hook", "_remote_device",
    "_verify_params_across_processes",
)

# -- torch 0.3's master-worker mode (its API for the master: tdist.master_worker) -----------------
from ._master_worker import init_master_worker  # noqa: E402

__all__ += ["init_master_worker"]

from . import distributed_c10d as distributed_c10d  # noqa: E402  (torch's module path; needs the names above)
