"""An error leaves no reference cycle through the frames it passed: what the callers' frames
held is freed when they return, not at the next collection.

An exception raised carries each frame it passed, and a frame keeps its caller's. Kept by an
object one of those frames holds (a work, a peer, a future, a broken group, a store client),
or by a local of one, it made a cycle only the garbage collector frees: the callers' tensors
lived on, a torch future kept its exception in C++ where the collector cannot see (for good),
and a forked child that collected a torch ``TCPStore`` server of its parent aborted.

Each test runs the failing call inside a caller whose frame holds an object, with the
collector off, and checks the object is gone once the caller returned (``errors.fresh``).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

import tdist
from tdist.c10d._tcp_backend import ProcessGroupTCP
from tdist.testing import run_threads

from . import rpc_funcs as f
from ._rpc_harness import BACKENDS, Worker, rpc, run

pytestmark = pytest.mark.timeout(60)


class Held:
    """What a caller's frame holds (a tensor, a store)."""


def freed(call: Callable[[], object]) -> tuple[str, bool]:
    """``call()``'s error type, and whether the object its caller held was freed with the
    caller's frame, the collector off."""

    def caller() -> tuple[weakref.ref[Held], str]:
        held = Held()
        try:
            call()
        except Exception as exc:
            return weakref.ref(held), type(exc).__name__
        return weakref.ref(held), "no error"

    gc.collect()
    gc.disable()
    try:
        ref, kind = caller()
        return kind, ref() is None
    finally:
        gc.enable()


@contextlib.contextmanager
def pair(timeout: float) -> Iterator[list[ProcessGroupTCP]]:
    store = tdist.HashStore()
    pgs: list[Any] = [None, None]

    def body(rank: int, n: int) -> None:
        pgs[rank] = ProcessGroupTCP(tdist.PrefixStore("g", store), rank, n, timedelta(seconds=timeout))

    run_threads(body, 2, timeout=30)
    try:
        yield pgs
    finally:
        run_threads(lambda rank, n: pgs[rank].shutdown(), 2, timeout=30)


def test_a_collective_that_times_out_and_the_broken_group_after_it() -> None:
    with pair(timeout=0.5) as pgs:
        t = torch.ones(3)
        assert freed(lambda: pgs[0].allreduce([t]).wait()) == ("CollectiveTimeoutError", True)

        def held_work() -> None:
            work = pgs[0].allreduce([t])  # (the caller holds the failed work)
            work.wait()

        assert freed(held_work) == ("DistBackendError", True)
        assert freed(lambda: pgs[0].send([t], 1, 0).wait()) == ("PeerError", True)


def test_a_receive_that_times_out_at_the_groups_deadline() -> None:
    with pair(timeout=0.5) as pgs:
        assert freed(lambda: pgs[1].recv([torch.zeros(3)], 0, 7).wait()) == ("CollectiveTimeoutError", True)


def test_a_future_that_a_then_callback_failed_keeps_none_of_its_frames() -> None:
    """torch's future keeps its error in C++, where the collector cannot see: the callback's
    frames, which the error's traceback held, and what they held, were never freed."""
    from tdist.rpc._future import Future

    refs: list[weakref.ref[Held]] = []

    def fail(done: object) -> None:
        held = Held()  # (what the failing callback's frame holds)
        refs.append(weakref.ref(held))
        raise ValueError("the callback failed")

    def run() -> None:
        first: Any = Future()
        then = first.then(fail)
        first.set_result(1)
        with pytest.raises(ValueError, match="the callback failed"):
            then.wait()

    run()
    gc.collect()
    assert len(refs) == 1 and refs[0]() is None


def test_a_receive_whose_own_wait_times_out() -> None:
    with pair(timeout=30) as pgs:
        work = pgs[1].recv([torch.zeros(3)], 0, 7)
        assert freed(lambda: work.wait(timedelta(seconds=0.05))) == ("CollectiveTimeoutError", True)
        pgs[0].send([torch.ones(3)], 1, 7).wait()
        assert work.wait()


def _leaves(port: int) -> None:
    store = tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    ProcessGroupTCP(tdist.PrefixStore("lost", store), 1, 2, timedelta(seconds=20))
    store.set("joined", "1")
    store.wait(["go"])
    os._exit(0)  # (no goodbye: the connection is lost)


def test_a_lost_peer_and_every_call_after_it() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
    child = multiprocessing.get_context("fork").Process(target=_leaves, args=(master.port,))
    child.start()
    try:
        pg = ProcessGroupTCP(tdist.PrefixStore("lost", master), 0, 2, timedelta(seconds=20))
        master.wait(["joined"])
        t = torch.ones(3)

        def lost() -> None:
            master.set("go", "1")
            pg.allreduce([t]).wait()

        assert freed(lost) == ("PeerError", True)
        assert freed(lambda: pg.allreduce([t]).wait()) == ("DistBackendError", True)
        assert freed(lambda: pg.send([t], 1, 0).wait()) == ("PeerError", True)
        pg.shutdown()
    finally:
        child.join(20)
        if child.is_alive():
            child.kill()
        master.close()


def test_a_store_whose_server_went_and_one_that_never_came() -> None:
    server = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    client = tdist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    client.set("k", "v")
    assert freed(lambda: client.wait(["absent"], timedelta(milliseconds=20))) == ("StoreTimeoutError", True)
    port = server.port
    server.close()
    assert freed(lambda: client.get("k")) == ("DistNetworkError", True)
    assert freed(lambda: client.get("k")) == ("DistNetworkError", True)  # (the client is broken now)
    client.close()
    none_there = lambda: tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=0.3))  # noqa: E731
    assert freed(none_there) == ("DistNetworkError", True)


def _rpc_errors(w: Worker) -> dict[str, tuple[str, bool]]:
    if w.rank == 1:
        return {}
    p = w.peer()
    raising = (f.raise_error, ("ValueError", "boom"))
    out = {
        "rpc_sync": freed(lambda: rpc.rpc_sync(p, raising[0], args=raising[1])),
        "rpc_async": freed(lambda: rpc.rpc_async(p, raising[0], args=raising[1]).wait()),
    }

    def held_future() -> None:
        fut = rpc.rpc_async(p, raising[0], args=raising[1])
        fut.wait()

    out["held future"] = freed(held_future)
    fut = rpc.rpc_async(p, raising[0], args=raising[1])
    out["a future waited twice"] = freed(fut.wait)
    out["a future waited twice, again"] = freed(fut.wait)
    rref = rpc.remote(p, raising[0], args=raising[1])
    out["to_here"] = freed(rref.to_here)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_rpc_that_raises(backend: str) -> None:
    got = run(_rpc_errors, backend, world_size=2)[0]
    assert got == dict.fromkeys(got, ("ValueError", True)) and len(got) == 6, got
