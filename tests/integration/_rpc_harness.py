"""Runs RPC scenarios on real processes, as torch's own rpc suite does: ``worker0``..``worker3``,
each ``init_rpc``, its part of the scenario, ``shutdown()``.

A scenario is ``fn(w: Worker) -> result``, run once per rank in a forked process (so it need
not pickle: closures work); what the callees run lives in ``rpc_funcs``, importable by name on
every worker. Every run has a hard timeout; a rank that raises fails the test with its remote
traceback (``tdist.testing.run_processes``).

``TDIST_RPC_TEST_IMPL=torch`` runs the same scenarios with ``torch.distributed.rpc`` instead of
``tdist.rpc``: a development aid that checks the tests themselves against the reference. torch
has no ``PROCESS_GROUP`` agent, so only the ``tensorpipe`` parameter runs then. Checks where we
demand better than torch are tests of their own, marked ``better_than_torch`` (expected to fail
under torch).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from tdist.testing import free_port, run_processes

from .._sync import wait_until as wait_until  # (the scenarios' modules take it from here)

IMPL = os.environ.get("TDIST_RPC_TEST_IMPL", "tdist")
if IMPL == "torch":
    import torch.distributed.rpc as rpc
elif IMPL == "tdist":
    import tdist.rpc as rpc  # type: ignore[no-redef]
else:
    raise RuntimeError(f"TDIST_RPC_TEST_IMPL must be 'tdist' or 'torch', not {IMPL!r}")

WORLD = 4
TORCH = IMPL == "torch"

# Every scenario runs over both agents; torch has only TensorPipe.
BACKENDS = [
    pytest.param("tensorpipe", id="tensorpipe"),
    pytest.param(
        "process_group",
        id="process_group",
        marks=pytest.mark.skipif(TORCH, reason="torch has no PROCESS_GROUP rpc backend"),
    ),
]

# For a test of behaviour where we demand better than torch: under torch it must fail.
better_than_torch = pytest.mark.xfail(
    TORCH, reason="better than torch: torch.distributed.rpc does not do this", strict=True
)

# What a timeout error says: torch's "RPC ran for more than set timeout (100 ms)", or ours.
TIMEOUT_RE = r"(?i)ran for more than|timed? ?out"

_ctx: Any = multiprocessing.get_context("fork")


def name(rank: int) -> str:
    return f"worker{rank}"


def backend_type(backend: str) -> Any:
    return getattr(rpc.BackendType, {"tensorpipe": "TENSORPIPE", "process_group": "PROCESS_GROUP"}[backend])


def make_options(backend: str, port: int, **kwargs: Any) -> Any:
    """The agent's options with a ``tcp://`` rendezvous on ``port`` (plus ``rpc_timeout`` ...)."""
    init_method = f"tcp://127.0.0.1:{port}"
    if backend == "tensorpipe":
        return rpc.TensorPipeRpcBackendOptions(init_method=init_method, **kwargs)
    return rpc.ProcessGroupRpcBackendOptions(init_method=init_method, **kwargs)


@dataclass
class Worker:
    """What a scenario gets on its rank: who it is, and how to reach the others."""

    rank: int
    world_size: int
    backend: str
    port: int
    barrier_: Any
    shared: dict[str, Any]
    options_kwargs: dict[str, Any] = field(default_factory=dict)
    initialized: bool = False

    @property
    def me(self) -> str:
        return name(self.rank)

    def peer(self, offset: int = 1) -> str:
        """The name of the rank ``offset`` after this one (wrapping)."""
        return name((self.rank + offset) % self.world_size)

    def others(self) -> list[str]:
        return [name(r) for r in range(self.world_size) if r != self.rank]

    @property
    def backend_type(self) -> Any:
        return backend_type(self.backend)

    def options(self, port: int | None = None, **kwargs: Any) -> Any:
        return make_options(self.backend, self.port if port is None else port,
                            **{**self.options_kwargs, **kwargs})

    def init(self, worker_name: str | None = None, *, port: int | None = None,
             world_size: int | str | None = "default", **kwargs: Any) -> None:
        """``init_rpc`` as ``worker<rank>`` with this run's backend and options."""
        rpc.init_rpc(
            self.me if worker_name is None else worker_name,
            backend=self.backend_type,
            rank=self.rank,
            world_size=self.world_size if world_size == "default" else world_size,
            rpc_backend_options=self.options(port, **kwargs),
        )
        self.initialized = True

    def shutdown(self, graceful: bool = True) -> None:
        rpc.shutdown(graceful=graceful)
        self.initialized = False

    def barrier(self, timeout: float = 30.0) -> None:
        """All ranks meet (outside RPC: a ``multiprocessing`` barrier made before the fork)."""
        self.barrier_.wait(timeout)


def _worker_main(rank: int, world_size: int, scenario: Callable[[Worker], Any], backend: str,
                 port: int, barrier: Any, shared: dict[str, Any], init: bool,
                 options_kwargs: dict[str, Any], env: dict[str, str]) -> Any:
    # (a rank killed for running past the timeout, or one that crashes, says where it was in
    # run_processes' error)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    w = Worker(rank, world_size, backend, port, barrier, shared, dict(options_kwargs))
    if init:
        w.init()
    result = scenario(w)
    if w.initialized:
        w.shutdown()
    return result


def run(scenario: Callable[[Worker], Any], backend: str, *, world_size: int = WORLD,
        timeout: float = 40.0, init: bool = True, env: dict[str, str] | None = None,
        shared: dict[str, Any] | None = None, start_method: Literal["fork", "forkserver"] = "fork",
        **options_kwargs: Any) -> list[Any]:
    """Run ``scenario`` on ``world_size`` fresh processes; its results by rank.

    Args:
        scenario: the body of one rank, given a ``Worker``.
        backend: ``"tensorpipe"`` or ``"process_group"``.
        world_size: the number of workers.
        timeout: the hard limit of the whole run, in seconds.
        init: ``init_rpc`` before the scenario (it calls ``w.init()`` itself otherwise); a
            worker still initialized after its scenario shuts down gracefully.
        env: environment variables every worker sets first.
        shared: objects made before the fork that every worker shares (``multiprocessing``
            events, values, queues); ``w.shared``.
        start_method: ``"forkserver"`` for a scenario that must not inherit this process's
            state (torch's thread pools do not survive a fork: ``torch.jit._fork`` in a forked
            worker may abort); ``scenario`` is then found by name in its module.
        **options_kwargs: passed to the backend's options (``rpc_timeout=...``).
    """
    barrier = multiprocessing.get_context(start_method).Barrier(world_size)
    return run_processes(
        _worker_main, world_size, scenario, backend, free_port(), barrier, shared or {},
        init, options_kwargs, env or {}, timeout=timeout, start_method=start_method,
    )


_observed: dict[tuple[str, str, str], Any] = {}


def observe(scenario: Callable[[Worker], Any], backend: str, variant: str = "",
            **kwargs: Any) -> list[Any]:
    """``run`` once per (scenario, backend, variant) in this session, cached: several tests can
    then assert on what one run observed (one process start-up, telling test names)."""
    key = (f"{scenario.__module__}.{scenario.__qualname__}", backend, variant)
    if key not in _observed:
        try:
            _observed[key] = ("ok", run(scenario, backend, **kwargs))
        except BaseException as exc:
            _observed[key] = ("error", exc)
    status, value = _observed[key]
    if status == "error":
        raise value
    return value


def settle(fut: Any, timeout: float) -> tuple[bool, Any]:
    """Wait at most ``timeout`` seconds for a future: ``(done, value or exception)``.

    A future's ``wait()`` has no timeout; this polls ``done()`` instead, so a test of a call
    that must fail in time does not hang when it does not.
    """
    deadline = time.monotonic() + timeout
    while not fut.done():
        if time.monotonic() > deadline:
            return False, None
        time.sleep(0.01)
    try:
        return True, fut.wait()
    except Exception as exc:
        return True, exc


def collect() -> None:
    """Drop unreachable objects now (RRefs in reference cycles, tracebacks)."""
    gc.collect()


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a rank killed for running past
    its timeout leaves no victim behind)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def forked_worker(body: Callable[[], Any]) -> Iterator[int]:
    """Run ``body`` in a child process of this rank (which may kill or stop it); yields its pid.

    The fault tests kill workers: a rank of ``run_processes`` that died would fail the run, so
    the victim is a grandchild and its rank only waits for it. It is killed on exit.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the victim: never return into the caller's stack
        code = 0
        try:
            _die_with_parent()
            body()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def in_thread(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``timeout`` seconds (for calls that have
    no timeout of their own and must not hang a test)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} still running after {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
