"""``tdist.elastic.rendezvous.etcd_rendezvous_backend``: torch's ``RendezvousBackend`` in etcd
(its ``etcd-v2`` backend), over tdist's own ``EtcdStore`` (etcd's v3 JSON gateway, standard
library only) instead of a python-etcd client.

The state is the key ``<key_prefix><run_id>`` of an ``EtcdStore`` (the prefix
``/torch/elastic/rendezvous`` by default), written by ``compare_set`` as in
``C10dRendezvousBackend``; the rounds' store is an ``EtcdStore`` under ``/torch/elastic/store``.
The state does not expire (torch's ``ttl`` is accepted and not used).
"""

from __future__ import annotations

from datetime import timedelta

from ..._core.errors import DistError
from ...store._api import Store
from ...store._etcd import EtcdStore
from . import RendezvousConnectionError, RendezvousParameters, parse_rendezvous_endpoint
from .c10d_rendezvous_backend import C10dRendezvousBackend

__all__ = ["EtcdRendezvousBackend", "create_backend"]


class EtcdRendezvousBackend(C10dRendezvousBackend):
    """A rendezvous backend in etcd: the key ``<key_prefix><run_id>`` of ``store``.

    Raises:
        ValueError: an empty run id. RendezvousConnectionError: etcd cannot be reached.
    """

    def __init__(self, store: Store, run_id: str, key_prefix: str | None = None, ttl: int | None = None) -> None:
        self._prefix = key_prefix or ""
        super().__init__(store, run_id)

    def _state_key(self, run_id: str) -> str:
        return self._prefix + run_id

    @property
    def name(self) -> str:
        return "etcd-v2"


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, Store]:
    """An ``EtcdRendezvousBackend`` and the rounds' ``EtcdStore``, from ``params``: the endpoint
    ``host[:port]`` (port 2379 by default) of an etcd server, ``read_timeout`` (seconds,
    default 60), ``protocol`` http (the only one: no TLS options).

    Raises:
        ValueError: a bad option. RendezvousConnectionError: etcd cannot be reached.
    """
    host, port = parse_rendezvous_endpoint(params.endpoint, 2379)
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    protocol = str(params.get("protocol", "http")).strip().lower()
    if protocol != "http":
        raise ValueError(f"The etcd protocol {protocol!r} is not supported: tdist's EtcdStore speaks http only.")
    timeout = timedelta(seconds=read_timeout)
    try:
        state = EtcdStore(host, port, prefix="/torch/elastic/rendezvous", timeout=timeout)
        store = EtcdStore(host, port, prefix="/torch/elastic/store", timeout=timeout)
    except DistError as exc:
        raise RendezvousConnectionError(f"etcd-v2 rendezvous: {exc}") from exc
    return EtcdRendezvousBackend(state, params.run_id), store
