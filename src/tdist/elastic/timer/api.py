"""``torch.distributed.elastic.timer.api``'s names: the request, the bases, ``configure``,
``expires`` (implemented in ``_api``)."""

from ._api import RequestQueue, TimerClient, TimerRequest, TimerServer, configure, expires

__all__ = ["RequestQueue", "TimerClient", "TimerRequest", "TimerServer", "configure", "expires"]
