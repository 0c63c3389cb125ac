"""The local agent behind ``tdist run``: host the store, run the workers, watch, stop, report.

Theory of operation. The agent of node 0 starts the job's store server (a forked process that
serves nothing else), so that workers find it at ``MASTER_ADDR:MASTER_PORT`` and every worker is
a client (``TORCHELASTIC_USE_AGENT_STORE=True``). It then starts ``nproc_per_node`` workers,
each in a session of its own (so that stopping a worker stops what it started too), with the
environment torchrun sets (and the kernel's parent-death signal, so that a launcher killed with
SIGKILL takes its workers along), and one thread per output stream that copies lines to its own
stdout/stderr and keeps the last lines for the report.

Each worker's streams go where torchrun's ``--redirects``/``--tee`` say (``_policy.stream_route``):
the console and/or ``stdout.log``/``stderr.log`` in the run's log directory
(``<log dir>/<run id>_<random>/attempt_<n>/<local rank>/``, torchrun's layout, with the worker's
``TORCHELASTIC_ERROR_FILE``). As torchrun's, a stream on the console goes there as it is, unless
it is teed (on the console and in its file): then each line starts with the worker's
``_policy.line_prefix`` (``[default0]:``). On a terminal a status line stays below the output: every write
erases it first and draws it again after, and the monitor loop redraws it each tick.

One loop, in the calling thread, watches: it sleeps in ``select`` on a pidfd per worker and on a
pipe that signal handlers write to, so it wakes as soon as a worker exits or a signal arrives.
After each wake-up it records what exited and asks ``_policy`` what that means and what to do;
the decisions (the root cause, restarts, the exit code) live there as pure functions.

Stopping a group sends each worker's process group the signal that stopped the launcher (one of
``signals``, torchrun's ``--signals-to-handle``: Ctrl-C's SIGINT reaches the workers as SIGINT)
or else SIGTERM, waits ``stop_timeout`` seconds (a second signal to the launcher cuts the wait
short), then sends SIGKILL. Every
worker is reaped before the agent returns. A failed job's report ends with a post-mortem built
from what was observed: each worker's exit, its last lines, its ``@record`` error file, the
flight-recorder dumps the ranks left, the restarts.

How nodes meet. With the static rendezvous (``--node-rank`` given) node 0 hosts the job's store
and each node's agent joins it (one key per node rank). With c10d and etcd, in every
``--nnodes`` form (a fixed N is N:N), the nodes meet through ``tdist.elastic.rendezvous``'s
one ``DynamicRendezvousHandler`` (its state in the job's store at the c10d endpoint, whose
host is node 0, or in etcd): each round gives the node its rank and the node count, and a
store of the round for the agents' keys; node 0 of the round hosts the workers' store (the
c10d host: the endpoint's store itself). A restart after a failure, or nodes waiting to join
an elastic job, make every node join the next round.

Expiration timers, as torchrun's: with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the environment the
agent runs a ``tdist.elastic.timer.FileTimerServer`` (a thread) for the whole run and gives the
workers its named pipe in ``TORCHELASTIC_TIMER_FILE``; a worker that overruns an ``expires``
block is killed by it (SIGKILL unless its client says otherwise), which the monitor loop sees
as any worker that died of a signal: a failure. Torchrun's launcher metrics (group
``torchelastic``) and worker events go through ``tdist.elastic.metrics`` and ``.events``,
whose handlers drop them unless a program configured others.

On several nodes each agent posts its first failure (``<agent prefix>/attempt<n>/failed``) so
that the other nodes stop their workers too, and a node that hosts a store the others use
keeps it up until every node has finished (the exit barrier).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, BinaryIO

from .._core import auth, patience
from .._core._process import proc_stat
from .._core._reaper import job_reaper, kill_marked, with_token
from .._core.deadline import Clock
from .._core.errors import DistError, DistStoreError
from ..store._api import Store
from ..store._replica import FailoverStore, StandbyKeeper
from ..store._server import StoreServer
from ..store._tcp import TCPStore
from ..store._torch_wire import TORCH_KEYS
from ._inspect import (
    STATUS_DIR_ENV,
    answer_dump,
    answers,
    dump_request,
    expire_status,
    gather_dump,
    node_metrics,
    publish_metrics,
    publish_status,
    register_job,
    remove_wake_pipes,
    unregister_job,
)
from ._metrics import METRICS_FD_ENV, TIMED_ENV
from ._policy import (
    AGENT_PREFIX,
    DEFAULT_FLIGHT_RECORD_PREFIX,
    FLIGHT_RECORD_VARS,
    Action,
    ErrorFile,
    LaunchConfig,
    Outcome,
    PostMortem,
    Std,
    WorkerExit,
    blamed_as_lost,
    blamed_as_stalled,
    describe_returncode,
    duplicate_filters,
    exit_code,
    failures,
    format_failure_report,
    format_status,
    group_outcome,
    line_prefix,
    next_action,
    parse_error_file,
    raised_before,
    stream_route,
    worker_command,
    worker_env,
)
from ._quorum import JOB_OVER as _JOB_OVER
from .events import Event, EventSource
from .events import record as record_event
from .metrics import put_metric
from .multiprocessing._process import (
    copy_lines,
    drain,
    open_pidfd,
    signal_session,
    start_process,
    stop_processes,
    wait_any,
)

if TYPE_CHECKING:  # (imported when used: the launcher starts without the rendezvous modules)
    from ._metrics_server import MetricsServer
    from .rendezvous import RendezvousHandler, RendezvousInfo
    from .rendezvous._dynamic import DynamicRendezvousHandler
    from .timer import FileTimerRequest, FileTimerServer

__all__ = ["LaunchError", "LocalAgent", "launch"]

log = logging.getLogger(__name__)

_READER_JOIN = 2.0  # seconds to wait for a worker's output after it exited
_OUTPUT_LINES = 20  # lines of each worker's output kept for the post-mortem
# a flight-recorder dump's name in a rank's log directory, <name><rank> (torch's default prefix's)
_FLIGHT_RECORD_NAME = os.path.basename(DEFAULT_FLIGHT_RECORD_PREFIX)
_STATUS_INTERVAL = 0.5  # seconds between redraws of the live status line (its clock moves)
_PUBLISH_EVERY = 1.0  # seconds between two publications of a node's rows in the job's store
_DUMP_WAIT = 8.0  # the most seconds the workers get to answer a job-wide dump request
_SNAPSHOT_WAIT = 2.0  # the most seconds the running workers get to write their stacks and records
_STATUS_GAP = 0.1  # after a worker's line, the status line is redrawn if not drawn for this long
_ERASE_LINE = b"\r\x1b[K"  # to the line's start, erase it (ANSI)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # a terminal control sequence in a worker's line
_ETCD_GRACE = 15.0  # seconds etcd may fail to answer before the job is given up
# torchrun's: run a FileTimerServer for the workers (``1``), and the path of its named pipe
ENABLE_FILE_TIMER_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
# the most seconds between two looks of the timer server at its timers (it also wakes on every
# request and when the earliest timer expires, so this bounds nothing but its idle wake-ups)
_TIMER_INTERVAL = 1.0



def _error_files(base: str) -> list[str]:
    """The ``@record`` error files workers wrote under ``base``."""
    return [os.path.join(d, f) for d, _, files in os.walk(base) for f in files if f == "error.json"]


def _worker_token(group_token: str, local_rank: int) -> str:
    """The mark of one worker of a group (``TDIST_JOB_TOKENS``, beside the group's)."""
    return f"{group_token}r{local_rank}"


def _remove_if_killed(path: str) -> None:
    """A path of the launcher's own that goes if the launcher is killed (its job reaper removes
    it after the workers): what an orderly end removes, or leaves for a report to name."""
    reaper = job_reaper()
    if reaper is not None:
        reaper.remove_on_kill(path)


#: after a failure ended the job, how long past ``--stop-timeout`` the node that hosts the job's
#: store waits for the other nodes to say they finished (they read the failure within a monitor
#: interval, then stop their workers); a node cut off from the network never says it
_FAILED_EXIT_WAIT = 10.0

class LaunchError(DistError):
    """The launcher could not set the job up (bad options, store not reachable, nodes missing)."""


@dataclass
class _Worker:
    local_rank: int
    rank: int
    proc: subprocess.Popen[bytes]
    pidfd: int | None
    tail: deque[str]  # the last lines of its stderr
    output: deque[str]  # the last lines of its output, both streams
    readers: list[threading.Thread] = field(default_factory=list)
    signalled: bool = False
    stalled: bool = False  # stopped (not running) when the group failed
    exit: WorkerExit | None = None
    metrics_id: int | None = None  # (its channel to the metrics endpoint, --metrics-port)


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped), or ``""``."""
    fields = proc_stat(pid)
    return fields[0] if fields else ""


def _is_terminal(stream: BinaryIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def _terminal_like(console: BinaryIO) -> tuple[int, int] | None:
    """A pseudo-terminal ``(ours, the worker's)`` for a worker's stream that goes to the
    console ``console``, a terminal, as torchrun's workers write to the launcher's terminal:
    the worker sees a terminal of the console's size (``isatty``, colours, a progress bar's
    width), and what it writes comes out unchanged (no output processing: a newline stays
    one byte). None where none can be made (the stream is a pipe then)."""
    try:
        ours, theirs = os.openpty()
    except OSError:
        return None
    try:
        attrs = termios.tcgetattr(theirs)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(theirs, termios.TCSANOW, attrs)
    except (OSError, termios.error):
        os.close(ours)
        os.close(theirs)
        return None
    with contextlib.suppress(OSError):
        fcntl.ioctl(theirs, termios.TIOCSWINSZ, fcntl.ioctl(console.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
    return ours, theirs


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one a socket can bind)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


def job_secret(env: Mapping[str, str], nnodes: int) -> str:
    """The job's shared secret: ``TDIST_SECRET`` if set, else a new one (single node only).

    Raises:
        LaunchError: several nodes and no ``TDIST_SECRET``: they could not agree on one.
    """
    secret = env.get(auth.SECRET_ENV, "")
    if secret:
        return secret
    if nnodes > 1:
        raise LaunchError(
            "a job on several nodes needs a shared secret: set TDIST_SECRET to the same value on "
            f"every node (for example the output of: {sys.executable} -c "
            "'import secrets; print(secrets.token_hex(32))')"
        )
    return auth.new_secret()


class LocalAgent:
    """Runs one node's share of a job; ``run()`` returns the launcher's exit code.

    Args:
        config: what to run.
        stdout: where the workers' prefixed stdout goes (default: this process's stdout).
        stderr: where their stderr, and the failure report, go (default: this process's stderr).
        env: the environment workers inherit (default ``os.environ``).
        clock: the monotonic clock.
        handle_signals: install handlers of ``config.signals`` that stop the workers (only possible in
            the main thread).
        rendezvous: a rendezvous handler the caller made (``tdist.elastic.agent.server``'s
            ``WorkerSpec.rdzv_handler``): the agent drives it instead of one of its own
            (``config``'s rendezvous settings are then not used; ``node_rank``, ``nnodes``,
            ``master_addr`` and ``master_port`` come from each round). Its rounds'
            ``store`` must be a tdist ``Store`` (the agents' keys, the exit barrier). The
            workers' store is the round's ``bootstrap_store_info`` endpoint: with
            ``use_agent_store`` the handler serves it already (a tdist store, whose secret is
            ``TDIST_SECRET`` or none); otherwise the agent of rank 0 starts one there (the port
            must be free on its host). The agent does not shut the handler down: it is the
            caller's, as in torch.
    """

    def __init__(
        self,
        config: LaunchConfig,
        *,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        env: Mapping[str, str] | None = None,
        clock: Clock = time.monotonic,
        handle_signals: bool = True,
        rendezvous: RendezvousHandler | None = None,
    ) -> None:
        self.config = config
        self._given_rendezvous = rendezvous
        self._out = stdout if stdout is not None else sys.stdout.buffer
        self._err = stderr if stderr is not None else sys.stderr.buffer
        self._env = dict(os.environ if env is None else env)
        self._clock = clock
        self._handle_signals = handle_signals
        self._write_lock = threading.RLock()  # (_write_piece holds it around _write)
        # the attempt's filtered_stdout.log/filtered_stderr.log (--duplicate-std*-filters)
        self._filtered: dict[Std, BinaryIO] = {}
        self._signum: int | None = None
        # how the last attempt's workers ended, and its number (``error_file``): what a
        # programmatic caller (``tdist.launcher.api``) reports
        self.last_exits: list[WorkerExit] = []
        self.last_attempt = 0
        self.title = ""  # what the failure report calls the job (default: its entrypoint)
        # where the failure report goes: stderr (the tdist command), or kept here for the
        # exception a programmatic caller raises (``tdist.launcher.api``: torch's prints nothing)
        self.keep_report = False
        self.failure_report: str | None = None
        self._signal_count = 0
        self._wake_r = -1
        self._wake_w = -1
        self._store: Store | None = None
        self._joined = False  # every node joined: the exit barrier can expect them all
        self._rdzv_round: int | None = None  # (a dynamic rendezvous's round: ``_next_round``)
        self._job_failed = False  # (this node ended the job on a failure: ``_post_failure``)
        self._next_peer_check = 0.0
        # (this host's name in the report and the events, as torch's: its fully qualified name)
        self._host = socket.getfqdn()
        # the run's log directory, <base>/<run id>_<random> (torchrun's layout), made by run();
        # None with --log-dir /dev/null. Without --log-dir, base is a temporary directory of ours.
        self._run_dir: str | None = None
        self._temp_base: str | None = None
        self._group_token = ""  # (the running group's mark: ``_run_group``)
        self._keeps_logs = False  # the run's directory stays (--log-dir, or a stream in it)
        self._attempt_started = 0.0  # time.time() when the current group started
        # the live status line, at the bottom of the terminal (all under _write_lock)
        self._status = not config.quiet and _is_terminal(self._out) and self._env.get("TERM") != "dumb"
        self._status_shown = False  # drawn, and no output since
        # the worker stream whose incomplete line (a prompt, a progress bar) ends the console's
        # output, and where; the streams whose shown start of a line another's output cut off
        self._open_line: tuple[tuple[int, Std], BinaryIO] | None = None
        self._cut_lines: set[tuple[int, Std]] = set()
        self._status_paused = True  # not drawn (no group running, or it is being stopped)
        self._status_counts = (0, 0, 0)  # running, finished, failed
        self._status_restarts = 0
        self._status_drawn_at = 0.0
        self._progress: str | None = None  # the last line a worker printed, "rank<N>: ..."
        self._started = clock()
        self._hosting = False  # whether this node hosts the job's store (static node 0, the c10d host)
        self._attempt = 0  # the group's restart count (the other nodes' failures are per attempt)
        self._store_failing_since = 0.0  # (etcd: when its requests began to fail)
        self._rendezvous: RendezvousHandler | None = None  # (c10d, etcd, or the caller's: kept for the run)
        self._rdzv_store: Store | None = None  # (c10d, etcd: the store the rendezvous state is in)
        self._keeper: StandbyKeeper | None = None  # (c10d: the rendezvous store's standby)
        # this node's rows in the job's store, for `tdist status --rdzv-endpoint` (several nodes)
        self._job_record: dict[str, Any] | None = None
        self._published_at = -1e9
        self._published_cpu: dict[int, tuple[float, float]] = {}
        self._dump_served: str | None = None  # (the last dump request answered)
        self._settle_until: float | None = None  # (see ``_settling``; per attempt)
        self._stacks: dict[int, str] = {}  # (see ``_snapshot``: the last failed attempt's)
        self._loose_snapshot: str | None = None  # (``_snapshot``'s folder of its own, until a report names it)
        self._entry: str | None = None  # (its file in the host's registry of jobs, once written)
        self._ft_restarts = 0  # (--ft: workers restarted alone)
        self._ft_replaced: set[int] = set()  # (their local ranks)
        self._ft_earlier: list[str] = []
        self._rdzv_server: StoreServer | None = None  # (c10d: the job's store, if this node hosts it)
        self._round_server: StoreServer | None = None  # (c10d, etcd: the workers' store, on node 0)
        # the store servers this node runs, with their pidfds (the monitor loop wakes when one dies)
        self._watched: list[tuple[StoreServer, int | None]] = []
        self._lost_store: str | None = None  # why the job ended: that store server died
        self._max_nodes = 0
        self._min_nodes = 0
        self._rescale_why: str | None = None
        self._leaving = False  # (SIGTERM in an elastic job: this node leaves, the job goes on)
        self._left = False
        self._next_waiting_check = 0.0
        self._metrics: MetricsServer | None = None  # (--metrics-port)
        self._metrics_url: str | None = None
        self._timer_server: FileTimerServer | None = None  # (TORCHELASTIC_ENABLE_FILE_TIMER=1)
        self._timer_file: str | None = None  # (its pipe, when the agent made up the path)
        self._by_pid: dict[int, _Worker] = {}  # (the running group's workers: whom a timer killed)

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job on this node until it succeeds, fails or is interrupted.

        Returns:
            The exit code, torchrun's: 0 when the job succeeded (or this node left an
            elastic job on SIGTERM), else 1 (a worker failed, whatever its code or signal,
            which the report gives; another node failed; a signal stopped the launcher).

        Raises:
            LaunchError: the job could not be set up.
        """
        cfg = self.config
        given = self._given_rendezvous
        if given is not None and given.use_agent_store:  # (the handler's store: its secret, or none)
            secret = self._env.get(auth.SECRET_ENV, "")
        else:
            secret = job_secret(self._env, cfg.nnodes)
        log.info(
            "node %d: workers start as new processes (%s); --start-method %s recorded",
            cfg.node_rank, " ".join(worker_command(cfg)[:3]), cfg.start_method,
        )
        # (nothing raises between taking these and the ``try`` that gives them back)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        previous = self._install_signal_handlers()
        server: StoreServer | None = None
        try:
            self._make_run_dir()
            self._serve_metrics()
            self._start_timer_server()
            if given is not None:  # (the caller's handler: its rounds say who is in)
                self._drive(given, secret)
                cfg = self.config
            elif cfg.rdzv_backend in ("c10d", "etcd"):  # (every --nnodes form: the rendezvous says who is in)
                self._meet(secret)
                cfg = self.config
            elif cfg.node_rank == 0:
                # one node binds the given address; several must be reachable from the others
                bind = cfg.master_addr if cfg.nnodes == 1 else ""
                try:
                    server = StoreServer(bind, cfg.master_port, secret=secret, torch_clients=True)
                except DistError as exc:
                    raise LaunchError(f"{exc} (--master-port)") from exc
                server.start("process")
                self._watch_store(server)
                self._hosting = True
                log.info("node 0: job store on %s:%d", cfg.master_addr, server.port)
            port = server.port if server is not None else cfg.master_port
            if cfg.nnodes > 1 and not self._joined:
                self._join(port, secret)
            return self._run_attempts(port, secret)
        finally:
            unregister_job()
            self._unpublish_status()
            try:
                self._leave_rendezvous()
                self._exit_barrier()
            finally:
                for store in (self._store, self._rdzv_store):
                    close = getattr(store, "close", None)
                    if close is not None:
                        close()
                if self._keeper is not None:
                    self._keeper.stop()
                if self._round_server is not None:
                    self._round_server.stop()
                for _, pidfd in self._watched:
                    if pidfd is not None:
                        os.close(pidfd)
                self._watched.clear()
                for hosted in (server, self._rdzv_server):
                    if hosted is not None:
                        hosted.stop()
                if self._metrics is not None:
                    self._metrics.close()
                if self._timer_server is not None:
                    self._timer_server.stop()  # (and its pipe is removed)
                self._close_filtered()
                self._drop_loose_snapshot()
                self._restore_signal_handlers(previous)
                wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
                os.close(wake_r)  # (-1 first: a late _on_signal writes nowhere, not to a reused fd)
                os.close(wake_w)
                if self._run_dir is not None:
                    remove_wake_pipes(self._run_dir)
                if self._temp_base is not None and not self._keeps_logs and not _error_files(self._temp_base):
                    # (nothing was there: an error file a worker wrote stays, as torchrun's do,
                    # since the report names it)
                    shutil.rmtree(self._temp_base, ignore_errors=True)

    def _serve_metrics(self) -> None:
        """``--metrics-port``: the endpoint, serving from threads of its own until the end."""
        cfg = self.config
        if cfg.metrics_port is None:
            return
        from ._metrics_server import MetricsServer

        self._metrics = MetricsServer(  # (LaunchError: no prometheus_client, or the port is taken)
            cfg.metrics_addr, cfg.metrics_port,
            {"run_id": cfg.run_id, "entrypoint": self._title(), "node": str(cfg.node_rank)},
        )
        host = cfg.metrics_addr if cfg.metrics_addr not in ("", "0.0.0.0", "::") else socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        self._metrics_url = f"http://{host}:{self._metrics.port}/metrics"
        self._say(f"metrics: {self._metrics_url}")

    def _start_timer_server(self) -> None:
        """``TORCHELASTIC_ENABLE_FILE_TIMER=1`` (torchrun's): the workers' expiration timers'
        server, for the whole run, at ``TORCHELASTIC_TIMER_FILE`` or at a new path in the
        temporary directory that the workers are given in that variable."""
        if self._env.get(ENABLE_FILE_TIMER_ENV) != "1":
            return
        from .timer import FileTimerServer

        given = self._env.get(TIMER_FILE_ENV)
        path = given or os.path.join(tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}")
        try:
            self._timer_server = FileTimerServer(
                path, self.config.run_id, max_interval=_TIMER_INTERVAL, log_event=self._on_timer_event
            )
        except OSError as exc:
            raise LaunchError(f"{ENABLE_FILE_TIMER_ENV}=1: cannot make the timers' named pipe {path}: {exc}") from exc
        self._timer_server.start()
        _remove_if_killed(path)  # (as its orderly stop removes it)
        self._timer_file = None if given else path
        log.info("node %d: expiration timers served at %s", self.config.node_rank, path)

    def _on_timer_event(self, name: str, request: FileTimerRequest | None) -> None:
        """(The timer server's thread.) A worker it killed: say so now, and in the worker's
        last lines, which the failure report quotes."""
        if name != "kill worker process" or request is None:
            return
        try:
            sig = signal.Signals(request.signal).name
        except ValueError:
            sig = f"signal {request.signal}"
        w = self._by_pid.get(request.worker_pid)
        who = f"rank {w.rank} (pid {request.worker_pid})" if w is not None else f"pid {request.worker_pid}"
        what = f"expiration timer {request.scope_id!r} expired {max(0.0, time.time() - request.expiration_time):.1f} s ago"
        self._say(f"worker {who}: its {what}: killed it with {sig}")
        if w is not None:
            w.tail.append(f"[tdist run] {what}: killed with {sig} ({TIMER_FILE_ENV})\n")

    def _meet(self, secret: str) -> None:
        """c10d and etcd, every ``--nnodes`` form (a fixed N is N:N): the nodes meet through
        ``tdist.elastic.rendezvous``'s ``DynamicRendezvousHandler``, which admits from MIN to
        MAX of them (a last call after MIN) and numbers them. Its state lives in the job's
        store at the endpoint (c10d: hosted by the node that can bind it, which sorts first
        and so is node 0) or in etcd (under ``/tdist/<run id>``). Each round's store carries
        the agents' own keys, and node 0 of the round hosts the workers' store at the address
        it published (the c10d host: the endpoint's store itself). A new round is held when
        nodes wait to join (the groups restart with them) and after a failure while restarts
        are left."""
        from ..store._prefix import PrefixStore
        from .rendezvous import RendezvousParameters
        from .rendezvous._dynamic import DynamicRendezvousHandler

        cfg = self.config
        timeout = timedelta(seconds=cfg.join_timeout)
        server, server_port = None, None
        store: Store
        if cfg.rdzv_backend == "c10d":
            endpoint = f"{cfg.master_addr}:{cfg.master_port}"
            server = self._try_to_host(secret)
            port = cfg.master_port
            if server is not None:
                server.start("process")
                self._watch_store(server)
                self._rdzv_server, self._hosting = server, True
                port = server_port = server.port
                log.info("the job's store (and its rendezvous) on %s:%d", cfg.master_addr, port)
            try:  # (reached within read_timeout, as torch's c10d backend's store; then waits as long as a join)
                client = FailoverStore(cfg.master_addr, port, timeout=timedelta(seconds=cfg.read_timeout), secret=secret)
                client.set_timeout(timeout)
            except DistError as exc:
                raise LaunchError(f"c10d rendezvous: the store at {cfg.master_addr}:{port} cannot be reached: {exc}") from exc
            self._rdzv_store = client
            store = PrefixStore(f"torch.rendezvous.{cfg.run_id}", client)
            # (the host's address as the others reach it is the endpoint's)
            local_addr = cfg.local_addr or (cfg.master_addr if server is not None else "")
            # another node keeps a standby of the store, which takes over if this host is lost
            self._keeper = StandbyKeeper(client, hosting=server is not None, advertise=local_addr or None)
            self._keeper.settle()
        else:
            from ..store._etcd import EtcdStore

            endpoint = f"{cfg.rdzv_host}:{cfg.rdzv_port}"
            prefix = "/tdist/" + urllib.parse.quote(cfg.run_id, safe="")  # (a / in the id nests no job)
            try:
                # (no lease: the job's keys are shared, and a key's lease would be its last writer's,
                # so one launcher's exit would take keys the others still use; a finished job's
                # keys are deleted by node 0, a crashed one's stay: give every job its own run id)
                store = self._rdzv_store = EtcdStore(cfg.rdzv_host, cfg.rdzv_port, prefix=prefix, timeout=timeout)
            except DistError as exc:
                raise LaunchError(f"etcd at {endpoint} (--rdzv-endpoint): {exc}") from exc
            local_addr = cfg.local_addr or cfg.master_addr
        params = RendezvousParameters(
            cfg.rdzv_backend, endpoint, cfg.run_id, cfg.nnodes if cfg.min_nodes is None else cfg.min_nodes, cfg.nnodes,
            local_addr=local_addr or None, join_timeout=cfg.join_timeout, last_call_timeout=cfg.last_call_timeout,
            keep_alive_interval=cfg.keep_alive_interval, keep_alive_max_attempt=cfg.keep_alive_max_attempt,
        )
        self._max_nodes = cfg.nnodes
        self._min_nodes = cfg.nnodes if cfg.min_nodes is None else cfg.min_nodes
        self._rendezvous = handler = DynamicRendezvousHandler(
            cfg.rdzv_backend, params, store, first=server is not None, server_port=server_port,
            on_beat=None if self._keeper is None else self._keeper.upkeep,
        )
        # a signal to the launcher ends a wait in the rendezvous
        handler._should_stop = lambda: self._signum is not None
        self._next_round(secret)

    def _drive(self, handler: RendezvousHandler, secret: str) -> None:
        """The caller's handler (``rendezvous=``): tdist's own c10d and etcd handlers are used
        as ``_meet`` uses them (elastic ranges, lost members, scale-down); any other handler
        only through torch's API (``next_rendezvous``, ``num_nodes_waiting``), as torch's
        agent does."""
        self._rendezvous = handler
        dynamic = self._dynamic()
        if dynamic is not None:
            self._max_nodes, self._min_nodes = dynamic.settings.max_nodes, dynamic.settings.min_nodes
            dynamic._should_stop = lambda: self._signum is not None
        else:  # (no node range known: a membership change is whatever num_nodes_waiting() says)
            self._max_nodes = self._min_nodes = sys.maxsize
        self._next_round(secret)

    def _dynamic(self) -> DynamicRendezvousHandler | None:
        """The rendezvous handler, if it is tdist's c10d/etcd one (what only it can tell:
        lost members, its settings, leaving without closing)."""
        from .rendezvous._dynamic import DynamicRendezvousHandler

        handler = self._rendezvous
        return handler if isinstance(handler, DynamicRendezvousHandler) else None

    def _workers_store(self, info: RendezvousInfo) -> tuple[str, int]:
        """Where this round's workers' store is (``MASTER_ADDR``, its port): the round's
        bootstrap endpoint (a subclass may override it: ``WorkerSpec.master_addr``/``master_port``)."""
        from .rendezvous import RendezvousStoreInfo

        boot = info.bootstrap_store_info
        if boot is None:  # (a handler that gives none: rank 0 picks and publishes one)
            boot = RendezvousStoreInfo.build(info.rank, info.store, self.config.local_addr or None)
        return boot.master_addr, boot.master_port

    def _next_round(self, secret: str) -> None:
        """Join the rendezvous's next round; this node's rank, the node count and the workers'
        store come from it (node 0 starts that store, unless it is the endpoint's)."""
        from .rendezvous import RendezvousError

        cfg, handler = self.config, self._rendezvous
        assert handler is not None
        try:
            info = handler.next_rendezvous()
        except (RendezvousError, DistError) as exc:
            raise LaunchError(str(exc)) from exc
        if self._given_rendezvous is not None and info.world_size > 1 and not handler.use_agent_store:
            job_secret(self._env, info.world_size)  # (LaunchError: several nodes need a shared secret)
        master_addr, master_port = self._workers_store(info)
        if self._round_server is not None:
            self._unwatch_store(self._round_server)
            self._round_server.stop()
            self._round_server = None
        hosted = [server.port for server, _ in self._watched]
        # (a handler with use_agent_store serves the bootstrap endpoint itself)
        served = handler.use_agent_store and info.bootstrap_store_info is not None and (
            master_port == info.bootstrap_store_info.master_port
        )
        if info.rank == 0 and master_port not in hosted and not served:
            try:
                self._round_server = StoreServer("", master_port, secret=secret, torch_clients=True)
            except DistError as exc:
                raise LaunchError(f"node 0: cannot start the job's store: {exc}") from exc
            self._round_server.start("process")
            self._watch_store(self._round_server)
        self.config = dataclasses.replace(
            cfg, node_rank=info.rank, nnodes=info.world_size, min_nodes=None,
            master_addr=master_addr, master_port=master_port,
        )
        self._store = info.store
        if info.rank == 0 and self._rdzv_round is not None and not served:  # (before the barrier below)
            self._forget_torch_keys(master_addr, master_port, secret)

        def late(missing: list[int]) -> str:
            return f"nodes {missing} of the round did not say their --nproc-per-node within {cfg.join_timeout:g} s"

        self._share_node_sizes(
            info.store, f"{AGENT_PREFIX}/nproc", lambda: "interrupted" if self._signum is not None else None, late
        )
        # (the workers' keys go in a namespace of the round: the count of restarts stays where a
        # node joined or left, and the store may be the same, so a group formed again in a new
        # round would meet keys of the last one, and its new members, counting afresh, not)
        self._rdzv_round = getattr(handler, "round", None)
        self._joined = True
        self._next_waiting_check = self._clock() + cfg.monitor_interval
        log.info("node %d of %d (%s rendezvous, up to %d nodes)", info.rank, info.world_size, handler.get_backend(), self._max_nodes)

    def _leave_rendezvous(self) -> None:
        """At the end, before the exit barrier: a member closes the rendezvous (nodes still
        waiting to join get an error rather than a round that will not come); a node that
        never got in only leaves it. Either way its heartbeats stop, so nothing of this node
        writes the rendezvous's state once it said it finished (node 0 may delete it). A handler
        the caller gave is left as it is (the caller shuts it down, as with torch's agent)."""
        if self._rendezvous is None or self._given_rendezvous is not None:
            return
        if self._joined and not self._leaving:
            self._rendezvous.shutdown()
        else:
            self._rendezvous_leave()

    def _rendezvous_leave(self) -> None:
        """Take this node out of the rendezvous (once), leaving it open for the others."""
        dynamic = self._dynamic()
        if dynamic is not None and not self._left:
            self._left = True
            dynamic._leave()

    def _membership_changed(self, now: bool = False, joins: bool = True) -> str | None:
        """Rendezvous: why the group must re-form without a failure, checked every monitor
        interval (``now``: at once): a member left (a scale-down) or was dropped (its agent's
        heartbeat stood still), or (``joins``) nodes wait to join while there is room; None if
        neither."""
        if self._rendezvous is None or (not now and self._clock() < self._next_waiting_check):
            return None
        self._next_waiting_check = self._clock() + self.config.monitor_interval
        dynamic = self._dynamic()
        try:
            if dynamic is not None and dynamic.members_lost():
                return "a node left the job (or its agent stopped beating): re-forming the worker group without it"
            if joins and self.config.nnodes < self._max_nodes and self._rendezvous.num_nodes_waiting() > 0:
                return "nodes wait to join the job: restarting the worker group with them"
        except Exception as exc:  # (the rendezvous's own errors: the next check tries again)
            log.warning("node %d: could not ask the rendezvous about its members: %s", self.config.node_rank, exc)
        return None

    def _restart_alone(
        self,
        workers: list[_Worker],
        exits: list[WorkerExit],
        started: dict[int, tuple[dict[str, str], str | None]],
        restart_count: int,
        attempt: str | None,
    ) -> None:
        """``--ft``: start a failed worker again, alone, while restarts are left (it joins the
        running job through ``tdist.elastic.ft``); the others go on. The failure is then not
        the group's (its exit leaves ``exits``)."""
        for i, w in enumerate(workers):
            e = w.exit
            if e is not None and e.failed and w.local_rank in self._ft_replaced and self._came_late(w):
                late = dataclasses.replace(e, came_late=True)
                exits[exits.index(e)] = w.exit = late
                self._say(f"worker rank {e.rank}, started again, came after the job had finished without it: nothing left to do")
                continue
            if e is None or not e.failed or self._ft_restarts >= self.config.max_restarts:
                continue
            self._ft_restarts += 1
            self._ft_replaced.add(w.local_rank)
            self._ft_earlier.append(f"rank {e.rank} failed (exit code {describe_returncode(e.returncode)}); restarted alone")
            self._say(
                f"worker rank {e.rank} failed (exit code {describe_returncode(e.returncode)}); restarting it alone, "
                f"the others go on (restart {self._ft_restarts} of {self.config.max_restarts})"
            )
            for t in w.readers:
                t.join(0.5)
            exits.remove(e)
            self._stop_leftovers(_worker_token(self._group_token, w.local_rank), f"worker rank {e.rank}")
            env, rank_dir = started[w.local_rank]
            env = {**env, "TORCHELASTIC_RESTART_COUNT": str(self._ft_restarts)}
            workers[i] = self._start_worker(w.local_rank, env, rank_dir, append=True)
            self._register(workers, restart_count, attempt)

    @staticmethod
    def _came_late(w: _Worker) -> bool:
        """Whether worker ``w`` ended with the fault-tolerant job's "the job is over": it came
        to join after the job's last member had left (``tdist.elastic.ft``'s ``QuorumError``)."""
        for t in w.readers:  # (its last lines: read to the end)
            t.join(0.5)
        return any(_JOB_OVER in line for line in w.tail)

    def _settling(self, workers: list[_Worker]) -> bool:
        """Whether to wait before calling our workers' failure one: in an elastic job with room
        to lose a node, when every failed worker blames ranks of other nodes (their connection
        was lost, or they stalled), the failure may be the loss of such a node, which the
        rendezvous learns only when its heartbeat expires; until then (or until another node
        posts a failure of its own), the monitor loop waits, and a dropped node then makes it
        a re-form, not a failure."""
        handler = self._dynamic()
        if handler is None or self.config.nnodes <= self._min_nodes:
            return False
        now = self._clock()
        if self._settle_until is None:
            local = {w.rank for w in workers}
            blamed: set[int] = set()
            for w in workers:
                if w.exit is None or not w.exit.failed:
                    continue
                for t in w.readers:  # (its last lines: the process is gone, its pipe ends)
                    t.join(0.5)
                named = blamed_as_lost(list(w.tail))
                if not named or named <= local:
                    return False  # (a failure of its own, or of this node)
                blamed |= named - local
            if not blamed or self._peer_failure()[0] is not None:
                return False
            settings = handler.settings
            wait = settings.keep_alive_interval * (settings.keep_alive_max_attempt + 1)
            self._settle_until = now + wait
            self._say(
                f"a worker failed naming rank{'s' if len(blamed) > 1 else ''} {', '.join(map(str, sorted(blamed)))} of "
                f"another node: waiting up to {wait:g} s to see whether that node is gone"
            )
        return now < self._settle_until and self._peer_failure()[0] is None

    def _scale_down(self) -> bool:
        """SIGTERM to a node of an elastic job (a MIN:MAX range) that others run with: it
        leaves the job on purpose, and the others re-form without it (no failure counted). (The
        job's only node stops it: an interruption, as torchrun's.)"""
        return (
            self._signum == signal.SIGTERM and self._dynamic() is not None and self._joined
            and self._min_nodes < self._max_nodes and self.config.nnodes > 1
        )

    def _try_to_host(self, secret: str) -> StoreServer | None:
        """c10d rendezvous: the job's store at the endpoint (not started yet) if this node can
        bind it (it is then node 0), else None (another node hosts it; this one is a client)."""
        cfg = self.config
        if cfg.is_host is False:
            return None
        bind = cfg.master_addr
        if cfg.nnodes > 1:
            # this node hosts if the endpoint's address is one of its own; the store then
            # listens on every interface (the others may reach this host by another address)
            if cfg.is_host is None and not _is_local_address(cfg.master_addr):
                return None
            bind = ""
        try:
            return StoreServer(bind, cfg.master_port, secret=secret, torch_clients=True)
        except DistError as exc:
            cause = exc.__cause__
            taken = isinstance(cause, OSError) and cause.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
            if not taken or cfg.nnodes == 1 or cfg.is_host:
                raise LaunchError(f"{exc} (--rdzv-endpoint)") from exc
            log.info("the job store at %s:%d is another node's: joining it", cfg.master_addr, cfg.master_port)
            return None

    def _run_attempts(self, port: int, secret: str) -> int:
        cfg = self.config
        restart_count = 0
        earlier: list[str] = []  # each failed attempt's cause, for the post-mortem
        while True:
            outcome, exits, tails, outputs = self._run_group(port, secret, restart_count)
            if outcome is Outcome.SUCCEEDED and cfg.nnodes > 1 and not cfg.ft:
                outcome = self._settle_success()
            exits = raised_before(exits, self._raised(restart_count, exits))
            self.last_exits, self.last_attempt = exits, restart_count
            role = cfg.role
            put_metric(f"workers.{role}.remaining_restarts", max(0, cfg.max_restarts - restart_count))
            put_metric(f"workers.{role}.{'succeeded' if outcome is Outcome.SUCCEEDED else 'failed'}", 1)
            # (--ft: the restarts are spent on single workers; a failure past them ends the job)
            action = next_action(outcome, restart_count, 0 if cfg.ft else cfg.max_restarts)
            found = failures(exits)
            root = found[0] if found else None
            if outcome is Outcome.FAILED:  # (the other nodes stop their groups: restart or end)
                assert root is not None
                self._post_failure(f"node {cfg.node_rank}: rank {root.rank} exited with code {root.returncode}")
            if action is Action.RESTART:
                if outcome is Outcome.RESCALE:
                    self._say(self._rescale_why or "the job's nodes changed: re-forming the worker group")
                else:
                    if root is not None:
                        why = f"worker rank {root.rank} failed (exit code {describe_returncode(root.returncode)})"
                    else:
                        why = self._peer_failure()[0] or "another node failed"
                    earlier.append(f"attempt {restart_count}: {why}")
                    self._say(f"{why}; restarting the worker group (restart {restart_count + 1} of {cfg.max_restarts})")
                    restart_count += 1
                # (c10d, etcd: every round has keys of its own, and nodes that joined later count
                # restarts from 0, so the failure keys are the round's, not the attempt's; another
                # handler's rounds may share one store: the attempt's)
                self._attempt = restart_count if self._dynamic() is None else 0
                if self._rendezvous is not None:  # (a new round, maybe with other nodes)
                    self._next_round(secret)
                    cfg, port = self.config, self.config.master_port
                elif cfg.nnodes > 1:
                    self._rejoin(restart_count, port, secret)
                else:
                    self._forget_torch_keys(cfg.master_addr, port, secret)
                continue
            if outcome is Outcome.FAILED:
                assert root is not None
                self._post_failure(f"node {cfg.node_rank}: rank {root.rank} exited with code {root.returncode}", final=True)
                dumps, looked_for = self._flight_records(restart_count, exits)
                post_mortem = PostMortem(
                    exits=exits, outputs=outputs, dumps=dumps, dumps_looked_for=looked_for,
                    restarts=restart_count + self._ft_restarts, max_restarts=cfg.max_restarts,
                    earlier=[*self._ft_earlier, *earlier],
                    logs=self._attempt_dir(restart_count) if self._keeps_logs else None,
                    stacks=self._stacks,
                )
                report = format_failure_report(
                    self._title(), found, host=self._host, tails=tails, max_lines=cfg.tail_lines,
                    # (the stopped workers' too: one that raised before the launcher's signal
                    # came is reported with its error, as torchrun's)
                    error_files=self._error_files(restart_count, exits), post_mortem=post_mortem,
                )
                if self.keep_report:
                    self.failure_report = report
                else:
                    self._write(self._err, report.encode() + b"\n")
                if self._stacks:  # (the report names the snapshot's files: they stay)
                    self._loose_snapshot = None
            elif outcome is Outcome.INTERRUPTED and self._leaving:
                self._say("left the job on SIGTERM: the other nodes go on without this one")
                return 0
            elif outcome is Outcome.INTERRUPTED:
                assert self._signum is not None
                self._say(f"stopped the workers on {signal.Signals(self._signum).name}{self._logs_note(restart_count)}")
                self._post_failure(f"node {cfg.node_rank}: interrupted", final=True)
            elif outcome in (Outcome.PEER_FAILED, Outcome.PEER_STOPPED):
                why = self._lost_store or self._peer_failure()[0] or "another node failed"
                self._say(f"stopped the workers: {why}{self._logs_note(restart_count)}")
            self._record_run(outcome, exits, restart_count)
            return exit_code(outcome)

    # -- torchrun's metrics and events ----------------------------------------------------------
    def _record_run(self, outcome: Outcome, exits: list[WorkerExit], restart_count: int) -> None:
        """At the end: torchrun's run metrics (group ``torchelastic``) and each worker's last
        state as an event (``SUCCEEDED``, ``FAILED``, or ``TERMINATED`` when the agent stopped
        it)."""
        cfg = self.config
        role, failed = cfg.role, outcome is not Outcome.SUCCEEDED
        retried = restart_count > 0
        put_metric(f"workers.{role}.flakiness", 100 if failed else int(100 * restart_count / (cfg.max_restarts + 1)))
        put_metric(f"workers.{role}.run_total", 1)
        for name, happened in (
            ("run_success_with_retries", not failed and retried),
            ("run_success_no_retries", not failed and not retried),
            ("run_failed_with_retries", failed and retried),
            ("run_failed_no_retries", failed and not retried),
        ):
            put_metric(f"workers.{role}.{name}", int(happened))
        for e in exits:
            state = "TERMINATED" if e.stopped_by_agent and not e.failed else "FAILED" if e.failed else "SUCCEEDED"
            self._record_worker_event(
                state, e.rank, e.local_rank, restart_count, pid=e.pid, exit_code=e.returncode if e.failed else None
            )

    def _record_worker_event(
        self, state: str, rank: int | None, local_rank: int, restart_count: int, *, pid: int | None, exit_code: int | None = None
    ) -> None:
        """Torchrun's event of a worker, ``torchelastic.worker.status.<state>``, to
        ``event_log_handler``; ``rank`` None: the agent's own (``RENDEZVOUS``,
        ``ASSIGN_WORKER_RANKS``, before its workers start, as torch's agent records them)."""
        cfg = self.config
        details: dict[str, object] = {"group_world_size": None, "entry_point": self._title()}
        if rank is not None:
            details.update(
                group_world_size=cfg.nnodes, local_rank=local_rank, role_rank=rank,
                role_world_size=cfg.world_size, exit_code=exit_code, worker_pid=pid,
            )
        metadata: dict[str, str | int | float | bool | None] = {
            "run_id": cfg.run_id, "global_rank": rank, "group_rank": None if rank is None else cfg.node_rank,
            "worker_id": None if pid is None else str(pid), "role": cfg.role, "hostname": self._host, "state": state,
            "total_run_time": int(self._clock() - self._started), "rdzv_backend": cfg.rdzv_backend,
            "raw_error": None, "metadata": json.dumps(details), "agent_restarts": restart_count, "duration_ms": None,
        }
        source = EventSource.AGENT if rank is None else EventSource.WORKER
        try:
            record_event(Event(f"torchelastic.worker.status.{state}", source, metadata=metadata), self.config.event_log_handler)
        except KeyError:
            log.warning("event_log_handler %r: no such destination (tdist.elastic.events)", self.config.event_log_handler)

    # -- logs ----------------------------------------------------------------------------------
    def _make_run_dir(self) -> None:
        """The run's log directory, as torchrun's ``DefaultLogsSpecs``: ``<log dir>/<run
        id>_<random>`` (a new one per run, so runs with one id never mix), under a temporary
        directory without ``--log-dir``; none with ``--log-dir /dev/null``."""
        cfg = self.config
        if cfg.log_dir == os.devnull:
            return
        try:
            if cfg.log_dir is None:
                base = self._temp_base = tempfile.mkdtemp(prefix="tdist_")
            else:  # (absolute: the workers' TORCHELASTIC_ERROR_FILE holds wherever they chdir)
                base = os.path.abspath(cfg.log_dir)
                if os.path.exists(base) and not os.path.isdir(base):
                    raise LaunchError(f"--log-dir {base}: is not a directory")
                os.makedirs(base, exist_ok=True)
                if cfg.log_dir_is_temporary:
                    self._temp_base = base
            safe_id = cfg.run_id.replace(os.sep, "_")[:200]  # (a / in the id nests no directory)
            self._run_dir = tempfile.mkdtemp(prefix=f"{safe_id}_", dir=base)
        except OSError as exc:
            raise LaunchError(f"cannot make the run's log directory under {cfg.log_dir or tempfile.gettempdir()}: {exc}") from exc
        log.info("log directory set to: %s", self._run_dir)
        writes_logs = any(stream_route(cfg, r).files for r in range(cfg.nproc_per_node))
        self._keeps_logs = (cfg.log_dir is not None and not cfg.log_dir_is_temporary) or writes_logs
        if self._temp_base is not None and not self._keeps_logs:
            _remove_if_killed(self._temp_base)
        if writes_logs:
            self._say(f"workers' logs: {self._run_dir}/attempt_<n>/<local rank>/")

    def _logs_note(self, restart_count: int) -> str:
        return f" (logs: {self._attempt_dir(restart_count)})" if self._keeps_logs else ""

    def _flight_records(self, restart_count: int, exits: list[WorkerExit]) -> tuple[dict[int, str], str]:
        """The flight-recorder dumps this attempt's workers left (torch's ``<prefix><rank>``:
        the prefix the worker's environment named, its log directory's when the logs are kept,
        else torch's default), by rank, and where they were looked for. A dump older than the
        attempt is another run's, not theirs."""
        given = next((self._env[var] for var in FLIGHT_RECORD_VARS if self._env.get(var)), None)
        attempt = self._attempt_dir(restart_count)
        per_rank_dir = given is None and attempt is not None and self._keeps_logs
        found = {}
        for e in exits:
            if per_rank_dir:
                assert attempt is not None
                prefix = os.path.join(attempt, str(e.local_rank), _FLIGHT_RECORD_NAME)
            else:
                prefix = given or DEFAULT_FLIGHT_RECORD_PREFIX
            path = prefix + str(e.rank)
            with contextlib.suppress(OSError):
                if os.path.isfile(path) and os.stat(path).st_mtime >= self._attempt_started - 1.0:
                    found[e.rank] = path
        if per_rank_dir:
            where = f"{attempt}/<local rank>/{_FLIGHT_RECORD_NAME}<rank>"
        else:
            where = f"{given or DEFAULT_FLIGHT_RECORD_PREFIX}<rank>"
        return found, f"looked for {where}"

    def _register(self, workers: list[_Worker], restart_count: int, attempt: str | None) -> None:
        """This job in the host's registry of running jobs (``tdist status``, ``tdist dump``)."""
        if attempt is None:
            return
        cfg = self.config
        fr_prefix = next((self._env[var] for var in FLIGHT_RECORD_VARS if self._env.get(var)), None)
        entries = []
        for w in workers:
            rank_dir = os.path.join(attempt, str(w.local_rank))
            prefix = fr_prefix or (os.path.join(rank_dir, _FLIGHT_RECORD_NAME) if self._keeps_logs else DEFAULT_FLIGHT_RECORD_PREFIX)
            rank = cfg.global_rank(w.local_rank)
            entries.append({"rank": rank, "local_rank": w.local_rank, "pid": w.proc.pid, "dir": rank_dir,
                            "flight_record": f"{prefix}{rank}"})
        self._job_record = {
            "pid": os.getpid(), "run_id": cfg.run_id, "node_rank": cfg.node_rank, "attempt": restart_count,
            "run_dir": self._run_dir, "entrypoint": self._title(), "started": time.time(), "workers": entries,
            "metrics": self._metrics_url,
        }
        with contextlib.suppress(OSError):
            entry = register_job(self._job_record)
            if entry != self._entry:
                self._entry = entry
                _remove_if_killed(entry)

    def _attempt_dir(self, restart_count: int) -> str | None:
        return None if self._run_dir is None else os.path.join(self._run_dir, f"attempt_{restart_count}")

    def _start_attempt_logs(self, restart_count: int) -> None:
        """A fresh ``attempt_<n>`` directory with a directory per local rank (torchrun empties
        one that exists: a group restarted without a restart spent, for nodes that joined)."""
        attempt = self._attempt_dir(restart_count)
        self._close_filtered()
        if attempt is None:
            return
        shutil.rmtree(attempt, ignore_errors=True)
        for local_rank in range(self.config.nproc_per_node):
            os.makedirs(os.path.join(attempt, str(local_rank)))
        cfg = self.config
        for std, filters in ((Std.OUT, cfg.duplicate_stdout_filters), (Std.ERR, cfg.duplicate_stderr_filters)):
            if filters:  # (torchrun's: the file is there, empty when no teed line matched)
                path = os.path.join(attempt, f"filtered_{'stdout' if std is Std.OUT else 'stderr'}.log")
                try:
                    self._filtered[std] = open(path, "wb", buffering=0)  # (closed by _close_filtered)
                except OSError as exc:
                    raise LaunchError(f"cannot write {path}: {exc}") from exc

    def _close_filtered(self) -> None:
        """Close the attempt's ``filtered_<stream>.log`` files (the pumps stop writing there)."""
        with self._write_lock:
            filtered, self._filtered = self._filtered, {}
        for f in filtered.values():
            f.close()

    @property
    def signum(self) -> int | None:
        """The signal that stopped the job, if one did."""
        return self._signum

    def process_failures(self, code: int) -> dict[int, Any]:
        """The last attempt's failed workers as torch's ``ProcessFailure``, by global rank (with
        the error file its ``@record`` wrote). When none failed on this node (another node
        failed, or the job could not go on) every worker is named, with ``code`` (the
        launcher's exit code) for one that the agent stopped."""
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        failed = {
            e.rank: ProcessFailure(
                local_rank=e.local_rank, pid=e.pid, exitcode=e.returncode,
                error_file=self.error_file(self.last_attempt, e.local_rank) or "<N/A>",
            )
            for e in self.last_exits
            if e.returncode != 0 and not e.stopped_by_agent
        }
        if not failed:
            failed = {
                e.rank: ProcessFailure(local_rank=e.local_rank, pid=e.pid, exitcode=e.returncode or code, error_file="<N/A>")
                for e in self.last_exits
            } or {0: ProcessFailure(local_rank=0, pid=-1, exitcode=code, error_file="<N/A>")}
        return failed

    def signal_exception(self) -> BaseException:
        """torch's ``SignalException`` for the signal that stopped the job (``signum``)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        assert self._signum is not None
        return SignalException(f"Process {os.getpid()} got signal: {self._signum}", sigval=signal.Signals(self._signum))

    def error_file(self, restart_count: int, local_rank: int) -> str:
        """Where worker ``local_rank`` of attempt ``restart_count`` wrote its ``@record`` error,
        if it did (``""``: nowhere)."""
        path = self._error_file(restart_count, local_rank)
        return path if path and os.path.exists(path) else ""

    def root_cause_error_file(self) -> tuple[str, int] | None:
        """The ``@record`` error file of the last attempt's root cause on this node, and its
        exit code (``None``: no worker failed here, or it wrote none): what torchrun, whose
        ``main`` is ``@record``, copies to its own ``TORCHELASTIC_ERROR_FILE``."""
        found = failures(self.last_exits)
        if not found:
            return None
        path = self.error_file(self.last_attempt, found[0].local_rank)
        return (path, found[0].returncode) if path else None

    def _error_file(self, restart_count: int, local_rank: int) -> str:
        """Where worker ``local_rank`` of attempt ``restart_count`` writes its error (torchrun's
        layout: ``attempt_<n>/<local rank>/error.json``; ``""``, none, with no log directory)."""
        attempt = self._attempt_dir(restart_count)
        return "" if attempt is None else os.path.join(attempt, str(local_rank), "error.json")

    def _raised(self, restart_count: int, exits: list[WorkerExit]) -> dict[int, float]:
        """When the workers had raised, by their ``@record`` error files (by local rank; those
        that wrote one), where the agent stopped some of them after a failure."""
        failed = [e for e in exits if e.failed]
        stopped = [e for e in exits if e.stopped_by_agent and not e.failed]
        if not stopped or not failed:
            return {}
        found = self._error_files(restart_count, stopped + failed)
        return {k: v.timestamp for k, v in found.items() if v.timestamp is not None}

    def _error_files(self, restart_count: int, failed: list[WorkerExit]) -> dict[int, ErrorFile]:
        """What the failed workers' ``@record`` wrote, by local rank."""
        found = {}
        for e in failed:
            path = self._error_file(restart_count, e.local_rank)
            if not path:
                continue
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    parsed = parse_error_file(path, f.read())
            except OSError:
                continue
            if parsed is not None:
                found[e.local_rank] = parsed
        return found

    def _title(self) -> str:
        cfg = self.config
        if self.title:
            return self.title
        return cfg.entrypoint if not cfg.module else f"-m {cfg.entrypoint}"

    # -- one worker group ----------------------------------------------------------------------
    def _run_group(
        self, port: int, secret: str, restart_count: int
    ) -> tuple[Outcome, list[WorkerExit], dict[int, list[str]], dict[int, list[str]]]:
        """Run one worker group until it succeeds, fails or is stopped. Returns the outcome,
        every worker's exit, and each one's last stderr lines and last lines of output, by
        local rank."""
        cfg = self.config
        workers: list[_Worker] = []
        exits: list[WorkerExit] = []
        outcome = Outcome.RUNNING
        # (the group's mark, inherited by whatever its workers start: what they leave running
        # goes with the group when it is stopped, ``_stop_leftovers``)
        group_token = self._group_token = secrets.token_hex(8)
        try:
            self._by_pid.clear()
            torch_port = self._torch_port(port)
            self._settle_until = None
            self._start_attempt_logs(restart_count)
            self._attempt_started = time.time()  # (wall clock: compared with files' times)
            attempt = self._attempt_dir(restart_count)
            if self._metrics is not None:
                self._metrics.attempt(restart_count, cfg.node_rank)
            started: dict[int, tuple[dict[str, str], str | None]] = {}  # (what each was started with)
            for local_rank in range(cfg.nproc_per_node):
                rank_dir = None if attempt is None else os.path.join(attempt, str(local_rank))
                env = worker_env(
                    self._env, cfg, local_rank, master_port=port, restart_count=restart_count, secret=secret,
                    rdzv_round=self._rdzv_round,
                    error_file=self._error_file(restart_count, local_rank), torch_port=torch_port,
                    flight_record_prefix=(
                        os.path.join(rank_dir, _FLIGHT_RECORD_NAME) if rank_dir is not None and self._keeps_logs else None
                    ),
                )
                if rank_dir is not None:  # (``tdist status``/``tdist dump`` look there)
                    env[STATUS_DIR_ENV] = rank_dir
                if self._timer_file is not None:
                    env[TIMER_FILE_ENV] = self._timer_file
                env = with_token(with_token(env, group_token), _worker_token(group_token, local_rank))
                started[local_rank] = (env, rank_dir)
                workers.append(self._start_worker(local_rank, env, rank_dir))
            log.info(
                "node %d: started %d workers (attempt %d): %s",
                cfg.node_rank, len(workers), restart_count, [w.proc.pid for w in workers],
            )
            self._register(workers, restart_count, attempt)
            for state in ("RENDEZVOUS", "ASSIGN_WORKER_RANKS"):
                self._record_worker_event(state, None, 0, restart_count, pid=None)
            for w in workers:
                self._record_worker_event("START", w.rank, w.local_rank, restart_count, pid=w.proc.pid)
            self._group_started(workers, restart_count, port if torch_port is None else torch_port)
            while True:
                self._reap(workers, exits)
                if cfg.ft and self._signum is None:
                    self._restart_alone(workers, exits, started, restart_count, attempt)
                peer, final = self._poll_peers()
                lost = self._store_lost()
                if lost is not None:  # (ends the job: every worker and node depends on it)
                    peer, final = lost, True
                    self._lost_store = lost
                outcome = group_outcome(len(workers), exits, signum=self._signum, peer_failure=peer, peer_stopped=final)
                if outcome in (Outcome.RUNNING, Outcome.FAILED):
                    # (a node that left, or was dropped, may be what made our workers fail: then
                    # it is a re-form, not a failure; a node that posted a failure leaves the
                    # round too, to restart, and that is the failure it posted)
                    failed = outcome is Outcome.FAILED
                    why = self._membership_changed(now=failed, joins=not failed)
                    if why is not None and self._peer_failure()[0] is None:
                        outcome, self._rescale_why = Outcome.RESCALE, why
                    elif failed and self._settling(workers):
                        outcome = Outcome.RUNNING  # (until the rendezvous tells whether a node is gone)
                if outcome is Outcome.INTERRUPTED and self._scale_down():
                    self._leaving = True
                    self._rendezvous_leave()  # (first: the others re-form before our workers stop)
                if outcome is not Outcome.RUNNING:
                    break
                timeout = self._poll_timeout()
                self._publish_status()
                if self._status:
                    self._update_status(workers, exits, restart_count)
                    timeout = _STATUS_INTERVAL if timeout is None else min(timeout, _STATUS_INTERVAL)
                self._sleep(workers, timeout)
            for e in failures(exits):
                log.info(
                    "worker rank %d (local rank %d, pid %d) failed with exit code %d",
                    e.rank, e.local_rank, e.pid, e.returncode,
                )
            if outcome is Outcome.FAILED:
                for w in workers:  # a stopped process did not fail: it made the others fail
                    if w.exit is None and _process_state(w.proc.pid) in ("T", "t"):
                        w.stalled = True
        finally:
            if outcome is Outcome.FAILED:
                self._snapshot(workers, restart_count)
            self._stop(workers, exits)
            if outcome is not Outcome.SUCCEEDED:
                self._stop_leftovers(group_token)
            deadline = self._clock() + _READER_JOIN
            for w in workers:
                for t in w.readers:
                    t.join(max(0.0, deadline - self._clock()))
        self._group_ended(outcome)
        tails = {w.local_rank: list(w.tail) for w in workers}
        outputs = {w.local_rank: list(w.output) for w in workers}
        if outcome is Outcome.FAILED and not any(e.stalled for e in exits):
            # a rank that hung without being stopped: the others' errors name it
            blamed = set().union(*(blamed_as_stalled(tails.get(e.local_rank, ())) for e in exits if e.failed))
            exits[:] = [dataclasses.replace(e, stalled=True) if e.stopped_by_agent and e.rank in blamed else e for e in exits]
        return outcome, exits, tails, outputs

    def _group_started(self, workers: list[_Worker], restart_count: int, torch_port: int) -> None:
        """Called when a group's workers have started (``torch_port``: their ``MASTER_PORT``);
        a subclass watches the group (``tdist.elastic.agent.server``'s ``WorkerGroup``)."""

    def _group_ended(self, outcome: Outcome) -> None:
        """Called when a group's workers have all ended (stopped and reaped), with why."""

    def _start_worker(self, local_rank: int, env: dict[str, str], log_dir: str | None, append: bool = False) -> _Worker:
        """Start worker ``local_rank`` and the threads that copy its streams where
        ``stream_route`` says (``log_dir``: its directory of this attempt; ``append``: after
        what an earlier process of this rank wrote there)."""
        cfg = self.config
        route = stream_route(cfg, local_rank)
        rank = cfg.global_rank(local_rank)
        files: dict[Std, BinaryIO | None] = {Std.OUT: None, Std.ERR: None}
        metrics_id: int | None = None
        pass_fds: tuple[int, ...] = ()
        if self._metrics is not None:  # (its end of a socket pair, where it writes its counts)
            metrics_id, fd = self._metrics.connect(rank, local_rank)
            env = {**env, METRICS_FD_ENV: str(fd)}
            env.setdefault(TIMED_ENV, "1")  # (true completion times, for the latency histograms)
            pass_fds = (fd,)
        with contextlib.ExitStack() as opened:  # (closed here if the worker does not start, else by its pumps)
            for std, name in ((Std.OUT, "stdout.log"), (Std.ERR, "stderr.log")):
                if std in route.files and log_dir is not None:
                    path = os.path.join(log_dir, name)
                    try:
                        files[std] = opened.enter_context(open(path, "ab" if append else "wb", buffering=0))
                    except OSError as exc:
                        raise LaunchError(f"cannot write worker {local_rank}'s log {path}: {exc}") from exc
            # (a stream shown on a terminal goes through a terminal of its own, as torchrun's
            # workers write to the launcher's: the worker's isatty() is true)
            ttys: dict[Std, tuple[int, int]] = {}
            for std, console in ((Std.OUT, self._out), (Std.ERR, self._err)):
                pair = _terminal_like(console) if std in route.console and _is_terminal(console) else None
                if pair is not None:
                    ttys[std] = pair
                    opened.callback(os.close, pair[0])
            try:
                # (a session of its own, and it dies with the launcher, even one killed with -9)
                proc = start_process(
                    worker_command(cfg, local_rank), env,
                    stdout=ttys[Std.OUT][1] if Std.OUT in ttys else subprocess.PIPE,
                    stderr=ttys[Std.ERR][1] if Std.ERR in ttys else subprocess.PIPE, pass_fds=pass_fds,
                )
            except OSError as exc:
                if self._metrics is not None and metrics_id is not None:
                    self._metrics.started(metrics_id, None)
                raise LaunchError(f"cannot start {cfg.entrypoint!r}: {exc}") from exc
            finally:
                for _, theirs in ttys.values():  # (the worker holds its side now)
                    os.close(theirs)
            opened.pop_all()
        streams = {std: os.fdopen(ours, "rb") for std, (ours, _) in ttys.items()}
        if self._metrics is not None and metrics_id is not None:
            self._metrics.started(metrics_id, proc.pid)
        pidfd = open_pidfd(proc)  # (None, an old kernel: the monitor loop polls instead)
        worker = _Worker(local_rank, rank, proc, pidfd, deque(maxlen=max(cfg.tail_lines * 4, 50)), deque(maxlen=_OUTPUT_LINES))
        worker.metrics_id = metrics_id
        self._by_pid[proc.pid] = worker
        stdout, stderr = streams.get(Std.OUT, proc.stdout), streams.get(Std.ERR, proc.stderr)
        assert stdout is not None and stderr is not None
        header = line_prefix(cfg, local_rank).encode()
        for stream, std, out, tails in (
            (stdout, Std.OUT, self._out, (worker.output,)),
            (stderr, Std.ERR, self._err, (worker.tail, worker.output)),
        ):
            t = threading.Thread(
                target=self._pump,
                args=(stream, std, rank, header if std in route.teed else b"", out if std in route.console else None, tails,
                      files[std], duplicate_filters(cfg, route, std)),
                name=f"tdist-run-rank{rank}",
                daemon=True,
            )
            t.start()
            worker.readers.append(t)
        return worker

    def _pump(
        self,
        stream: IO[bytes],
        std: Std,
        rank: int,
        prefix: bytes,
        out: BinaryIO | None,
        tails: tuple[deque[str], ...],
        file: BinaryIO | None,
        filters: tuple[str, ...] = (),
    ) -> None:
        """Copy worker ``rank``'s stream ``std`` line by line: to ``out`` with ``prefix`` (a
        teed stream's; ``b""``: as it is), flushing each line, and to ``file`` as it is (None:
        not there), keeping the last lines, as they are, in ``tails``; a line that holds one
        of ``filters`` goes, prefixed, to the attempt's ``filtered_<stream>.log`` too. A line
        that starts with ``prefix`` already (a worker that printed its own, as
        ``log_line_prefix_template`` ``[rank${rank}]:`` and torch's excepthook's ``[rank<N>]:``
        lines would) is not prefixed twice."""

        key, on_console = (rank, std), 0  # (bytes of the line coming that the console has: on_partial's)

        def on_partial(pending: bytes) -> None:  # (a line's start that waits: a prompt, a progress bar)
            nonlocal on_console
            if out is not None and len(pending) > on_console:
                # (a line that starts with its prefix already is not prefixed twice: see on_line)
                first = on_console == 0 and bool(prefix) and not pending.startswith(prefix)
                self._write_piece(out, key, prefix, pending[on_console:], first=first)
                on_console = len(pending)

        def on_line(line: bytes) -> None:
            nonlocal on_console
            if not line.endswith(b"\n"):
                line += b"\n"
            text = line.decode(errors="replace")
            for tail in tails:
                tail.append(text)
            progress = None
            if self._status and std is Std.OUT:  # (a worker's last line: its progress, on the status line)
                shown = _ANSI.sub("", text.rstrip("\r\n").rsplit("\r", 1)[-1]).strip()
                progress = f"rank{rank}: {shown}" if shown else None
            if on_console and out is not None:  # (its start is on the console: the rest)
                self._write_piece(out, key, prefix, line[on_console:], first=False, progress=progress)
            elif out is not None or progress is not None:
                # (a line that starts with its prefix already is not prefixed twice)
                self._write(out, line if line.startswith(prefix) else prefix + line, progress)
            on_console = 0
            if filters and any(needle in text for needle in filters):
                self._write_filtered(std, line if line.startswith(prefix) else prefix + line)

        copy_lines(stream, file, on_line, on_partial)

    def _write_filtered(self, std: Std, data: bytes) -> None:
        """Append ``data`` to the attempt's ``filtered_<stream>.log`` of ``std``, if it is open."""
        with self._write_lock:
            f = self._filtered.get(std)
            if f is not None:
                with contextlib.suppress(OSError):
                    f.write(data)

    def _write_piece(
        self, out: BinaryIO, key: tuple[int, Std], prefix: bytes, piece: bytes, first: bool, progress: str | None = None
    ) -> None:
        """Write a piece of worker stream ``key``'s line to ``out``: its start (``first``), more
        of it, or its end (``piece`` ends with a newline). Prefixed where it starts the line on
        the console: its start, a piece after another stream's output cut the line off, and
        what follows a carriage return (a progress bar redrawing its line keeps its prefix)."""
        with self._write_lock:
            if key in self._cut_lines:
                self._cut_lines.discard(key)
                if piece == b"\n":  # (the end of a line cut off: said already)
                    return
                first = True
            body = piece.replace(b"\r", b"\r" + prefix)
            body = body.replace(b"\r" + prefix + b"\n", b"\r\n")  # (a CRLF line end)
            self._write(out, prefix + body if first else body, progress, key, left_open=not piece.endswith(b"\n"))

    def _write(
        self,
        out: BinaryIO | None,
        data: bytes,
        progress: str | None = None,
        writer: tuple[int, Std] | None = None,
        left_open: bool = False,
    ) -> None:
        """Write ``data`` to ``out`` (None: nowhere), under the status line: it is erased first
        and drawn again after (when it was not drawn in the last ``_STATUS_GAP`` seconds; the
        monitor loop's next tick draws it otherwise). ``progress``: a worker's new last line.
        ``writer``: the worker stream ``data`` is of, when it goes on an incomplete line of its
        own, and ``left_open``: ``data`` leaves the line incomplete, open on the console (no status
        line under it) until its stream goes on; other output ends it with a newline first."""
        with self._write_lock:
            try:
                if progress is not None:
                    self._progress = progress
                if out is None:
                    return
                if self._open_line is not None and self._open_line[0] != writer:
                    key, where = self._open_line
                    self._open_line = None
                    self._cut_lines.add(key)
                    where.write(b"\n")
                    where.flush()
                elif self._open_line is not None:  # (the same line goes on)
                    self._open_line = None
                if self._status_shown:
                    self._out.write(_ERASE_LINE)
                    self._out.flush()
                    self._status_shown = False
                out.write(data)
                out.flush()
                if left_open and writer is not None:
                    self._open_line = (writer, out)
                elif self._status and self._clock() - self._status_drawn_at >= _STATUS_GAP:
                    self._draw_status()
            except (OSError, ValueError):  # our own output is gone (closed pipe): keep running
                pass

    # -- the live status line ------------------------------------------------------------------
    def _status_store(self) -> Store | None:
        """Where the nodes of a job of several publish their rows: the rendezvous store (c10d,
        etcd), or node 0's job store (a fixed node count); None on one node."""
        if self._rdzv_store is not None:
            return self._rdzv_store
        return self._store if self.config.nnodes > 1 else None

    def _publish_status(self) -> None:
        """This node's rows in the job's store, once a second (errors: logged)."""
        store, now = self._status_store(), self._clock()
        if store is None or self._job_record is None or now - self._published_at < _PUBLISH_EVERY:
            return
        self._published_at = now
        try:
            publish_status(store, self._job_record, self._published_cpu)
            if self._metrics is not None:  # (every node's endpoint serves the whole job)
                publish_metrics(store, self.config.run_id, self._metrics.snapshot())
                self._metrics.set_others(node_metrics(store, self.config.run_id))
            token = dump_request(store, self.config.run_id)  # (`tdist dump --rdzv-endpoint`)
            if token is not None and token != self._dump_served:
                self._dump_served = token
                threading.Thread(target=self._answer_dump, args=(store, dict(self._job_record), token),
                                 name="tdist-run-dump", daemon=True).start()
        except Exception as exc:  # (looking in is not worth a failure)
            log.debug("node %d: could not publish its status: %s", self.config.node_rank, exc)

    def _answer_dump(self, store: Store, record: dict[str, Any], token: str) -> None:
        try:
            answer_dump(store, record, token, _DUMP_WAIT)
        except Exception as exc:
            log.warning("node %d: could not answer a dump request: %s", self.config.node_rank, exc)

    def _unpublish_status(self) -> None:
        store = self._status_store()
        if store is None or self._job_record is None:
            return
        with contextlib.suppress(Exception):
            expire_status(store, self.config.run_id)
        if self._metrics is not None:  # (its last counts stay part of the job's)
            with contextlib.suppress(Exception):
                publish_metrics(store, self.config.run_id, self._metrics.snapshot())

    def _update_status(self, workers: list[_Worker], exits: list[WorkerExit], restart_count: int) -> None:
        """Count the group's workers and redraw the status line (monitor loop, each tick)."""
        counts = (
            sum(w.exit is None for w in workers),
            sum(not e.failed and e.returncode == 0 for e in exits),
            sum(e.failed for e in exits),
        )
        with self._write_lock:
            self._status_counts, self._status_restarts, self._status_paused = counts, restart_count, False
            with contextlib.suppress(OSError, ValueError):
                self._draw_status()

    def _draw_status(self) -> None:
        """Draw the status line in place of the one shown (``_write_lock`` held); not under a
        worker's incomplete line (a prompt), which it would erase."""
        if not self._status or self._status_paused or self._open_line is not None:
            return
        try:
            width = os.get_terminal_size(self._out.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):
            width = 80
        running, finished, failed = self._status_counts
        text = format_status(
            running=running, finished=finished, failed=failed, restarts=self._status_restarts,
            max_restarts=self.config.max_restarts, elapsed=self._clock() - self._started,
            progress=self._progress, width=width,
        )
        self._out.write(_ERASE_LINE + text.encode(errors="replace"))
        self._out.flush()
        self._status_shown = True
        self._status_drawn_at = self._clock()

    def _hide_status(self) -> None:
        """Erase the status line and draw it no more until the next group runs."""
        with self._write_lock:
            self._status_paused = True
            if self._status_shown:
                with contextlib.suppress(OSError, ValueError):
                    self._out.write(_ERASE_LINE)
                    self._out.flush()
                self._status_shown = False

    def _say(self, message: str) -> None:
        self._write(self._err, f"[tdist run] {message}\n".encode())

    # -- watching ------------------------------------------------------------------------------
    def _reap(self, workers: list[_Worker], exits: list[WorkerExit]) -> None:
        for w in workers:
            if w.exit is not None:
                continue
            rc = w.proc.poll()
            if rc is None:
                continue
            w.exit = WorkerExit(
                local_rank=w.local_rank,
                rank=w.rank,
                pid=w.proc.pid,
                returncode=rc,
                observed_at=self._clock(),
                timestamp=time.time(),
                # (one that failed on its own while being stopped still failed: only our
                # signals' own ends are consequences)
                stopped_by_agent=w.signalled and rc in (-signal.SIGTERM, -signal.SIGKILL, -(self._signum or signal.SIGTERM)),
                stalled=w.stalled,
            )
            exits.append(w.exit)
            if self._metrics is not None and w.metrics_id is not None:
                self._metrics.exited(w.metrics_id, rc, w.exit.stopped_by_agent)
            if w.pidfd is not None:
                os.close(w.pidfd)
                w.pidfd = None
            log.debug("worker rank %d (pid %d) exited with %d", w.rank, w.proc.pid, rc)

    def _sleep(self, workers: list[_Worker], timeout: float | None) -> None:
        """Block until a worker exits, a signal arrives, or ``timeout`` seconds pass."""
        fds = [self._wake_r]
        polling = not self._store_pidfds()
        fds += [pidfd for server, pidfd in self._watched if pidfd is not None and server.exit_status() is None]
        for w in workers:
            if w.exit is None:
                if w.pidfd is not None:
                    fds.append(w.pidfd)
                else:
                    polling = True
        if polling:
            timeout = 0.05 if timeout is None else min(timeout, 0.05)
        wait_any(fds, timeout)
        drain(self._wake_r)

    def _poll_timeout(self) -> float | None:
        if self._store is None:
            return None
        return max(0.0, self._next_peer_check - self._clock())

    # -- stopping ------------------------------------------------------------------------------
    def _snapshot(self, workers: list[_Worker], restart_count: int) -> None:
        """Before the workers still running are stopped after a failure: their Python stacks
        and flight records (each stays where its worker dumped it as well, where the failure
        report looks for it), where they answer such requests (a worker that imported tdist
        does; asked through its directory, never by a signal), into ``<attempt>/snapshot/`` for the post-mortem. When the
        logs are not kept, into a ``tdist_snapshot_*`` folder of its own: kept if the job's
        failure report names it, removed when the next failure's replaces it or the job ends
        without naming it (a job that succeeds after a restart leaves nothing)."""
        self._stacks = {}
        self._drop_loose_snapshot()
        attempt = self._attempt_dir(restart_count)
        record = self._job_record
        if attempt is None or record is None:
            return
        alive = {w.rank for w in workers if w.exit is None and w.proc.poll() is None}
        entries = [e for e in record.get("workers", []) if e.get("rank") in alive]
        if not any(answers(e) for e in entries):
            return
        with contextlib.suppress(OSError):
            if self._keeps_logs:
                dest = os.path.join(attempt, "snapshot")
            else:
                dest = self._loose_snapshot = tempfile.mkdtemp(prefix="tdist_snapshot_")
                _remove_if_killed(dest)
            files = gather_dump({**record, "workers": entries}, dest, timeout=_SNAPSHOT_WAIT)
            for path in files:
                name = os.path.basename(path)
                if name.startswith("stacks_"):
                    self._stacks[int(name[len("stacks_"):-len(".txt")])] = path

    def _drop_loose_snapshot(self) -> None:
        path, self._loose_snapshot = self._loose_snapshot, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _stop(self, workers: list[_Worker], exits: list[WorkerExit]) -> None:
        """SIGTERM every running worker's group, wait ``stop_timeout``, then SIGKILL; reap all."""
        self._hide_status()
        self._reap(workers, exits)
        alive = [w for w in workers if w.exit is None]
        if not alive:
            return
        log.info("stopping %d workers: %s", len(alive), [w.rank for w in alive])
        # the signal that stopped the job goes on to the workers (Ctrl-C: SIGINT, so that
        # their ``except KeyboardInterrupt`` runs), as torchrun's; any other stop: SIGTERM
        sig = self._signum if self._signum in self.config.signals else signal.SIGTERM
        for w in alive:
            w.signalled = True
            if w.stalled:  # (a stopped process would not act on the signal: it goes at once)
                signal_session(w.proc, signal.SIGKILL)
        signals_before = self._signal_count  # (a second signal to the launcher cuts the wait short)
        ranks = {id(w.proc): w.rank for w in alive}
        stop_processes(
            [w.proc for w in alive], sig, self.config.stop_timeout, clock=self._clock, wake_fd=self._wake_r,
            cut_short=lambda: self._signal_count > signals_before,
            describe=lambda p: f"worker rank {ranks[id(p)]} (pid {p.pid})",
        )
        self._reap(alive, exits)

    def _stop_leftovers(self, token: str, whose: str = "the stopped workers") -> None:
        """Kill what the stopped group's workers (or a failed worker that ``--ft`` restarts
        alone) left running: a worker that was killed, or failed, leaves its data loaders and
        subprocesses behind. A group that succeeded is left alone, as torchrun leaves it: a
        worker that exited 0 may have started something on purpose."""
        try:
            left = kill_marked(token)
        except Exception as exc:  # (a clean-up: never in place of the group's own outcome)
            log.warning("killing what the workers left running failed: %s", exc)
            return
        if left:
            pids = ", ".join(map(str, left))
            self._say(f"killed {len(left)} process{'es' if len(left) > 1 else ''} that {whose} had left running (pids {pids})")

    # -- signals -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signum is None:
            self._signum = signum
        self._signal_count += 1
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _install_signal_handlers(self) -> dict[int, object]:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, object] = {}
        for sig in self.config.signals:
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _restore_signal_handlers(self, previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _torch_port(self, port: int) -> int | None:
        """The workers' ``MASTER_PORT`` where it is not the job's store (``port``), which
        torch's own clients use as torchrun's (``TORCHELASTIC_USE_AGENT_STORE=True``; the
        store serves torch's protocol too): None here; a spec's own port in a subclass."""
        return None

    # -- several nodes -------------------------------------------------------------------------
    def _join(self, port: int, secret: str) -> None:
        """Static rendezvous: every node is given its rank; each sets its key in node 0's store
        and waits for the others' (there is nothing else to agree on)."""
        cfg = self.config
        timeout = timedelta(seconds=cfg.join_timeout)
        try:
            store = TCPStore(cfg.master_addr, port, timeout=timeout, secret=secret)
        except DistError as exc:
            raise LaunchError(
                f"node {cfg.node_rank}: cannot reach the job store at {cfg.master_addr}:{port}: {exc}"
            ) from exc
        self._store = store
        if store.add(f"{AGENT_PREFIX}/node{cfg.node_rank}", 1) > 1:
            raise LaunchError(
                f"node rank {cfg.node_rank} joined twice: give every node its own --node-rank"
            )
        keys = [f"{AGENT_PREFIX}/node{k}" for k in range(cfg.nnodes)]

        def stopped() -> str | None:
            return "interrupted while waiting for the other nodes" if self._signum is not None else None

        def late(missing: list[int]) -> str:
            return (
                f"nodes {missing} of {cfg.nnodes} did not join within {cfg.join_timeout:g} s; start "
                "`tdist run` with the same --master-addr and --master-port on every node"
            )

        self._wait_for_nodes(store, keys, stopped, late)
        self._share_node_sizes(store, f"{AGENT_PREFIX}/nproc", stopped, late)
        self._joined = True
        log.info("node %d: all %d nodes joined", cfg.node_rank, cfg.nnodes)

    def _share_node_sizes(
        self, store: Store, prefix: str, stopped: Callable[[], str | None], late: Callable[[list[int]], str]
    ) -> None:
        """Every node's ``--nproc-per-node``, through ``store`` (under ``prefix``), once the
        nodes have met: where they differ, global ranks follow the node ranks and the world is
        their sum, as torchrun's (each node counted with its own before: two workers got one
        rank, and the group waited its whole timeout)."""
        cfg = self.config
        store.set(f"{prefix}/{cfg.node_rank}", str(cfg.nproc_per_node))
        keys = [f"{prefix}/{k}" for k in range(cfg.nnodes)]
        self._wait_for_nodes(store, keys, stopped, late)
        sizes = tuple(int(v) for v in store.multi_get(keys))
        self.config = dataclasses.replace(cfg, node_sizes=None if len(set(sizes)) == 1 else sizes)

    def _watch_store(self, server: StoreServer) -> None:
        """Watch a store server this node started (its death ends the job). Its process serves
        from a moment after its start (a thread of ours serves until then): its pidfd is taken
        then (``_store_pidfds``)."""
        self._watched.append((server, None))
        self._store_pidfds()

    def _store_pidfds(self) -> bool:
        """Take the pidfds of the watched store servers whose own process serves by now;
        whether every one is watched so (else their state is looked at each wake-up)."""
        complete = True
        for i, (server, pidfd) in enumerate(self._watched):
            if pidfd is not None or server.exit_status() is not None:
                continue
            if server.handover_pending:
                complete = False
                continue
            pid = server.pid
            if pid is None:  # (served from a thread of this process: it ends with us)
                continue
            try:
                self._watched[i] = (server, os.pidfd_open(pid))
            except (AttributeError, OSError):  # (old kernel: checked each wake-up)
                complete = False
        return complete

    def _unwatch_store(self, server: StoreServer) -> None:
        """Stop watching ``server`` (before stopping it)."""
        for entry in [e for e in self._watched if e[0] is server]:
            self._watched.remove(entry)
            if entry[1] is not None:
                os.close(entry[1])

    def _store_lost(self) -> str | None:
        """Why a store server that this node runs is gone (its process died), else None. The
        workers and the other nodes depend on it: the job ends."""
        for server, _ in self._watched:
            status = server.exit_status()
            if status is not None:
                return (
                    f"the job's store server (pid {server.pid}, port {server.port}) died (exit code "
                    f"{describe_returncode(status)}); the workers cannot meet without it"
                )
        return None

    def _poll_peers(self) -> tuple[str | None, bool]:
        if self._store is None or self._clock() < self._next_peer_check:
            return None, False
        self._next_peer_check = self._clock() + self.config.monitor_interval
        return self._peer_failure()

    def _peer_failure(self) -> tuple[str | None, bool]:
        """Why another node's group stopped, and whether that ends the job (a node stopped
        for good, or the store is gone) rather than this attempt (a worker failed: the job
        restarts while restarts are left); (None, False) while none did."""
        if self._store is None:
            return None, False
        stopped, failed = f"{AGENT_PREFIX}/stopped", f"{AGENT_PREFIX}/attempt{self._attempt}/failed"
        try:
            for key, final in ((stopped, True), (failed, False)):
                if self._store.check([key]):
                    return self._store.get(key).decode(errors="replace"), final
        except DistError as exc:
            if self.config.rdzv_backend != "etcd":  # (our own store: its host, node 0, is gone)
                return f"the job store is gone ({exc})", True
            # etcd is a service of its own: a leader election or a busy moment is ridden out
            now = self._clock()
            self._store_failing_since = self._store_failing_since or now
            if now - self._store_failing_since < _ETCD_GRACE:
                log.warning("node %d: etcd did not answer (%s); trying again", self.config.node_rank, exc)
                return None, False
            return f"etcd has not answered for {_ETCD_GRACE:g} s ({exc})", True
        self._store_failing_since = 0.0
        return None, False

    def _post_failure(self, what: str, final: bool = False) -> None:
        """Tell the other nodes: this attempt failed (they stop their groups, and restart
        while restarts are left) or, ``final``, the job is over."""
        if self._store is None:
            return
        key = f"{AGENT_PREFIX}/stopped" if final else f"{AGENT_PREFIX}/attempt{self._attempt}/failed"
        self._job_failed = self._job_failed or final
        with contextlib.suppress(DistError):
            self._store.compare_set(key, b"", what.encode())

    def _rejoin(self, attempt: int, port: int, secret: str) -> None:
        """Before attempt ``attempt`` of several nodes: wait until every node is there (each
        has stopped its previous group), within the join timeout. Node 0 clears the last
        group's torch keys first (``_forget_torch_keys``): no node starts its workers before."""
        store, cfg = self._store, self.config
        assert store is not None
        keys = [f"{AGENT_PREFIX}/attempt{attempt}/node{k}" for k in range(cfg.nnodes)]
        if cfg.node_rank == 0:
            self._forget_torch_keys(cfg.master_addr, port, secret)
        store.set(keys[cfg.node_rank], b"1")

        def stopped() -> str | None:
            peer, final = self._peer_failure()
            if final or self._signum is not None:
                return f"the job stopped before restart {attempt}: {peer or 'interrupted'}"
            return None

        def late(missing: list[int]) -> str:
            return f"nodes {missing} did not come back for restart {attempt} within {cfg.join_timeout:g} s"

        self._wait_for_nodes(store, keys, stopped, late)
        log.info("node %d: all %d nodes are back for restart %d", cfg.node_rank, cfg.nnodes, attempt)

    def _forget_torch_keys(self, host: str, port: int, secret: str) -> None:
        """Between two worker groups (every worker of the last has stopped, none of the next
        has started): the keys torch's own clients wrote in the workers' store at
        ``host:port`` go (the server keeps them apart: ``TORCH_KEYS``). torch's
        ``init_process_group`` names the same keys in every group
        (``default_pg/...``), and under torchrun a group formed again meets the last one's,
        such as the addresses of ranks that are gone. tdist's own ``env://`` keeps each
        group's keys apart already (``TDIST_AGENT_ROUND`` and the restart count)."""
        try:
            store = TCPStore(host, port, timeout=timedelta(seconds=self.config.join_timeout), secret=secret or None)
        except DistError as exc:
            log.warning("cannot clear the last worker group's torch keys from the store at %s:%d: %s", host, port, exc)
            return
        try:
            if store.transport == "torch":  # (not a tdist server: a rendezvous handler's, left alone)
                return
            stale = [key for key in store.list_keys() if key.startswith(TORCH_KEYS)]
            for key in stale:
                store.delete_key(key)
            if stale:
                log.info("cleared %d keys of the last worker group's torch clients from the store", len(stale))
        except DistError as exc:
            log.warning("cannot clear the last worker group's torch keys from the store at %s:%d: %s", host, port, exc)
        finally:
            store.close()

    def _wait_for_nodes(
        self, store: Store, keys: list[str], stopped: Callable[[], str | None], late: Callable[[list[int]], str]
    ) -> None:
        """Wait until every node's key (``keys[k]`` for node ``k``) is set, within the join
        timeout. Raises ``LaunchError`` with ``stopped()``'s reason when it gives one, or with
        ``late(missing nodes)`` at the deadline."""
        cfg = self.config
        why: list[str] = []

        def stop() -> bool:
            reason = stopped()
            if reason is not None:
                why.append(reason)
            return reason is not None

        if not self._until_keys(store, keys, self._clock() + cfg.join_timeout, stop, what="waiting for the nodes to join"):
            if why:
                raise LaunchError(f"node {cfg.node_rank}: {why[0]}")
            missing = [k for k in range(len(keys)) if not store.check([keys[k]])]
            raise LaunchError(f"node {cfg.node_rank}: {late(missing)}")

    def _until_keys(
        self, store: Store, keys: list[str], deadline: float, stop: Callable[[], bool], poll: float = 1.0,
        what: str = "",
    ) -> bool:
        """Wait until every key of ``keys`` is set (True), or until ``stop()`` says so or
        ``deadline`` passes (False); ``stop`` is asked at least every ``poll`` seconds. With
        ``what`` (node ``k``'s key is ``keys[k]``), a wait of 30 s says which nodes it waits
        for, then every minute: ``node 0: <what>: waited 30 s for node(s) [1] ...``."""
        start = self._clock()
        words = patience.Words()
        while not store.check(keys):
            now = self._clock()
            if stop() or now >= deadline:
                return False
            if what and words.due(now - start):
                missing = [k for k, key in enumerate(keys) if not store.check([key])]
                log.warning("node %d: %s: waited %.0f s for node(s) %s (at most %.0f s more)",
                            self.config.node_rank, what, now - start, missing, deadline - now)
            with contextlib.suppress(DistStoreError):
                store.wait(keys, timedelta(seconds=min(poll, max(0.01, deadline - self._clock()))))
        return True

    def _settle_success(self) -> Outcome:
        """This node's workers all succeeded; the attempt is the job's, across the nodes: wait
        until every node's did (``SUCCEEDED``), or another node posts a failure of the attempt
        that it restarts after (``PEER_FAILED``: the group restarts, this node's too, as after
        any failure). Else a node whose worker failed as this node's finished restarts alone,
        and waits for this node to rejoin while this one waits for it to finish. A failure
        that ended the job leaves this node's success as it is (the failed node reports it),
        as do the exit barrier's timeout and a signal."""
        store, cfg = self._store, self.config
        if store is None:
            return Outcome.SUCCEEDED
        key = f"{AGENT_PREFIX}/attempt{self._attempt}/succeeded/node"
        keys = [f"{key}{k}" for k in range(cfg.nnodes)]
        restart = False

        def stop() -> bool:
            nonlocal restart
            peer, final = self._peer_failure()
            restart = peer is not None and not final
            return peer is not None or self._signum is not None

        try:
            store.set(keys[cfg.node_rank], b"1")
            self._until_keys(store, keys, self._clock() + cfg.exit_barrier_timeout, stop, poll=0.1,
                             what="its workers succeeded; waiting for the other nodes' workers to finish")
        except DistError as exc:
            log.warning("node %d: could not wait for the other nodes' workers: %s", cfg.node_rank, exc)
        return Outcome.PEER_FAILED if restart else Outcome.SUCCEEDED

    def _exit_barrier(self) -> None:
        store, cfg = self._store, self.config
        if store is None or not self._joined or self._leaving:  # (a node leaving on purpose: the job goes on)
            return
        try:
            store.set(f"{AGENT_PREFIX}/finished/node{cfg.node_rank}", b"1")
            # a node that hosts a store the others use (static node 0, the c10d host, the node
            # 0 of a round with the workers' store) waits for them before it goes
            # (under a caller's handler every agent waits, as torch's exit barrier)
            if not self._hosting and self._round_server is None and self._given_rendezvous is None:
                return
            keys = [f"{AGENT_PREFIX}/finished/node{k}" for k in range(cfg.nnodes)]
            # (after this node ended the job on a failure, the live nodes read it and stop their
            # workers within --stop-timeout: a node that does not come by then is cut off, and
            # is not waited for the whole exit barrier; a signal ends the wait then)
            limit = cfg.exit_barrier_timeout
            if self._job_failed:
                limit = min(limit, cfg.stop_timeout + _FAILED_EXIT_WAIT)
            signals = 0 if self._job_failed else 1
            if not self._until_keys(store, keys, self._clock() + limit, lambda: self._signal_count > signals,
                                    what="keeping the job's store up until every node has finished"):
                log.warning("node %d: stopping the job's store before every node finished", cfg.node_rank)
                return
            if cfg.rdzv_backend == "etcd" and cfg.node_rank == 0:  # the job is over: its keys leave etcd
                delete_all = getattr(self._rdzv_store, "delete_all", None)
                if delete_all is not None:
                    delete_all()
        except DistError as exc:
            log.warning("node %d: exit barrier failed: %s", cfg.node_rank, exc)


def launch(
    config: LaunchConfig,
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    env: Mapping[str, str] | None = None,
    handle_signals: bool = True,
) -> int:
    """Run ``config`` on this node with a ``LocalAgent`` (see it for the arguments).

    Returns:
        The launcher's exit code.

    Raises:
        LaunchError: the job could not be set up.
    """
    agent = LocalAgent(config, stdout=stdout, stderr=stderr, env=env, handle_signals=handle_signals)
    return agent.run()

