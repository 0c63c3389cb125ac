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
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

TORCHLESS = False

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that asks the kernel to SIGKILL the child when
    the calling thread's process dies (the thread must live as long as the child: the signal
    follows the thread that forked); None where the kernel has no such request."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # (here: the store server's process imports this module and needs no ctypes)

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child() -> None:  # runs between fork and exec: nothing here may take a lock
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return child


def die_with(parent: int | None) -> None:
    """In a child already running Python (a ``multiprocessing`` process): ask the kernel to
    SIGKILL this process when the thread that started it dies, and exit at once if
    ``parent`` (its expected parent's pid; None: not checked) is gone already. Nothing where
    the kernel has no such request."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


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
