"""``torch.distributed.launcher.api`` under tdist's name: ``elastic_launch`` and torch's
``LaunchConfig``, on the launcher behind ``tdist run``.

``elastic_launch(config, entrypoint)(*args)`` starts this node's ``config.nproc_per_node``
workers as ``tdist run`` would (each a new process with torchrun's environment, the job's store
and secret, restarts, the failure report) and returns what they returned, by global rank:

- a Python function: each worker calls ``entrypoint(*args)`` and its return value comes back
  (pickled, so it must be picklable; the function must be importable by the workers, as for
  ``multiprocessing``'s ``spawn``: a module's function, or one of the launching script's, whose
  top level the workers run again under ``__mp_main__``);
- a string: a program run with ``args`` as its arguments (``sys.executable`` with ``"-u",
  "script.py"`` runs a script); every value is ``None``.

A failed job raises torch's ``ChildFailedError``, naming each failed worker with its exit code
and the error file its ``@record`` wrote; a job stopped by a signal raises torch's
``SignalException``. Where tdist's launcher differs from torch's: workers are always new
processes (``start_method`` is recorded only), and the rendezvous backends are ``static``, ``c10d`` and ``etcd``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..elastic._agent import LocalAgent

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

log = logging.getLogger(__name__)

_DEFAULT_RDZV_TIMEOUT = 900  # seconds (torch's)


@dataclass
class LaunchConfig:
    """torch's launch configuration (``torch.distributed.launcher.api.LaunchConfig``).

    Attributes:
        min_nodes, max_nodes: the job's node count, or its elastic range (c10d or etcd).
        nproc_per_node: workers on this node.
        logs_specs: where the workers' logs go: ``tdist.elastic.multiprocessing.DefaultLogsSpecs``
            or torch's (its log directory, redirects, tee and local ranks filter are read);
            ``None``: a ``DefaultLogsSpecs()`` (a new temporary directory), as torch's.
        run_id: the job's id (``TORCHELASTIC_RUN_ID``; empty: a random one).
        role: ``ROLE_NAME``.
        rdzv_endpoint: ``host[:port]``: static, node 0's store (port required); c10d, where the
            nodes meet (port 29400 by default); etcd, etcd's client address (2379).
        rdzv_backend: ``"static"``, ``"c10d"`` or ``"etcd"`` (``"etcd-v2"`` too).
        rdzv_configs: ``rank`` (static: this node's rank), ``timeout`` or ``join_timeout``
            (seconds to wait for the nodes), ``last_call_timeout``, ``is_host``,
            ``keep_alive_interval``, ``keep_alive_max_attempt``; others are ignored.
        rdzv_timeout: ``rdzv_configs["timeout"]`` when not -1 (default 900 s).
        max_restarts: restarts of the worker group after a failure.
        monitor_interval: seconds between checks of the other nodes.
        start_method: recorded (workers are new processes whatever it says).
        local_addr: this node's address as the others reach it.
        signals_to_handle: the signals that stop the job, sent on to the workers.
        shutdown_timeout: seconds between a stop signal and SIGKILL (default
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30).
        event_log_handler: where the launcher's worker events go (a ``tdist.elastic.events``
            destination: ``null``, ``console``).
        log_line_prefix_template: the prefix of each worker's teed lines on the console (the
            streams ``logs_specs`` tees; the others are not prefixed), a ``string.Template`` of
            ``${role_name}``, ``${rank}``, ``${local_rank}`` (None: ``[<role><local rank>]:``).
        virtual_local_rank: every worker's ``LOCAL_RANK`` is 0 and its ``CUDA_VISIBLE_DEVICES``
            names its own device alone, as torch's.
        duplicate_stdout_filters, duplicate_stderr_filters: the strings whose teed lines of
            stdout/stderr are copied to the attempt's ``filtered_stdout.log``/``filtered_stderr.log``,
            as torch's.
        metrics_cfg, numa_options: accepted, not used (CPU workers; tdist's launcher logs its
            own way).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | None = None

    def __post_init__(self) -> None:
        if self.logs_specs is None:
            from ..elastic.multiprocessing import DefaultLogsSpecs

            self.logs_specs = DefaultLogsSpecs()
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = _DEFAULT_RDZV_TIMEOUT
        if self.shutdown_timeout is None:
            self.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")


class elastic_launch:  # (torch's name)
    """``elastic_launch(config, entrypoint)(*args)``: run ``entrypoint`` on this node's workers
    (see the module docstring); returns ``{global rank: return value}``.

    Raises:
        ChildFailedError: a worker failed (torch's class).
        SignalException: the launcher was stopped by a signal (torch's class).
        ValueError: a configuration the launcher cannot run.
    """

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, health_check_server: Any = None) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def _get_entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """The name a failure is reported under: a function's name, a script's (the first
    argument of ``sys.executable`` that is not an option), or the program's."""
    if callable(entrypoint):
        return str(getattr(entrypoint, "__name__", repr(entrypoint)))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    health_check_server: Any = None,
) -> dict[int, Any]:
    """Run ``entrypoint`` with ``args`` on this node's workers (``elastic_launch``'s body).
    ``health_check_server``: torch's, accepted and not used (as by ``elastic_launch``)."""
    from ..elastic._agent import LocalAgent
    from ..elastic.multiprocessing import _call

    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    name = _get_entrypoint_name(entrypoint, args)
    results: str | None = None
    try:
        if callable(entrypoint):
            results = tempfile.mkdtemp(prefix="tdist_launch_")
            cfg = _tdist_config(config, _call.WORKER_MODULE, _call.launcher_call(results, entrypoint, args), module=True)
        elif isinstance(entrypoint, str):
            cfg = _tdist_config(config, entrypoint, tuple(str(a) for a in args), no_python=True)
        else:
            raise ValueError(f"entrypoint must be a function or a program (str), got {entrypoint!r}")
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
        agent = LocalAgent(cfg)
        agent.title = name
        agent.keep_report = True  # (it goes in the ChildFailedError: printed if uncaught)
        code = agent.run()
        if code != 0:
            raise _failure(agent, name, code)
        if results is None:
            return dict.fromkeys(sorted(e.rank for e in agent.last_exits))
        return _call.launcher_values(results, agent.last_exits)
    finally:
        if results is not None:
            shutil.rmtree(results, ignore_errors=True)


def _failure(agent: LocalAgent, name: str, code: int) -> BaseException:
    """torch's exception for a job that ended with ``code``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if agent.signum is not None:
        return agent.signal_exception()
    exc = ChildFailedError(name=name, failures=agent.process_failures(code))
    if agent.failure_report:  # (its words: tdist's report, with the post-mortem)
        exc.args = ("\n" + agent.failure_report,)
    return exc


def _tdist_config(
    config: LaunchConfig, entrypoint: str, args: tuple[str, ...], *, module: bool = False, no_python: bool = False
) -> Any:
    """tdist's ``elastic.LaunchConfig`` for torch's ``config``."""
    from ..elastic._policy import LaunchConfig as Config
    from ..elastic._policy import logs_settings, parse_signals, rdzv_settings
    from ..elastic.rendezvous import parse_rendezvous_endpoint

    if not 1 <= config.min_nodes <= config.max_nodes:
        raise ValueError(f"min_nodes {config.min_nodes}, max_nodes {config.max_nodes}: expected 1 <= min_nodes <= max_nodes")
    conf = dict(config.rdzv_configs)
    backend = {"etcd-v2": "etcd"}.get(config.rdzv_backend, config.rdzv_backend)
    node_rank = 0
    master_addr, master_port, rdzv_host, rdzv_port = "127.0.0.1", 29500, "", 2379
    if backend == "static":
        if not config.rdzv_endpoint.strip():
            raise ValueError("Endpoint is missing in endpoint. Try to add --master-addr and --master-port")
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, -1)
        if master_port == -1:
            raise ValueError(f"port is missing in endpoint: {config.rdzv_endpoint}. Try to specify --master-port")
        node_rank = int(conf.get("rank", 0))
    elif backend == "c10d":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, 29400)
    elif backend == "etcd":
        rdzv_host, rdzv_port = parse_rendezvous_endpoint(config.rdzv_endpoint, 2379)
        master_addr, master_port = config.local_addr or socket.getfqdn(), 0
    else:
        raise ValueError(f"unknown rendezvous backend {config.rdzv_backend!r}: tdist's launcher runs static, c10d and etcd")
    conf.pop("rank", None)
    rdzv = rdzv_settings(conf, float(conf.pop("timeout", _DEFAULT_RDZV_TIMEOUT)))  # (torch's "timeout": the join's)
    signals = parse_signals(config.signals_to_handle)

    return Config(
        entrypoint=entrypoint,
        args=args,
        nproc_per_node=config.nproc_per_node,
        nnodes=config.max_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        run_id=config.run_id,
        max_restarts=config.max_restarts,
        stop_timeout=float(config.shutdown_timeout if config.shutdown_timeout is not None else 30),
        signals=signals,
        python=os.environ.get("PYTHON_EXEC") or sys.executable,
        monitor_interval=config.monitor_interval,
        rdzv_backend=backend,
        min_nodes=config.min_nodes if config.min_nodes != config.max_nodes else None,
        local_addr=config.local_addr or "",
        rdzv_host=rdzv_host,
        rdzv_port=rdzv_port,
        role=config.role,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        event_log_handler=config.event_log_handler,
        virtual_local_rank=config.virtual_local_rank,
        duplicate_stdout_filters=tuple(config.duplicate_stdout_filters or ()),
        duplicate_stderr_filters=tuple(config.duplicate_stderr_filters or ()),
        **logs_settings(config.logs_specs),
        quiet=True,
        module=module,
        no_python=no_python,
        **rdzv,
    )
