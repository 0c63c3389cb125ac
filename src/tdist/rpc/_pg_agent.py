"""The PROCESS_GROUP agent: RPC over a process group's point-to-point ``send`` and ``recv``.

Theory of operation. The workers of a static group (``world_size`` given; torch's
ProcessGroupAgent never supported dynamic groups) publish their names in the store under a
generation prefix, check that the names are unique, then build a private ``tcp`` process group
(``ProcessGroupTCP`` on ``PrefixStore("rpc-pg/<generation>/pg", store)``; it is not the default
group and nothing else uses it). Building it is the init barrier: its mesh needs every worker.

A message travels as point-to-point messages to the destination: a header, an int64 tensor
``[kind, message id, payload bytes, payload tag]`` with tag ``_HEADER_TAG``, then the payload,
a uint8 tensor holding the ``transport.serialization`` encoding of the body (its parts
concatenated once), one message with the payload tag the header named: the process group's own
``send`` (a large one to a worker of this host is copied straight from the sender's memory;
nothing is framed again here). Payload tags are unique
per sender and destination, so two threads sending to one worker at once can interleave their
messages without pairing a header with the other one's payload, and no lock is held across a
send. Messages go out in the sending thread; the process group delivers the messages of one tag
between two ranks in order, so the headers (hence the messages) that one thread sends to one
worker arrive in the order it sent them, which the RRef protocol and the replies rely on.

Receiving: per peer, one thread at a time (the holder of that peer's ``_Baton``) posts a
receive for the peer's next header, then one for the payload it announces (straight into the
tensor the message is decoded from), and hands the message to ``RpcAgent._on_message``;
one reading thread per source keeps its messages in order. A reply completes a future whose
callbacks may block, for instance on another call to the same worker, whose reply must still be
read: so the holder runs the agent's own reply handling, then hands the baton to a spare thread
(or a new one) and only then completes the future; it becomes a spare when the callbacks
return. Waiting on a specific peer also lets the process group's heartbeat watch catch a peer
that stalls. A call to ourselves skips the process group.

Failure. A peer that shuts its agent down leaves the process group in an orderly way: requests
waiting on it fail at once (``peer_lost``), everyone else goes on. A peer that dies or stalls
breaks the whole process group (a ``tcp`` group that lost a member refuses further operations),
so every request waiting on any worker fails at once with an error naming the lost worker, and
later requests fail as soon as they are made: use TENSORPIPE where workers must survive the
loss of others. Shutdown destroys the process group, which fails the posted receives; the
readers then exit quietly.

Thread-safety: as ``RpcAgent``; ``_transmit`` may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from .._core.errors import (
    DistError,
    PeerError,
    RemoteProtocolError,
)
from ..c10d._tcp_backend import ProcessGroupTCP, bytes_view
from ..store import PrefixStore
from ..transport import _serialization as ser
from ._agent import RpcAgent, current_agent, set_current_agent, validate_name
from ._message import REQUESTS, MsgKind, encode_meta
from ._options import ProcessGroupRpcBackendOptions

__all__ = ["ProcessGroupAgent"]

log = logging.getLogger(__name__)

_INIT_TIMEOUT = float(os.environ.get("TDIST_RPC_INIT_TIMEOUT", "300"))
_HEADER_TAG = 1
_PAYLOAD_TAG0 = 1 << 32  # payload tags: this plus the sender's count of messages to that worker
_MAX_TAG = 1 << 62  # the process group's point-to-point tags stay below this
_MAX_PAYLOAD = 1 << 40
# The readers' receives wait for the next message without a deadline (a receive that timed out
# would stay posted and swallow the message it was waiting for); the process group's heartbeat
# watch and its destruction end them instead.
_NO_TIMEOUT = timedelta(days=3650)


class _Baton:
    """Who reads one peer's messages: one thread at a time (``holder``) reads and delivers them
    in order; threads that handed it on run callbacks, then wait as spares (``idle``)."""

    __slots__ = ("cv", "done", "holder", "idle", "src")

    def __init__(self, src: int) -> None:
        self.src = src
        self.cv = threading.Condition()
        self.holder: threading.Thread | None = None
        self.idle = 0
        self.done = False  # the peer or the group is gone: nobody reads any more


class ProcessGroupAgent(RpcAgent):
    """``PROCESS_GROUP`` backend agent (see the module docstring).

    Args:
        store: the rendezvous store of ``init_rpc``.
        name: this worker's name.
        rank: this worker's id.
        world_size: the number of workers (required).
        options: ``ProcessGroupRpcBackendOptions``; ``num_send_recv_threads`` threads run
            incoming requests, as in torch's agent.

    Raises:
        ValueError: ``world_size`` is None.
        RuntimeError: an invalid or duplicate name, or the group could not be formed in time.
    """

    def __init__(self, store: Any, name: str, rank: int, world_size: int | None, options: ProcessGroupRpcBackendOptions) -> None:
        if world_size is None:
            raise ValueError("the PROCESS_GROUP backend needs a fixed world_size; use TENSORPIPE for dynamic groups")
        validate_name(name)
        super().__init__(name, rank, world_size, float(options.rpc_timeout), int(options.num_send_recv_threads))
        self.store = store
        self.options = options
        self._pg: ProcessGroupTCP | None = None
        self._closing = False
        self._broken = False  # the process group lost a member: every worker was failed
        self._readers: list[threading.Thread] = []
        self._batons = {peer: _Baton(peer) for peer in range(world_size) if peer != rank}
        self._tls = threading.local()
        self._seq_lock = threading.Lock()
        self._seq = [0] * world_size
        self._prefix = "rpc-pg"
        try:
            # every worker of one init_rpc round adds 1: rounds on one store use distinct keys
            generation = (int(store.add("rpc-pg/joined", 1)) - 1) // world_size
            self._prefix = f"rpc-pg/{generation}"
            self._gather_names(world_size)
            self._pg = ProcessGroupTCP(
                PrefixStore(f"{self._prefix}/pg", store), rank, world_size, timedelta(seconds=_INIT_TIMEOUT), name="rpc-pg"
            )
            self._pg.set_timeout(_NO_TIMEOUT)
            # A worker whose init_rpc returned may call us at once, and a function it calls may
            # use the RPC API (``get_worker_info``), so we must be the current agent before we
            # read a request; init_rpc sets it again when this returns.
            set_current_agent(self)
            for peer in range(world_size):
                if peer != rank:
                    self._start_reader(peer)
        except BaseException:
            if current_agent(required=False) is self:
                set_current_agent(None)
            self.linger_after_gather()
            self.stop(graceful=False)
            raise

    # -- forming the group ----------------------------------------------------------------------
    def _gather_names(self, world_size: int) -> None:
        self.add_workers([v.decode() for v in self.gather("name", self.name, world_size, _INIT_TIMEOUT)])

    # -- moving messages ------------------------------------------------------------------------
    def _transmit(self, dst: int, tag: int, kind: MsgKind, body: Any, deadline: float | None, answer: bool = False) -> None:
        parts = self.encode(dst, body, kind)
        if dst == self.rank:
            # a call to ourselves: copy semantics as for any peer, no process group
            data = bytearray(b"".join(parts))
            self._on_message(dst, tag, encode_meta(kind), lambda lenient=False: ser.loads(data, lenient))
            return
        pg = self._pg
        if pg is None:
            raise DistError(f"{self.label}: the RPC agent has no process group (init_rpc did not finish)")
        nbytes = sum(part.nbytes for part in parts)
        payload = torch.empty(nbytes, dtype=torch.uint8)
        view = bytes_view(payload)
        pos = 0
        for part in parts:
            view[pos : pos + part.nbytes] = part
            pos += part.nbytes
        with self._seq_lock:
            ptag = _PAYLOAD_TAG0 + self._seq[dst]
            self._seq[dst] += 1
        header = torch.tensor([int(kind), tag, nbytes, ptag], dtype=torch.int64)
        # ``deadline`` is not needed here: a send blocks only while the peer's socket is full,
        # and the process group fails a peer that stops reading (its heartbeat watch)
        try:
            pg.send([header], dst, tag=_HEADER_TAG)
            pg.send([payload], dst, tag=ptag)
        except DistError as exc:
            if kind not in REQUESTS:
                raise
            # Fail the request here rather than in ``RpcAgent.request``: a reader may have
            # failed it already (``peer_lost``), and a torch future cannot fail twice.
            with self._lock:
                call = self._pending.pop(tag, None)
            if call is not None:
                peer = exc.peer if isinstance(exc, PeerError) and isinstance(exc.peer, int) else dst
                why = f"its process group broke when {self.describe(peer)} was lost: " if peer not in (dst, self.rank) else ""
                err = PeerError(f"{self.label}: could not send {call.what} to {self.describe(dst)}: {why}{exc}", peer=peer)
                self._finish(call, None, err)

    def _start_reader(self, src: int) -> None:
        t = threading.Thread(target=self._read_from, args=(src,), name=f"tdist-rpc-pg-recv-{self.rank}-{src}", daemon=True)
        with self._lock:
            self._readers = [r for r in self._readers if r.is_alive()]
            self._readers.append(t)
        t.start()

    def _read_from(self, src: int) -> None:
        """A reader of ``src``: waits for the baton, then reads and delivers ``src``'s messages
        in order until it hands the baton on (``_finish``) or the peer or the group goes."""
        st = self._batons[src]
        me = threading.current_thread()
        while True:
            with st.cv:
                while st.holder is not None and not st.done:
                    st.idle += 1
                    st.cv.wait()
                    st.idle -= 1
                if st.done:
                    return
                st.holder = me
            try:
                self._read_messages(src, st, me)
            except Exception as exc:
                self._tls.baton = None
                with st.cv:
                    st.done = True
                    st.cv.notify_all()
                if not self._closing and not isinstance(exc, DistError):
                    log.exception("%s: the reader of %s's messages failed", self.label, self.describe(src))
                self._reader_failed(src, exc)
                return
            with st.cv:
                if st.idle >= 1 or st.done:
                    return  # a spare waits already: this thread is not needed any more

    def _read_messages(self, src: int, st: _Baton, me: threading.Thread) -> None:
        pg = self._pg
        assert pg is not None
        header = torch.empty(4, dtype=torch.int64)
        while st.holder is me:
            pg.recv([header], src, tag=_HEADER_TAG).wait()
            kind, tag, nbytes, ptag = header.tolist()
            if not (0 <= nbytes <= _MAX_PAYLOAD and _PAYLOAD_TAG0 <= ptag < _MAX_TAG):
                raise RemoteProtocolError(
                    f"{self.label}: {self.describe(src)} sent a malformed RPC header (kind {kind}, "
                    f"{nbytes} bytes, payload tag {ptag}): is it a PROCESS_GROUP agent of this version?"
                )
            payload = torch.empty(nbytes, dtype=torch.uint8)
            pg.recv([payload], src, tag=ptag).wait()
            # a reply completes a future, whose callbacks may block: ``_finish`` hands the
            # baton on before it runs them
            self._tls.baton = st if kind in (MsgKind.REPLY_OK, MsgKind.REPLY_ERR, MsgKind.REPLY_OK_ACK) else None
            try:
                self._deliver(src, kind, tag, payload)
            finally:
                self._tls.baton = None

    def _finish(self, call: Any, value: Any, exc: BaseException | None) -> None:
        st: _Baton | None = getattr(self._tls, "baton", None)
        if st is None:
            super()._finish(call, value, exc)
            return
        # A reader completes a request's future: callbacks may run on it and block (on another
        # RPC to the same worker, say). The agent's own reply handler runs first, in message
        # order; then another thread takes over reading this peer, and this one runs the
        # callbacks.
        self._tls.baton = None
        handler = call.on_reply

        def on_reply(v: Any, e: BaseException | None) -> None:
            try:
                if handler is not None:
                    handler(v, e)
            finally:
                self._hand_off(st)

        call.on_reply = on_reply
        super()._finish(call, value, exc)

    def _hand_off(self, st: _Baton) -> None:
        with st.cv:
            if st.holder is not threading.current_thread():
                return
            st.holder = None
            spawn = st.idle == 0 and not st.done
            if not spawn:
                st.cv.notify()
        if spawn:
            self._start_reader(st.src)

    def _deliver(self, src: int, kind: int, tag: int, payload: torch.Tensor) -> None:
        try:
            meta = encode_meta(MsgKind(kind))
        except ValueError:
            meta = bytes([kind]) if 0 <= kind < 256 else b""  # ``_on_message`` rejects it, with a warning
        data = bytes_view(payload)  # tensors in the body view the payload: no further copy
        try:
            self._on_message(src, tag, meta, lambda lenient=False: ser.loads(data, lenient))
        except Exception:
            # a reader must outlive a bug in one message's handling, or its peer goes silent
            log.exception("%s: handling a message from %s failed", self.label, self.describe(src))

    def _reader_failed(self, src: int, exc: Exception) -> None:
        if self._closing:
            return  # our own shutdown destroyed the process group
        pg = self._pg
        broken = pg.endpoint.broken if pg is not None else None
        if broken is None and isinstance(exc, PeerError) and exc.peer == src:
            # ``src`` left the process group in an orderly way (it shut its agent down); the
            # group goes on without it
            log.debug("%s: %s left: %s", self.label, self.describe(src), exc)
            self.peer_lost(src, PeerError(f"{self.label}: {self.describe(src)} left (shut down its RPC agent): {exc}", peer=src), True)
            return
        if broken is None:
            # ``src`` broke the protocol (or reading it failed here): nothing more can be read
            # from it, the others are fine
            log.warning("%s: stopped reading from %s: %s", self.label, self.describe(src), exc)
            self.peer_lost(src, PeerError(f"{self.label}: cannot read from {self.describe(src)} any more: {exc}", peer=src), False)
            return
        with self._lock:
            if self._broken:
                return
            self._broken = True
        lost = broken.peer if isinstance(broken, PeerError) and isinstance(broken.peer, int) else src
        cause = f"{self.label}: lost {self.describe(lost)}: {broken}"
        log.warning("%s; the PROCESS_GROUP RPC backend cannot reach any worker any more", cause)
        # the others first: whoever waited on the lost worker and goes on finds them failed too
        for w in range(self.world_size or 0):
            if w not in (lost, self.rank):
                msg = f"{cause}; its process group is broken, so {self.describe(w)} cannot be reached either"
                self.peer_lost(w, PeerError(msg, peer=w), False)
        if lost != self.rank:
            self.peer_lost(lost, PeerError(cause, peer=lost), False)

    def _close_transport(self, graceful: bool) -> None:
        self._closing = True
        pg = self._pg
        if pg is not None:
            # says goodbye to every peer and fails the posted receives: the readers return
            pg.shutdown()
        for st in self._batons.values():
            with st.cv:
                st.done = True
                st.cv.notify_all()
        me = threading.current_thread()
        end = time.monotonic() + 2.0
        with self._lock:
            readers = list(self._readers)
        for t in readers:
            if t is not me:
                t.join(max(0.0, end - time.monotonic()))

