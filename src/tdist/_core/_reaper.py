"""The job reaper: what a process's children started goes when that process is killed.

A child that tdist starts (a worker of ``tdist run``, a copy of ``start_processes``) runs in a
session of its own and carries the kernel's parent-death signal, so a launcher killed with
SIGKILL takes its children along. What those children started themselves (a ``subprocess``, a
forked data-loader process that ignores its parent) has no such tie: it is re-parented to init
and runs on. Nothing in the killed launcher can act then, so another process does.

Theory of operation. The first child a process starts through ``start_process`` also starts
that process's reaper: a small interpreter (this file run as a script, standard library only,
no site: some tens of milliseconds of one core, once) in a session of its own, so that a
signal to the launcher's process group (Ctrl-C, ``kill -9 -PGID``) does not reach it. It sleeps
in ``poll`` on a pidfd of its parent (readable once the parent exited) and on a pipe from it
that only the parent holds (closed in a forked child), and wakes on nothing else but:

- ``+<pid>``: a child was started, the leader of a session (its pidfd joins the poll; a leader
  that exited while the parent lived is dropped after a grace period, so that a pid used again
  later is never taken for it);
- ``rm:<path, hex>``: a file or directory of the parent's own (a launcher's temporary run
  directory, its entry in the host's registry of jobs) to remove once the job's processes are
  killed, should the parent die;
- ``done``: the parent ends in order (``atexit``); then it exits without touching anything, so
  a normal end, and the launcher's own SIGTERM/SIGINT handling, are as they were.

When the parent exits without ``done`` (SIGKILL, ``os._exit``, a fatal signal), it kills with
SIGKILL, in rounds until a scan of ``/proc`` finds none (a process forked meanwhile is found
by the next round; each round is bounded, and the whole by a few seconds), every process of
its user that

- is in the session of a child it was told of (what a worker started, whatever its process
  group), or
- carries this reaper's token in ``TDIST_JOB_TOKENS`` in its environment (every child gets it,
  and a descendant inherits it: one that made a session of its own is found this way), or
- descends from such a process, while its parent still runs.

The hard case left: a descendant that both made a session of its own and dropped the
environment variable is found only through its parent, so not once that parent is gone (a
worker's own such child: the worker died of its parent-death signal first). Each signal goes
through a pidfd opened after the scan and checked against the process's start time, so a pid
used again in between is not hit. Then it removes the paths it was given (the killed processes
wrote there until they died), and exits: it leaves nothing itself.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._process import Spawned

__all__ = ["TOKENS_ENV", "JobReaper", "job_reaper", "kill_marked", "with_token"]

TOKENS_ENV = "TDIST_JOB_TOKENS"  # the tokens of the reapers whose job a process belongs to, ":"-separated

_LEADER_GRACE = 2.0  # seconds a session is still reaped after its leader exited
_REAP_FOR = 5.0  # the most seconds the rounds of SIGKILL go on (a process stuck in the kernel)
_ROUND_PAUSE = 0.02  # seconds between rounds (killed processes leave the scan meanwhile)
_EXIT_WAIT = 5.0  # the most seconds the parent waits for its reaper to exit after ``done``

log = logging.getLogger(__name__)


# -- the parent's side ---------------------------------------------------------------------------
class JobReaper:
    """A process's reaper, seen from that process: mark a child's environment, report a child."""

    def __init__(self, proc: Spawned, fd: int, token: str) -> None:
        self.proc = proc
        self.token = token
        self._fd = fd
        self._lock = threading.Lock()

    def mark(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with this reaper's token added to ``TDIST_JOB_TOKENS`` (kept: a job that runs
        inside another one's worker belongs to both)."""
        return with_token(env, self.token)

    def watch(self, pid: int) -> bool:
        """Report child ``pid`` (a session leader). False if the reaper is gone."""
        return self._send(f"+{pid}\n".encode())

    def remove_on_kill(self, path: str) -> bool:
        """Have ``path`` (a file, or a directory and all it holds) removed if this process dies
        without its orderly end, after its job's processes are killed. False if the reaper
        is gone."""
        return self._send(b"rm:" + os.fsencode(os.path.abspath(path)).hex().encode() + b"\n")

    def _send(self, data: bytes) -> bool:
        with self._lock:
            if self._fd < 0:
                return False
            try:
                os.write(self._fd, data)  # (a few bytes: one write, never split)
            except OSError:
                return False
            return True

    def close(self) -> None:
        """The orderly end: ``done``, then wait (bounded) for the reaper to exit."""
        self._send(b"done\n")
        self._forget()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(_EXIT_WAIT)

    def _forget(self) -> None:
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1


def with_token(env: Mapping[str, str], token: str) -> dict[str, str]:
    """``env`` with ``token`` added to ``TDIST_JOB_TOKENS`` (the tokens there are kept)."""
    tokens = [t for t in env.get(TOKENS_ENV, "").split(":") if t and t != token]
    return {**env, TOKENS_ENV: ":".join([*tokens, token])}


def kill_marked(token: str) -> list[int]:
    """Kill, as a reaper does (SIGKILL, in rounds, bounded: ``reap``), every process of this
    user that carries ``token`` in ``TDIST_JOB_TOKENS`` (given to children with ``with_token``)
    and what descends from it. For a parent that is alive: what the children it stopped left
    running. Returns the pids the first scan found (none: nothing was left)."""
    return reap(set(), token.encode())


_reaper: JobReaper | None = None
_reaper_lock = threading.Lock()


def job_reaper() -> JobReaper | None:
    """This process's reaper, started at the first call (again if it died); None where there
    is none (not Linux, or it cannot start: logged)."""
    global _reaper
    if not sys.platform.startswith("linux"):
        return None
    with _reaper_lock:
        if _reaper is not None and _reaper.proc.poll() is None:
            return _reaper
        if _reaper is not None:
            log.warning("the job reaper (pid %d) exited with %s: starting another", _reaper.proc.pid, _reaper.proc.returncode)
            _reaper._forget()
            _reaper = None
        token = secrets.token_hex(8)
        r, w = os.pipe()  # (neither end inheritable: only the reaper gets r, by pass_fds)
        from ._process import spawn  # (here: this file also runs as a script, on its own)

        try:  # (not ``subprocess.Popen``: see ``spawn``)
            proc = spawn(
                [sys.executable or "python3", "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(r), token],
                pass_fds=(r,), new_session=True,
            )
        except OSError as exc:
            os.close(w)
            log.warning("cannot start the job reaper (what the children start may outlive a kill -9): %s", exc)
            return None
        finally:
            os.close(r)
        _reaper = JobReaper(proc, w, token)
        return _reaper


@atexit.register
def _close_at_exit() -> None:
    global _reaper
    with _reaper_lock:
        reaper, _reaper = _reaper, None
    if reaper is not None:
        reaper.close()


def _after_fork_in_child() -> None:
    # a forked child must not hold the parent's end of the pipe (it is not the reaper's parent)
    global _reaper, _reaper_lock
    _reaper_lock = threading.Lock()
    if _reaper is not None:
        _reaper._lock = threading.Lock()
        _reaper._forget()
        _reaper = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the reaper's side ---------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """``pid``'s state, parent, session and start time, from ``/proc``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[1]), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _has_token(pid: int, key: bytes, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # (another user's, or gone)
        return False
    for entry in environ.split(b"\0"):
        if entry.startswith(key) and token in entry[len(key) :].split(b":"):
            return True
    return False


def _targets(sessions: set[int], token: bytes) -> dict[int, int]:
    """The processes to kill now, each with its start time (see the module)."""
    me, uid = os.getpid(), os.getuid()
    key = TOKENS_ENV.encode() + b"="
    procs: dict[int, tuple[str, int, int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None and st[0] not in ("Z", "X", "x"):
            procs[int(name)] = st
    found = set()
    for pid, (_, _, sid, _) in procs.items():
        if pid == me:
            continue
        if sid in sessions:
            found.add(pid)
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        if _has_token(pid, key, token):
            found.add(pid)
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child != me and child not in found:
                found.add(child)
                todo.append(child)
    return {pid: procs[pid][3] for pid in found}


def _kill(pid: int, started: int) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # (gone)
    except AttributeError:  # (no pidfds: the pid, checked just before)
        st = _stat(pid)
        if st is not None and st[3] == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        st = _stat(pid)
        if st is not None and st[3] == started:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def reap(sessions: set[int], token: bytes) -> list[int]:
    """Kill the job's processes (see the module), in rounds, for at most ``_REAP_FOR`` s.
    Returns the pids the first round found (none: there was nothing to kill)."""
    deadline = time.monotonic() + _REAP_FOR
    first: list[int] | None = None
    while True:
        targets = _targets(sessions, token)
        if first is None:
            first = sorted(targets)
        if not targets or time.monotonic() > deadline:
            return first
        for pid, started in targets.items():
            _kill(pid, started)
        time.sleep(_ROUND_PAUSE)


def _lead(leaders: dict[int, tuple[int | None, float | None]], pid: int) -> None:
    """Watch the session of child ``pid``: checked to be the leader of a session (a pid that
    was reaped, or used again, before this one heard of it is not)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except AttributeError:
        pidfd = None  # (no pidfds: kept as long as this runs)
    except OSError:
        return
    st = _stat(pid)
    if st is not None and st[0] in ("Z", "X", "x"):
        leaders[pid] = (pidfd, time.monotonic())
    elif st is not None and st[2] == pid:
        leaders[pid] = (pidfd, None)
    elif pidfd is not None:
        os.close(pidfd)


def _remove(paths: list[bytes]) -> None:
    """Remove each of ``paths`` (a directory with all it holds), whatever is already gone."""
    import shutil  # (only here: a reaper that reaps nothing never needs it)

    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def serve(parent: int, fd: int, token: bytes) -> None:
    """Watch ``parent`` (the process that started this one) and its messages on ``fd``."""
    try:
        parent_fd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):
        parent_fd = None
    leaders: dict[int, tuple[int | None, float | None]] = {}  # pid: its pidfd, when it exited
    paths: list[bytes] = []  # to remove after a reap (``rm:``)
    pending = b""
    done = False
    gone = os.getppid() != parent  # (it died before this one started: read what it sent, reap)
    os.set_blocking(fd, False)
    while True:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if parent_fd is not None:
            poller.register(parent_fd, select.POLLIN)
        for pidfd, exited in leaders.values():
            if pidfd is not None and exited is None:
                poller.register(pidfd, select.POLLIN)
        now = time.monotonic()
        expiries = [exited + _LEADER_GRACE - now for _, exited in leaders.values() if exited is not None]
        timeout = None if not expiries else max(0, int(min(expiries) * 1000) + 1)
        ready = {fd for fd, _ in poller.poll(0 if gone else timeout)}
        while True:  # (everything sent, even by a parent that is gone already)
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not data:
                gone = True
                break
            pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"done":
                done = True
            elif line.startswith(b"+") and line[1:].isdigit():
                _lead(leaders, int(line[1:]))
            elif line.startswith(b"rm:"):
                with contextlib.suppress(ValueError):
                    paths.append(bytes.fromhex(line[3:].decode("ascii")))
        if parent_fd is not None and parent_fd in ready:
            gone = True
        if gone:
            break
        now = time.monotonic()
        for pid, (pidfd, exited) in list(leaders.items()):
            if pidfd is not None and exited is None and pidfd in ready:
                leaders[pid] = (pidfd, now)
            elif exited is not None and now >= exited + _LEADER_GRACE:
                if pidfd is not None:
                    os.close(pidfd)
                del leaders[pid]
    if not done:
        reap(set(leaders), token)
        _remove(paths)


def main(argv: list[str]) -> int:
    fd = int(argv[2])  # (every other descriptor it got is its parent's business: ``spawn``)
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    serve(int(argv[1]), int(argv[2]), argv[3].encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
