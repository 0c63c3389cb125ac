"""What kind of process this is, and the processes tdist starts.

``TORCHLESS`` is set by the ``tdist`` command (``tdist.cli.console_main``) before it imports
anything else of tdist: the launcher and the store server run no user code and handle no tensor,
so they skip importing torch, which costs about two seconds of CPU at every ``tdist run`` (before
any worker starts). In such a process, tdist's errors derive from stand-ins shaped like torch's
exception tree instead of torch's classes. Nothing else changes, and a process that imports
torch anyway (``"torch" in sys.modules`` when ``tdist._core.errors`` is first imported) keeps
torch's classes.

``die_with_parent`` makes a child that tdist starts (a worker of ``tdist run``, a store
server) die with the process that started it, even when that one is killed with SIGKILL and
runs no cleanup: Linux's parent-death signal (``PR_SET_PDEATHSIG``).

``spawn`` starts a helper process of tdist's own (a store server, the job reaper) from any
thread, safely while another thread forks (see there).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Sequence

TORCHLESS = False

_PR_SET_PDEATHSIG = 1


@functools.cache
def prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up once per process (None off Linux). A process that forks
    looks it up first, so that its forked child neither imports nor ``dlopen``s: another thread
    of the parent may have held the loader's lock at the fork, which the child would wait on
    for good."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # (here: the store server's process imports this module and needs no ctypes)

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that asks the kernel to SIGKILL the child when
    the calling thread's process dies (the thread must live as long as the child: the signal
    follows the thread that forked); None where the kernel has no such request."""
    call = prctl()
    if call is None:
        return None
    parent = os.getpid()

    def child() -> None:  # runs between fork and exec: nothing here may take a lock
        call(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return child


def die_with(parent: int | None) -> None:
    """In a child already running Python (a ``multiprocessing`` process): ask the kernel to
    SIGKILL this process when the thread that started it dies, and exit at once if
    ``parent`` (its expected parent's pid; None: not checked) is gone already. Nothing where
    the kernel has no such request. (A forking parent calls ``prctl()`` first.)"""
    call = prctl()
    if call is None:
        return
    call(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name, from the state letter on
    (``[0]``: the state, ``[11]``/``[12]``: user and system CPU time in clock ticks, of every
    thread), or None where there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 1 :].decode(errors="replace").split() or None


_PID_SPACE: list[str] = []


def pid_space() -> str:
    """This process's pid namespace on this boot of this machine (``"<boot id>|<inode>"``): a
    process of an equal one is seen by its pid in this process's ``/proc``, and only then (a
    host name is no proof: containers may share one, each with pids of its own). Read once."""
    if not _PID_SPACE:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                boot = f.read().decode(errors="replace").strip()
            _PID_SPACE.append(f"{boot}|{os.stat('/proc/self/ns/pid').st_ino}")
        except OSError:
            _PID_SPACE.append("")  # (no /proc: nothing is known of other processes)
    return _PID_SPACE[0]


def gone_here(pid: int, space: str) -> str | None:
    """Why process ``pid`` of pid space ``space`` (``pid_space()`` where it ran) is known to
    have exited, or None: where ``space`` is not this process's, or the process runs (or
    cannot be looked at)."""
    if not space or space != pid_space() or pid <= 0 or pid == os.getpid():
        return None
    return None if pid_alive(pid) else f"its process, pid {pid}, has exited"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid space) still runs: an exited one not yet reaped by
    its parent (a zombie) does not; a process of another user's does."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] not in (b"Z", b"X")


class Spawned:
    """A child started by ``spawn``, seen as ``subprocess.Popen`` shows one: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``kill``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._parent = os.getpid()  # (in a forked child, a copy of this is not its child)

    def __del__(self) -> None:
        # dropped while it may still run (a store server told to stop without waiting): kept
        # until it has exited and is reaped (by the next ``spawn``), as Popen keeps its own,
        # not left a zombie for as long as this process lives
        with contextlib.suppress(Exception):  # (at the interpreter's exit: nothing to keep)
            if self.returncode is None and self._parent == os.getpid() and self.poll() is None:
                _unreaped.append(self)

    def poll(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored): as Popen says
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit, at most ``timeout`` seconds (``subprocess.TimeoutExpired``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pidfd = -1
        with contextlib.suppress(OSError):
            pidfd = os.pidfd_open(self.pid)  # (readable once it has exited)
        try:
            pause = 0.0005
            while (code := self.poll()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    import subprocess

                    raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
                if pidfd >= 0:
                    ready = select.poll()
                    ready.register(pidfd, select.POLLIN)
                    ready.poll(None if left is None else max(1, int(left * 1000)))
                else:  # (no pidfd: a kernel before 5.3)
                    time.sleep(pause if left is None else min(pause, left))
                    pause = min(pause * 2, 0.05)
            return code
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL it, unless it has exited already (and been reaped: its pid may be another's)."""
        if self.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


def spawn(argv: Sequence[str], *, pass_fds: Sequence[int] = (), new_session: bool = False) -> Spawned:
    """Start ``argv`` (``argv[0]`` a path, or a name looked up in ``PATH``), its stdin and
    stdout on ``/dev/null``, stderr this process's, with the descriptors ``pass_fds`` (at their
    numbers); ``new_session``: in a session of its own. Raises ``OSError`` if it cannot start.

    Not ``subprocess.Popen``: Popen waits for its child's exec on a pipe whose write end the
    child holds until then, and a process forked meanwhile by another thread of this one (a
    ``multiprocessing`` child, a forked rank) holds a copy of that end for as long as it lives:
    Popen then waits for that process to exit. A store server whose thread started its own
    process as the test harness forked the ranks that use it waited so, and its clients with it,
    until their timeouts. ``posix_spawn`` has no such pipe (the parent's thread is suspended
    until the child has exec'd). The child gets every descriptor that is inheritable here (as a
    ``close_fds=False`` Popen's does): the program it runs closes the ones it does not know
    (``close_other_fds``).
    """
    actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
    ]
    # a descriptor duplicated onto itself loses its close-on-exec flag (glibc 2.29 and later,
    # as POSIX now says): the child keeps it, no other process started meanwhile gets it
    actions += [(os.POSIX_SPAWN_DUP2, fd, fd) for fd in pass_fds]
    start = os.posix_spawn if os.sep in argv[0] else os.posix_spawnp
    for old in list(_unreaped):  # (those dropped earlier that have exited meanwhile)
        if old.poll() is not None:
            _unreaped.remove(old)
    pid = start(
        argv[0], list(argv), os.environ, file_actions=actions, setsid=new_session,
        setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),  # (as Popen's restore_signals)
    )
    return Spawned(pid)


_unreaped: list[Spawned] = []


def close_other_fds(keep: Sequence[int]) -> None:
    """In a process that ``spawn`` started: close every descriptor above 2 but ``keep``'s (what
    was inheritable in its parent: descriptors made by ``os.dup2``, or by C libraries)."""
    low = 3
    for fd in sorted({fd for fd in keep if fd >= 3}):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
