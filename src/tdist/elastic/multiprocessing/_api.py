"""``start_processes`` and its process contexts (torch's ``elastic.multiprocessing.api``).

Theory of operation. ``start_processes`` starts ``n`` copies of an entrypoint, one per local
rank, and returns a ``PContext`` that watches them as a group: the first failure stops the rest,
and ``wait`` returns a ``RunProcsResult`` once every copy succeeded or one failed.

- A program (a ``str``): ``SubprocessContext`` runs ``entrypoint *args`` (each argument made a
  string) with this process's environment plus ``envs[local_rank]``.
- A Python function: ``MultiprocessContext`` runs each copy in a new interpreter, as
  ``multiprocessing``'s ``spawn`` does (``_worker``, ``_call``: the launching program's main module is
  prepared again, so the function must be picklable by name); the function runs under
  ``@record`` and its return value comes back pickled. ``start_method`` is checked and recorded:
  ``fork`` and ``forkserver`` run the same way (a new interpreter), so a lambda or a closure that
  only ``fork`` could carry is refused when the context starts.

Both kinds are one engine here: every copy is a child process in a session of its own that dies
with this process (``_process``), watched through pidfds, so ``wait`` sleeps until a copy
exits (or its deadline) instead of checking every ``period`` seconds.

Where each stream goes is ``LogsSpecs.reify``'s ``LogsDest``: ``""`` (this process's stream,
inherited as it is), a file (the child writes there itself), or a file that is also "teed": the
child writes into a pipe, and a thread copies each line to the file and to this process's
``sys.stdout``/``sys.stderr`` behind a ``[<name><local rank>]:`` header (or the rank's
``log_line_prefixes`` entry), as torch's ``TailLog`` prints them, without its polling.

Signals: ``start()`` in the main thread installs, for each signal of
``TORCHELASTIC_SIGNALS_TO_HANDLE`` (default ``SIGTERM,SIGINT,SIGHUP,SIGQUIT``), a handler that
raises torch's ``SignalException`` in the main thread, as torch's does (they stay installed);
the caller catches it and calls ``close(e.sigval)``.

Thread-safety: a context is used by one thread at a time.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, TextIO

from .._policy import Std, to_map
from . import _call
from ._process import copy_lines, open_pidfd, start_process, stop_processes, wait_any

if TYPE_CHECKING:
    from .errors import ProcessFailure

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SubprocessContext",
    "start_processes",
]

log = logging.getLogger(__name__)

_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # (torch's, when TORCHELASTIC_SIGNALS_TO_HANDLE is unset)
_SYS_STREAM = ""  # a LogsDest entry: this process's own stream
_PUMP_JOIN = 2.0  # seconds to wait for a child's last teed lines once it is gone
_POLL_EVERY = 0.05  # seconds between checks of a child that has no pidfd (an old kernel)
_console_lock = threading.Lock()  # (teed lines of every context: whole lines, never mixed)


def _validate_full_rank(d: Mapping[int, Any], nprocs: int, what: str) -> None:
    """``d``'s keys are the local ranks ``0..nprocs-1`` (torch's check and message).

    Raises:
        RuntimeError: they are not.
    """
    expected = set(range(nprocs))
    if set(d) != expected:
        raise RuntimeError(f"{what}, local rank mapping mismatch, expected: {expected}, actual: {set(d)}")


def _terminate_process_handler(signum: int, frame: FrameType | None) -> None:
    """The handler ``PContext.start`` installs: raise torch's ``SignalException``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


# -- where the logs go -------------------------------------------------------------------------
@dataclass
class LogsDest:
    """Each local rank's log destinations (torch's): its stdout and stderr (``""``: this
    process's), the ones also teed to the console, its error file, and the files of the lines
    that ``duplicate_*_filters`` pick."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = field(default_factory=str)
    filtered_stderr: str = field(default_factory=str)


class LogsSpecs(abc.ABC):
    """Where the workers' logs go (torch's base class): subclass it and give ``reify``.

    Args:
        log_dir: the base directory of the logs.
        redirects: the streams written to files instead of the console (one ``Std`` for every
            local rank, or one per local rank).
        tee: the streams written to files and to the console.
        local_ranks_filter: the local ranks whose streams the console shows (None: all).
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abc.abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Each local rank's destinations, for the environments ``envs`` (by local rank; a
        spec may set ``TORCHELASTIC_ERROR_FILE`` in them)."""

    @property
    @abc.abstractmethod
    def root_log_dir(self) -> str:
        """The base directory of the logs."""


class DefaultLogsSpecs(LogsSpecs):
    """torch's default: ``log_dir`` made if missing (a new temporary one when not given;
    ``os.devnull``: no files at all, every stream on the console, no error files); each
    ``reify`` lays out ``<log_dir>/<run id>_<random>/attempt_<restart count>/<local rank>/``
    with ``stdout.log``, ``stderr.log`` and ``error.json`` (the run directory is made once).

    Raises:
        NotADirectoryError: ``log_dir`` is a file.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        made = False
        if log_dir != os.devnull:
            if not log_dir:
                log_dir, made = tempfile.mkdtemp(prefix="torchelastic_"), True
            elif os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir: {log_dir} is a file")
            else:
                os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None
        # (a temporary directory of its own: a launch that leaves no log or error file in it
        # removes it at its end, where torch's stays behind in /tmp)
        self._temporary = made

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The destinations of ``len(envs)`` local ranks, in a fresh ``attempt_<n>`` directory
        (``n``: ``TORCHELASTIC_RESTART_COUNT`` of ``envs[0]``; the run id is its
        ``TORCHELASTIC_RUN_ID``); each rank's ``TORCHELASTIC_ERROR_FILE`` is set in ``envs``
        (``""`` with ``os.devnull``). A teed stream is a redirected one that the console
        shows too."""
        nprocs = len(envs)
        first = envs.get(0, {})
        if not envs:
            log.warning("empty envs map provided when defining logging destinations")
        run_id = first.get("TORCHELASTIC_RUN_ID", "test_run_id")
        restart_count = first.get("TORCHELASTIC_RESTART_COUNT", "0")
        devnull = self._root_log_dir == os.devnull
        attempt_dir = os.devnull
        if not devnull:
            if not self._run_log_dir:
                base = self._root_log_dir or tempfile.mkdtemp(prefix="torchelastic_")
                os.makedirs(base, exist_ok=True)
                self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
                log.info("log directory set to: %s", self._run_log_dir)
            attempt_dir = os.path.join(self._run_log_dir, f"attempt_{restart_count}")
            shutil.rmtree(attempt_dir, ignore_errors=True)
            os.makedirs(attempt_dir)
        # (a plain int is taken for its ``Std``, as torch's ``IntFlag`` arithmetic takes it)
        tees = {r: Std(std) for r, std in to_map(self._tee, nprocs).items()}
        files = {r: Std(std) | tees[r] for r, std in to_map(self._redirects, nprocs).items()}  # (a tee is a redirect too)
        dest = LogsDest(
            stdouts=dict.fromkeys(range(nprocs), _SYS_STREAM),
            stderrs=dict.fromkeys(range(nprocs), _SYS_STREAM),
            filtered_stdout=os.path.join(attempt_dir, "filtered_stdout.log"),
            filtered_stderr=os.path.join(attempt_dir, "filtered_stderr.log"),
        )
        for r in range(nprocs):
            if devnull:
                dest.tee_stdouts[r] = dest.tee_stderrs[r] = dest.error_files[r] = os.devnull
                envs[r]["TORCHELASTIC_ERROR_FILE"] = ""
                continue
            rank_dir = os.path.join(attempt_dir, str(r))
            os.mkdir(rank_dir)
            shown = self._local_ranks_filter is None or not self._local_ranks_filter or r in self._local_ranks_filter
            for std, paths, teed, name in (
                (Std.OUT, dest.stdouts, dest.tee_stdouts, "stdout.log"),
                (Std.ERR, dest.stderrs, dest.tee_stderrs, "stderr.log"),
            ):
                if std in files[r]:
                    paths[r] = os.path.join(rank_dir, name)
                    if std in tees[r] and shown:
                        teed[r] = paths[r]
                elif not shown:  # (a rank the console does not show: its stream goes nowhere)
                    paths[r] = os.devnull
            dest.error_files[r] = os.path.join(rank_dir, "error.json")
            envs[r]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[r]
            log.info("setting worker%s reply file to: %s", r, dest.error_files[r])
        return dest

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
            f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return False
        return (self._root_log_dir, self._redirects, self._tee, self._local_ranks_filter) == (
            other._root_log_dir, other._redirects, other._tee, other._local_ranks_filter
        )

    __hash__ = None  # type: ignore[assignment]  # (equal by value, mutable: as torch's)


# -- what a run gives back ---------------------------------------------------------------------
@dataclass
class RunProcsResult:
    """How a context's processes ended, by local rank (torch's).

    Attributes:
        return_values: each function's return value (a program's: None), once all succeeded.
        failures: the failed processes (torch's ``ProcessFailure``: exit code, pid, error file
            and the message the error file holds).
        stdouts, stderrs: each rank's stdout/stderr file (``""``: the console).
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """Whether a process failed."""
        return len(self.failures) > 0


@dataclass
class _Child:
    """One started process and the threads that copy its teed streams."""

    local_rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread]
    exited_at: float | None = None  # (monotonic: orders the failures)


class PContext(abc.ABC):
    """``n`` processes started by ``start_processes``, watched as a group (torch's ``PContext``).

    Args:
        name: what the processes are; the header of their teed lines, ``[<name><local rank>]:``.
        entrypoint: a function or a program.
        args: each local rank's arguments.
        envs: each local rank's environment variables (on top of this process's).
        logs_specs: where the streams and error files go (its ``reify`` sets each rank's
            ``TORCHELASTIC_ERROR_FILE`` in ``envs``).
        log_line_prefixes: a header per local rank, instead of the default one.
        duplicate_stdout_filters, duplicate_stderr_filters: the teed lines that contain any of
            these strings also go, with their headers, to ``LogsDest.filtered_stdout``/
            ``filtered_stderr`` (one file for all ranks).

    Raises:
        RuntimeError: the logs' destinations do not name every local rank.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        self.name = name
        nprocs = len(args)
        dest = logs_specs.reify(envs)
        _validate_full_rank(dest.stdouts, nprocs, "stdouts")
        _validate_full_rank(dest.stderrs, nprocs, "stderrs")
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.stdouts = dest.stdouts
        self.stderrs = dest.stderrs
        self.error_files = dest.error_files
        self.nprocs = nprocs
        self._tee_stdouts, self._tee_stderrs = dest.tee_stdouts, dest.tee_stderrs
        self._log_line_prefixes = log_line_prefixes or {}
        self._console: dict[Std, TextIO] = {Std.OUT: sys.stdout, Std.ERR: sys.stderr}
        self.filtered_stdout: IO[str] | None = None
        self.filtered_stderr: IO[str] | None = None
        self._filters: dict[Std, tuple[list[str], IO[str]]] = {}
        for std, needles, path in (
            (Std.OUT, duplicate_stdout_filters, dest.filtered_stdout),
            (Std.ERR, duplicate_stderr_filters, dest.filtered_stderr),
        ):
            if needles:
                f = open(path, "w", errors="replace", buffering=1)  # (closed by close())
                self._filters[std] = (list(needles), f)
                if std is Std.OUT:
                    self.filtered_stdout = f
                else:
                    self.filtered_stderr = f
        self._children: dict[int, _Child] = {}
        self._started = False
        self._closed = False
        self._result: RunProcsResult | None = None

    # -- starting ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the processes. In the main thread, first install the handlers that turn the
        signals of ``TORCHELASTIC_SIGNALS_TO_HANDLE`` into ``SignalException`` (torch's).

        Raises:
            ValueError: the context was started already.
            OSError: a process could not be started.
        """
        if threading.current_thread() is threading.main_thread():
            for sig_name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _DEFAULT_SIGNALS).split(","):
                try:
                    signal.signal(getattr(signal, sig_name.strip()), _terminate_process_handler)
                    log.info("registered signal handler for %s", sig_name)
                except (AttributeError, ValueError, RuntimeError):
                    log.warning("failed to register signal handler for %s", sig_name, exc_info=True)
        else:
            log.warning(
                "signal handlers not registered: start_processes runs in a thread other than the main "
                "one (its processes still die with this process)"
            )
        self._start()

    def _start(self) -> None:
        if self._started:
            raise ValueError(f"the processes of {self.name!r} were started already: start() was called twice")
        self._started = True
        for local_rank in range(self.nprocs):
            self._children[local_rank] = self._spawn(local_rank)

    @abc.abstractmethod
    def _command(self, local_rank: int) -> list[str]:
        """The argv of local rank ``local_rank``'s process."""

    def _pass_fds(self, local_rank: int) -> tuple[int, ...]:
        """The descriptors local rank ``local_rank``'s process inherits."""
        return ()

    def _header(self, local_rank: int) -> str:
        return self._log_line_prefixes.get(local_rank, f"[{self.name}{local_rank}]:")

    def _spawn(self, local_rank: int) -> _Child:
        """Start local rank ``local_rank``'s process, its streams where ``reify`` said."""
        env = {**os.environ, **{k: str(v) for k, v in self.envs[local_rank].items()}}
        targets: dict[Std, int | IO[bytes] | None] = {}
        teed: dict[Std, IO[bytes] | None] = {Std.OUT: None, Std.ERR: None}  # (the pumps' files)
        files: list[IO[bytes]] = []  # (the child's: it has its own copies once started)
        try:
            for std, paths, tees in ((Std.OUT, self.stdouts, self._tee_stdouts), (Std.ERR, self.stderrs, self._tee_stderrs)):
                path = paths[local_rank]
                if not path:
                    targets[std] = None  # (this process's stream, as it is)
                elif local_rank in tees and path != os.devnull:
                    targets[std] = subprocess.PIPE
                    teed[std] = open(path, "wb", buffering=0)  # (its pump closes it)
                else:
                    files.append(open(path, "wb"))  # (closed below)
                    targets[std] = files[-1]
            proc = start_process(
                self._command(local_rank), env, stdout=targets[Std.OUT], stderr=targets[Std.ERR],
                pass_fds=self._pass_fds(local_rank),
            )
        except BaseException:
            for f in teed.values():
                if f is not None:
                    f.close()
            raise
        finally:
            for f in files:
                f.close()
        pumps = []
        for std, stream in ((Std.OUT, proc.stdout), (Std.ERR, proc.stderr)):
            if stream is None:
                continue
            t = threading.Thread(
                target=copy_lines, args=(stream, teed[std], self._teer(local_rank, std)),
                name=f"tdist-tee-{self.name}{local_rank}", daemon=True,
            )
            t.start()
            pumps.append(t)
        log.debug("started %s local rank %d: pid %d", self.name, local_rank, proc.pid)
        return _Child(local_rank, proc, pumps)

    def _teer(self, local_rank: int, std: Std) -> Callable[[bytes], None]:
        """What a teed line of ``local_rank``'s stream ``std`` does after its file: it goes to
        the console behind its header (and to the filtered file when a filter picks it)."""
        header, console = self._header(local_rank), self._console[std]
        picked = self._filters.get(std)

        def on_line(raw: bytes) -> None:
            text = raw.decode(errors="replace")
            line = header + (text if text.endswith("\n") else text + "\n")
            with _console_lock:
                with contextlib.suppress(OSError, ValueError):  # (our console is gone: go on)
                    console.write(line)
                    console.flush()
                if picked is not None and any(needle in text for needle in picked[0]):
                    with contextlib.suppress(OSError, ValueError):
                        picked[1].write(line)

        return on_line

    # -- watching ------------------------------------------------------------------------------
    def _reap(self) -> None:
        for child in self._children.values():
            if child.exited_at is None and child.proc.poll() is not None:
                child.exited_at = time.monotonic()

    def _poll(self) -> RunProcsResult | None:
        """The result once every process succeeded or one failed (then the others are stopped
        first), else None."""
        if self._result is not None:
            return self._result
        if not self._started:
            raise RuntimeError(f"the processes of {self.name!r} were not started: call start() first")
        self._reap()
        failed = any(c.proc.returncode not in (None, 0) for c in self._children.values())
        if not failed and any(c.exited_at is None for c in self._children.values()):
            return None
        self._close(signal.SIGTERM)  # (the others, after a failure; the outcome counts their ends)
        self._reap()
        self._result = self._outcome()
        self.close()
        if self._result.is_failed():
            first = min(self._result.failures.values(), key=lambda f: (f.timestamp, f.local_rank))
            log.error(
                "failed (exitcode: %s) local_rank: %s (pid: %s) of %s", first.exitcode, first.local_rank,
                first.pid, self._what(),
            )
        return self._result

    def _failure(self, child: _Child) -> ProcessFailure:
        from .errors import ProcessFailure

        code = child.proc.returncode
        assert code is not None
        return ProcessFailure(
            local_rank=child.local_rank, pid=child.proc.pid, exitcode=code,
            error_file=self.error_files.get(child.local_rank, ""),
        )

    def _failed_children(self) -> list[_Child]:
        """The processes that failed, first observed first."""
        failed = [c for c in self._children.values() if c.proc.returncode not in (None, 0)]
        return sorted(failed, key=lambda c: (c.exited_at if c.exited_at is not None else float("inf"), c.local_rank))

    @abc.abstractmethod
    def _outcome(self) -> RunProcsResult:
        """The result, every process gone."""

    @abc.abstractmethod
    def _what(self) -> str:
        """The entrypoint, as a log line names it."""

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait up to ``timeout`` seconds (negative: no limit; 0: just look) until every
        process succeeded or one failed; the others are then stopped (``close``).

        Args:
            timeout: seconds.
            period: the longest sleep between two checks where a process cannot be waited on
                (an old kernel without pidfds); otherwise the wait ends as soon as a process
                exits.

        Returns:
            The result, or None if the processes still run at the deadline.

        Raises:
            SignalException: a signal the context handles arrived (torch's; call
                ``close(e.sigval)``).
        """
        if timeout == 0:
            return self._poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            result = self._poll()
            if result is not None:
                return result
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._sleep(remaining, period)

    def _sleep(self, timeout: float | None, period: float) -> None:
        """Until a running process exits or ``timeout`` seconds (None: no limit) passed."""
        running = [c.proc for c in self._children.values() if c.exited_at is None]
        pidfds = [open_pidfd(p) for p in running]
        try:
            fds = [fd for fd in pidfds if fd is not None]
            if len(fds) < len(running):
                step = min(period, _POLL_EVERY) if period > 0 else _POLL_EVERY
                timeout = step if timeout is None else min(timeout, step)
            wait_any(fds, timeout)
        finally:
            for fd in pidfds:
                if fd is not None:
                    os.close(fd)

    def pids(self) -> dict[int, int]:
        """Each local rank's process id (empty before ``start``)."""
        return {r: c.proc.pid for r, c in self._children.items()}

    # -- stopping ------------------------------------------------------------------------------
    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        """Stop every process still running: ``death_sig`` (default SIGTERM) to its process
        group, up to ``timeout`` seconds, then SIGKILL (ten seconds more at most); then the
        teed streams' last lines are copied and the files closed. Safe to call again."""
        self._close(death_sig or signal.SIGTERM, timeout)
        for child in self._children.values():
            deadline = time.monotonic() + _PUMP_JOIN
            for t in child.pumps:
                t.join(max(0.0, deadline - time.monotonic()))
        if not self._closed:
            self._closed = True
            for _, f in self._filters.values():
                f.close()
        self._reap()
        if self._started and self._result is None:  # (what a later ``wait`` returns)
            self._result = self._outcome()

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        running = [c for c in self._children.values() if c.proc.poll() is None]
        if not running:
            return
        for c in running:
            log.warning("closing process %s via signal %s", c.proc.pid, death_sig.name)
        names = {id(c.proc): c.local_rank for c in running}
        stop_processes(
            [c.proc for c in running], death_sig, timeout,
            describe=lambda p: f"{self.name} local rank {names[id(p)]} (pid {p.pid})",
        )


class SubprocessContext(PContext):
    """``PContext`` of a program: ``entrypoint *args`` per local rank (torch's).

    Its result: on success ``return_values`` are all None; on failure, ``failures`` holds every
    process that did not exit 0, those stopped after the first failure included (exit code
    ``-15`` for SIGTERM), as torch's.
    """

    def __init__(
        self,
        name: str,
        entrypoint: str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, duplicate_stdout_filters, duplicate_stderr_filters
        )
        self._program = entrypoint

    def _command(self, local_rank: int) -> list[str]:
        return [self._program, *(str(a) for a in self.args[local_rank])]

    def _what(self) -> str:
        return f"binary: {self._program}"

    def _outcome(self) -> RunProcsResult:
        failures = {c.local_rank: self._failure(c) for c in self._failed_children()}
        values: dict[int, Any] = {} if failures else dict.fromkeys(range(self.nprocs))
        return RunProcsResult(return_values=values, failures=failures, stdouts=self.stdouts, stderrs=self.stderrs)


class MultiprocessContext(PContext):
    """``PContext`` of a Python function: ``entrypoint(*args)`` per local rank, each in a new
    interpreter (see the module), under ``@record`` (torch's).

    Its result: on success ``return_values`` holds each call's value; on failure, ``failures``
    holds the first failed process only, as torch's.

    Raises:
        ValueError: ``start_method`` is not one of ``multiprocessing``'s.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any],
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        start_method: str,
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"cannot find context for {start_method!r}")
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, duplicate_stdout_filters, duplicate_stderr_filters
        )
        self.start_method = start_method
        self._fn = entrypoint
        # each local rank's call and return value, in files of memory only (``memfd``) that its
        # process inherits: nothing on disk for a crash of this process to leave behind
        self._calls: dict[int, tuple[int, int]] = {}

    def _start(self) -> None:
        if not self._calls:
            try:
                for local_rank in range(self.nprocs):
                    call = os.memfd_create(f"tdist-call-{local_rank}", os.MFD_CLOEXEC)
                    self._calls[local_rank] = (call, os.memfd_create(f"tdist-value-{local_rank}", os.MFD_CLOEXEC))
                    try:
                        _call.write_call(_call.fd_path(call), self._fn, self.args[local_rank])
                    except Exception as exc:
                        raise type(exc)(
                            f"{self.name}: cannot send {self._what()} with local rank {local_rank}'s arguments to a "
                            f"new process (its start method {self.start_method!r} runs as 'spawn' does: the function "
                            f"must be importable by name, its arguments picklable): {exc}"
                        ) from exc
            except BaseException:
                self._close_calls()
                raise
        super()._start()

    def _pass_fds(self, local_rank: int) -> tuple[int, ...]:
        return self._calls[local_rank]

    def _command(self, local_rank: int) -> list[str]:
        python = os.fsdecode(multiprocessing.spawn.get_executable() or sys.executable)  # (bytes, at times)
        call, value = self._calls[local_rank]
        return _call.worker_command(python, _call.fd_path(call), _call.fd_path(value))

    def _what(self) -> str:
        return f"fn: {getattr(self._fn, '__qualname__', repr(self._fn))} (start_method: {self.start_method})"

    def _outcome(self) -> RunProcsResult:
        failed = self._failed_children()
        if failed:
            first = failed[0]
            return RunProcsResult(failures={first.local_rank: self._failure(first)}, stdouts=self.stdouts, stderrs=self.stderrs)
        values = {r: _call.read_result(_call.fd_path(self._calls[r][1])) for r in range(self.nprocs)}
        return RunProcsResult(return_values=values, stdouts=self.stdouts, stderrs=self.stderrs)

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        super().close(death_sig, timeout)
        self._close_calls()

    def _close_calls(self) -> None:
        calls, self._calls = self._calls, {}
        for fds in calls.values():
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]],
    logs_specs: LogsSpecs,
    log_line_prefixes: dict[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: Any = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
) -> PContext:
    """Start ``len(args)`` copies of ``entrypoint``, one per local rank (torch's).

    Args:
        name: what the processes are (the header of their teed lines).
        entrypoint: a function (``MultiprocessContext``) or a program (``SubprocessContext``,
            its arguments made strings).
        args: each local rank's arguments, keyed ``0..n-1``.
        envs: each local rank's environment variables on top of this process's, keyed alike.
        logs_specs: where the streams go (``DefaultLogsSpecs``), and the error files.
        log_line_prefixes: a header per local rank for its teed lines.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (checked; every function runs in a
            new interpreter, as with ``spawn``); ignored for a program.
        numa_options: accepted, not used (tdist binds no NUMA node).
        duplicate_stdout_filters, duplicate_stderr_filters: see ``PContext``.

    Returns:
        The started context; ``wait()`` gives the ``RunProcsResult``.

    Raises:
        RuntimeError: ``args`` or ``envs`` are not keyed ``0..n-1``.
        ValueError: an unknown ``start_method``.
        OSError: a process could not be started (every one started is stopped first).
    """
    nprocs = len(args)
    _validate_full_rank(args, nprocs, "args")
    _validate_full_rank(envs, nprocs, "envs")
    context: PContext
    if isinstance(entrypoint, str):
        context = SubprocessContext(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, numa_options,
            duplicate_stdout_filters, duplicate_stderr_filters,
        )
    else:
        context = MultiprocessContext(
            name, entrypoint, args, envs, start_method, logs_specs, log_line_prefixes, numa_options,
            duplicate_stdout_filters, duplicate_stderr_filters,
        )
    try:
        context.start()
    except BaseException:
        context.close()
        raise
    return context
