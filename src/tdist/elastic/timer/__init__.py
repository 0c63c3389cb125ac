"""Expiration timers (``torch.distributed.elastic.timer`` under tdist's name): a worker arms a
countdown around code that may hang, and a server in another process of its host kills the
worker if the countdown runs out.

``tdist run`` (as torchrun) runs a ``FileTimerServer`` when its environment has
``TORCHELASTIC_ENABLE_FILE_TIMER=1`` and tells the workers its named pipe in
``TORCHELASTIC_TIMER_FILE`` (given, or made up); a worker then writes::

    from tdist.elastic import timer

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=60):
        train_step()

and, if the block takes longer than 60 s, is killed with SIGKILL; the launcher reports it as a
failed worker (and restarts the group if ``--max-restarts`` allows). A program that starts its
own workers can use ``LocalTimerServer`` with a ``multiprocessing`` queue instead, or implement
``TimerServer``/``TimerClient`` for another transport. See ``_api`` for how the pieces work.
"""

from . import api, debug_info_logging, file_based_local_timer, local_timer
from ._api import RequestQueue, TimerClient, TimerRequest, TimerServer, configure, expires
from ._file import FileTimerClient, FileTimerRequest, FileTimerServer
from ._local import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "LocalTimerClient",
    "LocalTimerServer",
    "MultiprocessingRequestQueue",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "api",
    "configure",
    "debug_info_logging",
    "expires",
    "file_based_local_timer",
    "local_timer",
]
