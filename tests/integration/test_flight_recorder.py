"""The flight recorder and the desync diagnosis with real processes: a rank that skips a
collective, calls another one, uses another shape, sleeps, is stopped (SIGSTOP) or dies; the
error on every rank names the culprit and what it was doing, and torch's analyzer
(``torchfrtrace``) run on the dumps agrees. Dumps on SIGUSR1 and on demand, and RPC calls in
flight in a dump.

Each rank is a forked process; results travel through a store this test process hosts (so the
store outlives every rank, whatever happens to them); ranks wait on store keys, not sleeps
(except the rank whose sleeping is the scenario)."""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import tdist
from tdist.testing import free_port, run_processes

from .._sync import read_line, wait_until

pytestmark = pytest.mark.timeout(120)

N = 3
CULPRIT = N - 1
PG_TIMEOUT = 3.0  # seconds: the collective timeout of the scenarios' groups
THIS_FILE = os.path.basename(__file__)


@pytest.fixture(params=["shm", "sockets"])
def path(request: pytest.FixtureRequest) -> str:
    """Both same-host paths: the shared-memory arena, and the schedules over the transport."""
    return str(request.param)


def _env(path: str, dumps: Path) -> dict[str, str]:
    return {
        "TDIST_SHM": "1" if path == "shm" else "0",
        "TDIST_FR_STACK": "1",
        "TDIST_FR_DUMP_TEMP_FILE": str(dumps / "rank_"),
    }


# -- the ranks' side -----------------------------------------------------------------------------
def _scenario(rank: int, n: int, store: tdist.Store, scenario: str, api: str, pg_timeout: float) -> str:
    """Two good collectives, then the third goes wrong on the last rank as ``scenario`` says.
    Returns the error this rank got (or ``"no error"``)."""
    if api.startswith("torch:"):  # torch's own init (and store, hosted by rank 0), tdist's backend
        import torch.distributed as tdc

        dist: Any = tdc
        tdc.init_process_group(
            "tdist", init_method=f"tcp://127.0.0.1:{api.split(':')[1]}", rank=rank, world_size=n,
            timeout=timedelta(seconds=pg_timeout),
        )
    else:
        dist = tdist
        tdist.init_process_group(
            "gloo", store=tdist.PrefixStore("job", store), rank=rank, world_size=n,
            timeout=timedelta(seconds=pg_timeout),
        )
    t = torch.ones(1024)
    dist.all_reduce(t)  # all_reduce #1
    dist.broadcast(torch.ones(10), 0)  # broadcast #2: the culprit's last good op
    try:
        if rank != CULPRIT:
            dist.all_reduce(t)  # all_reduce #3
        elif scenario == "skip":
            store.wait(["others_done"])  # (the others have their errors)
            _carry_on(dist, t)
        elif scenario == "sleep":
            time.sleep(PG_TIMEOUT + 3)
            store.wait(["others_done"])
            _carry_on(dist, t)
        elif scenario == "other":
            dist.broadcast(t, 0)
        elif scenario == "shape":
            dist.all_reduce(torch.ones(7))
        elif scenario == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)  # (the test continues us once the others have failed)
            store.wait(["others_done"])
            _carry_on(dist, t)
        elif scenario == "die":
            os._exit(3)
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _carry_on(dist: Any, t: torch.Tensor) -> None:
    """The culprit goes on after the others failed. Its first collective may still complete
    (what the others sent before they gave up is in its sockets, ahead of their abort); the
    next one fails."""
    dist.all_reduce(t)
    dist.barrier()


def _rank_main(rank: int, n: int, port: int, scenario: str, api: str, env: dict[str, str], pg_timeout: float) -> None:
    os.environ.update(env)
    if "TORCH_DISTRIBUTED_DEBUG" in env:  # (read at import: the test process's was imported without it)
        tdist.set_debug_level_from_env()
    torch.set_num_threads(1)
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    store.set(f"pid/{rank}", str(os.getpid()))
    try:
        result = _scenario(rank, n, store, scenario, api, pg_timeout)
    except BaseException as exc:  # (the harness reports it)
        result = f"harness: {type(exc).__name__}: {exc}"
    store.set(f"result/{rank}", result)
    store.wait(["release"])  # alive (answering) until the test has every result
    os._exit(0)


# -- the test's side -----------------------------------------------------------------------------
@contextlib.contextmanager
def _job(scenario: str, env: dict[str, str], api: str, pg_timeout: float) -> Iterator[tuple[tdist.TCPStore, list[Any]]]:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, N, master.port, scenario, api, env, pg_timeout), daemon=True) for r in range(N)]
    for p in procs:
        p.start()
    try:
        yield master, procs
    finally:
        master.set("release", "1")
        for p in procs:
            if p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        master.close()


def _results(master: tdist.TCPStore, ranks: list[int], timeout: float = 60.0) -> dict[int, str]:
    master.wait([f"result/{r}" for r in ranks], timedelta(seconds=timeout))
    return {r: master.get(f"result/{r}").decode() for r in ranks}


def _run(scenario: str, env: dict[str, str], api: str = "tdist", pg_timeout: float = PG_TIMEOUT) -> dict[int, str]:
    others = [r for r in range(N) if r != CULPRIT]
    with _job(scenario, env, api, pg_timeout) as (master, _procs):
        if scenario in ("other", "shape"):
            return _results(master, list(range(N)))
        got = _results(master, others)
        if scenario == "die":
            return got
        if scenario == "sigstop":
            os.kill(int(master.get(f"pid/{CULPRIT}")), signal.SIGCONT)
        prefix = env.get("TDIST_FR_DUMP_TEMP_FILE")
        if scenario == "skip" and prefix:  # (the culprit's dump, which the others asked for, is
            # written before it carries on: else it may record the all_reduce #3 it runs then)
            wait_until(lambda: os.path.exists(f"{prefix}{CULPRIT}"), 30, "the culprit's dump")
        master.set("others_done", "1")
        got.update(_results(master, [CULPRIT]))
        return got


def _fr_trace(dumps: Path) -> str:
    """What torch's analyzer (``python -m torch.distributed.flight_recorder.fr_trace``) says of
    the dumps in ``dumps``: its ``main``, run here (a fresh interpreter would import torch again),
    its printed lines and its log (a logger of its own, whose handler writes to stderr) caught."""
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger
    from torch.distributed.flight_recorder.fr_trace import main

    logger = FlightRecorderLogger().logger
    said = io.StringIO()
    handlers, logger.handlers = logger.handlers, [logging.StreamHandler(said)]
    try:
        with contextlib.redirect_stdout(said):
            main([str(dumps), "-p", "rank_"])
    finally:
        logger.handlers = handlers
    return said.getvalue()


# -- hangs: the error names the culprit and what it was doing --------------------------------------
@pytest.mark.parametrize("scenario", ["skip", "sleep"])
def test_a_rank_that_never_enters_the_collective_is_named_on_every_rank(
    scenario: str, path: str, tmp_path: Path
) -> None:
    got = _run(scenario, _env(path, tmp_path))
    for r in range(N - 1):
        m = got[r]
        assert m.startswith(("CollectiveTimeoutError", "PeerError")), m
        assert "rank 2 never entered all_reduce #3 (float32[1024])" in m, m
        assert "its last op is broadcast #2 (float32[10], completed" in m, m
        assert f"at {THIS_FILE}:" in m, m
        assert "ranks 0, 1 are waiting in all_reduce #3 (float32[1024])" in m, m
        assert f"its thread is now at {THIS_FILE}:" in m and "in _scenario" in m, m  # (where it is busy)
        if path == "shm" and scenario == "skip":  # (the arena counts its operations as the recorder does)
            assert "had not arrived at operation #3" in m, m
    # the culprit hears of it at its next call, with the same account
    assert "rank 2 never entered all_reduce #3" in got[CULPRIT], got[CULPRIT]
    # every rank left its dump (the culprit's written at the others' request)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1", "rank_2"]


def test_torchfrtrace_agrees_on_the_missing_rank(path: str, tmp_path: Path) -> None:
    _run("skip", _env(path, tmp_path))
    report = _fr_trace(tmp_path)
    assert "Not all ranks joining collective, sequence number: 3" in report, report
    assert "missing ranks: {2}" in report, report
    assert "collective: gloo:all_reduce" in report, report
    dump = pickle.loads((tmp_path / "rank_0").read_bytes())
    assert dump["version"] == "2.10"
    assert dump["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}
    last = dump["entries"][-1]
    assert (last["profiling_name"], last["collective_seq_id"], last["state"]) == ("gloo:all_reduce", 3, "started")
    assert last["input_sizes"] == [[1024]] and last["input_dtypes"] == ["Float"]
    assert any(f["filename"].endswith(THIS_FILE) for f in last["frames"])


def test_a_stopped_rank_is_named(path: str, tmp_path: Path) -> None:
    got = _run("sigstop", _env(path, tmp_path))
    for r in range(N - 1):
        m = got[r]
        assert "rank 2" in m and "SIGSTOP" in m, m
        assert "broadcast #2" in m, m  # (the last collective it took part in)
    assert "rank 2" in got[CULPRIT], got[CULPRIT]


def test_a_dead_rank_is_named(path: str, tmp_path: Path) -> None:
    got = _run("die", _env(path, tmp_path))
    for r in range(N - 1):
        m = got[r]
        assert m.startswith("PeerError"), m
        assert "rank 2 is gone (its process" in m, m
        assert "all_reduce #3" in m, m
    assert {"rank_0", "rank_1"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("scenario", ["die", "sigstop"])
def test_debug_detail_names_a_dead_or_stopped_rank_as_fast_as_without_it(scenario: str, tmp_path: Path) -> None:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every call through the store first; that wait
    did not look at the ranks known gone, and a dead or stopped rank was found at the group's
    timeout (60 s here), as "did not reach collective #N", where gloo names it at once."""
    env = {**_env("shm", tmp_path), "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TDIST_HEARTBEAT_TIMEOUT": "2"}
    got = _run(scenario, env, pg_timeout=60.0)
    for r in range(N - 1):
        m = got[r]
        assert m.startswith("PeerError") and "debug check of all_reduce" in m, m
        assert "rank 2 will never reach it" in m, m
        assert ("stalled" in m) if scenario == "sigstop" else ("lost" in m or "died" in m), m


# -- desyncs: the cheap check raises on every rank, naming both sides, long before the timeout ----
@pytest.mark.parametrize("scenario", ["other", "shape"])
def test_a_different_call_fails_every_rank_naming_both(scenario: str, path: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    got = _run(scenario, _env(path, tmp_path), pg_timeout=60.0)
    assert time.monotonic() - t0 < 30  # (the group's timeout is 60 s)
    for r in range(N):
        m = got[r]
        assert "mismatch" in m, m
        if scenario == "other":
            assert "broadcast" in m and "all_reduce" in m, m
        else:
            assert "1024" in m and "7" in m, m
        assert "rank 2" in m or r == CULPRIT, m
        assert "rank 0" in m or "rank 1" in m, m
    # the dumps were written, and torch's analyzer sees the same mismatch
    report = _fr_trace(tmp_path)
    kind = "COLLECTIVE_TYPE_MISMATCH" if scenario == "other" else "SIZE_OR_SYNTAX_MISMATCH"
    assert "Collective sequence number: 3 has errors" in report and kind in report, report


def _p2p_timeout(rank: int, n: int, port: int) -> str:
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    # (rank 1's timeout is longer: its barrier must not time out first, and abort rank 0's
    # receive before it times out itself; a receive's timeout breaks nothing on rank 1)
    timeout = timedelta(seconds=3 if rank == 0 else 5)
    tdist.init_process_group("gloo", store=tdist.PrefixStore("p2p", store), rank=rank, world_size=n, timeout=timeout)
    tdist.all_reduce(torch.ones(2))
    try:
        if rank == 0:
            tdist.recv(torch.zeros(3), 1)  # (rank 1 never sends: it is in a barrier)
        else:
            tdist.barrier()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        store.set(f"done/{rank}", "1")
        store.wait([f"done/{q}" for q in range(n)])  # (each answers the other's diagnosis until both have theirs)
        tdist.destroy_process_group()


def test_a_receive_that_times_out_says_what_its_sender_was_doing() -> None:
    """As a collective's timeout does: the rank that was to send is named, with its operation."""
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    try:
        got = run_processes(_p2p_timeout, 2, master.port, timeout=60)
    finally:
        master.close()
    assert got[0].startswith("CollectiveTimeoutError"), got
    assert "rank 1, which was to send it, is in barrier #2" in got[0], got
    assert "rank 0 is waiting in recv 1->0 (p2p #1) (float32[3])" in got[0], got
    assert "rank 0 never entered barrier #2; its last op is recv 1->0" in got[1], got


# -- two groups' collectives called in another order on two ranks: each waits for the other ------
def _crossed(rank: int, n: int, port: int, scenario: str, env: dict[str, str]) -> str:
    os.environ.update(env)
    os.environ["TDIST_FR_CHECK_AFTER"] = "0.5"
    if scenario == "slow":  # rank 0 finds the deadlock (rank 1 looks later), and its abort of
        # group '2', where rank 1 waits, is slow: rank 0's own failing call, and its destroy of
        # the groups right after, must not overtake it (rank 1 would hear only of a closed arena)
        if rank == 1:
            os.environ["TDIST_FR_CHECK_AFTER"] = "5"
        else:
            from tdist.c10d._tcp_backend import ProcessGroupTCP

            abort = ProcessGroupTCP._abort

            def slow_abort(self: Any, reason: str) -> None:
                if self._fr is not None and self._fr.label == "2":
                    time.sleep(0.5)
                abort(self, reason)

            ProcessGroupTCP._abort = slow_abort  # type: ignore[method-assign]
    timeout = timedelta(seconds=60)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timeout)
    a = tdist.new_group([0, 1], timeout=timeout)
    b = tdist.new_group([0, 1], timeout=timeout)
    try:
        if rank == 1:
            tdist.barrier(group=b)
            tdist.all_reduce(torch.ones(4), group=a)
        elif scenario in ("crossed", "slow"):
            tdist.all_reduce(torch.ones(4), group=a)
            tdist.barrier(group=b)
        elif scenario == "waited":  # (an async call waited for before the other group's: the same)
            tdist.all_reduce(torch.ones(4), group=a, async_op=True).wait()
            tdist.barrier(group=b)
        else:  # "thread": another thread of rank 0 calls b's, later: no deadlock
            late = threading.Thread(target=lambda: (time.sleep(2.0), tdist.barrier(group=b)))
            late.start()  # (the checks at 0.5 s and 1.5 s must not take it for one)
            tdist.all_reduce(torch.ones(4), group=a)
            late.join()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["crossed", "waited", "slow"])
def test_two_groups_called_in_another_order_fail_both_ranks_naming_the_deadlock(scenario: str, path: str, tmp_path: Path) -> None:
    """gloo hangs until the groups' timeout (30 minutes by default: no message of either group
    ever shows a mismatch). tdist's desync check finds the two ranks waiting for each other."""
    got = run_processes(_crossed, 2, free_port(), scenario, _env(path, tmp_path), timeout=90)
    # (each rank's check finds it, unless the other rank's verdict, which breaks both groups
    # there, reaches it first: then it fails with that one, as a PeerError quoting it)
    assert any(m.startswith("CollectiveMismatchError") for m in got), got
    for m in got:
        assert "deadlock between groups" in m, got
        assert "which this rank has not entered (its last collective there is #0)" in m, m
    for m in got:
        if m.startswith("CollectiveMismatchError: rank 0:"):
            assert "deadlock between groups '1' and '2'" in m and "which waits for rank 1; rank 1 is in" in m, m
            assert "all_reduce #1 (float32[4]) of group '1'" in m and "barrier #1 of group '2'" in m, m


# -- three groups, each rank in two, called so that each waits for the next: a cycle of three ----
def _cycle(rank: int, n: int, port: int, scenario: str, env: dict[str, str]) -> str:
    os.environ.update(env)
    os.environ["TDIST_FR_CHECK_AFTER"] = "0.5"
    timeout = timedelta(seconds=60)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timeout)
    # rank r is in groups[r] and groups[r - 1]; it calls groups[r]'s first, which waits for rank
    # r + 1, which is in groups[r + 1]'s first: each waits for the next, round the cycle
    groups = [tdist.new_group([r, (r + 1) % n], timeout=timeout) for r in range(n)]
    try:
        if scenario == "cycle" or rank != n - 1:
            tdist.all_reduce(torch.ones(4), group=groups[rank])
            tdist.all_reduce(torch.ones(4), group=groups[rank - 1])
        else:  # "broken": the last rank calls them in the order that ends the cycle: no deadlock
            tdist.all_reduce(torch.ones(4), group=groups[rank - 1])
            tdist.all_reduce(torch.ones(4), group=groups[rank])
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        tdist.destroy_process_group()


def test_groups_called_in_a_cycle_fail_every_rank_naming_the_deadlock(path: str, tmp_path: Path) -> None:
    """Three ranks, three groups of two, each rank's first call in a group that the next rank
    has not entered: no two ranks wait for each other, all three wait round a cycle. gloo (and
    the two-rank check) waits for the groups' timeout; the desync check follows the waits
    through every rank's answer to the default group and finds the cycle."""
    got = run_processes(_cycle, 3, free_port(), "cycle", _env(path, tmp_path), timeout=90)
    assert any(m.startswith("CollectiveMismatchError") for m in got), got
    for m in got:
        assert "deadlock between groups" in m, got
    # (each rank's own verdict follows the cycle from it: global rank r waits in its first
    # group's call for r + 1, ..., and the last waits in a group whose call r has not entered)
    own = 0
    for r, m in enumerate(got):
        if f"this rank (global rank {r})" not in m:
            continue  # (another rank's verdict reached it first, quoted)
        own += 1
        assert m.startswith("CollectiveMismatchError"), m
        chain = [f"this rank (global rank {r}) is in all_reduce #1 (float32[4]) of group '{r + 1}', which waits for global rank {(r + 1) % 3}"]
        for k in (1, 2):
            q = (r + k) % 3
            nxt = f"global rank {(q + 1) % 3}" if k == 1 else "this rank"
            chain.append(f"global rank {q} is in all_reduce #1 (float32[4]) of group '{q + 1}', which waits for {nxt}")
        assert "; ".join(chain) + ", which has not entered it (its last collective there is #0)" in m, m
    assert own, got


def test_groups_called_in_an_order_that_ends_the_cycle_are_no_deadlock(tmp_path: Path) -> None:
    assert run_processes(_cycle, 3, free_port(), "broken", _env("shm", tmp_path), timeout=90) == ["no error"] * 3


def test_a_call_another_thread_makes_later_is_no_deadlock(tmp_path: Path) -> None:
    assert run_processes(_crossed, 2, free_port(), "thread", _env("shm", tmp_path), timeout=90) == ["no error"] * 2


# -- a rank that is alive and busy elsewhere: the others warn while they wait ------------------
def _busy_elsewhere(rank: int, n: int, port: int, env: dict[str, str]) -> str:
    """Rank 2 is busy in code of its own (here: waiting on a store key) while ranks 0 and 1
    wait in an all_reduce; it comes once both have warned. No error: the wait was legal."""
    import logging

    os.environ.update(env)
    os.environ["TDIST_FR_CHECK_AFTER"] = "0.1"  # (the warning comes after 15 times that)
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and "has waited" in record.getMessage():
                warnings.append(record.getMessage())
                store.set(f"warned/{rank}", "1")

    logging.getLogger("tdist.c10d").addHandler(Catch())
    store = tdist.TCPStore("127.0.0.1", port, is_master=rank == 0, world_size=n, timeout=timedelta(seconds=60))
    tdist.init_process_group("gloo", store=tdist.PrefixStore("pg", store), rank=rank, world_size=n, timeout=timedelta(seconds=60))
    t = torch.ones(8)
    tdist.barrier()
    if rank == 2:
        store.wait(["warned/0", "warned/1"])  # (the busy part of its own)
    tdist.all_reduce(t)
    assert t.tolist() == [3.0] * 8
    tdist.destroy_process_group()
    return warnings[0] if warnings else "no warning"


def test_a_collective_that_waits_long_for_a_busy_rank_warns_naming_it_and_where_it_is(path: str, tmp_path: Path) -> None:
    """gloo says nothing until the group's timeout (30 minutes by default). tdist's desync check
    finds nothing wrong (rank 2 is alive, and has called nothing else), and after 15 checks'
    worth of waiting it warns, naming the rank and the line of its program it is at; the
    collective then completes."""
    got = run_processes(_busy_elsewhere, N, free_port(), _env(path, tmp_path), timeout=90)
    assert got[2] == "no warning", got
    for m in got[:2]:
        assert "all_reduce #2 (float32[8]) of group" in m and "has waited" in m, m
        assert "waits on until the group's timeout (0:01:00)" in m, m
        assert "rank 2 never entered all_reduce #2 (float32[8]); its last op is barrier #1" in m, m
        assert f"its thread is now at {THIS_FILE}:" in m and "in _busy_elsewhere" in m, m
        assert "ranks 0, 1 are waiting in all_reduce #2 (float32[8])" in m, m


def _late_sender(rank: int, n: int, port: int, env: dict[str, str]) -> str:
    """Rank 1 receives from rank 0, which is busy in code of its own until rank 1 has warned."""
    import logging

    os.environ.update(env)
    os.environ["TDIST_FR_CHECK_AFTER"] = "0.1"
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and "has waited" in record.getMessage():
                warnings.append(record.getMessage())
                store.set("warned", "1")

    logging.getLogger("tdist.c10d").addHandler(Catch())
    store = tdist.TCPStore("127.0.0.1", port, is_master=rank == 0, world_size=n, timeout=timedelta(seconds=60))
    tdist.init_process_group("gloo", store=tdist.PrefixStore("pg", store), rank=rank, world_size=n, timeout=timedelta(seconds=60))
    t = torch.full((4,), float(rank))
    if rank == 0:
        store.wait(["warned"])  # (the busy part of its own)
        tdist.send(t, 1)
    else:
        tdist.recv(t, 0)
        assert t.tolist() == [0.0] * 4
    tdist.destroy_process_group()
    return warnings[0] if warnings else "no warning"


def test_a_receive_that_waits_long_warns_saying_where_its_sender_is(path: str, tmp_path: Path) -> None:
    got = run_processes(_late_sender, 2, free_port(), _env(path, tmp_path), timeout=90)
    assert got[0] == "no warning", got
    m = got[1]
    assert m.startswith("rank 1: recv 0->1 (p2p #1) (float32[4]) of group") and "has waited" in m, m
    assert "rank 0, which was to send it, has recorded no operation in this group; its thread is now at " in m, m
    assert f"{THIS_FILE}:" in m and "in _late_sender" in m, m


# -- two ranks that both receive first: each waits for the other's send ------------------------
def _receives_first(rank: int, n: int, port: int, scenario: str) -> str:
    os.environ["TDIST_FR_CHECK_AFTER"] = "0.5"
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                             timeout=timedelta(seconds=60))
    t = torch.ones(3)
    try:
        if scenario == "crossed" or rank == 0:
            tdist.recv(t, src=1 - rank)
            if scenario == "late":
                tdist.send(t, dst=1)
        else:  # "late": rank 1 sends only after a while (rank 0's checks must not call it a deadlock)
            time.sleep(2.0)
            tdist.send(t, dst=0)
            tdist.recv(t, src=0)
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        tdist.destroy_process_group()


def test_two_ranks_that_both_receive_first_fail_naming_the_deadlock() -> None:
    """gloo waits for the group's timeout (30 minutes by default): no message ever comes."""
    got = run_processes(_receives_first, 2, free_port(), "crossed", timeout=90)
    assert any(m.startswith("CollectiveMismatchError") for m in got), got
    for m in got:
        assert "point-to-point deadlock in group" in m and "neither sends before its receive returns" in m, got


def test_a_send_that_comes_late_is_no_deadlock() -> None:
    assert run_processes(_receives_first, 2, free_port(), "late", timeout=90) == ["no error"] * 2


# -- torch's groups on the tdist backend -------------------------------------------------------------
def test_torch_groups_on_tdist_are_diagnosed_too(tmp_path: Path) -> None:
    got = _run("skip", _env("shm", tmp_path), api=f"torch:{free_port()}")
    for r in range(N - 1):
        assert "rank 2 never entered all_reduce #3 (float32[1024])" in got[r], got[r]
    report = _fr_trace(tmp_path)
    assert "missing ranks: {2}" in report, report


_LEAVE_FIRST = """
import os, sys, time
import torch, torch.distributed as tdc
import tdist
from tdist.c10d import _desync

tdc.init_process_group("tdist")  # (torch's store: its server in rank 0's process)
rank = tdc.get_rank()
sub = tdc.new_group([1, 2])  # (a group rank 0 is not in, on the same store)
t = torch.ones(4)
tdc.all_reduce(t)
if rank:
    tdc.all_reduce(t, group=sub)
deadline = time.monotonic() + 30  # (until every responder here is on the store)
while time.monotonic() < deadline:
    live = list(_desync._responders)
    if len(live) == (2 if rank else 1) and all(r._state == _desync._CONNECTED for r in live):
        break
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.readline()  # (rank 0 first: its process, and the store's server, go before the others leave)
tdc.destroy_process_group()
print("done", flush=True)
"""


def test_ranks_that_leave_after_the_store_host_print_nothing(tmp_path: Path) -> None:
    # (each rank's responders wait on torch's store, whose server goes with rank 0's process:
    # torch's client printed "recvValueWithTimeout failed ... Did the remote server shutdown
    # or crash?" with a C++ stack for each responder of ranks 1 and 2, and a responder's
    # thread inside torch's C++ wait at its own exit could abort the process)
    port = free_port()
    procs = []
    for r in range(3):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "3",
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _LEAVE_FIRST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env, text=True))
    try:
        for p in procs:
            assert p.stdout is not None and read_line(p.stdout, 60, "a rank's ready").strip() == "ready"
        outs = []
        for p in procs:  # (rank 0 first, and gone before the next is told)
            out, err = p.communicate("go\n", timeout=60)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0 and out.strip() == "done", (r, rc, out, err)
        # (what torch's client says of a server that has gone; not its retries of a connect
        # to one that is not up yet, which a loaded host may show before rank 0 listens)
        for said in ("remote server shutdown or crash", "sendBytes failed", "terminate called"):
            assert said not in err, (r, err)


# -- dumps on request --------------------------------------------------------------------------------
def _dump_on_request(rank: int, n: int, port: int, prefix: str) -> list[str]:
    # torch's older names of TORCH_FR_DUMP_TEMP_FILE and TORCH_FR_BUFFER_SIZE, which torch reads
    for var in ("TDIST_FR_DUMP_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TDIST_FR_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"):
        os.environ.pop(var, None)
    os.environ.update(TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix, TORCH_NCCL_TRACE_BUFFER_SIZE="2")
    store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    tdist.init_process_group("gloo", store=tdist.PrefixStore("job", store), rank=rank, world_size=n)
    from tdist import flight_recorder

    tdist.all_reduce(torch.ones(4))
    tdist.broadcast(torch.ones(2), 0)
    tdist.all_reduce(torch.ones(4))  # (the ring keeps the last 2)
    paths: list[str] = []
    if rank == 0:
        paths = flight_recorder.dump_all(os.path.dirname(prefix) + "/all/")
        os.kill(os.getpid(), signal.SIGUSR1)  # (the handler runs before the next bytecode)
    tdist.barrier()
    tdist.destroy_process_group()
    return paths


def test_dump_all_and_sigusr1(tmp_path: Path) -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    try:
        out = run_processes(_dump_on_request, 2, master.port, str(tmp_path / "sig_"), timeout=60)
    finally:
        master.close()
    assert out[0] == [str(tmp_path / "all" / "rank_0"), str(tmp_path / "all" / "rank_1")]
    for name in ("all/rank_0", "all/rank_1", "sig_0"):
        dump = pickle.loads((tmp_path / name).read_bytes())
        names = [e["profiling_name"] for e in dump["entries"]]
        # (rank 1 answers dump_all from a thread, maybe once in the barrier)
        assert names in (["gloo:broadcast", "gloo:all_reduce"], ["gloo:all_reduce", "gloo:barrier"]), name
        assert name == "all/rank_1" or names[0] == "gloo:broadcast", name


def _rpc_in_flight(rank: int, n: int, port: int) -> list[dict[str, Any]]:
    import tdist.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=n)
    found: list[dict[str, Any]] = []
    if rank == 0:
        fut = rpc.rpc_async("worker1", time.sleep, args=(1.5,))
        from tdist import flight_recorder

        found = flight_recorder.dump_dict()["rpc_in_flight"]
        fut.wait()
    rpc.shutdown()
    return found


def test_rpc_calls_in_flight_are_in_the_dump() -> None:
    got = run_processes(_rpc_in_flight, 2, free_port(), timeout=60)[0]
    assert len(got) == 1, got
    call = got[0]
    assert call["callee"] == "worker1" and "sleep" in call["call"], call
    assert 0 <= call["age_s"] < 1.5, call


# -- the issuing thread --------------------------------------------------------------------------
def _threads_of_entries(rank: int, n: int, port: int, api: str, torch_port: int) -> list[tuple[str, str, str]]:
    import threading

    for var in ("TDIST_FR_STACK", "TDIST_FR_TIMED", "TDIST_FR_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"):
        os.environ.pop(var, None)  # (the hot path's short entries, too)
    dist: Any
    if api == "torch":  # torch's own init (and store, hosted by rank 0), tdist's backend
        import torch.distributed as dist

        dist.init_process_group("tdist", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=n)
    else:
        dist = tdist
        store = tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=tdist.PrefixStore("job", store), rank=rank, world_size=n)
    from tdist import flight_recorder

    dist.all_reduce(torch.ones(1))  # (4 B: the tcp backend's short entry)
    side_done, release = threading.Event(), threading.Event()

    def side() -> None:
        dist.broadcast(torch.ones(3, dtype=torch.int64), 0)
        dist.all_reduce(torch.ones(2, 2))
        side_done.set()
        release.wait(30)  # (alive at the dump: a thread that ended has no name)

    worker = threading.Thread(target=side, name=f"side-{rank}")
    worker.start()
    assert side_done.wait(30)
    dist.barrier()
    found = [(e["profiling_name"], e["thread_id"], e["thread_name"]) for e in flight_recorder.dump_dict()["entries"]]
    release.set()
    worker.join(30)
    mine, side_ident = str(threading.get_ident()), str(worker.ident)
    assert found == [
        ("gloo:all_reduce", mine, "MainThread"),
        ("gloo:broadcast", side_ident, f"side-{rank}"),
        ("gloo:all_reduce", side_ident, f"side-{rank}"),
        ("gloo:barrier", mine, "MainThread"),
    ], found
    dist.destroy_process_group()
    return found


@pytest.mark.parametrize("api", ["tdist", "torch"])
def test_entries_name_the_thread_that_issued_them(api: str) -> None:
    # (torch's recorder writes the issuing thread's id and name into every entry)
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    try:
        out = run_processes(_threads_of_entries, 2, master.port, api, free_port(), timeout=60)
    finally:
        master.close()
    assert all(tid.isdigit() for r in out for _, tid, _ in r)
