"""What runs beside an arena, and what arenas of earlier versions left behind.

Each rank's heartbeat thread (``_heartbeat_loop``) writes ``time.monotonic()`` into its control
block every third of ``heartbeat_interval`` (a stopped process stops beating: see ``_core``,
Failures) and, after its first beat, faults the mapping in (``_prefault``), so that forming the
group does not wait for it. ``_release`` stops it and closes an arena's descriptors, from
``close`` or from the finalizer of an arena dropped without it. ``cleanup_stale`` removes the
``/dev/shm`` files of arenas of earlier tdist versions whose creator is gone; the first
prefault of a process runs it, after the group has formed.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
import time

from ..._core._process import pid_alive

__all__ = ["cleanup_stale"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_CREATOR = re.compile(r"(\d+)-")
_cleaned = False  # (``cleanup_stale`` ran in this process)


def cleanup_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's ``tdist-`` files in ``directory`` whose creator process is gone.

    Best effort: files of live processes, of other users and unreadable entries are left
    alone. Returns the paths removed.
    """
    prefix = f"tdist-{os.getuid()}-"
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for entry in names:
        if not entry.startswith(prefix):
            continue
        m = _CREATOR.match(entry[len(prefix):])
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, entry)
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    if removed:
        log.info("removed %s stale shared-memory file(s): %s", len(removed), removed)
    return removed


def _release(stop: threading.Event, fds: list[int]) -> None:
    stop.set()
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


def _heartbeat_loop(
    words: memoryview[float], index: int, interval: float, stop: threading.Event, mm: mmap.mmap | None = None
) -> None:
    # references no arena, so that a forgotten arena can still be collected
    while True:
        words[index] = time.monotonic()
        if stop.wait(interval):
            return
        if mm is not None:  # (after the first beat: the group forms without waiting for it)
            _prefault(mm, stop)
            mm = None


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # (Linux 5.14; Python 3.13 names it)
_PREFAULT_CHUNK = 256 << 10  # (about 0.1 ms with the GIL held, then the others' turn)


def _prefault(mm: mmap.mmap, stop: threading.Event) -> None:
    """Fault every page of ``mm`` in for writing, a chunk at a time (each madvise holds the
    GIL for a fraction of a millisecond), unless ``stop`` is set; where the kernel has no
    MADV_POPULATE_WRITE, pages fault in on first use instead. The first call of a process
    also removes what arenas of earlier tdist versions left (``cleanup_stale``)."""
    global _cleaned
    if not _cleaned:
        _cleaned = True
        cleanup_stale()
    with contextlib.suppress(OSError, ValueError):
        for start in range(0, len(mm), _PREFAULT_CHUNK):
            if stop.is_set():
                return
            mm.madvise(_MADV_POPULATE_WRITE, start, min(_PREFAULT_CHUNK, len(mm) - start))
            time.sleep(0)
