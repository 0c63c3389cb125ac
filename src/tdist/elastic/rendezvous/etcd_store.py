"""``tdist.elastic.rendezvous.etcd_store``: the module path of torch's ``EtcdStore``.

tdist's ``EtcdStore`` (``tdist.store._etcd``) speaks etcd's v3 JSON gateway with the standard
library alone: it is made from a host and port (``EtcdStore(host, port, prefix, timeout)``),
not from a python-etcd client as torch's is.
"""

from ...store._etcd import EtcdStore, EtcdStoreTimeoutError

__all__ = ["EtcdStore", "EtcdStoreTimeoutError"]
