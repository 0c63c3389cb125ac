"""The launcher's decisions, as pure functions: no processes, sockets, clocks or signals here.

The agent (``_agent.py``) observes its workers and asks these functions what the observations
mean: which worker failed first, whether the group is done, whether to restart, what exit code
the launcher returns, what environment each worker gets, and how the failure report reads.
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import re
import signal
import string
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "Action",
    "ErrorFile",
    "LaunchConfig",
    "Outcome",
    "PostMortem",
    "Std",
    "StreamRoute",
    "WorkerExit",
    "comma_separated",
    "describe_exception",
    "describe_returncode",
    "duplicate_filters",
    "exit_code",
    "failures",
    "first_failure",
    "format_failure_report",
    "format_status",
    "group_outcome",
    "line_prefix",
    "logs_settings",
    "next_action",
    "parse_error_file",
    "parse_std",
    "raised_before",
    "signal_name",
    "stream_route",
    "to_map",
    "traceback_tail",
    "visible_device",
    "worker_command",
    "worker_env",
]

#: Agent keys in the job's store (outside every ``/worker/attempt_<n>`` namespace).
AGENT_PREFIX = "/tdist/agent"

#: Where torch's flight recorder dumps rank N's record: ``<prefix>N``, the prefix from the first
#: of these variables that is set, else ``DEFAULT_FLIGHT_RECORD_PREFIX`` (torch's own).
# where a worker dumps its flight record, in the order a worker reads them (tdist's name, torch's,
# torch's older one)
FLIGHT_RECORD_VARS = ("TDIST_FR_DUMP_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DEFAULT_FLIGHT_RECORD_PREFIX = "/tmp/nccl_trace_rank_"

#: torchrun's ``--start-method`` choices (its default: spawn).
START_METHODS = ("spawn", "fork", "forkserver")


class Std(enum.IntFlag):
    """torchrun's stream selector (``--redirects``, ``--tee``): which of a worker's streams."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """torch's ``Std.from_str``: ``"1"`` -> ``Std.OUT``, ``"0:3,1:0"`` -> ``{0: Std.ALL,
        1: Std.NONE}`` (:func:`parse_std`; local ranks of more than one digit too).

        Raises:
            ValueError: neither form.
        """
        return parse_std(vm)


_STD_VALUE = re.compile(r"^[0123]$")
_STD_MAP = re.compile(r"^(\d+:[0123],)*(\d+:[0123])$")


def parse_std(text: str) -> Std | dict[int, Std]:
    """``--redirects``/``--tee`` as torchrun reads them (``Std.from_str``): ``"3"`` (every
    local rank) or ``"0:1,1:2"`` (local rank 0's stdout, local rank 1's stderr).

    Raises:
        ValueError: neither form.
    """
    text = text.strip()
    if _STD_VALUE.match(text):
        return Std(int(text))
    if _STD_MAP.match(text):
        return {int(rank): Std(int(value)) for rank, value in (item.split(":") for item in text.split(","))}
    raise ValueError(
        f"{text!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every local rank "
        "or per local rank as LOCAL_RANK:VALUE,... (e.g. 0:3,1:2)"
    )


def to_map(val_or_map: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """A ``Std`` per local rank (torchrun's ``to_map``, its parameter names): one value for
    all, or the mapping's (``Std.NONE`` for a local rank it does not name; ranks beyond the
    node's are ignored)."""
    if isinstance(val_or_map, Std):
        return dict.fromkeys(range(local_world_size), val_or_map)
    return {r: val_or_map.get(r, Std.NONE) for r in range(local_world_size)}


@dataclass(frozen=True)
class LaunchConfig:
    """What ``tdist run`` was asked to do (torchrun's options, with its defaults).

    Attributes:
        entrypoint: the script (or module with ``module=True``, or program with
            ``no_python=True``).
        args: the entrypoint's arguments.
        nproc_per_node: workers on this node.
        nnodes: nodes in the job (a fixed number: no elastic ranges).
        node_rank: this node's rank; node 0 hosts the store.
        master_addr: the store's host, as the workers and the other nodes reach it.
        master_port: the store's port; 0 picks a free one (single node only).
        run_id: ``TORCHELASTIC_RUN_ID``.
        max_restarts: how many times the job's worker groups are restarted after a failure
            (on several nodes, every node restarts its group when any worker fails); with
            ``ft``, how many times a failed worker is restarted alone.
        ft: fault-tolerant workers (``tdist.elastic.ft``): a failed worker is restarted alone
            and joins the running job; the others go on.
        module: run ``python -m entrypoint``.
        no_python: run ``entrypoint`` as a program, without the Python interpreter.
        run_path: run the script ``entrypoint`` with ``runpy.run_path`` under ``@record``
            (torchrun's ``--run-path``: an escaping exception fills the worker's error file).
        stop_timeout: seconds between the stop signal and SIGKILL when stopping workers (30,
            torchrun's ``--shutdown-timeout``).
        signals: the signals that stop the job (torchrun's ``--signals-to-handle``): each is
            sent on to the workers as it comes (a stop for another reason sends SIGTERM).
        monitor_interval: seconds between checks of the other nodes' state (multi-node).
        join_timeout: seconds to wait for every node to join (multi-node).
        exit_barrier_timeout: seconds node 0 keeps the store up for the other nodes to finish.
        tail_lines: lines of a failed worker's stderr quoted in the report.
        rdzv_backend: ``"static"`` (``node_rank`` given; node 0 hosts the store), ``"c10d"``
            (the node that can bind ``master_addr:master_port`` hosts the store and is node 0;
            the others get their ranks in the order they join; ``node_rank`` is not used) or
            ``"etcd"`` (the nodes meet in etcd at ``rdzv_host:rdzv_port`` and are numbered in
            the order they come; node 0 hosts the store on a free port of ``master_addr``, this
            node's address as the others reach it).
        rdzv_host, rdzv_port: etcd's client address (etcd only).
        min_nodes: with ``nnodes`` as the most, an elastic job (``--nnodes MIN:MAX``, c10d or
            etcd): the rendezvous admits from ``min_nodes`` to ``nnodes`` nodes, waiting
            ``last_call_timeout`` seconds after ``min_nodes`` came for more; None: exactly
            ``nnodes``.
        local_addr: this node's address as the others reach it (elastic: node 0's store).
        keep_alive_interval, keep_alive_max_attempt: c10d and etcd: a node beats every
            ``keep_alive_interval`` seconds while it is in the rendezvous, and one whose
            heartbeat stood still for ``keep_alive_max_attempt`` intervals is dropped.
        is_host: c10d only: whether this node hosts the store (None: it tries).
        read_timeout: c10d only: seconds a node tries to reach the rendezvous's store before it
            gives up (torch's ``--rdzv-conf read_timeout``, 60).
        local_ranks_filter: the local ranks whose output is shown (None: every one); the
            others' is read and dropped from the console (a failure's report still quotes it,
            and their log files still get it).
        role: ``ROLE_NAME``.
        log_dir: torchrun's ``--log-dir``: the base directory of the run's logs,
            ``<log_dir>/<run_id>_<random>/attempt_<n>/<local rank>/`` with ``stdout.log``,
            ``stderr.log`` (the streams ``redirects`` or ``tee`` name) and ``error.json`` (the
            worker's ``TORCHELASTIC_ERROR_FILE``); kept after the run. None: a temporary
            directory, removed at the end unless a stream went to a file in it.
            ``os.devnull``: no files at all (no error files either), every stream on the
            console.
        log_dir_is_temporary: ``log_dir`` is a temporary directory made for the launch (a
            ``DefaultLogsSpecs()`` without a ``log_dir``): removed at the end, as None's,
            unless a stream or an error file went into it.
        redirects: the streams written to files instead of the console (one ``Std`` for every
            local rank, or one per local rank).
        tee: the streams written to files and to the console, where their lines carry the
            worker's prefix (``log_line_prefix_template``); a stream on the console that is
            not teed is copied as it is.
        start_method: torchrun's ``--start-method`` (recorded only: every worker is a new
            process running ``python -u script``, as torchrun's are for a script).
        quiet: no live status line (it is drawn only when stdout is a terminal anyway).
        metrics_port: serve the job's metrics (Prometheus text and OpenMetrics) at
            ``http://<metrics_addr>:<port>/metrics`` (0: a free port, which the launcher
            prints); None: no endpoint. Needs ``prometheus_client`` (``tdist[metrics]``).
        metrics_addr: the address the metrics endpoint listens on (default: every interface).
        log_line_prefix_template: the prefix of a worker's teed lines on the console (the
            streams ``tee`` names; the others are not prefixed), torchrun's
            ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``: a ``string.Template`` of
            ``${role_name}``, ``${rank}`` and ``${local_rank}`` (None:
            ``[<role><local rank>]:``, ``[default0]:``).
        event_log_handler: where the launcher's worker events go, torchrun's
            ``--event-log-handler`` (a ``tdist.elastic.events`` destination: ``null``,
            ``console``).
        duplicate_stdout_filters: torchrun's ``--duplicate-stdout-filters``: a line of a
            worker's stdout that is teed (on the console and in its file) and holds one of
            these strings is copied, with its console prefix, to the attempt's
            ``filtered_stdout.log``.
        duplicate_stderr_filters: the same for stderr (``filtered_stderr.log``).
        virtual_local_rank: torchrun's ``--virtual-local-rank``: every worker's ``LOCAL_RANK``
            is 0 and its ``CUDA_VISIBLE_DEVICES`` names its own device alone (its local rank,
            or the launcher's ``CUDA_VISIBLE_DEVICES`` entry at its local rank).
        node_sizes: every node's ``nproc_per_node``, by node rank, where the nodes were started
            with different ones (set by the launcher once the nodes have met; torchrun's way:
            global ranks follow the node ranks, and the world is their sum).
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    run_id: str = "none"
    max_restarts: int = 0
    ft: bool = False
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    stop_timeout: float = 30.0
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    monitor_interval: float = 0.5
    join_timeout: float = 600.0
    exit_barrier_timeout: float = 300.0
    tail_lines: int = 20
    role: str = "default"
    python: str = field(default=sys.executable)
    rdzv_backend: str = "static"
    is_host: bool | None = None
    rdzv_host: str = ""
    rdzv_port: int = 2379
    min_nodes: int | None = None
    local_addr: str = ""
    last_call_timeout: float = 30.0
    read_timeout: float = 60.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    local_ranks_filter: frozenset[int] | None = None
    log_dir: str | None = None
    log_dir_is_temporary: bool = False
    redirects: Std | Mapping[int, Std] = Std.NONE
    tee: Std | Mapping[int, Std] = Std.NONE
    start_method: str = "spawn"
    quiet: bool = False
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    log_line_prefix_template: str | None = None
    event_log_handler: str = "null"
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    node_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.entrypoint, str):
            raise TypeError(
                f"LaunchConfig.entrypoint must be a str (a script, module or program), got "
                f"{type(self.entrypoint).__name__}; to run a Python function on every worker use "
                "tdist.launcher.api.elastic_launch(config, function)"
            )
        if not all(isinstance(a, str) for a in self.args):
            raise TypeError(f"LaunchConfig.args must be strs (a command line), got {self.args!r}")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.virtual_local_rank:  # (every local rank must have a device of its own)
            visible_device(os.environ.get("CUDA_VISIBLE_DEVICES"), self.nproc_per_node - 1)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be from 0 to nnodes - 1 = {self.nnodes - 1}, got {self.node_rank}"
            )
        if self.min_nodes is not None:
            if not 1 <= self.min_nodes <= self.nnodes:
                raise ValueError(f"--nnodes {self.min_nodes}:{self.nnodes}: expected 1 <= MIN <= MAX")
            if self.rdzv_backend not in ("c10d", "etcd"):
                raise ValueError(
                    f"elastic node ranges (--nnodes {self.min_nodes}:{self.nnodes}) need --rdzv-backend c10d or etcd"
                )
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"port must have value from 0 to 65535 but was {self.master_port}.")
        if self.nnodes > 1 and self.master_port == 0 and self.rdzv_backend != "etcd":
            raise ValueError(
                "--master-port 0 (pick a free port) works on one node only: with --nnodes > 1 "
                "every node must be given the same port"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must not be negative, got {self.max_restarts}")
        if self.rdzv_backend not in ("static", "c10d", "etcd"):
            raise ValueError(f"unknown rendezvous backend {self.rdzv_backend!r}: static, c10d or etcd")
        if self.rdzv_backend == "etcd" and not self.rdzv_host:
            raise ValueError("the etcd rendezvous needs etcd's address (--rdzv-endpoint HOST[:PORT])")
        if self.module and self.no_python:
            raise ValueError("-m/--module and --no-python cannot be used together")
        if self.start_method not in START_METHODS:
            raise ValueError(f"--start-method {self.start_method!r}: expected one of {', '.join(START_METHODS)}")

    @property
    def world_size(self) -> int:
        if self.node_sizes is not None:
            return sum(self.node_sizes)
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        if self.node_sizes is not None:
            return sum(self.node_sizes[: self.node_rank]) + local_rank
        return self.node_rank * self.nproc_per_node + local_rank


# -- what workers get --------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamRoute:
    """Where one worker's streams go.

    Attributes:
        console: the streams copied to the launcher's stdout/stderr: as they are, unless
            teed (``teed``).
        files: the streams written, as they are, to ``stdout.log``/``stderr.log`` in the
            worker's log directory.
    """

    console: Std
    files: Std

    @property
    def teed(self) -> Std:
        """The streams both on the console and in their files (``--tee``'s): the console's
        lines of these carry the worker's ``line_prefix``, as torch's ``TailLog`` prints them."""
        return Std(self.console & self.files)


def stream_route(config: LaunchConfig, local_rank: int) -> StreamRoute:
    """Where worker ``local_rank``'s streams go, as torchrun's ``DefaultLogsSpecs.reify`` says:
    a stream that ``redirects`` or ``tee`` names goes to its file; it is on the console unless
    only ``redirects`` names it; a local rank outside ``local_ranks_filter`` shows nothing on
    the console (its files are still written). With ``log_dir`` ``os.devnull`` there are no
    files and every stream is on the console."""
    redirect = to_map(config.redirects, config.nproc_per_node)[local_rank]
    tee = to_map(config.tee, config.nproc_per_node)[local_rank]
    if config.log_dir == os.devnull:
        redirect = tee = Std.NONE
    files = redirect | tee
    console = tee | (Std.ALL & ~files)
    if config.local_ranks_filter is not None and local_rank not in config.local_ranks_filter:
        console = Std.NONE
    return StreamRoute(console=Std(console), files=Std(files))


def comma_separated(value: str) -> list[str]:
    """torchrun's list of strings, ``a,b``, in which ``,,`` is a comma."""
    return [item.replace("\0", ",") for item in value.replace(",,", "\0").split(",") if item]


def duplicate_filters(config: LaunchConfig, route: StreamRoute, std: Std) -> tuple[str, ...]:
    """The strings whose lines of stream ``std`` (``Std.OUT`` or ``Std.ERR``) go to the
    attempt's ``filtered_<stream>.log`` too, as torchrun's: its duplicate filters, for a
    stream that is teed (on the console and in its file); none otherwise."""
    if std not in route.files or std not in route.console:
        return ()
    return config.duplicate_stdout_filters if std is Std.OUT else config.duplicate_stderr_filters


def line_prefix(config: LaunchConfig, local_rank: int) -> str:
    """What worker ``local_rank``'s teed lines (``StreamRoute.teed``) start with on the
    console, as torchrun's: ``[<role><local rank>]:`` (``[default0]:``), or
    ``log_line_prefix_template`` with its macros substituted (torch's ``safe_substitute``).
    A stream that is not teed goes to the console as it is, without a prefix."""
    rank = config.global_rank(local_rank)
    if config.log_line_prefix_template is None:
        return f"[{config.role}{local_rank}]:"
    return string.Template(config.log_line_prefix_template).safe_substitute(
        role_name=config.role, rank=rank, local_rank=local_rank
    )


def logs_settings(specs: Any) -> dict[str, Any]:
    """``LaunchConfig``'s ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter`` from
    a ``LogsSpecs`` (tdist's or torch's: its log directory, redirects, tee and local ranks
    filter are read), or None (a temporary directory, no redirects)."""
    if specs is None:
        return {}

    def std(value: Any) -> Std | dict[int, Std]:
        if isinstance(value, Mapping):
            return {int(k): Std(int(v)) for k, v in value.items()}
        return Std(int(value))

    ranks_filter = getattr(specs, "_local_ranks_filter", None)
    return {
        "log_dir": getattr(specs, "root_log_dir", None),
        "log_dir_is_temporary": bool(getattr(specs, "_temporary", False)),
        "redirects": std(getattr(specs, "_redirects", 0)),
        "tee": std(getattr(specs, "_tee", 0)),
        "local_ranks_filter": frozenset(ranks_filter) if ranks_filter else None,
    }


def parse_signals(text: str, unknown: list[str] | None = None) -> tuple[int, ...]:
    """torchrun's ``--signals-to-handle``: names (``SIGTERM,INT``) or numbers (``15``)
    separated by commas. An unknown one goes to ``unknown`` where given and is left out (the
    caller says so, as torchrun warns and goes on).

    Raises:
        ValueError: an unknown signal, where no ``unknown`` list is given.
    """
    out = []
    for name in (v.strip() for v in text.split(",")):
        if not name:
            continue
        try:
            sig = signal.Signals(int(name)) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            if unknown is None:
                raise ValueError(f"unknown signal {name!r}") from None
            unknown.append(name)
            continue
        out.append(int(sig))
    return tuple(out)


def rdzv_settings(conf: dict[str, Any], join_timeout: float) -> dict[str, Any]:
    """The rendezvous settings of torchrun's ``--rdzv-conf`` (``rdzv_configs``), as
    ``LaunchConfig``'s fields, taken out of ``conf``: ``join_timeout`` (default
    ``join_timeout``), ``last_call_timeout`` (30), ``read_timeout`` (60, more than 0),
    ``keep_alive_interval`` (3), ``keep_alive_max_attempt`` (3) and ``is_host`` (torch's
    spellings of a boolean; None when not given). What is left in ``conf`` is not for tdist's
    launcher.

    Raises:
        ValueError: a value out of its range or of the wrong form.
    """

    def seconds(key: str, default: object) -> float:
        text = str(conf.pop(key, default))
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--rdzv-conf {key}={text!r}: expected seconds") from None
        if value < 0:
            raise ValueError(f"--rdzv-conf {key}={text}: must not be negative")
        return value

    out: dict[str, Any] = {
        "join_timeout": seconds("join_timeout", join_timeout),
        "last_call_timeout": seconds("last_call_timeout", 30.0),
        "read_timeout": seconds("read_timeout", 60.0),
        "keep_alive_interval": seconds("keep_alive_interval", 3),
    }
    if out["read_timeout"] <= 0:
        raise ValueError(f"--rdzv-conf read_timeout={out['read_timeout']:g}: expected a positive number of seconds")
    attempts = str(conf.pop("keep_alive_max_attempt", 3))
    if out["keep_alive_interval"] <= 0 or not attempts.isdigit() or int(attempts) < 1:
        raise ValueError(
            f"--rdzv-conf keep_alive_interval={out['keep_alive_interval']:g}, keep_alive_max_attempt={attempts}: "
            "expected a positive number of seconds and a whole number of at least 1"
        )
    out["keep_alive_max_attempt"] = int(attempts)
    out["is_host"] = None
    if "is_host" in conf:
        text = str(conf.pop("is_host")).strip().lower()
        if text not in ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"):
            raise ValueError(f"--rdzv-conf is_host={text!r}: expected true or false")
        out["is_host"] = text in ("1", "true", "t", "yes", "y")
    return out


LOCAL_RANK_MACRO = "${local_rank}"  # (torchrun's macro: an argument's local rank)


def substitute_local_rank(args: Iterable[Any], local_rank: str) -> list[Any]:
    """``args`` with torchrun's macro replaced in each ``str`` one, as torch's agent does it
    (``string.Template``: ``${local_rank}`` and ``$local_rank``; ``$$`` is ``$``)."""
    return [string.Template(a).safe_substitute(local_rank=local_rank) if isinstance(a, str) else a for a in args]


def worker_command(config: LaunchConfig, local_rank: int | None = None) -> list[str]:
    """The worker's argv (torchrun's: ``python -u script args``), ``${local_rank}`` in its
    arguments replaced by ``local_rank`` (torchrun's macro; ``python -m tdist.launch`` passes
    ``--local-rank=${local_rank}``)."""
    args = list(config.args)
    if local_rank is not None:
        args = substitute_local_rank(args, str(local_rank))
    if config.no_python:
        return [config.entrypoint, *args]
    if config.module:
        return [config.python, "-u", "-m", config.entrypoint, *args]
    if config.run_path:  # (as torchrun's: the script runs under @record)
        return [config.python, "-u", "-m", "tdist.elastic.multiprocessing._run_path", config.entrypoint, *args]
    return [config.python, "-u", config.entrypoint, *args]


def visible_device(visible: str | None, local_rank: int) -> str:
    """Worker ``local_rank``'s ``CUDA_VISIBLE_DEVICES`` under ``--virtual-local-rank``: the
    launcher's entry ``visible`` at its local rank, else the local rank itself.

    Raises:
        ValueError: ``visible`` names fewer devices than there are local ranks.
    """
    if visible is None:
        return str(local_rank)
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise ValueError(f"--virtual-local-rank: local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible}")
    return devices[local_rank].strip()


def worker_env(
    base: Mapping[str, str],
    config: LaunchConfig,
    local_rank: int,
    *,
    master_port: int,
    restart_count: int,
    secret: str,
    error_file: str | None = None,
    torch_port: int | None = None,
    flight_record_prefix: str | None = None,
    rdzv_round: int | None = None,
) -> dict[str, str]:
    """The environment of worker ``local_rank``: ``base`` plus what torchrun sets.

    The job's store (``master_port``) is ``MASTER_PORT``, and every worker is its client
    (``TORCHELASTIC_USE_AGENT_STORE=True``), as under torchrun: it serves torch's own
    ``TCPStore`` clients in torch's protocol (on the keys they name), and tdist's, which prove
    the job's secret, in tdist's; ``TDIST_AGENT_STORE`` names it for tdist's ``env://``.
    ``torch_port`` (a ``WorkerSpec``'s own ``master_port``) is ``MASTER_PORT`` instead, with
    ``TORCHELASTIC_USE_AGENT_STORE=False``: the program's rank 0 hosts torch's store there.

    ``OMP_NUM_THREADS`` is set to 1 when unset and several workers share the node (as torchrun
    does), ``TDIST_SECRET`` carries the job's secret, and ``TORCHELASTIC_ERROR_FILE`` (when
    ``error_file`` is given) is where ``@record`` writes the worker's uncaught exception.
    ``rdzv_round`` (a dynamic rendezvous's round) becomes ``TDIST_AGENT_ROUND``: tdist's
    ``env://`` keeps the workers' keys of each round apart, as it keeps each restart's.
    ``flight_record_prefix`` becomes ``TORCH_FR_DUMP_TEMP_FILE``, where a rank dumps its flight
    record (``<prefix><rank>``), unless ``base`` names a place already (that variable, its
    older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, or ``TDIST_FR_DUMP_TEMP_FILE``).
    """
    env = dict(base)
    rank = config.global_rank(local_rank)
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(config.node_rank),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": config.role,
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "WORLD_SIZE": str(config.world_size),
            "GROUP_WORLD_SIZE": str(config.nnodes),
            "ROLE_WORLD_SIZE": str(config.world_size),
            "MASTER_ADDR": config.master_addr,
            "MASTER_PORT": str(master_port if torch_port is None else torch_port),
            "TDIST_AGENT_STORE": f"{config.master_addr}:{master_port}",
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_RUN_ID": config.run_id,
            "TDIST_SECRET": secret,
        }
    )
    # (said either way, as torchrun's: one inherited from an enclosing torchrun job would send
    # torch's client to a MASTER_PORT that nobody serves)
    env["TORCHELASTIC_USE_AGENT_STORE"] = str(torch_port is None)
    if rdzv_round is not None:
        env["TDIST_AGENT_ROUND"] = str(rdzv_round)
    else:  # (not one inherited from an enclosing job)
        env.pop("TDIST_AGENT_ROUND", None)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # (torchrun's default, for NCCL groups)
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(signal.Signals(s).name for s in config.signals)
    if config.virtual_local_rank:  # (torchrun's: the worker's one device is its device 0)
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = visible_device(base.get("CUDA_VISIBLE_DEVICES"), local_rank)
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if flight_record_prefix is not None and not any(base.get(var) for var in FLIGHT_RECORD_VARS):
        env["TORCH_FR_DUMP_TEMP_FILE"] = flight_record_prefix
    if "OMP_NUM_THREADS" not in base and config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def omp_threads_notice(environ: Mapping[str, str], nproc_per_node: int) -> str | None:
    """What the launcher says when it gives each worker ``OMP_NUM_THREADS=1`` (``worker_env``
    does, as torchrun's does, when several workers share the node and the variable is unset),
    or ``None`` when it does not: torchrun warns once, at the start, so that a slower program
    is not a mystery."""
    if "OMP_NUM_THREADS" in environ or nproc_per_node <= 1:
        return None
    return (
        f"OMP_NUM_THREADS is not set: each of the {nproc_per_node} workers gets OMP_NUM_THREADS=1 "
        "(torchrun's default), so that they do not oversubscribe the host's cores; set it to "
        "tune the threads per worker"
    )


# -- what happened -----------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerExit:
    """One worker's end, as the agent observed it.

    Attributes:
        local_rank: the worker's local rank.
        rank: its global rank.
        pid: its process id.
        returncode: its exit status (negative: killed by that signal).
        observed_at: when the agent saw it exit (monotonic seconds; orders the failures).
        timestamp: the same moment in wall-clock seconds (for the report only).
        stopped_by_agent: the agent's signal ended it (it was still running when the group
            was stopped), so its exit is a consequence, not a failure.
        stalled: it had stopped making progress when the others failed (a stopped process, or
            the one the others' errors name as stalled): the failure that caused theirs.
        raised_at: when its ``@record`` error file says it raised (wall-clock seconds), where
            that was before the failure that stopped the group: it had failed already, though
            still running then (a slow clean-up, a hung exit), and is ordered by that moment.
        came_late: (``--ft``) a worker started again alone that found the fault-tolerant job
            over when it came to join it (its ``QuorumError``): the job had finished without
            it, which is no failure of the job.
    """

    local_rank: int
    rank: int
    pid: int
    returncode: int
    observed_at: float
    timestamp: float = 0.0
    stopped_by_agent: bool = False
    stalled: bool = False
    raised_at: float | None = None
    came_late: bool = False

    @property
    def failed(self) -> bool:
        if self.came_late:
            return False
        return self.stalled or self.raised_at is not None or (self.returncode != 0 and not self.stopped_by_agent)

    @property
    def failed_at(self) -> float:
        """When it failed, on the ``observed_at`` clock: when it raised, where its error file
        says so, else when its exit was seen."""
        if self.raised_at is None:
            return self.observed_at
        return self.observed_at - max(0.0, self.timestamp - self.raised_at)


def failures(exits: Sequence[WorkerExit]) -> list[WorkerExit]:
    """The workers that failed: a stalled one first (the others failed because of it), then
    those that failed on their own, first failed first (``failed_at``; ties: lowest rank), as
    torchrun orders them by their error files' times."""
    return sorted((e for e in exits if e.failed), key=lambda e: (not e.stalled, e.failed_at, e.rank))


def raised_before(exits: Sequence[WorkerExit], raised: Mapping[int, float]) -> list[WorkerExit]:
    """``exits``, where a worker the agent stopped had raised (its error file's time, by local
    rank, in ``raised``) a whole second or more before the first failure: marked so
    (``raised_at``). The first failure's moment is when it raised, where its own error file
    says so, else when its exit was seen: a worker that raised, then took its time to exit
    (waiting for a peer, a slow clean-up, a loaded machine), failed when it raised, before
    what the others raised meanwhile. (Error files give whole seconds; one raised in the
    second of the failure may be the agent's own signal at work, and is left as it is.)"""
    found = failures(exits)
    if not found:
        return list(exits)
    first = min(found[0].timestamp, raised.get(found[0].local_rank, found[0].timestamp))
    return [
        replace(e, raised_at=raised[e.local_rank])
        if e.stopped_by_agent and not e.failed and e.local_rank in raised and raised[e.local_rank] + 1 <= first
        else e
        for e in exits
    ]


# what tdist's process groups say of a peer that stopped making progress (its group rank, which
# is its global rank in the default group)
_STALLED = re.compile(r"(?:peer )?rank (\d+) \([^)]*\) (?:stalled|has sent nothing)")


def blamed_as_stalled(tail: Sequence[str]) -> set[int]:
    """The ranks a failed worker's last stderr lines call stalled (tdist's own messages)."""
    found: set[int] = set()
    for line in tail:
        found.update(int(m) for m in _STALLED.findall(line))
    return found


# ... and of a peer whose process is gone (its connection was lost, or the shared-memory arena
# found it dead, or the desync diagnosis did)
_LOST = re.compile(r"rank (\d+) (?:\([^)]*\)(?:, pid \d+)? (?:was lost|died)|is gone)")


def blamed_as_lost(tail: Sequence[str]) -> set[int]:
    """The ranks a failed worker's last stderr lines call lost or stalled: when all of them are
    on other nodes, the failure may be the loss of such a node, not a fault of this one."""
    found = blamed_as_stalled(tail)
    for line in tail:
        found.update(int(m) for m in _LOST.findall(line))
    return found


def first_failure(exits: Sequence[WorkerExit]) -> WorkerExit | None:
    """The root cause: the failure observed first, or ``None``."""
    found = failures(exits)
    return found[0] if found else None


class Outcome(enum.Enum):
    """The state of a worker group."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"  # a worker of ours failed
    PEER_FAILED = "peer_failed"  # another node's group failed (the job may restart)
    PEER_STOPPED = "peer_stopped"  # another node stopped for good (a signal), or the store is gone
    RESCALE = "rescale"  # nodes wait to join (an elastic range): the group restarts with them
    INTERRUPTED = "interrupted"  # the launcher got a signal


def group_outcome(
    nworkers: int,
    exits: Sequence[WorkerExit],
    *,
    signum: int | None = None,
    peer_failure: str | None = None,
    peer_stopped: bool = False,
) -> Outcome:
    """What the observations mean for the group, in order of precedence: a signal to the
    launcher, a failure of ours, a failure on another node (``peer_stopped``: one that ends
    the job), all done, still running."""
    if signum is not None:
        return Outcome.INTERRUPTED
    if any(e.failed for e in exits):
        return Outcome.FAILED
    if peer_failure is not None:
        return Outcome.PEER_STOPPED if peer_stopped else Outcome.PEER_FAILED
    if len(exits) >= nworkers:
        return Outcome.SUCCEEDED
    return Outcome.RUNNING


class Action(enum.Enum):
    """What the agent does next."""

    WAIT = "wait"  # keep watching
    FINISH = "finish"  # the job succeeded
    RESTART = "restart"  # stop the group, start it again
    STOP = "stop"  # stop the group and fail


def next_action(outcome: Outcome, restart_count: int, max_restarts: int) -> Action:
    """The agent's move: restart a failed group, ours or another node's, while restarts are
    left (torchrun's policy; every node counts the same restarts)."""
    if outcome is Outcome.RUNNING:
        return Action.WAIT
    if outcome is Outcome.SUCCEEDED:
        return Action.FINISH
    if outcome is Outcome.RESCALE:  # (a change of membership is not a failure: no restart spent)
        return Action.RESTART
    if outcome in (Outcome.FAILED, Outcome.PEER_FAILED) and restart_count < max_restarts:
        return Action.RESTART
    return Action.STOP


def exit_code(outcome: Outcome) -> int:
    """The launcher's exit status, as torchrun's: 0 when the job succeeded, else 1, whatever
    ended it (a worker's exit code or signal, another node's failure, a signal that stopped
    the launcher: torchrun's ``ChildFailedError`` or ``SignalException`` leaves its ``main``,
    and Python exits 1). The failed worker's own code is in the report."""
    return 0 if outcome is Outcome.SUCCEEDED else 1


# -- the report --------------------------------------------------------------------------------
def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9; the number for one Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def describe_returncode(returncode: int) -> str:
    """``"3"``, or ``"-9 (SIGKILL)"`` for a worker killed by a signal."""
    if returncode < 0:
        try:
            return f"{returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return str(returncode)
    return str(returncode)


def traceback_tail(lines: Sequence[str], max_lines: int = 20) -> str:
    """The last Python traceback in ``lines`` (a worker's last stderr lines), else their end
    under a line that says there is none."""
    lines = [line.rstrip("\n") for line in lines]
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            start = i
            break
    picked = lines[start:] if start is not None else lines
    if len(picked) > max_lines:
        picked = ["...", *picked[-max_lines:]]
    if not picked:
        return "<N/A> (nothing on stderr)"
    if start is None:  # (what it wrote last is not a traceback: said so, then shown)
        return "\n".join(["<N/A> (no Python traceback on stderr, which ended:)", *picked])
    return "\n".join(picked)


#: the most lines of an error file's traceback the report quotes (torchrun quotes it whole; a
#: chain of causes, an RPC's remote traceback, go on longer than a stderr tail's lines)
_ERROR_FILE_LINES = 400

_FAILURE = """[{idx}]:
  time      : {time}
  host      : {host}
  rank      : {rank} (local_rank: {local_rank})
  exitcode  : {exitcode} (pid: {pid}) {signal}
  error_file: {error_file}
  traceback :{traceback}"""


@dataclass(frozen=True)
class ErrorFile:
    """What a worker's ``@record`` wrote (torchelastic's error file): its path and the
    exception's message and traceback."""

    path: str
    message: str
    traceback: str
    timestamp: float | None = None  # (when it was raised: ``extraInfo.timestamp``, whole seconds)


def parse_error_file(path: str, text: str) -> ErrorFile | None:
    """The error file at ``path`` whose content is ``text`` (torchelastic's JSON:
    ``message.message`` and ``message.extraInfo.py_callstack``), or None when it is not that."""
    try:
        message = json.loads(text)["message"]
        if isinstance(message, str):  # (a plain message, as torch writes for some errors)
            return ErrorFile(path, message, message)
        extra = message.get("extraInfo") or {}
        try:
            when: float | None = float(extra["timestamp"])
        except (KeyError, TypeError, ValueError):
            when = None
        return ErrorFile(path, str(message.get("message", "")), str(extra.get("py_callstack", "")), when)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _format_failure(
    idx: int, e: WorkerExit, host: str, tail: Sequence[str], max_lines: int, error: ErrorFile | None
) -> str:
    when = datetime.datetime.fromtimestamp(e.timestamp).isoformat(sep="_", timespec="seconds")
    if e.stalled and e.stopped_by_agent:
        text = (
            "<stalled: it had stopped making progress when the others failed (stopped, or named "
            f"stalled in their errors); the launcher ended it ({describe_returncode(e.returncode)})>"
        )
    elif error is not None and error.traceback.strip():  # the exception @record wrote, whole, as torchrun
        tb = [line.rstrip("\n") for line in error.traceback.splitlines()]
        text = "\n".join(tb if len(tb) <= _ERROR_FILE_LINES else ["...", *tb[-_ERROR_FILE_LINES:]])
    elif e.returncode < 0:  # (torchrun's line for a signal's end, then what the worker last said)
        text = f"Signal {-e.returncode} ({signal_name(-e.returncode)}) received by PID {e.pid}"
        if any(line.strip() for line in tail):
            text += "\n" + traceback_tail(tail, max_lines)
    else:
        text = traceback_tail(tail, max_lines)
    text = text.replace("\n", "\n    ")
    return _FAILURE.format(
        idx=idx,
        time=when,
        host=host,
        rank=e.rank,
        local_rank=e.local_rank,
        exitcode=e.returncode,  # (torchrun's form: "-15 (pid: N)  (SIGTERM)", "1 (pid: N) ")
        pid=e.pid,
        signal=f" ({signal_name(-e.returncode)})" if e.returncode < 0 else "",
        error_file=error.path if error is not None else "<N/A>",
        traceback=("\n    " if "\n" in text else " ") + text,
    )


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def describe_exception(traceback_text: str) -> str | None:
    """``"ValueError: boom (raised at train.py:12, in step)"``: the exception a Python
    traceback ends with and its innermost frame; None when the text holds no traceback."""
    # (torch's init_process_group, which tdist's makes too, has every line of an uncaught
    # exception's report begin with "[rankN]: ")
    lines = [_RANK_PREFIX.sub("", line.rstrip(), count=1) for line in traceback_text.splitlines()]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")), default=None)
    if start is None:
        return None
    frame, exception = None, None
    for line in lines[start + 1:]:
        match = _FRAME.match(line)
        if match is not None:
            frame = match
        elif line and not line[0].isspace() and exception is None:
            exception = line  # (the first line of the message; a long one goes on below)
    if exception is None:
        return None
    remote = _REMOTE_ORIGIN.match(lines[start - 1]) if start > 0 else None
    where = "" if remote is None else f" on {remote['name']}"  # (an RPC's remote traceback: tdist.rpc's form)
    by = "" if remote is None else f", called by {remote['call']}"
    if frame is None:
        return exception if remote is None else f"{exception} (raised{where}{by})"
    return f"{exception} (raised{where} at {frame['file']}:{frame['line']}, in {frame['func']}{by})"


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")

# the line above a remote traceback in a rebuilt RPC exception (``tdist.rpc._errors``)
_REMOTE_ORIGIN = re.compile(r"^On WorkerInfo\(id=(?P<id>\d+), name=(?P<name>.*?)\), raised in (?P<call>.+):$")


@dataclass(frozen=True)
class PostMortem:
    """What the failure report's post-mortem tells besides the failures (this node's view).

    Attributes:
        exits: every worker's end: those that did not fail are "the others".
        outputs: each worker's last lines of output, both streams, by local rank.
        dumps: flight-recorder dumps found, by global rank.
        dumps_looked_for: where they were looked for (said when none was found).
        restarts: the restarts spent; max_restarts: ``--max-restarts``.
        earlier: each earlier attempt's failure, one line each, oldest first.
        logs: the directory of the last attempt's logs (None: not kept).
        stacks: the Python stacks (every thread) of the ranks still running when the group
            failed, taken by the launcher before it stopped them, by global rank.
    """

    exits: Sequence[WorkerExit] = ()
    outputs: Mapping[int, Sequence[str]] = field(default_factory=dict)
    dumps: Mapping[int, str] = field(default_factory=dict)
    dumps_looked_for: str = ""
    restarts: int = 0
    max_restarts: int = 0
    earlier: Sequence[str] = ()
    logs: str | None = None
    stacks: Mapping[int, str] = field(default_factory=dict)


#: lines of output quoted for each rank that was stopped
_OTHER_LINES = 5


def _how_it_failed(e: WorkerExit, tail: Sequence[str], error: ErrorFile | None) -> str:
    if e.stalled and e.stopped_by_agent:
        return (
            "stalled: it had stopped making progress when the others failed (stopped, or named "
            f"stalled in their errors); the launcher ended it ({describe_returncode(e.returncode)})"
        )
    how = f"exit code {e.returncode}" if e.returncode >= 0 else f"killed by signal {signal_name(-e.returncode)}"
    if error is not None:
        recorded = describe_exception(error.traceback) or error.message
        return f"{how}, {recorded} (its @record error file)" if recorded else how
    exception = describe_exception("".join(tail))
    return f"{how}, {exception}" if exception else how


def _what_it_was_doing(e: WorkerExit) -> str:
    if not e.stopped_by_agent:
        return f"had finished (exit code {e.returncode})"
    if e.returncode == -signal.SIGKILL:
        return "was running; it did not stop on SIGTERM and was killed with SIGKILL"
    return f"was running; stopped by the launcher with {signal_name(-e.returncode)}"


def _files_in_rank_dirs(attempt: str) -> list[str]:
    """The names of the files in an attempt's ``<local rank>/`` directories (what the
    post-mortem says is there: the streams only where ``-r``/``-t`` sent them), but the hidden
    ones (a worker's named pipe, ``_inspect.WAKE``, goes at the run's end)."""
    names: set[str] = set()
    try:
        for entry in os.scandir(attempt):
            if entry.is_dir() and entry.name.isdigit():
                names.update(n for n in os.listdir(entry.path) if not n.startswith("."))
    except OSError:
        return []
    return sorted(names)


def _format_post_mortem(
    failed: Sequence[WorkerExit],
    host: str,
    tails: Mapping[int, Sequence[str]],
    errors: Mapping[int, ErrorFile],
    pm: PostMortem,
) -> list[str]:
    root = failed[0]
    lines = [
        "Post-mortem:",
        f"  first failure : rank {root.rank} (local_rank {root.local_rank}, host {host}): "
        + _how_it_failed(root, tails.get(root.local_rank, ()), errors.get(root.local_rank)),
    ]
    for e in failed[1:]:
        lines.append(
            f"  also failed   : rank {e.rank} (local_rank {e.local_rank}): "
            + _how_it_failed(e, tails.get(e.local_rank, ()), errors.get(e.local_rank))
        )
    failed_ranks = {e.local_rank for e in failed}
    others = sorted((e for e in pm.exits if e.local_rank not in failed_ranks), key=lambda e: e.rank)
    if others:
        lines.append("  the others    :")
    for e in others:
        doing = _what_it_was_doing(e)
        if not e.stopped_by_agent:
            lines.append(f"    rank {e.rank} (local_rank {e.local_rank}) {doing}")
            continue
        output = [line.rstrip("\n") for line in pm.outputs.get(e.local_rank, ())][-_OTHER_LINES:]
        lines.append(f"    rank {e.rank} (local_rank {e.local_rank}) {doing}; " + ("its last output:" if output else "it had printed nothing"))
        lines.extend(f"      | {line}" for line in output)
    if pm.dumps:
        lines.append("  flight records:")
        lines.extend(f"    rank {rank}: {path}" for rank, path in sorted(pm.dumps.items()))
    elif pm.dumps_looked_for:
        lines.append(f"  flight records: none found ({pm.dumps_looked_for})")
    if pm.stacks:
        lines.append("  stacks        : (the ranks still running, every thread, taken before they were stopped)")
        lines.extend(f"    rank {rank}: {path}" for rank, path in sorted(pm.stacks.items()))
    if pm.max_restarts == 0:
        lines.append("  restarts      : none allowed (--max-restarts 0)")
    else:
        lines.append(f"  restarts      : {pm.restarts} of {pm.max_restarts} used (--max-restarts)")
        lines.extend(f"    {line}" for line in pm.earlier)
    if pm.logs is not None:
        kept = _files_in_rank_dirs(pm.logs)
        lines.append(f"  logs          : {pm.logs}/<local rank>/" + (f" ({', '.join(kept)})" if kept else ""))
    elif errors:  # (the error files the report names stay where they are: the run's temporary directory)
        lines.append(
            "  logs          : not kept but for the error files named above (--log-dir DIR keeps each "
            "rank's error.json, and the streams that -r/-t send there as stdout.log, stderr.log)"
        )
    else:
        lines.append(
            "  logs          : not kept (--log-dir DIR keeps each rank's error.json, and the streams "
            "that -r/-t send there as stdout.log, stderr.log)"
        )
    return lines


def format_failure_report(
    name: str,
    failed: Sequence[WorkerExit],
    *,
    host: str,
    tails: Mapping[int, Sequence[str]],
    max_lines: int = 20,
    error_files: Mapping[int, ErrorFile] | None = None,
    post_mortem: PostMortem | None = None,
) -> str:
    """A report of failed workers in the shape of torchrun's ``ChildFailedError`` (with
    ``post_mortem``, its "Failures:" also lists, as torchrun's, the workers the launcher
    stopped that exited with a non-zero status), then, with ``post_mortem``, a summary: how the first failure happened, what the other ranks were
    doing when they were stopped, flight-recorder dumps, restarts, where the logs are.

    Args:
        name: the entrypoint (the report's title is ``"<name> FAILED"``).
        failed: the failures, root cause first (see ``failures``).
        host: this host's name (torch's: ``socket.getfqdn()``).
        tails: each worker's last stderr lines, by local rank.
        max_lines: lines of traceback quoted per failure.
        error_files: what workers' ``@record`` wrote, by local rank: the traceback quoted
            comes from there, else from the stderr tail.
        post_mortem: what the summary tells besides the failures (None: no summary).

    Raises:
        ValueError: no failure to report.
    """
    if not failed:
        raise ValueError("format_failure_report needs at least one failure")
    title = f"{name} FAILED"
    root, others = failed[0], failed[1:]
    errors = error_files or {}
    # and, as torchrun lists them, the ranks the launcher stopped that exited with a non-zero
    # status (its SIGTERM: "Signal 15 (SIGTERM) received"; the post-mortem says what they did)
    listed = {e.local_rank for e in failed}
    stopped = [] if post_mortem is None else sorted(
        (e for e in post_mortem.exits if e.stopped_by_agent and e.returncode != 0 and e.local_rank not in listed),
        key=lambda e: e.rank,
    )
    shown = [(e, tails.get(e.local_rank, ())) for e in others] + [(e, ()) for e in stopped]
    other_text = "\n".join(
        _format_failure(i + 1, e, host, tail, max_lines, errors.get(e.local_rank)) for i, (e, tail) in enumerate(shown)
    )
    root_text = _format_failure(0, root, host, tails.get(root.local_rank, ()), max_lines, errors.get(root.local_rank))
    summary = [] if post_mortem is None else _format_post_mortem(failed, host, tails, errors, post_mortem)
    width = min(60, max(len(line) for line in [title, *root_text.splitlines(), *other_text.splitlines(), *summary]))
    if summary:
        summary.insert(0, "-" * width)
    return "\n".join(
        [
            "=" * width,
            title,
            "-" * width,
            "Failures:",
            other_text or "  <NO_OTHER_FAILURES>",
            "-" * width,
            "Root Cause (a stalled rank, else the first observed failure):" if root.stalled else "Root Cause (first observed failure):",
            root_text,
            *summary,
            "=" * width,
        ]
    )


# -- the live status line ----------------------------------------------------------------------
def _clock_time(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_status(
    *,
    running: int,
    finished: int,
    failed: int,
    restarts: int,
    max_restarts: int,
    elapsed: float,
    progress: str | None,
    width: int,
) -> str:
    """The launcher's live status line: ranks running, finished and failed on this node, the
    restarts used (when any are allowed), the time since the job started and the last line a
    worker printed (``progress``, ``"rank<N>: ..."``), cut to ``width - 1`` characters (a line
    as wide as the terminal would wrap, and erasing it would then erase only its end)."""
    parts = [f"[tdist run] {running} running, {finished} finished, {failed} failed"]
    if max_restarts:
        parts.append(f"restart {restarts}/{max_restarts}")
    parts.append(_clock_time(elapsed))
    if progress:
        parts.append(progress)
    text = " | ".join(parts)
    room = max(width - 1, 1)
    return text if len(text) <= room else text[: max(room - 3, 0)] + "..."[: room]
