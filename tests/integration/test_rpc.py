"""tdist.rpc end to end on real processes, against torch.distributed.rpc's documented behaviour:
init and the backend registry, calls, futures, errors, async_execution, timeouts, shutdown.

Four workers (``worker0``..``worker3``) per test, over both agents (``tensorpipe`` and
``process_group``); ``TDIST_RPC_TEST_IMPL=torch`` runs the same tests on torch (see
``_rpc_harness``). Tests marked ``better_than_torch`` check what torch does not do.
"""

from __future__ import annotations

import multiprocessing
import operator
import pickle
import re
import sys
import threading
import time
import types
from typing import Any

import pytest
import torch

from .._sync import when_inside
from . import rpc_funcs as f
from ._rpc_harness import (
    BACKENDS,
    TIMEOUT_RE,
    TORCH,
    Worker,
    better_than_torch,
    name,
    observe,
    rpc,
    run,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", BACKENDS)]


def call(mode: str, to: Any, func: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
         **kw: Any) -> Any:
    """One call in one of the three ways: ``rpc_sync``, ``rpc_async().wait()``, ``remote().to_here()``."""
    if mode == "sync":
        return rpc.rpc_sync(to, func, args=args, kwargs=kwargs, **kw)
    if mode == "async":
        return rpc.rpc_async(to, func, args=args, kwargs=kwargs, **kw).wait()
    return rpc.remote(to, func, args=args, kwargs=kwargs, **kw).to_here()


MODES = ("sync", "async", "remote")


# -- init and the registry ---------------------------------------------------------------------


def _init_barrier_and_worker_infos(w: Worker) -> tuple[float, float]:
    time.sleep(0.15 * w.rank)  # the workers arrive one after another
    arrived = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    w.init(rpc_timeout=45)
    returned = time.monotonic()
    # every worker is reachable as soon as init_rpc returned
    assert [rpc.rpc_sync(n, f.whoami) for n in w.others()] == w.others()
    assert rpc.get_rpc_timeout() == pytest.approx(45)

    me = rpc.get_worker_info()
    assert (me.name, me.id) == (w.me, w.rank)
    assert rpc.get_worker_info(w.me) == me
    infos = [rpc.get_worker_info(name(r)) for r in range(w.world_size)]
    assert [(i.name, i.id) for i in infos] == [(name(r), r) for r in range(w.world_size)]
    assert infos[w.rank] == me and infos[(w.rank + 1) % w.world_size] != me
    assert pickle.loads(pickle.dumps(me)) == me
    # a WorkerInfo travels as an argument and a result, equal to the original
    assert rpc.rpc_sync(w.peer(), f.identity, args=(me,)) == me
    # the destination as a name, a WorkerInfo or a rank
    assert rpc.rpc_sync(infos[(w.rank + 1) % w.world_size], f.whoami) == w.peer()
    assert rpc.rpc_sync((w.rank + 2) % w.world_size, f.my_id) == (w.rank + 2) % w.world_size
    with pytest.raises(RuntimeError, match="nosuchworker"):
        rpc.get_worker_info("nosuchworker")
    with pytest.raises(RuntimeError, match=r"(?i)already initialized"):
        w.init()
    w.initialized = True
    return arrived, returned


def test_init_rpc_is_a_barrier_and_worker_infos_name_every_worker(backend: str) -> None:
    times = run(_init_barrier_and_worker_infos, backend, init=False)
    last_arrival = max(a for a, _ in times)
    assert all(r >= last_arrival for _, r in times), times


def _duplicate_names(w: Worker) -> None:
    # worker0 twice (ranks 0 and 3): every rank learns of it, none is left half-initialized
    with pytest.raises(RuntimeError, match=r"(?i)unique|duplicate") as info:
        w.init(name(w.rank % 3))
    assert "worker0" in str(info.value)
    w.barrier()  # rank 0 hosts the rendezvous store: it stays until everyone has failed


def test_duplicate_worker_names_fail_init_on_every_rank(backend: str) -> None:
    run(_duplicate_names, backend, init=False, timeout=30)


def _invalid_names_and_types(w: Worker) -> None:
    # torch's rule: [A-Za-z0-9-_:], non-empty, shorter than 128 characters
    for bad in ("abc*", " ", "", "a" * 200, "worker 1", "w/1"):
        try:
            rpc.WorkerInfo(bad, 0)
        except RuntimeError:  # torch: RuntimeError("Worker name must match ...")
            continue
        raise AssertionError(f"WorkerInfo({bad!r}, 0) did not raise RuntimeError")
    ok = rpc.WorkerInfo("Trainer-3_x:1", 5)
    assert (ok.name, ok.id) == ("Trainer-3_x:1", 5)
    with pytest.raises(RuntimeError, match=r"(?i)not (been )?initialized"):
        rpc.rpc_sync("worker0", f.add, args=(1, 2))
    with pytest.raises(TypeError, match="BackendType"):
        rpc.init_rpc("worker0", backend="TENSORPIPE", rank=0, world_size=1)
    with pytest.raises(TypeError, match="RpcBackendOptions"):
        rpc.init_rpc("worker0", rank=0, world_size=1,
                     rpc_backend_options={"init_method": f"tcp://127.0.0.1:{w.port}"})
    with pytest.raises(RuntimeError, match=r"bad name\*"):
        w.init("bad name*")
    # a failed init leaves nothing behind: the next one works
    w.init()
    assert rpc.get_rpc_timeout() == pytest.approx(60)  # the options' default
    assert rpc.rpc_sync("worker0", f.add, args=(1, 2)) == 3
    w.shutdown()
    with pytest.raises(RuntimeError, match=r"(?i)not (been )?initialized"):
        rpc.rpc_sync("worker0", f.add, args=(1, 2))


def test_invalid_worker_names_and_argument_types_are_rejected(backend: str) -> None:
    run(_invalid_names_and_types, backend, world_size=1, init=False, timeout=30)


def _destinations(w: Worker) -> dict[str, Any]:
    # torch's checks of init_rpc's argument types (RuntimeError), in torch's words
    for kwargs, words in (({"name": 3}, "must be of type"), ({"rank": "0"}, "`rank` must be an integer"),
                          ({"world_size": "2"}, "`world_size` must be an integer")):
        args = {"name": w.me, "rank": w.rank, "world_size": w.world_size, **kwargs}
        with pytest.raises(RuntimeError, match=words):
            rpc.init_rpc(args["name"], rank=args["rank"], world_size=args["world_size"],
                         rpc_backend_options=w.options())
    w.init()
    out: dict[str, Any] = {}
    if w.rank == 0:
        # torch's private helpers that code uses
        agent = rpc.api._get_current_rpc_agent()
        assert [i.name for i in agent.get_worker_infos()] == ["worker0", "worker1"]
        assert rpc._get_debug_info()["agent.client_active_calls"] == "0"
        rpc._set_rpc_timeout(7.5)
        assert rpc.get_rpc_timeout() == 7.5
        # a WorkerInfo is found by its name, as torch finds it
        assert rpc.rpc_sync(rpc.WorkerInfo("worker1", 0), f.whoami) == "worker1"
        assert rpc.get_worker_info(1) == rpc.get_worker_info("worker1")
        t0 = time.monotonic()
        for use in (lambda to: rpc.rpc_sync(to, f.whoami), lambda to: rpc.rpc_async(to, f.whoami),
                    lambda to: rpc.remote(to, f.whoami)):
            for to in (rpc.WorkerInfo("fake", 1), rpc.WorkerInfo("fake", 5), "fake", 5):
                with pytest.raises(RuntimeError, match="could not find destination"):
                    use(to)
        out["unknown_s"] = time.monotonic() - t0  # at once, never waiting for a stranger
        with pytest.raises(ValueError, match="Cannot get WorkerInfo"):
            rpc.rpc_sync(1.0, f.whoami)
        info = rpc.get_worker_info()
        with pytest.raises(AttributeError):
            info.name = "other"  # type: ignore[misc]
        assert rpc.get_worker_info().name == "worker0"
        # torch's ids are int16s: a negative one is a WorkerInfo, a bigger one a TypeError
        with pytest.raises(TypeError):
            rpc.WorkerInfo("big", 1 << 16)
        with pytest.raises(TypeError):
            rpc.WorkerInfo("small", -(1 << 15) - 1)
        assert rpc.WorkerInfo("neg", -1).id == -1
        # a negative timeout other than -1 has run out already (torch); the text says how long
        with pytest.raises(RuntimeError, match=r"ran for more than set timeout \(200 ms\)"):
            rpc.rpc_sync("worker1", f.sleep_then, args=(1.0,), timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"ran for more than set timeout \(-5000 ms\)"):
            rpc.rpc_sync("worker1", f.sleep_then, args=(1.0,), timeout=-5)
        out["negative_s"] = time.monotonic() - t0
    w.barrier()
    return out


def test_destinations_worker_infos_argument_types_and_negative_timeouts(backend: str) -> None:
    out = run(_destinations, backend, world_size=2, init=False)[0]
    # (negative_s: failed at once, not when the callee answered, 1 s later)
    assert out["unknown_s"] < 2 and out["negative_s"] < 0.9, out


def _agent_helpers(w: Worker) -> dict[str, Any]:
    threads = {"num_worker_threads": 5} if w.backend == "tensorpipe" else {}
    options = w.options(rpc_timeout=7, **threads)
    if w.backend == "tensorpipe" and w.rank == 0:
        options.set_device_map("worker1", {"cpu": "cpu"})
    rpc.init_rpc(w.me, backend=w.backend_type, rank=w.rank, world_size=w.world_size,
                 rpc_backend_options=options)
    w.initialized = True
    out: dict[str, Any] = {}
    if w.rank == 0:
        # the methods of torch's agent that code reaches through _get_current_rpc_agent()
        agent = rpc.api._get_current_rpc_agent()
        opts = agent._get_backend_options()
        out["options"] = (type(opts).__name__, opts.rpc_timeout, opts.init_method)
        out["metrics"] = agent.get_metrics()
        out["static"] = agent.is_static_group
        if w.backend == "tensorpipe":
            out["threads"] = opts.num_worker_threads
            out["map1"] = agent._get_device_map(rpc.get_worker_info("worker1"))
            out["map0"] = agent._get_device_map(rpc.get_worker_info("worker0"))
    w.barrier()
    return out


def test_the_agents_torch_methods_report_options_metrics_and_device_maps(backend: str) -> None:
    out = run(_agent_helpers, backend, world_size=2, init=False)[0]
    name_, timeout, init_method = out["options"]
    assert name_.endswith("RpcBackendOptions") or name_ == "_TensorPipeRpcBackendOptionsBase", out
    assert timeout == 7 and init_method.startswith("tcp://127.0.0.1:"), out
    # torch's five figures (its get_debug_info's, which ours extends)
    assert set(out["metrics"]) == {"agent.client_active_calls", "agent.num_idle_threads",
                                   "agent.server_active_async_calls", "agent.server_active_calls",
                                   "agent.thread_pool_size"}, out
    assert out["metrics"]["agent.client_active_calls"] == "0", out
    assert out["static"] is True
    if backend == "tensorpipe":
        assert out["threads"] == 5 and out["metrics"]["agent.thread_pool_size"] == "5", out
        assert out["map1"] == {torch.device("cpu"): torch.device("cpu")} and out["map0"] == {}, out


def _registered_backend(w: Worker) -> dict[str, Any]:
    base = w.backend_type.value
    calls: list[str] = []

    def construct(*args: Any, **kwargs: Any) -> Any:
        calls.append("construct")
        return base.construct_rpc_backend_options_handler(*args, **kwargs)

    def init_backend(*args: Any, **kwargs: Any) -> Any:
        calls.append("init")
        return base.init_backend_handler(*args, **kwargs)

    registry = rpc.backend_registry
    mine = registry.register_backend("MINE", construct, init_backend)
    assert registry.backend_registered("MINE")
    assert registry.BackendType["MINE"] is mine
    with pytest.raises(RuntimeError, match="MINE: already registered"):
        registry.register_backend("MINE", construct, init_backend)
    options = registry.construct_rpc_backend_options(
        mine, rpc_timeout=33, init_method=f"tcp://127.0.0.1:{w.port}"
    )
    rpc.init_rpc(w.me, backend=mine, rank=w.rank, world_size=w.world_size,
                 rpc_backend_options=options)
    w.initialized = True
    assert calls == ["construct", "init"]
    assert rpc.get_rpc_timeout() == pytest.approx(33)
    assert [rpc.rpc_sync(n, f.whoami) for n in w.others()] == w.others()
    assert rpc.remote(w.peer(), f.add, args=(1, 2)).to_here() == 3
    return {"in_rpc_BackendType": getattr(rpc.BackendType, "MINE", None) is mine}


def test_user_registered_backend_runs_end_to_end(backend: str) -> None:
    observe(_registered_backend, backend, init=False)


@better_than_torch  # torch rebinds backend_registry.BackendType only: rpc.BackendType is stale
def test_user_registered_backend_is_a_member_of_rpc_backend_type(backend: str) -> None:
    assert all(o["in_rpc_BackendType"] for o in observe(_registered_backend, backend, init=False))


# -- calls -------------------------------------------------------------------------------------


def _calls(w: Worker) -> None:
    p = w.peer()
    ones = torch.ones(2, 2)
    for mode in MODES:
        assert call(mode, p, f.add, (1, 2)) == 3
        assert call(mode, p, f.add_kwargs, (1,), {"b": 2, "c": 3}) == 6
        assert call(mode, p, f.add, kwargs={"a": "x", "b": "y"}) == "xy"
        assert call(mode, p, f.identity, (None,)) is None
        assert torch.equal(call(mode, p, torch.add, (ones, ones)), ones * 2)
        assert torch.equal(call(mode, p, torch.add, (ones, 3)), ones + 3)
        assert call(mode, p, operator.add, (2, 3)) == 5
        assert call(mode, p, len, ([1, 2, 3],)) == 3
        assert call(mode, p, min, (3, 1, 2)) == 1
        assert call(mode, p, f.Calc.mul, (3, 4)) == 12  # staticmethod
        assert call(mode, p, f.Calc.make, (5,)) == f.Calc(5)  # classmethod
        assert call(mode, p, f.Calc, (7,)) == f.Calc(7)  # a constructor
        assert call(mode, p, f.calc_plus, (f.Calc(2), 3)) == 5  # an object as an argument
        # to itself, by name, WorkerInfo and rank
        assert call(mode, w.me, f.whoami) == w.me
        assert call(mode, rpc.get_worker_info(), f.add, (1, 1)) == 2
        assert call(mode, w.rank, f.my_id) == w.rank
        assert call(mode, rpc.get_worker_info(p), f.whoami) == p


def test_rpc_sync_async_remote_with_args_kwargs_builtins_methods_and_self(backend: str) -> None:
    run(_calls, backend)


def _operators_on_numbers(w: Worker) -> None:
    p = w.peer()
    # torch's RPC runs an operator given plain values on the first schema they fit without
    # becoming tensors: Python numbers come back (called locally, these return tensors)
    cases: list[tuple[Any, tuple[Any, ...], Any]] = [
        (torch.add, (1, 1), 2),
        (torch.add, (1.5, 1), 2.5 + 0j),  # (aten::add.complex comes before add.float)
        (torch.mul, (2, 3), 6),
        (torch.div, (3, 2), 1.5),
        (torch.eq, (1, 1), True),
        (torch.sqrt, (4,), 2.0),
        (torch.pow, (2, 3), 8.0),
        (torch.neg, (3,), -3),
        (torch.add, (True, 1), 2),
    ]
    for mode in MODES:
        for fn, args, expected in cases:
            got = call(mode, p, fn, args)
            assert type(got) is type(expected) and got == expected, (mode, fn, args, got)
        assert torch.equal(call(mode, p, torch.zeros, ((2,),)), torch.zeros(2))  # a tensor made
    w.barrier()


def test_torch_operators_on_plain_numbers_return_what_torchs_rpc_returns(backend: str) -> None:
    run(_operators_on_numbers, backend, world_size=2)


def _script_functions(w: Worker) -> None:
    p = w.peer()
    for mode in MODES:
        assert torch.equal(call(mode, p, f.script_add, (torch.ones(2), 3)), torch.full((2,), 4.0))
        assert torch.equal(call(mode, p, f.script_add, kwargs={"x": torch.ones(1), "y": 2}), torch.full((1,), 3.0))
        # an error inside TorchScript arrives as a RuntimeError, as torch's RPC raises it
        with pytest.raises(RuntimeError, match="TorchScript interpreter"):
            call(mode, p, f.script_fails, (torch.ones(1),))
    w.barrier()


def test_torchscript_functions_run_by_name(backend: str) -> None:
    run(_script_functions, backend, world_size=2)


def _script_modules(w: Worker) -> None:
    p = w.peer()
    x = torch.ones(1, 3)
    for mode in MODES:
        for make in (f.scripted_affine, f.traced_affine):  # (a result, as torch's RPC sends one)
            m = call(mode, p, make)
            assert isinstance(m, torch.jit.ScriptModule), (mode, make, type(m))
            # (an argument, and the result of its run there: torch's RPC sends a module only as
            # the whole result)
            assert torch.equal(call(mode, p, f.call_module, (m, x)), m(x)), (mode, make)
    w.barrier()


@better_than_torch
def test_torchscript_modules_cross_as_results_and_arguments(backend: str) -> None:
    run(_script_modules, backend, world_size=2)


def _other_devices(w: Worker) -> None:
    if w.rank == 0:
        p = w.peer()
        meta = torch.empty(2, device="meta")
        request = f"Request device mapping is not available for destination {p}, but found tensor on device: meta"
        for attempt in (
            lambda: rpc.rpc_sync(p, torch.add, args=(meta, 1)),
            lambda: rpc.rpc_async(p, torch.add, args=(meta, 1)),  # (raised by the call, as torch's)
            lambda: rpc.remote(p, torch.add, args=(meta, 1)),
            lambda: rpc.rpc_sync(p, f.identity, args=([torch.ones(1), {"t": meta}],)),
        ):
            with pytest.raises(RuntimeError, match=re.escape(request)):
                attempt()
        reply = f"Response device mapping is not available for destination {w.me}, but found tensor on device: meta"
        for mode in MODES:
            with pytest.raises(RuntimeError, match=re.escape(reply)):
                call(mode, p, f.meta_tensor)
        assert rpc.rpc_sync(p, f.add, args=(1, 2)) == 3  # (nothing else broke)
    w.barrier()


def test_a_tensor_on_another_device_needs_a_device_map_as_in_torch(backend: str) -> None:
    run(_other_devices, backend, world_size=2)


def _async_script_functions(w: Worker) -> None:
    p = w.peer()
    for mode in MODES:  # async_execution over TorchScript: the reply waits for its future
        assert torch.equal(call(mode, p, f.script_add_later, (torch.ones(2), 5)), torch.full((2,), 6.0))
    w.barrier()


def test_async_execution_over_torchscript(backend: str) -> None:
    # (workers from the forkserver: torch.jit._fork uses torch's thread pool, which a fork of this process may leave broken)
    run(_async_script_functions, backend, world_size=2, start_method="forkserver", timeout=60)


def _tensors(w: Worker) -> None:
    p = w.peer()
    big = torch.randn(4 << 20)  # 16 MiB
    assert torch.equal(rpc.rpc_sync(p, f.identity, args=(big,)), big)
    assert torch.equal(rpc.rpc_async(p, torch.add, args=(big, 1)).wait(), big + 1)
    assert torch.equal(rpc.remote(p, f.identity, args=(big,)).to_here(), big)

    base = torch.arange(25.0).reshape(5, 5)
    view = base.narrow(1, 2, 2)
    assert not view.is_contiguous()
    seen = rpc.rpc_sync(p, f.describe_tensor, args=(view,))
    assert seen["shape"] == (5, 2)
    assert seen["first"] == view.flatten()[:4].tolist()
    assert seen["sum"] == float(view.sum())
    back = rpc.rpc_sync(p, f.identity, args=(view,))
    assert torch.equal(back, view) and back.shape == (5, 2)
    assert torch.equal(rpc.rpc_sync(p, f.identity, args=(base.t(),)), base.t())
    assert torch.equal(rpc.rpc_sync(p, f.make_view, args=(4,)), f.make_view(4))  # a view returned
    # a tensor and a view of it in one message share one storage on arrival, as torch's
    pair = torch.zeros(3)
    whole, tail = rpc.rpc_sync(p, f.identity, args=((pair, pair[1:]),))
    tail.add_(1.0)
    assert whole.tolist() == [0.0, 1.0, 1.0]

    grad = torch.ones(3, requires_grad=True)
    assert rpc.rpc_sync(p, f.describe_tensor, args=(grad,))["requires_grad"] is True
    assert rpc.rpc_sync(p, f.identity, args=(grad,)).requires_grad is True
    assert rpc.rpc_sync(p, f.describe_tensor, args=(torch.ones(3),))["requires_grad"] is False

    for t in (torch.arange(6, dtype=torch.int64), torch.tensor([True, False]),
              torch.arange(4, dtype=torch.bfloat16), torch.arange(4, dtype=torch.float16),
              torch.arange(4, dtype=torch.uint8), torch.tensor([1 + 2j], dtype=torch.complex64),
              torch.tensor(3.5), torch.empty(0, 3)):
        back = rpc.rpc_sync(p, f.identity, args=(t,))
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)

    nested = {"a": [torch.ones(2), (torch.zeros(3), 5)], "b": torch.full((2,), 7.0), "c": "text"}
    back = rpc.rpc_sync(p, f.identity, args=(nested,))
    assert torch.equal(back["a"][0], torch.ones(2)) and torch.equal(back["a"][1][0], torch.zeros(3))
    assert back["a"][1][1] == 5 and torch.equal(back["b"], nested["b"]) and back["c"] == "text"


def test_tensors_large_non_contiguous_requires_grad_dtypes_and_containers(backend: str) -> None:
    run(_tensors, backend)


def _values_at_the_call(w: Worker) -> list[tuple[float, float]]:
    if w.rank != 0:
        return []
    seen = []
    n = 4 << 20  # 16 MiB: a cross-memory copy between processes of one host
    for i in range(10):
        # the caller overwrites its argument as soon as the call returns
        t = torch.full((n,), float(i))
        fut = rpc.rpc_async(w.peer(), f.value_range, args=(t,))
        t.fill_(-1.0)
        rref = rpc.remote(w.peer(), f.value_range, args=(t.fill_(float(i)),))
        t.fill_(-1.0)
        seen += [fut.wait(), rref.to_here()]
        # the callee overwrites its result as soon as its reply returns
        got = rpc.rpc_sync(w.peer(), f.reply_then_overwrite, args=(n, float(i)))
        seen.append(f.value_range(got))
    return seen


@better_than_torch
def test_a_tensor_changed_right_after_the_call_returns_arrives_with_its_values_at_the_call(backend: str) -> None:
    seen = run(_values_at_the_call, backend, world_size=2, timeout=50)[0]
    assert seen == [(float(i), float(i)) for i in range(10) for _ in range(3)]


def _nested(w: Worker) -> None:
    p, q = w.peer(1), w.peer(2)
    assert rpc.rpc_sync(p, f.nested_call, args=(q, f.whoami)) == q  # to a third worker
    assert rpc.rpc_sync(p, f.nested_call, args=(w.me, f.whoami)) == w.me  # back to the caller
    assert rpc.rpc_sync(w.me, f.nested_call, args=(w.me, f.add, (1, 2))) == 3  # self, twice
    assert rpc.rpc_async(p, f.nested_call, args=(q, f.add, (2, 3))).wait() == 5
    assert rpc.remote(p, f.nested_call, args=(w.me, f.add, (3, 4))).to_here() == 7
    # worker -> p -> q -> r -> back to the caller, adding 1 at every hop
    assert rpc.rpc_sync(p, f.chain_call, args=([q, w.peer(3), w.me], 0)) == 3


def test_nested_rpc_to_third_workers_and_back_to_the_caller(backend: str) -> None:
    run(_nested, backend)


def _futures(w: Worker) -> None:
    p = w.peer()
    fut = rpc.rpc_async(p, f.add, args=(1, 2))
    chained = fut.then(lambda x: x.wait() * 10).then(lambda x: x.value() + 1)
    assert chained.wait() == 31
    assert fut.wait() == 3 and fut.wait() == 3  # wait twice
    assert fut.done() and fut.value() == 3
    seen: list[Any] = []
    fut.add_done_callback(lambda x: seen.append(x.value()))  # done already: runs at once
    assert seen == [3]

    futs = [rpc.rpc_async(n, f.add, args=(i, 1)) for i, n in enumerate(w.others())]
    assert torch.futures.wait_all(futs) == [i + 1 for i in range(len(futs))]
    assert [x.wait() for x in torch.futures.collect_all(futs).wait()] == [i + 1 for i in range(len(futs))]

    failed = rpc.rpc_async(p, f.raise_error, args=("ValueError", "future boom"))
    slow = rpc.rpc_async(p, f.sleep_then, args=(0.2, "slow"))
    with pytest.raises(ValueError, match="future boom"):
        torch.futures.wait_all([slow, failed])
    with pytest.raises(ValueError, match="future boom"):
        failed.value()
    assert slow.wait() == "slow"

    def handle(x: Any) -> str:
        try:
            x.wait()
        except ValueError as exc:
            return f"caught: {exc}"
        return "no error"

    assert "future boom" in failed.then(handle).wait()
    with pytest.raises(Exception, match="future boom"):
        failed.then(lambda x: x.wait()).wait()  # a callback's error fails its future

    # rpc.api._wait_all (torch's docstring example): every rpc_async of the block is waited on
    # leaving it; the first failure is raised then; the list lives only inside the block
    with rpc.api._wait_all():
        assert rpc.api._thread_local_var.future_list == []
        slow = rpc.rpc_async(p, f.sleep_then, args=(0.3, "slow"))
        assert rpc.rpc_sync(p, f.add, args=(1, 2)) == 3  # (not collected)
        assert len(rpc.api._thread_local_var.future_list) == 1
    assert slow.done() and slow.wait() == "slow"
    assert not hasattr(rpc.api._thread_local_var, "future_list")
    with pytest.raises(ValueError, match="wait_all boom"), rpc.api._wait_all():
        slow = rpc.rpc_async(p, f.sleep_then, args=(0.2, "slow"))
        rpc.rpc_async(p, f.raise_error, args=("ValueError", "wait_all boom"))
    assert not hasattr(rpc.api._thread_local_var, "future_list")
    assert slow.wait() == "slow"
    # what the callback raised is a RuntimeError with torch's message, as with torch's futures,
    # and still of its own type
    for catch in (RuntimeError, KeyError):
        with pytest.raises(catch, match=r"^Got the following error when running the callback: KeyError: 'k'$"):
            fut.then(lambda x: {}["k"]).wait()


def test_futures_then_wait_value_wait_all_and_errors(backend: str) -> None:
    run(_futures, backend)


def _profiled(w: Worker) -> list[str]:
    names: list[str] = []
    if w.rank == 0:
        p = w.peer()
        # torch's rule: RPCs are profiled under the legacy autograd profiler only
        with torch.autograd.profiler_legacy.profile() as prof:
            assert rpc.rpc_sync(p, f.add, args=(1, 2)) == 3
            assert torch.equal(rpc.rpc_async(p, torch.add, args=(torch.ones(2), 1)).wait(), torch.full((2,), 2.0))
            rref = rpc.remote(p, f.add, args=(2, 3))
            assert rref.to_here() == 5
            made = rpc.remote(p, torch.add, args=(torch.ones(2), 1))
            assert torch.equal(made.to_here(), torch.full((2,), 2.0))
            made._get_profiling_future().wait()
            # a remote() is recorded until its creation is confirmed, which may come after the
            # value (torch's rule as well): wait for its record inside the profiled range, as
            # torch's tests do
            assert rref._get_profiling_future().wait() is None
        names = [e.name for e in prof.function_events]
        assert f"rpc_sync#add({w.me} -> {p})" in names
        assert f"rpc_async#aten::add({w.me} -> {p})" in names
        assert f"rpc_remote#add({w.me} -> {p})" in names
        assert f"to_here#({w.me})->({p})" in names
        # the callee's own events come back, as torch shows them
        for key in (f"rpc_async#aten::add({w.me} -> {p})", f"rpc_remote#aten::add({w.me} -> {p})"):
            remote = [e for e in prof.function_events if e.name == f"{key}#remote_op: aten::add"]
            assert remote and all(e.is_remote and e.node_id == 1 for e in remote), (key, remote)
        assert all(e.node_id == 0 for e in prof.function_events if not e.is_remote)
        # here, only the user's own ops and the calls' ranges: not what serialization runs
        local = {e.name for e in prof.function_events if not e.is_remote and not e.name.startswith(("rpc_", "to_here#"))}
        assert local == {"aten::ones", "aten::empty", "aten::fill_", "aten::full", "aten::equal", "aten::is_same_size"}, local
        with torch.autograd.profiler.profile() as kineto:  # the default profiler: not recorded
            rpc.rpc_sync(p, f.add, args=(1, 2))
            with pytest.raises(RuntimeError, match="Profiling future has not been set"):
                rpc.remote(p, f.add, args=(1, 2))._get_profiling_future()
        assert not [e.name for e in kineto.function_events if e.name.startswith("rpc_")]
    w.barrier()
    return names


def test_calls_under_the_legacy_profiler_are_recorded_as_torch_names_them(backend: str) -> None:
    run(_profiled, backend, world_size=2)


def _server_profiled(w: Worker) -> None:
    if w.rank == 0:  # torch's documented use: profiles of the callee's requests, through RRefs
        p = w.peer()
        x = torch.ones(2)
        outer = rpc.remote(p, rpc._server_process_global_profile)
        outer.rpc_sync().__enter__()
        rpc.rpc_sync(p, torch.add, args=(x, x))
        inner = rpc.remote(p, rpc._server_process_global_profile)
        inner.rpc_sync().__enter__()
        rpc.rpc_sync(p, torch.sub, args=(x, x))
        inner.rpc_sync().__exit__(None, None, None)
        outer.rpc_sync().__exit__(None, None, None)
        inner_keys = {e.key.removeprefix("aten::") for e in inner.rpc_sync().key_averages()}
        outer_keys = {e.key.removeprefix("aten::") for e in outer.rpc_sync().key_averages()}
        assert "sub" in inner_keys and "add" not in inner_keys, inner_keys
        assert {"add", "sub"} <= outer_keys, outer_keys
    w.barrier()


def test_server_process_global_profile_records_the_requests_a_worker_serves(backend: str) -> None:
    run(_server_profiled, backend, world_size=2)


def _concurrent(w: Worker) -> None:
    threads, calls = 4, 30
    everyone = [name(r) for r in range(w.world_size)]
    errors: list[BaseException] = []

    def body(t: int) -> None:
        try:
            pending = []
            for i in range(calls):
                to = everyone[(i + t) % len(everyone)]
                if i % 2:
                    assert rpc.rpc_sync(to, f.add, args=(i, t)) == i + t
                else:
                    pending.append((rpc.rpc_async(to, f.add, args=(i, t)), i + t))
                pending.append((rpc.rpc_async(to, f.count, args=("hits",)), None))
            for fut, expected in pending:
                value = fut.wait()
                assert expected is None or value == expected
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in ts)
    w.barrier()
    if w.rank == 0:
        hits = sum(rpc.rpc_sync(n, f.get_count, args=("hits",)) for n in everyone)
        assert hits == w.world_size * threads * calls


def test_many_concurrent_calls_from_several_threads(backend: str) -> None:
    run(_concurrent, backend)


def _blocked_by_the_next_call(w: Worker) -> None:
    p = w.peer()
    key = f"released-by-{w.rank}"
    for _ in range(3):
        # the first call blocks on the callee until the caller's next call releases it: the
        # callee reads that call while the first one runs (its connection is never left unread)
        blocked = rpc.rpc_async(p, f.wait_event, args=(key, 20.0))
        t0 = time.monotonic()
        rpc.rpc_sync(p, f.set_event, args=(key,))
        assert blocked.wait() is True
        assert time.monotonic() - t0 < 10  # released by the next call (not at its wait's 20 s)
        rpc.rpc_sync(p, f.clear_event, args=(key,))
    w.barrier()


def test_a_call_blocked_until_the_same_callers_next_call_completes(backend: str) -> None:
    run(_blocked_by_the_next_call, backend)


def _unavailable_functions(w: Worker) -> None:
    p = w.peer()

    def local_function() -> int:
        return 1

    for func in (lambda: 1, local_function):  # not picklable: the caller fails at call time
        for api in (rpc.rpc_sync, rpc.rpc_async, rpc.remote):
            with pytest.raises((AttributeError, pickle.PicklingError, TypeError, RuntimeError),
                               match=r"(?i)pickle"):
                api(p, func)

    # a module only this worker has: the callee cannot import it
    modname = f"caller_only_module_{w.rank}"
    module = types.ModuleType(modname)
    exec("def only_here():\n    return 42\n", module.__dict__)
    sys.modules[modname] = module
    assert rpc.rpc_sync(w.me, module.only_here) == 42  # fine on the caller itself
    with pytest.raises(Exception, match=modname):
        rpc.rpc_sync(p, module.only_here)
    with pytest.raises(Exception, match=modname):
        rpc.rpc_async(p, module.only_here).wait()
    assert rpc.rpc_sync(p, f.add, args=(1, 2)) == 3  # the callee is still up
    w.barrier()  # keep the module until every callee has failed to import it


def test_function_the_callee_cannot_have_fails_clearly_and_callee_stays_up(backend: str) -> None:
    run(_unavailable_functions, backend)


# torch's hint, as tdist writes it (torch's text has line breaks and indentation in it)
PICKLER_HINT_RE = (r"Default RPC pickler does not serialize\s+function code\.\s+Ensure that UDFs are "
                   r"defined on both\s+caller and\s+callee modules\.")


def _uncrossable(w: Worker) -> dict[str, Any]:
    p = w.peer()
    out: dict[str, Any] = {}
    # a result the callee cannot send back (torch's remote().to_here() of one hangs: not tried)
    for mode in ("sync", "async") if TORCH else MODES:
        out[f"result/{mode}"] = _attempt(call, mode, p, f.unpicklable_result)
        out[f"lock/{mode}"] = _attempt(call, mode, p, f.lock_result)
    # a function the caller's module has and the callee's lacks (as one defined in the caller's
    # __main__ only): the callee cannot unpickle the request
    fname = f"only_on_caller_{w.rank}"

    def only_here() -> int:
        return 42

    only_here.__module__, only_here.__name__, only_here.__qualname__ = f.__name__, fname, fname
    setattr(f, fname, only_here)
    assert rpc.rpc_sync(w.me, only_here) == 42
    # a module only the caller has
    modname = f"caller_only_module_{w.rank}"
    module = types.ModuleType(modname)
    exec("def only_here():\n    return 42\n", module.__dict__)
    sys.modules[modname] = module
    for mode in ("sync", "async") if TORCH else MODES:  # (torch's to_here() hangs there too)
        out[f"missing/{mode}"] = _attempt(call, mode, p, only_here)
        out[f"module/{mode}"] = _attempt(call, mode, p, module.only_here)
    out["serving"] = rpc.rpc_sync(p, f.add, args=(1, 2))
    w.barrier()  # every callee has failed before the modules go
    return out


def test_a_result_or_function_that_cannot_cross_fails_as_a_runtime_error(backend: str) -> None:
    for obs in observe(_uncrossable, backend, world_size=2):
        for mode in ("sync", "async"):  # (torch's remote().to_here() keeps the type)
            got = obs[f"result/{mode}"]
            assert got is not None and "RuntimeError" in got["mro"], (mode, got)
            assert "Can't pickle local object" in got["text"], (mode, got)
        for mode in ("sync", "async") if TORCH else MODES:  # (the pickler's TypeError: a RuntimeError)
            got = obs[f"lock/{mode}"]
            assert got is not None and "RuntimeError" in got["mro"], (mode, got)
            assert "TypeError: cannot pickle '_thread.lock' object" in got["text"], (mode, got)
            got = obs[f"missing/{mode}"]
            assert got is not None and "RuntimeError" in got["mro"], (mode, got)
            assert re.search(PICKLER_HINT_RE, got["text"]), (mode, got)
        assert obs["serving"] == 3


@better_than_torch  # torch: a RuntimeError only; no hint for a missing module
def test_a_result_or_function_that_cannot_cross_keeps_its_type(backend: str) -> None:
    for obs in observe(_uncrossable, backend, world_size=2):
        for mode in MODES:
            for what, kind in (("result", "AttributeError"), ("missing", "AttributeError"),
                               ("module", "ModuleNotFoundError")):
                got = obs[f"{what}/{mode}"]
                assert got is not None and got["type"] == kind and "RuntimeError" in got["mro"], (what, mode, got)
                if what != "result":
                    assert re.search(PICKLER_HINT_RE, got["text"]), (what, mode, got)


def _unimportable_remote(w: Worker) -> None:
    modname = f"caller_only_module_{w.rank}"
    module = types.ModuleType(modname)
    exec("def only_here():\n    return 42\n", module.__dict__)
    sys.modules[modname] = module
    rref = rpc.remote(w.peer(), module.only_here)
    with pytest.raises(Exception, match=modname):
        rref.to_here(timeout=5)
    # an argument whose rebuilding raises on the callee: that error is the value
    bad = rpc.remote(w.peer(), f.add, args=(f.RebuildFails(f"not here {w.rank}"), 1))
    with pytest.raises(ValueError, match=f"not here {w.rank}"):
        bad.to_here(timeout=5)
    assert rpc.remote(w.peer(), f.add, args=(1, 2)).to_here() == 3
    w.barrier()


@better_than_torch  # torch: the owner never learns the creation failed; to_here times out
def test_remote_of_a_function_the_callee_cannot_import_fails_on_to_here(backend: str) -> None:
    run(_unimportable_remote, backend, timeout=20)


# -- errors ------------------------------------------------------------------------------------

BUILTIN_KINDS = ("ValueError", "TypeError", "RuntimeError")
OTHER_KINDS = ("KeyError", "ZeroDivisionError", "CustomError", "ThreeArgError", "FormattedError",
               "AssertionError", "FileNotFoundError")


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "str": str(exc),
        # what str() cannot hold (KeyError's text is the key's repr) may come as PEP 678 notes
        "text": "\n".join([str(exc), *getattr(exc, "__notes__", [])]),
        "attrs": {k: getattr(exc, k, None) for k in ("code", "where", "detail", "errno", "filename")},
    }


def _attempt(fn: Any, *args: Any) -> dict[str, Any] | None:
    """``fn(*args)``: the description of what it raised, or None."""
    try:
        fn(*args)
    except Exception as exc:
        return _describe(exc)
    return None


def _errors(w: Worker) -> dict[str, Any]:
    p, q = w.peer(1), w.peer(2)
    out: dict[str, Any] = {"peer": p, "third": q, "peer_id": rpc.get_worker_info(p).id}
    for kind in BUILTIN_KINDS + OTHER_KINDS:
        for mode in MODES:
            message = f"boom-{kind}-{mode}-from-{w.me}"
            out[f"{kind}/{mode}"] = _attempt(call, mode, p, f.raise_error, (kind, message))
    for mode in MODES:
        out[f"async_raise/{mode}"] = _attempt(
            call, mode, p, f.async_raise, ("ValueError", f"async-raise-{mode}"))
        out[f"async_callback/{mode}"] = _attempt(
            call, mode, p, f.async_callback_error, (q, f"async-callback-{mode}"))
        out[f"async_nested/{mode}"] = _attempt(
            call, mode, p, f.async_remote_error, (q, f"async-nested-{mode}"))
        out[f"async_future/{mode}"] = _attempt(
            call, mode, p, f.async_future_error, (f"async-future-{mode}",))
    out["serving"] = [rpc.rpc_sync(n, f.add, args=(1, 2)) for n in w.others()]
    w.barrier()  # everyone has observed before anyone shuts down
    return out


def test_remote_value_type_and_runtime_errors_keep_type_and_message(backend: str) -> None:
    for obs in observe(_errors, backend):
        for kind in BUILTIN_KINDS:
            for mode in MODES:
                got = obs[f"{kind}/{mode}"]
                assert got is not None, f"{kind}/{mode}: no error raised"
                assert got["type"] == kind, (kind, mode, got)
                assert f"boom-{kind}-{mode}-from-" in got["str"]


def test_remote_error_text_names_the_worker_and_has_the_remote_traceback(backend: str) -> None:
    for obs in observe(_errors, backend):
        for kind in BUILTIN_KINDS:
            for mode in MODES:
                text = obs[f"{kind}/{mode}"]["str"]
                assert obs["peer"] in text, (kind, mode, text)
                assert "Traceback" in text and "raise_error" in text, (kind, mode, text)


@better_than_torch  # torch rebuilds only cls(message), and not KeyError or a user type
def test_remote_errors_of_any_type_keep_their_type(backend: str) -> None:
    for rank, obs in enumerate(observe(_errors, backend)):
        for kind in OTHER_KINDS:
            for mode in MODES:
                got = obs[f"{kind}/{mode}"]
                assert got is not None and got["type"] == kind, (kind, mode, got)
                assert obs["peer"] in got["text"], (kind, mode, got)
                if kind == "ThreeArgError":  # rebuilt with its own arguments
                    attrs = got["attrs"]
                    assert (attrs["code"], attrs["where"]) == (7, "callee"), got
                    assert str(attrs["detail"]).startswith(f"boom-{kind}-{mode}"), got
                elif kind == "FormattedError":  # rebuilt without its constructor, fields and all
                    attrs = got["attrs"]
                    assert attrs["code"] == 42 and str(attrs["detail"]).startswith(f"boom-{kind}-{mode}"), got
                    assert got["str"].startswith(f"E42: boom-{kind}-{mode}"), got
                    assert "Traceback" in got["text"] and "raise_error" in got["text"], got
                elif kind == "FileNotFoundError":  # with its fields
                    attrs = got["attrs"]
                    assert attrs["errno"] == 2 and attrs["filename"] == f"/nonexistent/boom-{kind}-{mode}-from-{name(rank)}"
                if kind != "ZeroDivisionError":
                    assert f"boom-{kind}-{mode}" in got["str"]


def test_other_remote_errors_are_runtime_errors_naming_the_worker_as_torch_does(backend: str) -> None:
    # torch re-raises a remote error other than a ValueError or a TypeError as a RuntimeError
    # whose text says "On WorkerInfo(id=1, name=worker1)" (``except RuntimeError`` catches it);
    # remote().to_here() of torch keeps the type, so only sync and async here
    for obs in observe(_errors, backend):
        where = f"On WorkerInfo(id={obs['peer_id']}, name={obs['peer']})"
        for kind in OTHER_KINDS:
            for mode in ("sync", "async"):
                got = obs[f"{kind}/{mode}"]
                assert got is not None and "RuntimeError" in got["mro"], (kind, mode, got)
                assert where in got["text"], (kind, mode, got)


@better_than_torch  # torch: a RuntimeError, or the type alone from remote().to_here()
def test_other_remote_errors_are_their_type_and_runtime_errors_in_every_mode(backend: str) -> None:
    for obs in observe(_errors, backend):
        for kind in OTHER_KINDS:
            for mode in MODES:
                got = obs[f"{kind}/{mode}"]
                assert got is not None and got["type"] == kind, (kind, mode, got)
                assert got["mro"][1] == kind and "RuntimeError" in got["mro"], (kind, mode, got)
                assert f"On WorkerInfo(id={obs['peer_id']}, name={obs['peer']})" in got["text"]
        for kind in BUILTIN_KINDS:  # as torch: ValueError and TypeError are not RuntimeErrors
            for mode in MODES:
                got = obs[f"{kind}/{mode}"]
                assert ("RuntimeError" in got["mro"]) == (kind == "RuntimeError"), (kind, mode, got)


def test_errors_in_async_execution_functions_and_their_callbacks(backend: str) -> None:
    for obs in observe(_errors, backend):
        for mode in MODES:
            got = obs[f"async_raise/{mode}"]
            assert got is not None and got["type"] == "ValueError", got
            assert f"async-raise-{mode}" in got["str"] and obs["peer"] in got["str"]
            got = obs[f"async_callback/{mode}"]
            assert got is not None and f"async-callback-{mode}" in got["str"], got
            assert {"ValueError", "RuntimeError"} & set(got["mro"]), got
            got = obs[f"async_nested/{mode}"]  # failed on a third worker, which it names
            assert got is not None and f"async-nested-{mode}" in got["str"], got
            assert obs["third"] in got["str"], got
            assert {"ValueError", "RuntimeError"} & set(got["mro"]), got


@better_than_torch  # torch's Future.then turns it into RuntimeError("Got the following error ...")
def test_an_error_raised_in_an_async_execution_callback_keeps_its_type(backend: str) -> None:
    for obs in observe(_errors, backend):
        for mode in MODES:
            got = obs[f"async_callback/{mode}"]
            assert got is not None and got["type"] == "ValueError", got
            assert got["str"].startswith(f"async-callback-{mode}"), got
            assert "Traceback" in got["text"] and "in fail" in got["text"], got  # the callback's frame


@better_than_torch  # torch hands back the exception as the future's *value*
def test_async_execution_future_set_with_an_exception_raises_on_the_caller(backend: str) -> None:
    for obs in observe(_errors, backend):
        for mode in MODES:
            got = obs[f"async_future/{mode}"]
            assert got is not None and got["type"] == "ValueError", got
            assert f"async-future-{mode}" in got["str"]


def test_callee_keeps_serving_after_errors(backend: str) -> None:
    for obs in observe(_errors, backend):
        assert obs["serving"] == [3, 3, 3]


# -- async_execution ---------------------------------------------------------------------------


def _async_execution(w: Worker) -> None:
    p, q, r = w.peer(1), w.peer(2), w.peer(3)
    ones = torch.ones(2)
    for mode in MODES:
        assert call(mode, p, f.async_add, (q, 1, 2)) == 3
        assert torch.equal(call(mode, p, f.async_add, (q, ones, ones)), ones * 2)
        assert call(mode, p, f.async_add, (w.me, 1, 2)) == 3  # the nested call comes back
        assert call(mode, w.me, f.async_add, (w.me, 2, 2)) == 4  # all on itself
        assert call(mode, p, f.async_add_chained, (q, 0, 3)) == 3
        assert call(mode, p, f.async_fanout, (w.others(), 1)) == 2 * (w.world_size - 1)
        assert call(mode, p, f.async_nested, (r, q, 1)) == 2
        assert call(mode, p, f.async_sleep_then, (0.05, "later")) == "later"
        assert call(mode, p, f.AsyncCalc.static_async_add, (q, 1, 2)) == 3
        assert call(mode, p, f.AsyncCalc.class_async_add, (q, 2, 2)) == 4
    calc = rpc.remote(p, f.AsyncCalc, args=(10,))
    assert calc.rpc_sync().async_plus(q, 5) == 15
    assert calc.rpc_async().async_plus(q, 6).wait() == 16
    assert calc.remote().async_plus(q, 7).to_here() == 17
    assert calc.rpc_sync().plus(1) == 11  # a plain method next to async ones
    # a then-callback may block on another RPC (torch runs callbacks on its thread pool)
    assert rpc.rpc_sync(p, f.async_add_chained_blocking, args=(q, 0, 3)) == 3


def test_async_execution_functions_chains_nesting_and_rref_proxies(backend: str) -> None:
    run(_async_execution, backend)


# -- timeouts ----------------------------------------------------------------------------------


def _timeouts(w: Worker) -> list[str]:
    p = w.peer()
    messages: list[str] = []
    slow = (1.0, "slow")  # longer than the timeouts below, shorter than the test
    # what the calls that time out run: they fail at their deadline, long before it answers
    # (the bounds below: 1.8 s, for timeouts of 0.2 and 0.6 s)
    slower = (2.0, "slow")
    assert rpc.get_rpc_timeout() == pytest.approx(0.6)  # the options' rpc_timeout
    # started together: a per-call timeout, the default one, a longer one, none
    short = rpc.rpc_async(p, f.sleep_then, args=slower, timeout=0.2)
    default = rpc.rpc_async(p, f.sleep_then, args=slower)
    longer = rpc.rpc_async(p, f.sleep_then, args=slow, timeout=5)
    unlimited = rpc.rpc_async(p, f.sleep_then, args=slow, timeout=0)  # 0: no timeout
    t0 = time.monotonic()
    for fut in (short, default):
        with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
            fut.wait()
        messages.append(str(info.value))
    assert time.monotonic() - t0 < 1.8  # failed at the deadline, not when the callee answered
    assert longer.wait() == "slow" and unlimited.wait() == "slow"

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        rpc.rpc_sync(p, f.sleep_then, args=slower, timeout=0.2)
    messages.append(str(info.value))
    assert time.monotonic() - t0 < 1.8
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        rpc.rpc_sync(p, f.sleep_then, args=slower)
    messages.append(str(info.value))
    assert time.monotonic() - t0 < 1.8
    assert rpc.rpc_sync(p, f.sleep_then, args=(0.8, "slow"), timeout=0) == "slow"

    # to_here's own timeout; the value is still there afterwards
    rref = rpc.remote(p, f.sleep_then, args=(1.0, 5), timeout=0)
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        rref.to_here(timeout=0.2)
    messages.append(str(info.value))
    assert rref.to_here(timeout=0) == 5
    # remote: a creation that takes longer than its timeout fails the next use of the RRef
    # (last: torch's graceful shutdown hangs when another remote() follows this one)
    rref = rpc.remote(p, f.sleep_then, args=slow, timeout=0.2)
    wait_until(lambda: rref._get_future().done(), 10, "the creation timed out")
    with pytest.raises(RuntimeError, match=TIMEOUT_RE) as info:
        rref.to_here()
    # torch's sentence
    assert str(info.value).startswith("RRef creation via rpc.remote() timed out, and it is possible "
                                      "that the RRef on the owner node does not exist.")
    messages.append(str(info.value))
    w.barrier()
    return messages


def test_per_call_and_default_timeouts_on_every_api(backend: str) -> None:
    observe(_timeouts, backend, world_size=2, rpc_timeout=0.6)


@better_than_torch  # torch: "RPC ran for more than set timeout (200 ms)", no callee
def test_timeout_errors_name_the_callee(backend: str) -> None:
    for rank, messages in enumerate(observe(_timeouts, backend, world_size=2, rpc_timeout=0.6)):
        callee = name((rank + 1) % 2)
        assert all(callee in m for m in messages), messages


# -- shutdown ----------------------------------------------------------------------------------


def _graceful(w: Worker) -> None:
    last = w.world_size - 1
    inside_shutdown, last_in = w.shared["inside_shutdown"], w.shared["last_in"]
    if w.rank == last:
        # slow to reach shutdown: it comes once the others wait inside theirs ...
        wait_until(lambda: inside_shutdown.value == last, 20, "the others wait in shutdown()")
        # ... and still serve while they wait
        assert [rpc.rpc_sync(n, f.whoami) for n in w.others()] == w.others()
    else:
        def count_me() -> None:
            with inside_shutdown.get_lock():
                inside_shutdown.value += 1

        when_inside("shutdown", count_me, "api.py")  # (rpc.shutdown, tdist's or torch's)
    done: list[Any] = []
    fut = rpc.rpc_async(w.peer(), f.sleep_then, args=(0.5, w.rank))
    fut.add_done_callback(lambda x: done.append(x.value()))
    if w.rank == last:
        last_in.set()
    w.shutdown()
    assert done == [w.rank]  # the outstanding call completed before shutdown returned
    if w.rank != last:
        assert last_in.is_set()  # waited for the last worker
    with pytest.raises(RuntimeError, match=r"(?i)not (been )?initialized"):
        rpc.rpc_sync(w.peer(), f.add, args=(1, 2))


def test_graceful_shutdown_waits_for_slow_workers_and_outstanding_calls(backend: str) -> None:
    ctx = multiprocessing.get_context("fork")
    run(_graceful, backend, shared={"inside_shutdown": ctx.Value("i", 0), "last_in": ctx.Event()})


def _ungraceful(w: Worker) -> None:
    assert rpc.rpc_sync(w.peer(), f.add, args=(1, 2)) == 3
    w.barrier()
    if w.rank == 0:  # leaves alone: nobody else is in shutdown
        t0 = time.monotonic()
        w.shutdown(graceful=False)
        assert time.monotonic() - t0 < 5
    w.barrier()
    if w.rank != 0:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            rpc.rpc_sync("worker0", f.add, args=(1, 2), timeout=5)
        assert time.monotonic() - t0 < 4  # it is gone: no waiting for the timeout (5 s)
        assert rpc.rpc_sync(name(1 + w.rank % 3), f.add, args=(1, 2)) == 3  # the others still talk
        w.barrier()
        w.shutdown(graceful=False)
    else:
        w.barrier()
    with pytest.raises(RuntimeError, match=r"(?i)not (been )?initialized"):
        rpc.rpc_sync(w.peer(), f.add, args=(1, 2))


def test_ungraceful_shutdown_is_local(backend: str) -> None:
    run(_ungraceful, backend)


def _reinit(w: Worker) -> None:
    assert rpc.rpc_sync(w.peer(), f.whoami) == w.peer()
    w.shutdown()
    w.init(port=w.shared["second_port"])
    assert rpc.rpc_sync(w.peer(), f.whoami) == w.peer()
    assert rpc.rpc_sync(w.peer(), f.nested_call, args=(w.peer(2), f.whoami)) == w.peer(2)
    assert rpc.rpc_async(w.peer(), f.add, args=(1, 2)).wait() == 3


def test_init_shutdown_init_again_in_the_same_process(backend: str) -> None:
    from tdist.testing import free_port

    run(_reinit, backend, shared={"second_port": free_port()})
