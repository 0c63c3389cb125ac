"""The ``tdist`` command: ``tdist run`` (the project's torchrun) and ``tdist store``.

Thin argparse over ``tdist.elastic`` and ``tdist.store``; torchrun's option spellings (with
underscores) are accepted next to ours (with dashes).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .elastic._policy import Std

__all__ = ["console_main", "main"]

log = logging.getLogger(__name__)



#: torchrun's ``--numa-binding`` modes (torch.numa.binding's ``AffinityMode``)
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")

def _opt(*names: str) -> list[str]:
    """``--foo-bar`` and torchrun's ``--foo_bar``."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "-" in name[2:]:
            out.append("--" + name[2:].replace("-", "_"))
    return out


def _nproc(value: str) -> int:
    if value == "cpu":
        return os.cpu_count() or 1
    if value == "auto":  # (as torchrun's: a worker per accelerator where there is one, else per CPU)
        return _accelerators() or os.cpu_count() or 1
    if value in ("gpu", "xpu"):  # (one worker per device, as torchrun's; only then, and for auto, is torch imported)
        import torch

        device = torch.cuda if value == "gpu" else torch.xpu
        if not device.is_available():
            raise argparse.ArgumentTypeError(f"{'Cuda' if value == 'gpu' else 'Xpu'} is not available.")
        return int(device.device_count())
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of workers, 'cpu', 'auto', 'gpu' or 'xpu', got {value!r}"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _accelerators() -> int:
    """How many devices torch's current accelerator (CUDA, XPU, ...) has: 0 without one, or
    without torch. Imports torch, which only ``--nproc-per-node auto``/``gpu``/``xpu`` make the
    launcher do."""
    try:
        import torch
    except ImportError:
        return 0
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return 0
    return int(accelerator.device_count())


def _nnodes(value: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (an elastic range) -> (MIN, MAX)."""
    low, sep, high = value.partition(":")
    try:
        lo = int(low)
        hi = int(high) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes, got {value!r}") from None
    if lo < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {lo}")
    if hi < lo:
        raise argparse.ArgumentTypeError(f"the most nodes ({hi}) must not be fewer than the least ({lo})")
    return lo, hi


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"port must have value from 0 to 65535 but was {port}.")
    return port


def _ranks(value: str) -> frozenset[int]:
    try:
        ranks = frozenset(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected local ranks separated by commas, got {value!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected local ranks separated by commas, got {value!r}")
    return ranks


def _std(value: str) -> Std | dict[int, Std]:
    from .elastic._policy import parse_std

    try:
        return parse_std(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rdzv_backend(value: str) -> str:
    if value in ("static", "c10d"):
        return value
    if value in ("etcd", "etcd-v2"):  # (torchrun's two etcd rendezvous: one here)
        return "etcd"
    raise argparse.ArgumentTypeError(f"unknown rendezvous backend {value!r}: static, c10d or etcd")


def _rdzv_conf(value: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE pairs separated by commas, got {item!r}")
        conf[key.strip()] = val.strip()
    return conf


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return seconds


def _signals(value: str) -> tuple[int, ...]:
    from .elastic._policy import parse_signals

    unknown: list[str] = []
    found = parse_signals(value, unknown)
    for name in unknown:  # (as torchrun: said, and the others handled)
        log.warning("--signals-to-handle: unknown signal %r, not handled", name)
    return found


# torchrun's environment defaults: PET_<its option's name> (Kubeflow's PyTorchJob sets them)
_PET_NAMES = {"run_id": "rdzv_id", "stop_timeout": "shutdown_timeout", "entrypoint": "", "args": ""}


def _pet_defaults(parser: argparse.ArgumentParser) -> None:
    """Defaults from ``PET_<OPTION>`` for every option of ``parser``, as torchrun's (a flag's
    value is a number: ``PET_STANDALONE=1``)."""
    for action in parser._actions:
        name = _PET_NAMES.get(action.dest, action.dest)
        if not name or not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(f"PET_{name.upper()}")
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip() not in ("", "0")
        else:
            action.default = value  # (a string default goes through ``type``, as a given value)


def build_parser() -> argparse.ArgumentParser:
    """The ``tdist`` argument parser."""
    from .elastic._policy import START_METHODS, Std, comma_separated

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        *_opt("--log-level"), default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the launcher's own log level (default: WARNING)",
    )
    parser = argparse.ArgumentParser(prog="tdist", description="tdist: torch.distributed in Python")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a script on several workers (like torchrun)",
        description="Start --nproc-per-node workers with the environment torchrun sets, host "
        "the job's store, pass the workers' output through as it is (a stream that --tee names "
        "gets torchrun's [<role><local rank>]: prefix, e.g. [default0]:, or "
        "$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE's), stop every worker when one fails, report "
        "its exit code, and exit, as torchrun does, with 0 when every worker succeeded, else 1 "
        "(a worker failed, another node failed, or a signal stopped the launcher).",
    )
    run.add_argument(*_opt("--nproc-per-node"), type=_nproc, default=1, metavar="N",
                     help="workers on this node: a number, 'cpu', 'gpu', 'xpu' or 'auto' (a worker per "
                     "accelerator device where torch sees one, else per CPU) (default: 1)")
    run.add_argument("--nnodes", type=_nnodes, default=(1, 1), metavar="N",
                     help="nodes in the job, or MIN:MAX for an elastic range (c10d or etcd rendezvous: "
                     "nodes that come later join while there is room) (default: 1)")
    run.add_argument(*_opt("--node-rank"), type=int, default=0, metavar="K",
                     help="this node's rank; node 0 hosts the store (default: 0)")
    run.add_argument(*_opt("--master-addr"), default="127.0.0.1", metavar="HOST",
                     help="the store's address, as the workers reach it (default: 127.0.0.1)")
    run.add_argument(*_opt("--master-port"), type=_port, default=None, metavar="PORT",
                     help="the store's port; 0 picks a free one (default: 29500; as torchrun's, one "
                     "node with neither this nor --rdzv-endpoint runs as --standalone)")
    run.add_argument("--standalone", action="store_true",
                     help="one node, a free port on 127.0.0.1 (overrides --master-addr/--master-port)")
    run.add_argument(*_opt("--rdzv-id", "--run-id"), dest="run_id", default="none", metavar="ID",
                     help="the job id (TORCHELASTIC_RUN_ID; default: none)")
    run.add_argument(*_opt("--rdzv-backend"), type=_rdzv_backend, default="static", metavar="NAME",
                     help="'static' (every node is given --node-rank; node 0 hosts the store at "
                     "--master-addr/--master-port), 'c10d' (the nodes meet at --rdzv-endpoint, "
                     "whose host hosts the store, and get their node ranks in turn) or 'etcd' "
                     "(the nodes meet in the etcd at --rdzv-endpoint, default port 2379; node 0 "
                     "hosts the store) (default: static)")
    run.add_argument(*_opt("--rdzv-endpoint"), default="", metavar="HOST[:PORT]",
                     help="where the nodes meet: the store's address (c10d: port 29400 if not "
                     "given; static: instead of --master-addr/--master-port)")
    run.add_argument(*_opt("--local-addr"), default="", metavar="HOST",
                     help="this node's address, as the other nodes reach it (etcd: where node 0's "
                     "store is reached; default: this host's fully qualified name)")
    run.add_argument(*_opt("--rdzv-conf"), type=_rdzv_conf, default={}, metavar="K=V,...",
                     help="rendezvous settings: join_timeout and last_call_timeout (seconds; static: "
                     "timeout, the same as join_timeout), read_timeout (c10d: seconds to reach the store, "
                     "default 60), is_host (true/false), keep_alive_interval (seconds) and keep_alive_max_attempt "
                     "(c10d, etcd: a node whose heartbeat stood still that many intervals is dropped)")
    run.add_argument(*_opt("--max-restarts"), type=int, default=0, metavar="N",
                     help="restart the workers up to N times after a failure (default: 0)")
    run.add_argument("--ft", action="store_true",
                     help="fault-tolerant workers (tdist.elastic.ft.Manager on ft.job_store()): a worker "
                     "that fails is restarted alone (up to --max-restarts times) and joins the running "
                     "job; the others go on")
    run.add_argument(*_opt("--monitor-interval"), type=_seconds, default=0.5, metavar="S",
                     help="seconds between checks of the other nodes (default: 0.5)")
    run.add_argument(*_opt("--join-timeout"), type=_seconds, default=600.0, metavar="S",
                     help="seconds to wait for every node to join (default: 600)")
    run.add_argument(*_opt("--stop-timeout", "--shutdown-timeout"), type=_seconds,
                     default=os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip() or "30", metavar="S",
                     help="seconds between the stop signal and SIGKILL when stopping workers "
                     "(default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30, as torchrun's)")
    run.add_argument(*_opt("--signals-to-handle"), type=_signals, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                     metavar="SIG,...",
                     help="the signals that stop the job: the launcher sends each to the workers as "
                     "it comes, then SIGKILL after --stop-timeout (default: SIGTERM,SIGINT,SIGHUP,SIGQUIT)")
    run.add_argument(*_opt("--local-ranks-filter"), type=_ranks, default=None, metavar="R,R,...",
                     help="show only these local ranks' output, e.g. 0 (default: every rank's)")
    run.add_argument("--role", default="default", metavar="NAME",
                     help="the workers' role (ROLE_NAME; default: default)")
    run.add_argument(*_opt("--log-dir"), default=None, metavar="DIR",
                     help="base directory of the workers' logs, kept after the run: each run gets "
                     "DIR/<run id>_<random>/attempt_<n>/<local rank>/ with stdout.log and stderr.log "
                     "(the streams --redirects or --tee name) and error.json (TORCHELASTIC_ERROR_FILE), "
                     "as torchrun's (default: a temporary directory, removed at the end unless a "
                     "stream went to a file)")
    run.add_argument("-r", *_opt("--redirects"), type=_std, default=Std.NONE, metavar="STD",
                     help="write the workers' streams to files in the log directory instead of the "
                     "console: 1 stdout, 2 stderr, 3 both, 0 none, for every local rank, or per local "
                     "rank: 0:1,1:2 (stdout of local rank 0, stderr of local rank 1) (default: 0)")
    run.add_argument("-t", "--tee", type=_std, default=Std.NONE, metavar="STD",
                     help="write the workers' streams to files in the log directory and to the "
                     "console, where each of their lines starts with [<role><local rank>]: "
                     "(e.g. [default0]:), or $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with ${role_name}, "
                     "${rank}, ${local_rank} substituted; streams not teed go to the console unprefixed "
                     "(same values as --redirects) (default: 0)")
    run.add_argument(*_opt("--start-method"), choices=START_METHODS, default="spawn",
                     help="torchrun's multiprocessing start method, accepted and recorded in the "
                     "launcher's log: tdist run starts every worker as a new process running the "
                     "entrypoint (python -u script), which torchrun does for a script whatever this "
                     "says (its start methods apply to its Python-function entrypoints only) "
                     "(default: spawn, torchrun's)")
    run.add_argument("--quiet", action="store_true",
                     help="no live status line under the workers' output (drawn only when stdout "
                     "is a terminal)")
    # (a string default goes through ``type`` as a given value would: a bad one is reported)
    run.add_argument(*_opt("--metrics-port"), type=_port, default=os.environ.get("TDIST_METRICS_PORT", "").strip() or None,
                     metavar="PORT",
                     help="serve the job's metrics for Prometheus (per-rank operation counts, bytes and "
                     "latencies, RPC calls and errors, restarts, worker states) at "
                     "http://HOST:PORT/metrics; 0 picks a free port and prints it; needs pip install "
                     "'tdist[metrics]' (default: $TDIST_METRICS_PORT, else no endpoint)")
    run.add_argument(*_opt("--metrics-addr"), default="0.0.0.0", metavar="HOST",
                     help="the address the metrics endpoint listens on (default: 0.0.0.0, every "
                     "interface; 127.0.0.1 keeps it to this host)")
    run.add_argument("-m", "--module", action="store_true",
                     help="run the entrypoint as a module (python -m)")
    run.add_argument(*_opt("--no-python"), action="store_true",
                     help="run the entrypoint as a program, not a Python script")
    run.add_argument(*_opt("--run-path"), action="store_true",
                     help="torchrun's: run the script with runpy.run_path under @record (its "
                     "exception fills the worker's error file; a script, not -m or --no-python)")
    # torchrun's options that change nothing here: accepted, so that its command lines run
    for std in ("stdout", "stderr"):
        run.add_argument(*_opt(f"--duplicate-{std}-filters"), type=comma_separated, default=[], metavar="S,S,...",
                         help=f"as torchrun's: a line of a worker's {std} that --tee sends to the console and "
                         f"its file and that holds one of these strings is copied, with its prefix, to "
                         f"attempt_<n>/filtered_{std}.log in the run's log directory (a double comma is a comma)")
    run.add_argument(*_opt("--logs-specs"), default=None, metavar="VALUE",
                     help="torchrun's LogsSpecs entry point (tdist run lays out --log-dir as torchrun's "
                     "default); accepted and not used")
    run.add_argument(*_opt("--numa-binding"), default=None, choices=NUMA_MODES,
                     help="torchrun's NUMA binding to GPUs (CPU workers here: none); accepted and not used")
    run.add_argument(*_opt("--event-log-handler"), default="null", metavar="NAME",
                     help="where the launcher's worker events go (tdist.elastic.events: null, console)")
    run.add_argument(*_opt("--virtual-local-rank"), action="store_true",
                     help="as torchrun's: LOCAL_RANK is 0 for every worker, and its CUDA_VISIBLE_DEVICES "
                     "names its own device alone (the launcher's CUDA_VISIBLE_DEVICES entry at its "
                     "local rank, else its local rank)")
    run.add_argument("entrypoint", metavar="script", help="the script (or module, or program) to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    _pet_defaults(run)

    store = sub.add_parser(
        "store",
        parents=[common],
        help="run a standalone store server in the foreground",
        description="Serve a TCPStore until interrupted. Clients must know TDIST_SECRET if it is "
        "set here; without it the store is open to anyone who can connect.",
    )
    store.add_argument("--host", default="127.0.0.1",
                       help="the address to bind (default: 127.0.0.1; 0.0.0.0 for every interface)")
    store.add_argument("--port", type=_port, default=29500, help="the port; 0 picks a free one (default: 29500)")

    status = sub.add_parser(
        "status", parents=[common], help="a live per-rank table of a job tdist run runs on this host",
        description="Show every worker of a running job: pid, host, state, the operation its process "
        "groups are in and for how long, the steps it reported (tdist.elastic.report_progress) and "
        "steps/s, CPU, memory and its last heartbeat; redrawn every --interval seconds until the job "
        "ends (or once).",
    )
    status.add_argument("--pid", type=int, default=None, help="the job's launcher pid (default: the only job here)")
    status.add_argument("--once", action="store_true", help="print the table once and exit")
    status.add_argument("--interval", type=_seconds, default=1.0, metavar="S", help="seconds between redraws (default: 1)")
    _job_endpoint_args(status)
    dump = sub.add_parser(
        "dump", parents=[common], help="gather every worker's Python stacks and flight record into a folder",
        description="Ask every worker of a running job for its Python stacks (all threads) and its "
        "flight record (torch's format: torchfrtrace DIR reads them) and gather them into DIR.",
    )
    dump.add_argument("--pid", type=int, default=None, help="the job's launcher pid (default: the only job here)")
    dump.add_argument("--out", default=None, metavar="DIR", help="where (default: ./tdist-dump-<time>)")
    dump.add_argument("--timeout", type=_seconds, default=10.0, metavar="S", help="seconds to wait for the workers (default: 10)")
    _job_endpoint_args(dump)
    return parser


def _job_endpoint_args(parser: argparse.ArgumentParser) -> None:
    """``tdist status``/``tdist dump`` of a job of several nodes, through its store."""
    parser.add_argument(*_opt("--rdzv-endpoint"), default=None, metavar="HOST:PORT",
                        help="a job of several nodes, from anywhere: its rendezvous endpoint (c10d, etcd) or "
                        "MASTER_ADDR:MASTER_PORT (a fixed node count); needs the job's TDIST_SECRET")
    parser.add_argument(*_opt("--rdzv-backend"), default="c10d", choices=["c10d", "static", "etcd", "etcd-v2"],
                        help="how the job met (default: c10d; static for --master-addr/--master-port)")
    parser.add_argument(*_opt("--rdzv-id"), default="none", metavar="ID", help="the job's run id (default: none)")


def _inspect(ns: argparse.Namespace) -> int:
    from .elastic import _inspect

    if ns.rdzv_endpoint:
        return _of_job(ns)
    if ns.command == "status":
        return _inspect.watch(ns.pid, ns.once, ns.interval)
    try:
        job = _inspect.find_job(ns.pid)
    except LookupError as exc:
        print(f"tdist dump: {exc}", file=sys.stderr)
        return 1
    out = ns.out or f"tdist-dump-{time.strftime('%Y%m%d-%H%M%S')}"
    files = _inspect.gather_dump(job, out, ns.timeout)
    for path in files:
        print(path)
    workers = len(job.get("workers", []))
    print(f"tdist dump: {len(files)} files from {workers} workers in {out}", file=sys.stderr)
    return 0 if files else 1


def _of_job(ns: argparse.Namespace) -> int:
    """``tdist status``/``tdist dump`` ``--rdzv-endpoint``: a job of several nodes, through its
    store."""
    import urllib.parse
    from datetime import timedelta

    from ._core.errors import DistError
    from .elastic import _inspect
    from .elastic.rendezvous import parse_rendezvous_endpoint
    from .store._api import Store

    etcd = ns.rdzv_backend.startswith("etcd")
    host, port = parse_rendezvous_endpoint(ns.rdzv_endpoint, 2379 if etcd else 29400)
    try:
        store: Store
        if etcd:
            from .store._etcd import EtcdStore

            store = EtcdStore(host, port, prefix="/tdist/" + urllib.parse.quote(ns.rdzv_id, safe=""),
                              timeout=timedelta(seconds=10))
        else:
            from .store._tcp import TCPStore

            store = TCPStore(host, port, timeout=timedelta(seconds=10))
        try:
            if ns.command == "status":
                return _inspect.watch_job(store, ns.rdzv_id, f"{host}:{port}", ns.once, ns.interval)
            out = ns.out or f"tdist-dump-{time.strftime('%Y%m%d-%H%M%S')}"
            try:
                files, nodes = _inspect.collect_dump(store, ns.rdzv_id, out, ns.timeout)
            except LookupError as exc:
                print(f"tdist dump: {exc} at {host}:{port} (--rdzv-id names the job)", file=sys.stderr)
                return 1
            for path in files:
                print(path)
            print(f"tdist dump: {len(files)} files from {nodes} node{'s' if nodes != 1 else ''} in {out}", file=sys.stderr)
            return 0 if files else 1
        finally:
            store.close()
    except DistError as exc:
        print(f"tdist {ns.command}: the job's store at {host}:{port}: {exc}", file=sys.stderr)
        return 1


def _run(ns: argparse.Namespace) -> int:
    from ._core.errors import DistError
    from .elastic import LaunchConfig, LocalAgent
    from .elastic._policy import omp_threads_notice, rdzv_settings
    from .elastic.rendezvous import parse_rendezvous_endpoint

    master_addr, master_port, run_id = ns.master_addr, ns.master_port, ns.run_id
    min_nodes, nnodes = ns.nnodes
    elastic = min_nodes != nnodes
    backend, conf = ns.rdzv_backend, dict(ns.rdzv_conf)
    join_timeout = ns.join_timeout
    rdzv_host, rdzv_port = "", 2379
    try:
        # (one node that names no address of its own runs as --standalone, as torchrun's does:
        # a free port and a run id of its own, so two such jobs on one host do not collide)
        alone = backend == "static" and not ns.rdzv_endpoint and master_port is None and nnodes == 1
        if ns.standalone or alone:  # (a run id of its own, as torchrun's --standalone makes one)
            master_addr, master_port, nnodes, run_id, backend = "127.0.0.1", 0, 1, str(uuid.uuid4()), "static"
            elastic = False
        elif backend == "etcd":  # etcd is where the nodes meet; node 0 hosts the store here
            if not ns.rdzv_endpoint:
                raise ValueError("--rdzv-backend etcd needs --rdzv-endpoint HOST[:PORT] (etcd's client address)")
            rdzv_host, rdzv_port = parse_rendezvous_endpoint(ns.rdzv_endpoint, 2379)
            master_addr, master_port = ns.local_addr or socket.getfqdn(), 0
        elif ns.rdzv_endpoint:
            master_addr, master_port = parse_rendezvous_endpoint(ns.rdzv_endpoint, 29400 if backend == "c10d" else master_port or 29500)
        elif backend == "c10d":  # (as torchrun's: the store of this host's port 29400)
            master_addr, master_port = "localhost", 29400
        if backend == "static" and "timeout" in conf:  # (torch's static rendezvous: how long the nodes may take)
            join_timeout = conf.pop("timeout")
        node_rank = ns.node_rank
        if backend != "static" and node_rank != 0:  # (torchrun's warning: the rendezvous numbers the nodes)
            log.warning("--node-rank is only used by the static rendezvous; --rdzv-backend %s numbers the nodes itself", backend)
            node_rank = 0
        rdzv = rdzv_settings(conf, join_timeout)
        for key in conf:
            log.warning("--rdzv-conf %s is not used by tdist run; ignored", key)
        if master_port is None:
            master_port = 29500
        if ns.run_path:  # (as torchrun's: it runs a script, whatever -m or --no-python say)
            ns.module = ns.no_python = False
        config = LaunchConfig(
            entrypoint=ns.entrypoint,
            args=tuple(ns.args),
            nproc_per_node=ns.nproc_per_node,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            run_id=run_id,
            max_restarts=ns.max_restarts,
            ft=ns.ft,
            module=ns.module,
            no_python=ns.no_python,
            run_path=ns.run_path,
            stop_timeout=ns.stop_timeout,
            signals=ns.signals_to_handle,
            python=os.environ.get("PYTHON_EXEC") or sys.executable,
            monitor_interval=ns.monitor_interval,
            rdzv_backend=backend,
            min_nodes=min_nodes if elastic else None,
            local_addr=ns.local_addr,
            rdzv_host=rdzv_host,
            rdzv_port=rdzv_port,
            local_ranks_filter=ns.local_ranks_filter,
            role=ns.role,
            log_dir=ns.log_dir,
            redirects=ns.redirects,
            tee=ns.tee,
            start_method=ns.start_method,
            quiet=ns.quiet,
            metrics_port=ns.metrics_port,
            metrics_addr=ns.metrics_addr,
            event_log_handler=ns.event_log_handler,
            log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
            virtual_local_rank=ns.virtual_local_rank,
            duplicate_stdout_filters=tuple(ns.duplicate_stdout_filters),
            duplicate_stderr_filters=tuple(ns.duplicate_stderr_filters),
            **rdzv,
        )
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"tdist run: error: {exc}", file=sys.stderr)
        return 2
    notice = omp_threads_notice(os.environ, config.nproc_per_node)
    if notice is not None:  # (as torchrun's warning, once; the workers get it in worker_env)
        print(f"[tdist run] {notice}", file=sys.stderr, flush=True)
    try:
        agent = LocalAgent(config)
        code = agent.run()
    except DistError as exc:  # (LaunchError, or a store or etcd that failed on the way)
        from .elastic.rendezvous import RendezvousGracefulExitError

        if isinstance(exc.__cause__, RendezvousGracefulExitError):  # (a spare let go: torchrun's exit 0)
            print(f"tdist run: the rendezvous let this node go: {exc.__cause__}", file=sys.stderr)
            return 0
        print(f"tdist run: error: {exc}", file=sys.stderr)
        return 1
    root = agent.root_cause_error_file() if code else None
    if root is not None and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # (torchrun's main is @record: a launcher run under another one, or by a scheduler
        # that reads error files, hands its root cause's error file up, with its exit code)
        from .elastic.multiprocessing.errors import get_error_handler

        try:
            get_error_handler().dump_error_file(*root)
        except (OSError, ValueError) as exc:
            log.warning("could not copy %s to TORCHELASTIC_ERROR_FILE: %s", root[0], exc)
    return code


def _store(ns: argparse.Namespace) -> int:
    from ._core import auth
    from ._core.errors import DistError
    from .store._server import StoreServer

    secret = auth.resolve_secret(None)
    try:
        server = StoreServer(ns.host, ns.port, secret=secret)
    except DistError as exc:
        print(f"tdist store: error: {exc}", file=sys.stderr)
        return 1
    r, w = os.pipe()
    stopped: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)
        if len(stopped) == 1:  # (once: a second signal would close whatever has w's number now)
            with contextlib.suppress(OSError):
                os.close(w)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    access = "clients must prove TDIST_SECRET" if secret else "open: anyone who can connect may use it"
    print(f"tdist store: serving on {ns.host}:{server.port} ({access}); Ctrl-C to stop", flush=True)
    try:
        server.serve_forever(control_fd=r)
    finally:
        server.stop()
        os.close(r)
        if not stopped:
            os.close(w)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("tdist store: stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tdist`` command; returns the exit code."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, ns.log_level),
        format="[tdist %(asctime)s %(levelname)s %(name)s] %(message)s",
        stream=sys.stderr,
    )
    if ns.command == "run":
        return _run(ns)
    if ns.command in ("status", "dump"):
        return _inspect(ns)
    return _store(ns)


def console_main() -> None:
    """The ``tdist`` command itself (console script and ``python -m tdist.cli``): like ``main``,
    in a process that does not import torch (``tdist._core._process``), then exits."""
    from ._core import _process

    _process.TORCHLESS = True
    sys.exit(main())


if __name__ == "__main__":
    console_main()
