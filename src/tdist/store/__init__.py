"""Stores: the key-value services every process of a job meets at.

``TCPStore`` (client and server), ``HashStore`` (in one process), ``FileStore`` (processes
sharing a file), ``PrefixStore`` (a namespace inside another store), ``EtcdStore`` (an etcd
cluster); ``StoreStandby`` and ``FailoverStore``: a server's standby that takes over when it is
lost, and a client that fails over to it.

The names load on first use (PEP 562): a process that needs one part of the package (the store
server, started as a fresh interpreter, imports ``_server`` alone) does not pay for the others
(``EtcdStore`` brings ``http.client``).
"""

from __future__ import annotations

from .._core import lazy

TYPE_CHECKING = False  # (typing is not imported at run time: see tdist/__init__)

if TYPE_CHECKING:
    from ._api import Store as Store
    from ._etcd import EtcdStore as EtcdStore
    from ._file import FileStore as FileStore
    from ._hash import HashStore as HashStore
    from ._prefix import PrefixStore as PrefixStore
    from ._replica import FailoverStore as FailoverStore
    from ._replica import StoreStandby as StoreStandby
    from ._tcp import TCPStore as TCPStore

__all__ = ["EtcdStore", "FailoverStore", "FileStore", "HashStore", "PrefixStore", "Store", "StoreStandby", "TCPStore"]

_WHERE = {
    "EtcdStore": "._etcd",
    "FileStore": "._file",
    "HashStore": "._hash",
    "PrefixStore": "._prefix",
    "FailoverStore": "._replica",
    "StoreStandby": "._replica",
    "Store": "._api",
    "TCPStore": "._tcp",
}


__getattr__, __dir__ = lazy.names(__name__, _WHERE)
