"""``torch.distributed.elastic.timer.file_based_local_timer``'s names: timers over a named pipe
(implemented in ``_file``)."""

from ._file import FileTimerClient, FileTimerRequest, FileTimerServer

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer"]
