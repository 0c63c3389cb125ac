"""``torch.distributed.elastic.timer.local_timer``'s names: timers over a ``multiprocessing``
queue (implemented in ``_local``)."""

from ._local import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]
