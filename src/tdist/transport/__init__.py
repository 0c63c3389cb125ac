"""Transport: authenticated peer connections carrying tagged messages between processes.

One transport, two thin front ends. Underneath both:

* ``_protocol``: the wire format, sans-IO (handshake records, frames, ``FrameDecoder``);
* ``_handshake`` and ``_dial``: authenticated connections, made and let in from a poll loop;
* ``_table``: one connection table (links by peer and by descriptor, one one-shot epoll set,
  a waiting thread reading its own reply, lazy dialling or a whole mesh at once);
* ``_link``: one connection (framing, sealing, writing whole frames, its copies in flight);
* ``_memory``: same-host copies (one ``DATA_CMA`` format) and received memory (one pool);
* ``_liveness``: heartbeats and stalls; ``_lane``: shared-memory rings between two processes.

The front ends: ``Endpoint`` (``_endpoint``), one rank's end of a process group's full mesh,
a tag-matched mailbox; ``Messenger`` (``_messenger``), RPC's lazily dialled connections,
delivering each message to a callback.
"""

from ._endpoint import Endpoint, RecvHandle

__all__ = ["Endpoint", "RecvHandle"]
