"""RPC backend options and the device-map checks an agent runs at init, as torch does them.

Theory of operation. A TensorPipe worker may declare, per peer, a *device map*: which of its
CUDA devices a tensor on its side lands on at the peer (``{"worker1": {cuda:0: cuda:1}}``), and
a *device list*: every local device the agent must synchronize streams for. The options object
only normalizes what the user wrote (``int``, ``str`` and ``torch.device`` become
``torch.device``; ``int`` means a CUDA index) and refuses a map that sends two devices to one.
Everything that needs the whole group -- do the names exist, are the indices below each
worker's device count, does the map agree with the device lists -- is checked once every
worker's ``(name, device count, device maps, devices)`` is known, by :func:`validate_device_maps`;
:func:`resolve_device_maps` then derives the reverse maps (how replies travel back) and the
device list a worker uses when it gave none. These are pure functions of the gathered data, so
the agent does the all-gather and tests need neither sockets nor a GPU: device counts are
arguments and ``torch.device("cuda:1")`` can be built on a CPU-only machine.

Messages and exception types are torch's (``torch/distributed/rpc/options.py``, the C++ option
classes, ``backend_registry._validate_device_maps``) so code that matches on them keeps working.

Thread-safety: option objects are plain mutable objects; configure them before ``init_rpc`` and
do not change them from several threads at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from . import constants as rpc_constants

__all__ = [
    "DeviceMap",
    "DeviceType",
    "ProcessGroupRpcBackendOptions",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "create_device_list",
    "create_reverse_mapping",
    "resolve_device_maps",
    "validate_device_maps",
]

DeviceType = int | str | torch.device
DeviceMap = dict[torch.device, torch.device]

# The names torch's CPU build registers with TensorPipe; torch refuses any other at construction.
# CUDA path: CUDA builds also register the channels "cuda_basic", "cuda_ipc", "cuda_gdr" and
# "cuda_xth"; we have no CUDA channel, so they are refused here as on a CPU build of torch.
_KNOWN_TRANSPORTS = frozenset({"uv", "shm", "ibv"})
_KNOWN_CHANNELS = frozenset({"basic", "cma", "mpt_uv"})


# -- normalizing what users write -----------------------------------------------------------------
def _to_device(device: DeviceType) -> torch.device:
    """One device as ``torch.device``; an ``int`` is a CUDA index, as on a CUDA host in torch.

    Raises:
        RuntimeError: a negative index or a malformed device string (torch's own errors).
        TypeError: anything that is not an ``int``, ``str`` or ``torch.device``.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        # torch.device(int) means "this index of the current accelerator" and fails on a
        # machine without one; device maps only ever describe CUDA devices, so say so directly.
        return torch.device("cuda", device)
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(
        f"a device must be an int, a str or a torch.device, got {type(device).__name__}: {device!r}"
    )


def _to_cuda_device(device: DeviceType) -> torch.device:
    """A device for a ``devices`` list: it must be a CUDA device.

    Raises:
        ValueError: not a CUDA device (torch's message, which names ``set_devices`` even when
            the list came from the constructor).
    """
    dev = _to_device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"`set_devices` expect a list of CUDA devices, but got device type {dev.type}."
        )
    return dev


def _to_device_list(devices: Iterable[DeviceType]) -> list[torch.device]:
    return [_to_cuda_device(d) for d in devices]


def _to_device_map(device_map: Mapping[DeviceType, DeviceType]) -> DeviceMap:
    """Normalize one worker's map and check that it is one-to-one.

    Raises:
        ValueError: two source devices map to the same target.
    """
    full: DeviceMap = {}
    source_of: DeviceMap = {}  # target -> the source that claimed it
    for key, value in device_map.items():
        src, dst = _to_device(key), _to_device(value)
        if dst in source_of:
            raise ValueError(
                "`device_map` only supports 1-to-1 mapping, "
                f"trying to map {src} and {source_of[dst]} to {dst}"
            )
        full[src] = dst
        source_of[dst] = src
    return full


def _check_worker_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(
            f"a device map is keyed by worker name (str), got {type(name).__name__}: {name!r}"
        )
    return name


def _check_timeout(value: object) -> float:
    if not isinstance(value, (int, float)):
        raise TypeError(
            f"rpc_timeout must be a number of seconds, got {type(value).__name__}: {value!r}"
        )
    return float(value)


def _check_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}: {value!r}")
    return value


def _check_names(what: str, names: Iterable[str] | None, known: frozenset[str]) -> list[str] | None:
    if names is None:
        return None
    checked = list(names)
    for name in checked:
        if name not in known:
            raise RuntimeError(f"Unknown {what}: {name}")
    return checked


# -- option classes -------------------------------------------------------------------------------
class RpcBackendOptions:
    """Options every RPC agent takes (``torch.distributed.rpc.RpcBackendOptions``).

    Args:
        rpc_timeout: default timeout of an RPC, in seconds (``0`` means no timeout).
        init_method: URL of the rendezvous that builds the agents' store (``env://``,
            ``tcp://host:port``, ``file://path``).

    Raises:
        RuntimeError: ``rpc_timeout`` is negative (torch's check; the attribute setter, like
            torch's, does not repeat it).
        TypeError: ``rpc_timeout`` is not a number or ``init_method`` not a ``str``.
    """

    def __init__(
        self,
        rpc_timeout: float = rpc_constants.DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = rpc_constants.DEFAULT_INIT_METHOD,
    ) -> None:
        timeout = _check_timeout(rpc_timeout)
        if timeout < 0:
            raise RuntimeError("RPC Timeout must be non-negative")
        self.rpc_timeout = timeout
        self.init_method = init_method

    @property
    def rpc_timeout(self) -> float:
        """Default timeout of an RPC, in seconds."""
        return self._rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        self._rpc_timeout = _check_timeout(value)

    @property
    def init_method(self) -> str:
        """Rendezvous URL."""
        return self._init_method

    @init_method.setter
    def init_method(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"init_method must be a str, got {type(value).__name__}: {value!r}")
        self._init_method = value

    def _repr_fields(self) -> str:
        return f"rpc_timeout={self.rpc_timeout!r}, init_method={self.init_method!r}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_fields()})"


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Options of the TensorPipe agent (``torch.distributed.rpc.TensorPipeRpcBackendOptions``).

    Args:
        num_worker_threads: threads that run incoming requests (default 16).
        rpc_timeout: default timeout of an RPC, in seconds (default 60).
        init_method: rendezvous URL (default ``env://``).
        device_maps: per callee name, a map from this worker's devices to the callee's
            (``int`` is a CUDA index, ``str``, or ``torch.device``); it must be one-to-one.
        devices: every local CUDA device the agent uses; by default, the devices this worker's
            maps and its peers' maps name (see :func:`create_device_list`).
        _transports: TensorPipe transports to use (``uv``, ``shm``, ``ibv``), None for all.
        _channels: TensorPipe channels to use (``basic``, ``cma``, ``mpt_uv``), None for all.

    Raises:
        RuntimeError: ``num_worker_threads`` is not positive, ``rpc_timeout`` is negative, or
            a transport or channel name is unknown (torch's messages).
        ValueError: a map sends two devices to one, or ``devices`` holds a non-CUDA device.
        TypeError: a value of the wrong type.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = rpc_constants.DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = rpc_constants.DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = rpc_constants.DEFAULT_INIT_METHOD,
        device_maps: Mapping[str, Mapping[DeviceType, DeviceType]] | None = None,
        devices: Iterable[DeviceType] | None = None,
        _transports: Iterable[str] | None = None,
        _channels: Iterable[str] | None = None,
    ) -> None:
        # The order of checks is torch's: the Python wrapper normalizes the maps and the device
        # list first, then the C++ constructor checks the numbers and the TensorPipe names.
        full_device_maps = (
            {}
            if device_maps is None
            else {_check_worker_name(k): _to_device_map(v) for k, v in device_maps.items()}
        )
        full_devices = [] if devices is None else _to_device_list(devices)
        threads = _check_int("num_worker_threads", num_worker_threads)
        super().__init__(rpc_timeout, init_method)
        if threads <= 0:
            raise RuntimeError(f"num_worker_threads must be positive, got {threads}")
        self._transports: list[str] | None = _check_names(
            "transport", _transports, _KNOWN_TRANSPORTS
        )
        self._channels: list[str] | None = _check_names("channel", _channels, _KNOWN_CHANNELS)
        self.num_worker_threads = threads
        self._device_maps: dict[str, DeviceMap] = full_device_maps
        self._devices: list[torch.device] = full_devices

    @property
    def num_worker_threads(self) -> int:
        """Threads that run incoming requests."""
        return self._num_worker_threads

    @num_worker_threads.setter
    def num_worker_threads(self, value: int) -> None:
        self._num_worker_threads = _check_int("num_worker_threads", value)

    @property
    def device_maps(self) -> dict[str, DeviceMap]:
        """A copy of the device maps, per callee name; change them with :meth:`set_device_map`."""
        return {name: dict(map_) for name, map_ in self._device_maps.items()}

    @device_maps.setter
    def device_maps(self, value: Mapping[str, Mapping[torch.device, torch.device]]) -> None:
        # Like torch's attribute, this stores ``torch.device`` maps as given: no conversion and
        # no one-to-one check (validate_device_maps still catches a bad map at init).
        maps: dict[str, DeviceMap] = {}
        for name, map_ in value.items():
            for k, v in map_.items():
                if not isinstance(k, torch.device) or not isinstance(v, torch.device):
                    raise TypeError(
                        f"device_maps must map torch.device to torch.device, got {k!r}: {v!r} "
                        f"for {name!r} (use set_device_map to convert ints and strings)"
                    )
            maps[_check_worker_name(name)] = dict(map_)
        self._device_maps = maps

    @property
    def devices(self) -> list[torch.device]:
        """A copy of the local device list; change it with :meth:`set_devices`."""
        return list(self._devices)

    @devices.setter
    def devices(self, value: Iterable[torch.device]) -> None:
        # Like torch's attribute: torch.device values only, stored without the CUDA check.
        devices = list(value)
        for d in devices:
            if not isinstance(d, torch.device):
                raise TypeError(
                    f"devices must be torch.device values, got {type(d).__name__}: {d!r} "
                    "(use set_devices to convert ints and strings)"
                )
        self._devices = devices

    def set_device_map(self, to: str, device_map: Mapping[DeviceType, DeviceType]) -> None:
        """Add device mappings from this worker to the worker named ``to``.

        May be called several times; the maps accumulate. A device already mapped for ``to``
        may be mapped again only to the same target.

        Args:
            to: the callee's name.
            device_map: this worker's devices to the callee's devices; must be one-to-one.

        Raises:
            ValueError: the map sends two devices to one target, or remaps a device that is
                already mapped to another target for ``to``.
            TypeError: ``to`` is not a ``str`` or a device is of the wrong type.
        """
        full = _to_device_map(device_map)
        name = _check_worker_name(to)
        current = self._device_maps.get(name)
        if current is None:
            self._device_maps[name] = full
            return
        for src, dst in full.items():
            if src in current and current[src] != dst:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, trying"
                    f" to map {src} to {dst} and {current[src]}"
                )
        # As in torch, a new source may target a device another source already targets: the
        # many-to-one map this makes is refused by validate_device_maps at init.
        current.update(full)

    def set_devices(self, devices: Iterable[DeviceType]) -> None:
        """Set the local CUDA devices the agent uses (replacing any earlier list).

        Args:
            devices: CUDA devices as ``int`` indices, strings or ``torch.device``.

        Raises:
            ValueError: a device is not a CUDA device.
        """
        self._devices = _to_device_list(devices)

    def _repr_fields(self) -> str:
        return (
            f"num_worker_threads={self.num_worker_threads!r}, {super()._repr_fields()}, "
            f"device_maps={self._device_maps!r}, devices={self._devices!r}"
        )


class ProcessGroupRpcBackendOptions(RpcBackendOptions):
    """Options of the ProcessGroup agent (torch's, removed from torch in 1.11).

    Args:
        num_send_recv_threads: threads that send and receive messages (default 4).
        rpc_timeout: default timeout of an RPC, in seconds (default 60).
        init_method: rendezvous URL (default ``env://``).

    Raises:
        RuntimeError: ``num_send_recv_threads`` is not positive or ``rpc_timeout`` is negative
            (torch's messages).
        TypeError: a value of the wrong type.
    """

    def __init__(
        self,
        num_send_recv_threads: int = rpc_constants.DEFAULT_NUM_SEND_RECV_THREADS,
        rpc_timeout: float = rpc_constants.DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = rpc_constants.DEFAULT_INIT_METHOD,
    ) -> None:
        threads = _check_int("num_send_recv_threads", num_send_recv_threads)
        super().__init__(rpc_timeout, init_method)
        if threads <= 0:
            raise RuntimeError(
                f"Cannot create ProcessGroup RPC backend with {threads} threads in the thread-pool."
            )
        self.num_send_recv_threads = threads

    @property
    def num_send_recv_threads(self) -> int:
        """Threads that send and receive messages."""
        return self._num_send_recv_threads

    @num_send_recv_threads.setter
    def num_send_recv_threads(self, value: int) -> None:
        self._num_send_recv_threads = _check_int("num_send_recv_threads", value)

    def _repr_fields(self) -> str:
        return f"num_send_recv_threads={self.num_send_recv_threads!r}, {super()._repr_fields()}"


# -- the group-wide checks an agent runs at init ----------------------------------------------------
def _valid_indices(devices: Iterable[torch.device], device_count: int) -> bool:
    # CPU is always fine; a CUDA device needs an index below the worker's count. torch compares
    # the index directly and so fails with a TypeError on an index-less "cuda"; we call it an
    # invalid index instead.
    return all(
        d.type == "cpu"
        or (d.type == "cuda" and d.index is not None and 0 <= d.index < device_count)
        for d in devices
    )


def validate_device_maps(
    all_names: Sequence[str],
    all_device_counts: Mapping[str, int] | Sequence[int],
    all_device_maps: Mapping[str, Mapping[str, Mapping[torch.device, torch.device]]],
    all_devices: Mapping[str, Sequence[torch.device]],
    is_static_group: bool = True,
) -> None:
    """Check every worker's device maps and device list against the whole group.

    The checks and their order are torch's: first each worker's own list (no duplicates,
    indices below its device count), then each map (target names known, no two sources to one
    target, sources within the worker's list -- or below its count when it gave no list --,
    targets within the target's list -- or below the target's count when it gave none).

    Args:
        all_names: every worker's name.
        all_device_counts: per name, how many CUDA devices the worker has; a sequence is read in
            the order of ``all_names``.
        all_device_maps: per name, the worker's device maps (callee name -> source -> target).
        all_devices: per name, the worker's device list (empty when it gave none).
        is_static_group: False for a group that workers join later: target names and counts
            of workers that have not joined are not checked.

    Raises:
        ValueError: the first problem found, with torch's message: duplicated devices, devices
            with invalid indices, unknown target names, duplicated target devices, unexpected
            source or target devices (not in a device list), or source or target devices with
            invalid indices.
    """
    counts: Mapping[str, int] = (
        all_device_counts
        if isinstance(all_device_counts, Mapping)
        else dict(zip(all_names, all_device_counts, strict=True))
    )
    for node in all_names:
        devices = all_devices[node]
        if len(set(devices)) != len(devices):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devices}")
        if not _valid_indices(devices, counts[node]):
            raise ValueError(
                f"Node {node} has devices with invalid indices\n"
                f"devices = {devices}\n"
                f"device count = {counts[node]}"
            )

    for source in all_names:
        maps = all_device_maps[source]
        # A worker of a dynamic group may map to one that has not joined yet.
        if is_static_group and not set(maps.keys()).issubset(all_names):
            raise ValueError(
                f"Node {source} has invalid target node names in its device maps\n"
                f"device maps = {maps.keys()}\n"
                f"node names = {all_names}"
            )
        for target, map_ in maps.items():
            if len(set(map_.values())) != len(map_):
                raise ValueError(
                    f"Node {source} has duplicated target devices "
                    f"in its device map for {target}\n"
                    f"device map = {map_}"
                )
            source_devices = all_devices[source]
            if source_devices:
                if not set(map_.keys()).issubset(source_devices):
                    raise ValueError(
                        f"Node {source} has unexpected source devices "
                        f"in its device map for {target}\n"
                        f"device map = {map_}\n"
                        f"devices = {source_devices}"
                    )
            elif not _valid_indices(map_.keys(), counts[source]):
                raise ValueError(
                    f"Node {source} has source devices with invalid indices "
                    f"in its device map for {target}\n"
                    f"device map = {map_}\n"
                    f"device count = {counts[source]}"
                )
            target_devices = all_devices.get(target, [])
            if target_devices:
                if not set(map_.values()).issubset(target_devices):
                    raise ValueError(
                        f"Node {source} has unexpected target devices "
                        f"in its device map for {target}\n"
                        f"device map = {map_}\n"
                        f"devices = {target_devices}"
                    )
            elif target in counts and not _valid_indices(map_.values(), counts[target]):
                raise ValueError(
                    f"Node {source} has target devices with invalid indices "
                    f"in its device map for {target}\n"
                    f"device map = {map_}\n"
                    f"device count = {counts[target]}"
                )


def create_reverse_mapping(
    my_name: str,
    all_names: Iterable[str],
    all_device_maps: Mapping[str, Mapping[str, Mapping[torch.device, torch.device]]],
) -> dict[str, DeviceMap]:
    """The maps replies follow back: per worker that maps to ``my_name``, its map inverted.

    Args:
        my_name: this worker's name.
        all_names: every worker's name (``my_name`` included: a worker may map to itself).
        all_device_maps: per name, the worker's device maps.

    Returns:
        Per worker name, ``my_name``'s devices to that worker's devices.
    """
    reverse: dict[str, DeviceMap] = {}
    for node in all_names:
        map_ = all_device_maps[node].get(my_name)
        if map_ is not None:
            reverse[node] = {dst: src for src, dst in map_.items()}
    return reverse


def create_device_list(
    my_devices: Sequence[torch.device],
    my_device_maps: Mapping[str, Mapping[torch.device, torch.device]],
    reverse_device_maps: Mapping[str, Mapping[torch.device, torch.device]],
) -> list[torch.device]:
    """The devices a worker's agent uses, sorted by index.

    Args:
        my_devices: the worker's own list; when empty, the list is every non-CPU device that
            the worker's maps send from or that its peers' maps send to.
        my_device_maps: the worker's device maps.
        reverse_device_maps: from :func:`create_reverse_mapping`.

    Returns:
        The device list, sorted by index.
    """
    if my_devices:
        chosen = list(my_devices)
    else:
        found: set[torch.device] = set()
        for map_ in my_device_maps.values():
            found.update(map_.keys())
        for map_ in reverse_device_maps.values():
            found.update(map_.keys())
        found.discard(torch.device("cpu"))
        chosen = list(found)
    return sorted(chosen, key=lambda d: -1 if d.index is None else d.index)


def resolve_device_maps(
    my_name: str,
    all_names: Sequence[str],
    all_device_counts: Mapping[str, int] | Sequence[int],
    all_device_maps: Mapping[str, Mapping[str, Mapping[torch.device, torch.device]]],
    all_devices: Mapping[str, Sequence[torch.device]],
    is_static_group: bool = True,
) -> tuple[dict[str, DeviceMap], list[torch.device]]:
    """What a TensorPipe agent does with the gathered device information at init.

    Validates the group's maps, then returns this worker's reverse maps and device list
    (torch's ``_tensorpipe_exchange_and_check_all_device_maps`` after its all-gather).

    Args:
        my_name: this worker's name.
        all_names: every worker's name.
        all_device_counts: per name (or in the order of ``all_names``), CUDA device counts.
        all_device_maps: per name, the worker's device maps.
        all_devices: per name, the worker's device list.
        is_static_group: see :func:`validate_device_maps`.

    Returns:
        ``(reverse_device_maps, devices)`` for ``my_name``.

    Raises:
        ValueError: from :func:`validate_device_maps`.
    """
    validate_device_maps(
        all_names, all_device_counts, all_device_maps, all_devices, is_static_group
    )
    reverse = create_reverse_mapping(my_name, all_names, all_device_maps)
    devices = create_device_list(all_devices[my_name], all_device_maps[my_name], reverse)
    return reverse, devices
