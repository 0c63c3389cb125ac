"""The TENSORPIPE agent: RPC over tdist's own message transport.

Theory of operation. Each worker starts a ``transport.Messenger`` (an abstract Unix socket for
workers of its host, TCP for the others, cross-memory copies for large tensors between
processes of one host), publishes ``{name, address, devices}`` in the store under a job token,
and connects to a peer when it first sends to it.

Static group (``world_size`` given): ``init_rpc`` waits until every worker has published
(a barrier), checks that names are unique and validates the device maps as torch does.
Dynamic group (``world_size=None``): a worker claims its name in the store, reads the
current members, connects to each and introduces itself with ``JOIN``; a member learns about a
newcomer from that message. Leaving sends ``LEAVE`` to every member; nothing depends on the
store after joining, so any worker, the store's host included, may leave while the others go on.

Graceful shutdown (static): wait for our own outstanding requests, barrier, release every user
RRef, wait for the RRef protocol to settle, barrier, close. Requests keep being served
throughout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

import torch

from .._core import auth
from .._core.errors import DistError, PeerError
from ..transport import _serialization as ser
from ..transport._link import advertised_address
from ..transport._memory import CMA_MIN
from ..transport._messenger import Messenger, Payload, PeerAddress
from ._agent import RpcAgent, set_current_agent
from ._message import MsgKind, encode_meta
from ._options import TensorPipeRpcBackendOptions, resolve_device_maps
from ._worker_info import WorkerInfo, validate_name

__all__ = ["TensorPipeAgent"]

log = logging.getLogger(__name__)

_INIT_TIMEOUT = float(os.environ.get("TDIST_RPC_INIT_TIMEOUT", "300"))
_CLAIM_MAX = min(1 << 20, CMA_MIN) if CMA_MIN > 0 else 1 << 20  # (below a cross-memory copy)


class _ThreadState(threading.local):
    """What each thread keeps here; the class holds the defaults (a missing attribute of a
    plain ``threading.local`` costs an exception on every look)."""

    self_call: bool = False
    claim_for: int | None = None
    claimed: Any = None
    job: Any = None


class TensorPipeAgent(RpcAgent):
    """``TENSORPIPE`` backend agent (see the module docstring).

    Raises:
        ValueError: an invalid or duplicate name, or invalid device maps.
        RuntimeError: the group could not be formed in time.
    """

    def __init__(self, store: Any, name: str, rank: int, world_size: int | None, options: TensorPipeRpcBackendOptions) -> None:
        validate_name(name)
        super().__init__(name, rank, world_size, float(options.rpc_timeout), int(options.num_worker_threads))
        self.store = store
        self.options = options
        self._addresses: dict[int, PeerAddress] = {}
        self._tls = _ThreadState()
        self._joined = threading.Event()
        self.device_maps: dict[str, Any] = {}
        self.devices: list[torch.device] = []
        token_hex = store.compare_set("rpc/token", "", secrets.token_hex(16)).decode()
        self._prefix = f"rpc/{token_hex}"
        self.messenger = Messenger(
            rank,
            self.label,
            bytes.fromhex(token_hex),
            auth.resolve_secret(None),
            self._lookup,
            self.describe,
            self._on_frame,
            self.peer_lost,
            advertise=advertised_address(store, "TP_SOCKET_IFNAME"),
            heartbeat_interval=float(os.environ.get("TDIST_HEARTBEAT_INTERVAL", "1.0")),
            stall_timeout=float(os.environ.get("TDIST_HEARTBEAT_TIMEOUT", "5.0")),
            on_batch_end=self._run_deferred,
            max_pollers=int(options.num_worker_threads) + 1,
            quiet=lambda: self._active_requests == 0,
        )
        # requests may arrive as soon as others see us, before init_rpc returns: functions
        # they run (and RRefs they unpickle) need the current agent already
        set_current_agent(self)
        try:
            if world_size is None:
                self._join_dynamic()
            else:
                self._join_static(world_size)
            self._joined.set()
        except BaseException:
            set_current_agent(None)
            self.linger_after_gather()
            self.stop(graceful=False)
            raise

    # -- forming the group ----------------------------------------------------------------------
    def _record(self) -> str:
        maps = {to: {str(k): str(v) for k, v in m.items()} for to, m in self.options.device_maps.items()}
        return json.dumps(
            {
                "name": self.name,
                "addr": self.messenger.address,
                "maps": maps,
                "devices": [str(d) for d in self.options.devices],
                # CUDA path: the number of visible GPUs bounds the indices a map may use
                "ndev": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            }
        )

    def _join_static(self, world_size: int) -> None:
        records = [json.loads(v) for v in self.gather("worker", self._record(), world_size, _INIT_TIMEOUT)]
        self.add_workers([r["name"] for r in records])
        for i, rec in enumerate(records):
            self._addresses[i] = rec["addr"]
        all_names = [r["name"] for r in records]
        all_maps = {r["name"]: {to: {torch.device(k): torch.device(v) for k, v in m.items()} for to, m in r["maps"].items()} for r in records}
        all_devices = {r["name"]: [torch.device(d) for d in r["devices"]] for r in records}
        counts = {r["name"]: int(r["ndev"]) for r in records}
        self.device_maps, self.devices = resolve_device_maps(self.name, all_names, counts, all_maps, all_devices, True)

    def _join_dynamic(self) -> None:
        p = self._prefix
        claimed = self.store.compare_set(f"{p}/name/{self.name}", "", str(self.rank)).decode()
        if claimed != str(self.rank):
            raise RuntimeError(f"RPC worker name {self.name!r} is already taken by the worker with id {claimed}")
        record = self._record()
        self.store.set(f"{p}/worker/{self.rank}", record)
        self.store.append(f"{p}/members", f"{self.rank},")
        members = [int(x) for x in self.store.get(f"{p}/members").decode().split(",") if x]
        mine = json.loads(record)
        deadline = time.monotonic() + min(_INIT_TIMEOUT, 60.0)
        for wid in dict.fromkeys(members):
            if wid == self.rank or self.store.check([f"{p}/left/{wid}"]):
                continue
            rec = json.loads(self.store.get(f"{p}/worker/{wid}"))
            self._addresses[wid] = rec["addr"]
            self._add_worker(WorkerInfo(rec["name"], wid))
            fut = self.request(wid, MsgKind.JOIN, (self.rank, self.name, mine["addr"]), max(0.1, deadline - time.monotonic()), "join")
            try:
                fut.wait()
            except Exception as exc:
                # a member that died without leaving: not one of us any more
                log.info("%s: member %s did not answer the join: %s", self.label, self.describe(wid), exc)
                self._remove_worker(wid)

    def _on_join(self, src: int, tag: int, body: Any) -> None:
        wid, name, addr = body
        self._addresses[wid] = addr
        self.messenger.forget(wid)
        self._add_worker(WorkerInfo(name, wid))
        super()._on_join(src, tag, body)

    def _find_worker(self, name: str) -> WorkerInfo | None:
        # a request can come in while we still read the members: wait for that; in a dynamic
        # group a worker may have joined without talking to us yet: ask the store
        self._joined.wait(_INIT_TIMEOUT)
        info = self._by_name.get(name)
        if info is None and self.world_size is None:
            wid = None
            with contextlib.suppress(Exception):
                if self.store.check([f"{self._prefix}/name/{name}"]):
                    wid = int(self.store.get(f"{self._prefix}/name/{name}"))
            if wid is not None:
                info = self._find_worker_id(wid)
        return info

    def _find_worker_id(self, wid: int) -> WorkerInfo | None:
        self._joined.wait(_INIT_TIMEOUT)
        info = self._workers.get(wid)
        if info is None and self.world_size is None:
            with contextlib.suppress(Exception):
                if self.store.check([f"{self._prefix}/worker/{wid}"]):
                    rec = json.loads(self.store.get(f"{self._prefix}/worker/{wid}"))
                    self._addresses[wid] = rec["addr"]
                    info = WorkerInfo(rec["name"], wid)
                    self._add_worker(info)
        return info

    def _lookup(self, peer: int) -> PeerAddress:
        addr = self._addresses.get(peer)
        if addr is None:
            key = f"{self._prefix}/worker/{peer}"
            if not self.store.check([key]):  # (never wait on the store for a stranger)
                raise KeyError(f"no worker with id {peer} is known")
            rec = json.loads(self.store.get(key))
            addr = self._addresses[peer] = rec["addr"]
        return addr

    # -- moving messages ------------------------------------------------------------------------
    def _on_frame(self, src: int, tag: int, meta: bytes, payload: Payload) -> None:
        if isinstance(payload, list):
            self._on_message(src, tag, meta, lambda lenient=False: ser.loads_parts(payload[0], payload[1:], lenient))
        else:
            self._on_message(src, tag, meta, lambda lenient=False: ser.loads(payload, lenient))

    def _transmit(self, dst: int, tag: int, kind: MsgKind, body: Any, deadline: float | None, answer: bool = False) -> None:
        parts = self.encode(dst, body, kind)
        if dst == self.rank:
            # a call to ourselves: copy semantics as for any peer, no socket
            data = bytearray(b"".join(parts))
            self._tls.self_call = True  # a request to ourselves goes to the pool, never deferred
            try:
                self._on_message(dst, tag, encode_meta(kind), lambda lenient=False: ser.loads(data, lenient))
            finally:
                self._tls.self_call = False
            return
        if self._tls.claim_for == dst and sum(p.nbytes for p in parts) < _CLAIM_MAX:
            # a blocking call takes the callee's connection before its request goes out (then
            # no poller wakes for the reply); not for a large request, whose long write (or
            # wait for the callee's copy) would leave the connection unread meanwhile
            self._tls.claim_for = None
            self._tls.claimed = self.messenger.claim(dst)
        self.messenger.send(dst, tag, encode_meta(kind), parts, deadline, answer)

    def _schedule(self, job: Any) -> None:
        # a poller thread runs the first request of what it read itself (no hand-off) unless
        # another poller is running one already; the rest go to the pool, side by side
        if (
            self.messenger.in_poller()
            and not self.messenger.busy()
            and self._tls.job is None
            and not self._tls.self_call
        ):
            self._tls.job = job
        else:
            super()._schedule(job)

    def _run_deferred(self) -> None:
        job = self._tls.job
        if job is not None:
            self._tls.job = None
            self.messenger.run_inline(lambda: self._run_job(job))

    def call_sync(self, dst: int, kind: MsgKind, body: Any, timeout: float | None, what: object) -> Any:
        # take the callee's connection before sending, so that the reply is read here and no
        # poller wakes up (and competes for the GIL) for it
        self._tls.claim_for = dst
        try:
            fut = self.request(dst, kind, body, timeout, what, sync=True)
        except BaseException:
            self.messenger.release(self._tls.claimed)
            raise
        finally:
            self._tls.claim_for = None
            token, self._tls.claimed = self._tls.claimed, None
        if not fut.done():
            seconds = self.timeout_seconds(timeout)
            deadline = None if seconds is None else time.monotonic() + seconds + 1.0
            if self.messenger.read_until(dst, fut.done, deadline, claimed=token, budget=fut._tdist_spin):
                return fut.wait()
            token = None
            super()._wait_reply(dst, fut, deadline)
        else:
            self.messenger.release(token)
        return fut.wait()

    def _wait_reply(self, dst: int, fut: Any, deadline: float | None) -> None:
        if dst != self.rank and self.messenger.read_until(dst, fut.done, deadline, budget=getattr(fut, "_tdist_spin", None)):
            return
        super()._wait_reply(dst, fut, deadline)

    def _lost_peer(self, peer: int) -> PeerError | None:
        lost = super()._lost_peer(peer)
        if lost is None and peer != self.rank:
            try:  # connected, its heartbeats tell when it dies or stalls
                self.messenger.connect(peer, time.monotonic() + self.messenger.stall_timeout)
            except PeerError as exc:
                return exc
            except (DistError, OSError) as exc:  # it does not answer: stalled, or gone
                return PeerError(f"{self.describe(peer)} could not be reached: {exc}", peer=peer)
            return super()._lost_peer(peer)
        return lost

    def _close_transport(self, graceful: bool) -> None:
        self.messenger.close()

    # -- leaving --------------------------------------------------------------------------------
    def leave_dynamic(self) -> None:
        """Tell every member we leave, and give our name back."""
        p = self._prefix
        for wid in list(self._workers):
            if wid != self.rank and self.messenger.is_connected(wid):
                try:
                    self._transmit(wid, 0, MsgKind.LEAVE, self.rank, time.monotonic() + 2.0)
                except Exception as exc:
                    log.debug("%s: could not say goodbye to %s: %s", self.label, self.describe(wid), exc)
        try:
            self.store.set(f"{p}/left/{self.rank}", "1")
            self.store.delete_key(f"{p}/name/{self.name}")
        except Exception as exc:  # the store's host may be gone already: not our problem any more
            log.debug("%s: could not update the store on leaving: %s", self.label, exc)
