"""Code written for torch.distributed ports by changing its imports: every public name of
torch's modules that tdist covers exists in tdist's module of the same path."""

from __future__ import annotations

import importlib
import warnings

import pytest

# torch names outside tdist's scope (device meshes, DDP's reducer, newer group surgery, ZeRO,
# torch's internal helpers), each with the reason
NOT_COVERED = {
    "torch.distributed": {
        "device_mesh",  # torch's module (its DeviceMesh and init_device_mesh are tdist's names too)
        "record_comm",
        "algorithms", "c10d_logger", "config", "logging_handlers",
        "remote_device", "utils", "RankType",
        "fsdp", "nn", "tensor",  # torch's own modules on our backend (issue 17), once imported
        "log", "logging", "sys", "timedelta", "torch", "traceback", "typing",  # torch's own imports
    },
    "torch.distributed.distributed_c10d": {"record_comm"},
    "torch.distributed.rpc": {"AllGatherStates", "method_factory", "new_method"},  # api internals
    "torch.distributed.rpc.api": {"AllGatherStates", "method_factory", "new_method"},
    "torch.distributed.nn": {"Function", "ReduceOp", "group", "dist", "torch", "warnings", "jit"},  # its imports
    "torch.distributed.nn.functional": {"Function", "ReduceOp", "group", "dist", "torch", "warnings"},  # its imports
    "torch.distributed.elastic.metrics": {"Optional"},  # its imports
    "torch.distributed.elastic.events": {"Optional", "inspect", "logging", "os", "socket", "traceback"},
    "torch.distributed.elastic.events.handlers": {"logging"},
    "torch.distributed.elastic.utils.api": {"Any", "Template", "os", "socket"},  # its imports
    # a context manager of torch's workers' libc-level redirects (tdist's children get files at birth)
    "torch.distributed.elastic.multiprocessing.api": {"get_std_cm"},
    "torch.distributed.elastic.agent.server": {"health_check_server"},
    # torch's imports, and its helper that sleeps a random while between compare-and-sets
    "torch.distributed.elastic.rendezvous.etcd_store": {"Store", "b64decode", "b64encode", "cas_delay", "datetime", "etcd", "random", "time"},
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend": {  # its imports
        "Any", "FileStore", "NodeState", "RendezvousBackend", "RendezvousConnectionError", "RendezvousError",
        "RendezvousParameters", "RendezvousStateError", "Store", "TCPStore", "Token", "b64decode", "b64encode",
        "binascii", "cast", "construct_and_record_rdzv_event", "logger", "logging", "os", "parse_rendezvous_endpoint",
        "tempfile", "timedelta",
    },
    "torch.distributed.run": {"ArgumentParser", "REMAINDER", "get_logger", "logger", "metadata", "torch", "os", "sys", "uuid"},  # its imports  # torch's health-check server (no tdist one)
}

PAIRS = [
    ("torch.distributed", "tdist"),
    ("torch.distributed.distributed_c10d", "tdist.distributed_c10d"),
    ("torch.distributed.constants", "tdist.constants"),
    ("torch.distributed.rpc", "tdist.rpc"),
    ("torch.distributed.rpc.backend_registry", "tdist.rpc.backend_registry"),
    ("torch.distributed.rpc.functions", "tdist.rpc.functions"),
    ("torch.distributed.rpc.api", "tdist.rpc.api"),
    ("torch.distributed.rpc.options", "tdist.rpc.options"),
    ("torch.distributed.autograd", "tdist.autograd"),
    ("torch.distributed.optim", "tdist.optim"),
    ("torch.distributed.nn", "tdist.nn"),
    ("torch.distributed.nn.functional", "tdist.nn.functional"),
    ("torch.distributed.nn.api.remote_module", "tdist.nn.api.remote_module"),
    ("torch.distributed.elastic.rendezvous", "tdist.elastic.rendezvous"),
    ("torch.distributed.elastic.rendezvous.registry", "tdist.elastic.rendezvous.registry"),
    ("torch.distributed.elastic.rendezvous.api", "tdist.elastic.rendezvous.api"),
    ("torch.distributed.elastic.rendezvous.utils", "tdist.elastic.rendezvous.utils"),
    ("torch.distributed.elastic.rendezvous.static_tcp_rendezvous", "tdist.elastic.rendezvous.static_tcp_rendezvous"),
    ("torch.distributed.elastic.rendezvous.etcd_store", "tdist.elastic.rendezvous.etcd_store"),
    ("torch.distributed.elastic.rendezvous.etcd_server", "tdist.elastic.rendezvous.etcd_server"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "tdist.elastic.rendezvous.dynamic_rendezvous"),
    ("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "tdist.elastic.rendezvous.c10d_rendezvous_backend"),
    ("torch.distributed.elastic.utils.data", "tdist.elastic.utils.data"),
    ("torch.distributed.elastic.utils.api", "tdist.elastic.utils.api"),
    ("torch.distributed.elastic.utils.distributed", "tdist.elastic.utils.distributed"),
    ("torch.distributed.elastic.utils.store", "tdist.elastic.utils.store"),
    ("torch.distributed.elastic.multiprocessing.errors.error_handler", "tdist.elastic.multiprocessing.errors.error_handler"),
    ("torch.distributed.elastic.multiprocessing.errors.handlers", "tdist.elastic.multiprocessing.errors.handlers"),
    ("torch.distributed.elastic.multiprocessing.errors", "tdist.elastic.multiprocessing.errors"),
    ("torch.distributed.elastic.timer", "tdist.elastic.timer"),
    ("torch.distributed.elastic.timer.api", "tdist.elastic.timer.api"),
    ("torch.distributed.elastic.timer.local_timer", "tdist.elastic.timer.local_timer"),
    ("torch.distributed.elastic.timer.file_based_local_timer", "tdist.elastic.timer.file_based_local_timer"),
    ("torch.distributed.elastic.metrics", "tdist.elastic.metrics"),
    ("torch.distributed.elastic.metrics.api", "tdist.elastic.metrics.api"),
    ("torch.distributed.elastic.events", "tdist.elastic.events"),
    ("torch.distributed.elastic.events.api", "tdist.elastic.events.api"),
    ("torch.distributed.elastic.events.handlers", "tdist.elastic.events.handlers"),
    ("torch.distributed.elastic.multiprocessing", "tdist.elastic.multiprocessing"),
    ("torch.distributed.elastic.multiprocessing.api", "tdist.elastic.multiprocessing.api"),
    ("torch.distributed.elastic.agent.server", "tdist.elastic.agent.server"),
    ("torch.distributed.elastic.agent.server.api", "tdist.elastic.agent.server.api"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "tdist.elastic.agent.server.local_elastic_agent"),
    ("torch.distributed.run", "tdist.run"),
    ("torch.distributed.launch", "tdist.launch"),
]


def test_rpc_internal_and_rref_proxy_modules() -> None:
    import torch

    from tdist.rpc import internal
    from tdist.rpc.rref_proxy import RRefProxy

    assert callable(RRefProxy)
    assert [m.value for m in internal.RPCExecMode] == ["sync", "async", "async_jit", "remote"]
    key = internal._build_rpc_profiling_key(internal.RPCExecMode.SYNC, "f", "a", "b")
    assert key == "rpc_sync#f(a -> b)"
    obj = {"t": torch.arange(3.0), "x": [1, torch.ones(2)]}
    data, table = internal.serialize(obj)
    assert isinstance(data, bytes) and len(table) == 2  # the tensors travel beside the pickle
    back = internal.deserialize(data, table)
    assert torch.equal(back["t"], obj["t"]) and back["x"][0] == 1 and torch.equal(back["x"][1], torch.ones(2))


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=[p[1] for p in PAIRS])
def test_torch_public_names_exist(theirs: str, ours: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_mod = importlib.import_module(theirs)
    mod = importlib.import_module(ours)
    names = getattr(torch_mod, "__all__", None) or [n for n in dir(torch_mod) if not n.startswith("_")]
    missing = sorted(n for n in set(names) - NOT_COVERED.get(theirs, set()) if not hasattr(mod, n))
    assert not missing, f"{ours} lacks {missing}"


def test_rendezvous_module_paths_of_torch() -> None:
    import tdist.elastic.rendezvous.etcd_server as ours
    import torch.distributed.elastic.rendezvous.etcd_server as torchs

    from tdist.elastic.rendezvous import RendezvousParameters
    from tdist.elastic.rendezvous.etcd_store import EtcdStore
    from tdist.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )
    from tdist.store._etcd import EtcdStore as own

    assert ours is torchs and EtcdStore is own  # (torch's test helper; tdist's own store)
    h = create_rdzv_handler(RendezvousParameters("static", "127.0.0.1:1234", "job", 2, 2, rank=1))
    assert isinstance(h, StaticTCPRendezvous) and h.get_backend() == "static" and h.use_agent_store
    assert (h.master_addr, h.master_port, h.rank, h.world_size, h.run_id) == ("127.0.0.1", 1234, 1, 2, "job")
    assert h.timeout.total_seconds() == 600 and h.num_nodes_waiting() == 0 and not h.is_closed()
    with pytest.raises(ValueError, match="Port is absent"):
        create_rdzv_handler(RendezvousParameters("static", "127.0.0.1", "job", 2, 2, rank=1))
    with pytest.raises(ValueError, match="rank is absent"):
        create_rdzv_handler(RendezvousParameters("static", "127.0.0.1:1", "job", 2, 2))


def test_dynamic_rendezvous_api_as_torchs() -> None:
    from datetime import timedelta

    from tdist import HashStore
    from tdist.elastic.rendezvous import DynamicRendezvousHandler as ours
    from tdist.elastic.rendezvous import RendezvousParameters
    from tdist.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from tdist.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
        create_handler,
    )

    assert DynamicRendezvousHandler is ours
    t = RendezvousTimeout(close=timedelta(seconds=7))
    assert (t.join, t.last_call, t.close, t.heartbeat) == tuple(timedelta(seconds=s) for s in (600, 30, 7, 5))
    with pytest.raises(ValueError, match="must be positive"):
        RendezvousTimeout(join=timedelta(0))
    store = HashStore()
    backend = C10dRendezvousBackend(store, "job")
    assert backend.name == "c10d" and backend.get_state() is None
    state, token, ok = backend.set_state(b"one")  # (no state yet: it takes)
    assert (state, ok) == (b"one", True) and backend.get_state() == (b"one", token)
    assert backend.set_state(b"two") == (b"one", token, False)  # (a state exists)
    assert backend.set_state(b"two", token)[::2] == (b"two", True)
    assert backend.set_state(b"three", token)[::2] == (b"two", False)  # (a stale token)
    with pytest.raises(ValueError, match="run id"):
        C10dRendezvousBackend(store, "")
    params = RendezvousParameters("c10d", "", "job", 1, 2, keep_alive_interval=2, join_timeout=9)
    h = create_handler(store, C10dRendezvousBackend(store, "other"), params)
    assert h.get_backend() == "c10d" and h.settings.keep_alive_interval == 2 and h.num_nodes_waiting() == 0
    with pytest.raises(TypeError, match="keep_alive_interval=None"):
        create_handler(store, backend, RendezvousParameters("c10d", "", "job", 1, 2, keep_alive_interval=None))


def test_distributed_c10d_private_helpers() -> None:
    import tdist as dist
    from tdist import distributed_c10d as c10d

    assert dist.distributed_c10d is c10d
    assert c10d.init_process_group is dist.init_process_group
    assert c10d._rank_not_in_group(None) is False
    assert c10d._rank_not_in_group(dist.GroupMember.NON_GROUP_MEMBER) is True
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        c10d._get_default_group()
    store = dist.HashStore()
    dist.init_process_group("tcp", store=store, rank=0, world_size=1)
    try:
        assert c10d._get_default_group() is dist.group.WORLD or c10d._get_default_group().size() == 1
    finally:
        dist.destroy_process_group()


def test_rpc_and_autograd_helpers() -> None:
    import tdist.rpc.api
    from tdist.rpc.options import TensorPipeRpcBackendOptions

    import tdist.autograd as autograd
    import tdist.rpc as rpc

    assert tdist.rpc.api is rpc.api and TensorPipeRpcBackendOptions is rpc.TensorPipeRpcBackendOptions
    assert rpc.PyRRef is rpc.RRef and rpc._UNSET_RPC_TIMEOUT == -1.0 and rpc._DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert not rpc._is_current_rpc_agent_set()
    with pytest.raises(RuntimeError, match="Current RPC agent is not set"):
        rpc._get_current_rpc_agent()

    assert autograd.is_available() is True
    assert rpc.register_backend is rpc.backend_registry.register_backend
    assert rpc.BackendValue is rpc.backend_registry.BackendValue


def test_rref_takes_a_type_parameter_as_torchs() -> None:
    import typing

    from tdist.rpc import RRef

    hinted = RRef[int]
    assert typing.get_origin(hinted) is RRef and typing.get_args(hinted) == (int,)

    def f(r: RRef[int]) -> int:  # (annotations that name it work at import, as with torch)
        return 0

    assert typing.get_type_hints(f, localns={"RRef": RRef})["r"] == RRef[int]


@pytest.mark.parametrize(
    "path",
    [
        "checkpoint", "checkpoint.state_dict", "fsdp", "tensor.parallel", "device_mesh", "pipelining",
        "algorithms.ddp_comm_hooks.default_hooks", "_functional_collectives", "utils", "nn.jit", "config",
        "optim.zero_redundancy_optimizer", "optim.post_localSGD_optimizer", "optim.functional_sgd",
        "elastic.utils.data.elastic_distributed_sampler", "elastic.utils.logging", "elastic.multiprocessing.tail_log",
        "debug", "elastic.control_plane", "elastic.agent.server.health_check_server", "elastic.utils.process_state",
        "flight_recorder.fr_trace", "flight_recorder.components.types",
    ],
)
def test_torchs_training_stack_is_importable_under_tdists_module_paths(path: str) -> None:
    """``tdist.<path>`` is torch's module (one copy), its spec still torch's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit's own)
        ours = importlib.import_module(f"tdist.{path}")
    assert ours is importlib.import_module(f"torch.distributed.{path}")
    assert ours.__spec__ is not None and ours.__spec__.name == f"torch.distributed.{path}"


def test_torchs_private_optimizer_names_that_code_imports_are_in_tdist_optim() -> None:
    import torch.distributed.optim as torchs

    import tdist.optim as ours

    names = ["_apply_optimizer_in_backward", "_get_in_backward_optimizers", "_NamedOptimizer",
             "_FunctionalSGD", "_FunctionalAdam", "_FunctionalAdamW", "_FunctionalAdagrad",
             "_FunctionalAdadelta", "_FunctionalAdamax", "_FunctionalRMSprop", "_FunctionalRprop"]
    assert [n for n in names if getattr(ours, n, None) is not getattr(torchs, n)] == []


def test_tdists_own_optimizer_module_path_gives_tdists_distributed_optimizer() -> None:
    import tdist.optim
    from tdist.optim.optimizer import DistributedOptimizer

    assert DistributedOptimizer is tdist.optim.DistributedOptimizer
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tdist.optim.nosuch")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tdist.fsdp.nosuch")


def test_torchs_modules_under_tdists_paths_run_with_python_m() -> None:
    """``python -m tdist.flight_recorder.fr_trace`` runs torch's analyzer of the dumps, as
    ``python -m torch.distributed.flight_recorder.fr_trace`` does."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "tdist.flight_recorder.fr_trace", "--help"], capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: fr_trace.py" in proc.stdout and "--selected-ranks" in proc.stdout, proc.stdout
