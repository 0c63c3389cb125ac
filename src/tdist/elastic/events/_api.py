"""torchelastic's events: what happened to a job (a worker started, failed, a rendezvous round
closed), as JSON lines through Python logging.

Theory of operation. An ``Event`` (or a rendezvous's ``RdzvEvent``) serialises to one JSON
object. ``record(event, destination)`` logs that JSON at INFO on a logger of the destination's
own (``tdist-events-<destination>``, which does not propagate, so the program's logging
configuration never sees an event twice), whose one handler is the destination's
``get_logging_handler(destination)``: ``null`` (the default: dropped), ``console`` (stderr) or
``dynamic_rendezvous`` (null unless a program puts a handler there, in ``handlers._log_handlers``).
A rendezvous event is built only when its destination has a real handler, so by default an
event costs a dictionary look-up. The level of the events' loggers is ``LOGLEVEL`` (INFO), as
torch's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "Event",
    "EventMetadataValue",
    "EventSource",
    "NodeState",
    "RdzvEvent",
    "construct_and_record_rdzv_event",
    "get_logging_handler",
    "record",
    "record_rdzv_event",
]

EventMetadataValue = str | int | float | bool | None

# the destinations' handlers, by name (a program may replace one: torch's tests do)
_log_handlers: dict[str, logging.Handler] = {
    "console": logging.StreamHandler(),
    "dynamic_rendezvous": logging.NullHandler(),
    "null": logging.NullHandler(),
}
_events_loggers: dict[str, logging.Logger] = {}


class EventSource(str, Enum):  # noqa: UP042  (torch's bases: str() of a member is "EventSource.AGENT")
    """Who produced an event."""

    AGENT = "AGENT"
    WORKER = "WORKER"


class NodeState(str, Enum):  # noqa: UP042  (torch's bases)
    """Where a node is in a rendezvous."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class Event:
    """Something that happened in a job.

    Args:
        name: what (the launcher's: ``torchelastic.worker.status.<STATE>``).
        source: who produced it.
        timestamp: when, in milliseconds (0: not given).
        metadata: what else is known, JSON values.
    """

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.serialize()

    @staticmethod
    def deserialize(data: str | Event) -> Event:
        """The event that ``serialize`` wrote (an event is returned as it is).

        Raises:
            ValueError: ``data`` is not an event's JSON (``KeyError`` for an unknown source).
        """
        if isinstance(data, Event):
            return data
        body: dict[str, Any] = json.loads(data)
        body["source"] = EventSource[body["source"]]
        return Event(**body)

    def serialize(self) -> str:
        """The event as one JSON object."""
        return json.dumps(asdict(self))


@dataclass
class RdzvEvent:
    """Something that happened to a node in a rendezvous.

    Args:
        name: what (``<file>:<function>`` of the recorder, by default).
        run_id: the rendezvous's run id.
        message: what to say about it.
        hostname: the node's host.
        pid: the node's agent's process id.
        node_state: where the node is.
        master_endpoint: the rendezvous store's endpoint, if known.
        rank: the node's rank, if known.
        local_id: the node's local id in the rendezvous, if known.
        error_trace: the exception being handled, for a failure.
    """

    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: int | None = None
    local_id: int | None = None
    error_trace: str = ""

    def __str__(self) -> str:
        return self.serialize()

    @staticmethod
    def deserialize(data: str | RdzvEvent) -> RdzvEvent:
        """The event that ``serialize`` wrote (an event is returned as it is)."""
        if isinstance(data, RdzvEvent):
            return data
        body: dict[str, Any] = json.loads(data)
        body["node_state"] = NodeState[body["node_state"]]
        return RdzvEvent(**body)

    def serialize(self) -> str:
        """The event as one JSON object."""
        return json.dumps(asdict(self))


def get_logging_handler(destination: str = "null") -> logging.Handler:
    """The handler of ``destination`` (``null``, ``console``, ``dynamic_rendezvous``).

    Raises:
        KeyError: no such destination.
    """
    return _log_handlers[destination]


def _logger(destination: str) -> logging.Logger:
    found = _events_loggers.get(destination)
    if found is None or found.propagate or not found.handlers:
        # (made here; or reset since by a ``logging.config.dictConfig``, which gives existing
        # loggers back to their parents: set up again, so that no event reaches the program's logs)
        handler = get_logging_handler(destination)
        found = logging.getLogger(f"tdist-events-{destination}")
        found.setLevel(os.environ.get("LOGLEVEL", "INFO"))
        found.propagate = False
        if handler not in found.handlers:
            found.addHandler(handler)
        found = _events_loggers.setdefault(destination, found)
    return found


def record(event: Event, destination: str = "null") -> None:
    """Log ``event``'s JSON to ``destination``.

    Args:
        event: the event.
        destination: where (``null``: nowhere, ``console``: stderr).

    Raises:
        KeyError: no such destination.
    """
    _logger(destination).info(event.serialize())


def record_rdzv_event(event: RdzvEvent) -> None:
    """Log a rendezvous event's JSON to the ``dynamic_rendezvous`` destination."""
    _logger("dynamic_rendezvous").info(event.serialize())


def construct_and_record_rdzv_event(
    run_id: str,
    message: str,
    node_state: NodeState,
    name: str = "",
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
) -> None:
    """Build a rendezvous event and record it, if the ``dynamic_rendezvous`` destination has
    a handler that is not null (else this returns at once).

    Args:
        run_id: the rendezvous's run id.
        message: what to say.
        node_state: where the node is (``FAILED``: the exception being handled is added).
        name: what happened (default: the caller's function); the event's name is
            ``<caller's file>:<name>``.
        hostname: the node's host (default: this host's fully qualified name).
        pid: the process id (default: this process's).
        master_endpoint: the rendezvous store's endpoint, if known.
        local_id: the node's local id, if known.
        rank: the node's rank, if known.
    """
    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return
    caller = sys._getframe(1)
    filename = os.path.basename(caller.f_code.co_filename)
    event = RdzvEvent(
        name=f"{filename}:{name or caller.f_code.co_name}",
        run_id=run_id,
        message=message,
        hostname=hostname or socket.getfqdn(),
        pid=pid or os.getpid(),
        node_state=node_state,
        master_endpoint=master_endpoint,
        rank=rank,
        local_id=local_id,
        error_trace=traceback.format_exc() if node_state == NodeState.FAILED else "",
    )
    del caller  # (a frame kept alive keeps its locals)
    record_rdzv_event(event)
