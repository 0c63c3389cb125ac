"""Server-side profiling of every RPC request a worker runs
(``torch.distributed.rpc._server_process_global_profile``).

Theory of operation. While at least one such profile is entered in a process, the agent runs
each request it serves under a legacy autograd profiler of the serving thread
(``profiled_job``); the events of that request are added to every profile entered then. On exit
a profile holds them as ``function_events`` (an ``EventList``: ``key_averages()``, ``table()``),
as torch's does. It may be entered and left through RPCs on an RRef to it (torch's documented
use: ``rref = rpc.remote(w, rpc._server_process_global_profile)``,
``rref.rpc_sync().__enter__()``, ...).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.autograd import profiler_legacy
from torch.autograd.profiler_util import EventList

__all__: list[str] = []

_active: list[_server_process_global_profile] = []
_lock = threading.Lock()
_done = threading.Condition(_lock)  # (a profiled request's events are in)
_SETTLE = 5.0  # seconds a profile's exit waits for the requests it saw start


def profiled_job(job: Callable[[], None]) -> None:
    """Run a request's job, under a profiler when a server profile is entered (see above)."""
    if not _active:
        job()
        return
    me = threading.get_ident()
    with _lock:
        targets = list(_active)
        for p in targets:
            p._serving.add(me)
    try:
        with profiler_legacy.profile() as prof:  # type: ignore[no-untyped-call]
            job()
    finally:
        with _done:
            for p in targets:
                p._serving.discard(me)
                if p in _active:
                    p._events.extend(prof.function_events)
            _done.notify_all()


class _server_process_global_profile(profiler_legacy.profile):
    """A legacy autograd profile of every RPC request this process serves while it is entered
    (not of the entering thread's own work). Same arguments as
    ``torch.autograd.profiler_legacy.profile``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._events: list[Any] = []
        self._serving: set[int] = set()  # threads serving a request this profile sees

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        with _lock:
            self._events = []
            self._serving = set()
            _active.append(self)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        if not self.enabled:
            return False
        with _done:
            # the requests served meanwhile reply before their events are added: wait for
            # those still adding (the request that runs this exit aside)
            me = threading.get_ident()
            _done.wait_for(lambda: not self._serving - {me}, _SETTLE)
            if self in _active:
                _active.remove(self)
            events = sorted(self._events, key=lambda e: (e.time_range.start, -e.time_range.end))
            self._events = []
        self.process_global_function_events = events
        self.function_events = EventList(events, use_device="cuda" if self.use_cuda else None, profile_memory=self.profile_memory)  # type: ignore[no-untyped-call]
        # each request's events are a tree already, built when its own profile ended (building
        # it again would give events two parents)
        self.function_events._tree_built = True
        return False

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)  # (travels by RPC: its caller may call it on an RRef)
