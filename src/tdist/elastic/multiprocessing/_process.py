"""Child processes that go when their parent goes: start, watch, stop, and copy their output.

Shared by the launcher's agent (``tdist run``, ``elastic_launch``) and ``start_processes``.

Theory of operation. Every child runs in a session of its own, so that a signal to its process
group reaches whatever it started too, and carries the kernel's parent-death signal
(``die_with_parent``), so that a parent killed with SIGKILL, which runs no cleanup, takes its
children along; what the children started goes then too, killed by this process's reaper
(``tdist._core._reaper``: it is told of every child, whose environment carries its token). That signal follows the *thread* that forked, not the process: a child started
from a thread that ends before it would be killed with that thread. So a child is started from
the main thread, or else from one spawner thread that lives as long as the process (a daemon
thread, made again in a forked process, whose threads are not copied).

A child is watched through a pidfd (readable once it exited) in ``poll``, next to any other
descriptor the caller wakes on (a signal handler's pipe), so the parent sleeps until something
happens instead of checking on a period. Stopping sends each child's process group a signal,
waits until a deadline, sends SIGKILL, and waits again, bounded: a process stuck in an
uninterruptible sleep (a wedged device) cannot be reaped even by SIGKILL, and the caller must
not hang with it. A process is signalled only while it is not reaped (``Popen.returncode`` is
None), so its pid, and its group's id, cannot have been given to another process.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import IO, Any

from ..._core._process import die_with_parent
from ..._core._reaper import job_reaper
from ..._core.deadline import Clock

__all__ = ["copy_lines", "drain", "open_pidfd", "signal_session", "start_process", "stop_processes", "wait_any"]

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16  # the longest line copied at once (a longer one goes in pieces)
_PARTIAL_WAIT = 0.05  # seconds of quiet after which an incomplete line is shown (a prompt, a progress bar)
_POLL_FALLBACK = 0.05  # seconds between checks of a child without a pidfd (an old kernel)
_START_TIMEOUT = 60.0  # the most seconds the spawner thread may take to start a child
_KILL_WAIT = 10.0  # the most seconds to wait for children to go after SIGKILL

# the spawner thread's queue, with the pid of the process whose thread serves it
_spawner: tuple[int, queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], threading.Event]]] | None = None
_spawner_lock = threading.Lock()


def _serve(requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], threading.Event]]) -> None:
    while True:
        call, future, abandoned = requests.get()
        try:
            proc = call()
        except BaseException as exc:
            future.set_exception(exc)
            continue
        with _spawner_lock:  # (the caller gave up waiting: nobody owns the child, it goes)
            if abandoned.is_set():
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(_KILL_WAIT)
                continue
            future.set_result(proc)


def _from_spawner(call: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """Run ``call`` (it starts a child) in the process's spawner thread and return its child."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], threading.Event]] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(requests,), name="tdist-spawner", daemon=True).start()
            _spawner = (os.getpid(), requests)
        requests = _spawner[1]
    future: Future[subprocess.Popen[bytes]] = Future()
    abandoned = threading.Event()
    requests.put((call, future, abandoned))
    try:
        return future.result(_START_TIMEOUT)
    except TimeoutError:
        with _spawner_lock:
            if not future.done():
                abandoned.set()
                raise TimeoutError(f"a child process did not start within {_START_TIMEOUT:g} s") from None
        return future.result(0)


def start_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own that dies with this process (see the module).

    Args:
        argv: the program and its arguments.
        env: its whole environment.
        stdout, stderr: as ``subprocess.Popen``'s (None: this process's).
        pass_fds: descriptors it inherits.

    Returns:
        The child.

    Raises:
        OSError: it could not be started (no such program, not executable).
        TimeoutError: the spawner thread did not start it within a minute.
    """

    reaper = job_reaper()
    child_env = dict(env) if reaper is None else reaper.mark(env)

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(argv), env=child_env, stdout=stdout, stderr=stderr, start_new_session=True,
            preexec_fn=die_with_parent(), pass_fds=tuple(pass_fds),
        )

    proc = popen() if threading.current_thread() is threading.main_thread() else _from_spawner(popen)
    if reaper is not None and not reaper.watch(proc.pid):
        log.warning("the job reaper (pid %d) is gone: what process %d starts may outlive a kill -9 of this one",
                    reaper.proc.pid, proc.pid)
    return proc


def open_pidfd(proc: subprocess.Popen[bytes]) -> int | None:
    """A pidfd of ``proc``, readable once it exited; None if it was reaped or the kernel has
    none (then poll ``proc``)."""
    if proc.returncode is not None:
        return None
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None


def signal_session(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (its session's), unless ``proc`` was reaped."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def wait_any(fds: Iterable[int], timeout: float | None) -> None:
    """Block until one of ``fds`` (pidfds, a wake-up pipe) is readable or ``timeout`` seconds
    (None: no limit) passed. A signal handler that raises ends the wait with its exception."""
    poller = select.poll()  # (not select.select: descriptors may exceed FD_SETSIZE)
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999)))


def drain(fd: int) -> None:
    """Read whatever a non-blocking wake-up pipe holds (so that it blocks again)."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 256):
            pass


def _wait_for_exits(
    procs: Sequence[subprocess.Popen[bytes]],
    deadline: float,
    clock: Clock,
    wake_fd: int | None,
    cut_short: Callable[[], bool],
) -> None:
    """Wait until every one of ``procs`` exited (they are reaped), ``deadline`` passed, or
    ``cut_short()`` says so (checked after each wake-up)."""
    pidfds = {id(p): open_pidfd(p) for p in procs}
    try:
        while True:
            pending = [p for p in procs if p.poll() is None]
            remaining = deadline - clock()
            if not pending or remaining <= 0 or cut_short():
                return
            fds = [fd for p in pending if (fd := pidfds[id(p)]) is not None]
            if len(fds) < len(pending):
                remaining = min(remaining, _POLL_FALLBACK)
            wait_any([*fds, *([] if wake_fd is None else [wake_fd])], remaining)
            if wake_fd is not None:
                drain(wake_fd)
    finally:
        for fd in pidfds.values():
            if fd is not None:
                os.close(fd)


def stop_processes(
    procs: Sequence[subprocess.Popen[bytes]],
    sig: int,
    timeout: float,
    *,
    clock: Clock = time.monotonic,
    wake_fd: int | None = None,
    cut_short: Callable[[], bool] = lambda: False,
    describe: Callable[[subprocess.Popen[bytes]], str] = lambda p: f"process {p.pid}",
) -> list[subprocess.Popen[bytes]]:
    """Stop ``procs``: ``sig`` to each running one's process group, up to ``timeout`` seconds
    for them to exit (``cut_short()`` true after a wake-up of ``wake_fd``, a non-blocking pipe
    that is drained, ends that wait early), then SIGKILL to the rest and up to ten more seconds. Every one that exited is
    reaped.

    Returns:
        The children still there after SIGKILL (stuck in the kernel): abandoned, and logged.
    """
    for p in procs:
        signal_session(p, sig)
    start = clock()
    _wait_for_exits(procs, start + timeout, clock, wake_fd, cut_short)
    waited = clock() - start
    left = [p for p in procs if p.poll() is None]
    for p in left:
        if waited < timeout:  # (cut short: a second signal to the launcher)
            log.warning(
                "%s had not stopped %.1f s after %s, and the wait (up to %g s) was cut short: "
                "sending SIGKILL", describe(p), waited, signal.Signals(sig).name, timeout,
            )
        else:
            log.warning(
                "%s did not stop within %g s of %s: sending SIGKILL", describe(p), timeout, signal.Signals(sig).name
            )
        signal_session(p, signal.SIGKILL)
    _wait_for_exits(left, clock() + _KILL_WAIT, clock, None, lambda: False)
    stuck = [p for p in left if p.poll() is None]
    for p in stuck:
        log.error(
            "%s did not exit within %g s of SIGKILL (an uninterruptible sleep in the kernel, as on a "
            "wedged device?): abandoning it", describe(p), _KILL_WAIT,
        )
    return stuck


def copy_lines(
    stream: IO[bytes],
    file: IO[bytes] | None,
    on_line: Callable[[bytes], None] | None,
    on_partial: Callable[[bytes], None] | None = None,
) -> None:
    """Copy ``stream`` line by line until its end: to ``file`` as it is (a file that fails, a
    full disk, is given up with a warning) and to ``on_line``. Closes ``stream`` and ``file``.
    A thread's body: errors reading the stream end the copy quietly.

    ``on_partial`` (optional) is given the start of a line that is not complete yet when
    nothing more came for ``_PARTIAL_WAIT`` seconds: a prompt that waits for input (``pdb``'s
    ``(Pdb) ``, ``input()``'s), a progress bar redrawn with carriage returns. It gets the whole
    line so far each time (the line still goes to ``on_line`` and ``file`` once complete)."""
    try:
        if on_partial is None:
            while True:
                line = stream.readline(_READ_CHUNK)
                if not line:
                    break
                file = _copy_line(line, file, on_line)
            return
        fd, pending = stream.fileno(), b""
        more = select.poll()  # (not select.select: a launcher of many workers has descriptors past 1024)
        more.register(fd, select.POLLIN)
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except OSError as exc:  # (a pseudo-terminal's side, once the process closed its own: EIO)
                if exc.errno != errno.EIO:
                    raise
                chunk = b""
            if not chunk:
                break
            pending += chunk
            start = 0
            while (end := pending.find(b"\n", start)) >= 0 or len(pending) - start >= _READ_CHUNK:
                end = end + 1 if end >= 0 else start + _READ_CHUNK  # (a longer line goes in pieces)
                file = _copy_line(pending[start:end], file, on_line)
                start = end
            pending = pending[start:]
            if pending and not more.poll(_PARTIAL_WAIT * 1000):
                on_partial(pending)
        if pending:
            file = _copy_line(pending, file, on_line)
    except (OSError, ValueError):
        pass
    finally:
        stream.close()
        if file is not None:
            file.close()


def _copy_line(line: bytes, file: IO[bytes] | None, on_line: Callable[[bytes], None] | None) -> IO[bytes] | None:
    """``copy_lines``'s step: ``line`` to ``file`` and ``on_line``; the file, or None once it failed."""
    if file is not None:
        try:
            file.write(line)
        except OSError as exc:
            log.warning("cannot write a process's log file %s: %s", getattr(file, "name", "?"), exc)
            file.close()
            file = None
    if on_line is not None:
        on_line(line)
    return file
