"""torch's elastic agent API on tdist (``tdist.elastic.agent.server``), as torch's docs use it:
a ``RendezvousParameters`` and a handler from the registry (or one of the user's own), a
``WorkerSpec``, ``LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs()).run()``. Real worker
processes over real sockets; the tests wait for what the workers and the agent do (files the
workers write, the rendezvous handler being asked), never for time to pass."""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from tdist.elastic.agent.server import (
    ElasticAgent,
    LocalElasticAgent,
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from tdist.elastic.agent.server.api import Worker
from tdist.elastic.multiprocessing import DefaultLogsSpecs, Std
from tdist.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    get_rendezvous_handler,
)
from tdist.store import HashStore
from tests._sync import wait_until

pytestmark = pytest.mark.timeout(120)

_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
)


# -- worker functions (module level: the workers import them) -------------------------------
def train(tag: str, marks: str) -> dict[str, Any]:
    """Fails on rank 1 in attempt 0; then joins the group (env://) and all-reduces its rank."""
    import torch

    import tdist

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    Path(marks, f"attempt{attempt}_rank{os.environ['RANK']}").touch()
    if attempt == "0" and os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails in attempt 0")
    tdist.init_process_group("gloo")
    t = torch.tensor([float(tdist.get_rank())])
    tdist.all_reduce(t)
    tdist.destroy_process_group()
    return {"tag": tag, "sum": float(t.item()), **{k: os.environ.get(k) for k in _ENV}}


def block(marks: str) -> None:
    """Says it started, then waits until the agent stops it."""
    Path(marks, f"started_{os.environ['RANK']}_{os.getpid()}").touch()
    threading.Event().wait()


def by_round(marks: str) -> str:
    """Round 1 of ``OwnHandler``: says it started and waits to be stopped; round 2: returns."""
    round_ = Path(marks, "round").read_text()
    if round_ == "1":
        block(marks)
    print("round", round_, flush=True)
    return f"round{round_}:{os.environ['RANK']}:{os.environ['TORCHELASTIC_RESTART_COUNT']}"


def _c10d(run_id: str, nodes: int = 1, endpoint: str = "127.0.0.1:0") -> RendezvousHandler:
    return get_rendezvous_handler(RendezvousParameters("c10d", endpoint, run_id, nodes, nodes, join_timeout=60))


# -- the API's objects -------------------------------------------------------------------
def test_worker_spec_checks_and_names_its_entrypoint_as_torchs() -> None:
    handler = HandlerOfMyOwn(Path("."))
    assert WorkerSpec("r", 1, handler, entrypoint=train).get_entrypoint_name() == "train"
    assert WorkerSpec("r", 1, handler, entrypoint="/usr/bin/trainer").get_entrypoint_name() == "trainer"
    with pytest.warns(DeprecationWarning):
        assert WorkerSpec("r", 1, handler, fn=train).entrypoint is train
    for bad in ({"local_world_size": 0}, {"monitor_interval": 0}, {"entrypoint": None}):
        with pytest.raises(AssertionError):
            WorkerSpec(**{"role": "r", "local_world_size": 1, "rdzv_handler": handler, "entrypoint": train, **bad})
    assert WorkerState.is_running(WorkerState.HEALTHY) and WorkerState.is_running(WorkerState.UNHEALTHY)
    assert not any(WorkerState.is_running(s) for s in (WorkerState.INIT, WorkerState.STOPPED, WorkerState.SUCCEEDED))
    assert WorkerState.FAILED == "FAILED" and RunResult(WorkerState.FAILED).is_failed()
    assert not RunResult(WorkerState.SUCCEEDED).is_failed()
    assert str(Worker(1, 3, 3, 4, 4)) == "local_rank=1,global_rank=3,role_rank=3,world_size=4,role_world_size=4"
    group = WorkerGroup(WorkerSpec("r", 2, handler, entrypoint=train))
    assert group.state is WorkerState.INIT and [w.local_rank for w in group.workers] == [0, 1]
    assert issubclass(LocalElasticAgent, SimpleElasticAgent) and issubclass(SimpleElasticAgent, ElasticAgent)


def test_ranks_are_assigned_as_torch_assigns_them_across_roles() -> None:
    from tdist.elastic.agent.server.api import assign_ranks

    # agents in group rank order: two trainers of 2 and 3 workers, a reader of 1 between them
    assert assign_ranks([("trainer", 2), ("reader", 1), ("trainer", 3)]) == [
        (0, 6, 0, 5), (2, 6, 0, 1), (3, 6, 2, 5),
    ]


# -- LocalElasticAgent -------------------------------------------------------------------
def test_local_agent_gives_torchs_environment_restarts_a_failed_group_and_returns_values_by_rank(tmp_path: Path) -> None:
    run_id = f"agent-{uuid.uuid4().hex[:8]}"
    handler = _c10d(run_id)
    spec = WorkerSpec("trainer", 2, handler, entrypoint=train, args=("w${local_rank}", str(tmp_path)), max_restarts=2)
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    try:
        result = agent.run()
    finally:
        assert not handler.is_closed()  # (the agent leaves the caller's handler open, as torch's)
        handler.shutdown()
    assert result is not None and result.state is WorkerState.SUCCEEDED and not result.failures
    assert os.listdir(tmp_path / "logs")  # (attempt 0's rank 0 may have been stopped before it got far)
    assert {"attempt0_rank1", "attempt1_rank0", "attempt1_rank1"} <= {p.name for p in tmp_path.glob("attempt*")}
    values = result.return_values
    assert sorted(values) == [0, 1]
    for rank, value in values.items():
        assert value["tag"] == f"w{rank}" and value["sum"] == 1.0  # (${local_rank}; 0 + 1 reduced)
        assert {k: value[k] for k in ("RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK")} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank), "GROUP_RANK": "0",
        }
        assert (value["WORLD_SIZE"], value["LOCAL_WORLD_SIZE"], value["ROLE_WORLD_SIZE"], value["GROUP_WORLD_SIZE"]) == ("2", "2", "2", "1")
        assert (value["ROLE_NAME"], value["TORCHELASTIC_RUN_ID"]) == ("trainer", run_id)
        assert (value["TORCHELASTIC_RESTART_COUNT"], value["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "2")
    group = agent.get_worker_group()
    assert group.state is WorkerState.SUCCEEDED and (group.group_rank, group.group_world_size) == (0, 1)
    assert (group.master_addr, str(group.master_port)) == (values[0]["MASTER_ADDR"], values[0]["MASTER_PORT"])
    assert [(w.local_rank, w.global_rank, w.world_size) for w in group.workers] == [(0, 0, 2), (1, 1, 2)]
    assert all(isinstance(w.id, int) for w in group.workers)  # (the workers' pids)
    assert agent._remaining_restarts == 1


def test_a_group_failing_past_max_restarts_names_each_failed_rank_with_its_process_failure(tmp_path: Path) -> None:
    # a program: rank 1 exits 3 in every attempt; rank 0 succeeds (and so is in neither map)
    code = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    handler = _c10d(f"agent-{uuid.uuid4().hex[:8]}")
    spec = WorkerSpec("trainer", 2, handler, entrypoint=sys.executable, args=("-c", code), max_restarts=1)
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    assert result is not None and result.is_failed() and result.return_values == {}
    assert sorted(result.failures) == [1]
    failure = result.failures[1]
    assert (failure.local_rank, failure.exitcode) == (1, 3) and failure.pid > 0
    assert agent.get_worker_group().state is WorkerState.FAILED and agent._remaining_restarts == 0
    # a function's exception comes back through its @record error file
    handler = _c10d(f"agent-{uuid.uuid4().hex[:8]}")
    spec = WorkerSpec("trainer", 2, handler, entrypoint=train, args=("x", str(tmp_path)), max_restarts=0)
    try:
        result = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path))).run()
    finally:
        handler.shutdown()
    assert result is not None and sorted(result.failures) == [1]
    assert result.failures[1].exitcode == 1 and "rank 1 fails in attempt 0" in str(result.failures[1].message)
    assert result.failures[1].error_file.endswith("error.json")


def test_a_signal_to_the_agent_stops_the_workers_and_raises_torchs_signal_exception(tmp_path: Path) -> None:
    handler = _c10d(f"agent-{uuid.uuid4().hex[:8]}")
    spec = WorkerSpec("trainer", 2, handler, entrypoint=block, args=(str(tmp_path),), max_restarts=3)
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull), shutdown_timeout=10)
    before = signal.getsignal(signal.SIGTERM)

    def started() -> list[Path]:
        return list(tmp_path.glob("started_*"))

    def stop_when_started() -> None:
        wait_until(lambda: len(started()) == 2, 60, "both workers started")
        os.kill(os.getpid(), signal.SIGTERM)  # (the agent's handler, in this main thread, takes it)

    killer = threading.Thread(target=stop_when_started, daemon=True)
    killer.start()
    try:
        with pytest.raises(SignalException) as info:
            agent.run()
    finally:
        killer.join(60)
        handler.shutdown()
    assert info.value.sigval == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # (the agent's handler is gone)
    for path in started():  # every worker was stopped (and reaped) before run() returned
        pid = int(path.name.rsplit("_", 1)[1])
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert agent.get_worker_group().state is WorkerState.STOPPED


class HandlerOfMyOwn(RendezvousHandler):
    """A user's handler: one node, a store in this process; it says a node waits (once) when
    the first round's workers have started, and tells the workers their round in a file."""

    def __init__(self, marks: Path) -> None:
        self.marks, self.rounds, self.told, self.shut = marks, 0, False, False
        self.store = HashStore()

    def get_backend(self) -> str:
        return "mine"

    def next_rendezvous(self) -> RendezvousInfo:
        self.rounds += 1
        (self.marks / "round").write_text(str(self.rounds))
        boot = RendezvousStoreInfo.build(0, self.store, "127.0.0.1")
        return RendezvousInfo(self.store, 0, 1, boot)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        if self.rounds == 1 and not self.told and len(list(self.marks.glob("started_*"))) == 2:
            self.told = True
            return 1
        return 0

    def get_run_id(self) -> str:
        return "mine"

    def shutdown(self) -> bool:
        self.shut = True
        return True


def test_a_users_own_handler_is_driven_and_nodes_waiting_restart_the_group_without_spending_a_restart(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    handler = HandlerOfMyOwn(tmp_path)
    spec = WorkerSpec("trainer", 2, handler, entrypoint=by_round, args=(str(tmp_path),), max_restarts=0, monitor_interval=0.05)
    # (the template is the prefix of the teed streams' lines, as torch's: stdout here)
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=Std.OUT)
    agent = LocalElasticAgent(spec, logs_specs=logs, log_line_prefix_template="[${role_name}-${rank}]:")
    result = agent.run()
    assert result is not None and result.state is WorkerState.SUCCEEDED
    # round 2 after the membership change; no restart spent (max_restarts 0: none to spend)
    assert result.return_values == {0: "round2:0:0", 1: "round2:1:0"}
    assert handler.rounds == 2 and not handler.shut  # (the caller's to shut down, as in torch)
    assert agent.get_worker_group().store is handler.store
    out = capfd.readouterr().out.splitlines()
    assert sorted(line for line in out if "round 2" in line) == ["[trainer-0]:round 2", "[trainer-1]:round 2"]


def test_two_agents_meet_in_one_c10d_rendezvous_and_their_workers_form_one_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDIST_SECRET", uuid.uuid4().hex)  # (several nodes: one shared secret)
    from tdist.elastic.utils.distributed import get_free_port

    endpoint, run_id = f"127.0.0.1:{get_free_port()}", f"agent-{uuid.uuid4().hex[:8]}"
    handlers = [_c10d(run_id, 2, endpoint) for _ in range(2)]  # (the first hosts the store: node 0)
    results: list[RunResult | None] = [None, None]
    errors: list[BaseException] = []

    def node(i: int) -> None:
        spec = WorkerSpec("trainer", 1, handlers[i], entrypoint=train, args=(f"node{i}", str(tmp_path)), max_restarts=1)
        try:
            results[i] = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull)).run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    for h in reversed(handlers):
        h.shutdown()
    assert not errors and all(r is not None and r.state is WorkerState.SUCCEEDED for r in results)
    values = {rank: v for r in results if r is not None for rank, v in r.return_values.items()}
    assert sorted(values) == [0, 1]  # (rank 1 failed in attempt 0: both nodes restarted together)
    for rank, value in values.items():
        assert (value["WORLD_SIZE"], value["GROUP_WORLD_SIZE"], value["GROUP_RANK"], value["LOCAL_RANK"]) == ("2", "2", str(rank), "0")
        assert value["sum"] == 1.0 and value["TORCHELASTIC_RESTART_COUNT"] == "1"


def test_the_static_handler_serves_the_workers_from_its_own_store(tmp_path: Path) -> None:
    from tdist.elastic.utils.distributed import get_free_port

    port = get_free_port()
    params = RendezvousParameters("static", f"127.0.0.1:{port}", f"agent-{uuid.uuid4().hex[:8]}", 1, 1, rank=0)
    handler = get_rendezvous_handler(params)
    assert handler.use_agent_store
    spec = WorkerSpec("trainer", 2, handler, entrypoint=train, args=("s", str(tmp_path)), max_restarts=1)
    result = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull)).run()
    assert result is not None and result.state is WorkerState.SUCCEEDED
    assert [v["sum"] for v in result.return_values.values()] == [1.0, 1.0]  # (they met in the handler's store)
    assert {v["TORCHELASTIC_RESTART_COUNT"] for v in result.return_values.values()} == {"1"}


class AgentOfMyOwn(SimpleElasticAgent):
    """torch's scaffolding with hooks of a test's own: the group fails once, then succeeds."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, exit_barrier_timeout=10)
        self.states = [WorkerState.FAILED, WorkerState.HEALTHY, WorkerState.SUCCEEDED]
        self.calls: list[str] = []

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.calls.append("start")
        return {w.local_rank: f"w{w.global_rank}" for w in worker_group.workers}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self.calls.append("stop")

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        state = self.states.pop(0)
        return RunResult(state, return_values={0: "done"} if state is WorkerState.SUCCEEDED else {})

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self.calls.append(f"shutdown {death_sig.name}")


def test_simple_elastic_agent_is_torchs_scaffolding_for_an_agent_of_ones_own(tmp_path: Path) -> None:
    handler = HandlerOfMyOwn(tmp_path)
    spec = WorkerSpec("reader", 2, handler, entrypoint=train, max_restarts=1, monitor_interval=0.01, master_port=1234)
    agent = AgentOfMyOwn(spec)
    result = agent.run()
    assert result is not None and result.return_values == {0: "done"} and not result.is_failed()
    assert agent.calls == ["start", "stop", "start", "shutdown SIGTERM"] and handler.rounds == 2
    group = agent.get_worker_group()
    assert group.state is WorkerState.SUCCEEDED and group.master_port == 1234 and group.master_addr == "127.0.0.1"
    assert [(w.id, w.global_rank, w.role_rank, w.role_world_size) for w in group.workers] == [("w0", 0, 0, 2), ("w1", 1, 1, 2)]
    assert agent._remaining_restarts == 0


class _Events(__import__("logging").Handler):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: Any) -> None:
        import json

        self.names.append(json.loads(record.getMessage())["name"].rsplit(".", 1)[-1])


def test_a_program_gives_each_rank_none_and_the_specs_event_handler_gets_torchs_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tdist.elastic.events import _api as events_api

    seen = _Events()
    monkeypatch.setattr(events_api, "_events_loggers", {})
    monkeypatch.setitem(events_api._log_handlers, "test", seen)
    params = RendezvousParameters("static", "127.0.0.1:0", f"agent-{uuid.uuid4().hex[:8]}", 1, 1, rank=0)
    spec = WorkerSpec(
        "trainer", 2, get_rendezvous_handler(params), entrypoint=sys.executable,
        args=("-c", "pass"), event_log_handler="test",
    )
    try:
        result = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull)).run()
    finally:
        __import__("logging").getLogger("tdist-events-test").handlers.clear()
    assert result is not None and result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: None, 1: None}  # (torch's: each rank, no value)
    assert seen.names[:2] == ["RENDEZVOUS", "ASSIGN_WORKER_RANKS"]
    assert sorted(seen.names[2:]) == ["START", "START", "SUCCEEDED", "SUCCEEDED"]


def test_shutdown_from_another_thread_stops_the_running_workers(tmp_path: Path) -> None:
    handler = _c10d(f"agent-{uuid.uuid4().hex[:8]}")
    spec = WorkerSpec("trainer", 2, handler, entrypoint=block, args=(str(tmp_path),), max_restarts=3)
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull), shutdown_timeout=10)
    agent._shutdown()  # (no group yet: nothing)
    assert agent._monitor_workers(agent.get_worker_group()).state is WorkerState.INIT

    seen: dict[str, Any] = {}

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop_when_started() -> None:
        wait_until(lambda: len(list(tmp_path.glob("started_*"))) == 2, 60, "both workers started")
        seen["state"] = agent._monitor_workers(agent.get_worker_group()).state
        agent._shutdown(signal.SIGTERM)  # (returns once run() has stopped them: as torch's)
        seen["alive"] = [alive(int(p.name.rsplit("_", 1)[1])) for p in tmp_path.glob("started_*")]

    stopper = threading.Thread(target=stop_when_started, daemon=True)
    stopper.start()
    try:
        with pytest.raises(SignalException) as info:
            agent.run()
    finally:
        stopper.join(60)
        handler.shutdown()
    assert info.value.sigval == signal.SIGTERM
    assert seen == {"state": WorkerState.HEALTHY, "alive": [False, False]}
