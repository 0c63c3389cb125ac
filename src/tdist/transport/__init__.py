"""Transport: authenticated peer connections carrying tagged messages between ranks.

``Endpoint`` is one rank's end of a full mesh (Unix-domain sockets between ranks of one host,
TCP between hosts); ``_protocol`` is its sans-IO wire format.
"""

from ._endpoint import Endpoint, RecvHandle

__all__ = ["Endpoint", "RecvHandle"]
