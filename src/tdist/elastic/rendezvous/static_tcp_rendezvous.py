"""``tdist.elastic.rendezvous.static_tcp_rendezvous``: torch's module path of the ``static``
rendezvous: every node is given its rank, and rank 0 hosts a TCPStore at the master's address
(tdist's static handler, under torch's class name and constructor)."""

from __future__ import annotations

from datetime import timedelta

from . import RendezvousHandler, RendezvousParameters, _StaticRendezvous, parse_rendezvous_endpoint

__all__ = ["StaticTCPRendezvous", "create_rdzv_handler"]

_default_timeout_seconds = 600  # (torch's default for create_rdzv_handler)


class StaticTCPRendezvous(_StaticRendezvous):
    """A rendezvous whose nodes know their ranks: rank 0 hosts a TCPStore at
    ``master_addr:master_port`` (``timeout``: seconds to reach it); the round's store is that
    store under the prefix ``run_id``."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, run_id: str, timeout: int) -> None:
        super().__init__(master_addr, int(master_port), int(rank), int(world_size), run_id, timedelta(seconds=timeout))

    @property
    def master_addr(self) -> str:
        return self._host

    @property
    def master_port(self) -> int:
        return self._port

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def timeout(self) -> timedelta:
        return self._timeout


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A ``StaticTCPRendezvous`` from ``params``: its ``rank`` option, the endpoint
    ``host:port`` (a port is required), ``max_nodes`` as the world size, ``timeout`` (seconds,
    default 600).

    Raises:
        ValueError: no rank, no endpoint, or no port in it.
    """
    if "rank" not in params.config:
        raise ValueError("rank is absent in RendezvousParameters. Try add --node-rank to the cmd request")
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError("endpoint is absent in RendezvousParameters. Try add --master-port and --master-addr to the cmd request")
    host, port = parse_rendezvous_endpoint(endpoint, 0)
    if ":" not in endpoint.rpartition("]")[2] or port == 0:
        raise ValueError(f"Port is absent in endpoint: {endpoint}. Try launching with --master-port")
    rank = params.get_as_int("rank")
    timeout = params.get_as_int("timeout", _default_timeout_seconds)
    return StaticTCPRendezvous(host, port, rank or 0, params.max_nodes, params.run_id, timeout or _default_timeout_seconds)
