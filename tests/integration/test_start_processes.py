"""``tdist.elastic.multiprocessing.start_processes`` with real processes: functions and programs,
their results and failures, where their streams go, signals, and that nothing outlives its
parent. Where it is cheap, the same case runs on torch's ``start_processes`` too and the two
results are compared."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import api as torch_api
from torch.distributed.elastic.multiprocessing import start_processes as torch_start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchProcessFailure

from tdist.elastic import multiprocessing as mp
from tdist.elastic.multiprocessing import (
    DefaultLogsSpecs,
    MultiprocessContext,
    SignalException,
    Std,
    SubprocessContext,
    start_processes,
)

from .._sync import read_line

pytestmark = pytest.mark.timeout(90)

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_GONE_WITHIN = 20.0  # seconds a process may take to go once it should


# -- the workers (module functions: a new interpreter imports them by name) ---------------------
def double_and_say(x: int) -> int:
    print(f"out {x} {os.environ['COLOR']}", flush=True)
    print(f"err {x}", file=sys.stderr, flush=True)
    return x * 2


def fail_on_one(x: int) -> int:
    if x == 1:
        raise ValueError(f"bad value {x}")
    signal.pause()  # (until the failure of the other stops it)
    return x


def say_ready_and_block(fifo: str) -> None:
    with open(fifo, "w") as f:
        f.write(f"{os.getpid()}\n")
    signal.pause()


# -- helpers ------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _signal_handlers() -> Iterator[None]:
    """``start()`` installs handlers that raise ``SignalException`` and, as torch's, leaves
    them: each test gets the previous ones back."""
    before = {s: signal.getsignal(s) for s in _HANDLED}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _gone(pid: int, timeout: float = _GONE_WITHIN) -> bool:
    """Whether process ``pid`` (not ours to reap) is gone within ``timeout`` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))
    finally:
        os.close(fd)


def _read_lines(fifo: str, n: int, timeout: float = 30.0) -> list[str]:
    """The first ``n`` lines written to ``fifo`` (by any number of writers), within ``timeout``."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    keep_open = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # (so a writer that closes is no end)
    deadline = time.monotonic() + timeout
    data = b""
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while data.count(b"\n") < n:
            if not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"{fifo}: not {n} lines within {timeout} s: {data!r}")
            data += os.read(fd, 4096)
    finally:
        os.close(keep_open)
        os.close(fd)
    return data.decode().splitlines()[:n]


def _envs(n: int, **extra: str) -> dict[int, dict[str, str]]:
    return {r: {"LOCAL_RANK": str(r), **extra} for r in range(n)}


def _program(code: str) -> tuple[str, tuple[str, ...]]:
    return sys.executable, ("-c", textwrap.dedent(code))


# -- results ------------------------------------------------------------------------------------
def test_a_function_returns_each_ranks_value_and_its_streams_go_to_the_attempts_files(tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL)
    envs = _envs(2, COLOR="blue", TORCHELASTIC_RUN_ID="job", TORCHELASTIC_RESTART_COUNT="3")
    ctx = start_processes("trainer", double_and_say, {0: (10,), 1: (20,)}, envs, specs)
    try:
        assert isinstance(ctx, MultiprocessContext) and set(ctx.pids()) == {0, 1}
        result = ctx.wait(timeout=60)
    finally:
        ctx.close()
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: 20, 1: 40}
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert run_dir.name.startswith("job_")
    for r, x in ((0, 10), (1, 20)):
        rank_dir = run_dir / "attempt_3" / str(r)
        assert result.stdouts[r] == str(rank_dir / "stdout.log") and result.stderrs[r] == str(rank_dir / "stderr.log")
        assert (rank_dir / "stdout.log").read_text() == f"out {x} blue\n"
        assert (rank_dir / "stderr.log").read_text() == f"err {x}\n"
        assert envs[r]["TORCHELASTIC_ERROR_FILE"] == str(rank_dir / "error.json")  # (reify sets it)
        assert not (rank_dir / "error.json").exists()
    assert ctx.wait(0) is result  # (a finished context keeps its result)


def test_a_program_runs_with_string_arguments_and_tee_prints_prefixed_lines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), tee={0: Std.OUT, 1: Std.ALL}, redirects={2: Std.ERR},
                             local_ranks_filter={0, 1})
    exe, code = _program("""
        import os, sys
        print("out", *sys.argv[1:], flush=True)
        print("err", os.environ["LOCAL_RANK"], file=sys.stderr, flush=True)
    """)
    ctx = start_processes("echo", exe, {r: (*code, r, "x") for r in range(3)}, _envs(3), specs,
                          log_line_prefixes={1: "<one> "})
    try:
        assert isinstance(ctx, SubprocessContext)
        result = ctx.wait(60)
    finally:
        ctx.close()
    assert result is not None and result.return_values == {0: None, 1: None, 2: None} and not result.failures
    out, err = capfd.readouterr()
    # rank 0: its stdout teed (file and console, behind its header), its stderr on the console as
    # it is; rank 1: both teed behind its own prefix; rank 2 (filtered out): stderr to its file,
    # stdout nowhere
    assert sorted(out.splitlines()) == ["<one> out 1 x", "[echo0]:out 0 x"]
    assert sorted(line for line in err.splitlines() if line.startswith(("err", "<one>"))) == ["<one> err 1", "err 0"]
    assert Path(result.stdouts[0]).read_text() == "out 0 x\n" and result.stderrs[0] == ""
    assert Path(result.stderrs[1]).read_text() == "err 1\n"
    assert result.stdouts[2] == os.devnull and Path(result.stderrs[2]).read_text() == "err 2\n"


def test_duplicate_filters_gather_the_teed_lines_that_match(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.OUT)
    exe, code = _program("print('loss 1'); print('noise'); print('loss 2')")
    ctx = start_processes("t", exe, {0: code, 1: code}, _envs(2), specs, duplicate_stdout_filters=["loss"])
    try:
        assert ctx.wait(60) is not None
    finally:
        ctx.close()
    capfd.readouterr()
    assert ctx.filtered_stdout is not None and ctx.filtered_stdout.closed
    lines = Path(ctx.filtered_stdout.name).read_text().splitlines()
    assert sorted(lines) == ["[t0]:loss 1", "[t0]:loss 2", "[t1]:loss 1", "[t1]:loss 2"]


def test_log_dir_devnull_sends_everything_to_the_console_and_writes_no_error_file(capfd: pytest.CaptureFixture[str]) -> None:
    specs = DefaultLogsSpecs(log_dir=os.devnull, redirects=Std.ALL)
    exe, code = _program("import os; print('err file:', repr(os.environ['TORCHELASTIC_ERROR_FILE']))")
    ctx = start_processes("n", exe, {0: code}, {0: {}}, specs)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close()
    assert result is not None and result.stdouts == {0: ""} and result.stderrs == {0: ""}
    assert "err file: ''" in capfd.readouterr().out


@pytest.mark.parametrize(
    ("redirects", "tee", "ranks_filter"),
    [(Std.NONE, Std.NONE, None), (Std.ALL, {1: Std.ERR}, None), ({0: Std.OUT}, Std.ERR, {1}), (Std.ERR, Std.OUT, {0, 2}),
     ({0: 2, 2: 3}, {0: 1}, None)],  # (plain ints, as torch's IntFlag takes them)
)
def test_reify_lays_out_the_destinations_as_torchs(
    tmp_path: Path, redirects: Any, tee: Any, ranks_filter: set[int] | None
) -> None:
    def relative(dest: Any, root: Path) -> dict[str, Any]:
        (run_dir,) = root.iterdir()
        strip = {str(run_dir): "<run>"}

        def rel(p: str) -> str:
            return next((p.replace(k, v) for k, v in strip.items() if p.startswith(k)), p)

        fields = ("stdouts", "stderrs", "tee_stdouts", "tee_stderrs", "error_files")
        out: dict[str, Any] = {f: {r: rel(p) for r, p in getattr(dest, f).items()} for f in fields}
        out["filtered"] = (rel(dest.filtered_stdout), rel(dest.filtered_stderr))
        return out

    results = []
    def torchs(v: Any) -> Any:  # (torch's Std is a class of its own)
        return {r: torch_api.Std(int(s)) for r, s in v.items()} if isinstance(v, dict) else torch_api.Std(int(v))

    for name, cls, std in (("ours", DefaultLogsSpecs, lambda v: v), ("torch", torch_api.DefaultLogsSpecs, torchs)):
        root = tmp_path / name
        envs = _envs(3, TORCHELASTIC_RUN_ID="r", TORCHELASTIC_RESTART_COUNT="1")
        dest = cls(log_dir=str(root), redirects=std(redirects), tee=std(tee), local_ranks_filter=ranks_filter).reify(envs)
        results.append((relative(dest, root), {r: e["TORCHELASTIC_ERROR_FILE"].replace(str(root), "") for r, e in envs.items()}))
    ours, theirs = results
    assert ours[0] == theirs[0]
    assert [Path(p).parts[2:] for p in ours[1].values()] == [Path(p).parts[2:] for p in theirs[1].values()]


# -- failures -----------------------------------------------------------------------------------
def _failure_fields(f: Any) -> tuple[Any, ...]:
    message = f.message["message"] if isinstance(f.message, dict) else f.message
    return (f.local_rank, f.exitcode, os.path.basename(f.error_file), message)


@pytest.mark.slow
def test_a_failed_function_reports_its_first_failure_with_its_recorded_error_as_torchs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (torch's leaves its error files there)
    outcomes = []
    for name, start in (("ours", start_processes), ("torch", torch_start_processes)):
        specs = (DefaultLogsSpecs if name == "ours" else torch_api.DefaultLogsSpecs)(log_dir=str(tmp_path / name))
        ctx = start("fail", fail_on_one, {0: (0,), 1: (1,)}, _envs(2), specs)
        try:
            result = ctx.wait(60)
        finally:
            ctx.close(timeout=10)
        assert result is not None and result.is_failed() and result.return_values == {}
        outcomes.append({r: _failure_fields(f) for r, f in result.failures.items()})
        assert all(isinstance(f, TorchProcessFailure) for f in result.failures.values())
    ours, theirs = outcomes
    # only the first failure: rank 1's exception, from the error file that @record wrote
    assert ours == theirs == {1: (1, 1, "error.json", "ValueError: bad value 1")}


def test_a_failed_program_reports_every_process_that_did_not_exit_0_as_torchs(tmp_path: Path) -> None:
    exe, code = _program("""
        import os, signal, sys
        if sys.argv[1] == "1":
            sys.exit(7)
        signal.pause()
    """)
    outcomes = []
    for name, start in (("ours", start_processes), ("torch", torch_start_processes)):
        specs = (DefaultLogsSpecs if name == "ours" else torch_api.DefaultLogsSpecs)(log_dir=str(tmp_path / name))
        ctx = start("prog", exe, {0: (*code, 0), 1: (*code, 1)}, _envs(2), specs)
        try:
            result = ctx.wait(60)
        finally:
            ctx.close(timeout=10)
        assert result is not None and result.return_values == {}
        outcomes.append({r: (f.exitcode, f.error_file) for r, f in result.failures.items()})
    ours, theirs = outcomes
    # the failure and the one stopped because of it (SIGTERM), with no error files
    assert ours == theirs == {0: (-signal.SIGTERM, "<N/A>"), 1: (7, "<N/A>")}


def test_wait_times_out_and_close_kills_the_whole_session_of_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    fifo = str(tmp_path / "ready")
    os.mkfifo(fifo)
    exe, code = _program(f"""
        import os, signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pause()"])
        with open({fifo!r}, "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}\\n")
        signal.pause()
    """)
    ctx = start_processes("stubborn", exe, {0: code}, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    try:
        (line,) = _read_lines(fifo, 1)
        pid, grandchild = map(int, line.split())
        assert ctx.pids() == {0: pid}
        assert ctx.wait(timeout=0.2, period=0.05) is None and ctx.wait(0) is None
        ctx.close(timeout=1)  # (SIGTERM is ignored: SIGKILL after a second)
    finally:
        ctx.close(timeout=1)
    assert _gone(grandchild)
    result = ctx.wait(0)
    assert result is not None and {r: f.exitcode for r, f in result.failures.items()} == {0: -signal.SIGKILL}


def test_a_handled_signal_raises_signal_exception_and_close_passes_it_on(tmp_path: Path) -> None:
    fifo = str(tmp_path / "ready")
    os.mkfifo(fifo)
    # the worker tells when it handles SIGINT, then signals its parent (this process)
    exe, code = _program(f"""
        import os, signal, sys
        signal.signal(signal.SIGINT, lambda *a: sys.exit(42))
        with open({fifo!r}, "w") as f:
            f.write("ready\\n")
        os.kill(os.getppid(), signal.SIGINT)
        signal.pause()
    """)
    contexts = []
    with pytest.raises(SignalException) as info:
        contexts.append(start_processes("sig", exe, {0: code}, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / "l"))))
        _read_lines(fifo, 1)
        contexts[0].wait(60)
    assert info.value.sigval == signal.SIGINT and isinstance(info.value, torch_api.SignalException)
    assert mp.SignalException is torch_api.SignalException
    if contexts:
        (ctx,) = contexts
        ctx.close(info.value.sigval, timeout=10)
        result = ctx.wait(0)
        assert result is not None and result.failures[0].exitcode == 42  # (its SIGINT handler ran)


def test_arguments_must_name_every_local_rank_and_the_start_method_must_exist(tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path))
    for start in (start_processes, torch_start_processes):
        with pytest.raises(RuntimeError, match=r"envs, local rank mapping mismatch, expected: \{0, 1\}, actual: \{0\}"):
            start("x", "true", {0: (), 1: ()}, {0: {}}, specs)  # type: ignore[operator]
    with pytest.raises(ValueError, match="cannot find context for 'threads'"):
        start_processes("x", double_and_say, {0: (1,)}, {0: {}}, specs, start_method="threads")
    with pytest.raises(FileNotFoundError):
        start_processes("x", str(tmp_path / "no-such-program"), {0: ()}, {0: {}}, specs)
    with pytest.raises(AttributeError, match="importable by name"):
        start_processes("x", lambda: 1, {0: ()}, {0: {}}, specs, start_method="fork")
    unstarted = SubprocessContext("x", "true", {0: ()}, {0: {}}, specs)
    with pytest.raises(RuntimeError, match="not started"):
        unstarted.wait(0)
    unstarted.close()
    assert unstarted.pids() == {}


# -- no orphans ---------------------------------------------------------------------------------
def test_processes_started_from_a_thread_outlive_it(tmp_path: Path) -> None:
    """The parent-death signal follows the thread that forked: a short-lived thread must not
    take the processes it started along when it ends."""
    started: list[Any] = []
    t = threading.Thread(target=lambda: started.append(start_processes(
        "thr", double_and_say, {0: (5,)}, _envs(1, COLOR="red"), DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL))))
    t.start()
    t.join(60)
    (ctx,) = started
    try:
        result = ctx.wait(60)
    finally:
        ctx.close()
    assert result is not None and result.return_values == {0: 10}


@pytest.mark.parametrize("kind", [pytest.param("function", marks=pytest.mark.slow), "program"])
def test_kill_9_of_the_parent_takes_its_processes_along(tmp_path: Path, kind: str) -> None:
    fifo = str(tmp_path / "ready")
    os.mkfifo(fifo)
    parent = tmp_path / "parent.py"
    block = "import os, signal; f = open(" + repr(fifo) + ", 'w'); f.write(f'{os.getpid()}\\n'); f.close(); signal.pause()"
    entry = "block" if kind == "function" else "sys.executable"
    arg = (fifo,) if kind == "function" else ("-c", block)
    args = repr({0: arg, 1: arg})
    parent.write_text(textwrap.dedent(f"""
        import os, signal, sys
        from tdist.elastic.multiprocessing import DefaultLogsSpecs, start_processes

        def block(fifo):
            with open(fifo, "w") as f:
                f.write(f"{{os.getpid()}}\\n")
            signal.pause()

        if __name__ == "__main__":
            specs = DefaultLogsSpecs(log_dir={str(tmp_path / "logs")!r})
            ctx = start_processes("orphan", {entry}, {args}, {{0: {{}}, 1: {{}}}}, specs)
            ctx.wait(120)
    """))
    tmp = tmp_path / "tmp"  # (the parent's temporary files: a kill -9 leaves none there)
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, str(parent)], env={**os.environ, "TMPDIR": str(tmp)})
    try:
        pids = [int(line) for line in _read_lines(fifo, 2, timeout=60)]
        proc.kill()
        proc.wait(30)
        for pid in pids:
            assert _gone(pid), f"process {pid} outlived its parent"
        assert sorted(os.listdir(tmp)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_public_names_are_torchs() -> None:
    import torch.distributed.elastic.multiprocessing as theirs

    assert sorted(mp.__all__) == sorted(theirs.__all__)
    assert mp.ProcessFailure is TorchProcessFailure and mp.Std.ALL == Std.OUT | Std.ERR
    assert mp.to_map({1: Std.OUT}, 2) == theirs.to_map({1: theirs.Std.OUT}, 2)
    from tdist.elastic.multiprocessing import api

    assert api.SignalException is torch_api.SignalException
    assert sorted(n for n in torch_api.__all__ if n != "get_std_cm") == sorted(api.__all__)


def test_stopping_cut_short_by_a_second_signal_says_so_not_the_whole_timeout(caplog: pytest.LogCaptureFixture) -> None:
    import signal
    import subprocess
    import sys

    from tdist.elastic.multiprocessing._process import stop_processes

    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    assert child.stdout is not None and read_line(child.stdout, 60, "the child's ready") == "ready\n"
    with caplog.at_level("WARNING", logger="tdist"):
        stop_processes([child], signal.SIGTERM, 30.0, cut_short=lambda: True)
    assert child.poll() is not None  # (killed)
    text = caplog.text
    assert "the wait (up to 30 s) was cut short: sending SIGKILL" in text and "did not stop within 30 s" not in text, text
