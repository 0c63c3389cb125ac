"""torchelastic's agent API (``torch.distributed.elastic.agent.server.api``): what an agent is
given (``WorkerSpec``), what it runs (``WorkerGroup`` of ``Worker``), in which state
(``WorkerState``), what it returns (``RunResult``), and the scaffolding of an agent of one role
(``SimpleElasticAgent``).

Theory of operation (``SimpleElasticAgent.run``, torch's loop). The agent joins a rendezvous
round (``spec.rdzv_handler.next_rendezvous()``), learns its group rank and the number of
agents, assigns its workers their ranks through the round's store (``assign_ranks``, a pure
function of every agent's role and worker count), starts them (``_start_workers``) and looks at
them every ``monitor_interval`` seconds (``_monitor_workers``). A group that failed, or became
unhealthy, is stopped and started again after a new round while restarts are left; a healthy
group is restarted (no restart spent) when nodes wait to join (``num_nodes_waiting() > 0``). A
group that succeeded waits for the other agents (the exit barrier) and returns. The four
abstract methods are the only ones a new agent writes. tdist's ``LocalElasticAgent`` does not
use this loop: it runs on the launcher behind ``tdist run`` (see ``local_elastic_agent``).
"""

from __future__ import annotations

import abc
import json
import logging
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ...rendezvous import RendezvousGracefulExitError, RendezvousHandler

__all__ = [
    "DEFAULT_ROLE",
    "ElasticAgent",
    "RunResult",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "assign_ranks",
]

log = logging.getLogger(__name__)

DEFAULT_ROLE = "default"
_TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"  # (torch's exit-barrier keys)
_ROLE_INFO_PREFIX = "torchelastic/role_info/"  # (torch's rank-assignment keys)
_ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"


@dataclass
class WorkerSpec:
    """What one role's workers are: the same on every node (each runs ``local_world_size``).

    Attributes:
        role: the workers' role (``ROLE_NAME``).
        local_world_size: workers on this node.
        rdzv_handler: the rendezvous the agents meet in.
        fn: deprecated: ``entrypoint``.
        entrypoint: a function (run by each worker; its return value comes back) or a program
            (a path, run with ``args``).
        args: the entrypoint's arguments; ``${local_rank}`` in a ``str`` becomes the worker's
            local rank.
        max_restarts: how many times the group is restarted after a failure.
        monitor_interval: seconds between looks at the workers.
        master_port: the workers' ``MASTER_PORT`` (None: the rendezvous's, or a free port).
        master_addr: the workers' ``MASTER_ADDR`` (None: the rendezvous's rank 0's address).
        local_addr: this node's address as the others reach it.
        event_log_handler: where the agent's worker events go (a ``tdist.elastic.events``
            destination: ``null``, ``console``).
        virtual_local_rank: every worker's ``LOCAL_RANK`` is 0 and its ``CUDA_VISIBLE_DEVICES``
            names its own device alone, as torch's.
        duplicate_stdout_filters, duplicate_stderr_filters: the strings whose teed lines are
            copied to the attempt's ``filtered_stdout.log``/``filtered_stderr.log``, as torch's.
        numa_options: torch's, accepted and not used by tdist's agent.

    Raises:
        AssertionError: ``local_world_size`` or ``monitor_interval`` not positive, or no
            entrypoint (torch's checks, torch's error type).
    """

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    fn: Callable[..., Any] | None = None
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.local_world_size <= 0:
            raise AssertionError(f"WorkerSpec.local_world_size must be positive, got {self.local_world_size}")
        if self.monitor_interval <= 0:
            raise AssertionError(f"WorkerSpec.monitor_interval must be positive, got {self.monitor_interval}")
        if self.fn:
            warnings.warn(
                "WorkerSpec.fn will be deprecated, please use WorkerSpec.entrypoint instead",
                category=DeprecationWarning,
                stacklevel=3,
            )
            self.entrypoint = self.fn
        if not self.entrypoint:
            raise AssertionError("WorkerSpec needs an entrypoint: a function or a program's path")

    def get_entrypoint_name(self) -> str:
        """A function's ``__qualname__``, or a program's file name."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        assert self.entrypoint is not None
        return str(self.entrypoint.__qualname__)


class Worker:
    """One worker of a ``WorkerGroup``: its ranks, and its ``id`` (the local agent's: its pid).

    Args:
        local_rank: its rank on this node.
        global_rank: its rank among all workers (changes from round to round).
        role_rank: its rank among the workers of its role.
        world_size: the number of workers.
        role_world_size: the number of workers of its role.
    """

    __slots__ = ["global_rank", "id", "local_rank", "role_rank", "role_world_size", "world_size"]

    def __init__(
        self,
        local_rank: int,
        global_rank: int = -1,
        role_rank: int = -1,
        world_size: int = -1,
        role_world_size: int = -1,
    ) -> None:
        self.id: Any = None
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.role_rank = role_rank
        self.world_size = world_size
        self.role_world_size = role_world_size

    def __str__(self) -> str:
        return (
            f"local_rank={self.local_rank},global_rank={self.global_rank},role_rank={self.role_rank},"
            f"world_size={self.world_size},role_world_size={self.role_world_size}"
        )

    __repr__ = __str__


class WorkerState(str, Enum):  # noqa: UP042  (torch's bases: str() and format() as torch's)
    """The state of a worker group (its workers change state together).

    ``INIT`` (made, not started), ``HEALTHY``/``UNHEALTHY`` (running), ``STOPPED`` (stopped by
    the agent, to be started again: a failure with restarts left, or a membership change),
    ``SUCCEEDED`` (all exited 0), ``FAILED``, ``UNKNOWN`` (the agent lost track of it).
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """Whether workers in ``state`` are running (healthy or not)."""
        return state in {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


class WorkerGroup:
    """The workers an agent runs for ``spec``; after each rendezvous: the round's ``store``,
    this agent's ``group_rank`` of ``group_world_size``, the workers' ``master_addr`` and
    ``master_port``. Mutable: the agent updates it while it runs."""

    __slots__ = ["group_rank", "group_world_size", "master_addr", "master_port", "spec", "state", "store", "workers"]

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Any = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT


@dataclass
class RunResult:
    """How a run ended: all of this agent's workers succeeded, or not.

    Attributes:
        state: ``SUCCEEDED`` or ``FAILED`` (or, from ``_monitor_workers``, the group's state).
        return_values: a function entrypoint's return values, by global rank (empty for a
            program).
        failures: torch's ``ProcessFailure`` of each worker that failed, by global rank
            (workers the agent stopped are in neither map).
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, Any] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED


class ElasticAgent(abc.ABC):
    """An agent: runs and watches workers, restarts them on failure, reacts to membership
    changes (torch's ``ElasticAgent``)."""

    @abc.abstractmethod
    def run(self, role: str = DEFAULT_ROLE) -> RunResult | None:
        """Run the workers until they succeed or fail, restarting them up to ``max_restarts``.

        Returns:
            Their return values or failures, by global rank (None: the rendezvous let this
            node go, ``RendezvousGracefulExitError``).
        """

    @abc.abstractmethod
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The ``WorkerGroup`` of ``role`` (the live object: it changes while the agent runs)."""


def assign_ranks(infos: Sequence[tuple[str, int]]) -> list[tuple[int, int, int, int]]:
    """Every agent's workers' ranks, from each agent's ``(role, local_world_size)`` in group
    rank order: ``(base global rank, world size, base role rank, role world size)`` per agent
    (its workers' ranks are the bases plus their local ranks), as torch assigns them."""
    role_sizes: dict[str, int] = {}
    for role, size in infos:
        role_sizes[role] = role_sizes.get(role, 0) + size
    world = sum(size for _, size in infos)
    out, base, role_bases = [], 0, dict.fromkeys(role_sizes, 0)
    for role, size in infos:
        out.append((base, world, role_bases[role], role_sizes[role]))
        base += size
        role_bases[role] += size
    return out


class SimpleElasticAgent(ElasticAgent):
    """An agent of one ``WorkerSpec`` (torch's scaffolding; see the module): a subclass writes
    ``_start_workers``, ``_stop_workers``, ``_monitor_workers`` and ``_shutdown``.

    Args:
        spec: what to run.
        exit_barrier_timeout: seconds to wait for the other agents when done.
        shutdown_timeout: seconds between the stop signal and SIGKILL when shutting down.
    """

    def __init__(self, spec: WorkerSpec, exit_barrier_timeout: float = 300, shutdown_timeout: int = 30) -> None:
        self._worker_group = WorkerGroup(spec)
        self._remaining_restarts = spec.max_restarts
        self._store: Any = None
        self._exit_barrier_timeout = exit_barrier_timeout
        self._shutdown_timeout = shutdown_timeout
        self._total_execution_time = 0

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @abc.abstractmethod
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start the group's workers; returns each one's id by local rank."""

    @abc.abstractmethod
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the group's workers, whatever their state (gone, stuck, ...)."""

    @abc.abstractmethod
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """The group's state now (with the return values or failures when it ended)."""

    @abc.abstractmethod
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Release what the agent holds; ``death_sig`` to running workers, SIGKILL after
        ``timeout`` seconds."""

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Join the next round; give the workers their ranks; note the round's store and the
        workers' ``MASTER_ADDR``/``MASTER_PORT`` (the spec's, else the round's)."""
        spec = worker_group.spec
        info = spec.rdzv_handler.next_rendezvous()
        boot = info.bootstrap_store_info
        self._store = info.store
        worker_group.workers = self._assign_worker_ranks(info.store, info.rank, info.world_size, spec)
        worker_group.store = info.store
        worker_group.group_rank = info.rank
        worker_group.group_world_size = info.world_size
        worker_group.master_addr = spec.master_addr or (boot.master_addr if boot is not None else None)
        worker_group.master_port = spec.master_port or (boot.master_port if boot is not None else None)
        log.info(
            "[%s] rendezvous complete: group rank %d of %d, restart %d, workers %s",
            spec.role, info.rank, info.world_size, spec.max_restarts - self._remaining_restarts, worker_group.workers,
        )

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec) -> list[Worker]:
        """Every agent posts its role and worker count in ``store``; rank 0 assigns the ranks
        (``assign_ranks``) and posts each agent's; each reads its own (torch's keys)."""
        info = {"role": spec.role, "rank": group_rank, "local_world_size": spec.local_world_size}
        store.set(f"{_ROLE_INFO_PREFIX}{group_rank}", json.dumps(info).encode())
        if group_rank == 0:
            posted = [json.loads(store.get(f"{_ROLE_INFO_PREFIX}{i}")) for i in range(group_world_size)]
            assigned = assign_ranks([(p["role"], int(p["local_world_size"])) for p in posted])
            for i, ranks in enumerate(assigned):
                store.set(f"{_ASSIGNED_RANKS_PREFIX}{i}", json.dumps(list(ranks)).encode())
        base, world, role_base, role_world = json.loads(store.get(f"{_ASSIGNED_RANKS_PREFIX}{group_rank}"))
        return [
            Worker(local_rank=r, global_rank=base + r, role_rank=role_base + r, world_size=world, role_world_size=role_world)
            for r in range(spec.local_world_size)
        ]

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """A rendezvous, then ``_start_workers``; the group is then ``HEALTHY`` (until
        ``_monitor_workers`` says otherwise)."""
        self._rendezvous(worker_group)
        for local_rank, worker_id in self._start_workers(worker_group).items():
            worker_group.workers[local_rank].id = worker_id
        worker_group.state = WorkerState.HEALTHY

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the workers, then a new rendezvous and start."""
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)

    def run(self, role: str = DEFAULT_ROLE) -> RunResult | None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        started = time.monotonic()
        shut_down = False
        try:
            return self._invoke_run(role)
        except RendezvousGracefulExitError as exc:
            log.info("[%s] the rendezvous let this node go: %s", self._worker_group.spec.role, exc)
            return None
        except SignalException as exc:
            log.warning("[%s] received %s: shutting down the workers", self._worker_group.spec.role, exc.sigval)
            self._shutdown(exc.sigval, timeout=self._shutdown_timeout)
            shut_down = True
            raise
        finally:
            if not shut_down:
                self._shutdown(timeout=self._shutdown_timeout)
            self._total_execution_time = int(time.monotonic() - started)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        log.info("[%s] starting workers for entrypoint: %s", spec.role, spec.get_entrypoint_name())
        self._initialize_workers(group)
        while True:
            time.sleep(spec.monitor_interval)  # (torch's polling loop: the interval is the spec's)
            result = self._monitor_workers(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return result
            if result.state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                if self._remaining_restarts > 0:
                    log.info(
                        "[%s] worker group %s; %d/%d restarts left: restarting it",
                        spec.role, result.state.name, self._remaining_restarts, spec.max_restarts,
                    )
                    self._remaining_restarts -= 1
                    self._restart_workers(group)
                    continue
                self._stop_workers(group)
                group.state = WorkerState.FAILED
                return result
            if result.state == WorkerState.HEALTHY:
                waiting = spec.rdzv_handler.num_nodes_waiting()
                if waiting > 0:  # (a membership change spends no restart)
                    log.info("[%s] %d nodes wait to join: restarting the worker group", spec.role, waiting)
                    self._restart_workers(group)
                continue
            raise RuntimeError(f"[{spec.role}] worker group in state {result.state.name}: the agent cannot go on")

    def _exit_barrier(self) -> None:
        """Wait up to ``exit_barrier_timeout`` seconds for every agent to finish (errors are
        logged: the run succeeded)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from ...utils.store import barrier

        try:
            barrier(self._store, self._worker_group.group_world_size or 1, _TERMINAL_STATE_SYNC_ID, self._exit_barrier_timeout)
        except SignalException:
            raise
        except Exception as exc:
            log.warning("[%s] exit barrier: not every agent finished: %s", self._worker_group.spec.role, exc)
