"""torchrun's programmatic interface on tdist's launcher, as a program calls it:
``tdist.launcher.api.elastic_launch`` (functions and programs, real worker processes) and
``tdist.run``'s ``get_args_parser``/``config_from_args``/``run``/``main``."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import tdist.run as tdist_run
from tdist.elastic.multiprocessing.errors import record
from tdist.launcher.api import LaunchConfig, elastic_launch

pytestmark = pytest.mark.timeout(120)


def reduce_ranks(scale: float) -> float:
    """A worker: joins the job's group (env://, as under torchrun) and sums the ranks + 1."""
    import torch

    import tdist

    tdist.init_process_group("gloo")
    t = torch.ones(1) * (tdist.get_rank() + 1)
    tdist.all_reduce(t)
    tdist.destroy_process_group()
    return float(t.item()) * scale


def fail_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    return 0


def no_value_in_its_second_attempt(tag: str) -> str:
    """Rank 1 fails in attempt 0; in attempt 1, rank 0 ends its process without a value."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if os.environ["RANK"] == "1" and attempt == "0":
        raise SystemExit(3)
    if os.environ["RANK"] == "0" and attempt == "1":
        os._exit(0)
    return f"{tag}{os.environ['RANK']}-{attempt}"


def _config(**kw: object) -> LaunchConfig:
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                        rdzv_endpoint="127.0.0.1:0", max_restarts=0, run_id="api", **kw)  # type: ignore[arg-type]


def test_elastic_launch_returns_each_workers_value_by_rank_and_runs_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = signal.getsignal(signal.SIGINT)
    assert elastic_launch(_config(), reduce_ranks)(2.0) == {0: 6.0, 1: 6.0}
    out = elastic_launch(_config(), sys.executable)("-c", "import os; assert os.environ['WORLD_SIZE'] == '2'")
    assert out == {0: None, 1: None}
    assert signal.getsignal(signal.SIGINT) is before  # (the launcher's handlers are gone)
    # the temporary log directories that the default logs specs made held nothing: gone (torch's
    # stay); what is left is the registry of running jobs (`tdist status`'s), empty
    assert [p.name for p in tmp_path.iterdir()] == [f"tdist-jobs-{os.getuid()}"]
    assert not list((tmp_path / f"tdist-jobs-{os.getuid()}").iterdir())


def test_a_worker_that_wrote_no_value_in_the_last_attempt_has_none_not_an_earlier_one() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=1, run_id="api")
    assert elastic_launch(config, no_value_in_its_second_attempt)("r") == {0: None, 1: "r1-1"}


def test_one_node_naming_no_port_gets_a_free_one_as_torchruns_run_gives_it(tmp_path: Path) -> None:
    import socket

    script = tmp_path / "job.py"
    script.write_text("import os\nassert os.environ['WORLD_SIZE'] == '2'\n")
    held = socket.socket()
    try:  # (29500, torchrun's default port, busy: held here, or by someone else already)
        held.bind(("127.0.0.1", 29500))
        held.listen()
    except OSError:
        pass
    try:
        tdist_run.main(["--nproc-per-node", "2", str(script)])
    finally:
        held.close()


def test_the_log_line_prefix_template_comes_from_torchruns_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${role_name}-${rank}]")
    config, _, _ = tdist_run.config_from_args(tdist_run.parse_args(["--standalone", "x.py"]))
    assert config.log_line_prefix_template == "[${role_name}-${rank}]"


def test_config_from_args_gives_several_workers_one_omp_thread_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # (as torchrun's: the launcher's own environment, which every worker inherits, with a warning)
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # (so that the test's end restores the original)
    monkeypatch.delenv("OMP_NUM_THREADS")
    tdist_run.config_from_args(tdist_run.parse_args(["--nproc-per-node", "1", "x.py"]))
    assert "OMP_NUM_THREADS" not in os.environ and not caplog.records
    with caplog.at_level("WARNING", logger="tdist.run"):
        tdist_run.config_from_args(tdist_run.parse_args(["--nproc-per-node", "2", "x.py"]))
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert [r.getMessage()[:33] for r in caplog.records] == ["OMP_NUM_THREADS is not set: each "]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    caplog.clear()
    tdist_run.config_from_args(tdist_run.parse_args(["--nproc-per-node", "2", "x.py"]))
    assert os.environ["OMP_NUM_THREADS"] == "4" and not caplog.records


def test_nproc_per_node_auto_is_a_worker_per_accelerator_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from tdist.cli import build_parser

    assert tdist_run.determine_local_world_size("auto") == (os.cpu_count() or 1)  # (no accelerator here)
    # (as torchrun's: torch's current accelerator's devices, where it has one)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 3)
    assert tdist_run.determine_local_world_size("auto") == 3
    assert build_parser().parse_args(["run", "--nproc-per-node", "auto", "x.py"]).nproc_per_node == 3
    assert tdist_run.determine_local_world_size("cpu") == (os.cpu_count() or 1)


def test_torchruns_helpers() -> None:
    # (torch.distributed.run's functions that wrappers call, with torch's results and errors)
    assert tdist_run.parse_min_max_nnodes("2") == (2, 2) and tdist_run.parse_min_max_nnodes("1:4") == (1, 4)
    with pytest.raises(RuntimeError, match='nnodes=1:2:3 is not in "MIN:MAX" format'):
        tdist_run.parse_min_max_nnodes("1:2:3")
    assert tdist_run.determine_local_world_size("3") == 3
    assert tdist_run.determine_local_world_size("cpu") == tdist_run.determine_local_world_size("auto") >= 1
    with pytest.raises(ValueError, match="Unsupported nproc_per_node value: many"):
        tdist_run.determine_local_world_size("many")
    static = tdist_run.parse_args(["--master-addr", "h", "--master-port", "7", "x.py"])
    assert tdist_run.get_rdzv_endpoint(static) == "h:7" and tdist_run.get_use_env(static)
    c10d = tdist_run.parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "e:9", "x.py"])
    assert tdist_run.get_rdzv_endpoint(c10d) == "e:9"


def test_a_failed_worker_raises_torchs_child_failed_error_and_record_passes_its_error_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The failure report is the exception's words, printed by nothing else (as torch's: a
    program that catches the error prints no report; uncaught, Python prints it once)."""
    mine = tmp_path / "launcher_error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    # (the run's log directory keeps the worker's error file, as torchrun's does: in tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    @record
    def launcher() -> None:
        elastic_launch(_config(), fail_on_rank_one)()

    with pytest.raises(ChildFailedError) as info:
        launcher()
    rank, failure = info.value.get_first_failure()
    assert (rank, failure.local_rank, failure.exitcode) == (1, 1, 1)
    assert "rank one fails" in str(failure.message) and "fail_on_rank_one" in str(info.value)
    assert "Root Cause" in str(info.value) and "Root Cause" not in capfd.readouterr().err
    # the root cause's error file, as this process's, with the worker's exit code
    data = json.loads(mine.read_text())
    assert data["message"]["errorCode"] == 1 and "rank one fails" in data["message"]["message"]
    # the temporary log directory stays, for the worker's error file that the report names
    (kept,) = tmp_path.glob("torchelastic_*/api_*/attempt_0/1/error.json")
    assert "rank one fails" in kept.read_text()


def test_a_launch_config_without_logs_specs_gets_torchs_default() -> None:
    from tdist.elastic.multiprocessing import DefaultLogsSpecs

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert isinstance(config.logs_specs, DefaultLogsSpecs) and os.path.isdir(config.logs_specs.root_log_dir)
    os.rmdir(config.logs_specs.root_log_dir)


def test_torchruns_functions_parse_its_options_and_run_the_job(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nassert sys.argv[1:] == ['--lr', '0.1'] and os.environ['LOCAL_WORLD_SIZE'] == '2'\n")
    ns = tdist_run.parse_args(["--nproc_per_node", "2", "--standalone", str(script), "--lr", "0.1"])
    assert (ns.training_script, ns.training_script_args, ns.nproc_per_node, ns.nnodes) == (
        str(script), ["--lr", "0.1"], "2", "1:1")
    config, cmd, args = tdist_run.config_from_args(ns)
    assert (config.rdzv_backend, config.min_nodes, config.max_nodes, config.nproc_per_node) == ("c10d", 1, 1, 2)
    assert (cmd, args) == (sys.executable, ["-u", str(script), "--lr", "0.1"])
    tdist_run.run(ns)
    assert isinstance(tdist_run.get_args_parser().parse_args(["x.py"]).rdzv_id, str)
    script.write_text("raise SystemExit(3)\n")
    with pytest.raises(ChildFailedError) as info:
        tdist_run.main(["--nproc-per-node", "1", "--standalone", str(script)])
    assert info.value.get_first_failure()[1].exitcode == 3


def test_logs_specs_send_the_workers_streams_to_torchs_layout(tmp_path: Path) -> None:
    from tdist.elastic.multiprocessing import DefaultLogsSpecs, Std

    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.OUT)
    out = elastic_launch(_config(logs_specs=specs), sys.executable)("-c", "import os; print('hello from', os.environ['RANK'])")
    assert out == {0: None, 1: None}
    (run_dir,) = (tmp_path / "logs").iterdir()
    for rank in (0, 1):
        assert (run_dir / "attempt_0" / str(rank) / "stdout.log").read_text().strip() == f"hello from {rank}"


def test_the_legacy_launcher_gives_each_worker_its_local_rank_argument(tmp_path: Path) -> None:
    import tdist.launch

    script = tmp_path / "legacy.py"
    script.write_text(
        "import argparse, os\n"
        "p = argparse.ArgumentParser(); p.add_argument('--local-rank', '--local_rank', type=int); p.add_argument('--lr')\n"
        "a = p.parse_args()\n"
        "assert a.local_rank == int(os.environ['LOCAL_RANK']) and a.lr == '0.1', a\n"
    )
    with pytest.warns(FutureWarning, match="deprecated"):
        tdist.launch.main(["--nproc_per_node", "2", "--master_port", "0", str(script), "--lr", "0.1"])
    with pytest.warns(FutureWarning), pytest.raises(ChildFailedError):  # (--use-env: LOCAL_RANK only)
        tdist.launch.main(["--nproc_per_node", "1", "--use_env", "--master_port", "0", str(script), "--lr", "0.1"])
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="--use-env"):
        tdist.launch.main(["--no-python", "--master_port", "0", "true"])


def test_numa_binding_takes_torchruns_modes_alone() -> None:
    """``--numa-binding``: torchrun's modes (accepted, nothing to bind on CPU workers); another
    value is a usage error, on ``tdist.run``'s parser and on the ``tdist run`` command."""
    from tdist.cli import build_parser

    assert tdist_run.parse_args(["--numa-binding", "socket", "x.py"]).numa_binding == "socket"
    for parse in (lambda a: tdist_run.parse_args(a), lambda a: build_parser().parse_args(["run", *a])):
        with pytest.raises(SystemExit) as info:
            parse(["--numa-binding", "bogus", "x.py"])
        assert info.value.code == 2
