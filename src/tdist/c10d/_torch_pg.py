"""tdist as a backend of ``torch.distributed``: ``init_process_group(backend="tdist")``.

torch's plug-in point for backends (``torch.distributed.Backend.register_backend``) takes a
function ``(store, rank, world_size, timeout)`` that returns a process group; torch then routes
every collective and point-to-point call of that group, its own modules' (DDP, FSDP, DTensor)
included, to the group's methods: ``allreduce(tensors, opts)``, ``broadcast(tensors, opts)``,
and so on. Those are the methods of tdist's own backends (``c10d._backend.Backend`` was drawn
after torch's), so ``TorchProcessGroup`` is a thin shell: it builds tdist's tcp backend on
torch's store (``TorchStore`` adapts it), converts torch's option objects into tdist's, and
hands back each tdist ``Work`` wrapped as a torch ``Work`` (``wait``, ``is_completed``,
``get_future``, ``exception``), whose future torch's DDP chains its bucket hooks on.

Registered by ``import tdist`` (see ``tdist/__init__``) once ``torch.distributed`` is imported.

A program ported by its imports (``import tdist as dist; dist.init_process_group("gloo")``)
never calls torch's ``init_process_group``, yet torch's modules (DDP, ``DistributedSampler``,
FSDP) look for torch's default group: ``mirror_default_group`` makes it, on the very backend
of tdist's default group (``_adopting`` hands that backend to the creator; no new
connection), and ``forget_default_group`` destroys it with tdist's.

A Work's future is completed by a thread of ``_Completers``, never by the backend's thread
that finished the work: the future's callbacks (DDP's bucket hooks) issue and wait for more
work on that backend.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as tdc
from torch._C._distributed_c10d import Work as _Work

from .._core.errors import DistError, fresh
from ..store import PrefixStore
from ..store._api import Store
from . import _types as T
from ._backend_config import Backend
from ._checks import CollectiveArgumentError, meta_noop
from ._checks import dense_cpu as _check
from ._group import GroupInfo, ProcessGroup, SplitMerge, _d, _dd, chain_work
from ._profiling import profiled
from ._reduce import sparse_all_reduce

__all__ = ["BACKEND_NAME", "StoreForTorch", "TorchProcessGroup", "TorchStore", "TorchWork", "register"]

BACKEND_NAME = "tdist"
_UNSET = timedelta(0)  # (torch's "no timeout given")

# (torch's stubs type the overloads of its C++ classes; our overrides follow what torch calls)
_TorchWork: Any = _Work
_TorchProcessGroup: Any = tdc.ProcessGroup
_TorchStore: Any = tdc.Store  # type: ignore[attr-defined]
_TorchPrefixStore: Any = tdc.PrefixStore  # type: ignore[attr-defined]
_TorchTCPStore: Any = tdc.TCPStore  # type: ignore[attr-defined]

log = logging.getLogger(__name__)


class _Released:
    """What a released ``TorchStore`` holds instead of torch's store."""

    def __getattr__(self, name: str) -> Any:
        raise DistError("the process group was destroyed: its store is no longer used")


class TorchStore(Store):
    """A torch ``Store`` (the one ``init_process_group`` made for the group) as a tdist one."""

    def __init__(self, store: Any) -> None:
        super().__init__(store.timeout)
        self._s = store

    def release(self) -> None:
        """Let go of torch's store (its group was destroyed): whatever still holds this object
        (a reference cycle that only the garbage collector breaks) no longer keeps torch's
        store, whose server on rank 0 would go on serving its port, and a program that forms
        its group again on that port would have its other ranks read the old group's keys."""
        self._s = _Released()

    def set(self, key: str, value: str | bytes) -> None:
        self._s.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._s.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._s.add(key, amount))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return bytes(self._s.compare_set(key, expected_value, desired_value))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._s.wait(list(keys))
        else:
            self._s.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._s.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._s.delete_key(key))

    def num_keys(self) -> int:
        return int(self._s.num_keys())

    def clone(self) -> Store:
        """A new connection to the same torch store (for a thread that blocks in ``wait``)."""
        return TorchStore(self._s.clone())

    def _torch_store(self) -> Any:
        return self._s


class _ServerWatch:
    """A connection of this rank's own to the server of torch's store (on rank 0), idle, kept
    from the forming of torch's default group so as to see that server go: the server closes
    it as it stops (torch's ``destroy_process_group`` lets go of the store on rank 0).

    torch's ``init_process_group`` forms the group again on the same port with a new store
    whose server is on rank 0 again; a rank that got there while rank 0 was still destroying
    the old group joined the old server (torch's client takes whichever server answers),
    read the old group's keys and failed, or hung with rank 0 waiting for it on the new one.
    So a rank's destroy of the default group waits here until rank 0's server has gone
    (``wait_gone``). Opened when the group is formed, not when it is destroyed: by then rank
    0 may have formed the next group, whose server would answer. A plain socket: torch's own
    client on a closed connection logs a warning with a C++ stack.
    """

    def __init__(self, host: str, port: int) -> None:
        self.address = f"{host}:{port}"
        self._sock: socket.socket | None = socket.create_connection((host, port), timeout=5.0)

    @classmethod
    def open(cls, store: Any, rank: int) -> _ServerWatch | None:
        """A watch on the server of ``store`` (torch's store of the default group being
        formed, on rank ``rank``); ``None`` where there is nothing to watch: on rank 0, which
        hosts the server; for a store that is not a ``TCPStore``; when torchelastic's agent
        hosts it (it outlives the group); or if it cannot be reached."""
        if rank == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return None
        base = store
        while isinstance(base, _TorchPrefixStore):
            base = base.underlying_store
        if not isinstance(base, _TorchTCPStore):
            return None
        try:
            return cls(base.host, base.port)
        except OSError:
            return None

    def gone(self) -> bool:
        """Whether the server has closed this connection, now (never waits)."""
        sock = self._sock
        if sock is None:
            return True
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False
            return not sock.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):
            return True

    def wait_gone(self, timeout: float) -> bool:
        """Wait until the server has closed this connection (it stopped), at most ``timeout``
        seconds. Returns whether it has; the connection is closed either way."""
        sock, self._sock = self._sock, None
        if sock is None:
            return True
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                sock.settimeout(left)
                if not sock.recv(64):  # (the server never writes to a client that said nothing)
                    return True
        except TimeoutError:
            return False
        except OSError:  # (reset: gone as well)
            return True
        finally:
            sock.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


# how long a rank's destroy of torch's default group waits for rank 0's store server to go
_SERVER_GONE_WAIT = 10.0


def _formation(store: TorchStore, rank: int) -> Store:
    """The namespace of this formation of a group in torch's store ``store``: a store that
    outlives a group (torchelastic's agent store) sees the group formed again under the same
    name after ``destroy_process_group`` (torch names groups from 0 again), and a rank there
    would read the addresses its peers left the time before. Each rank counts the times it
    formed a group on ``store`` (every rank forms it as often, so they agree); the first
    formation keeps the plain namespace."""
    n = int(store.add(f"tdist_formation/rank_{rank}", 1))
    return store if n == 1 else PrefixStore(f"tdist_formation_{n}/", store)


class StoreForTorch(_TorchStore):  # type: ignore[misc]
    """A tdist ``Store`` as a torch one (what torch's default group gets when tdist made it)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self._s = store

    def set(self, key: str, value: Any) -> None:
        self._s.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._s.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._s.add(key, amount)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._s.compare_set(key, _bytes(expected_value), _bytes(desired_value))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._s.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._s.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._s.delete_key(key)

    def num_keys(self) -> int:
        return self._s.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._s.set_timeout(timeout)


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Held:
    """The small ``TorchWork``s kept alive here until they are used.

    torch's C++ code may keep a work that Python code handed it while Python drops it: DDP's
    reducer keeps the one-element all-reduce of ``Join`` until its backward pass waits on it,
    then reads its future. pybind finds a Python subclass's methods only while its Python
    object lives; without it the base class's ``wait`` waits for ever and its ``get_future``
    raises. So a work whose outputs are small (at most ``_SMALL`` bytes: a control message,
    which is what torch's C++ keeps) stays here until it has been waited on or its future
    taken, and then for ``_AFTER`` works more (the reducer reads the future right after its
    wait, with the interpreter lock let go in between); small works nobody uses (fire and
    forget) are let go, oldest completed first, past ``_UNUSED``. A work with larger outputs is
    never kept beyond Python's references, so no tensor lives longer than under gloo but a
    few small ones.
    """

    _SMALL = 64 << 10
    _AFTER = 16
    _UNUSED = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: dict[int, TorchWork] = {}
        self._last_use: dict[int, int] = {}  # id -> the made-count at its last use
        self._uses: collections.deque[tuple[int, int]] = collections.deque()  # (made-count, id)
        self._made = 0
        self._scan_at = self._UNUSED  # (the held count at which unused ones are looked at)

    def add(self, work: TorchWork, outputs: Any) -> None:
        if not _small(outputs, self._SMALL):
            return
        key = id(work)
        with self._lock:
            made = self._made = self._made + 1
            self._last_use.pop(key, None)  # (an id of a work gone before: not this one's uses)
            self._works[key] = work
            uses = self._uses
            while uses and uses[0][0] <= made - self._AFTER:
                when, old = uses.popleft()
                if self._last_use.get(old) == when:  # (not used again since)
                    del self._last_use[old]
                    self._works.pop(old, None)
            if len(self._works) >= self._scan_at:
                done = [k for k, w in self._works.items() if k not in self._last_use and w._work.is_completed()]
                for k in done[: len(self._works) - self._UNUSED // 2]:
                    del self._works[k]
                self._scan_at = max(self._UNUSED, 2 * len(self._works))

    def used(self, work: TorchWork) -> None:
        key = id(work)
        with self._lock:
            if key in self._works and self._last_use.get(key) != self._made:
                self._last_use[key] = self._made
                self._uses.append((self._made, key))


def _small(outputs: Any, limit: int) -> bool:
    """Whether the tensors in ``outputs`` (nested lists) add up to at most ``limit`` bytes."""
    total, stack = 0, [outputs]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()  # (a sparse tensor: its dense size)
            if total > limit:
                return False
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return True


_held = _Held()


_M = TypeVar("_M", bound=Callable[..., Any])


def _skips_meta(method: _M) -> _M:
    """``method``, doing nothing on tensors on the meta device (a completed work), as torch's
    meta kernels of gloo's operations."""
    return meta_noop(method, lambda name, kwargs: TorchWork(T.Work.completed([], name), []))


class TorchWork(_TorchWork):  # type: ignore[misc]
    """A tdist ``Work`` as torch's: what torch's functions and modules wait on (kept alive
    until waited for: see ``_Held``)."""

    def __init__(self, work: T.Work, outputs: Any) -> None:
        super().__init__()
        self._work = work
        self._outputs = outputs
        self._fut: Any = None  # completed with the outputs, or a _Failed
        self._out: Any = None  # the future handed out: the outputs, or the failure as its error
        self._lock = threading.Lock()
        self._settler: int | None = None  # the thread completing the future
        self._settled: threading.Event | None = None  # (made with the future)
        _held.add(self, outputs)

    def wait(self, timeout: timedelta = _UNSET) -> bool:
        self._work.wait(timeout if timeout else None)
        if self._fut is not None:
            self._settle()  # (the future is done when wait returns, not a moment later)
        _held.used(self)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def _source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        """Nothing to do: the tensors are CPU tensors, written when the work completes."""

    def result(self) -> list[torch.Tensor]:
        """The output tensors, once done (torch's deprecated ``Work.result``)."""
        self.wait()
        out = self._outputs
        return [t for x in out for t in (x if isinstance(x, list) else [x])]

    def _get_op_type(self) -> int:
        return self._work._get_op_type()

    def get_future_result(self) -> Any:
        """How the work ended, as torch's ``WorkResult`` int (see ``Work.get_future_result``)."""
        _held.used(self)
        return self._work.get_future_result()

    def get_future(self) -> Any:
        """Completed with the output tensors (torch's DDP reads ``value()[0]``), or the error."""
        with self._lock:
            if self._fut is None:
                self._settled = threading.Event()
                self._fut = torch.futures.Future()
                # (a failure must reach torch's C++ side as the future's error: DDP's reducer
                # reads the value of a future that ``set_exception`` completed as a tensor
                # list, and crashes. An exception raised in a ``then`` callback is such an
                # error, so the future handed out is this one's continuation.)
                self._out = self._fut.then(_unwrap)
                done = self._work.is_completed()
                if not done:
                    # (completed from a thread of its own: the future's callbacks, DDP's next
                    # bucket among them, must not run in the backend's thread that finished it)
                    self._work.add_done_callback(lambda _w: _completers.complete(self))
            else:
                done = False
            out = self._out
        _held.used(self)
        if done:  # (as torch's: after wait(), the future is done; no callback of the user's yet)
            self._settle()
        return out

    def _settle(self) -> None:
        """Complete the future once the work is done (once; outside the lock: the future's
        callbacks, DDP's bucket hooks among them, run in this call and may come back here).
        A second caller waits until the first one has completed it, unless it is that one."""
        with self._lock:
            fut = self._fut
            if fut is None or not self._work.is_completed():
                return
            if self._settler is not None:
                settled, mine = self._settled, self._settler == threading.get_ident()
            else:
                self._settler = threading.get_ident()
                settled = None
        if settled is not None:
            if not mine:
                settled.wait()
            return
        assert self._settled is not None
        try:
            exc = self._work.exception()
            fut.set_result(self._outputs if exc is None else _Failed(exc))
        finally:
            self._settled.set()


def _flat(outputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """What gloo's future gives for a gather into lists (``all_gather``, ``gather``): the
    output tensors themselves, in one flat list (not a list per input)."""
    return [t for outs in outputs for t in outs]


def _blocks(output: torch.Tensor, size: int) -> list[torch.Tensor]:
    """What gloo's future gives for ``all_gather_into_tensor``: ``output`` cut along its
    first dimension into one view per rank (a stacked output: views of one row each)."""
    return list(output.chunk(size)) if output.dim() else [output]


class _Failed:
    """A failed work's exception, as the value of the inner future (see ``get_future``)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _unwrap(fut: Any) -> Any:
    value = fut.value()
    if isinstance(value, _Failed):
        raise fresh(value.exc)  # (the future keeps its own: see ``fresh``)
    return value


class _Completers:
    """Threads that complete the futures of finished works, one free thread for each future.

    A future's callbacks run in the thread that completes it, and some block on another
    future (PowerSGD's hook waits, inside a callback, for the all-reduce it has just started):
    a future must never queue behind a callback that waits for it. So a finished work takes
    an idle thread if there is one and starts a new one if not; a thread goes back to idle
    once its callbacks return (as many threads as callbacks ever blocked at once).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TorchWork] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting on the queue and not yet promised to a work

    def complete(self, work: TorchWork) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # (promised to this work)
        if not start:
            self._queue.put(work)
            return
        try:
            threading.Thread(target=self._run, args=(work,), name="tdist-torch-futures", daemon=True).start()
        except RuntimeError:  # (no thread to be had: at interpreter exit, or at the thread limit)
            work._settle()

    def _run(self, first: TorchWork) -> None:
        first._settle()
        while True:
            with self._lock:
                self._idle += 1
            self._queue.get()._settle()


_completers = _Completers()


def _forget_completer() -> None:
    global _completers, _held
    _completers = _Completers()  # (a forked child has none of its parent's threads)
    _held = _Held()  # (nor its lock's holder)


os.register_at_fork(after_in_child=_forget_completer)


_FIELDS: dict[tuple[type, type], tuple[str, ...]] = {}
_RED_OPS = {int(op): op for op in T.RedOpType}


def _opts(cls: type[T._Options], torch_opts: Any) -> Any:
    """tdist's options of class ``cls`` from torch's option object (same camelCase names).

    On every call's path (the 4-byte all-reduce pays it): the fields both classes have are
    found once per pair of classes, and a reduce op is looked up, not constructed."""
    out = cls()
    if torch_opts is None:
        return out
    kinds = (cls, type(torch_opts))
    names = _FIELDS.get(kinds)
    if names is None:
        names = _FIELDS[kinds] = tuple(
            n for n in ("reduceOp", "rootRank", "rootTensor", "timeout", "asyncOp")
            if hasattr(cls, n) and hasattr(torch_opts, n)
        )
    for name in names:
        value = getattr(torch_opts, name)
        if name == "reduceOp":
            value = _RED_OPS[int(getattr(value, "op", value))]
        elif name == "timeout" and (value is None or value <= _UNSET):
            continue  # (torch's "unset")
        setattr(out, name, value)
    return out


class TorchProcessGroup(SplitMerge, _TorchProcessGroup):  # type: ignore[misc]
    # (SplitMerge: torch's C++ split and merge ask a backend of torch's to split itself, and
    # crashed the process on this group; tdist makes the group)
    """One rank of a ``torch.distributed`` process group whose work runs on tdist."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, backend: Any = None) -> None:
        super().__init__(rank, size)
        self._torch_store = store if isinstance(store, _TorchStore) else None
        self._group_name = self._group_desc = ""
        self._timeout = timeout
        self._owned = backend is None  # (else tdist's own group: tdist stops it)
        # the adapters of torch's store made for this group (its backend's, tdist's handles'):
        # released when torch destroys the group (``TorchStore.release``)
        self._adapters: list[TorchStore] = []
        self._watch: _ServerWatch | None = None
        if backend is None:
            # (imported here: registering the backend costs no transport import)
            from ._tcp_backend import ProcessGroupTCP

            if not tdc.is_initialized():  # (torch's default group; before the mesh: see _ServerWatch)
                self._watch = _ServerWatch.open(store, rank)
            adapter = TorchStore(store)
            self._adapters.append(adapter)
            try:
                backend = ProcessGroupTCP(_formation(adapter, rank), rank, size, timeout)
            except BaseException:
                if self._watch is not None:
                    self._watch.close()
                raise
            rec = backend.flight_recorder
            if rec is not None:  # (the members' global ranks: torch knows them once it has the group)
                me = weakref.ref(self)
                rec.ranks_fn = lambda: tdc.get_process_group_ranks(me())
        self._b = backend

    _backend_name = BACKEND_NAME  # (the profiler's ranges: "tdist:all_reduce")
    _shown_name: str | None = None  # (the twin of a group tdist made: the backend its program named)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        """The backend's name, as torch's ``ProcessGroup.name()``: for torch's twin of a group
        that ``tdist.init_process_group("gloo")`` or ``tdist.new_group`` made, the backend the
        program named ("gloo"), as torch says of its own gloo group; else "tdist". (torch's own
        code reads ``getBackendName`` and ``get_backend``, which say "tdist": the group runs on
        tdist's backend.)"""
        return self._shown_name or BACKEND_NAME

    def _get_backend_name(self) -> str:
        """``name()``: torch's own code branches on it ("gloo": the group's tensors live on
        the CPU; SyncBatchNorm, ShardedTensor's device), as it does on its gloo group."""
        return self.name()

    # (a group written in Python registers no per-device backend with torch, whose Python code
    # asks for them: ``_get_pg_default_device`` (distributed checkpoints' state-dict loading),
    # ``_device_capability``, ``_set_pg_timeout``; this group is its own CPU backend)
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: Any = None) -> Any:
        if device is not None and torch.device(device).type != "cpu":
            raise RuntimeError(f"No backend type associated with device type {torch.device(device).type}")
        return self

    # (torch keeps a group's name and description on its backend; a group written in Python
    # keeps its own, and torch's DeviceMesh, DTensor and functional collectives look it up)
    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name
        if self._owned:
            self._identify(name=name)

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc
        if self._owned:
            self._identify(desc=desc)

    def _identify(self, name: str | None = None, desc: str | None = None) -> None:
        rec = getattr(self._b, "flight_recorder", None)
        if rec is not None:
            rec.identify(name, desc)

    @property
    def backend(self) -> Any:
        """tdist's backend under this group."""
        return self._b

    def __repr__(self) -> str:
        return f"TorchProcessGroup(tdist, rank={self.rank()}, size={self.size()})"

    # -- collectives ---------------------------------------------------------------------------
    @_skips_meta
    @profiled("broadcast", "broadcast_")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        _check("broadcast", tensors)
        return TorchWork(self._b.broadcast(_d(tensors), _opts(T.BroadcastOptions, opts)), tensors)

    @_skips_meta
    @profiled("all_reduce", "allreduce_")
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        if opts is not None and not hasattr(opts, "reduceOp"):  # allreduce(tensors, op)
            opts = _with_op(opts)
        if len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:  # (as gloo)
            o = _opts(T.AllreduceOptions, opts)
            sparse_all_reduce(tensors[0], o.reduceOp, self.size(), lambda outs, inp: self._b.allgather([outs], [inp]).wait())
            return TorchWork(T.Work.completed(tensors, "allreduce"), tensors)
        _check("allreduce", tensors)
        return TorchWork(self._b.allreduce(_d(tensors), _opts(T.AllreduceOptions, opts)), tensors)

    @_skips_meta
    @profiled("all_reduce", "allreduce_coalesced_")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        _check("allreduce_coalesced", tensors)
        o = _opts(T.AllreduceOptions, opts)
        return _all(tensors, [self._b.allreduce([t], o) for t in _d(tensors)])

    @_skips_meta
    @profiled("reduce", "reduce_")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        _check("reduce", tensors)
        return TorchWork(self._b.reduce(_d(tensors), _opts(T.ReduceOptions, opts)), tensors)

    @_skips_meta
    @profiled("all_gather", "allgather_")
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        _check("allgather", inputs, *outputs)
        work = self._b.allgather(_dd(outputs), inputs, _opts(T.AllgatherOptions, opts))
        return TorchWork(work, _flat(outputs))

    @_skips_meta
    @profiled("all_gather", "_allgather_base_")
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TorchWork:
        _check("all_gather_into_tensor", [output, input])
        work = self._b._allgather_base(_d([output])[0], input, _opts(T.AllgatherOptions, opts))
        return TorchWork(work, _blocks(output, self.size()))

    @profiled("all_gather", "allgather_into_tensor_coalesced_")
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        return _pairwise(self._b._allgather_base, outputs, inputs, _opts(T.AllgatherOptions, opts))

    @_skips_meta
    @profiled("gather", "gather_")
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        _check("gather", inputs, *outputs)
        return TorchWork(self._b.gather(_dd(outputs), inputs, _opts(T.GatherOptions, opts)), _flat(outputs))

    @_skips_meta
    @profiled("scatter", "scatter_")
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> TorchWork:
        _check("scatter", outputs, *inputs)
        return TorchWork(self._b.scatter(_d(outputs), inputs, _opts(T.ScatterOptions, opts)), outputs)

    @_skips_meta
    @profiled("reduce_scatter", "reduce_scatter_")
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> TorchWork:
        _check("reduce_scatter", outputs, *inputs)
        return TorchWork(self._b.reduce_scatter(_d(outputs), inputs, _opts(T.ReduceScatterOptions, opts)), outputs)

    @_skips_meta
    @profiled("reduce_scatter", "_reduce_scatter_base_")
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TorchWork:
        _check("reduce_scatter_tensor", [output, input])
        o = _opts(T.ReduceScatterOptions, opts)
        return TorchWork(self._b._reduce_scatter_base(_d([output])[0], input, o), [output])

    @profiled("reduce_scatter", "reduce_scatter_tensor_coalesced_")
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        return _pairwise(self._b._reduce_scatter_base, outputs, inputs, _opts(T.ReduceScatterOptions, opts))

    @_skips_meta
    @profiled("all_to_all", "alltoall_")
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        _check("all_to_all", outputs, inputs)
        return TorchWork(self._b.alltoall(_d(outputs), inputs, _opts(T.AllToAllOptions, opts)), outputs)

    @_skips_meta
    @profiled("all_to_all", "alltoall_base_")
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> TorchWork:
        _check("all_to_all_single", [output, input])
        o = _opts(T.AllToAllOptions, opts)
        return TorchWork(self._b.alltoall_base(_d([output])[0], input, output_split_sizes, input_split_sizes, o), [output])

    @profiled("barrier", "barrier")
    def barrier(self, opts: Any = None) -> TorchWork:
        return TorchWork(self._b.barrier(_opts(T.BarrierOptions, opts)), [])

    @profiled("monitored_barrier", "monitored_barrier_")
    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        o = T.BarrierOptions()
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            o.timeout = timeout
        self._b.monitored_barrier(o, wait_all_ranks)

    @_skips_meta
    @profiled("all_gather", "allgather_coalesced_")
    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """``outputs[r][i]`` receives rank r's ``inputs[i]``: one ``all_gather`` for each input."""
        _check("allgather_coalesced", inputs, *outputs)
        if len(outputs) != self.size():
            raise CollectiveArgumentError(
                f"allgather_coalesced: {len(outputs)} output lists for a group of {self.size()} "
                "ranks: give one list per rank"
            )
        for r, out in enumerate(outputs):
            if len(out) != len(inputs):
                raise CollectiveArgumentError(
                    f"allgather_coalesced: output list {r} holds {len(out)} tensors for "
                    f"{len(inputs)} inputs: each rank's list holds one tensor per input"
                )
        o = _opts(T.AllgatherOptions, opts)
        works = [self._b.allgather([_d([out[i] for out in outputs])], [inp], o) for i, inp in enumerate(inputs)]
        return _all(outputs, works)  # (the future's value, as gloo's: the lists, one per rank)

    # torch's Python-facing names of the same operations (``all_gather_into_tensor``,
    # ``reduce_scatter_tensor``, ``all_to_all_single`` and the coalescing manager call these)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- point to point ------------------------------------------------------------------------
    @_skips_meta
    @profiled("send", "send")
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> TorchWork:
        _check("send", tensors)
        return TorchWork(self._b.send(tensors, dst, tag), tensors)

    @_skips_meta
    @profiled("recv", "recv_")
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> TorchWork:
        _check("recv", tensors)
        return TorchWork(self._b.recv(_d(tensors), src, tag), tensors)

    @_skips_meta
    @profiled("recvAnySource", "recv_any_source_")
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TorchWork:
        _check("recv", tensors)
        return TorchWork(self._b.recv_anysource(_d(tensors), tag), tensors)

    # -- lifetime ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._owned:
            self._b.shutdown()
            self._torch_store = None  # (see ``TorchStore.release``)
            for adapter in self._adapters:
                adapter.release()
            self._wait_for_store_server()

    def _wait_for_store_server(self) -> None:
        """On a rank but 0, the default group's destroy returns once rank 0's server of torch's
        store has gone (see ``_ServerWatch``), or after ``_SERVER_GONE_WAIT`` seconds. Not for a
        store the program gave (``init_process_group(store=...)``): the program keeps it."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        if tdc.distributed_c10d._default_pg_init_method is None:  # (store=...: not torch's to let go)
            watch.close()
            return
        if not watch.wait_gone(_SERVER_GONE_WAIT):
            # (info: a program whose rank 0 works on before it destroys its group is common,
            # one that forms the group again on the same port rare)
            log.info(
                "rank %d: rank 0 still serves torch's store at %s %g s after this rank destroyed "
                "the default group (has rank 0 destroyed it?); a group formed again on that port "
                "before it does may find the old group's keys",
                self.rank(), watch.address, _SERVER_GONE_WAIT,
            )

    def abort(self) -> None:
        self._b.abort()

    def get_group_store(self) -> Any:
        """The store torch made the group with (torch's C++ keeps none for a group written in
        Python: it gave None)."""
        return self._torch_store

    # (torch's C++ versions of these three look for a backend of torch's: they raised here)
    @property
    def use_pg_for_symm_mem_rendezvous(self) -> bool:
        return False

    def _get_sequence_number_for_group(self) -> int:
        """How many operations the group has numbered (the same on every rank)."""
        return int(getattr(self._b, "_seq", 0))

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to do: tdist's backend numbers its operations from its start."""

    def _set_default_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._b.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        """The default deadline of the group's operations."""
        return self._timeout


def _with_op(op: Any) -> Any:
    o = tdc.AllreduceOptions()
    o.reduceOp = op
    return o


def _all(outputs: Any, works: list[T.Work]) -> TorchWork:
    """One torch Work for several of ours (a coalesced call): done when all are, without
    waiting in the caller."""
    return TorchWork(chain_work(works, "coalesced", lambda: []), outputs)


def _pairwise(op: Callable[..., T.Work], outputs: list[torch.Tensor], inputs: list[torch.Tensor], o: Any) -> TorchWork:
    """``op(output, input, options)`` for each pair, as one Work."""
    return _all(outputs, [op(out, inp, o) for out, inp in zip(_d(outputs), inputs, strict=True)])


_adopting: Any = None  # a tdist backend the next group torch asks for is to run on


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> TorchProcessGroup:
    global _adopting
    backend, _adopting = _adopting, None
    return TorchProcessGroup(store, rank, size, timeout, backend)


_mirrored: Any = None  # (tdist's default group, torch's default group that runs on it, its store)


def mirror_default_group(pg: Any, store: Store, timeout: timedelta, ranks: list[int] | None = None) -> Any:
    """Make torch's default group run on tdist's default group ``pg`` (same ranks, same
    transport, no new connection), so that ``torch.distributed``'s functions, and torch's own
    modules that call them (DDP, ``DistributedSampler``), reach the group a program made with
    ``tdist.init_process_group``. Nothing is done if torch has a default group already.

    Returns:
        torch's default group, or ``None`` if torch had one already.
    """
    global _mirrored, _adopting
    register()
    if tdc.is_initialized():
        return None
    _adopting = pg._get_backend()
    # (kept for as long as torch's group: torch's C++ side holds it, and pybind finds its Python
    # methods only while the Python object lives; without them torch's store would be the bare
    # base class, and torch's own new_group would fail on it)
    for_torch = StoreForTorch(store)
    try:
        tdc.init_process_group(BACKEND_NAME, store=for_torch, rank=pg.rank(), world_size=pg.size(), timeout=timeout, _ranks=ranks)
    finally:
        _adopting = None
    _mirrored = (pg, tdc.distributed_c10d._get_default_group(), for_torch)
    _mirrored[1]._shown_name = pg.name()
    return _mirrored[1]


def mirror_group(pg: Any, members: list[int], timeout: timedelta, desc: str | None, local: bool) -> Any:
    """torch's twin of the sub-group tdist's ``new_group(members)`` just made, running on the
    same backend (``pg``; ``None`` on a rank outside it): what tdist's ``new_group`` hands out,
    so that torch's modules (``DistributedDataParallel(process_group=...)``, FSDP) take it.
    Every rank calls it in the same order, as torch's ``new_group`` (only the members, if
    ``local``).

    Returns:
        The twin; torch's non-member value on a rank outside the group.
    """
    global _adopting
    _adopting = None if pg is None else pg._get_backend()
    try:
        twin = tdc.new_group(
            members, timeout=timeout, backend=BACKEND_NAME, use_local_synchronization=local, group_desc=desc
        )
    finally:
        _adopting = None
    if isinstance(twin, TorchProcessGroup) and pg is not None:
        twin._shown_name = pg.name()
    return twin


def forget_default_group(pg: Any) -> None:
    """``pg``, tdist's default group, is being destroyed: so is torch's, if it runs on it."""
    global _mirrored
    if _mirrored is None or _mirrored[0] is not pg:
        return
    torch_pg, store, _mirrored = _mirrored[1], _mirrored[2], None
    if tdc.is_initialized() and tdc.distributed_c10d._get_default_group() is torch_pg:
        tdc.destroy_process_group()
    del store  # (only now: torch's destroy may still use it)


def handle_on(group: Any) -> tuple[ProcessGroup, GroupInfo] | None:
    """tdist's handle on torch's group ``group`` if it runs on tdist (torch's own
    ``init_process_group("tdist")`` or ``new_group(backend="tdist")`` made it): a
    ``ProcessGroup`` on the same backend, so that tdist's functions take torch's group (the
    reverse of ``mirror_default_group``), and its entry for the world's registry. ``None`` for
    another backend's group, or one torch no longer knows.
    """
    if not isinstance(group, TorchProcessGroup):
        return None
    try:
        ranks = tdc.get_process_group_ranks(group)
        base = tdc.distributed_c10d._get_default_store()
    except (KeyError, ValueError, RuntimeError):  # (destroyed since)
        return None
    name = group.group_name
    adapter = TorchStore(base)
    group._adapters.append(adapter)
    store = PrefixStore(f"tdist/{name}/", adapter)
    pg = ProcessGroup(store, group.rank(), group.size())
    pg._set_group_name(name)
    pg._set_group_desc(group.group_desc)
    pg._set_backend(group.backend, BACKEND_NAME, group.timeout, None)
    try:  # (what torch says of it: "undefined" for a group formed with no backend named)
        named, config = str(tdc.get_backend(group)), tdc.get_backend_config(group)
    except (KeyError, ValueError, RuntimeError):
        named, config = BACKEND_NAME, f"cpu:{BACKEND_NAME}"
    info = GroupInfo(name, Backend(named), config, store, {g: i for i, g in enumerate(ranks)})
    return pg, info


def register() -> None:
    """Make ``"tdist"`` a backend of ``torch.distributed`` (for CPU tensors); idempotent. The
    one registration is ``import tdist``'s; this makes sure it has happened."""
    import tdist

    tdist._register_with_torch()


def _eager_under_compile() -> None:
    """Have ``torch.compile``'s frame evaluator leave tdist's groups alone, as
    ``torch.compiler.disable`` would (without importing dynamo, which ``import torch`` does
    not): their methods are called from torch's C++ (DDP's reducer rebuilds its buckets with a
    broadcast before a compiled forward), and dynamo, tracing them there, failed on the group
    ("Attempted to access unregistered member on an OpaqueObject"). Every operation of tdist's
    runs eagerly, its callees too (``_profiling.profiled``'s wrapper is every operation's entry)."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # (another torch: nothing to mark)
        return
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    codes = [profiled("", "")(lambda self: None).__code__]
    for cls in (TorchProcessGroup, TorchWork, StoreForTorch, TorchStore):
        for value in vars(cls).values():
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
            if code is not None:
                codes.append(code)
    for code in codes:
        set_code_exec_strategy(code, skip)


_eager_under_compile()
