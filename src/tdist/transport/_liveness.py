"""One liveness mechanism for both transports: heartbeats on quiet connections, and the silence
after which a peer counts as stalled.

Theory of operation. Every connection (a process group's ``_Peer``, RPC's ``_Conn``) is a
``_link.Link``: it knows when it last received (``last_rx``) and sent (``last_tx``) anything.
Every half ``interval`` a round runs (``Heartbeats.round``: in the messenger, on a thread of its
own; in a process group's endpoint, on its reader thread, between reads):

- a link quiet on the way out for half an interval gets a heartbeat frame, written without
  waiting (``MSG_DONTWAIT``) and only if its send lock is free: a link busy writing needs none.
  A socket with room for part of the frame takes that part; the rest is the link's ``tail``,
  which the link's next write (or heartbeat) sends first, so frames stay whole (a sealed frame
  has used its sequence number: it must leave whole even if none of it went);
- a link silent on the way in for more than ``stall_timeout`` is reported to ``on_stall``
  (RPC fails the connection there; process groups pass none: the operation waiting on the
  peer checks ``silent_for`` itself and names itself in the error);
- the owner's ``add_tick`` callbacks run (a shared-memory arena's heartbeat rides along);
- a thread that wakes much later than it asked (this process was stopped, or starved) first
  counts every link as just heard: the peers had no chance to be heard meanwhile, and must not
  be blamed for this process's own pause.

Busy is not stalled. A heartbeat needs the interpreter lock, so a peer inside one long call that
holds it (``sum(range(10**9))``, ``json.loads`` of a large document, a C extension that keeps
the lock) is silent as a stopped one. On this host the two are told apart: a silent peer whose
process used CPU time since the last look (``still_running``) is busy, and only the operation's
own timeout applies to it, as under torch. A peer on another host cannot be looked at: its
silence past the stall timeout is a stall.

Knobs: ``TDIST_HEARTBEAT_INTERVAL`` (1 s) and ``TDIST_HEARTBEAT_TIMEOUT`` (stall timeout; 10 s
for process groups, RPC's own default is 5 s).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

from .._core._process import proc_stat
from ._link import Link

__all__ = ["GROUP_STALL", "STALL_CAUSES", "Heartbeats", "default_interval", "default_stall_timeout", "still_running"]

GROUP_STALL = 10.0  # a process group's stall timeout unless TDIST_HEARTBEAT_TIMEOUT says


# what a peer's silence past the stall timeout may be, by whether it is of this host (its process
# uses no CPU: ``still_running`` said no) or not (nothing can be looked at)
STALL_CAUSES = {
    True: "stopped, or hung: its process uses no CPU",
    False: "stopped, hung, cut off, or inside one long call that holds its interpreter lock",
}

# (pid: its CPU ticks and when they were read, the last look that was compared with)
_cpu_seen: dict[int, tuple[int, float]] = {}
# seconds between the two looks compared: a busy process uses CPU ticks (10 ms) in it, even on
# a loaded host where it gets a fraction of a core
_LOOK_APART = 0.5


def still_running(pid: int) -> bool:
    """Whether process ``pid`` of this host, silent on its connections, is running all the same:
    it has used CPU time since an earlier look (a first look, and a look within ``_LOOK_APART``
    of it, cannot tell yet: yes). A stopped process (``SIGSTOP``, a debugger), one that has
    exited, and one that uses no CPU (a hang, a deadlock) are not; nor is this process itself
    (a peer in it is one of its threads, which tests run: its CPU time says nothing of it)."""
    if pid == os.getpid():
        return False
    fields = proc_stat(pid)
    if fields is None or len(fields) < 13 or fields[0] in ("T", "t", "Z", "X"):
        _cpu_seen.pop(pid, None)
        return False
    ticks, now = int(fields[11]) + int(fields[12]), time.monotonic()
    seen = _cpu_seen.get(pid)
    if seen is None:
        _cpu_seen[pid] = (ticks, now)
        return True
    if now - seen[1] < _LOOK_APART:
        return True
    _cpu_seen[pid] = (ticks, now)
    return ticks > seen[0]


def default_interval() -> float:
    """``TDIST_HEARTBEAT_INTERVAL``, seconds (1.0)."""
    return float(os.environ.get("TDIST_HEARTBEAT_INTERVAL", "1.0"))


def default_stall_timeout(fallback: float) -> float:
    """``TDIST_HEARTBEAT_TIMEOUT``, seconds (else ``fallback``)."""
    return float(os.environ.get("TDIST_HEARTBEAT_TIMEOUT", str(fallback)))


class Heartbeats:
    """The heartbeat rounds of one endpoint or messenger, on a thread of their own or the
    owner's (see the module docstring).

    Args:
        name: the thread's name.
        interval: seconds: no link stays quiet on the way out for longer.
        stall_timeout: seconds of silence after which ``on_stall`` hears of a link.
        links: the links to look after, asked on every round.
        dead: whether a link is past caring for (failed or closed).
        on_stall: ``on_stall(link, silent_seconds)``; ``None``: nobody is told.
    """

    def __init__(
        self,
        name: str,
        interval: float,
        stall_timeout: float,
        links: Callable[[], Iterable[Link]],
        dead: Callable[[Link], bool],
        on_stall: Callable[[Link, float], None] | None = None,
    ) -> None:
        self.interval = interval
        self.stall_timeout = stall_timeout
        self._links = links
        self._dead = dead
        self._on_stall = on_stall
        self._stop = threading.Event()
        self._ticks: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._last_round = time.monotonic()

    def add_tick(self, tick: Callable[[], None]) -> None:
        """Have ``tick()`` called on every round too (its errors are its own business: it must
        not raise), e.g. the heartbeat of the owner's shared-memory arena."""
        self._ticks.append(tick)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def period(self) -> float:
        """Seconds between rounds."""
        return min(self.interval, self.stall_timeout / 2) / 2

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.round(time.monotonic())

    def round(self, now: float) -> None:
        """One round (see the module docstring). Once started, this object's own thread runs
        one every ``period`` seconds; an owner with a loop of its own (the endpoint's reader)
        runs them there instead, and never starts the thread."""
        for tick in self._ticks:
            tick()
        paused = now - self._last_round > max(2 * self.interval, self.stall_timeout / 2)
        self._last_round = now
        for link in list(self._links()):
            if self._dead(link):
                continue
            if paused:
                link.last_rx = now  # (we were stopped ourselves: nobody had a chance to be heard)
                continue
            if self._on_stall is not None and now - link.last_rx > self.stall_timeout:
                self._on_stall(link, now - link.last_rx)
                continue
            if (link.tail or now - link.last_tx >= self.interval / 2) and link.send_lock.acquire(blocking=False):
                try:
                    self.beat(link, now)
                finally:
                    link.send_lock.release()

    def beat(self, link: Link, now: float) -> None:
        """Write a heartbeat on ``link`` without waiting (its send lock held)."""
        out = link.tail or link.heartbeat()
        try:
            sent = link.sock.send(out, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError, TimeoutError):  # full: data is moving, or the peer stalls
            sent = 0
        except OSError:  # (the reader reports the loss)
            return
        link.tail = out[sent:]
        if sent:
            link.last_tx = now
