"""``tdist.elastic.rendezvous`` (torchelastic's rendezvous API): parameters and registry as
torch's, and the static, c10d and etcd handlers with nodes as threads over the real stores."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tdist.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    get_rendezvous_handler,
)
from tdist.testing import free_port

from .._sync import wait_until

pytestmark = pytest.mark.timeout(60)


def test_parameters_and_registry_as_torchs() -> None:
    with pytest.raises(ValueError, match="must be a non-empty string"):
        RendezvousParameters("", "h:1", "job", 1, 1)
    with pytest.raises(ValueError, match=r"minimum number of rendezvous nodes \(0\) must be greater than zero"):
        RendezvousParameters("c10d", "h:1", "job", 0, 1)
    with pytest.raises(ValueError, match="must be greater than or equal to"):
        RendezvousParameters("c10d", "h:1", "job", 3, 2)
    p = RendezvousParameters("c10d", "h:1", "job", 1, 2, flag="yes", off=0, n="7", bad="maybe")
    assert p.get("flag") == "yes" and p.get("missing", 5) == 5
    assert p.get_as_bool("flag") is True and p.get_as_bool("off") is False and p.get_as_bool("missing") is None
    assert p.get_as_int("n") == 7
    with pytest.raises(ValueError, match="'bad' does not represent a valid boolean value"):
        p.get_as_bool("bad")
    with pytest.raises(ValueError, match="'flag' does not represent a valid integer value"):
        p.get_as_int("flag")

    registry = RendezvousHandlerRegistry()

    def creator(params: RendezvousParameters) -> RendezvousHandler:
        return get_rendezvous_handler(RendezvousParameters("static", "127.0.0.1:1", "x", 1, 1, rank=0))

    registry.register("mine", creator)
    registry.register("mine", creator)  # (again with the same creator: fine)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine", lambda p: creator(p))
    with pytest.raises(ValueError, match="'nope' is not registered"):
        registry.create_handler(RendezvousParameters("nope", "", "job", 1, 1))
    with pytest.raises(RuntimeError, match="'static' does not match the requested backend 'mine'"):
        registry.create_handler(RendezvousParameters("mine", "", "job", 1, 1))
    with pytest.raises(ValueError, match="rank is absent"):
        get_rendezvous_handler(RendezvousParameters("static", "127.0.0.1:1", "job", 1, 1))
    # c10d's options, as torch's create_backend
    with pytest.raises(ValueError, match="Invalid store type given"):
        get_rendezvous_handler(RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 1, store_type="redis"))
    with pytest.raises(ValueError, match="read timeout must be a positive integer"):
        get_rendezvous_handler(RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 1, read_timeout=0))


FILE_NODE = """
import sys
from tdist.elastic.rendezvous import RendezvousParameters, get_rendezvous_handler
h = get_rendezvous_handler(RendezvousParameters("c10d", sys.argv[1], "job", 2, 2, store_type="file"))
info = h.next_rendezvous()
info.store.set(f"hello{info.rank}", b"x")
info.store.get(f"hello{1 - info.rank}")
print(info.rank, info.world_size, info.bootstrap_store_info.master_port)
h.shutdown()
"""


def test_c10d_on_a_file_store(tmp_path: Path) -> None:
    """``store_type=file``: the endpoint is the path of a FileStore the nodes (processes) share."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", FILE_NODE, str(tmp_path / "rdzv")], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=30)[0].split() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert sorted(o[:2] for o in outs) == [["0", "2"], ["1", "2"]] and outs[0][2] == outs[1][2], outs


def nodes(n: int, make: Callable[[], RendezvousHandler]) -> list[Any]:
    """``n`` nodes (threads) that each make a handler and join; their RendezvousInfo or error."""
    out: list[Any] = [None] * n

    def node(i: int) -> None:
        try:
            h = make()
            out[i] = (h, h.next_rendezvous())
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def check_round(results: list[Any], size: int) -> list[RendezvousInfo]:
    infos = [r[1] for r in results]
    assert sorted(i.rank for i in infos) == list(range(size))
    assert {i.world_size for i in infos} == {size}
    assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
    # the round's store is shared
    by_rank = {i.rank: i for i in infos}
    by_rank[0].store.set("hello", b"from 0")
    assert all(i.store.get("hello") == b"from 0" for i in infos)
    return infos


def test_static_rendezvous() -> None:
    port = free_port()
    ranks = iter([0, 1])
    lock = threading.Lock()

    def make() -> RendezvousHandler:
        with lock:
            rank = next(ranks)
        return get_rendezvous_handler(RendezvousParameters("static", f"127.0.0.1:{port}", "job", 2, 2, rank=rank))

    results = nodes(2, make)
    assert all(isinstance(r, tuple) for r in results), results
    infos = check_round(results, 2)
    assert {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos} == {("127.0.0.1", port)}
    h = results[0][0]
    assert h.get_backend() == "static" and not h.is_closed() and h.num_nodes_waiting() == 0 and h.use_agent_store


@pytest.fixture(params=["c10d", "etcd"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def endpoint(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "etcd":
        host, port = request.getfixturevalue("etcd_endpoint")
        return f"{host}:{port}"
    return f"127.0.0.1:{free_port()}"


SPARE = """
import sys
from tdist.elastic.rendezvous import RendezvousParameters, get_rendezvous_handler
backend, endpoint, run_id = sys.argv[1:]
h = get_rendezvous_handler(
    RendezvousParameters(backend, endpoint, run_id, 2, 3, local_addr="127.0.0.1", join_timeout=0.2)
)
try:
    h.next_rendezvous()  # (a spare waits on past join_timeout)
    print("joined")
except Exception as exc:
    print(type(exc).__name__)
"""


def test_a_full_round_closes_at_once(backend: str, endpoint: str, request: pytest.FixtureRequest) -> None:
    run_id = f"full-{request.node.name}-{time.time_ns()}"
    make = lambda: get_rendezvous_handler(  # noqa: E731
        RendezvousParameters(backend, endpoint, run_id, 2, 3, local_addr="127.0.0.1", last_call_timeout=30)
    )
    start = time.monotonic()
    results = nodes(3, make)
    assert all(isinstance(r, tuple) for r in results), results
    assert time.monotonic() - start < 10  # (max_nodes reached: no last call)
    infos = check_round(results, 3)
    assert {i.bootstrap_store_info.master_addr for i in infos} == {"127.0.0.1"}
    # rank 0 published MASTER_ADDR/MASTER_PORT in the round's store, as torch's
    assert {(i.store.get("MASTER_ADDR"), int(i.store.get("MASTER_PORT"))) for i in infos} == {
        (b"127.0.0.1", infos[0].bootstrap_store_info.master_port)
    }
    for h, _ in results:
        assert h.get_backend() == backend and h.get_run_id() == run_id
    # a fourth node, a process, comes while the round is full: a spare (torch's redundancy
    # list), not counted as waiting; closing lets it go with RendezvousGracefulExitError
    spare = subprocess.Popen(
        [sys.executable, "-c", SPARE, backend, endpoint, run_id],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    ordered = sorted(results, key=lambda r: r[1].rank, reverse=True)
    try:
        first = ordered[-1][0]
        wait_until(lambda: bool(first._read().wait_list) or spare.poll() is not None, 20, "the spare waits")
        assert first._read().wait_list and first.num_nodes_waiting() == 0
        ordered[0][0].shutdown()  # (it closes the rendezvous; rank 0 hosts the c10d store: last)
        out, _ = spare.communicate(timeout=20)
    finally:
        spare.kill()
        for h, _ in ordered[1:]:
            h.shutdown()
    assert out.strip() == "RendezvousGracefulExitError", out


def test_last_call_late_nodes_and_the_next_round(backend: str, endpoint: str, request: pytest.FixtureRequest) -> None:
    run_id = f"late-{request.node.name}-{time.time_ns()}"

    def make() -> RendezvousHandler:
        return get_rendezvous_handler(
            RendezvousParameters(backend, endpoint, run_id, 2, 4, local_addr="127.0.0.1", last_call_timeout=0.3)
        )

    # 2 of at most 4 come: the round closes after the last call, with 2
    first = nodes(2, make)
    assert all(isinstance(r, tuple) for r in first), first
    check_round(first, 2)
    # a third comes late: it waits, and the members see it waiting
    late: list[Any] = []
    t = threading.Thread(target=lambda: late.extend(nodes(1, make)))
    t.start()
    members = [h for h, _ in first]
    deadline = time.monotonic() + 10
    while members[0].num_nodes_waiting() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert members[0].num_nodes_waiting() == 1
    # the members start the next round, which admits it
    again = [None, None]

    def rejoin(i: int) -> None:
        again[i] = (members[i], members[i].next_rendezvous())  # type: ignore[call-overload]

    threads = [threading.Thread(target=rejoin, args=(i,)) for i in range(2)]
    threads[0].start()  # one member opens the next round first: it leaves the round, and waits
    deadline = time.monotonic() + 10
    while members[1].num_nodes_waiting() < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert members[1].num_nodes_waiting() == 2  # (the other sees that it must move on too)
    threads[1].start()
    for th in threads:
        th.join(30)
    t.join(30)
    assert isinstance(late[0], tuple), late
    check_round([*again, late[0]], 3)
    # closing ends it for everyone
    members[0].set_closed()
    assert members[1].is_closed()
    with pytest.raises(RendezvousClosedError):
        members[1].next_rendezvous()
    for h in [*members, late[0][0]]:
        h.shutdown()


def test_too_few_nodes_time_out(backend: str, endpoint: str, request: pytest.FixtureRequest) -> None:
    h = get_rendezvous_handler(
        RendezvousParameters(backend, endpoint, f"alone-{time.time_ns()}", 2, 2, join_timeout=0.5)
    )
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"1 of at least 2 nodes joined within 0\.5 s"):
        h.next_rendezvous()
    assert time.monotonic() - start < 5
    h.shutdown()


# -- torch's from_backend: the state in a user's RendezvousBackend ----------------------------
class DictBackend:
    """A user's own backend: a dict behind a lock (the token: a version number)."""

    name = "dict"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.record: tuple[bytes, int] | None = None

    def get_state(self) -> tuple[bytes, Any] | None:
        with self.lock:
            return self.record

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        with self.lock:
            current = None if self.record is None else self.record[1]
            if token == current:
                self.record = (state, 0 if current is None else current + 1)
                return (*self.record, True)
            return None if self.record is None else (*self.record, False)


def test_from_backend_over_a_users_backend_in_threads() -> None:
    """Two nodes (threads) meet through a user's ``RendezvousBackend``; a third that comes when
    the round is complete waits (``num_nodes_waiting``) until ``set_closed`` ends it."""
    from datetime import timedelta

    from tdist import HashStore
    from tdist.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousBackend,
        RendezvousTimeout,
    )

    RendezvousBackend.register(DictBackend)
    backend, store = DictBackend(), HashStore()
    timeout = RendezvousTimeout(last_call=timedelta(seconds=0.2))

    def make() -> DynamicRendezvousHandler:
        return DynamicRendezvousHandler.from_backend("job", store, backend, 2, 3, "127.0.0.1", timeout)  # type: ignore[arg-type]

    members = nodes(2, make)
    check_round(members, 2)
    assert members[0][0].get_backend() == "dict" and members[0][0].get_run_id() == "job"
    assert [k for k in store.list_keys() if k.endswith("hello")] == ["torch.rendezvous.job.0/hello"]  # (the user's store)
    late: list[Any] = []
    t = threading.Thread(target=lambda: late.append(nodes(1, make)[0]))
    t.start()
    wait_until(lambda: members[0][0].num_nodes_waiting() == 1, 10, "the late node waits")
    members[1][0].set_closed()
    t.join(10)
    assert isinstance(late[0], RendezvousClosedError) and members[0][0].is_closed(), late
    for h, _ in members:
        h.shutdown()


BACKEND_NODE = """
import sys
from datetime import timedelta
from tdist import TCPStore
from tdist.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from tdist.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from tdist.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout, create_handler
port, how = int(sys.argv[1]), sys.argv[2]
if how == "from_backend":  # (the module docstring's example)
    store = TCPStore("127.0.0.1", port, is_master=False)
    backend = C10dRendezvousBackend(store, "my_run_id")
    h = DynamicRendezvousHandler.from_backend(run_id="my_run_id", store=store, backend=backend, min_nodes=2,
        max_nodes=4, timeout=RendezvousTimeout(last_call=timedelta(seconds=0.3)))
else:
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "my_run_id", 2, 4, is_host=False, last_call_timeout=0.3)
    backend, store = create_backend(params)
    h = create_handler(store, backend, params)
info = h.next_rendezvous()
print(info.rank, info.world_size, h.get_backend(), flush=True)
if info.rank == 0:
    info.store.set("hello", b"from 0")
    info.store.wait(["done"])
    h.set_closed()
else:
    assert info.store.get("hello") == b"from 0"
    info.store.set("done", b"")
    try:
        h.next_rendezvous()
    except RendezvousClosedError:
        print("closed", flush=True)
h.shutdown()
"""


def test_from_backend_over_c10d_backend_in_processes() -> None:
    """torch's docstring example on two processes: a TCPStore, ``C10dRendezvousBackend`` and
    ``from_backend`` (the other through ``create_backend``/``create_handler``): ranks 0 and 1,
    the round's store shared, and ``set_closed`` ends the other's next round."""
    from tdist import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", BACKEND_NODE, str(server.port), how], stdout=subprocess.PIPE, text=True, env=env)
        for how in ("from_backend", "create_handler")
    ]
    try:
        outs = [p.communicate(timeout=30)[0].split() for p in procs]
    finally:
        for p in procs:
            p.kill()
        server.close()
    assert sorted(outs) == [["0", "2", "c10d"], ["1", "2", "c10d", "closed"]], outs
    assert all(p.returncode == 0 for p in procs)


def test_etcd_rendezvous_backend(etcd_endpoint: tuple[str, int]) -> None:
    """``etcd_rendezvous_backend.create_backend``: a backend in etcd (tdist's EtcdStore) whose
    fencing token guards the state, and the rounds' store."""
    from tdist.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    host, port = etcd_endpoint
    with pytest.raises(ValueError, match="not supported"):
        create_backend(RendezvousParameters("etcd-v2", f"{host}:{port}", "job", 1, 1, protocol="https"))
    params = RendezvousParameters("etcd-v2", f"{host}:{port}", f"job-{time.time_ns()}", 1, 1)
    backend, store = create_backend(params)
    assert backend.name == "etcd-v2" and backend.get_state() is None
    result = backend.set_state(b"one")
    assert result is not None and result[::2] == (b"one", True)
    assert backend.set_state(b"two", b"stale") == (b"one", result[1], False)
    store.set("k", b"v")
    assert store.get("k") == b"v"
