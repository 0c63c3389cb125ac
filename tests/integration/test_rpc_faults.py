"""RPC with failing workers, on real processes: a callee killed with SIGKILL or stopped with
SIGSTOP while calls to it are pending, and dynamic membership (``world_size=None``: workers
join a running group and leave it). See ``_rpc_harness``.

The victim (``worker1``) runs in a child of rank 1's process, so that killing it does not fail
the run; the survivors end with ``shutdown(graceful=False)``, as a job that lost a worker does.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import pytest

from tdist.testing import free_port

from . import rpc_funcs as f
from ._rpc_harness import (
    BACKENDS,
    Worker,
    backend_type,
    better_than_torch,
    forked_worker,
    in_thread,
    make_options,
    name,
    observe,
    rpc,
    run,
    settle,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

VICTIM = 1
# the agents' heartbeats (tdist.transport): a peer silent this long is stalled
STALL_TIMEOUT = 2.0
HEARTBEAT_ENV = {"TDIST_HEARTBEAT_INTERVAL": "0.25", "TDIST_HEARTBEAT_TIMEOUT": str(STALL_TIMEOUT)}


def _describe(exc: Any) -> dict[str, Any] | None:
    if not isinstance(exc, BaseException):
        return None
    return {"type": type(exc).__name__, "runtime": isinstance(exc, RuntimeError),
            "text": "\n".join([str(exc), *getattr(exc, "__notes__", [])])}


def _timed(fn: Any) -> tuple[float, dict[str, Any] | None]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return time.monotonic() - t0, _describe(exc)
    return time.monotonic() - t0, None


def _victim_fails(w: Worker) -> dict[str, Any] | None:
    """Ranks other than the victim's call it, it is killed or stopped, they observe."""
    sig = w.shared["signal"]
    if w.rank == VICTIM:
        def serve() -> None:
            f.arrived = w.shared["arrived"]
            w.init()
            time.sleep(300)  # serves until killed

        with forked_worker(serve) as pid:
            w.shared["victim_pid"].value = pid
            w.barrier()  # everyone is initialized
            w.barrier()  # every caller has had its answers
            w.barrier()  # the calls to the victim are pending; it is hit now
            w.barrier()  # everyone has observed
        return None

    w.init()
    victim = name(VICTIM)
    w.barrier()
    assert rpc.rpc_sync(victim, f.whoami) == victim
    rref = rpc.remote(victim, f.add, args=(1, 2))
    assert rref.to_here() == 3
    # the pending calls below hold the victim's workers (the process-group agent has only
    # num_send_recv_threads=4 of them): a slow rank's answered calls must not queue behind them
    w.barrier()
    pending = rpc.rpc_async(victim, f.arrive_then_sleep, args=(300, "never"), timeout=0)
    pending_rref = rpc.remote(victim, f.arrive_then_sleep, args=(300, "never"), timeout=0)
    # the requests have arrived: every caller's run on the victim (the process-group agent's
    # 4 threads run 4 of them; the others wait in its queue)
    running = 2 * (w.world_size - 1)
    if w.backend != "tensorpipe":
        running = min(running, 4)
    wait_until(lambda: w.shared["arrived"].value >= running, 20, "the pending calls run on the victim")
    w.barrier()
    if w.rank == 0:
        os.kill(w.shared["victim_pid"].value, sig)
    t0 = time.monotonic()
    done, error = settle(pending, 10 if sig == signal.SIGKILL else STALL_TIMEOUT + 6)
    out: dict[str, Any] = {"pending_s": time.monotonic() - t0 if done else None,
                           "pending": _describe(error)}
    if done:  # (else the rest would wait as long)
        out["pending_rref_s"], out["pending_rref"] = _timed(lambda: pending_rref.to_here(timeout=10))
        out["later_s"], out["later"] = _timed(lambda: rpc.rpc_sync(victim, f.add, args=(1, 2), timeout=5))
        out["rref_later_s"], out["rref_later"] = _timed(lambda: rref.to_here(timeout=5))
    out["others"] = [_timed(lambda n=n: rpc.rpc_sync(n, f.whoami, timeout=5))
                     for n in w.others() if n != victim]
    w.barrier()
    in_thread(lambda: w.shutdown(graceful=False), 10)
    return out


def _observe_victim(backend: str, sig: int) -> list[dict[str, Any]]:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    shared = {"signal": sig, "victim_pid": ctx.Value("i", 0), "arrived": ctx.Value("i", 0)}
    env = HEARTBEAT_ENV if sig == signal.SIGSTOP else {}
    outs = observe(_victim_fails, backend, signal.Signals(sig).name, init=False, env=env,
                   shared=shared, timeout=50)
    return [o for o in outs if o is not None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_callee_fails_pending_calls_within_5s_and_later_calls_fast(backend: str) -> None:
    for out in _observe_victim(backend, signal.SIGKILL):
        assert out["pending_s"] is not None and out["pending_s"] < 5, out
        assert out["pending"]["runtime"], out
        # (fast: not at their timeouts, 10 s and 5 s)
        assert out["pending_rref"] is not None and out["pending_rref_s"] < 8, out
        assert out["later"] is not None and out["later_s"] < 4, out
        assert out["rref_later"] is not None and out["rref_later_s"] < 4, out
        _check_survivors(backend, out)


def _check_survivors(backend: str, out: dict[str, Any]) -> None:
    if backend == "tensorpipe":  # the survivors still talk to each other
        assert [error for _, error in out["others"]] == [None, None], out
    else:  # a process group that lost a member is broken: calls fail at once, naming it
        for took, error in out["others"]:
            assert took < 4 and (error is None or name(VICTIM) in error["text"]), out  # (timeout: 5 s)


@better_than_torch  # torch: "eof (this error originated at tensorpipe/...)", no worker named
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_callee_errors_name_it(backend: str) -> None:
    for out in _observe_victim(backend, signal.SIGKILL):
        for what in ("pending", "pending_rref", "later", "rref_later"):
            assert name(VICTIM) in out[what]["text"], (what, out[what])


@better_than_torch  # torch has no heartbeats: a call to a stopped worker waits forever
@pytest.mark.parametrize("backend", BACKENDS)
def test_stopped_callee_fails_pending_calls_by_heartbeat(backend: str) -> None:
    for out in _observe_victim(backend, signal.SIGSTOP):
        assert out["pending_s"] is not None, f"still pending 15 s after SIGSTOP: {out}"
        assert out["pending_s"] < STALL_TIMEOUT + 4, out
        assert out["pending"]["runtime"] and name(VICTIM) in out["pending"]["text"], out
        assert out["later"] is not None and out["later_s"] < STALL_TIMEOUT + 4, out
        _check_survivors(backend, out)


# -- graceful shutdown ------------------------------------------------------------------------


def _late_to_shutdown(w: Worker) -> tuple[float, bool]:
    late_in = w.shared["late_in"]
    if w.rank == 1:
        time.sleep(2.5)  # longer than the RPC timeout: shutdown waits all the same (as torch)
        late_in.set()
    t0 = time.monotonic()
    in_thread(w.shutdown, 20)
    # (rank 0: back only once the late worker had reached shutdown)
    return time.monotonic() - t0, late_in.is_set()


@pytest.mark.parametrize("backend", BACKENDS)
def test_graceful_shutdown_waits_for_a_late_worker_beyond_the_rpc_timeout(backend: str) -> None:
    import multiprocessing

    late_in = multiprocessing.get_context("fork").Event()
    took = run(_late_to_shutdown, backend, world_size=2, rpc_timeout=1.0, shared={"late_in": late_in})
    assert took[0][1], took  # rank 0 waited for the late worker
    assert took[1][0] < 2.0, took  # (the late one finds rank 0 waiting: no wait of its own)


def _said_while_waiting(w: Worker) -> list[str]:
    import logging

    from tdist._core import patience

    warned = w.shared["warned"]
    if w.rank == 1:
        assert warned.wait(20)  # (late until rank 0 has said so)
        w.shutdown()
        return []
    patience.FIRST, patience.EVERY = 0.5, 1.0  # (30 s and a minute)
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "RPC shutdown has waited" in record.getMessage():
                said.append(f"{record.levelname}: {record.getMessage()}")
                warned.set()

    logging.getLogger("tdist.rpc").addHandler(Catch())
    in_thread(w.shutdown, 20)
    return said


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shutdown_that_waits_long_says_for_whom(backend: str) -> None:
    """torch's graceful shutdown waits for a late worker without limit, and without a word;
    tdist's says after 30 s (then every minute) which workers it waits for."""
    import multiprocessing

    said = run(_said_while_waiting, backend, world_size=2, shared={"warned": multiprocessing.get_context("fork").Event()})
    assert said[0] and said[0][0].startswith("WARNING: "), said
    assert re.search(rf"RPC shutdown has waited \d+ s for {name(1)} \(id 1\) to call shutdown \(it waits as long as they live\)$", said[0][0]), said


def _shutdown_timeout_with_a_late_worker(w: Worker) -> str:
    early_done = w.shared["early_done"]
    early = w.shared["early"]
    if w.rank == early:
        rpc.shutdown(graceful=True, timeout=1.0)  # (the other comes only after this returned)
        w.initialized = False
        early_done.set()
        return "early: returned"
    assert early_done.wait(20)
    w.shutdown()
    return "late: returned"


@pytest.mark.parametrize("early", [0, 1], ids=["store_host_early", "store_host_late"])
@better_than_torch
def test_a_shutdown_timeout_bounds_the_wait_for_a_late_worker_and_both_shut_down(early: int) -> None:
    # (the timeout bounds the wait and raises nothing for a worker that is only late; the late
    # one then shuts down alone, without the other's store or its barrier. torch's bounds only
    # its first gathering: its agent's join ignores the timeout and waits for the late worker)
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    outs = run(_shutdown_timeout_with_a_late_worker, "tensorpipe", world_size=2, timeout=40,
               shared={"early_done": ctx.Event(), "early": early})
    assert outs[early] == "early: returned" and outs[1 - early] == "late: returned", outs


def _serve_until_killed(w: Worker) -> None:
    """The victim's rank: its worker, in a child, serves until it is killed; the rank itself
    takes the others' two barriers (initialized; done)."""
    def serve() -> None:
        w.init()
        time.sleep(300)

    with forked_worker(serve) as pid:
        w.shared["victim_pid"].value = pid
        w.barrier()
        w.barrier()


def _lost_before_shutdown(w: Worker) -> dict[str, Any] | None:
    sig = w.shared["signal"]
    if w.rank == VICTIM:
        _serve_until_killed(w)
        return None
    w.init()
    w.barrier()  # everyone is initialized
    if w.rank == 0:
        os.kill(w.shared["victim_pid"].value, sig)
    t0 = time.monotonic()
    try:
        in_thread(w.shutdown, 30)
        error = None
    except Exception as exc:
        error = _describe(exc)
    took = time.monotonic() - t0
    w.initialized = False  # a failed graceful shutdown stops the agent all the same
    w.barrier()
    return {"took": took, "error": error}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_graceful_shutdown_fails_naming_a_worker_lost_before_it(backend: str, sig: int) -> None:
    # (it waits without limit for workers that live, as torch's: never for a dead one)
    import multiprocessing

    shared = {"signal": sig, "victim_pid": multiprocessing.get_context("fork").Value("i", 0)}
    outs = run(_lost_before_shutdown, backend, world_size=3, init=False, env=HEARTBEAT_ENV,
               shared=shared, timeout=50)
    for out in [o for o in outs if o is not None]:
        assert out["error"] is not None and name(VICTIM) in out["error"]["text"], out
        assert out["took"] < STALL_TIMEOUT + 5, out


def _lost_while_another_works(w: Worker) -> dict[str, Any] | None:
    """worker1 dies; worker0 (a parameter server) is in its shutdown; worker2 (the trainer left)
    still calls it, then shuts down."""
    if w.rank == VICTIM:
        _serve_until_killed(w)
        return None
    w.init()
    w.barrier()  # everyone is initialized
    out: dict[str, Any] = {}
    if w.rank == 0:
        os.kill(w.shared["victim_pid"].value, signal.SIGKILL)
    else:
        # (the server has found worker1 lost, in its shutdown: it serves this one all the same)
        wait_until(lambda: rpc.rpc_sync(name(0), f.knows_lost, args=(VICTIM,)), 20, "worker0 finds worker1 lost")
        out["served"] = [rpc.rpc_sync(name(0), f.sleep_then, args=(0.2, i), timeout=10) for i in range(8)]
    try:
        in_thread(w.shutdown, 30)
        out["error"] = None
    except Exception as exc:
        out["error"] = _describe(exc)
    w.initialized = False  # a failed graceful shutdown stops the agent all the same
    w.barrier()
    return out


def test_a_worker_lost_fails_shutdown_only_once_the_live_ones_have_come() -> None:
    # (a parameter server whose shutdown failed as soon as one trainer died left the trainer
    # still training with "worker0 left"; torch's waits for ever. TensorPipe's agent only: the
    # process-group agent's group breaks with a member, and every worker fails)
    backend = "tensorpipe"
    import multiprocessing

    shared = {"victim_pid": multiprocessing.get_context("fork").Value("i", 0)}
    outs = run(_lost_while_another_works, backend, world_size=3, init=False, env=HEARTBEAT_ENV,
               shared=shared, timeout=50)
    server, trainer = outs[0], outs[2]
    assert trainer["served"] == list(range(8)), trainer
    for out in (server, trainer):
        assert out["error"] is not None and out["error"]["type"] == "PeerError", out
        assert f"{name(VICTIM)}" in out["error"]["text"] and "will never reach it" in out["error"]["text"], out


_HOSTED_BY_WORKER0 = """
import os, signal, sys, threading, time
import tdist.rpc as rpc
rank = int(os.environ["RANK"])
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
main = threading.get_ident()

def stop_once_waiting():  # (worker2: stopped once it waits in the shutdown's barrier, its part set)
    while True:
        frame, names = sys._current_frames().get(main), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "_barrier" in names and names[0] in ("wait", "poll", "_read_reply", "recv"):
            os.kill(os.getpid(), signal.SIGSTOP)  # (the test continues it once worker0 has left)
            return
        time.sleep(0.001)

if rank == 2:
    threading.Thread(target=stop_once_waiting, daemon=True).start()
try:
    rpc.shutdown()
    print("shutdown returned", flush=True)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
"""


def test_a_worker_that_finds_the_store_gone_names_the_lost_worker_not_the_stores_host() -> None:
    """worker0 hosts the store (env://, as without a launcher). worker1 dies; worker0's
    shutdown fails naming it, and worker0 leaves, taking the store along. worker2, which has
    not looked at the missing workers yet, then finds the store gone: it names worker1 too,
    not worker0."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TDIST_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3", **HEARTBEAT_ENV)
    procs = [
        subprocess.Popen([sys.executable, "-c", _HOSTED_BY_WORKER0], env={**env, "RANK": str(r)}, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for r in range(3)
    ]
    try:
        out0 = procs[0].communicate(timeout=40)[0]
        assert "PeerError" in out0 and "worker1 (id 1) will never reach it" in out0, out0
        os.kill(procs[2].pid, signal.SIGCONT)
        out2 = procs[2].communicate(timeout=40)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
    assert "PeerError: worker2 (id 2): RPC shutdown: worker1 (id 1) was lost" in out2, out2
    assert "(and worker0 (id 0), which hosted the store, is gone too)" in out2, out2


# -- dynamic membership ------------------------------------------------------------------------


def _dynamic(w: Worker) -> None:
    joined, leaver = w.shared["joined"], w.shared["leaver"]
    if w.rank > 0:  # one after another, into a group that is already running
        assert joined[w.rank - 1].wait(20)
    w.init(world_size=None)
    earlier = [name(r) for r in range(w.rank)]
    assert [rpc.rpc_sync(n, f.whoami) for n in earlier] == earlier  # the newcomer reaches them
    # ... and they reach the newcomer
    assert [rpc.rpc_sync(n, f.nested_call, args=(w.me, f.whoami)) for n in earlier] == [w.me] * w.rank
    joined[w.rank].set()
    w.barrier()
    everyone = [name(r) for r in range(w.world_size)]
    assert [rpc.rpc_sync(n, f.whoami) for n in everyone] == everyone
    w.barrier()

    if w.rank == leaver:
        w.barrier()  # the others are calling each other
        in_thread(w.shutdown, 20)
        w.barrier()  # left
        w.barrier()  # the others are done
        return

    # the others keep calling each other while the leaver leaves
    stay = [n for n in everyone if n != name(leaver)]
    stop = threading.Event()
    calls: list[int] = []
    errors: list[BaseException] = []

    def keep_calling() -> None:
        i = 0
        while not stop.is_set():
            try:
                assert rpc.rpc_sync(stay[i % len(stay)], f.add, args=(i, 1)) == i + 1
                calls.append(i)
            except BaseException as exc:
                errors.append(exc)
                return
            i += 1

    caller = threading.Thread(target=keep_calling, daemon=True)
    caller.start()
    w.barrier()
    w.barrier()  # the leaver's shutdown() returned
    after = len(calls)  # calls go on without it
    deadline = time.monotonic() + 10
    while len(calls) < after + 5 and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    caller.join(10)
    assert not errors, errors
    assert calls, "no call went through while the leaver left"
    assert [rpc.rpc_sync(n, f.whoami) for n in stay] == stay
    with pytest.raises(RuntimeError, match=name(leaver)):
        rpc.rpc_sync(name(leaver), f.whoami, timeout=5)
    w.barrier()
    in_thread(w.shutdown, 20)


def _run_dynamic(backend: str, leaver: int) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    shared = {"joined": [ctx.Event() for _ in range(4)], "leaver": leaver}
    run(_dynamic, backend, init=False, shared=shared, timeout=40)


@pytest.mark.parametrize("backend", ["tensorpipe"])
def test_dynamic_group_workers_join_one_by_one_and_one_leaves(backend: str) -> None:
    _run_dynamic(backend, leaver=3)


@better_than_torch  # torch: rank 0 hosts the group's store; the others cannot leave after it
@pytest.mark.parametrize("backend", ["tensorpipe"])
def test_dynamic_group_rank0_leaves_while_the_others_keep_calling(backend: str) -> None:
    _run_dynamic(backend, leaver=0)


def _dynamic_refused(w: Worker) -> None:
    with pytest.raises((ValueError, RuntimeError), match=r"(?i)world_size|dynamic"):
        rpc.init_rpc(w.me, backend=backend_type(w.backend), rank=w.rank, world_size=None,
                     rpc_backend_options=make_options(w.backend, w.port))


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values == ("process_group",)])
def test_process_group_agent_refuses_dynamic_membership(backend: str) -> None:
    run(_dynamic_refused, backend, world_size=1, init=False, timeout=20)


# -- a worker that dies while the group forms --------------------------------------------------
def _init_rpc_with_worker_2_dying(rank: int, results_port: int, port: int) -> None:
    from datetime import timedelta

    import tdist
    from tdist.rpc import _agent

    results = tdist.TCPStore("127.0.0.1", results_port, timeout=timedelta(seconds=60))
    if rank == 2:  # (past the rendezvous, before it publishes what the others wait for)
        _agent.RpcAgent.gather = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        rpc.init_rpc(name(rank), rank=rank, world_size=3,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
        out = "joined"
    except RuntimeError as exc:
        out = f"{time.monotonic() - start:.0f} s: {exc}"
    results.set(f"result{rank}", out)
    results.wait(["result0", "result1"])  # (rank 0's store serves rank 1 until it is done)
    os._exit(0)


def test_a_worker_that_dies_while_init_rpc_forms_the_group_is_named_at_once() -> None:
    """torch's agent waits for its rendezvous timeout for a worker that died after the
    rendezvous; tdist's workers fail within seconds, naming it (on its host: its process
    found gone)."""
    import multiprocessing
    from datetime import timedelta

    import tdist

    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=40))
    port = free_port()
    procs = [multiprocessing.get_context("fork").Process(target=_init_rpc_with_worker_2_dying, args=(r, master.port, port))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        for r in (0, 1):
            got = master.get(f"result{r}").decode()
            assert " s: " in got and int(got.split(" s: ")[0]) < 30, got
            assert got.endswith("init_rpc: the worker with id 2 never joined, and it is gone: "
                                f"its process, pid {procs[2].pid}, has exited"), got
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        master.close()
