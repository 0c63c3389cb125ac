"""The callee's profiler events of a profiled RPC, in the caller's profile, as torch shows them.

Theory of operation. Under torch's legacy autograd profiler, ``rpc_sync``/``rpc_async`` send
``ProfiledCall(func, key)`` instead of ``func``: the callee runs the function under a legacy
profiler of its own and returns ``Profiled(value, events, started)``, the events as plain
tuples with times from its profile's start and ``started`` on ``time.perf_counter`` (one clock
for every process of a host). The caller takes the value and keeps the events (``keep``); when
its profile ends, torch parses its own records, and ``_parse_legacy_records``, wrapped here,
adds each kept batch as remote events (``is_remote``, the callee's ``node_id``, named
``<key>#remote_op: <op>``), placed in the caller's range of that call (``key``), as torch
places them. Batches that no range of the ending profile claims are dropped.

A ``remote()``'s events come back with the reply to the ``remote()`` itself (the owner keeps
the value). Not profiled this way (torch's events for them are not produced): calls inside a
distributed autograd context, ``async_execution`` functions, a ``remote()`` to this worker, and
a callee thread that runs a profiler already (a server-side profile).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd import profiler_legacy

__all__ = ["Profiled", "ProfiledCall", "keep", "keep_on", "unwrap"]

log = logging.getLogger(__name__)
_lock = threading.Lock()
_batches: list[tuple[str, float, Any]] = []  # (key, when the caller sent it, Profiled)
_installed = False


class Profiled:
    """A profiled call's result: its value and the callee's events."""

    __slots__ = ("events", "node", "started", "value")

    def __init__(self, value: Any, events: list[tuple[str, float, float, int, Any]], started: float, node: int) -> None:
        self.value = value
        self.events = events
        self.started = started
        self.node = node

    def __reduce__(self) -> Any:
        return (Profiled, (self.value, self.events, self.started, self.node))


class ProfiledCall:
    """``func`` to run under a legacy profiler on the callee (see the module docstring)."""

    __slots__ = ("func", "key")

    def __init__(self, func: Any, key: str) -> None:
        self.func = func
        self.key = key

    def __reduce__(self) -> Any:
        return (ProfiledCall, (self.func, self.key))

    def __call__(self, *args: Any, **kwargs: Any) -> Profiled:
        from ._agent import current_agent
        from ._execution import run_user_function

        agent = current_agent(required=False)
        node = agent.rank if agent is not None else -1
        if torch._C._autograd._profiler_enabled():  # a profiler runs here already
            return Profiled(run_user_function(self.func, args, kwargs)[1], [], 0.0, node)
        started = time.perf_counter()
        with profiler_legacy.profile() as prof:  # type: ignore[no-untyped-call]
            value = run_user_function(self.func, args, kwargs)[1]
        # (the events' names, times from the profile's start, threads and input shapes)
        events = [(e.name, e.time_range.start, e.time_range.end, e.thread, e.input_shapes) for e in prof.function_events]
        return Profiled(value, events, started, node)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Torch ops run here are not recorded (this thread's record functions are off): the
    caller's profile shows the call's range, not the ops tdist's own serialization runs
    (``aten::detach``, ``aten::lift_fresh``...), which torch's C++ does without recording."""
    depth = getattr(_unrecorded, "depth", 0)
    if depth == 0:
        torch._C._autograd._enable_record_function(False)
    _unrecorded.depth = depth + 1
    try:
        yield
    finally:
        _unrecorded.depth = depth
        if depth == 0:  # (the outermost turns them back on)
            torch._C._autograd._enable_record_function(True)


_unrecorded = threading.local()  # how deep this thread is inside unrecorded()


def keep(key: str, sent: float, result: Any) -> Any:
    """The value of a profiled call's result; its events wait for the caller's profile."""
    if not isinstance(result, Profiled):
        return result
    if result.events:
        _install()
        with _lock:
            _batches.append((key, sent, result))
    return result.value


def keep_on(fut: Any, key: str, sent: float) -> None:
    """``keep`` the events that a ``remote()``'s creation reply (``fut``) brings."""

    def done(f: Any) -> None:
        try:
            value = f.value()  # (the agent's light future: its value, or its error raised)
        except BaseException:
            return
        keep(key, sent, value)

    if fut is not None:
        fut.add_done_callback(done)


def unwrap(key: str, sent: float) -> Any:
    """``keep`` for a future's value (``rpc_async``)."""
    return lambda value: keep(key, sent, value)


def _install() -> None:
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        parse = profiler_legacy._parse_legacy_records

        def parse_with_remote_events(thread_records: Any) -> Any:
            events = parse(thread_records)  # type: ignore[no-untyped-call]
            try:
                _add_remote_events(events)
            except Exception:  # never cost the user their profile: only the remote events go
                log.debug("could not add the remote profiler events", exc_info=True)
            return events

        profiler_legacy._parse_legacy_records = parse_with_remote_events
        _installed = True


def _add_remote_events(events: list[Any]) -> None:
    from torch.autograd.profiler_util import FunctionEvent

    with _lock:
        batches = sorted(_batches, key=lambda b: b[1])
        _batches.clear()
    if not batches:
        return
    ranges: dict[str, list[Any]] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if "#" in e.name and not e.is_remote:
            ranges.setdefault(e.name, []).append(e)
    next_id = max((e.id for e in events), default=0) + 1
    added = []
    for key, sent, res in batches:
        candidates = ranges.get(key)
        if not candidates:
            continue
        caller = candidates.pop(0)
        lo, hi = caller.time_range.start, caller.time_range.end
        base = min(max(lo + (res.started - sent) * 1e6, lo), hi)
        for name, start, end, thread, shapes in res.events:
            s = min(base + start, hi)
            added.append(
                FunctionEvent(  # type: ignore[no-untyped-call]
                    id=next_id,
                    name=f"{key}#remote_op: {name}",
                    thread=thread,
                    start_us=s,
                    end_us=max(s, min(base + end, hi)),
                    input_shapes=shapes,
                    stack=[],
                    is_remote=True,
                    node_id=res.node,
                    is_legacy=True,
                )
            )
            next_id += 1
    events.extend(added)
