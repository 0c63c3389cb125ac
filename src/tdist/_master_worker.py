"""torch 0.3's master-worker mode (``init_master_worker``), built on tdist's RPC.

Theory of operation. Every rank calls ``init_master_worker``. Rank 0, the master, runs the
program; ranks 1..N-1, the workers, serve it. All ranks meet once through the ``init_method``
(a rendezvous whose store, under ``tdist/master_worker/<group_name>``, also forms the workers'
process group), then join an RPC group named ``master``, ``worker1``, ``worker2``... The master
then asks every worker, over RPC, to form a process group of the workers alone (worker ``r``
is rank ``r - 1`` there) and returns once they all have; a worker returns to nothing: it
serves in ``rpc.shutdown()`` (torch's graceful shutdown, which waits for every worker) until
the master shuts the job down, destroys its group, and ends its process (``SystemExit``).

A ``RemoteTensor`` on the master is an ``RRef`` to a tensor owned by a worker. Each operation
on it is one ``rpc_sync`` to the worker that owns the data (``_execute``): the arguments'
``RemoteTensor`` are replaced there by their values (copied worker to worker when another
worker owns one), the function runs, and each tensor of the result is kept there and sent back
as a new ``RemoteTensor`` (an ``RRef`` the worker makes, so the data never passes through the
master); a result tensor that is one of the arguments (an in-place method) comes back as the
master's own handle. Everything else in a result (numbers, ``torch.Size``, dtypes, strings)
comes back by value. Collectives among workers are sent to every worker that holds one of
their tensors at once, and run on the workers' process group (or on a sub-group the master
had every worker make, once, for that set of workers); the master runs one at a time, so every
worker sees them in one order.

Thread safety: the master's functions and ``RemoteTensor`` may be used from several threads
(collectives are serialized by one lock). A worker runs each request in an RPC thread.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ._core.errors import DistError, PeerError
from .c10d._types import RedOpType, ReduceOp, as_red_op

if TYPE_CHECKING:
    from .rpc._rref import RRef
    from .store import Store

__all__ = [
    "RemoteTensor",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "fetch",
    "gather",
    "init_master_worker",
    "on_each_worker",
    "reduce",
    "remote_tensor",
    "run",
    "shutdown",
    "spread",
    "tensor",
    "workers",
]

log = logging.getLogger(__name__)

# torch 0.3's words (torch/distributed/__init__.py, init_master_worker)
EXPERIMENTAL_WARNING = """
    ================================================================================
                                        WARNING
    ================================================================================
    Master-worker mode is still experimental. The API will change without
    notice and we're can't guarantee full correctness and expected performance yet.
    We'll announce it once it's ready.
    """

MASTER = "master"
_PREFIX = "tdist/master_worker"
_TWICE = "trying to initialize torch.distributed twice!"


def worker_name(rank: int) -> str:
    """The RPC name of worker ``rank`` (``worker1``, ...); the master is ``master``."""
    return MASTER if rank == 0 else f"worker{rank}"


# -- the job's state on this process -------------------------------------------------------------
@dataclass
class _Job:
    rank: int
    world_size: int
    store: Store  # the rendezvous's, under the job's prefix
    raw_store: Store  # the rendezvous's own (closed at the end)
    group_name: str
    # master: sub-groups of workers made so far, by their sorted ranks (of the whole job)
    subgroups: set[tuple[int, ...]] = field(default_factory=set)
    collective_lock: threading.Lock = field(default_factory=threading.Lock)
    # worker: its sub-groups, by the same key
    groups: dict[tuple[int, ...], Any] = field(default_factory=dict)


_job: _Job | None = None
_job_lock = threading.Lock()


def _master() -> _Job:
    job = _job
    if job is None or job.rank != 0:
        raise RuntimeError(
            "tdist master-worker mode is not running on this process: call "
            "tdist.init_master_worker(...) first (its API is the master's, rank 0)"
        )
    return job


def _worker_job() -> _Job:
    job = _job
    if job is None or job.rank == 0:
        raise RuntimeError("tdist master-worker: this process is not a worker of a master-worker job")
    return job


def _rpc() -> Any:
    from . import rpc

    return rpc


def _already_initialized() -> str | None:
    """What makes a second ``init_master_worker`` here an error, if anything."""
    from .c10d._world import is_initialized

    if _job is not None:
        return "master-worker mode is already running"
    if is_initialized():
        return "the default process group is initialized (init_process_group)"
    if _rpc()._is_current_rpc_agent_set():
        return "RPC is initialized (init_rpc)"
    return None


# -- init and shutdown ---------------------------------------------------------------------------
def init_master_worker(
    backend: str,
    init_method: str = "env://",
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
    *,
    timeout: timedelta | None = None,
) -> None:
    """Start torch 0.3's master-worker mode (experimental, as it was: warns so).

    Rank 0, the master, returns and runs the program; it makes and uses tensors on the workers
    through ``tdist.master_worker`` (``remote_tensor``, ``spread``, ``all_reduce``, ...). Every
    other rank is a worker: the call serves the master and never returns; once the master shuts
    the job down (``tdist.master_worker.shutdown()``, or at the master's exit) the worker's
    process exits with status 0 (``SystemExit(0)``), or with a message and status 1 when the
    master or another worker was lost first.

    Args:
        backend: the workers' process group backend (``"tcp"``, ``"gloo"``: tdist's tcp
            backend), used by the collectives among workers.
        init_method: how the ranks meet: ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``,
            ``RANK``, ``WORLD_SIZE``; what ``tdist run`` sets), ``tcp://host:port`` (rank 0's
            host) or ``file:///path``.
        world_size: the number of processes, master included (at least 2); -1: from the
            ``init_method``.
        rank: this process's rank; -1: from the ``init_method``.
        group_name: names the job in its store (two jobs may share one store).
        timeout: the RPC timeout of the master's calls and the workers' group timeout
            (default: RPC's 60 s, the group's 30 minutes).

    Raises:
        RuntimeError: torch.distributed (a process group, RPC or master-worker mode) is
            initialized already ("trying to initialize torch.distributed twice!"); a worker
            could not make the workers' process group (raised on the master, naming it).
        ValueError: a world size below 2, or a rendezvous error.
        AssertionError: an unknown backend (torch's type); RuntimeError: a backend tdist does
            not have (NCCL, MPI...), on every rank before anything else.
    """
    global _job
    warnings.warn(EXPERIMENTAL_WARNING, UserWarning, stacklevel=2)
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"init_master_worker: timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    from .c10d._backend_config import Backend
    from .c10d._lifecycle import _creator_for
    from .store._prefix import PrefixStore
    from .store._rendezvous import rendezvous
    from .store._tcp import serving_in_a_thread

    _creator_for(Backend(backend), None)  # (a backend the workers cannot make fails here, on every rank)
    with _job_lock:
        why = _already_initialized()
        if why is not None:
            raise RuntimeError(f"{_TWICE} ({why})")
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        with serving_in_a_thread():  # (rank 0's store is busy only while groups form)
            store, rank, world_size = next(rendezvous(init_method, rank, world_size, **kwargs))
        if world_size < 2:
            close = getattr(store, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            raise ValueError(
                f"init_master_worker: world_size {world_size}: the job needs a master (rank 0) "
                "and at least one worker"
            )
        job = _Job(rank, world_size, PrefixStore(f"{_PREFIX}/{group_name}", store), store, group_name)
        _job = job
    rpc = _rpc()
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    if timeout is not None:
        options.rpc_timeout = timeout.total_seconds()
    try:
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    except BaseException:
        _forget(job)
        raise
    if rank != 0:
        _serve(job)
    try:
        futures = [
            rpc.rpc_async(worker_name(r), _form_worker_group, args=(backend, timeout))
            for r in range(1, world_size)
        ]
        for r, fut in enumerate(futures, start=1):
            try:
                fut.wait()
            except Exception as exc:
                exc.add_note(f"tdist master-worker: worker{r} (rank {r}) could not join the workers' process group")
                raise
    except BaseException:
        with contextlib.suppress(Exception):
            rpc.shutdown(graceful=False)
        _forget(job)
        raise
    atexit.register(_shutdown_at_exit)
    log.info("master-worker: master of %d workers (group %r)", world_size - 1, group_name)


def _forget(job: _Job) -> None:
    global _job
    with _job_lock:
        if _job is job:
            _job = None
    close = getattr(job.raw_store, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


def _serve(job: _Job) -> NoReturn:
    """A worker: serve until the master shuts the job down, then end the process."""
    from .c10d._lifecycle import destroy_process_group
    from .c10d._world import is_initialized

    name = worker_name(job.rank)
    log.info("master-worker: %s (rank %d) serves the master", name, job.rank)
    failure: str | None = None
    try:
        _rpc().shutdown()  # graceful: returns once the master (and every worker) shut down
    except DistError as exc:  # the master or another worker was lost
        failure = str(exc)
    finally:
        if is_initialized():
            with contextlib.suppress(Exception):
                destroy_process_group()
        _forget(job)
    if failure is not None:
        raise SystemExit(
            f"tdist master-worker: {name} (rank {job.rank}) ends: the master (rank 0) or another "
            f"worker was lost before the master shut the job down: {failure}"
        )
    raise SystemExit(0)


def _form_worker_group(backend: str, timeout: timedelta | None) -> None:
    """On a worker, asked by the master: join the workers' process group."""
    from .c10d._lifecycle import init_process_group
    from .store._prefix import PrefixStore

    job = _worker_job()
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    init_process_group(
        backend,
        store=PrefixStore("workers", job.store),
        rank=job.rank - 1,
        world_size=job.world_size - 1,
        group_name=job.group_name,
        **kwargs,
    )


def shutdown() -> None:
    """End the master-worker job (the master's side): every worker's ``init_master_worker``
    ends its process, and the master's RPC stops. Runs at the master's exit if not called;
    calling it again does nothing.

    Raises:
        PeerError: a worker was lost before the end (named); the job is shut down anyway.
    """
    job = _job
    if job is None or job.rank != 0:
        return
    atexit.unregister(_shutdown_at_exit)
    try:
        _rpc().shutdown()  # graceful: waits for the workers (and for the RRefs held here)
    finally:
        _forget(job)


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception as exc:  # (at exit: say it, nothing can be raised to)
        log.warning("tdist master-worker: shutdown at exit: %s", exc)


def workers() -> list[int]:
    """The workers' ranks (1 to world_size - 1).

    Raises:
        RuntimeError: not the master of a running master-worker job.
    """
    return list(range(1, _master().world_size))


def _worker_rank(worker: int | str) -> int:
    job = _master()
    if isinstance(worker, str):
        if not worker.startswith("worker") or not worker[6:].isdigit():
            raise ValueError(f"tdist master-worker: {worker!r} is no worker's name (worker1, worker2, ...)")
        rank = int(worker[6:])
    elif isinstance(worker, int) and not isinstance(worker, bool):
        rank = worker
    else:
        raise TypeError(f"tdist master-worker: worker must be a rank (int) or a name, got {type(worker).__name__}")
    if not 1 <= rank < job.world_size:
        raise ValueError(
            f"tdist master-worker: no worker {worker!r}: the workers are ranks 1 to {job.world_size - 1} "
            "(rank 0 is the master)"
        )
    return rank


# -- remote tensors ------------------------------------------------------------------------------
class RemoteTensor:
    """A tensor that lives on a worker; the master holds this handle.

    Methods and attributes of ``torch.Tensor`` run on the worker (``h.add_(1)``, ``h.sum()``,
    ``h.shape``, ``h[0]``, ``h + 1``), and so do torch functions given a handle
    (``torch.matmul(a, b)``, through ``__torch_function__``): on the worker of the first
    handle among the arguments, other workers' handles copied there. Tensors in a result stay
    on that worker (new handles; an in-place method returns this handle); anything else comes
    back. ``fetch()`` brings the value to the master. The value is freed when no handle to it
    is left (the ``RRef`` protocol). Handles may be sent in RPCs and to other workers.
    """

    __slots__ = ("__weakref__", "_rref", "_worker")

    def __init__(self, rref: RRef, worker: str) -> None:
        self._rref = rref
        self._worker = worker

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteTensor, (self._rref, self._worker))

    @property
    def rref(self) -> RRef:
        """The ``RRef`` to the value (owned by the worker)."""
        return self._rref

    @property
    def worker(self) -> str:
        """The name of the worker that holds the value (``worker1``, ...)."""
        return self._worker

    @property
    def worker_rank(self) -> int:
        """The rank of the worker that holds the value."""
        return int(self._worker[len("worker"):])

    def fetch(self) -> torch.Tensor:
        """A copy of the value on the master.

        Raises:
            PeerError: the worker was lost (named).
        """
        return _guard(self._worker, lambda: self._rref.to_here())  # type: ignore[no-any-return]

    def to_here(self) -> torch.Tensor:
        """``fetch()`` (the ``RRef`` spelling)."""
        return self.fetch()

    def __repr__(self) -> str:
        return f"RemoteTensor(on {self._worker})"

    def __getattr__(self, name: str) -> Any:
        # (dunder probes, by copy or pickle, and our own slots, unset while unpickling)
        if name.startswith("__") or name in ("_rref", "_worker"):
            raise AttributeError(name)
        static = inspect.getattr_static(torch.Tensor, name, _MISSING)
        if static is _MISSING:
            raise AttributeError(f"'RemoteTensor' object has no attribute {name!r} (torch.Tensor has none)")
        if callable(static):
            return _RemoteMethod(self, name)
        return _call(getattr, (self, name), {})  # an attribute: its value, read on the worker

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_rref", "_worker"):
            object.__setattr__(self, name, value)
            return
        _call(setattr, (self, name, value), {})

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _call(func, tuple(args), dict(kwargs or {}))

    def _method(self, name: str, *args: Any) -> Any:
        return _call(name, (self, *args), {})

    # Python looks operators up on the type: each one runs as the tensor's method of that name
    def __add__(self, other: Any) -> Any:
        return self._method("__add__", other)

    def __radd__(self, other: Any) -> Any:
        return self._method("__radd__", other)

    def __iadd__(self, other: Any) -> Any:
        return self._method("__iadd__", other)

    def __sub__(self, other: Any) -> Any:
        return self._method("__sub__", other)

    def __rsub__(self, other: Any) -> Any:
        return self._method("__rsub__", other)

    def __isub__(self, other: Any) -> Any:
        return self._method("__isub__", other)

    def __mul__(self, other: Any) -> Any:
        return self._method("__mul__", other)

    def __rmul__(self, other: Any) -> Any:
        return self._method("__rmul__", other)

    def __imul__(self, other: Any) -> Any:
        return self._method("__imul__", other)

    def __truediv__(self, other: Any) -> Any:
        return self._method("__truediv__", other)

    def __rtruediv__(self, other: Any) -> Any:
        return self._method("__rtruediv__", other)

    def __itruediv__(self, other: Any) -> Any:
        return self._method("__itruediv__", other)

    def __matmul__(self, other: Any) -> Any:
        return self._method("__matmul__", other)

    def __rmatmul__(self, other: Any) -> Any:
        return self._method("__rmatmul__", other)

    def __pow__(self, other: Any) -> Any:
        return self._method("__pow__", other)

    def __neg__(self) -> Any:
        return self._method("__neg__")

    def __abs__(self) -> Any:
        return self._method("__abs__")

    def __getitem__(self, key: Any) -> Any:
        return self._method("__getitem__", key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._method("__setitem__", key, value)

    def __len__(self) -> int:
        return int(self._method("__len__"))

    def __float__(self) -> float:
        return float(self._method("__float__"))

    def __int__(self) -> int:
        return int(self._method("__int__"))

    def __bool__(self) -> bool:
        return bool(self._method("__bool__"))


_MISSING = object()


class _RemoteMethod:
    """``handle.name``, a method of ``torch.Tensor``: calling it runs it on the worker."""

    __slots__ = ("_handle", "_name")

    def __init__(self, handle: RemoteTensor, name: str) -> None:
        self._handle = handle
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self._name, (self._handle, *args), kwargs)

    def __repr__(self) -> str:
        return f"<remote method Tensor.{self._name} of {self._handle!r}>"


@dataclass(frozen=True)
class _Same:
    """In a worker's result: the argument handle number ``index`` (the call returned its input)."""

    index: int


# -- walking arguments and results ---------------------------------------------------------------
def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every leaf, through lists, tuples (named ones and torch's
    ``return_types`` too) and dicts, in a fixed order (the master and the worker count handles
    alike)."""
    if isinstance(obj, list):
        return [_map(x, fn) for x in obj]
    if isinstance(obj, tuple):
        items = [_map(x, fn) for x in obj]
        if type(obj) is tuple:
            return tuple(items)
        if hasattr(type(obj), "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)  # torch.return_types and other struct sequences
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn)) for k, v in obj.items())
    return fn(obj)


def _handles(obj: Any) -> list[RemoteTensor]:
    found: list[RemoteTensor] = []

    def visit(x: Any) -> Any:
        if isinstance(x, RemoteTensor):
            found.append(x)
        return x

    _map(obj, visit)
    return found


def _local_value(handle: RemoteTensor) -> Any:
    """On a worker: the value of ``handle`` (copied here from its worker if it is elsewhere)."""
    rref = handle._rref
    return rref.local_value() if rref.is_owner() else rref.to_here()


def _execute(fn: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On a worker: run ``fn`` (a function, or the name of the first argument's method) on the
    arguments' values; keep the result's tensors here (see the module's docstring)."""
    inputs: list[Any] = []

    def value(x: Any) -> Any:
        if isinstance(x, RemoteTensor):
            v = _local_value(x)
            inputs.append(v)
            return v
        return x

    args, kwargs = _map((args, kwargs), value)
    if isinstance(fn, str):
        result = getattr(args[0], fn)(*args[1:], **kwargs)
    else:
        result = fn(*args, **kwargs)
    rpc = _rpc()
    me = rpc.get_worker_info().name

    def keep(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            for i, v in enumerate(inputs):
                if x is v:
                    return _Same(i)
            return RemoteTensor(rpc.RRef(x), me)
        return x

    return _map(result, keep)


def _guard(worker: str, call: Callable[[], Any]) -> Any:
    """Run ``call`` (RPCs to ``worker``); a lost worker's error says which worker, as master-worker
    mode knows it."""
    try:
        return call()
    except PeerError as exc:
        exc.add_note(f"tdist master-worker: the call to {worker} failed: the worker is lost, and its tensors with it")
        raise


def _call(
    fn: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any], worker: int | str | None = None
) -> Any:
    """On the master: run ``fn(*args, **kwargs)`` on ``worker`` (default: the worker of the first
    handle among the arguments); the result as ``_execute`` keeps it, with this side's handles
    for the arguments it returned."""
    handles = _handles((args, kwargs))
    if worker is not None:
        name = worker_name(_worker_rank(worker))
    elif handles:
        name = handles[0]._worker
    else:
        _master()
        raise ValueError("tdist master-worker: no RemoteTensor among the arguments: say which worker runs it (worker=)")
    rpc = _rpc()
    result = _guard(name, lambda: rpc.rpc_sync(name, _execute, args=(fn, args, kwargs)))
    return _map(result, lambda x: handles[x.index] if isinstance(x, _Same) else x)


def run(fn: Callable[..., Any], *args: Any, worker: int | str | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on a worker, with handles among the arguments replaced by
    their values; tensors of the result stay there (as ``RemoteTensor``), the rest comes back.

    Args:
        fn: a function the worker can import (module level), or a torch function.
        *args: its arguments; ``RemoteTensor`` on another worker are copied to this one.
        worker: the rank (or name) of the worker; default: the worker of the first handle.
        **kwargs: its keyword arguments.

    Returns:
        ``fn``'s result, its tensors as ``RemoteTensor``.

    Raises:
        ValueError: no worker given and no handle among the arguments, or no such worker.
        PeerError: the worker was lost (named). Whatever ``fn`` raised, with its type.
    """
    return _call(fn, args, kwargs, worker)


def remote_tensor(factory: Callable[..., torch.Tensor], *args: Any, worker: int | str, **kwargs: Any) -> RemoteTensor:
    """A tensor made on ``worker`` by ``factory(*args, **kwargs)`` (``torch.randn``, ...).

    Raises:
        TypeError: ``factory`` did not return a tensor. See ``run``.
    """
    return _as_handle(_call(factory, args, kwargs, worker), factory)


def _as_handle(result: Any, what: object) -> RemoteTensor:
    if not isinstance(result, RemoteTensor):
        raise TypeError(f"tdist master-worker: {what!r} returned {type(result).__name__}, not a tensor")
    return result


def _make_tensor(data: Any, **kwargs: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.to(**kwargs) if kwargs else data
    return torch.tensor(data, **kwargs)


def tensor(data: Any, *, worker: int | str, **kwargs: Any) -> RemoteTensor:
    """The value ``data`` (a tensor of the master's, or what ``torch.tensor`` takes) on ``worker``.

    Args:
        data: the value; a tensor is copied to the worker.
        worker: the rank (or name) of the worker.
        **kwargs: ``torch.tensor``'s (``dtype=``, ...).
    """
    if isinstance(data, torch.Tensor):
        data = data.detach().clone()  # (a view would travel with its whole storage)
    return _as_handle(_call(_make_tensor, (data,), kwargs, worker), "tensor")


def _futures_of(calls: Iterable[tuple[str, Any]]) -> list[Any]:
    """Send every ``(worker, future)`` call first, then wait for them in order; their values (a
    lost worker named)."""
    out = []
    for worker, fut in list(calls):  # (all sent before the first wait: collectives need all)
        out.append(_guard(worker, fut.wait))
    return out


def spread(data: torch.Tensor, dim: int = 0) -> list[RemoteTensor]:
    """Shard ``data`` along ``dim`` over all workers: shard ``i`` (``torch.tensor_split``) on
    worker ``i + 1``.

    Returns:
        One handle per worker, in worker order.
    """
    ranks = workers()
    rpc = _rpc()
    shards = torch.tensor_split(data.detach(), len(ranks), dim)
    calls = (
        (worker_name(r), rpc.rpc_async(worker_name(r), _execute, args=(_make_tensor, (s.clone(),), {})))
        for r, s in zip(ranks, shards, strict=True)
    )
    return [_as_handle(x, "spread") for x in _futures_of(calls)]


def on_each_worker(factory: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> list[RemoteTensor]:
    """``factory(*args, **kwargs)`` run on every worker at once; one handle per worker, in order."""
    rpc = _rpc()
    calls = ((worker_name(r), rpc.rpc_async(worker_name(r), _execute, args=(factory, args, kwargs))) for r in workers())
    return [_as_handle(x, factory) for x in _futures_of(calls)]


def fetch(handle: RemoteTensor) -> torch.Tensor:
    """``handle.fetch()``: the value, copied to the master."""
    return handle.fetch()


def gather(handles: Sequence[RemoteTensor], dim: int = 0) -> torch.Tensor:
    """The values of ``handles``, fetched at once and concatenated along ``dim`` on the master
    (``spread``'s inverse)."""
    rpc = _rpc()
    calls = ((h._worker, rpc.rpc_async(h._worker, _local_value, args=(h,))) for h in handles)
    return torch.cat(_futures_of(calls), dim)


# -- collectives among workers -------------------------------------------------------------------
def _new_worker_group(key: tuple[int, ...]) -> None:
    """On every worker, asked by the master: make the sub-group of the workers ``key``."""
    from .c10d._lifecycle import new_group

    job = _worker_job()
    job.groups[key] = new_group([r - 1 for r in key])


def _worker_group(key: tuple[int, ...]) -> Any:
    job = _worker_job()
    return None if len(key) == job.world_size - 1 else job.groups[key]


def _run_collective(kind: str, handle: RemoteTensor, key: tuple[int, ...], params: dict[str, Any]) -> Any:
    """On a worker: its part of collective ``kind`` on its tensor ``handle``."""
    from .c10d import _api as c10d

    t = _local_value(handle)
    group = _worker_group(key)
    if kind == "all_reduce":
        c10d.all_reduce(t, op=params["op"], group=group)
    elif kind == "reduce":
        c10d.reduce(t, dst=params["dst"] - 1, op=params["op"], group=group)
    elif kind == "broadcast":
        c10d.broadcast(t, src=params["src"] - 1, group=group)
    elif kind == "all_gather":
        parts = [torch.empty_like(t) for _ in key]
        c10d.all_gather(parts, t, group=group)
        by_rank = dict(zip(key, parts, strict=True))
        rpc = _rpc()
        return RemoteTensor(rpc.RRef(torch.cat([by_rank[r] for r in params["order"]])), rpc.get_worker_info().name)
    else:
        raise ValueError(f"tdist master-worker: unknown collective {kind!r}")
    return None


def _collective(kind: str, handles: Sequence[RemoteTensor], **params: Any) -> list[Any]:
    job = _master()
    handles = list(handles)
    if not handles:
        raise ValueError(f"tdist master-worker: {kind} needs at least one RemoteTensor")
    owners: dict[int, RemoteTensor] = {}
    for h in handles:
        if not isinstance(h, RemoteTensor):
            raise TypeError(f"tdist master-worker: {kind} takes RemoteTensor handles, got {type(h).__name__}")
        if h.worker_rank in owners:
            raise ValueError(
                f"tdist master-worker: {kind}: two tensors on {h.worker}; a collective takes one tensor per worker"
            )
        owners[h.worker_rank] = h
    key = tuple(sorted(owners))
    rpc = _rpc()
    with job.collective_lock:  # (one at a time: every worker sees them in one order)
        if len(key) < job.world_size - 1 and key not in job.subgroups:
            # new_group is a collective of every worker, even those outside the sub-group
            made = ((worker_name(r), rpc.rpc_async(worker_name(r), _new_worker_group, args=(key,))) for r in workers())
            _futures_of(made)
            job.subgroups.add(key)
        calls = (
            (h.worker, rpc.rpc_async(h.worker, _run_collective, args=(kind, h, key, params)))
            for h in handles
        )
        return _futures_of(calls)


def _op(op: object) -> RedOpType:
    try:
        return as_red_op(op)
    except ValueError as exc:
        raise TypeError(str(exc)) from None


def all_reduce(handles: Sequence[RemoteTensor], op: ReduceOp | RedOpType = ReduceOp.SUM) -> None:
    """All-reduce the tensors of ``handles`` (one per worker) in place, on the workers.

    Args:
        handles: tensors on distinct workers; all the workers, or a subset (a sub-group of
            them is made once, on every worker, the first time).
        op: ``ReduceOp`` (or ``reduce_op``) member.

    Raises:
        ValueError: two handles on one worker. PeerError: a worker was lost (named).
    """
    _collective("all_reduce", handles, op=_op(op))


def reduce(handles: Sequence[RemoteTensor], dst: RemoteTensor, op: ReduceOp | RedOpType = ReduceOp.SUM) -> None:
    """Reduce the tensors of ``handles`` into ``dst`` (one of them), on the workers."""
    _collective("reduce", handles, dst=_member(dst, handles, "reduce").worker_rank, op=_op(op))


def broadcast(handles: Sequence[RemoteTensor], src: RemoteTensor) -> None:
    """Copy ``src`` (one of ``handles``) into every tensor of ``handles``, worker to worker."""
    _collective("broadcast", handles, src=_member(src, handles, "broadcast").worker_rank)


def all_gather(handles: Sequence[RemoteTensor]) -> list[RemoteTensor]:
    """All-gather among the workers of ``handles`` (same shapes): each worker gets the tensors
    of ``handles`` concatenated along dim 0, in the order of ``handles``.

    Returns:
        The gathered tensor of each handle's worker, in the order of ``handles``.
    """
    order = [h.worker_rank for h in handles]
    return [_as_handle(x, "all_gather") for x in _collective("all_gather", handles, order=order)]


def barrier() -> None:
    """Wait until every worker has reached a barrier of the workers' process group (what the
    master asked of them before is done)."""
    job = _master()
    rpc = _rpc()
    with job.collective_lock:
        _futures_of((worker_name(r), rpc.rpc_async(worker_name(r), _worker_barrier)) for r in workers())


def _worker_barrier() -> None:
    from .c10d import _api as c10d

    c10d.barrier()


def _member(h: RemoteTensor, handles: Sequence[RemoteTensor], kind: str) -> RemoteTensor:
    if not any(h is x for x in handles):
        raise ValueError(f"tdist master-worker: {kind}: the source/destination must be one of the handles")
    return h
