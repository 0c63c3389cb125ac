"""What the RPC tests' callees run: module-level functions and classes, importable by name
(``tests.integration.rpc_funcs``) on every worker.

Module state (counters, stored RRefs, live tracked objects) is per process: each worker has its
own, and the tests read a worker's through an RPC to it.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import torch
from torch.futures import Future

from ._rpc_harness import rpc

# -- plain calls -------------------------------------------------------------------------------


def add(a: Any, b: Any) -> Any:
    return a + b


def add_kwargs(a: Any, *, b: Any = 0, c: Any = 0) -> Any:
    return a + b + c


def identity(x: Any) -> Any:
    return x


def whoami() -> str:
    return rpc.get_worker_info().name


def my_id() -> int:
    return rpc.get_worker_info().id


def pid() -> int:
    return os.getpid()


def sleep_then(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


arrived: Any = None  # a multiprocessing Value a scenario gives its callee (``arrive_then_sleep``)


def arrive_then_sleep(seconds: float, value: Any = None) -> Any:
    """``sleep_then``, counted in ``arrived`` as it starts (a count every process can read)."""
    with arrived.get_lock():
        arrived.value += 1
    time.sleep(seconds)
    return value


def describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    """What the callee received: shape, strides, flags and a checksum."""
    return {
        "shape": tuple(t.shape),
        "dtype": t.dtype,
        "requires_grad": t.requires_grad,
        "is_contiguous": t.is_contiguous(),
        "sum": float(t.double().sum()),
        "first": t.flatten()[:4].tolist(),
    }


def make_view(n: int) -> torch.Tensor:
    """A non-contiguous view of a larger tensor, as a return value."""
    return torch.arange(n * n, dtype=torch.float32).reshape(n, n).t()[1:]


def nested_call(to: str, func: Any, args: tuple[Any, ...] = ()) -> Any:
    """Call ``func`` on ``to`` from inside an RPC: nested RPC (``to`` may be the caller)."""
    return rpc.rpc_sync(to, func, args=args)


def chain_call(path: list[str], x: Any) -> Any:
    """Forward down ``path`` (A -> B -> C ...), adding 1 at every hop."""
    if not path:
        return x
    return rpc.rpc_sync(path[0], chain_call, args=(path[1:], x + 1))


class Calc:
    """An importable class: constructor, static, class and instance methods."""

    def __init__(self, base: int = 0) -> None:
        self.base = base

    def plus(self, x: int) -> int:
        return self.base + x

    @staticmethod
    def mul(a: Any, b: Any) -> Any:
        return a * b

    @classmethod
    def make(cls, base: int) -> Calc:
        return cls(base)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Calc) and other.base == self.base

    def __hash__(self) -> int:
        return hash(self.base)


def calc_plus(c: Calc, x: int) -> int:
    return c.plus(x)


# -- counters and concurrency ------------------------------------------------------------------

_lock = threading.Lock()
_counts: dict[str, int] = {}


def count(key: str, n: int = 1) -> int:
    with _lock:
        _counts[key] = _counts.get(key, 0) + n
        return _counts[key]


def get_count(key: str) -> int:
    with _lock:
        return _counts.get(key, 0)


_events: dict[str, threading.Event] = {}


def _event(key: str) -> threading.Event:
    with _lock:
        return _events.setdefault(key, threading.Event())


def set_event(key: str) -> None:
    _event(key).set()


def wait_event(key: str, timeout: float = 30.0) -> bool:
    return _event(key).wait(timeout)


def clear_event(key: str) -> None:
    _event(key).clear()


# -- errors ------------------------------------------------------------------------------------


class CustomError(Exception):
    """A user exception class (importable on every worker)."""


class ThreeArgError(Exception):
    """An exception whose constructor needs three arguments (not ``cls(message)``)."""

    def __init__(self, code: int, where: str, detail: str) -> None:
        super().__init__(code, where, detail)
        self.code = code
        self.where = where
        self.detail = detail

    def __str__(self) -> str:
        return f"code {self.code} at {self.where}: {self.detail}"


class FormattedError(Exception):
    """An exception whose constructor takes several arguments and passes one formatted text
    on (so plain pickling, which calls ``FormattedError(text)``, cannot rebuild it)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"E{code}: {detail}")
        self.code = code
        self.detail = detail


def raise_error(kind: str, message: str = "expected error") -> None:
    """Raise the exception named ``kind`` with ``message`` in it."""
    if kind == "ZeroDivisionError":
        _ = 1 / 0
    if kind == "ThreeArgError":
        raise ThreeArgError(7, "callee", message)
    if kind == "CustomError":
        raise CustomError(message)
    if kind == "FormattedError":
        raise FormattedError(42, message)
    if kind == "FileNotFoundError":
        open(f"/nonexistent/{message}")  # (it raises)
    if kind == "AssertionError":
        raise AssertionError(message)
    raise {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError,
           "KeyError": KeyError}[kind](message)


def unpicklable_result() -> Any:
    """A value the callee cannot send back (a local function)."""
    return lambda: 1


def lock_result() -> Any:
    """A value the callee cannot send back, whose pickling raises TypeError."""
    return threading.Lock()


# -- async_execution ---------------------------------------------------------------------------


@rpc.functions.async_execution
def async_add(to: str, a: Any, b: Any) -> Any:
    """Returns a future: the reply is sent when the nested call completes."""
    return rpc.rpc_async(to, add, args=(a, b))


@rpc.functions.async_execution
def async_add_chained(to: str, x: Any, times: int) -> Any:
    """``times`` nested calls one after another, each adding 1, chained by callbacks that
    never block (each starts the next call): the reply goes out when the last completes."""
    result: torch.futures.Future[Any] = torch.futures.Future()

    def step(fut: Any, remaining: int) -> None:
        try:
            value = fut.wait()
        except Exception as exc:
            result.set_exception(exc)
            return
        if remaining == 0:
            result.set_result(value)
        else:
            rpc.rpc_async(to, add, args=(value, 1)).add_done_callback(
                lambda f: step(f, remaining - 1))

    rpc.rpc_async(to, add, args=(x, 1)).add_done_callback(lambda f: step(f, times - 1))
    return result


@rpc.functions.async_execution
def async_add_chained_blocking(to: str, x: Any, times: int) -> Any:
    """As ``async_add_chained``, but each ``then`` callback blocks on the next call."""
    fut = rpc.rpc_async(to, add, args=(x, 1))
    for _ in range(times - 1):
        fut = fut.then(lambda f: rpc.rpc_async(to, add, args=(f.wait(), 1)).wait())
    return fut


@rpc.functions.async_execution
def async_fanout(tos: list[str], x: Any) -> Any:
    """Calls every worker in ``tos`` and answers with the sum of the results."""
    futs = [rpc.rpc_async(to, add, args=(x, 1)) for to in tos]
    return torch.futures.collect_all(futs).then(lambda f: sum(g.wait() for g in f.wait()))


@rpc.functions.async_execution
def async_nested(to: str, via: str, x: Any) -> Any:
    """async_execution calling another async_execution function: ``via`` calls ``to``."""
    return rpc.rpc_async(via, async_add, args=(to, x, 1))


@rpc.functions.async_execution
def async_sleep_then(seconds: float, value: Any) -> Any:
    """A future completed later by a thread of the callee."""
    fut: torch.futures.Future[Any] = torch.futures.Future()

    def complete() -> None:
        time.sleep(seconds)
        fut.set_result(value)

    threading.Thread(target=complete, daemon=True).start()
    return fut


@rpc.functions.async_execution
def async_raise(kind: str, message: str) -> Any:
    """Raises before returning a future."""
    raise_error(kind, message)


@rpc.functions.async_execution
def async_future_error(message: str) -> Any:
    """Returns a future that completes with an error."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_exception(ValueError(message))
    return fut


@rpc.functions.async_execution
def async_callback_error(to: str, message: str) -> Any:
    """The error is raised in a ``then`` callback."""

    def fail(f: Any) -> Any:
        f.wait()
        raise ValueError(message)

    return rpc.rpc_async(to, add, args=(1, 1)).then(fail)


@rpc.functions.async_execution
def async_remote_error(to: str, message: str) -> Any:
    """The nested call fails on a third worker."""
    return rpc.rpc_async(to, raise_error, args=("ValueError", message))


class AsyncCalc:
    """async_execution on static, class and instance methods."""

    def __init__(self, base: int = 0) -> None:
        self.base = base

    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to: str, x: Any, y: Any) -> Any:
        return rpc.rpc_async(to, add, args=(x, y))

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to: str, x: Any, y: Any) -> Any:
        return rpc.rpc_async(to, add, args=(x, y))

    @rpc.functions.async_execution
    def async_plus(self, to: str, x: Any) -> Any:
        return rpc.rpc_async(to, add, args=(self.base, x))

    def plus(self, x: Any) -> Any:
        return self.base + x


# -- RRefs -------------------------------------------------------------------------------------


class Counter:
    """A stateful object held by an RRef owner (for the rref proxies)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def increment(self, n: int = 1) -> int:
        self.value += n
        return self.value

    def get(self) -> int:
        return self.value

    def slow_get(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.value

    def fail(self, message: str) -> None:
        raise ValueError(message)


# The values of Tracked objects alive in this process, by tag: the owner of an RRef holds
# one until every user dropped its reference.
_live: set[str] = set()


class Tracked:
    """An object that reports its deletion: ``is_alive(tag)`` on the process that holds it."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        with _lock:
            _live.add(tag)

    def __del__(self) -> None:
        with _lock:
            _live.discard(self.tag)


def tracked_after(seconds: float, tag: str) -> Tracked:
    time.sleep(seconds)
    return Tracked(tag)


def is_alive(tag: str) -> bool:
    import gc

    gc.collect(1)  # (the young generations only: a full collection takes 0.1 s of CPU with torch loaded)
    with _lock:
        return tag in _live


_stored: dict[str, Any] = {}


def store_rref(key: str, rref: Any) -> bool:
    """Keep ``rref`` in this worker (a user reference that outlives the call)."""
    _stored[key] = rref
    return True


def drop_rref(key: str) -> bool:
    import gc

    _stored.pop(key, None)
    gc.collect()
    return True


def stored_to_here(key: str) -> Any:
    return _stored[key].to_here()


def forward_stored(key: str, to: str, drop: bool) -> bool:
    """Pass the stored RRef on to ``to`` (which stores it under the same key); then maybe drop
    ours: a fork of a fork."""
    rpc.rpc_sync(to, store_rref, args=(key, _stored[key]))
    if drop:
        drop_rref(key)
    return True


def rref_to_here(rref: Any) -> Any:
    return rref.to_here()


def rref_info(rref: Any) -> dict[str, Any]:
    """What a (user or owner) RRef says about itself where it was received."""
    return {
        "is_owner": rref.is_owner(),
        "owner_name": rref.owner_name(),
        "owner_id": rref.owner().id,
        "confirmed": rref.confirmed_by_owner(),
    }


def rref_local_value(rref: Any) -> Any:
    return rref.local_value()


def rref_add(rref: Any, x: Any) -> Any:
    """``to_here`` of an RRef passed as an argument, plus ``x``."""
    return rref.to_here() + x


def make_local_rrefs(values: list[Any]) -> list[Any]:
    """RRefs this worker owns, returned to the caller (owner RRefs forked on return)."""
    return [rpc.RRef(Counter(v)) for v in values]


def call_on_rref(method: str, rref: Any, *args: Any) -> Any:
    """Call ``method`` on the value of a local RRef (run on its owner)."""
    return getattr(rref.local_value(), method)(*args)


def remote_of(to: str, func: Any, args: tuple[Any, ...]) -> Any:
    """An RRef made by this worker on ``to`` and returned to the caller (a fork)."""
    return rpc.remote(to, func, args=args)


def _refuse_to_be_rebuilt(text: str) -> Any:
    raise ValueError(text)


class RebuildFails:
    """Pickles fine; rebuilding it (on the callee) raises ``ValueError(text)``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> Any:
        return (_refuse_to_be_rebuilt, (self.text,))


def _script_add(x: torch.Tensor, y: int) -> torch.Tensor:
    return x + y


def _script_fails(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("script boom")


def _script_add_later(x: torch.Tensor, y: int) -> Future[torch.Tensor]:
    return torch.jit._fork(_script_add, x, y)


with warnings.catch_warnings():  # (torch.jit.script is deprecated in this torch; RPC runs it)
    warnings.simplefilter("ignore", DeprecationWarning)
    script_add = torch.jit.script(_script_add)  # TorchScript functions: torch's RPC runs them by name
    script_fails = torch.jit.script(_script_fails)
    # async_execution over TorchScript: the function returns a future, the reply waits for it
    script_add_later = rpc.functions.async_execution(torch.jit.script(_script_add_later))


def unrebuildable_after(seconds: float, text: str) -> RebuildFails:
    """After ``seconds``, a value whose rebuilding (on the caller) raises ``ValueError(text)``."""
    time.sleep(seconds)
    return RebuildFails(text)


# -- RemoteModule ------------------------------------------------------------------------------
class Affine(torch.nn.Module):
    """``x @ w.T + b`` with known parameters (w = 1, b = 0.5), and a training flag to read."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        with torch.no_grad():
            self.lin.weight.fill_(1.0)
            self.lin.bias.fill_(0.5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * scale


def call_module(module: Any, x: torch.Tensor) -> torch.Tensor:
    """Another worker runs a module (a RemoteModule sent to it) on ``x`` (``forward``: torch's
    unpickled RemoteModule cannot be called as ``module(x)``; ours can)."""
    return module.forward(x)  # type: ignore[no-any-return]


def module_state(module_rref: Any) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """On the module's owner: its training flag and parameters."""
    m = module_rref.local_value()
    return m.training, m.lin.weight.detach().clone(), m.lin.bias.detach().clone()


# (torch.jit.interface is deprecated in torch 2.13, and says so once per definition)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.interface
    class AffineInterface(torch.nn.Module):
        """What ``Affine`` implements, as a TorchScript module interface."""

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            pass

    @torch.jit.interface
    class OtherInterface(torch.nn.Module):
        def forward(self, x: torch.Tensor, word: str) -> str:
            pass


def scripted_affine() -> torch.jit.ScriptModule:
    return torch.jit.script(Affine(3, 2))


def meta_tensor() -> torch.Tensor:
    return torch.empty(2, device="meta")


def traced_affine() -> torch.jit.ScriptModule:
    return torch.jit.trace(Affine(3, 2), torch.ones(1, 3))  # type: ignore[no-any-return]


class SlowCounter(Counter):
    """A ``Counter`` whose constructor takes ``seconds``."""

    def __init__(self, value: int, seconds: float) -> None:
        time.sleep(seconds)
        super().__init__(value)


def local_get(rref: Any) -> int:
    """On the owner: ``rref.local_value().get()`` (waits for the value to be made)."""
    return rref.local_value().get()  # type: ignore[no-any-return]


def parameter_rref() -> Any:
    """An RRef, owned here, to a parameter."""
    return rpc.RRef(torch.nn.Parameter(torch.ones(2)))


def parameter() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(2))


# -- values at the call (no torn tensors) -------------------------------------------------------


def value_range(t: torch.Tensor) -> tuple[float, float]:
    """The smallest and largest element: both the value of the call for an intact tensor."""
    return float(t.min()), float(t.max())


class _Watched(torch.futures.Future):  # type: ignore[type-arg]
    """A future that tells when someone (the agent's reply) waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.watched = threading.Event()

    def add_done_callback(self, callback: Any) -> None:
        super().add_done_callback(callback)
        self.watched.set()


@rpc.functions.async_execution
def reply_then_overwrite(n: int, value: float) -> Any:
    """Replies with a tensor of ``n`` times ``value`` from a thread of the callee, which fills
    the tensor with -1 as soon as ``set_result`` (where the reply is sent) returns."""
    state = torch.full((n,), value)
    fut = _Watched()

    def complete() -> None:
        fut.watched.wait(30)
        fut.set_result(state)
        state.fill_(-1.0)

    threading.Thread(target=complete, daemon=True).start()
    return fut


def knows_lost(peer: int) -> bool:
    """Whether this worker's agent has found worker ``peer`` lost."""
    from tdist.rpc._agent import current_agent

    agent = current_agent()
    return agent is not None and agent._lost_peer(peer) is not None
