"""``torch.distributed.run`` under tdist's name.

``python -m tdist.run`` is ``tdist run`` (the project's torchrun, with its status line,
``--ft`` and ``--metrics-port``; see ``tdist run --help``), and exits with its exit code.

The module's functions are torchrun's programmatic interface, which wrappers (accelerate,
torchtune, ...) call: ``get_args_parser()`` and ``parse_args(argv)`` give torchrun's options
under torchrun's names (``training_script``, ``rdzv_id``, ...; ``PET_<OPTION>`` environment
defaults), ``config_from_args(args)`` turns them into ``tdist.launcher.api.LaunchConfig`` and
the command to run, ``run(args)`` runs it with ``elastic_launch`` (raising torch's
``ChildFailedError`` when a worker fails) and ``main(argv)`` parses and runs; torchrun's helpers
``parse_min_max_nnodes``, ``determine_local_world_size``, ``get_rdzv_endpoint`` and
``get_use_env`` are here too.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._core import lazy

__all__ = [
    "config_from_args",
    "determine_local_world_size",
    "get_args_parser",
    "get_rdzv_endpoint",
    "get_use_env",
    "main",
    "parse_args",
    "parse_min_max_nnodes",
    "run",
    "run_script_path",
]

log = logging.getLogger(__name__)


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser: its options, defaults and ``dest`` names."""
    from .cli import NUMA_MODES, _pet_defaults
    from .elastic._policy import comma_separated

    p = argparse.ArgumentParser(description="Torch Distributed Elastic Training Launcher (tdist)")

    def opt(name: str, **kw: Any) -> None:  # (torchrun's spelling with underscores too)
        p.add_argument(*dict.fromkeys((name, "--" + name[2:].replace("-", "_"))), **kw)

    opt("--nnodes", type=str, default="1:1", help="nodes, or MIN:MAX")
    opt("--nproc-per-node", type=str, default="1", help="workers per node: a number, cpu or auto")
    opt("--rdzv-backend", type=str, default="static", help="static, c10d or etcd")
    opt("--rdzv-endpoint", type=str, default="", help="host[:port] of the rendezvous")
    opt("--rdzv-id", type=str, default="none", help="the job's id")
    opt("--rdzv-conf", type=str, default="", help="rendezvous settings: key1=value1,key2=value2")
    p.add_argument("--standalone", action="store_true", help="one node, a rendezvous of its own")
    opt("--max-restarts", type=int, default=0, help="restarts of the worker group")
    opt("--monitor-interval", type=float, default=0.1, help="seconds between checks")
    opt("--start-method", type=str, default="spawn", choices=["spawn", "fork", "forkserver"])
    opt("--event-log-handler", type=str, default="null")
    p.add_argument("--role", type=str, default="default")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module")
    opt("--no-python", action="store_true", help="run the script as a program")
    opt("--run-path", action="store_true", help="run the script with runpy.run_path")
    opt("--log-dir", type=str, default=None)
    p.add_argument("-r", "--redirects", type=str, default="0")
    p.add_argument("-t", "--tee", type=str, default="0")
    opt("--local-ranks-filter", type=str, default="")
    opt("--duplicate-stdout-filters", type=comma_separated, default=[])
    opt("--duplicate-stderr-filters", type=comma_separated, default=[])
    opt("--node-rank", type=int, default=0)
    opt("--master-addr", type=str, default="127.0.0.1")
    opt("--master-port", type=int, default=None)
    opt("--local-addr", type=str, default=None)
    opt("--logs-specs", type=str, default=None)
    opt("--numa-binding", type=str, default=None, choices=NUMA_MODES)
    opt("--signals-to-handle", type=str, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    opt("--shutdown-timeout", type=int, default=None)
    opt("--virtual-local-rank", action="store_true")
    p.add_argument("training_script", type=str, help="the script (or module, or program) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    _pet_defaults(p)
    return p


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """torchrun's options from ``args`` (the command line's when ``None``)."""
    return get_args_parser().parse_args(args)


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``, ``N`` or ``MIN:MAX``, as ``(MIN, MAX)``.

    Raises:
        RuntimeError: not of that form (torch's type).
    """
    from .cli import _nnodes

    try:
        return _nnodes(nnodes)
    except argparse.ArgumentTypeError as exc:
        raise RuntimeError(f'nnodes={nnodes} is not in "MIN:MAX" format: {exc}') from None


def determine_local_world_size(nproc_per_node: str) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu`` (a worker per CPU), ``gpu`` or
    ``xpu`` (a worker per device), or ``auto`` (a worker per device of torch's accelerator
    where there is one, else per CPU).

    Raises:
        ValueError: an unknown value, or no such device (torch's messages).
    """
    from .cli import _nproc

    try:
        return _nproc(nproc_per_node)
    except argparse.ArgumentTypeError as exc:
        if nproc_per_node in ("gpu", "xpu"):
            raise ValueError(str(exc)) from None
        raise ValueError(f"Unsupported nproc_per_node value: {nproc_per_node} ({exc})") from None


def get_rdzv_endpoint(args: argparse.Namespace) -> str:
    """The rendezvous endpoint torchrun's options name: ``--rdzv-endpoint``, else (static)
    ``--master-addr:--master-port``."""
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return str(args.rdzv_endpoint)


def get_use_env(args: argparse.Namespace) -> bool:
    """``torch.distributed.launch``'s ``--use-env`` (True for torchrun's options, which have
    none): False passes ``--local-rank=N`` to each worker."""
    return bool(getattr(args, "use_env", True))


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run ``training_script`` as ``__main__`` in this interpreter with ``training_script_args``
    as its ``sys.argv`` (``--run-path``; the launcher's worker has substituted ``${local_rank}``
    in them already, as torch's agent does)."""
    sys.argv = [training_script, *training_script_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


@dataclass
class _LogsSpecs:
    """The logs part of a ``LaunchConfig`` (what torch's ``DefaultLogsSpecs`` holds)."""

    root_log_dir: str | None
    _redirects: Any
    _tee: Any
    _local_ranks_filter: set[int] | None


def config_from_args(args: argparse.Namespace) -> tuple[Any, Callable[..., Any] | str, list[str]]:
    """torchrun's options as ``(LaunchConfig, entrypoint, its arguments)`` for
    ``elastic_launch``.

    Raises:
        ValueError: options the launcher cannot run.
    """
    from .elastic._policy import LOCAL_RANK_MACRO, omp_threads_notice, parse_std
    from .launcher.api import LaunchConfig

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    nproc_per_node = determine_local_world_size(str(args.nproc_per_node))  # (ValueError, torch's type)
    notice = omp_threads_notice(os.environ, nproc_per_node)
    if notice is not None:  # (as torchrun's: said once, and set here for whatever the caller starts)
        log.warning("%s", notice)
        os.environ["OMP_NUM_THREADS"] = "1"
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    if args.standalone:  # (as torchrun's: one node, a rendezvous of its own on a free port)
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    conf: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (args.rdzv_conf or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--rdzv-conf: expected key=value pairs, got {item!r}")
        conf[key.strip()] = value.strip()
    if backend == "static":
        conf["rank"] = args.node_rank
        if not endpoint:
            endpoint = f"{args.master_addr}:{29500 if args.master_port is None else args.master_port}"
    ranks_filter = {int(r) for r in args.local_ranks_filter.split(",") if r.strip()} if args.local_ranks_filter else None
    logs = _LogsSpecs(args.log_dir, parse_std(args.redirects), parse_std(args.tee), ranks_filter)
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, logs_specs=logs,
        run_id=run_id, role=args.role, rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=conf,
        max_restarts=args.max_restarts, monitor_interval=args.monitor_interval, start_method=args.start_method,
        local_addr=args.local_addr, event_log_handler=args.event_log_handler,
        log_line_prefix_template=os.getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        signals_to_handle=args.signals_to_handle, shutdown_timeout=args.shutdown_timeout,
        duplicate_stdout_filters=args.duplicate_stdout_filters, duplicate_stderr_filters=args.duplicate_stderr_filters,
        virtual_local_rank=args.virtual_local_rank,
    )
    script_args = list(args.training_script_args)
    if not get_use_env(args):  # (torch.distributed.launch's --local-rank argument)
        script_args.insert(0, f"--local-rank={LOCAL_RANK_MACRO}")
    if args.run_path:
        return config, run_script_path, [args.training_script, *script_args]
    if args.no_python:
        return config, args.training_script, script_args
    if args.module:
        return config, os.environ.get("PYTHON_EXEC", sys.executable), ["-u", "-m", args.training_script, *script_args]
    return config, os.environ.get("PYTHON_EXEC", sys.executable), ["-u", args.training_script, *script_args]


def run(args: argparse.Namespace) -> None:
    """Run the job that torchrun's options ``args`` describe, on this node.

    Raises:
        ChildFailedError: a worker failed (torch's class).
    """
    from .launcher.api import elastic_launch

    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and parse_min_max_nnodes(args.nnodes)[1] == 1:
        # (as torchrun's run(): one node that names no port of its own gets a rendezvous on a
        # free port and a run id of its own, so two such jobs on one host do not collide)
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    elastic_launch(config=config, entrypoint=cmd)(*cmd_args)


def _main(args: Sequence[str] | None = None) -> None:
    run(parse_args(args))


def main(args: Sequence[str] | None = None) -> None:
    """``torchrun args``, as a function: parses and runs (the command line's by default).

    Raises:
        ChildFailedError: a worker failed; its error file is copied to this process's
            ``TORCHELASTIC_ERROR_FILE`` first, if that is set (``@record``).
    """
    from .elastic.multiprocessing.errors import record

    record(_main)(args)


if __name__ == "__main__":
    from ._core import _process
    from .cli import main as cli_main

    _process.TORCHLESS = True  # (as the tdist command: the launcher does not import torch)
    sys.exit(cli_main(["run", *sys.argv[1:]]))


# torch's module also carries the names it imports (``from torch.distributed.run import
# elastic_launch, LaunchConfig, record``): the same here, loaded when asked for (the launcher's
# own process imports no torch)
_REEXPORTED = {
    "elastic_launch": "tdist.launcher.api",
    "LaunchConfig": "tdist.launcher.api",
    "record": "tdist.elastic.multiprocessing.errors",
    "DefaultLogsSpecs": "tdist.elastic.multiprocessing",
    "LogsSpecs": "tdist.elastic.multiprocessing",
    "Std": "tdist.elastic.multiprocessing",
    "macros": "tdist.elastic.utils.api",
    "check_env": "torch.distributed.argparse_util",
    "env": "torch.distributed.argparse_util",
}


__getattr__, __dir__ = lazy.names(__name__, _REEXPORTED)
