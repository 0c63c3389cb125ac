"""init_method rendezvous: torch's errors, the handler registry, env/tcp/file URLs."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tdist
from tdist.store import _rendezvous
from tdist.store._api import Store
from tdist.testing import free_port, local_store, run_threads

pytestmark = pytest.mark.timeout(30)

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RESTART_COUNT", "TDIST_AGENT_STORE")
SHORT = timedelta(seconds=10)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TDIST_SECRET", raising=False)


@pytest.fixture
def full_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def close(store: Store) -> None:
    closer = getattr(store, "close", None)
    if closer is not None:
        closer()


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("var", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_env_missing_variable(var: str, full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(var)
    if var == "MASTER_ADDR":  # (rank 0 needs none: below)
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
    expected = (
        "Error initializing torch.distributed using env:// rendezvous: "
        f"environment variable {var} expected, but not set"
    )
    with pytest.raises(ValueError) as info:
        next(tdist.rendezvous("env://"))
    assert str(info.value).startswith(expected)


def test_env_rank_0_needs_no_master_addr_as_in_torch_03(full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR")
    store, rank, world_size = next(tdist.rendezvous("env://", timeout=SHORT))
    try:
        assert (rank, world_size) == (0, 1) and store.add("n", 1) == 1
    finally:
        close(store)


def test_env_empty_variable_counts_as_missing(full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "")
    with pytest.raises(ValueError, match="environment variable MASTER_ADDR expected, but not set"):
        next(tdist.rendezvous("env://"))


def test_env_bad_master_port_names_variable_and_value(
    full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_PORT", "29x00")
    with pytest.raises(ValueError, match=r"MASTER_PORT must be a port number, but was '29x00'"):
        next(tdist.rendezvous("env://"))


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_env_port_out_of_range(port: str, full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(ValueError, match=rf"^port must have value from 0 to 65535 but was {port}\.$"):
        next(tdist.rendezvous("env://"))


def test_env_bad_rank(full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK must be an integer, but was 'zero'"):
        next(tdist.rendezvous("env://"))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="rank 1 is out of range for world size 1"):
        next(tdist.rendezvous("env://"))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
        ("tcp://127.0.0.1:1234?world_size=1", "rank parameter missing"),
        ("tcp://127.0.0.1:1234?rank=0", "world size parameter missing"),
        ("file://?rank=0&world_size=1", "path missing"),
        ("tcp://239.1.2.3:1234?rank=0&world_size=1", "239.1.2.3 is a multicast address: torch 0.3's"),
        ("tcp://[ff15::1]:1234?world_size=4", "ff15::1 is a multicast address: torch 0.3's"),
        ("file:///tmp/x?rank=0", "world size parameter missing"),
    ],
)
def test_url_errors_match_torch(url: str, message: str) -> None:
    scheme = url.split(":")[0]
    with pytest.raises(ValueError) as info:
        next(tdist.rendezvous(url))
    assert str(info.value).startswith(
        f"Error initializing torch.distributed using {scheme}:// rendezvous: {message}"
    )


def test_tcp_port_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"^port must have value from 0 to 65535 but was 70000\.$"):
        next(tdist.rendezvous("tcp://127.0.0.1:70000?rank=0&world_size=1"))


def test_file_relative_path_hint() -> None:
    with pytest.raises(ValueError, match="path missing; write file:///absolute/path"):
        next(tdist.rendezvous("file://x?rank=0&world_size=1"))
    with pytest.raises(ValueError, match="names host 'tmp', but the file must be local"):
        next(tdist.rendezvous("file://tmp/x?rank=0&world_size=1"))


def test_malformed_query() -> None:
    with pytest.raises(ValueError, match="malformed query parameter 'rank'"):
        next(tdist.rendezvous("tcp://127.0.0.1:1234?rank&world_size=1"))


def test_unknown_scheme() -> None:
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for foo://$"):
        tdist.rendezvous("foo://bar")


def test_argument_types() -> None:
    with pytest.raises(RuntimeError, match="`url` must be a string"):
        tdist.rendezvous(5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="`rank` must be an integer"):
        tdist.rendezvous("env://", rank="0")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="`world_size` must be an integer"):
        tdist.rendezvous("env://", world_size=1.0)  # type: ignore[arg-type]


def test_rank_given_twice() -> None:
    with pytest.raises(AssertionError, match="has node-specific arguments"):
        tdist.rendezvous("tcp://127.0.0.1:1234?rank=0&world_size=1", rank=0)


# -- registry ----------------------------------------------------------------------------------
@pytest.fixture
def scheme() -> Iterator[str]:
    name = "tdisttest"
    yield name
    _rendezvous._rendezvous_handlers.pop(name, None)


def test_register_custom_handler(scheme: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
        seen.append((url, kwargs))
        yield (Store(), 3, 4)

    tdist.register_rendezvous_handler(scheme, handler)
    store, rank, world_size = next(tdist.rendezvous(f"{scheme}://x/y", rank=3, world_size=4, timeout=SHORT))
    assert (rank, world_size) == (3, 4)
    assert isinstance(store, Store)
    assert seen == [(f"{scheme}://x/y?rank=3&world_size=4", {"timeout": SHORT})]
    with pytest.raises(RuntimeError, match=rf"Rendezvous handler for {scheme}:// already registered"):
        tdist.register_rendezvous_handler(scheme, handler)


def test_builtin_handlers_registered() -> None:
    assert {"env", "tcp", "file"} <= set(_rendezvous._rendezvous_handlers)


# -- working rendezvous ------------------------------------------------------------------------
def test_env_world_size_one(full_env: dict[str, str]) -> None:
    it = tdist.rendezvous("env://", timeout=timedelta(seconds=7))
    store, rank, world_size = next(it)
    try:
        assert (rank, world_size) == (0, 1)
        assert isinstance(store, tdist.TCPStore)
        assert store.port == int(full_env["MASTER_PORT"])
        assert store.timeout == timedelta(seconds=7)
        store.set("k", "v")
        assert store.get("k") == b"v"
        with pytest.raises(RuntimeError, match=r"^Unable to perform re-rendezvous using env:// method$"):
            next(it)
    finally:
        close(store)


def test_env_query_overrides_environment(full_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "9")
    store, rank, world_size = next(tdist.rendezvous("env://?rank=0&world_size=1", timeout=SHORT))
    close(store)
    assert (rank, world_size) == (0, 1)


def _env_rank(rank: int, world_size: int) -> tuple[int, int, bytes]:
    store, r, ws = next(tdist.rendezvous("env://", rank=rank, world_size=world_size, timeout=SHORT))
    try:
        store.set(f"from{rank}", str(rank))
        other = store.get(f"from{(rank + 1) % world_size}")
        store.barrier("done", world_size)
        return r, ws, other
    finally:
        close(store)


def test_env_two_ranks_as_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert run_threads(_env_rank, 2, timeout=20) == [(0, 2, b"1"), (1, 2, b"0")]


def test_tcp_world_size_one() -> None:
    it = tdist.rendezvous(f"tcp://127.0.0.1:{free_port()}?rank=0&world_size=1", timeout=SHORT)
    store, rank, world_size = next(it)
    try:
        assert (rank, world_size) == (0, 1)
        assert store.add("n", 2) == 2
        with pytest.raises(RuntimeError, match=r"^Unable to perform re-rendezvous using tcp:// method$"):
            next(it)
    finally:
        close(store)


def test_tcp_two_ranks_as_threads() -> None:
    url = f"tcp://localhost:{free_port()}"

    def body(rank: int, world_size: int) -> int:
        store, r, ws = next(tdist.rendezvous(url, rank=rank, world_size=world_size, timeout=SHORT))
        try:
            assert (r, ws) == (rank, world_size)
            total = store.add("sum", rank + 1)
            store.barrier("b", world_size)
            return total
        finally:
            close(store)

    assert sorted(run_threads(body, 2, timeout=20)) in ([1, 3], [2, 3])


def test_agent_store_is_prefixed_per_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    with local_store(2, timeout=10) as server:
        monkeypatch.setenv("MASTER_ADDR", server.host)
        monkeypatch.setenv("MASTER_PORT", str(server.port))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")

        def body(rank: int, world_size: int) -> None:
            # rank 0 must not host a server: the agent's (ours) is already on the port
            store, _, _ = next(tdist.rendezvous("env://", rank=rank, world_size=world_size, timeout=SHORT))
            store.set(f"k{rank}", b"x")

        run_threads(body, 2, timeout=20)
        raw = server.client()
        assert raw.get("/worker/attempt_3/k0") == b"x"
        assert raw.get("/worker/attempt_3/k1") == b"x"


def test_file_rendezvous(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    it = tdist.rendezvous(url, rank=0, world_size=1)
    store, rank, world_size = next(it)
    assert (rank, world_size) == (0, 1)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    with pytest.raises(RuntimeError, match="Unable to perform rerendezvous using file:// method"):
        next(it)


def test_file_two_ranks_as_threads(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"

    def body(rank: int, world_size: int) -> bytes:
        store, _, _ = next(tdist.rendezvous(url, rank=rank, world_size=world_size))
        store.set(f"k{rank}", str(rank))
        return store.get(f"k{1 - rank}")

    assert run_threads(body, 2, timeout=20) == [b"1", b"0"]


def test_file_without_rank_assigns_ranks_as_torch_03(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    first = next(tdist.rendezvous(url, world_size=2))
    second = next(tdist.rendezvous(url, world_size=2))
    assert (first[1:], second[1:]) == ((0, 2), (1, 2))
    with pytest.raises(ValueError, match=r"rank parameter missing, and the 2 automatic ranks of .* are taken"):
        next(tdist.rendezvous(url, world_size=2))


def test_the_launchers_store_is_used_for_the_jobs_own_address_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # tdist run: MASTER_ADDR:MASTER_PORT is torch's store; tdist's env:// goes to TDIST_AGENT_STORE
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "4000")
    monkeypatch.setenv("TDIST_AGENT_STORE", "127.0.0.1:5000")
    assert _rendezvous._agent_store("127.0.0.1", 4000) == ("127.0.0.1", 5000)
    # a job of the worker's own (another address) is left alone
    assert _rendezvous._agent_store("127.0.0.1", 4001) is None
    monkeypatch.setenv("TDIST_AGENT_STORE", "nonsense")
    with pytest.raises(ValueError, match="TDIST_AGENT_STORE must be HOST:PORT"):
        _rendezvous._agent_store("127.0.0.1", 4000)
    # torchrun's way: every rank a client of MASTER_ADDR:MASTER_PORT
    monkeypatch.delenv("TDIST_AGENT_STORE")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _rendezvous._agent_store("127.0.0.1", 4000) == ("127.0.0.1", 4000)


# -- what the checked join's claims tell of a rank that keeps the group waiting ------------------
def test_claims_name_a_rank_gone_only_where_its_pid_means_its_process() -> None:
    import os
    import subprocess
    import sys

    from tdist._core._process import pid_space
    from tdist.store._hash import HashStore
    from tdist.store._rendezvous import _RDZV, claims_gone

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # (exited and reaped: its pid names no process)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store = HashStore()
        assert claims_gone(store, 5) is None  # (no checked join on it)
        store._rdzv_round = 3  # type: ignore[attr-defined]
        here = pid_space()
        claims = [
            f"h|{dead.pid}|n0|{here}",  # gone
            f"h|{dead.pid}|n1|another-boot|{os.stat('/proc/self/ns/pid').st_ino}",  # another machine's pids
            f"released|h|{alive.pid}|n2|{here}",  # alive (a released claim: its process is what counts)
            f"h|{os.getpid()}|n3|{here}",  # this process (ranks as threads of one process)
            f"h|{dead.pid}|n4",  # a claim without its pid space: nothing known
        ]
        store.multi_set([f"{_RDZV}/3/rank_{r}" for r in range(5)], claims)
        gone = claims_gone(store, 5)
        assert gone is not None
        assert [gone(r) for r in range(5)] == [f"its process, pid {dead.pid}, has exited", None, None, None, None]
        assert gone(7) is None
    finally:
        alive.kill()
        alive.wait()
