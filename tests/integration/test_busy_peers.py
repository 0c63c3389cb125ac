"""A peer that is busy is not a stalled one.

A rank inside one long call that holds the interpreter lock (``sum`` over a huge range, a
``json.loads`` of a large document, a C extension that keeps the lock) sends no heartbeat, as a
stopped one does. On one host tdist tells them apart by the process's CPU time
(``transport._liveness.still_running``): the busy rank's peers wait for it, up to the
operation's own timeout, as torch's do; a stopped rank is still called stalled within the stall
timeout (``test_transport``, ``test_shm_arena``).

Each test makes the busy call last several stall timeouts (1 s here): without the check, the
waiting rank fails with "stalled" after 1 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import pytest

from tdist.testing import free_port, run_processes
from tdist.transport._liveness import _LOOK_APART, still_running

from .._sync import read_line

STALL_S = 1.0
BUSY_S = 3.5  # (the call that holds the interpreter lock: several stall timeouts)


def _quick_liveness() -> None:
    os.environ["TDIST_HEARTBEAT_INTERVAL"] = "0.2"
    os.environ["TDIST_HEARTBEAT_TIMEOUT"] = str(STALL_S)


def _hold_the_interpreter_lock(seconds: float) -> float:
    """Busy for ``seconds``, never letting the interpreter lock go (as one long C call would);
    its length. (A thread that holds the lock drops it only when another asks, after the switch
    interval: made longer than the call, nobody asks. A ``sum`` sized from a sample was as
    long as the sample said only on a steady host: under a full suite it came out at half.)"""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        time.sleep(0.01)  # (every thread that waits for the lock now waits with the new interval)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            pass
        return time.perf_counter() - t0
    finally:
        sys.setswitchinterval(before)


def _collective_beside_a_busy_rank(rank: int, world: int, port: int, shm: str) -> tuple[float, list[float]]:
    _quick_liveness()
    os.environ["TDIST_SHM"] = shm
    import torch

    import tdist as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    t = torch.ones(4)
    dist.all_reduce(t)  # (every rank is in the group, and heard, before the busy call)
    busy = _hold_the_interpreter_lock(BUSY_S) if rank == 1 else 0.0
    dist.all_reduce(t)
    dist.destroy_process_group()
    return busy, t.tolist()


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "sockets"])
def test_a_rank_busy_in_one_call_that_holds_the_interpreter_lock_is_waited_for(shm: str) -> None:
    (_, got0), (busy, got1) = run_processes(_collective_beside_a_busy_rank, 2, free_port(), shm, timeout=90)
    assert busy > 2 * STALL_S, f"the busy call took {busy:.1f} s: too short to tell"
    assert got0 == got1 == [4.0] * 4


def _rpc_to_a_busy_callee(rank: int, world: int, port: int) -> Any:
    _quick_liveness()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import tdist.rpc as rpc

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=60))
    out = None
    if rank == 0:
        out = rpc.rpc_sync("w1", _hold_the_interpreter_lock, args=(BUSY_S,))
    rpc.shutdown()
    return out


def test_an_rpc_whose_callee_holds_the_interpreter_lock_gets_its_answer() -> None:
    busy = run_processes(_rpc_to_a_busy_callee, 2, free_port(), timeout=90)[0]
    assert busy > 2 * STALL_S, f"the busy call took {busy:.1f} s: too short to tell"


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    how = sys.argv[1]
    print("ready", flush=True)
    if how == "busy":
        while True:
            sum(range(10_000_000))
    elif how == "sleeping":
        time.sleep(60)
    elif how == "stopped":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
""")


@pytest.mark.parametrize("how", ["busy", "sleeping", "stopped", "exited"])
def test_still_running_is_a_process_that_uses_cpu(how: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, how], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and read_line(child.stdout, 60, "the child's ready") == "ready\n"
        if how == "exited":
            child.kill()
            child.wait(10)
        elif how == "stopped":
            deadline = time.monotonic() + 10
            while _state(child.pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.01)
        looks = []
        for _ in range(3):  # (a first look cannot tell; the ones after compare)
            looks.append(still_running(child.pid))
            time.sleep(_LOOK_APART + 0.05)
        assert looks[1:] == [how == "busy"] * 2, looks
        assert not still_running(os.getpid())  # (its own process: its peers are its threads)
    finally:
        child.kill()
        child.wait(10)


def _state(pid: int) -> str:
    from tdist._core._process import proc_stat

    fields = proc_stat(pid)
    return fields[0] if fields else ""
