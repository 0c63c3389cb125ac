"""Helpers for testing distributed code: N ranks as threads or processes, stores, free ports.

Every helper has a hard timeout and reaps what it starts::

    def body(rank: int, world_size: int, url: str) -> int:
        store, rank, world_size = next(tdist.rendezvous(url, rank, world_size))
        return store.add("n", 1)

    with local_store() as server:
        results = run_threads(body, 2, server.url(), timeout=10)

``fn(rank, world_size, *args)`` runs once per rank. The first rank that raises fails the whole
run: its exception is re-raised in the caller with a note naming the rank (and, for processes,
the remote traceback), so ``pytest.raises(ValueError)`` still works. A run that outlives its
timeout raises ``RankTimeoutError`` naming the ranks still running; a process rank's error
(``RankTimeoutError``, ``RankFailedError``) carries a note with where each of its threads was
when it was stopped, or when it crashed.

Threads cannot be killed: ranks left running after a failure or a timeout are daemon threads
that end when the code they run gives up (close their stores to hurry them). Processes are
killed (SIGTERM, then SIGKILL) and always reaped.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import select
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal, TypeVar

from ._core import ports
from ._core._process import die_with, prctl
from ._core.errors import DistError, DistTimeoutError
from .store._tcp import TCPStore

__all__ = [
    "LocalStore",
    "RankFailedError",
    "RankTimeoutError",
    "free_port",
    "local_store",
    "run_processes",
    "run_threads",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for processes left running


class RankFailedError(DistError):
    """A rank ended without a result: its process died, or its exception could not be sent.

    Attributes:
        rank: the rank that failed.
        exitcode: its process's exit code (negative: killed by that signal), if known.
    """

    def __init__(self, message: str, rank: int, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class RankTimeoutError(DistTimeoutError):
    """Ranks were still running when the hard timeout expired. ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Another process may take it before you bind it; prefer binding port 0 where you can. It is
    drawn at random below the kernel's ephemeral range (``_core.ports``), where the kernel never
    hands one out of its own accord.
    """
    return ports.free_port(host)


def _signal_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def _note(exc: BaseException, text: str) -> BaseException:
    exc.add_note(text)
    return exc


# -- threads -----------------------------------------------------------------------------------
def run_threads(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    grace: float = 1.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads; results by rank.

    Args:
        fn: the body of one rank.
        world_size: the number of ranks.
        *args: passed to every rank after ``rank`` and ``world_size``.
        timeout: seconds until the run fails with ``RankTimeoutError``.
        grace: after the first failure, seconds to let the other ranks finish before raising
            (so that their own errors, caused by the first, do not leak into the next test).

    Returns:
        ``[fn(0, ...), fn(1, ...), ...]``.

    Raises:
        BaseException: the first exception a rank raised, with a note naming the rank.
        RankTimeoutError: ranks were still running after ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"run_threads: world_size must be positive, got {world_size}")
    done: queue.Queue[tuple[int, BaseException | None, Any]] = queue.Queue()

    def body(rank: int) -> None:
        from .c10d._group import isolate_thread

        isolate_thread()  # (a rank of its own: its own world, as a process would have)
        try:
            value = fn(rank, world_size, *args)
        except BaseException as exc:
            done.put((rank, exc, None))
        else:
            done.put((rank, None, value))

    name = getattr(fn, "__name__", "fn")
    threads = [
        threading.Thread(target=body, args=(r,), name=f"rank{r}-{name}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failure: tuple[int, BaseException] | None = None
    failure_at = 0.0
    while len(results) < world_size:
        if failure is not None:
            wait_until = min(deadline, failure_at + grace)
        else:
            wait_until = deadline
        remaining = wait_until - time.monotonic()
        try:
            rank, exc, value = done.get(timeout=max(0.0, remaining))
        except queue.Empty:
            break
        results[rank] = value
        if exc is not None and failure is None:
            failure = (rank, exc)
            failure_at = time.monotonic()
    if failure is not None:
        rank, exc = failure
        running = [r for r in range(world_size) if r not in results]
        extra = f"; ranks still running: {running}" if running else ""
        raise _note(exc, f"[tdist.testing] raised on rank {rank} of {world_size} ({name}){extra}")
    if len(results) < world_size:
        running = [r for r in range(world_size) if r not in results]
        stacks = _thread_stacks([threads[r] for r in running])
        raise RankTimeoutError(
            f"run_threads({name}): ranks {running} of {world_size} still running after "
            f"{timeout:g} s (hung or deadlocked?){stacks}",
            running,
        )
    return [results[r] for r in range(world_size)]


def _thread_stacks(threads: list[threading.Thread]) -> str:
    import sys

    frames = sys._current_frames()
    parts = []
    for t in threads:
        frame = frames.get(t.ident) if t.ident is not None else None
        if frame is not None:
            stack = "".join(traceback.format_stack(frame)[-6:])
            parts.append(f"\n--- {t.name} is at:\n{stack}")
    return "".join(parts)


# -- processes ---------------------------------------------------------------------------------
def _die_with_caller(caller: int | None) -> None:
    if caller is None or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(caller)
    except OSError:
        os._exit(1)  # (gone already)

    def watch() -> None:
        select.select([pidfd], [], [])  # (readable once the caller exited)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tdist-rank-caller-watch", daemon=True).start()


def _process_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    conn: multiprocessing.connection.Connection,
    caller: int | None = None,
    forkserver: tuple[dict[str, str], str] | None = None,
    stacks: str | None = None,
) -> None:
    """The body of one rank's process: run ``fn`` and send back its result or exception. It
    dies with ``caller``, the process that called ``run_processes``, even one killed with
    SIGKILL (a test's timeout that ends pytest with ``os._exit``), instead of running on,
    waiting for peers: the kernel's parent-death signal, or, started by a forkserver (which
    lives as long as its children, since they hold its keep-alive pipe), a thread that waits
    on a pidfd of the caller. ``forkserver``: the caller's environment and working folder,
    which a forkserver's child takes instead of the forkserver's own (as a spawned one has
    them). ``stacks``: the file where its threads' stacks go when it is stopped (SIGTERM, by
    ``_reap``) or crashes (``faulthandler``'s), for the caller's error."""
    if stacks is not None:
        with contextlib.suppress(OSError):
            out = open(stacks, "w")  # (open for the handlers, for the process's life)
            faulthandler.register(signal.SIGTERM, file=out, all_threads=True, chain=True)
            faulthandler.enable(file=out, all_threads=True)
    if forkserver is not None:
        env, cwd = forkserver
        os.environ.clear()
        os.environ.update(env)
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        _die_with_caller(caller)
    else:
        die_with(caller)
    try:
        value = fn(rank, world_size, *args)
    except BaseException as exc:
        tb = traceback.format_exc()
        try:
            conn.send(("error", exc, tb))
        except Exception:  # the exception does not pickle: send its text
            conn.send(("error", None, tb))
        conn.close()
        os._exit(1)
    try:
        conn.send(("ok", value, ""))
    except Exception:
        conn.send(("error", None, f"the result of rank {rank} cannot be pickled:\n{traceback.format_exc()}"))
        conn.close()
        os._exit(1)
    conn.close()


def run_processes(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    start_method: Literal["fork", "spawn", "forkserver"] = "fork",
    grace: float = 1.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; results by rank.

    Results and exceptions come back pickled over a pipe per rank. With ``"spawn"`` ``fn`` and
    ``args`` must be picklable (``fn`` defined at module level).

    Args:
        fn: the body of one rank.
        world_size: the number of ranks.
        *args: passed to every rank after ``rank`` and ``world_size``.
        timeout: seconds until the run fails with ``RankTimeoutError``; the ranks still
            running are killed.
        start_method: how processes start (``multiprocessing`` start methods). ``"fork"``,
            the quickest, copies this process, with one limit of torch's: once this process
            has run an operation on several intra-op threads, GNU OpenMP's team does not
            survive the fork, and a rank's first operation on several threads hangs (to
            ``timeout``). There, use ``"spawn"``, or keep this process on one intra-op
            thread (``torch.set_num_threads(1)`` before its first operation).
            ``"spawn"`` starts a new interpreter per rank, which imports torch again (about
            1.5 s of CPU each). ``"forkserver"`` forks each rank from Python's forkserver, a
            process started once that holds no threads: as safe as ``"spawn"``, and as quick
            as ``"fork"`` where the forkserver imported torch already
            (``multiprocessing.set_forkserver_preload(["torch"])`` before its first use). Its
            ranks get this process's environment and working folder, as spawned ones do.
        grace: after the first failure, seconds to let the other ranks finish before they
            are killed.

    Returns:
        ``[fn(0, ...), fn(1, ...), ...]``.

    Raises:
        BaseException: the first exception a rank raised, with notes naming the rank and
            giving its remote traceback.
        RankFailedError: a rank's process died (or exited) without a result; names the rank
            and the exit code.
        RankTimeoutError: ranks were still running after ``timeout`` seconds; they were killed.
    """
    if world_size < 1:
        raise ValueError(f"run_processes: world_size must be positive, got {world_size}")
    # typeshed types a context chosen at run time as BaseContext, which lacks Process
    ctx: Any = multiprocessing.get_context(start_method)
    carried = (dict(os.environ), os.getcwd()) if start_method == "forkserver" else None
    prctl()  # (looked up here: a forked rank then neither imports nor dlopens it)
    name = getattr(fn, "__name__", "fn")
    procs: list[multiprocessing.process.BaseProcess] = []
    readers: list[multiprocessing.connection.Connection] = []
    stacks = tempfile.mkdtemp(prefix="tdist-ranks-")
    try:
        try:
            for rank in range(world_size):
                r, w = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_process_main, name=f"rank{rank}-{name}", daemon=True,
                    args=(fn, rank, world_size, args, w, os.getpid(), carried, os.path.join(stacks, f"rank{rank}")),
                )
                p.start()
                w.close()
                procs.append(p)
                readers.append(r)
            return _collect(procs, readers, name, world_size, timeout, grace)
        finally:
            _reap(procs)
            for r in readers:
                r.close()
    except (RankTimeoutError, RankFailedError) as exc:
        for rank in exc.ranks if isinstance(exc, RankTimeoutError) else [exc.rank]:
            with contextlib.suppress(OSError):
                with open(os.path.join(stacks, f"rank{rank}")) as f:
                    where = f.read().strip()
                if where:
                    exc.add_note(f"[tdist.testing] rank {rank} was at:\n{where}")
        raise
    finally:
        shutil.rmtree(stacks, ignore_errors=True)


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    readers: list[multiprocessing.connection.Connection],
    name: str,
    world_size: int,
    timeout: float,
    grace: float,
) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failure: BaseException | None = None
    failure_at = 0.0
    waiting_result = set(range(world_size))  # ranks whose pipe may still carry a result
    running = set(range(world_size))  # ranks whose process has not exited
    while waiting_result or running:
        if failure is not None and not running:
            break
        limit = deadline if failure is None else min(deadline, failure_at + grace)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        by_obj: dict[Any, tuple[str, int]] = {}
        for r in waiting_result:
            by_obj[readers[r]] = ("pipe", r)
        for r in running:
            by_obj[procs[r].sentinel] = ("exit", r)
        for obj in multiprocessing.connection.wait(list(by_obj), timeout=remaining):
            kind, rank = by_obj[obj]
            if kind == "exit":
                running.discard(rank)
                # the sentinel fires as the process closes its files, a moment before it can
                # be reaped: wait that moment for the exit code
                procs[rank].join(5.0)
                continue
            waiting_result.discard(rank)
            try:
                status, value, tb = readers[rank].recv()
            except EOFError:
                continue  # no result: reported below once the process has exited
            except Exception:
                status, value, tb = "error", None, traceback.format_exc()
            if status == "ok":
                results[rank] = value
            elif failure is None:
                failure = _remote_error(rank, world_size, name, value, tb)
                failure_at = time.monotonic()
        if failure is None:
            for rank in range(world_size):
                if rank not in running and rank not in waiting_result and rank not in results:
                    code = procs[rank].exitcode
                    failure = RankFailedError(
                        f"run_processes({name}): rank {rank} of {world_size} "
                        f"(pid {procs[rank].pid}) exited with {_signal_text(code)} before "
                        "returning a result",
                        rank,
                        code,
                    )
                    failure_at = time.monotonic()
                    break
    if failure is not None:
        try:
            raise failure
        finally:  # (no cycle through this frame: see ``errors.fresh``)
            del failure
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        details = ", ".join(f"rank {r} (pid {procs[r].pid})" for r in missing)
        raise RankTimeoutError(
            f"run_processes({name}): {details} of {world_size} still running after {timeout:g} s "
            "(hung or deadlocked?); killed",
            missing,
        )
    return [results[r] for r in range(world_size)]


def _remote_error(rank: int, world_size: int, name: str, exc: BaseException | None, tb: str) -> BaseException:
    if exc is None:
        return RankFailedError(
            f"run_processes({name}): rank {rank} of {world_size} failed:\n{tb}", rank, None
        )
    exc.add_note(f"[tdist.testing] raised on rank {rank} of {world_size} ({name}); remote traceback:")
    exc.add_note(tb.rstrip())
    return exc


def _reap(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Stop and reap every process: SIGTERM, then SIGKILL after a grace period."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(5.0)
    for p in procs:
        with contextlib.suppress(Exception):
            p.close()


# -- stores ------------------------------------------------------------------------------------
class LocalStore:
    """A store server on this host for tests, with helpers to reach it.

    Made by ``local_store()``; every client made by ``client()`` is closed on exit.
    """

    def __init__(self, world_size: int, timeout: float, secret: str | bytes | None) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.secret = secret
        self.host = "127.0.0.1"
        self._server = TCPStore(
            self.host, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False, secret=secret
        )
        self.port: int = self._server.port
        self._clients: list[TCPStore] = []
        self._lock = threading.Lock()

    def client(self, timeout: float | None = None) -> TCPStore:
        """A new ``TCPStore`` client of this server (closed when the ``LocalStore`` closes)."""
        store = TCPStore(
            self.host,
            self.port,
            timeout=timedelta(seconds=self.timeout if timeout is None else timeout),
            secret=self.secret,
        )
        with self._lock:
            self._clients.append(store)
        return store

    def url(self, rank: int | None = None) -> str:
        """A ``tcp://`` URL of this server; with ``rank``, including ``rank`` and world size.

        Note that ``tcp://`` rendezvous makes rank 0 host a server of its own on the port: use
        ``env()`` with ``TORCHELASTIC_USE_AGENT_STORE=True`` to make every rank a client.
        """
        base = f"tcp://{self.host}:{self.port}"
        if rank is None:
            return base
        return f"{base}?rank={rank}&world_size={self.world_size}"

    def env(self, rank: int, *, agent_store: bool = True) -> dict[str, str]:
        """The environment ``tdist run`` gives ``rank``: ``env://`` rendezvous then joins this
        server as a client (with ``agent_store``)."""
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
        if agent_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        return env

    def close(self) -> None:
        """Close every client, then stop the server."""
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        self._server.close()

    def __enter__(self) -> LocalStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def local_store(
    world_size: int = 1, *, timeout: float = 30.0, secret: str | bytes | None = None
) -> Iterator[LocalStore]:
    """A store server on a free loopback port for ``world_size`` ranks, stopped on exit.

    Use it in a pytest fixture::

        @pytest.fixture
        def store_server() -> Iterator[LocalStore]:
            with local_store(2, timeout=10) as server:
                yield server

    Args:
        world_size: the number of ranks the tests will run (used by ``url`` and ``env``).
        timeout: the default timeout of the clients' blocking calls, in seconds.
        secret: the shared secret (default ``TDIST_SECRET``, else an open store).
    """
    server = LocalStore(world_size, timeout, secret)
    try:
        yield server
    finally:
        server.close()
