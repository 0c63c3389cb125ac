"""RRefs end to end on real processes: remote and to_here, local RRefs, introspection, RRefs as
arguments and results (forks), forward chains, deletion on the owner after the last user,
proxies, and to_here timeouts. Over both agents; see ``_rpc_harness``.
"""

from __future__ import annotations

import copy
import pickle
import time
from typing import Any

import pytest
import torch

from .._sync import holds_for
from . import rpc_funcs as f
from ._rpc_harness import (
    BACKENDS,
    TIMEOUT_RE,
    TORCH,
    Worker,
    better_than_torch,
    collect,
    observe,
    rpc,
    run,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", BACKENDS)]


def _remote_and_local(w: Worker) -> None:
    p = w.peer()
    me = rpc.get_worker_info()

    rref = rpc.remote(p, f.add, args=(1, 2))
    assert rref.to_here() == 3 and rref.to_here() == 3
    assert rref.owner() == rpc.get_worker_info(p) and rref.owner_name() == p
    assert not rref.is_owner()
    wait_until(rref.confirmed_by_owner, 5, "a user RRef is confirmed by its owner")
    with pytest.raises(RuntimeError, match=p):  # local_value() is for the owner only
        rref.local_value()

    ones = torch.ones(2, 3)
    assert torch.equal(rpc.remote(p, torch.add, args=(ones, 1)).to_here(), ones + 1)
    assert rpc.remote(p, f.Counter, args=(5,)).to_here().value == 5
    assert rpc.remote(p, f.add_kwargs, args=(1,), kwargs={"b": 2}).to_here() == 3
    with pytest.raises(ValueError, match="remote boom"):
        rpc.remote(p, f.raise_error, args=("ValueError", "remote boom")).to_here()

    # the future of the value's creation (torch's RRef._get_future)
    made = rpc.remote(p, f.add, args=(1, 2))
    fut = made._get_future()
    assert isinstance(fut, torch._C.Future)
    assert fut.wait() is None and made.to_here() == 3
    failed = rpc.remote(p, f.raise_error, args=("ValueError", "made badly"))
    assert failed._get_future().wait() is None  # made (as that error, which to_here raises)
    with pytest.raises(ValueError, match="made badly"):
        failed.to_here()
    failed_here = rpc.remote(w.me, f.raise_error, args=("ValueError", "made badly here"))
    assert failed_here._get_future().wait() is None  # (also when this worker is the owner)
    with pytest.raises(ValueError, match="made badly here"):
        failed_here.to_here()

    # RRef._get_type: blocking=False is a future, which a user gets before the owner answers
    # (here: before the value exists)
    slow = rpc.remote(p, f.sleep_then, args=(0.5, 5))
    typed = slow._get_type(blocking=False)
    assert not typed.done()
    assert typed.wait() is int and slow._get_type(blocking=False).wait() is int

    # remote() to itself: this worker owns the value
    own = rpc.remote(w.me, f.add, args=(1, 2))
    assert own.to_here() == 3 and own.is_owner() and own.local_value() == 3
    assert own.owner() == me and own.owner_name() == w.me

    # a local RRef
    with pytest.raises(RuntimeError, match="type_hint should only be specified"):
        rpc.RRef(torch.ones(1), torch.Tensor)  # (torch's: a type hint is for ScriptModules)
    local = rpc.RRef(35)
    assert local.local_value() == 35 and local.to_here() == 35
    assert local.is_owner() and local.confirmed_by_owner()
    assert local.owner() == me and local.owner_name() == w.me
    t = torch.arange(6.0)
    assert torch.equal(rpc.RRef(t).local_value(), t)
    assert torch.equal(rpc.RRef(t).to_here(), t)


def test_remote_to_here_local_rrefs_and_introspection(backend: str) -> None:
    run(_remote_and_local, backend)


def _rrefs_as_arguments(w: Worker) -> None:
    p, q = w.peer(1), w.peer(2)
    ones = torch.ones(2)
    rref = rpc.remote(p, torch.add, args=(ones, 1))  # owned by p
    # to a third worker (a fork of a user RRef)
    assert torch.equal(rpc.rpc_sync(q, f.rref_add, args=(rref, 1)), ones * 3)
    assert torch.equal(rpc.rpc_async(q, f.rref_to_here, args=(rref,)).wait(), ones * 2)
    assert torch.equal(rpc.remote(q, f.rref_add, args=(rref, 2)).to_here(), ones * 4)
    seen = rpc.rpc_sync(q, f.rref_info, args=(rref,))
    assert (seen["is_owner"], seen["owner_name"], seen["owner_id"]) == (False, p, (w.rank + 1) % 4)
    # back to its owner, where it is the owner RRef
    seen = rpc.rpc_sync(p, f.rref_info, args=(rref,))
    assert seen["is_owner"] and seen["owner_name"] == p
    assert torch.equal(rpc.rpc_sync(p, f.rref_local_value, args=(rref,)), ones * 2)

    # a local (owner) RRef lent to others
    mine = rpc.RRef(torch.full((2,), float(w.rank)))
    assert torch.equal(rpc.rpc_sync(p, f.rref_add, args=(mine, 1)), torch.full((2,), w.rank + 1.0))
    seen = rpc.rpc_sync(p, f.rref_info, args=(mine,))
    assert not seen["is_owner"] and seen["owner_name"] == w.me
    assert rpc.rpc_sync(p, f.rref_info, args=(rpc.RRef(1),))["owner_name"] == w.me

    # RRefs as results: owned by the callee, and made by the callee on a third worker
    counters = rpc.rpc_sync(p, f.make_local_rrefs, args=([1, 2, 3],))
    assert [c.owner_name() for c in counters] == [p, p, p]
    for c in counters:
        rpc.rpc_sync(c.owner(), f.call_on_rref, args=("increment", c, 10))
    assert [rpc.rpc_sync(c.owner(), f.call_on_rref, args=("get", c)) for c in counters] == [11, 12, 13]
    assert [c.to_here().value for c in counters] == [11, 12, 13]
    made = rpc.rpc_sync(p, f.remote_of, args=(q, f.add, (1, 2)))
    assert made.owner_name() == q and made.to_here() == 3
    # one's own remote RRef as an argument to itself
    assert rpc.rpc_sync(w.me, f.rref_add, args=(rpc.remote(w.me, f.add, args=(1, 2)), 1)) == 4
    w.barrier()  # nobody shuts down while others still use its RRefs


def test_rrefs_as_arguments_to_third_workers_and_as_results(backend: str) -> None:
    run(_rrefs_as_arguments, backend)


def _chain_and_deletion(w: Worker) -> dict[str, Any]:
    """Every worker at once: A = this worker, B and C = the next two, O (owner) = the last."""
    b, c, owner = w.peer(1), w.peer(2), w.peer(3)
    out: dict[str, Any] = {}

    # a forward chain A -> B -> C where A drops its reference first, then B
    key = f"chain-{w.rank}"
    rref = rpc.remote(owner, torch.add, args=(torch.ones(2), w.rank))
    rpc.rpc_sync(b, f.store_rref, args=(key, rref))
    del rref
    collect()
    rpc.rpc_sync(b, f.forward_stored, args=(key, c, True))
    # (a list: a tensor result would travel back to pytest through shared memory)
    out["chain"] = rpc.rpc_sync(c, f.stored_to_here, args=(key,)).tolist()
    rpc.rpc_sync(c, f.drop_rref, args=(key,))

    # the owner keeps a value while any user holds it, and deletes it after the last
    tag = f"tracked-{w.rank}"
    rref = rpc.remote(owner, f.Tracked, args=(tag,))
    wait_until(lambda: rpc.rpc_sync(owner, f.is_alive, args=(tag,)), 5, "the value was created")
    rpc.rpc_sync(b, f.store_rref, args=(tag, rref))  # a second user
    del rref
    collect()
    # (our release reaches the owner as a message: nothing here shows when it has been handled,
    # so the value is watched for a while, and the watch ends at once if it goes)
    try:
        holds_for(lambda: rpc.rpc_sync(owner, f.is_alive, args=(tag,)), 0.3, "the value lives")
        out["alive_while_a_user_holds_it"] = True
    except AssertionError:
        out["alive_while_a_user_holds_it"] = False
    rpc.rpc_sync(b, f.drop_rref, args=(tag,))
    t0 = time.monotonic()
    deadline = t0 + 20  # (a loaded machine: 5 s was not always enough)
    while rpc.rpc_sync(owner, f.is_alive, args=(tag,)) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["deleted_after_last_user_s"] = None if time.monotonic() >= deadline else time.monotonic() - t0

    # the same for a value this worker owns (a local RRef) and lends out
    tag = f"local-{w.rank}"
    local = rpc.RRef(f.Tracked(tag))
    rpc.rpc_sync(b, f.store_rref, args=(tag, local))
    del local
    collect()
    try:
        holds_for(lambda: f.is_alive(tag), 0.3, "the value lives")
        out["local_alive_while_lent"] = True
    except AssertionError:
        out["local_alive_while_lent"] = False
    rpc.rpc_sync(b, f.drop_rref, args=(tag,))
    deadline = time.monotonic() + 5
    while f.is_alive(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["local_deleted_after_return"] = not f.is_alive(tag)
    w.barrier()
    return out


def test_rref_forward_chain_after_the_creator_dropped_it(backend: str) -> None:
    for rank, out in enumerate(observe(_chain_and_deletion, backend)):
        assert out["chain"] == [1.0 + rank, 1.0 + rank]


def test_owner_deletes_the_value_after_the_last_user_dropped_it(backend: str) -> None:
    for out in observe(_chain_and_deletion, backend):
        assert out["alive_while_a_user_holds_it"] is True
        assert out["deleted_after_last_user_s"] is not None, "still alive 20 s after the last user"
        assert out["local_alive_while_lent"] is True
        assert out["local_deleted_after_return"] is True


def _proxies(w: Worker) -> None:
    p = w.peer()
    counter = rpc.remote(p, f.Counter, args=(5,))
    assert counter.rpc_sync().increment(2) == 7
    assert counter.rpc_async().increment(3).wait() == 10
    assert counter.remote().get().to_here() == 10
    assert counter.rpc_sync().get() == 10  # the state lives on the owner
    with pytest.raises(ValueError, match="proxy boom"):
        counter.rpc_sync().fail("proxy boom")
    with pytest.raises(ValueError, match="proxy boom"):
        counter.rpc_async().fail("proxy boom").wait()
    with pytest.raises(AttributeError):
        counter.rpc_sync().no_such_method()
    # proxies of RRefs this worker owns
    local = rpc.RRef(f.Counter(1))
    assert local.rpc_sync().increment(1) == 2
    assert local.rpc_async().increment(1).wait() == 3
    assert local.remote().get().to_here() == 3
    assert local.local_value().value == 3
    own = rpc.remote(w.me, f.Counter, args=(0,))
    assert own.rpc_sync().increment() == 1 and own.local_value().value == 1
    w.barrier()


def test_rref_proxies_rpc_sync_rpc_async_remote(backend: str) -> None:
    run(_proxies, backend)


def _to_here_timeout(w: Worker) -> list[str]:
    p = w.peer()
    messages = []
    rref = rpc.remote(p, f.sleep_then, args=(1.0, 5))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        rref.to_here(timeout=0.2)
    assert time.monotonic() - t0 < 0.9
    messages.append(str(info.value))
    assert rref.to_here() == 5  # the value arrives all the same
    counter = rpc.remote(p, f.Counter, args=(3,))
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        counter.rpc_sync(timeout=0.2).slow_get(1.0)
    messages.append(str(info.value))
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        counter.rpc_async(timeout=0.2).slow_get(1.0).wait()
    messages.append(str(info.value))
    assert counter.rpc_sync().get() == 3
    # a remote() that times out: the future of its creation fails (torch's RRef._get_future)
    late = rpc.remote(p, f.sleep_then, args=(1.0, 5), timeout=0.2)
    with pytest.raises(RuntimeError, match=TIMEOUT_RE):
        late._get_future().wait()
    w.barrier()
    return messages


def test_to_here_and_proxy_timeouts_on_a_slow_remote(backend: str) -> None:
    observe(_to_here_timeout, backend, world_size=2)


def _pickling_and_parameters(w: Worker) -> None:
    if w.rank == 0:
        rref = rpc.remote(w.peer(), f.Counter, args=(1,))
        for attempt in (lambda: pickle.dumps(rref), lambda: copy.deepcopy(rref), rref.__getstate__):
            with pytest.raises(RuntimeError, match="rref can only be pickled when using RPC"):
                attempt()
        # a parameter is fetched as a plain tensor that requires grad, as torch's to_here() does
        param = rpc.rpc_sync(w.peer(), f.parameter_rref)
        fetched = param.to_here()
        assert type(fetched) is torch.Tensor and fetched.requires_grad and fetched.grad_fn is None
        assert param._get_type() is torch.nn.Parameter
        # ... but a parameter made by remote() (a Python function's result) arrives as one
        made = rpc.remote(w.peer(), f.parameter)
        assert type(made.to_here()) is torch.nn.Parameter and made.to_here().requires_grad
    w.barrier()


def test_rrefs_refuse_plain_pickle_and_parameters_are_fetched_as_tensors(backend: str) -> None:
    run(_pickling_and_parameters, backend, world_size=2)


def _slow_made(w: Worker) -> None:
    # the owner waits for a value still being made as long as the call's own timeout allows,
    # not the agent's default (torch's owner waits without limit): here the default is 0.2 s
    # and the value takes 0.6 s to make
    default = rpc.get_rpc_timeout()
    rpc._set_rpc_timeout(0.2)
    w.barrier()
    try:
        if w.rank == 0:
            p = w.peer()
            made = [rpc.remote(p, f.SlowCounter, args=(n, 0.6), timeout=5) for n in range(5)]
            assert made[0].rpc_sync(timeout=5).get() == 0
            assert made[1].rpc_async(timeout=5).increment(2).wait() == 3
            assert made[2].remote(timeout=5).get().to_here(5) == 2
            assert made[3].rpc_sync(timeout=0).get() == 3  # 0: no limit
            assert rpc.rpc_sync(p, f.local_get, args=(made[4],), timeout=5) == 4  # local_value()
            with torch.autograd.profiler_legacy.profile():  # (a profiled proxy call waits as well)
                assert rpc.remote(p, f.SlowCounter, args=(5, 0.6), timeout=5).rpc_sync(timeout=5).get() == 5
        w.barrier()
    finally:
        rpc._set_rpc_timeout(default)


def test_the_owner_waits_for_a_value_being_made_within_the_callers_timeout(backend: str) -> None:
    run(_slow_made, backend, world_size=2)


@better_than_torch  # torch: "RPC ran for more than set timeout (200 ms)", no owner named
def test_to_here_timeout_error_names_the_owner(backend: str) -> None:
    for rank, messages in enumerate(observe(_to_here_timeout, backend, world_size=2)):
        assert all(f"worker{1 - rank}" in m for m in messages), messages


def _timed_out_remote(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if w.rank == 0:
        p = w.peer()
        rref = rpc.remote(p, f.tracked_after, args=(0.8, "late"), timeout=0.2)
        wait_until(lambda: rref._get_future().done(), 10, "the creation timed out")
        try:
            rref.to_here()
        except RuntimeError as exc:  # (not pytest.raises: it would keep the RRef alive)
            out["error"] = str(exc)
        del rref  # the owner made the value all the same, and holds our fork: it must go
        t0 = time.monotonic()
        while rpc.rpc_sync(p, f.is_alive, args=("late",)) is False and time.monotonic() - t0 < 3:
            time.sleep(0.05)  # (made 0.8 s after the request)
        while rpc.rpc_sync(p, f.is_alive, args=("late",)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        out["deleted"] = not rpc.rpc_sync(p, f.is_alive, args=("late",))
        rpc.remote(p, f.sleep_then, args=(0.8, 1), timeout=0.2)  # dropped at once, still running
    w.barrier()
    t0 = time.monotonic()
    w.shutdown()
    out["shutdown_s"] = time.monotonic() - t0
    return out


@better_than_torch  # torch: the processes hang (its shutdown waits for the timed-out RRef)
def test_a_timed_out_remote_value_is_deleted_when_its_late_reply_comes(backend: str) -> None:
    # (the owner registers the creator's fork when the request arrives: the creator's user
    # reference is confirmed by the late reply and then deleted; it once stayed forever and
    # held graceful shutdown for 10 s)
    out = run(_timed_out_remote, backend, world_size=2, init=True)
    assert out[0]["deleted"] is True
    assert all(o["shutdown_s"] < 4.0 for o in out), out


def _fetched_while_made(w: Worker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if w.rank == 0:
        p = w.peer()

        def confirmed_soon(rref: Any) -> bool:
            t0 = time.monotonic()
            while not rref.confirmed_by_owner() and time.monotonic() - t0 < 3.0:
                time.sleep(0.01)
            return bool(rref.confirmed_by_owner())

        # the fetch waits on the owner for the value: one reply answers it and the remote()
        rref = rpc.remote(p, f.tracked_after, args=(0.3, "fetched-early"))
        assert rref.to_here().tag == "fetched-early"
        out["confirmed"] = confirmed_soon(rref)
        rref._get_future().wait()
        del rref  # the owner deletes the value: the remote()'s fork was confirmed and let go
        t0 = time.monotonic()
        while rpc.rpc_sync(p, f.is_alive, args=("fetched-early",)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        out["deleted"] = not rpc.rpc_sync(p, f.is_alive, args=("fetched-early",))
        # a value that cannot be rebuilt here: to_here() fails, the remote() itself is done
        bad = rpc.remote(p, f.unrebuildable_after, args=(0.3, "not here"))
        try:
            bad.to_here()
        except Exception as exc:  # (not pytest.raises: it would keep the RRef alive)
            out["error"] = str(exc)
        out["bad_confirmed"] = confirmed_soon(bad)
        # fetched right after the remote(), many times (the common, merged, case)
        out["values"] = [rpc.remote(p, f.add, args=(i, 1)).to_here() for i in range(50)]
    w.barrier()
    return out


def test_a_fetch_that_waits_for_the_value_also_completes_the_remote(backend: str) -> None:
    out = run(_fetched_while_made, backend, world_size=2)[0]
    assert out["confirmed"] and out["deleted"], out
    assert "not here" in out["error"] and out["bad_confirmed"], out
    assert out["values"] == [i + 1 for i in range(50)]


_TORCH_DEBUG_KEYS = {
    "num_pending_users", "num_forks", "num_pending_futures", "num_owner_rrefs",
    "agent.server_active_async_calls", "agent.client_active_calls", "agent.server_active_calls",
    "agent.num_idle_threads", "agent.thread_pool_size",
    "num_autograd_contexts", "num_current_backward_passes",
}  # fmt: skip


def _debug_info(w: Worker) -> list[tuple[str, str]]:
    if TORCH:
        import torch.distributed.autograd as dist_autograd
    else:
        import tdist.autograd as dist_autograd  # type: ignore[no-redef]
    p = w.peer()

    def counts() -> tuple[str, str]:
        info = rpc._rref_context_get_debug_info()
        return info["num_owner_rrefs"], info["num_pending_users"]

    def flushed() -> bool:
        info = rpc._rref_context_get_debug_info()
        return info["num_pending_futures"] == "0" and info["num_pending_users"] == "0"

    seen = []
    # (torch's test_rref_context_debug_info) a local RRef counts once it is shared
    rref1 = rpc.RRef(w.rank)
    seen.append(counts())
    w.barrier()
    rpc.rpc_sync(p, f.store_rref, args=("debug", rref1))
    wait_until(flushed, 10, "RRef messages settled")
    w.barrier()
    seen.append(counts())
    w.barrier()
    rpc.rpc_sync(p, f.drop_rref, args=("debug",))
    wait_until(lambda: counts()[0] == "0", 10, "the shared RRef is no longer counted")
    w.barrier()
    rref2 = rpc.remote(p, torch.add, args=(torch.ones(2, 2), 1))
    rref3 = rpc.remote(p, torch.add, args=(torch.ones(2, 2), 1))
    rref2.to_here()
    rref3.to_here()
    wait_until(flushed, 10, "RRef messages settled")
    w.barrier()
    seen.append(counts())
    w.barrier()
    # (torch's test_debug_info) the three parts, together
    info = rpc._get_debug_info()
    rref_info = rpc._rref_context_get_debug_info()
    agent_info = rpc.api._get_current_rpc_agent().get_debug_info()
    autograd_info = dist_autograd._get_debug_info()
    assert not (rref_info.keys() & agent_info.keys() & autograd_info.keys())
    assert set(info) == set(rref_info) | set(agent_info) | set(autograd_info), info
    assert _TORCH_DEBUG_KEYS <= set(info), info
    assert "agent.gil_average_wait_time_us" not in info
    rpc.enable_gil_profiling(True)
    assert rpc.rpc_sync(p, f.add, args=(1, 2)) == 3
    wait_until(lambda: "agent.gil_average_wait_time_us" in rpc._get_debug_info(), 5, "the GIL wait is reported")
    assert float(rpc._get_debug_info()["agent.gil_average_wait_time_us"]) >= 0.0
    rpc.enable_gil_profiling(False)
    assert "agent.gil_average_wait_time_us" not in rpc._get_debug_info()
    w.barrier()
    del rref2, rref3
    return seen


def test_debug_info_counts_rrefs_and_has_torchs_keys(backend: str) -> None:
    for seen in run(_debug_info, backend, world_size=2):
        assert seen == [("0", "0"), ("1", "0"), ("2", "0")]


def _rref_str(w: Worker) -> list[str]:
    # (torch's test_rref_str) ids count per worker: a local RRef takes one, a remote() two
    out = []
    if w.rank == 0:
        rref1 = rpc.RRef(w.rank)
        rref2 = rpc.remote(w.peer(), torch.add, args=(torch.ones(2, 2), 1))
        out = [str(rref1), str(rref2), repr(rref2)]
        rref2.to_here()
    w.barrier()
    return out


def test_rrefs_print_as_torchs(backend: str) -> None:
    local, user, user_repr = run(_rref_str, backend, world_size=2)[0]
    gid = "GloballyUniqueId(created_on=0, local_id={})"
    assert local == f"OwnerRRef({gid.format(0)})"
    assert user == user_repr == f"UserRRef(RRefId = {gid.format(1)}, ForkId = {gid.format(2)})"


def _rrefs_after_reinit(w: Worker) -> None:
    w.shutdown()
    w.init(port=w.shared["second_port"])
    assert rpc.remote(w.peer(), f.add, args=(1, 2)).to_here() == 3
    assert rpc.rpc_sync(w.peer(), f.rref_add, args=(rpc.RRef(1), 1)) == 2
    w.barrier()


@better_than_torch  # torch: graceful shutdown after RRefs in a second init_rpc hangs
def test_rrefs_work_after_shutdown_and_init_again(backend: str) -> None:
    from tdist.testing import free_port

    run(_rrefs_after_reinit, backend, timeout=15, shared={"second_port": free_port()})
