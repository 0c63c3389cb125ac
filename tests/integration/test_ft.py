"""Fault-tolerant training (``tdist.elastic.ft``) on real processes: a rank killed with SIGKILL
in the middle of a step, a rank that joins a running job, with tdist's own API and with torch's
DDP on the tdist backend. Every process trains on the same global batch per step (each rank
its slice), so the averaged gradient is the full batch's whatever the world size: the final
parameters can be checked against one process training alone."""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import tdist as dist
from tdist.elastic import ft
from tdist.elastic._ft import STATE_KEY
from tdist.elastic._quorum import State
from tdist.store import FailoverStore
from tdist.testing import local_store

pytestmark = pytest.mark.timeout(150)

STEPS = 24
BATCH = 12  # divisible by every world size of these tests


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _reference() -> list[torch.Tensor]:
    """One process, the full batch, every step once."""
    model = _model()
    opt = _optimizer(model)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(port: int, role: dict[str, Any]) -> dict[str, Any]:
    """One process of the job: trains until STEPS steps are committed (a lost step is tried
    again: its batch is the step's)."""
    torch.set_num_threads(1)
    # (a stall is seen in 2 s where a test stops a rank; elsewhere a rank slowed by a loaded
    # machine must not be taken for a stalled one)
    os.environ.update(TDIST_HEARTBEAT_INTERVAL="0.25", TDIST_HEARTBEAT_TIMEOUT=str(role.get("stall_s", 10)))
    if "start_after" in role:  # (a joiner: start once the job has gone that far)
        probe = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
        probe.wait([f"progress/{role['start_after']}"])
    if role.get("failover"):  # (a member keeps a standby of the store's server)
        store: Any = FailoverStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    else:
        store = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    model = _model()
    if "start_after" in role:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # (whatever a joiner holds is replaced by the job's state)
    opt = _optimizer(model)
    ddp: list[Any] = [None]
    quorums: list[tuple[int, int, int, int, int]] = []

    def on_reconfigure(q: ft.Quorum) -> None:
        quorums.append((q.epoch, q.world_size, len(q.lost), len(q.joined), q.step))
        if role.get("ddp"):
            ddp[0] = None  # (the old reducer's hooks on the parameters go with it)
            ddp[0] = torch.nn.parallel.DistributedDataParallel(model)

    mgr = ft.Manager(
        store, min_size=1, max_size=3, initial_size=role["initial"], timeout=20, join_timeout=60, last_call=60, grace=1.0,
        rejoin_timeout=10,
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        on_reconfigure=on_reconfigure,
    )
    mgr.start()
    warned: list[str] = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tdist.elastic._ft").addHandler(catcher)
    if role.get("failover"):
        leave = mgr._client.leave

        def leave_after_the_stores_host(deadline: float) -> None:
            # (the member whose standby serves the job's store leaves first; the others need
            # that store after it left: it used to go with that member's process. The pause
            # widens the window; the test does not synchronise on it.)
            keeper = mgr._keeper
            if not (keeper is not None and keeper.standby is not None and keeper.standby.serving):
                time.sleep(0.5)
            leave(deadline)

        mgr._client.leave = leave_after_the_stores_host  # type: ignore[method-assign]
    steps: list[tuple[int, bool, int]] = []
    kill_at = role.get("kill_at")
    while mgr.current_step < STEPS:
        with mgr.step() as outcome:
            step, rank, size = mgr.current_step, mgr.rank, mgr.world_size
            x, y = _batch(step)
            n = BATCH // size
            xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
            opt.zero_grad()
            if role.get("ddp"):
                if step == kill_at:  # die inside backward, while DDP's buckets are all-reduced
                    next(model.parameters()).register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
                torch.nn.functional.mse_loss(ddp[0](xs), ys).backward()
            else:
                if step == role.get("stop_at"):  # (stopped until the test sends SIGCONT)
                    os.kill(os.getpid(), signal.SIGSTOP)
                torch.nn.functional.mse_loss(model(xs), ys).backward()
                for i, p in enumerate(model.parameters()):
                    if step == kill_at and i == 2:  # die between two all-reduces of the step
                        os.kill(os.getpid(), signal.SIGKILL)
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p.grad /= size
            opt.step()
        time.sleep(0.05)  # (a pace at which a joiner can catch the job)
        if mgr.current_step == role.get("hold_at"):
            # (between two steps: wait until the stopped node is back or asks to join, so that
            # it comes back before the job ends, however slow this machine is)
            # (read from the store directly: the Manager's own view must not move)
            end = time.monotonic() + 60
            while True:
                st = State.decode(mgr._client.store.get(STATE_KEY))
                if len(st.members) == role.get("hold_for", 3) or set(st.candidates) - set(st.members):
                    break  # (back already, or asking)
                assert time.monotonic() < end, f"nobody came back to join: {st}"
                time.sleep(0.02)
        steps.append((outcome.number, bool(outcome.committed), size))
        if mgr.rank == 0:
            store.set(f"progress/{mgr.current_step}", b"")
    final_size = mgr.world_size
    mgr.shutdown()
    return {
        "params": [p.detach().tolist() for p in model.parameters()], "steps": steps, "quorums": quorums,
        "world_size": final_size, "warnings": warned,
    }


def _main(conn: multiprocessing.connection.Connection, port: int, role: dict[str, Any]) -> None:
    try:
        conn.send(("ok", _worker(port, role)))
    except BaseException as exc:
        import traceback

        conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _run(roles: dict[str, dict[str, Any]], timeout: float = 120, kill_store_at: int | None = None) -> dict[str, Any]:
    """Run one process per role around a store of this process; each role's result, or its
    exit code if it died without one. Every process is reaped. ``kill_store_at``: SIGKILL to
    the store's server (a process of its own) once the job committed that step."""
    ctx = multiprocessing.get_context("fork")
    initial = sum("start_after" not in role for role in roles.values())
    roles = {name: {**role, "initial": initial} for name, role in roles.items()}
    with local_store(timeout=60) as server:
        if kill_store_at is not None:
            threading.Thread(target=_kill_store, args=(server, kill_store_at), daemon=True).start()
        procs: dict[str, Any] = {}
        pipes: dict[str, multiprocessing.connection.Connection] = {}
        try:
            for name, role in roles.items():
                r, w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_main, args=(w, server.port, role), name=f"ft-{name}", daemon=True)
                p.start()
                w.close()
                procs[name], pipes[name] = p, r
            for name, role in roles.items():
                if "cont_after" in role:  # (wake a stopped process once the job has gone on)
                    threading.Thread(
                        target=_wake, args=(server.client(), procs[name].pid, role["cont_after"]), daemon=True
                    ).start()
            results: dict[str, Any] = {}
            deadline = time.monotonic() + timeout
            waiting = dict(pipes)
            while waiting and time.monotonic() < deadline:
                for conn in multiprocessing.connection.wait(list(waiting.values()), timeout=1.0):
                    name = next(n for n, c in waiting.items() if c is conn)
                    del waiting[name]
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        procs[name].join(5)
                        results[name] = procs[name].exitcode
                        continue
                    assert status == "ok", f"{name} failed: {value}"
                    results[name] = value
            assert not waiting, f"still running after {timeout} s: {sorted(waiting)}"
            return results
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join(5)
            for c in pipes.values():
                with contextlib.suppress(Exception):
                    c.close()


def _kill_store(server: Any, at: int) -> None:
    with contextlib.suppress(Exception):
        server.client().wait([f"progress/{at}"], timedelta(seconds=100))
        os.kill(server._server._server.pid, signal.SIGKILL)


def _wake(store: Any, pid: int, after: int) -> None:
    with contextlib.suppress(Exception):
        store.wait([f"progress/{after}"], timedelta(seconds=100))
        os.kill(pid, signal.SIGCONT)


def _check_same(results: list[dict[str, Any]], reference: list[torch.Tensor]) -> None:
    # (parameters come back as lists: a tensor through a pipe would need the sender alive)
    first = [torch.tensor(p) for p in results[0]["params"]]
    for r in results[1:]:
        for a, b in zip(first, [torch.tensor(p) for p in r["params"]], strict=True):
            assert torch.equal(a, b)  # (bit for bit: they hold one state)
    for a, b in zip(first, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_survivors_of_a_sigkill_mid_step_finish_in_place() -> None:
    # (the survivors wait at step 16 until both are members again or one asks to join: a
    # survivor slow to come back from the kill's abort joins before the other ends the job)
    out = _run({"a": {"hold_at": 16, "hold_for": 2}, "b": {"hold_at": 16, "hold_for": 2}, "victim": {"kill_at": 7}})
    assert out["victim"] == -signal.SIGKILL
    survivors = [out["a"], out["b"]]
    _check_same(survivors, _reference())
    # (the quorums after the kill depend on timing: typically one of the two survivors, [(1, 3),
    # (2, 2)]; on a loaded host a survivor slow to come back from the abort may first leave the
    # other alone, [(1, 3), (2, 1), (3, 2)], and join it as a newcomer, [(1, 3), (3, 2)], or a
    # quorum of the same two forms again. What holds in every case is checked.)
    assert any(q[2] >= 1 for r in survivors for q in r["quorums"][1:])  # (the victim lost)
    for r in survivors:
        assert r["world_size"] == 2
        epochs = [q[:2] for q in r["quorums"]]
        assert epochs[0] == (1, 3) and epochs[-1][1] == 2, epochs
        assert all(a[0] < b[0] for a, b in itertools.pairwise(epochs)) and all(s in (1, 2) for _, s in epochs[1:]), epochs
        committed = [(number, size) for number, ok, size in r["steps"] if ok]
        assert committed[0] == (0, 3) and committed[-1] == (STEPS - 1, 2), committed
        assert all(a[0] < b[0] for a, b in itertools.pairwise(committed)), committed  # (each once)
        assert all(s == (7, False, 3) for s in r["steps"] if not s[1]), r["steps"]  # (step 7 tried again, or healed)


def test_a_joiner_receives_the_state_from_a_live_peer_and_takes_part() -> None:
    # (the members wait at step 12 until the joiner asks: however slow its start, it joins a running job)
    out = _run({"a": {"hold_at": 12}, "b": {"hold_at": 12}, "late": {"start_after": 8}})
    results = [out["a"], out["b"], out["late"]]
    _check_same(results, _reference())
    late = out["late"]
    epoch, size, lost, _joined, step = late["quorums"][0]
    assert epoch == 2 and size == 3 and lost == 0 and step >= 8
    assert late["steps"][0][0] == step and len(late["steps"]) == STEPS - step
    assert all(r["world_size"] == 3 for r in results)


def test_ddp_on_tdist_survives_a_kill_and_takes_a_joiner() -> None:
    out = _run({
        "a": {"ddp": True, "hold_at": 16}, "b": {"ddp": True, "hold_at": 16}, "victim": {"ddp": True, "kill_at": 6},
        "late": {"ddp": True, "start_after": 12},
    })
    assert out["victim"] == -signal.SIGKILL
    results = [out["a"], out["b"], out["late"]]
    _check_same(results, _reference())
    sizes = [size for _, committed, size in out["a"]["steps"] if committed]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    late = out["late"]["quorums"]
    # (the joiner joins the running job from step 12 on and ends in the whole group; on a loaded
    # machine a survivor that was slow to come back from the kill's abort may join that round
    # one quorum later)
    assert late[0][1] in (2, 3) and late[0][4] >= 12 and late[-1][1] == 3, late


def test_the_job_outlives_the_host_of_its_store() -> None:
    """Members on ``FailoverStore`` clients: one keeps a standby of the store's server. SIGKILL
    to the server (a process of its own) once step 8 is committed: the standby takes over, and
    the members finish every step with one state, as in a job that lost nothing."""
    # (a stall seen in 2 s, as this test was written for: with 10 s it failed once in a loaded
    # run, its ranks 20 s apart after the failover; not understood yet)
    roles = {name: {"failover": True, "stall_s": 2} for name in ("a", "b", "c")}
    out = _run(roles, kill_store_at=8)
    results = [out["a"], out["b"], out["c"]]
    _check_same(results, _reference())
    assert all(r["world_size"] == 3 and all(committed for _, committed, _ in r["steps"]) for r in results)
    # (every member left the quorum: the one whose standby serves the store serves it on
    # until the others have left)
    assert not [w for r in results for w in r["warnings"] if "could not leave" in w], [r["warnings"] for r in results]


def test_a_stalled_rank_is_left_out_and_comes_back_as_a_joiner() -> None:
    # stopped (SIGSTOP) inside a step: the others see it stall (2 s), name it, go on without it
    # after the grace (1 s); woken up later, its step fails, and it joins again, healed
    out = _run({
        "a": {"hold_at": 16, "stall_s": 2}, "b": {"hold_at": 16, "stall_s": 2},
        "sleeper": {"stop_at": 5, "cont_after": 12, "stall_s": 2},
    })
    results = [out["a"], out["b"], out["sleeper"]]
    _check_same(results, _reference())
    sizes = [size for _, committed, size in out["a"]["steps"] if committed]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    epochs = [q[:2] for q in out["sleeper"]["quorums"]]
    assert epochs[0] == (1, 3) and epochs[-1][1] == 3 and out["sleeper"]["quorums"][-1][4] >= 12


@pytest.mark.timeout(200)
def test_the_example_runs_a_kill_and_a_join_to_identical_parameters() -> None:
    """``examples/ft_ddp.py`` (the README's command) end to end, shorter: 4 workers, one killed,
    a fifth joins; it exits 0 only if the four that finish hold identical parameters."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "MASTER_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "ft_ddp.py"), "--steps", "80", "--kill-at", "10", "--join-at", "20",
         "--pace", "0.01"],
        capture_output=True, text=True, timeout=180, env=env, cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "[launcher] killed w2" in out and "lost " in out and "[w4] quorum" in out, out[-3000:]
    assert "finished with identical parameters" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    worlds = [line.split("| world ")[1].split(" ")[0] for line in steps]
    assert worlds[0] == "4" and "3" in worlds and worlds[-1] == "4"
    # every step's loss once, the kill's step too (whichever worker was rank 0 then)
    assert [int(line.split()[1]) for line in steps] == list(range(80)), steps
