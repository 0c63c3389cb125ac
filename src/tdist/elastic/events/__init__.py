"""Events (``torch.distributed.elastic.events`` under tdist's name): what happened to a job, as
JSON lines through Python logging::

    from tdist.elastic import events

    event = events.Event(name="checkpoint", source=events.EventSource.WORKER, metadata={"step": 10})
    events.record(event, destination="console")   # {"name": "checkpoint", "source": "WORKER", ...}

``record`` sends to a destination's handler (``null``: dropped, the default; ``console``:
stderr); ``construct_and_record_rdzv_event`` builds and records a rendezvous event when the
``dynamic_rendezvous`` destination has a handler, else costs nothing. ``tdist run`` records
torchrun's worker events (``torchelastic.worker.status.<STATE>``) to the launch's
``event_log_handler`` (``null`` unless ``tdist.launcher.LaunchConfig`` says otherwise).
"""

from __future__ import annotations

from . import api, handlers
from ._api import (
    Event,
    EventMetadataValue,
    EventSource,
    NodeState,
    RdzvEvent,
    construct_and_record_rdzv_event,
    get_logging_handler,
    record,
    record_rdzv_event,
)

__all__ = [
    "Event",
    "EventMetadataValue",
    "EventSource",
    "NodeState",
    "RdzvEvent",
    "api",
    "construct_and_record_rdzv_event",
    "get_logging_handler",
    "handlers",
    "record",
    "record_rdzv_event",
]
