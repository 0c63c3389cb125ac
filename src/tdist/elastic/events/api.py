"""``torch.distributed.elastic.events.api``'s names (implemented in ``_api``)."""

from ._api import Event, EventMetadataValue, EventSource, NodeState, RdzvEvent

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent"]
