"""tdist.testing: ranks as threads and processes, failures, hard timeouts, local stores."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

import tdist
from tdist.testing import (
    RankFailedError,
    RankTimeoutError,
    free_port,
    local_store,
    run_processes,
    run_threads,
)

pytestmark = pytest.mark.timeout(30)


# module-level bodies, so that "spawn" can pickle them
def square(rank: int, world_size: int, offset: int = 0) -> tuple[int, int]:
    return (rank * rank + offset, world_size)


def fail_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"bad input on rank {rank}")
    return rank


def exit_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def hang_on_one(rank: int, world_size: int, pidfile: str) -> int:
    if rank == 1:
        Path(pidfile).write_text(str(os.getpid()))
        time.sleep(60)
    return rank


def killed_on_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickling drops b: unpickling fails
        super().__init__(a)
        self.lock = threading.Lock()


def raise_unpicklable(rank: int, world_size: int) -> int:
    raise Unpicklable(1, 2)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- threads -----------------------------------------------------------------------------------
def test_threads_return_results_by_rank() -> None:
    assert run_threads(square, 3, 10, timeout=5) == [(10, 3), (11, 3), (14, 3)]


def test_threads_failure_names_the_rank() -> None:
    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        run_threads(fail_on_one, 3, timeout=5)
    assert any("raised on rank 1 of 3" in n for n in info.value.__notes__)


def test_threads_first_failure_wins_and_others_are_not_awaited_forever() -> None:
    release = threading.Event()

    def body(rank: int, world_size: int) -> None:
        if rank == 0:
            raise KeyError("first")
        release.wait(10)  # a rank stuck because rank 0 died

    start = time.monotonic()
    with pytest.raises(KeyError) as info:
        run_threads(body, 2, timeout=10, grace=0.2)
    assert time.monotonic() - start < 3
    assert any("ranks still running: [1]" in n for n in info.value.__notes__)
    release.set()


def test_threads_hung_rank_hits_the_timeout() -> None:
    release = threading.Event()

    def body(rank: int, world_size: int) -> int:
        if rank == 2:
            release.wait(10)
        return rank

    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[2\] of 3 still running after 0.3 s") as info:
        run_threads(body, 3, timeout=0.3)
    assert info.value.ranks == [2]
    assert "release.wait" in str(info.value)  # where the hung rank is stuck
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - start < 3
    release.set()


def test_threads_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size must be positive"):
        run_threads(square, 0)


# -- processes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_processes_return_results_by_rank(start_method: str) -> None:
    assert run_processes(square, 2, 5, timeout=20, start_method=start_method) == [(5, 2), (6, 2)]  # type: ignore[arg-type]


def environment_and_folder(rank: int, world_size: int, name: str) -> tuple[str | None, str]:
    return os.environ.get(name), os.getcwd()


@pytest.mark.timeout(90)  # (four spawned interpreters, each importing torch: 30 s on a loaded host)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_processes_get_the_callers_environment_and_folder_as_it_is_at_the_call(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the forkserver, started once, keeps the environment of its start: a rank forked by it
    # takes the caller's as it is at the call, as a spawned one does)
    run_processes(square, 1, timeout=20, start_method=start_method)  # type: ignore[arg-type]  # (the server up)
    name = f"TDIST_TEST_CARRIED_{os.getpid()}"
    monkeypatch.setenv(name, "set after the server started")
    monkeypatch.chdir(tmp_path)
    got = run_processes(environment_and_folder, 2, name, timeout=20, start_method=start_method)  # type: ignore[arg-type]
    assert got == [("set after the server started", str(tmp_path))] * 2
    monkeypatch.delenv(name)
    assert run_processes(environment_and_folder, 1, name, timeout=20, start_method=start_method)[0][0] is None  # type: ignore[arg-type]


def test_processes_exception_comes_back_with_rank_and_remote_traceback() -> None:
    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        run_processes(fail_on_one, 2, timeout=10)
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 2" in notes
    assert "in fail_on_one" in notes  # the remote traceback


def test_processes_unpicklable_exception_is_still_reported() -> None:
    with pytest.raises(RankFailedError, match="rank 0 of 1 failed") as info:
        run_processes(raise_unpicklable, 1, timeout=10)
    assert "Unpicklable" in str(info.value)


def test_processes_exit_without_result_reports_rank_and_exit_code() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 \(pid \d+\) exited with exit code 3") as info:
        run_processes(exit_on_one, 2, timeout=10)
    assert info.value.rank == 1
    assert info.value.exitcode == 3


def test_processes_killed_rank_reports_the_signal() -> None:
    with pytest.raises(RankFailedError, match=r"exit code -9 \(SIGKILL\)") as info:
        run_processes(killed_on_zero, 2, timeout=10)
    assert info.value.rank == 0


def test_processes_hung_rank_is_killed_at_the_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"rank 1 \(pid \d+\) of 2 still running after 1 s") as info:
        run_processes(hang_on_one, 2, str(pidfile), timeout=1)
    assert time.monotonic() - start < 6
    assert info.value.ranks == [1]
    assert gone(int(pidfile.read_text()))  # killed and reaped
    # where it hung, every thread of it, written as it was stopped
    notes = "\n".join(info.value.__notes__)
    assert "rank 1 was at:" in notes and "in hang_on_one" in notes, notes
    assert "rank 0" not in notes  # (it had finished)


def crash_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # (a segfault)
    return rank


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_processes_crashed_rank_says_where(start_method: str) -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 \(pid \d+\) exited with exit code -11 \(SIGSEGV\)") as info:
        run_processes(crash_on_one, 2, timeout=20, start_method=start_method)  # type: ignore[arg-type]
    notes = "\n".join(info.value.__notes__)
    assert "Segmentation fault" in notes and "in crash_on_one" in notes, notes


# -- ports and stores --------------------------------------------------------------------------
def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_is_none_the_kernel_would_hand_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # (below the ephemeral range: a port the kernel chose went to another process, now and then,
    # before the caller bound it, in a loaded test run)
    from tdist._core import ports as testing

    low = testing._ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(testing._FREE_PORTS_FROM <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 40  # (drawn at random, not the same few)
    with socket.socket() as taken:  # a port in use is not handed out: the next draw is
        taken.bind(("127.0.0.1", free_port()))
        draws = iter([taken.getsockname()[1], taken.getsockname()[1] + 1])
        monkeypatch.setattr(testing._random, "randrange", lambda a, b: next(draws))
        assert free_port() == taken.getsockname()[1] + 1


def test_local_store_clients_share_keys() -> None:
    with local_store(2, timeout=5) as server:
        a, b = server.client(), server.client()
        a.set("k", b"v")
        assert b.get("k") == b"v"
        assert server.url() == f"tcp://127.0.0.1:{server.port}"
        assert server.url(1) == f"tcp://127.0.0.1:{server.port}?rank=1&world_size=2"


def test_local_store_with_ranks_as_threads() -> None:
    with local_store(3, timeout=5) as server:

        def body(rank: int, world_size: int) -> int:
            store = server.client()
            store.set(f"rank{rank}", str(rank))
            store.wait([f"rank{r}" for r in range(world_size)])
            return store.add("count", 1)

        assert sorted(run_threads(body, 3, timeout=10)) == [1, 2, 3]


def test_local_store_env_for_agent_store_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    with local_store(1, timeout=5) as server:
        env = server.env(0)
        assert env["MASTER_PORT"] == str(server.port)
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        store, rank, world_size = next(tdist.rendezvous("env://", timeout=timedelta(seconds=5)))
        assert (rank, world_size) == (0, 1)
        store.set("k", b"v")
        assert server.client().get("/worker/attempt_0/k") == b"v"
