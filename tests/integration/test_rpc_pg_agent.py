"""The PROCESS_GROUP RPC agent on real processes: calls, tensors, errors, RRefs, ordering under
concurrent senders, graceful shutdown, static membership only, a killed worker.

A focused smoke suite; ``test_rpc*.py`` runs the full scenarios over both agents.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from tdist import rpc
from tdist._core.errors import PeerError
from tdist.rpc._options import ProcessGroupRpcBackendOptions
from tdist.rpc._pg_agent import ProcessGroupAgent
from tdist.testing import RankFailedError, free_port, run_processes

from .._sync import wait_until, when_inside

pytestmark = pytest.mark.timeout(60)

WORLD = 4


class CustomError(Exception):
    pass


# -- what the callees run (module level: they exist in every forked worker) --------------------


def scale(t: torch.Tensor, k: float) -> torch.Tensor:
    return t * k


def make_tensor(n: int, fill: float) -> torch.Tensor:
    return torch.full((n,), fill)


def rref_sum(rref: Any) -> float:
    """Runs on a third worker: fetches the value from its owner."""
    return float(rref.to_here().sum())


def rref_owner_name(rref: Any) -> str:
    return str(rref.owner().name)


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


def raise_custom(msg: str) -> None:
    raise CustomError(msg)


def echo(tag: int, t: torch.Tensor) -> tuple[int, torch.Tensor]:
    return tag, t


def my_name() -> str:
    return str(rpc.get_worker_info().name)


_sleeping = threading.Event()
_sleepers = [0]  # the sleep_for calls that run here
_sleepers_lock = threading.Lock()


def sleep_for(seconds: float) -> str:
    with _sleepers_lock:
        _sleepers[0] += 1
    _sleeping.set()
    time.sleep(seconds)
    return "slept"


def die_once_sleeping(callers: int) -> None:
    """Die (SIGKILL) once ``callers`` calls of ``sleep_for`` run here: they wait on it."""
    wait_until(lambda: _sleepers[0] >= callers, 20, f"{callers} sleep_for calls arrive")
    os.kill(os.getpid(), signal.SIGKILL)


_arrivals: dict[int, list[int]] = {}


def record(src: int, i: int, t: torch.Tensor) -> int:
    _arrivals.setdefault(src, []).append(i)
    return t.numel()


def recorded(src: int) -> list[int]:
    return _arrivals.get(src, [])


# -- helpers -------------------------------------------------------------------------------------


def _init(rank: int, port: int, world: int = WORLD, **options: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType.PROCESS_GROUP,
        rank=rank,
        world_size=world,
        rpc_backend_options=ProcessGroupRpcBackendOptions(**options),
    )


# -- the main scenario ---------------------------------------------------------------------------


def _calls(rank: int, world: int, port: int) -> dict[str, Any]:
    _init(rank, port)
    nxt, third = f"worker{(rank + 1) % world}", f"worker{(rank + 2) % world}"
    out: dict[str, Any] = {}

    t = torch.arange(10, dtype=torch.float32) + rank
    assert torch.equal(rpc.rpc_sync(nxt, torch.add, args=(t, 1)), t + 1)
    # 8 MiB: the same-host cross-memory path of the process group
    big = torch.randn(1 << 21)
    assert torch.equal(rpc.rpc_async(nxt, scale, args=(big, 2.0)).wait(), big * 2.0)
    assert torch.equal(rpc.remote(nxt, make_tensor, args=(5, float(rank))).to_here(), torch.full((5,), float(rank)))
    assert rpc.rpc_sync(nxt, my_name) == nxt
    # to ourselves, by name and through remote
    assert rpc.rpc_sync(f"worker{rank}", my_name) == f"worker{rank}"
    assert torch.equal(rpc.remote(f"worker{rank}", scale, args=(t, 3.0)).to_here(), t * 3.0)

    # errors keep their type and message
    with pytest.raises(ValueError, match=f"bad value from {rank}"):
        rpc.rpc_sync(nxt, raise_value_error, args=(f"bad value from {rank}",))
    with pytest.raises(CustomError, match="custom"):
        rpc.rpc_async(nxt, raise_custom, args=("custom",)).wait()
    with pytest.raises(ValueError, match="in remote"):
        rpc.remote(nxt, raise_value_error, args=("in remote",)).to_here()

    # an RRef owned by the next worker, used by a third one
    rref = rpc.remote(nxt, make_tensor, args=(100, float(rank + 1)))
    assert rpc.rpc_sync(third, rref_sum, args=(rref,)) == 100.0 * (rank + 1)
    assert rpc.rpc_sync(third, rref_owner_name, args=(rref,)) == nxt
    assert torch.equal(rref.to_here(), torch.full((100,), float(rank + 1)))

    # a callback may block on another call to the same worker (its reply needs a reader)
    fut = rpc.rpc_async(nxt, scale, args=(t, 2.0))
    for _ in range(3):
        fut = fut.then(lambda f: rpc.rpc_sync(nxt, scale, args=(f.wait(), 2.0)))
    assert torch.equal(fut.wait(), t * 16)

    # several threads sending to one worker at once: every reply pairs with its request
    errors: list[BaseException] = []

    def burst(k: int) -> None:
        try:
            futs = []
            for i in range(15):
                n = (k * 7919 + i * 104729) % (1 << 17) if i % 3 == 0 else i
                futs.append((k * 100 + i, n, rpc.rpc_async(nxt, echo, args=(k * 100 + i, torch.full((n,), float(i))))))
            for tag, n, fut in futs:
                got_tag, got = fut.wait()
                assert got_tag == tag and torch.equal(got, torch.full((n,), float(tag % 100)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=burst, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors

    start = time.monotonic()
    rpc.shutdown()
    out["shutdown_s"] = time.monotonic() - start
    return out


def test_calls_tensors_errors_rrefs_and_graceful_shutdown() -> None:
    results = run_processes(_calls, WORLD, free_port(), timeout=60)
    assert all(r["shutdown_s"] < 10 for r in results)


# -- static membership only -----------------------------------------------------------------------


def _large_both_ways(rank: int, world: int, port: int) -> bool:
    _init(rank, port, world)
    peer = f"worker{rank ^ 1}"
    errors: list[BaseException] = []

    def calls(k: int) -> None:
        try:
            for i in range(3):
                t = torch.full((3 << 20,), float(rank * 100 + k * 10 + i))  # 12 MiB each way
                got_tag, got = rpc.rpc_sync(peer, echo, args=(i, t))
                assert got_tag == i and torch.equal(got, t)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(40)
    assert not errors, errors
    rpc.shutdown()
    return True


def test_large_messages_both_ways_at_once_travel_whole() -> None:
    # Requests one way and replies the other, each a single process-group message copied
    # straight from the sender's memory: neither side's reader waits on a send of its own.
    # (fresh interpreters: its threads' 12 MiB tensors run torch's OpenMP, which a child forked
    # from a test process that used it may find broken: "Invalid thread pool!")
    # (one pair: every rank both calls and answers)
    assert run_processes(_large_both_ways, 2, free_port(), timeout=50, start_method="forkserver") == [True] * 2


def test_world_size_none_is_refused_directly() -> None:
    with pytest.raises(ValueError, match="fixed world_size; use TENSORPIPE"):
        ProcessGroupAgent(None, "w", 0, None, ProcessGroupRpcBackendOptions())


def _dynamic(rank: int, world: int, port: int) -> str:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    with pytest.raises(ValueError, match="fixed world_size") as info:
        rpc.init_rpc("solo", backend=rpc.BackendType.PROCESS_GROUP, rank=0, world_size=None,
                     rpc_backend_options=ProcessGroupRpcBackendOptions())
    return str(info.value)


def test_world_size_none_is_refused_by_init_rpc() -> None:
    [msg] = run_processes(_dynamic, 1, free_port(), timeout=30)
    assert "TENSORPIPE" in msg


# -- a worker killed while calls wait on it --------------------------------------------------------


def _killed(rank: int, world: int, port: int, everyone: Any, results: Any) -> None:
    _init(rank, port)
    assert rpc.rpc_sync(f"worker{(rank + 1) % world}", my_name) == f"worker{(rank + 1) % world}"
    everyone.wait(20)
    if rank == 3:
        time.sleep(30)  # killed by worker0's call before this ends
        return
    if rank == 0:  # (worker3 dies once the calls of worker1 and worker2 run there)
        fut = rpc.rpc_async("worker3", die_once_sleeping, args=(2,))
    else:
        fut = rpc.rpc_async("worker3", sleep_for, args=(20.0,))
    start = time.monotonic()
    report: dict[str, Any] = {"rank": rank}
    try:
        fut.wait()
        report["error"] = None
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["peer_error"] = isinstance(exc, PeerError)
    report["failed_after_s"] = time.monotonic() - start
    # the group is broken now: another call fails at once too, naming the lost worker
    start = time.monotonic()
    try:
        rpc.rpc_sync(f"worker{(rank + 1) % 3}", my_name, timeout=20)
        report["next"] = None
    except Exception as exc:
        report["next"] = str(exc)
    report["next_s"] = time.monotonic() - start
    rpc.shutdown(graceful=False)
    results.put(report)


def test_killed_worker_fails_pending_calls_fast() -> None:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with pytest.raises(RankFailedError) as info:
        run_processes(_killed, WORLD, free_port(), ctx.Barrier(WORLD), results, timeout=40, grace=15.0)
    assert info.value.rank == 3, info.value
    reports = sorted((results.get(timeout=5) for _ in range(3)), key=lambda r: r["rank"])
    for r in reports:
        assert r["error"] is not None and r["peer_error"], r
        assert "worker3" in r["error"], r
        # (fast: at the loss of the connection, not at the group's stall timeout, 10 s)
        assert r["failed_after_s"] < 8.0, r
        assert r["next"] is not None and "worker3" in r["next"], r
        assert r["next_s"] < 8.0, r


# -- a worker that leaves in an orderly way: the others go on ----------------------------------------


def _leaves(rank: int, world: int, port: int, everyone: Any, survivors: Any, waiting: Any) -> dict[str, Any]:
    # one thread runs the requests: they run in the order they arrived
    _init(rank, port, num_send_recv_threads=1)
    assert rpc.rpc_sync(f"worker{(rank + 1) % world}", my_name) == f"worker{(rank + 1) % world}"
    everyone.wait(20)
    report: dict[str, Any] = {}
    if rank in (1, 2):
        # messages from one worker to another arrive in the order sent (both ways at once,
        # payloads of one piece and of several)
        peer = f"worker{3 - rank}"
        futs = [
            rpc.rpc_async(peer, record, args=(rank, i, torch.zeros((1 << 18) if i % 10 == 0 else i)))
            for i in range(150)
        ]
        assert rpc.rpc_sync(peer, recorded, args=(rank,)) == list(range(150))
        assert [f.wait() for f in futs] == [(1 << 18) if i % 10 == 0 else i for i in range(150)]
    if rank == 3:
        assert _sleeping.wait(20)  # worker0's call runs here: leave while it waits ...
        assert waiting.wait(20)  # ... on its future
        rpc.shutdown(graceful=False)
        return report
    if rank == 0:
        fut = rpc.rpc_async("worker3", sleep_for, args=(10.0,))
        start = time.monotonic()
        when_inside("wait", waiting.set, "futures/__init__.py")  # (tells worker3: it may leave)
        with pytest.raises(PeerError, match="worker3") as info:
            fut.wait()
        report["failed_after_s"] = time.monotonic() - start
        report["error"] = str(info.value)
        # the process group is intact: the others answer, worker3 is refused at once
        assert rpc.rpc_sync("worker1", my_name) == "worker1"
        assert torch.equal(rpc.rpc_sync("worker2", scale, args=(torch.ones(3), 2.0)), torch.full((3,), 2.0))
        with pytest.raises(PeerError, match="worker3"):
            rpc.rpc_sync("worker3", my_name)
    survivors.wait(20)  # no graceful shutdown: its barrier would wait for worker3
    rpc.shutdown(graceful=False)
    return report


def test_a_worker_that_leaves_fails_calls_to_it_and_the_others_go_on() -> None:
    ctx = multiprocessing.get_context("fork")
    results = run_processes(_leaves, WORLD, free_port(), ctx.Barrier(WORLD), ctx.Barrier(WORLD - 1), ctx.Event(),
                            timeout=40)
    assert results[0]["failed_after_s"] < 8.0, results[0]  # (not at the stall timeout, 10 s)
    assert "left" in results[0]["error"], results[0]


# -- a group of one -----------------------------------------------------------------------------------


def _alone(rank: int, world: int, port: int) -> str:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc("solo", backend=rpc.BackendType.PROCESS_GROUP, rank=0, world_size=1,
                 rpc_backend_options=ProcessGroupRpcBackendOptions())
    assert torch.equal(rpc.rpc_sync("solo", scale, args=(torch.ones(2), 3.0)), torch.full((2,), 3.0))
    assert rpc.remote("solo", make_tensor, args=(3, 1.0)).to_here().sum() == 3.0
    name = my_name()
    rpc.shutdown()
    return name


def test_a_group_of_one_calls_itself() -> None:
    assert run_processes(_alone, 1, free_port(), timeout=30) == ["solo"]
