"""RPC backend registry, backend options and device-map checks, side by side with torch.

No sockets and no GPU: agents are replaced by fakes, and device maps name CUDA devices that
``torch.device`` builds without CUDA, with device counts passed in.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as tdd
import torch.distributed.rpc as trpc
from torch.distributed.rpc import backend_registry as tbr
from torch.distributed.rpc import constants as tconstants

import tdist
from tdist.rpc import _options, backend_registry, constants
from tdist.rpc._options import (
    ProcessGroupRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    create_device_list,
    create_reverse_mapping,
    resolve_device_maps,
    validate_device_maps,
)

pytestmark = pytest.mark.timeout(30)


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


CPU = torch.device("cpu")


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """What a call did: ("ok", repr of the result) or (exception type name, message)."""
    try:
        return "ok", repr(fn())
    except Exception as e:
        return type(e).__name__, str(e)


class Named:
    """An object whose str is fixed, so torch's and our messages that embed it can be compared."""

    def __str__(self) -> str:
        return "<not a store>"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The registry module; registrations made in the test are undone afterwards."""
    monkeypatch.setattr(backend_registry, "BackendType", backend_registry.BackendType)
    package = sys.modules["tdist.rpc"]
    if "BackendType" in vars(package):
        monkeypatch.setattr(package, "BackendType", vars(package)["BackendType"])
    yield backend_registry


# -- constants and public surface -----------------------------------------------------------------
def test_constants_equal_torch() -> None:
    for name in (
        "DEFAULT_RPC_TIMEOUT_SEC",
        "DEFAULT_INIT_METHOD",
        "DEFAULT_NUM_WORKER_THREADS",
        "UNSET_RPC_TIMEOUT",
        "DEFAULT_SHUTDOWN_TIMEOUT",
        "DEFAULT_PROCESS_GROUP_TIMEOUT",
    ):
        assert getattr(constants, name) == getattr(tconstants, name), name
    assert constants.DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert constants.DEFAULT_INIT_METHOD == "env://"
    assert constants.DEFAULT_NUM_WORKER_THREADS == 16
    assert constants.UNSET_RPC_TIMEOUT == -1.0
    assert constants.DEFAULT_NUM_SEND_RECV_THREADS == 4
    assert constants.__all__ == tconstants.__all__ == []


def test_registry_public_names_match_torch() -> None:
    assert sorted(backend_registry.__all__) == sorted(tbr.__all__)
    for name in backend_registry.__all__:
        assert hasattr(backend_registry, name)
    assert backend_registry.BackendValue._fields == tbr.BackendValue._fields
    # torch's private helpers, for code ported from torch
    assert backend_registry._validate_device_maps is validate_device_maps
    assert backend_registry._create_device_list is create_device_list
    assert backend_registry._create_reverse_mapping is create_reverse_mapping


# -- the registry -----------------------------------------------------------------------------------
def test_builtin_backends_are_registered() -> None:
    bt = backend_registry.BackendType
    assert backend_registry.backend_registered("TENSORPIPE")
    assert backend_registry.backend_registered("PROCESS_GROUP")
    assert not backend_registry.backend_registered("NOPE")
    assert list(bt) == [bt.TENSORPIPE, bt.PROCESS_GROUP]  # newest first, as torch orders them
    assert bt["TENSORPIPE"] is bt.TENSORPIPE
    assert isinstance(bt.TENSORPIPE.value, backend_registry.BackendValue)
    assert bt.__name__ == "BackendType"
    assert bt.__doc__ and "TENSORPIPE" in bt.__doc__


def test_member_repr_and_str_match_torch() -> None:
    bt = backend_registry.BackendType
    assert repr(bt.TENSORPIPE) == repr(tbr.BackendType.TENSORPIPE) == "BackendType.TENSORPIPE"
    assert str(bt.TENSORPIPE) == str(tbr.BackendType.TENSORPIPE)
    assert repr(bt.PROCESS_GROUP) == "BackendType.PROCESS_GROUP"


def test_unknown_member_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = backend_registry.BackendType.NOPE
    with pytest.raises(AttributeError):
        _ = tbr.BackendType.NOPE


def test_duplicate_registration_is_refused_like_torch() -> None:
    ours = outcome(lambda: backend_registry.register_backend("TENSORPIPE", print, print))
    theirs = outcome(lambda: tbr.register_backend("TENSORPIPE", print, print))
    assert ours == theirs == ("RuntimeError", "RPC backend TENSORPIPE: already registered")


def test_user_backend_routes_to_its_handlers(registry: types.ModuleType) -> None:
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    sentinel_options = object()
    sentinel_agent = object()

    def construct(*args: Any, **kwargs: Any) -> object:
        calls.append(("construct", args, kwargs))
        return sentinel_options

    def init(*args: Any, **kwargs: Any) -> object:
        calls.append(("init", args, kwargs))
        return sentinel_agent

    old = registry.BackendType
    mine = registry.register_backend("MINE", construct, init)
    bt = registry.BackendType
    assert bt is not old  # rebuilt, as torch does
    assert mine is bt.MINE and repr(mine) == "BackendType.MINE"
    assert list(bt) == [bt.MINE, bt.TENSORPIPE, bt.PROCESS_GROUP]
    assert registry.backend_registered("MINE")
    assert bt.TENSORPIPE.value == old.TENSORPIPE.value
    # members of the earlier generation still pass the common base
    assert isinstance(old.TENSORPIPE, registry.BackendTypeBase)
    assert isinstance(mine, registry.BackendTypeBase)

    assert registry.construct_rpc_backend_options(mine) is sentinel_options
    assert registry.construct_rpc_backend_options(mine, 5.0, "tcp://h:1", x=1) is sentinel_options
    assert registry.init_backend(mine, "store", "w0", 0, 2, sentinel_options) is sentinel_agent
    assert calls == [
        ("construct", (60.0, "env://"), {}),
        ("construct", (5.0, "tcp://h:1"), {"x": 1}),
        ("init", ("store", "w0", 0, 2, sentinel_options), {}),
    ]

    with pytest.raises(RuntimeError, match=r"^RPC backend MINE: already registered$"):
        registry.register_backend("MINE", construct, init)


def test_registration_updates_the_package_binding(
    registry: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = sys.modules["tdist.rpc"]
    # what `from .backend_registry import BackendType` in the facade leaves behind
    monkeypatch.setattr(package, "BackendType", registry.BackendType, raising=False)
    registry.register_backend("MINE", print, repr)
    assert package.BackendType is registry.BackendType
    assert package.BackendType.MINE is registry.BackendType.MINE
    assert package.BackendType.TENSORPIPE is registry.BackendType.TENSORPIPE


def test_registration_binds_nothing_in_a_package_without_the_name(
    registry: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = sys.modules["tdist.rpc"]
    if "BackendType" in vars(package):  # bound by the facade; a module __getattr__ stays
        monkeypatch.delattr(package, "BackendType")
    registry.register_backend("MINE", print, repr)
    assert "BackendType" not in vars(package)


def test_backends_with_equal_handlers_alias_like_torch(registry: types.ModuleType) -> None:
    # Enum values are the handler pairs, so equal pairs make the later name the canonical one.
    first = registry.register_backend("FIRST", print, repr)
    second = registry.register_backend("SECOND", print, repr)
    bt = registry.BackendType
    assert bt.FIRST is bt.SECOND is second
    assert first is not second  # `first` belongs to the previous generation
    assert registry.backend_registered("FIRST")
    assert [m.name for m in bt] == ["SECOND", "TENSORPIPE", "PROCESS_GROUP"]


# -- the built-in handlers --------------------------------------------------------------------------
def test_tensorpipe_options_from_the_registry_match_torch() -> None:
    ours = backend_registry.construct_rpc_backend_options(backend_registry.BackendType.TENSORPIPE)
    theirs = tbr.construct_rpc_backend_options(tbr.BackendType.TENSORPIPE)
    assert type(ours) is TensorPipeRpcBackendOptions
    for name in ("num_worker_threads", "rpc_timeout", "init_method", "device_maps", "devices"):
        assert getattr(ours, name) == getattr(theirs, name), name

    kwargs: dict[str, Any] = {
        "rpc_timeout": 5,
        "init_method": "tcp://h:1",
        "num_worker_threads": 3,
        "_transports": ["uv"],
        "_channels": ["basic"],
        "not_an_option": 1,  # ignored, as torch does
    }
    ours = backend_registry.construct_rpc_backend_options(
        backend_registry.BackendType.TENSORPIPE, **kwargs
    )
    theirs = tbr.construct_rpc_backend_options(tbr.BackendType.TENSORPIPE, **kwargs)
    for name in ("num_worker_threads", "rpc_timeout", "init_method"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours._transports == ["uv"] and ours._channels == ["basic"]


def test_tensorpipe_options_from_the_registry_keep_device_maps() -> None:
    # torch drops these two keywords here; we pass them on to the options
    opts = backend_registry.construct_rpc_backend_options(
        backend_registry.BackendType.TENSORPIPE,
        device_maps={"w1": {"cuda:0": "cuda:1"}},
        devices=["cuda:0"],
    )
    assert opts.device_maps == {"w1": {cuda(0): cuda(1)}}
    assert opts.devices == [cuda(0)]


def test_process_group_options_from_the_registry() -> None:
    pg = backend_registry.BackendType.PROCESS_GROUP
    opts = backend_registry.construct_rpc_backend_options(pg)
    assert type(opts) is ProcessGroupRpcBackendOptions
    assert (opts.num_send_recv_threads, opts.rpc_timeout, opts.init_method) == (4, 60.0, "env://")
    opts = backend_registry.construct_rpc_backend_options(
        pg, 7, "file:///tmp/x", num_send_recv_threads=8, num_worker_threads=2
    )
    assert (opts.num_send_recv_threads, opts.rpc_timeout, opts.init_method) == (
        8,
        7.0,
        "file:///tmp/x",
    )


def test_tensorpipe_init_handler_type_checks_like_torch() -> None:
    ours_handler = backend_registry.BackendType.TENSORPIPE.value.init_backend_handler
    theirs_handler = tbr.BackendType.TENSORPIPE.value.init_backend_handler
    good = TensorPipeRpcBackendOptions()

    ours = outcome(lambda: ours_handler(Named(), "w0", 0, 1, good))
    theirs = outcome(
        lambda: theirs_handler(Named(), "w0", 0, 1, trpc.TensorPipeRpcBackendOptions())
    )
    assert ours == theirs == ("TypeError", "`store` must be a c10d::Store. <not a store>")

    for bad in (Named(), None):
        ours = outcome(lambda bad=bad: ours_handler(tdist.HashStore(), "w0", 0, 1, bad))
        theirs = outcome(lambda bad=bad: theirs_handler(tdd.HashStore(), "w0", 0, 1, bad))
        assert ours == theirs
        assert ours[0] == "TypeError"
        assert ours[1].startswith("`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`.")
    # options of another backend are refused too
    kind, message = outcome(
        lambda: ours_handler(tdist.HashStore(), "w0", 0, 1, ProcessGroupRpcBackendOptions())
    )
    assert kind == "TypeError" and "TensorPipeRpcBackendOptions" in message


def test_process_group_init_handler_type_checks() -> None:
    handler = backend_registry.BackendType.PROCESS_GROUP.value.init_backend_handler
    assert outcome(lambda: handler(Named(), "w0", 0, 1, ProcessGroupRpcBackendOptions())) == (
        "TypeError",
        "`store` must be a c10d::Store. <not a store>",
    )
    assert outcome(lambda: handler(tdist.HashStore(), "w0", 0, 1, Named())) == (
        "TypeError",
        "`rpc_backend_options` must be a `ProcessGroupRpcBackendOptions`. <not a store>",
    )


@pytest.mark.parametrize(
    ("backend", "module", "agent", "options"),
    [
        ("TENSORPIPE", "tdist.rpc._tensorpipe", "TensorPipeAgent", TensorPipeRpcBackendOptions),
        (
            "PROCESS_GROUP",
            "tdist.rpc._pg_agent",
            "ProcessGroupAgent",
            ProcessGroupRpcBackendOptions,
        ),
    ],
)
def test_init_handlers_build_the_agent_lazily(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    module: str,
    agent: str,
    options: type[RpcBackendOptions],
) -> None:
    built: list[tuple[Any, ...]] = []

    class FakeAgent:
        def __init__(self, *args: Any) -> None:
            built.append(args)

    fake = types.ModuleType(module)
    setattr(fake, agent, FakeAgent)
    monkeypatch.setitem(sys.modules, module, fake)
    store = tdist.HashStore()
    opts = options()
    result = backend_registry.init_backend(
        backend_registry.BackendType[backend], store, "w0", 0, 2, opts
    )
    assert isinstance(result, FakeAgent)
    assert built == [(store, "w0", 0, 2, opts)]


# -- options ----------------------------------------------------------------------------------------
def test_option_defaults_match_torch() -> None:
    ours, theirs = TensorPipeRpcBackendOptions(), trpc.TensorPipeRpcBackendOptions()
    for name in ("num_worker_threads", "rpc_timeout", "init_method", "device_maps", "devices"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours._transports is None and ours._channels is None
    base, tbase = RpcBackendOptions(), trpc.RpcBackendOptions()
    assert (base.rpc_timeout, base.init_method) == (tbase.rpc_timeout, tbase.init_method)
    assert isinstance(ours, RpcBackendOptions) and isinstance(theirs, trpc.RpcBackendOptions)


def test_tensorpipe_signature_matches_torch() -> None:
    ours = inspect.signature(TensorPipeRpcBackendOptions.__init__).parameters
    theirs = inspect.signature(trpc.TensorPipeRpcBackendOptions.__init__).parameters
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].kind == theirs[name].kind, name
        assert ours[name].default == theirs[name].default, name
    assert outcome(lambda: TensorPipeRpcBackendOptions(8))[0] == "TypeError"  # type: ignore[call-arg]
    assert outcome(lambda: trpc.TensorPipeRpcBackendOptions(8))[0] == "TypeError"  # type: ignore[call-arg]


def test_base_options_positional_and_setters() -> None:
    for cls in (RpcBackendOptions, trpc.RpcBackendOptions):
        o = cls(5, "tcp://h:1")
        assert (o.rpc_timeout, o.init_method) == (5.0, "tcp://h:1")
        o.rpc_timeout = 3
        assert o.rpc_timeout == 3.0 and isinstance(o.rpc_timeout, float)
        o.rpc_timeout = -1  # the setter does not check the sign (torch's does not either)
        assert o.rpc_timeout == -1.0
        o.init_method = "file:///x"
        assert o.init_method == "file:///x"
        with pytest.raises(TypeError):
            o.rpc_timeout = "3"  # type: ignore[assignment]
        with pytest.raises(TypeError):
            o.init_method = 3  # type: ignore[assignment]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rpc_timeout": -1},
        {"num_worker_threads": 0},
        {"num_worker_threads": -2},
        {"_transports": ["nope"]},
        {"_transports": ["uv", "shm", "ibv"]},
        {"_channels": ["nope"]},
        {"_channels": ["basic", "cma", "mpt_uv"]},
        {"rpc_timeout": 0, "num_worker_threads": 1},
        {"device_maps": {"w": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}},
        {"device_maps": {"w": {"cpu": "cpu"}}},
        {"device_maps": {"w": {"cuda:0": "cuda:-1"}}},
        {"device_maps": {"w": {"bogus": "cuda:0"}}},
        {"devices": ["cpu"]},
        {"devices": ["cuda:1", torch.device("cuda", 0), "cuda:1"]},
    ],
)
def test_tensorpipe_construction_matches_torch(kwargs: dict[str, Any]) -> None:
    def describe(cls: type[Any]) -> tuple[str, str]:
        def build() -> Any:
            o = cls(**kwargs)
            return (o.num_worker_threads, o.rpc_timeout, o.device_maps, o.devices)

        return outcome(build)

    assert describe(TensorPipeRpcBackendOptions) == describe(trpc.TensorPipeRpcBackendOptions)


def test_int_devices_mean_cuda() -> None:
    opts = TensorPipeRpcBackendOptions(device_maps={"w": {0: 1}}, devices=[1, 0])
    assert opts.device_maps == {"w": {cuda(0): cuda(1)}}
    assert opts.devices == [cuda(1), cuda(0)]
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        TensorPipeRpcBackendOptions(device_maps={"w": {-1: 0}})
    with pytest.raises(TypeError):
        TensorPipeRpcBackendOptions(devices=[1.5])  # type: ignore[list-item]
    if torch.cuda.is_available():  # on a CUDA host torch reads ints the same way
        theirs = trpc.TensorPipeRpcBackendOptions(device_maps={"w": {0: 1}}, devices=[1, 0])
        assert theirs.device_maps == opts.device_maps and theirs.devices == opts.devices


def test_set_device_map_matches_torch() -> None:
    def run(cls: type[Any]) -> list[tuple[str, str]]:
        o = cls(device_maps={"w": {"cuda:0": "cuda:1"}})
        steps: list[Callable[[], Any]] = [
            lambda: o.set_device_map("w", {"cuda:0": "cuda:2"}),  # remaps cuda:0
            lambda: o.set_device_map("w", {"cuda:0": "cuda:1", "cuda:1": "cuda:2"}),
            lambda: o.set_device_map("w", {"cuda:2": "cuda:1"}),  # accepted, caught at init
            lambda: o.set_device_map("w", {"cuda:3": "cuda:0", "cuda:4": "cuda:0"}),
            lambda: o.set_device_map("v", {"cpu": "cuda:0"}),
            lambda: o.set_device_map("x", {}),
            lambda: o.set_device_map(5, {"cpu": "cuda:0"}),
            # sorted: torch keeps the maps in a C++ unordered_map
            lambda: sorted((k, sorted(v.items(), key=str)) for k, v in o.device_maps.items()),
        ]
        results = [outcome(step) for step in steps]
        return [r if r[0] != "TypeError" else ("TypeError", "") for r in results]

    ours, theirs = run(TensorPipeRpcBackendOptions), run(trpc.TensorPipeRpcBackendOptions)
    assert ours == theirs
    assert ours[0] == (
        "ValueError",
        "`set_device_map` only supports 1-to-1 mapping, trying to map cuda:0 to cuda:2 and cuda:1",
    )
    assert ours[3] == (
        "ValueError",
        "`device_map` only supports 1-to-1 mapping, trying to map cuda:4 and cuda:3 to cuda:0",
    )


def test_getters_return_copies_like_torch() -> None:
    for cls in (TensorPipeRpcBackendOptions, trpc.TensorPipeRpcBackendOptions):
        o = cls(device_maps={"w": {"cuda:0": "cuda:1"}}, devices=["cuda:0"])
        o.device_maps["z"] = {}
        o.device_maps["w"][cuda(5)] = cuda(6)
        o.devices.append(cuda(3))
        assert o.device_maps == {"w": {cuda(0): cuda(1)}}
        assert o.devices == [cuda(0)]


def test_set_devices_matches_torch() -> None:
    def run(cls: type[Any]) -> list[tuple[str, str]]:
        o = cls()
        steps: list[Callable[[], Any]] = [
            lambda: o.set_devices(["cuda:0", torch.device("cuda", 1)]),
            lambda: o.devices,
            lambda: o.set_devices(["cpu"]),
            lambda: o.set_devices(["cuda:0", "cuda:0"]),  # duplicates are caught at init
            lambda: o.devices,
            lambda: o.set_devices([]),
            lambda: o.devices,
        ]
        return [outcome(step) for step in steps]

    ours, theirs = run(TensorPipeRpcBackendOptions), run(trpc.TensorPipeRpcBackendOptions)
    assert ours == theirs
    assert ours[2] == (
        "ValueError",
        "`set_devices` expect a list of CUDA devices, but got device type cpu.",
    )


def test_attribute_setters_match_torch() -> None:
    for cls in (TensorPipeRpcBackendOptions, trpc.TensorPipeRpcBackendOptions):
        o = cls()
        o.devices = [CPU, cuda(1)]  # the attribute takes torch.device values, unchecked
        assert o.devices == [CPU, cuda(1)]
        with pytest.raises(TypeError):
            o.devices = ["cuda:0"]
        o.device_maps = {"w": {cuda(0): cuda(1)}}
        assert o.device_maps == {"w": {cuda(0): cuda(1)}}
        o.num_worker_threads = 0  # the setter does not check the count
        assert o.num_worker_threads == 0
        with pytest.raises(TypeError):
            o.num_worker_threads = "3"


def test_process_group_options() -> None:
    o = ProcessGroupRpcBackendOptions()
    assert (o.num_send_recv_threads, o.rpc_timeout, o.init_method) == (4, 60.0, "env://")
    o = ProcessGroupRpcBackendOptions(8, 5, "tcp://h:1")
    assert (o.num_send_recv_threads, o.rpc_timeout, o.init_method) == (8, 5.0, "tcp://h:1")
    assert isinstance(o, RpcBackendOptions)
    for n in (0, -1):
        with pytest.raises(RuntimeError) as info:
            ProcessGroupRpcBackendOptions(num_send_recv_threads=n)
        assert str(info.value) == (
            f"Cannot create ProcessGroup RPC backend with {n} threads in the thread-pool."
        )
    with pytest.raises(RuntimeError, match=r"^RPC Timeout must be non-negative$"):
        ProcessGroupRpcBackendOptions(rpc_timeout=-0.5)
    assert "num_send_recv_threads=4" in repr(ProcessGroupRpcBackendOptions())


# -- validate_device_maps ---------------------------------------------------------------------------
W = ["w0", "w1"]
COUNTS = {"w0": 2, "w1": 2}
NO_DEVICES: dict[str, list[torch.device]] = {"w0": [], "w1": []}

# (id, counts, maps, devices, is_static_group); every case is run through ours and torch's
VALIDATION_CASES: list[tuple[str, dict[str, int], dict[str, Any], dict[str, Any], bool]] = [
    ("valid", COUNTS, {"w0": {"w1": {cuda(0): cuda(1)}}, "w1": {"w0": {cuda(1): cuda(0)}}},
     NO_DEVICES, True),
    ("valid-devices", COUNTS, {"w0": {"w1": {cuda(0): cuda(1)}}, "w1": {}},
     {"w0": [cuda(0)], "w1": [cuda(1)]}, True),
    ("valid-cpu", {"w0": 0, "w1": 0}, {"w0": {"w1": {CPU: CPU}}, "w1": {}}, NO_DEVICES, True),
    ("valid-self", COUNTS, {"w0": {"w0": {cuda(0): cuda(1)}}, "w1": {}}, NO_DEVICES, True),
    ("duplicated-devices", COUNTS, {"w0": {}, "w1": {}},
     {"w0": [cuda(0), cuda(0)], "w1": []}, True),
    ("devices-invalid-index", COUNTS, {"w0": {}, "w1": {}}, {"w0": [], "w1": [cuda(2)]}, True),
    ("unknown-target-name", COUNTS, {"w0": {"w2": {cuda(0): cuda(1)}}, "w1": {}},
     NO_DEVICES, True),
    ("unknown-target-name-dynamic", COUNTS, {"w0": {"w2": {cuda(0): cuda(7)}}, "w1": {}},
     NO_DEVICES, False),
    ("many-to-one", COUNTS, {"w0": {"w1": {cuda(0): cuda(1), cuda(1): cuda(1)}}, "w1": {}},
     NO_DEVICES, True),
    ("unexpected-source", COUNTS, {"w0": {"w1": {cuda(1): cuda(0)}}, "w1": {}},
     {"w0": [cuda(0)], "w1": []}, True),
    ("source-invalid-index", COUNTS, {"w0": {"w1": {cuda(2): cuda(0)}}, "w1": {}},
     NO_DEVICES, True),
    ("source-no-gpu", {"w0": 0, "w1": 2}, {"w0": {"w1": {cuda(0): cuda(0)}}, "w1": {}},
     NO_DEVICES, True),
    ("unexpected-target", COUNTS, {"w0": {"w1": {cuda(0): cuda(1)}}, "w1": {}},
     {"w0": [], "w1": [cuda(0)]}, True),
    ("target-invalid-index", COUNTS, {"w0": {"w1": {cuda(0): cuda(5)}}, "w1": {}},
     NO_DEVICES, True),
    ("target-invalid-index-devices-ok", {"w0": 2, "w1": 1},
     {"w0": {"w1": {cuda(0): cuda(1)}}, "w1": {}}, {"w0": [cuda(0)], "w1": []}, True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("counts", "maps", "devices", "static"),
    [case[1:] for case in VALIDATION_CASES],
    ids=[case[0] for case in VALIDATION_CASES],
)
def test_validate_device_maps_matches_torch(
    counts: dict[str, int], maps: dict[str, Any], devices: dict[str, Any], static: bool
) -> None:
    ours = outcome(lambda: validate_device_maps(W, counts, maps, devices, static))
    theirs = outcome(lambda: tbr._validate_device_maps(W, counts, maps, devices, static))
    assert ours == theirs
    assert ours[0] in ("ok", "ValueError")


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("valid", "ok"),
        ("valid-devices", "ok"),
        ("valid-cpu", "ok"),
        ("valid-self", "ok"),
        ("unknown-target-name-dynamic", "ok"),
        ("duplicated-devices", "Node w0 has duplicated devices"),
        ("devices-invalid-index", "Node w1 has devices with invalid indices"),
        ("unknown-target-name", "Node w0 has invalid target node names in its device maps"),
        ("many-to-one", "Node w0 has duplicated target devices in its device map for w1"),
        ("unexpected-source", "Node w0 has unexpected source devices in its device map for w1"),
        ("source-invalid-index", "Node w0 has source devices with invalid indices"),
        ("source-no-gpu", "Node w0 has source devices with invalid indices"),
        ("unexpected-target", "Node w0 has unexpected target devices in its device map for w1"),
        ("target-invalid-index", "Node w0 has target devices with invalid indices"),
        ("target-invalid-index-devices-ok", "Node w0 has target devices with invalid indices"),
    ],
)
def test_validate_device_maps_categories(case: str, expected: str) -> None:
    _, counts, maps, devices, static = next(c for c in VALIDATION_CASES if c[0] == case)
    result = outcome(lambda: validate_device_maps(W, counts, maps, devices, static))
    if expected == "ok":
        assert result == ("ok", "None")
    else:
        assert result[0] == "ValueError" and result[1].startswith(expected)
    # device counts may also be given in the order of the names
    listed = outcome(lambda: validate_device_maps(W, [counts[n] for n in W], maps, devices, static))
    assert listed == result


def test_message_shows_the_maps_and_names() -> None:
    with pytest.raises(ValueError) as info:
        validate_device_maps(W, COUNTS, {"w0": {"w2": {}}, "w1": {}}, NO_DEVICES)
    assert str(info.value) == (
        "Node w0 has invalid target node names in its device maps\n"
        "device maps = dict_keys(['w2'])\n"
        "node names = ['w0', 'w1']"
    )


def test_indexless_cuda_is_an_invalid_index() -> None:
    # torch fails here with a TypeError comparing None to an int; we report the device
    with pytest.raises(ValueError, match="Node w0 has devices with invalid indices"):
        validate_device_maps(
            W, COUNTS, {"w0": {}, "w1": {}}, {"w0": [torch.device("cuda")], "w1": []}
        )
    with pytest.raises(ValueError, match="Node w0 has source devices with invalid indices"):
        validate_device_maps(
            W, COUNTS, {"w0": {"w1": {torch.device("cuda"): cuda(0)}}, "w1": {}}, NO_DEVICES
        )


def test_reverse_maps_and_device_lists_match_torch() -> None:
    names = ["w0", "w1", "w2"]
    maps: dict[str, dict[str, dict[torch.device, torch.device]]] = {
        "w0": {"w1": {cuda(0): cuda(1), CPU: CPU}, "w2": {cuda(1): cuda(0)}},
        "w1": {"w0": {cuda(1): cuda(3)}},
        "w2": {"w0": {cuda(0): cuda(2)}, "w2": {cuda(0): cuda(1)}},
    }
    for me in names:
        ours = create_reverse_mapping(me, names, maps)
        assert ours == tbr._create_reverse_mapping(me, names, maps)
        for given in ([], [cuda(2), cuda(0)]):
            devices = create_device_list(given, maps[me], ours)
            assert devices == tbr._create_device_list(given, maps[me], ours)
    # w0: its own sources 0, 1 (cpu dropped) and what w1 and w2 send to it: 3, 2
    reverse, devices = resolve_device_maps(
        "w0", names, {n: 4 for n in names}, maps, {n: [] for n in names}
    )
    assert reverse == {"w1": {cuda(3): cuda(1)}, "w2": {cuda(2): cuda(0)}}
    assert devices == [cuda(0), cuda(1), cuda(2), cuda(3)]


def test_resolve_device_maps_validates_first() -> None:
    with pytest.raises(ValueError, match="duplicated target devices"):
        resolve_device_maps(
            "w0", W, COUNTS, {"w0": {"w1": {cuda(0): cuda(1), cuda(1): cuda(1)}}, "w1": {}},
            NO_DEVICES,
        )  # fmt: skip


def test_options_module_names_exist() -> None:
    for name in _options.__all__:
        assert hasattr(_options, name), name
