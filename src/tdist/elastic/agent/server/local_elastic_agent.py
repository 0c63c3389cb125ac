"""``LocalElasticAgent``: torch's agent of one node's workers, on the launcher behind ``tdist
run`` (``tdist.elastic._agent.LocalAgent``).

``run()`` turns the ``WorkerSpec`` into the launcher's ``LaunchConfig`` and hands the spec's
rendezvous handler to a ``LocalAgent``, which drives it: each round gives this node its group
rank and the node count, rank 0's agent starts the workers' store, the workers get torch's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
``TORCHELASTIC_RUN_ID``, ...), a failed group is restarted after a new round while restarts
are left, a healthy one when nodes wait to join, and a finished one waits for the other agents
(the exit barrier). The ``WorkerGroup`` follows along (``get_worker_group()``, from any
thread). A function entrypoint runs in each worker as ``elastic_launch`` runs one
(``tdist.elastic.multiprocessing._worker``): it must be picklable and importable by a new process (as for
``spawn``), and its return value comes back in ``RunResult.return_values``.

Where it differs from torch's: workers are always new processes (``start_method`` is checked,
not used), global ranks are ``group_rank * local_world_size + local_rank`` (every node runs the
same role with the same ``local_world_size``, as ``WorkerSpec`` asks: mixed roles or sizes are
not supported), and ``RunResult.failures`` names only the workers that failed on their own
(torch's program workers also list those its agent stopped). Of the scaffolding's hooks,
``_stop_workers`` and ``_shutdown`` stop a running group from any thread (``run()`` then raises
``SignalException``) and ``_monitor_workers`` reports its state; ``_start_workers`` raises
``NotImplementedError``: the workers start inside ``run()``, never one step at a time.

What a rendezvous handler must be (tdist's static, c10d and etcd handlers are): a
``tdist.elastic.rendezvous.RendezvousHandler`` whose rounds give a tdist ``Store`` (the agents'
keys and exit barrier are there) and a ``bootstrap_store_info`` endpoint for the workers' store
(None: rank 0 picks one and posts it in the round's store). With ``use_agent_store`` False
(c10d, etcd) the agent of rank 0 starts a tdist store server on that port, which must be free
on its host; with True (static) the handler serves the endpoint itself with a tdist store, open
or with the secret in ``TDIST_SECRET``. Several nodes need ``TDIST_SECRET`` unless the
handler's own store serves the workers. Only tdist's c10d/etcd handler tells the agent of lost
members and node ranges (a scale-down on SIGTERM); any other handler is asked
``num_nodes_waiting()`` each ``monitor_interval``, as torch's agent does. torch's own
handlers (torch's stores) are not supported: the workers speak tdist's store protocol.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Any

from ..._agent import LaunchError, LocalAgent, _Worker
from ..._policy import LaunchConfig, Outcome, logs_settings, parse_signals
from ...multiprocessing import _call
from ...rendezvous import RendezvousError, RendezvousGracefulExitError, RendezvousInfo
from .api import (
    DEFAULT_ROLE,
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_TIMER_FILE",
    "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT",
    "LocalElasticAgent",
]

log = logging.getLogger(__name__)

# torch's names of its watchdog's and health check's variables (tdist's agent reads none of them)
TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
TORCHELASTIC_HEALTH_CHECK_PORT = "TORCHELASTIC_HEALTH_CHECK_PORT"
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"
TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"

_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # (torch's; its default below)
_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

# what the group is once its workers have all ended, by why they did
_ENDED = {
    Outcome.SUCCEEDED: WorkerState.SUCCEEDED,
    Outcome.FAILED: WorkerState.FAILED,
    Outcome.PEER_FAILED: WorkerState.FAILED,
    Outcome.PEER_STOPPED: WorkerState.FAILED,
}


class _SpecAgent(LocalAgent):
    """The launcher's agent, keeping a ``WorkerGroup`` up to date and applying the spec's
    ``master_addr``/``master_port``."""

    def __init__(self, config: LaunchConfig, spec: WorkerSpec, group: WorkerGroup, **kwargs: Any) -> None:
        super().__init__(config, rendezvous=spec.rdzv_handler, **kwargs)
        self._spec, self._group = spec, group
        self.restarts_used = 0

    def _workers_store(self, info: RendezvousInfo) -> tuple[str, int]:
        addr, port = super()._workers_store(info)
        return self._spec.master_addr or addr, port

    def _torch_port(self, port: int) -> int | None:
        return self._spec.master_port or super()._torch_port(port)

    def _group_started(self, workers: list[_Worker], restart_count: int, torch_port: int) -> None:
        cfg, group = self.config, self._group
        members = []
        for w in workers:
            member = Worker(w.local_rank, w.rank, w.rank, cfg.world_size, cfg.world_size)
            member.id = w.proc.pid
            members.append(member)
        group.workers = members
        group.store = self._store
        group.group_rank, group.group_world_size = cfg.node_rank, cfg.nnodes
        group.master_addr, group.master_port = cfg.master_addr, torch_port
        group.state = WorkerState.HEALTHY
        self.restarts_used = restart_count

    def _group_ended(self, outcome: Outcome) -> None:
        self._group.state = _ENDED.get(outcome, WorkerState.STOPPED)


class LocalElasticAgent(SimpleElasticAgent):
    """torch's agent of this node's workers (see the module): ``run()`` starts
    ``spec.local_world_size`` workers after each rendezvous round, restarts them up to
    ``spec.max_restarts`` times, and returns a ``RunResult``.

    Args:
        spec: what to run, and the rendezvous handler.
        logs_specs: where the workers' logs go (``tdist.elastic.multiprocessing.DefaultLogsSpecs``
            or torch's: ``<log_dir>/<run id>_<random>/attempt_<n>/<local rank>/`` with
            ``stdout.log``, ``stderr.log``, ``error.json``; its redirects, tee and local ranks
            filter apply).
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` (checked; workers are
            always new processes).
        exit_barrier_timeout: seconds to wait for the other agents when done.
        log_line_prefix_template: the prefix of each worker's teed console lines (the
            streams the logs specs tee; the others are not prefixed), a ``string.Template`` of
            ``${role_name}``, ``${rank}``, ``${local_rank}`` (None: ``[<role><local rank>]:``).
        shutdown_timeout: seconds between the stop signal and SIGKILL.
        health_check_server, uninterruptible_state_timeout: torch's, accepted and not used.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: Any,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        health_check_server: Any = None,
        uninterruptible_state_timeout: float | None = None,
    ) -> None:
        super().__init__(spec, exit_barrier_timeout, shutdown_timeout)
        self._start_method = start_method
        self._logs_specs = logs_specs
        self._log_line_prefix_template = log_line_prefix_template
        self._rdzv_handler = spec.rdzv_handler
        self._agent: _SpecAgent | None = None
        self._finished: threading.Event | None = None  # (set once run() has stopped everything)
        self._runner: int | None = None  # (the thread in run())

    def _launch_config(self, entrypoint: str, args: tuple[str, ...], *, module: bool, no_python: bool) -> LaunchConfig:
        spec = self._worker_group.spec
        return LaunchConfig(
            entrypoint=entrypoint,
            args=args,
            module=module,
            no_python=no_python,
            nproc_per_node=spec.local_world_size,
            run_id=spec.rdzv_handler.get_run_id(),
            max_restarts=spec.max_restarts,
            monitor_interval=spec.monitor_interval,
            role=spec.role,
            local_addr=spec.local_addr or "",
            exit_barrier_timeout=self._exit_barrier_timeout,
            stop_timeout=float(self._shutdown_timeout),
            signals=parse_signals(os.environ.get(_SIGNALS_ENV) or _DEFAULT_SIGNALS),
            python=os.environ.get("PYTHON_EXEC") or sys.executable,
            start_method=self._start_method,
            log_line_prefix_template=self._log_line_prefix_template,
            event_log_handler=spec.event_log_handler,
            virtual_local_rank=spec.virtual_local_rank,
            duplicate_stdout_filters=tuple(spec.duplicate_stdout_filters or ()),
            duplicate_stderr_filters=tuple(spec.duplicate_stderr_filters or ()),
            quiet=True,
            **logs_settings(self._logs_specs),
        )

    def run(self, role: str = DEFAULT_ROLE) -> RunResult | None:
        """Run the workers (see the class).

        Returns:
            ``SUCCEEDED`` with the return values by global rank (a function entrypoint; empty
            for a program), or ``FAILED`` with each failed worker's torch ``ProcessFailure``
            by global rank; None when the rendezvous let this node go
            (``RendezvousGracefulExitError``).

        Raises:
            SignalException: the agent got one of ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (torch's
                class; the workers were stopped with it).
            RendezvousError: the rendezvous failed (closed, timed out, unreachable).
            LaunchError: the job could not be set up (a port taken, no shared secret).
        """
        spec = self._worker_group.spec
        results: str | None = None
        self._runner, self._finished = threading.get_ident(), threading.Event()
        try:
            if callable(spec.entrypoint):
                results = tempfile.mkdtemp(prefix="tdist_agent_")
                config = self._launch_config(
                    _call.WORKER_MODULE, _call.launcher_call(results, spec.entrypoint, spec.args), module=True, no_python=False
                )
            else:
                assert isinstance(spec.entrypoint, str)
                config = self._launch_config(spec.entrypoint, tuple(str(a) for a in spec.args), module=False, no_python=True)
            agent = self._agent = _SpecAgent(config, spec, self._worker_group)
            agent.title = spec.get_entrypoint_name()
            log.info("[%s] starting workers for entrypoint: %s", spec.role, agent.title)
            try:
                code = agent.run()
            except LaunchError as exc:
                if isinstance(exc.__cause__, RendezvousGracefulExitError):
                    log.info("[%s] the rendezvous let this node go: %s", spec.role, exc.__cause__)
                    return None
                if isinstance(exc.__cause__, RendezvousError):  # (torch's agent raises the rendezvous's error)
                    raise exc.__cause__ from exc
                raise
            finally:
                self._remaining_restarts = spec.max_restarts - agent.restarts_used
            if agent.signum is not None:
                raise agent.signal_exception()
            if code != 0:
                self._worker_group.state = WorkerState.FAILED
                return RunResult(WorkerState.FAILED, failures=agent.process_failures(code))
            if results is None:  # (a program: no values, each rank's None, as torch's)
                values = dict.fromkeys(sorted(e.rank for e in agent.last_exits))
            else:
                values = _call.launcher_values(results, agent.last_exits)
            return RunResult(WorkerState.SUCCEEDED, return_values=values)
        finally:
            if results is not None:
                shutil.rmtree(results, ignore_errors=True)
            self._finished.set()

    # (the scaffolding's hooks: ``run`` above goes through the launcher's agent, not them)
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        raise NotImplementedError("LocalElasticAgent starts its workers inside run() (tdist's LocalAgent)")

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the running group's workers (SIGTERM, then SIGKILL after the shutdown
        timeout), from any thread; ``run()`` then raises ``SignalException``. Nothing when no
        group runs."""
        self._shutdown(signal.SIGTERM)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """The group's state as ``run()`` keeps it (``HEALTHY`` while its workers run; values
        and failures come with ``run()``'s own result)."""
        return RunResult(worker_group.state)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Stop the running workers with ``death_sig`` (as a signal to the agent would), from
        any thread, and wait up to ``timeout`` seconds until ``run()`` has stopped them all
        (from ``run()``'s own thread, a signal handler: no wait); ``run()`` then raises
        ``SignalException``. Nothing when no group runs."""
        agent, finished = self._agent, self._finished
        if agent is None or finished is None or finished.is_set():
            return
        agent._on_signal(int(death_sig), None)
        if threading.get_ident() != self._runner:
            finished.wait(timeout)
