"""Stores: the key-value services every process of a job meets at.

``TCPStore`` (client and server), ``HashStore`` (in one process), ``FileStore`` (processes
sharing a file), ``PrefixStore`` (a namespace inside another store).
"""

from ._api import Store
from ._etcd import EtcdStore
from ._file import FileStore
from ._hash import HashStore
from ._prefix import PrefixStore
from ._tcp import TCPStore

__all__ = ["EtcdStore", "FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]
