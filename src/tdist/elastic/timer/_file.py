"""Timers over a named pipe: ``FileTimerServer`` (the launcher's, with
``TORCHELASTIC_ENABLE_FILE_TIMER=1``) and ``FileTimerClient`` (a worker's, at
``TORCHELASTIC_TIMER_FILE``).

Theory of operation. The server makes a FIFO at its path (mode 0600: only its user may write
to it) and holds both ends open: the read end, non-blocking, which its watchdog polls, and a
write end of its own, so that the read end never sees end-of-file when clients come and go
(torch's server reads EOF between clients and sleeps) and so that ``stop()`` can wake it. A
client opens the FIFO for writing without blocking (no reader: the server is not there, and
the request fails after a short retry instead of hanging), writes one JSON line of at most
``PIPE_BUF`` bytes (the kernel writes it whole, never interleaved with another client's), and
closes it. The wire format is torch's: ``{"version": 1, "pid", "scope_id", "expiration_time",
"signal"}``, so torch's clients and ours talk to either server.

A worker whose timer expired gets the signal of its earliest expired timer that has one
(``signal <= 0``: the timer is dropped and the worker left alone). Torch's server then also
sends that signal to its own process (the agent: the whole node goes down); this one does not,
and its owner (tdist's launcher) sees a worker killed by a signal and treats it as a failure.

Nothing is left behind: ``stop()`` (and ``run_once()``) close both ends and remove the FIFO,
and a server that is dropped without being stopped does the same when it is collected or the
interpreter exits; a FIFO of an earlier server at the same path is replaced, as torch's is.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import signal as signal_module
import stat
import threading
import time
import weakref
from collections.abc import Callable

from ._api import TimerClient, TimerRequest
from .debug_info_logging import log_debug_info_for_expired_timers

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer"]

log = logging.getLogger(__name__)

_SEND_TIMEOUT = 1.0  # seconds a client tries to reach a server that is not reading (yet)
_RETRY_EVERY = 0.05  # seconds between two tries to open the FIFO or write to a full one
_STOP_GRACE = 1.0  # seconds ``stop()`` waits for the watchdog beyond its wake-up
_READ_CHUNK = 1 << 16
_MAX_PENDING = 1 << 20  # bytes of a line without its end before the server drops it


class FileTimerRequest(TimerRequest):
    """A request of the file-based timers: the worker is a pid, and ``signal`` is what the
    server sends it on expiry (``0`` or less: nothing; a release carries 0).

    Args:
        worker_pid: the worker's process id.
        scope_id: which of its timers.
        expiration_time: seconds since the epoch; negative releases the timer.
        signal: the signal that reaps the worker.
    """

    __slots__ = ("signal", "version")

    def __init__(self, worker_pid: int, scope_id: str, expiration_time: float, signal: int = 0) -> None:
        super().__init__(worker_id=worker_pid, scope_id=scope_id, expiration_time=expiration_time)
        self.version = 1
        self.signal = signal

    @property
    def worker_pid(self) -> int:
        """The worker's process id."""
        return int(self.worker_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileTimerRequest):
            return False
        return super().__eq__(other) and (self.version, self.signal) == (other.version, other.signal)

    def __repr__(self) -> str:
        return (
            f"FileTimerRequest(worker_pid={self.worker_id!r}, scope_id={self.scope_id!r}, "
            f"expiration_time={self.expiration_time!r}, signal={self.signal!r})"
        )

    def to_json(self) -> str:
        """The request as torch's wire format, one JSON object."""
        return json.dumps({
            "version": self.version,
            "pid": self.worker_pid,
            "scope_id": self.scope_id,
            "expiration_time": self.expiration_time,
            "signal": self.signal,
        })


class FileTimerClient(TimerClient):
    """The client of a ``FileTimerServer`` of this host, through its named pipe; the worker is
    this process's pid. Several clients (processes, threads) may share one server.

    Args:
        file_path: the FIFO the server made.
        signal: what the server sends this process when one of its timers expires (SIGKILL;
            0 or less: the timer expires without reaping it).
    """

    def __init__(self, file_path: str, signal: int = signal_module.SIGKILL) -> None:
        super().__init__()
        self._file_path = file_path
        self.signal = signal

    def _open(self, deadline: float) -> int:
        """The FIFO's write end, opened without blocking; retried until ``deadline`` while no
        server reads it (it may be starting).

        Raises:
            BrokenPipeError: no server read the FIFO by ``deadline``, or the path is no FIFO.
        """
        while True:
            try:
                fd = os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                # ENXIO: a FIFO with no reader; ENOENT: not made yet (or removed at the end)
                retry = exc.errno in (errno.ENXIO, errno.ENOENT)
                if not retry or time.monotonic() >= deadline:
                    raise BrokenPipeError(
                        f"Could not send the FileTimerRequest because FileTimerServer is not available "
                        f"at {self._file_path}: {exc.strerror}"
                    ) from exc
                time.sleep(min(_RETRY_EVERY, max(0.0, deadline - time.monotonic())))
                continue
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                raise BrokenPipeError(f"{self._file_path} is not a FileTimerServer's named pipe (not a FIFO)")
            return fd

    def _send_request(self, request: FileTimerRequest) -> None:
        """Write ``request`` to the server, whole, within ``_SEND_TIMEOUT`` seconds.

        Raises:
            RuntimeError: the request is longer than ``PIPE_BUF`` (it could not be written whole).
            BrokenPipeError: the server is not there, or did not read for ``_SEND_TIMEOUT`` s.
        """
        data = (request.to_json() + "\n").encode()
        if len(data) > select.PIPE_BUF:
            raise RuntimeError(
                f"FileTimerRequest larger than {select.PIPE_BUF} bytes is not supported "
                f"(scope {request.scope_id[:80]!r}...: {len(data)} bytes)"
            )
        deadline = time.monotonic() + _SEND_TIMEOUT
        fd = self._open(deadline)
        try:
            while True:
                try:
                    os.write(fd, data)  # (at most PIPE_BUF: all of it or nothing)
                    return
                except BlockingIOError as exc:  # the pipe is full: the server is behind
                    if time.monotonic() >= deadline:
                        raise BrokenPipeError(
                            f"FileTimerServer at {self._file_path} did not read its pipe for {_SEND_TIMEOUT:g} s"
                        ) from exc
                    time.sleep(_RETRY_EVERY)
                except BrokenPipeError as exc:  # (the server closed it between open and write)
                    raise BrokenPipeError(f"FileTimerServer at {self._file_path} went away") from exc
        finally:
            os.close(fd)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm the timer ``scope_id`` of this process.

        Raises:
            BrokenPipeError: the server is not there.
        """
        self._send_request(FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        """Disarm the timer ``scope_id`` of this process.

        Raises:
            BrokenPipeError: the server is not there.
        """
        self._send_request(FileTimerRequest(os.getpid(), scope_id, -1, 0))


def _close_and_remove(fds: list[int], path: str, ident: tuple[int, int]) -> None:
    """Close the server's ends of its FIFO and remove it, if the path is still that FIFO (a
    later server may have replaced it)."""
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)


class FileTimerServer:
    """Watches the timers of this host's workers, which send them through a named pipe, and
    signals a worker whose timer expired.

    Args:
        file_path: where to make the FIFO (an existing file there is replaced).
        run_id: the job's id, for the log.
        max_interval: the most seconds between two looks at the timers (the watchdog also
            wakes when a request comes and when the earliest timer expires).
        daemon: whether the watchdog thread is a daemon thread.
        log_event: called with ``"watchdog started"``, ``"watchdog stopped"``, ``"timer
            expired"`` and ``"kill worker process"``, and the request concerned (or None),
            from the watchdog thread for the last two.

    Raises:
        OSError: the FIFO could not be made or opened.
    """

    def __init__(
        self,
        file_path: str,
        run_id: str,
        max_interval: float = 10,
        daemon: bool = True,
        log_event: Callable[[str, FileTimerRequest | None], None] | None = None,
    ) -> None:
        self._file_path = file_path
        self._run_id = run_id
        self._max_interval = max_interval
        self._daemon = daemon
        self._timers: dict[tuple[int, str], FileTimerRequest] = {}
        self._stop_event = threading.Event()
        self._run_once = False
        self._watchdog_thread: threading.Thread | None = None
        self._is_client_started = False
        self._request_count = 0  # (requests registered: torch's tests read it)
        self._log_event = log_event if log_event is not None else (lambda name, request: None)
        self._last_progress_time = int(time.time())
        self._pending = b""  # (the start of a line whose end has not come yet)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file_path)
        os.mkfifo(file_path, 0o600)
        st = os.lstat(file_path)
        self._fds: list[int] = []
        self._cleanup = weakref.finalize(self, _close_and_remove, self._fds, file_path, (st.st_dev, st.st_ino))
        try:
            # the read end first (a write end opened without blocking needs a reader)
            self._read_fd = os.open(file_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._fds.append(self._read_fd)
            self._write_fd = os.open(file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._fds.append(self._write_fd)
        except OSError:
            self._cleanup()
            raise

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the watchdog thread (returns at once)."""
        log.info(
            "starting FileTimerServer at %s (run %s, max_interval=%s, daemon=%s)",
            self._file_path, self._run_id, self._max_interval, self._daemon,
        )
        self._watchdog_thread = threading.Thread(
            target=self._watchdog_loop, name="tdist-FileTimerServer", daemon=self._daemon
        )
        self._watchdog_thread.start()
        self._emit("watchdog started", None)

    def stop(self) -> None:
        """Stop the watchdog (waiting a bounded time for it) and remove the FIFO."""
        log.info("stopping FileTimerServer at %s", self._file_path)
        self._stop_event.set()
        self._join(self._max_interval + _STOP_GRACE)
        self._cleanup()
        self._emit("watchdog stopped", None)

    def run_once(self) -> None:
        """Handle every request written so far, reap what expired, then stop as ``stop()``
        does (without a thread: one pass here)."""
        self._run_once = True
        if self._watchdog_thread is None and self._cleanup.alive:
            self._run_watchdog()
        self._join(None)
        self._cleanup()

    def _join(self, timeout: float | None) -> None:
        thread, self._watchdog_thread = self._watchdog_thread, None
        if thread is None:
            return
        self._wake()
        thread.join(self._max_interval * 4 + _STOP_GRACE if timeout is None else timeout)
        if thread.is_alive():
            log.warning("FileTimerServer at %s: the watchdog thread did not stop in time", self._file_path)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # (full: it has data to wake on anyway)
            os.write(self._write_fd, b"\n")  # (an empty line: no request)

    def _emit(self, name: str, request: FileTimerRequest | None) -> None:
        try:
            self._log_event(name, request)
        except Exception:
            log.exception("FileTimerServer: log_event(%r) raised", name)

    def _watchdog_loop(self) -> None:
        self._is_client_started = True
        while not self._stop_event.is_set():
            once = self._run_once
            try:
                self._run_watchdog()
            except Exception:
                log.exception("FileTimerServer at %s: a watchdog pass failed", self._file_path)
                self._stop_event.wait(min(self._max_interval, _STOP_GRACE))  # (no busy loop)
            if once:
                break
            self._last_progress_time = int(time.time())

    def _run_watchdog(self) -> None:
        """One pass: read the requests that came (waiting for one at most until the earliest
        timer expires or ``max_interval`` passes), then reap the workers whose timers expired."""
        self.register_timers(self._get_requests(0.0 if self._run_once else self._wait_time()))
        expired = self.get_expired_timers(time.time())
        log_debug_info_for_expired_timers(
            self._run_id, {pid: [t.to_json() for t in timers] for pid, timers in expired.items()}
        )
        reaped: set[int] = set()
        for pid, timers in expired.items():
            timers.sort(key=lambda t: t.expiration_time)
            chosen = None
            for t in timers:
                self._emit("timer expired", t)
                if t.signal > 0:
                    chosen = t
                    break
            if chosen is None:
                log.info("worker pid %d: expired timers %s carry no signal: not reaped", pid, [t.scope_id for t in timers])
                reaped.add(pid)
                continue
            log.info("worker pid %d: timers %s expired: sending signal %d", pid, [t.scope_id for t in timers], chosen.signal)
            if self._reap_worker(pid, chosen.signal):
                self._emit("kill worker process", chosen)
                reaped.add(pid)
            else:
                log.error("worker pid %d: could not signal it: trying again on the next pass", pid)
        self.clear_timers(reaped)

    def _wait_time(self) -> float:
        wait = self._max_interval
        earliest = min((t.expiration_time for t in self._timers.values()), default=None)
        if earliest is not None:
            wait = min(wait, max(0.0, earliest - time.time()))
        return wait

    def _get_requests(self, wait: float) -> list[FileTimerRequest]:
        """The requests in the pipe, waiting at most ``wait`` seconds for the first."""
        if not self._cleanup.alive:
            return []
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        poller.poll(max(0, int(wait * 1000 + 0.999)))
        chunks = [self._pending]
        while True:
            try:
                chunk = os.read(self._read_fd, _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:  # (cannot happen while our write end is open)
                break
            chunks.append(chunk)
        *lines, self._pending = b"".join(chunks).split(b"\n")
        if len(self._pending) > _MAX_PENDING:
            log.warning("FileTimerServer at %s: dropped %d bytes without a line end", self._file_path, len(self._pending))
            self._pending = b""
        requests = []
        for line in lines:
            if not line.strip():
                continue
            try:
                body = json.loads(line)
                requests.append(FileTimerRequest(
                    int(body["pid"]), str(body["scope_id"]), float(body["expiration_time"]), int(body["signal"]),
                ))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("FileTimerServer at %s: dropped a malformed request %r: %s", self._file_path, line[:200], exc)
        return requests

    # -- the table -----------------------------------------------------------------------------
    def register_timers(self, timer_requests: list[FileTimerRequest]) -> None:
        """Apply the requests: an acquire arms (or re-arms) the timer of its pid and scope, a
        release (a negative expiration time) disarms it."""
        for request in timer_requests:
            self._request_count += 1
            key = (request.worker_pid, request.scope_id)
            if request.expiration_time < 0:
                self._timers.pop(key, None)
            else:
                self._timers[key] = request

    def clear_timers(self, worker_pids: set[int]) -> None:
        """Forget the timers of ``worker_pids`` and of processes that are gone."""
        for key in list(self._timers):
            if key[0] in worker_pids or not self.is_process_running(key[0]):
                del self._timers[key]

    def get_expired_timers(self, deadline: float) -> dict[int, list[FileTimerRequest]]:
        """The timers expiring at or before ``deadline`` (seconds since the epoch), by pid."""
        expired: dict[int, list[FileTimerRequest]] = {}
        for request in self._timers.values():
            if request.expiration_time <= deadline:
                expired.setdefault(request.worker_pid, []).append(request)
        return expired

    @staticmethod
    def is_process_running(pid: int) -> bool:
        """Whether process ``pid`` exists."""
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # (it exists, another user's)
            return True
        return True

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        """Send ``signal`` to ``worker_pid``. Returns whether it is done with (False: try again)."""
        if worker_pid <= 0:  # (os.kill would signal a process group, or every process)
            log.error("FileTimerServer at %s: a request named pid %d: not signalled", self._file_path, worker_pid)
            return True
        try:
            os.kill(worker_pid, signal)
        except ProcessLookupError:
            log.info("worker pid %d is gone already", worker_pid)
        except Exception:
            log.exception("could not send signal %d to worker pid %d", signal, worker_pid)
            return False
        return True

    def get_last_progress_time(self) -> int:
        """When the watchdog last finished a pass (seconds since the epoch; now, if it has not
        started)."""
        return self._last_progress_time if self._is_client_started else int(time.time())
