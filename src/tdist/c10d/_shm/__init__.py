"""The shared-memory arena: collectives among the ranks of one host, without sockets.

Theory of operation
===================

When every rank of a group runs on one host, the ``tcp`` backend hands its collectives to a
``ShmArena``. The ranks map one shared segment; data moves through it with ``torch`` copies and
reductions (whose kernels release the GIL), and the ranks sequence each other with counters in
the same segment. No byte crosses a socket and no thread hands work to another.

API
---
::

    arena = ShmArena(store, rank, size, name="arena", timeout=300.0, heartbeat_interval=1.0)
    arena.all_reduce(tensor, op)                    # in place, any view, any reducible dtype
    arena.reduce(tensor, root, op)                  # root's tensor; the others' are unchanged
    arena.broadcast(tensor, root)
    arena.all_gather(outputs, input)                # outputs[q]: rank q's input, sizes may differ
    arena.all_gather_into_tensor(output, input)
    arena.gather(outputs_or_None, input, root)
    arena.scatter(output, inputs_or_None, root)
    arena.reduce_scatter(output, inputs, op)        # inputs[q]: this rank's part for rank q
    arena.reduce_scatter_tensor(output, input, op)
    arena.all_to_all(outputs, inputs)               # inputs[q] -> rank q; sizes may differ
    arena.barrier()
    arena.abort(reason)                             # from any thread: break the arena now
    arena.close()

Every collective takes ``timeout=`` (seconds or a ``timedelta``; default: the arena's). The
errors: ``ValueError``/``TypeError`` for arguments (raised before anything is published, so the
arena stays usable), ``CollectiveMismatchError`` when ranks disagree, ``PeerError`` for a dead,
stalled, closed or failed peer, ``DistTimeoutError`` for a deadline; after any of the last three
the arena is broken and every later call raises ``DistBackendError`` at once.

Files
-----
None. The segment is a memfd and the wake-up channels are pipes: nothing has a name, and all of
it goes away with the last process that holds it, however the processes end (``kill -9``
during ``__init__`` included). Only processes that may inspect each other (same user) can open
them through ``/proc``. (Arenas of earlier versions used files named
``/dev/shm/tdist-<uid>-<pid>-...``: rank 0 of a new arena removes those whose creator pid is
gone, ``cleanup_stale``.)

Store keys are ``shm/<name>/<k>/...``, where ``k`` counts the arenas of that name each rank
has made, so a group re-created over the same store never reads the keys of the last one.

Thread-safety
-------------
One arena per group per process; its methods are called from one thread at a time (the backend
serializes them), except ``abort``, which any thread may call. The only thread an arena starts
is its heartbeat.

Modules
-------
``_layout``: the segment's layout, its words and descriptors. ``_core``: making and mapping the
segment, the counters, waiting, arrival, failures (``ArenaCore``). ``_arena``: the collectives
(``ShmArena``). ``_tensors``: reduction kernels and tensor checks. ``_lifetime``: the heartbeat
thread and the clean-up of earlier versions' files.
"""

from __future__ import annotations

from ..._core.errors import CollectiveMismatchError
from ._arena import ShmArena
from ._layout import default_frame_bytes, memory_order_ok
from ._lifetime import SHM_DIR as SHM_DIR
from ._lifetime import cleanup_stale

__all__ = ["CollectiveMismatchError", "ShmArena", "cleanup_stale", "default_frame_bytes", "memory_order_ok"]
