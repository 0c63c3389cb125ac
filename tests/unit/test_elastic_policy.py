"""The launcher's decisions: root cause, outcome, restarts, exit code, worker env, report."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import pytest

from tdist.elastic._agent import LaunchError, job_secret
from tdist.elastic._policy import (
    Action,
    LaunchConfig,
    Outcome,
    PostMortem,
    Std,
    StreamRoute,
    WorkerExit,
    blamed_as_lost,
    blamed_as_stalled,
    comma_separated,
    describe_exception,
    describe_returncode,
    exit_code,
    failures,
    first_failure,
    format_failure_report,
    format_status,
    group_outcome,
    line_prefix,
    next_action,
    parse_std,
    raised_before,
    stream_route,
    to_map,
    traceback_tail,
    worker_command,
    worker_env,
)

pytestmark = pytest.mark.timeout(10)


def ex(rank: int, rc: int, at: float, *, stopped: bool = False, stalled: bool = False) -> WorkerExit:
    return WorkerExit(local_rank=rank, rank=rank, pid=1000 + rank, returncode=rc, observed_at=at,
                      timestamp=1.7e9, stopped_by_agent=stopped, stalled=stalled)


# -- root cause --------------------------------------------------------------------------------
def test_first_failure_is_the_first_observed() -> None:
    exits = [ex(0, 0, 1.0), ex(2, 1, 3.0), ex(1, 3, 2.0)]
    assert first_failure(exits) == ex(1, 3, 2.0)
    assert [e.rank for e in failures(exits)] == [1, 2]


def test_ties_go_to_the_lowest_rank() -> None:
    assert first_failure([ex(3, 1, 5.0), ex(1, 1, 5.0)]) == ex(1, 1, 5.0)


def test_a_stopped_worker_that_raised_before_the_failure_is_the_root_cause_and_not_after_the_failure_raised() -> None:
    # rank 1 failed (exit seen at wall-clock 100.5); the agent then stopped rank 0, whose error
    # file says it raised at 98 (whole seconds)
    failed = dataclasses.replace(ex(1, 1, 5.0), timestamp=100.5)
    stopped = dataclasses.replace(ex(0, -15, 5.2, stopped=True), timestamp=100.6)
    marked = raised_before([stopped, failed], {0: 98.0})
    assert first_failure(marked) == dataclasses.replace(stopped, raised_at=98.0)
    # the same, but rank 1's own error file says it raised at 97, before rank 0, and took its
    # time to exit: rank 1 stays the root cause
    assert first_failure(raised_before([stopped, failed], {0: 98.0, 1: 97.0})) == failed
    # within the second of the first failure: maybe the agent's own signal at work, left alone
    assert first_failure(raised_before([stopped, failed], {0: 98.0, 1: 98.0})) == failed
    assert first_failure(raised_before([stopped, failed], {0: 100.0})) == failed


def test_workers_stopped_by_the_agent_are_not_failures() -> None:
    exits = [ex(0, -15, 1.0, stopped=True), ex(1, 1, 2.0, stopped=True)]
    assert first_failure(exits) is None
    assert first_failure([ex(0, 0, 1.0)]) is None
    assert first_failure([]) is None


def test_a_stalled_rank_is_the_root_cause_and_every_failure_is_listed() -> None:
    # rank 1 stopped; ranks 0 and 2 failed because of it; the launcher then ended rank 1
    exits = [ex(0, 1, 1.0), ex(2, 1, 1.1), ex(1, -9, 2.0, stopped=True, stalled=True), ex(3, -15, 2.0, stopped=True)]
    assert [e.rank for e in failures(exits)] == [1, 0, 2]
    report = format_failure_report("train.py", failures(exits), host="h", tails={})
    assert "<NO_OTHER_FAILURES>" not in report
    root = report.split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in root and "stalled" in root and "SIGKILL" in root
    others = report.split("Root Cause")[0]
    assert "rank      : 0 (local_rank: 0)" in others and "rank      : 2 (local_rank: 2)" in others
    assert "rank      : 3" not in report  # (ended by the launcher: a consequence)


def test_the_ranks_tdists_errors_call_stalled() -> None:
    tail = [
        "tdist._core.errors.PeerError: rank 0: peer rank 1 (pid 3124) stalled during all_reduce: no heartbeat\n",
        "PeerError: rank 2: rank 3 (unix) has sent nothing for 10.2 s (no heartbeat) during recv: it is stalled\n",
        "ValueError: rank 5 is fine\n",
    ]
    assert blamed_as_stalled(tail) == {1, 3}


def test_the_ranks_tdists_errors_call_lost_or_stalled() -> None:
    tail = [
        "tdist._core.errors.PeerError: rank 1: connection to rank 0 (10.77.0.1:4242), pid 977 was lost: "
        "connection closed; the process died or closed its socket\n",
        "RuntimeError: ... rank 2: connection to rank 4 (unix) was lost; the process died\n",
        "PeerError: rank 2: rank 3 (unix) has sent nothing for 10.2 s (no heartbeat) during recv: it is stalled\n",
        "PeerError: rank 1: peer rank 6 (pid 18055) died during all_reduce in shared-memory arena 'pg'\n",
        "What the ranks of group '0' were doing: rank 7 is gone (its process, pid 18055, has exited); ...\n",
        "ValueError: rank 5 is fine\n",
    ]
    assert blamed_as_lost(tail) == {0, 3, 4, 6, 7}
    assert blamed_as_lost(["ValueError: my own bug\n"]) == set()


# -- outcome and action ------------------------------------------------------------------------
def test_group_outcome() -> None:
    assert group_outcome(2, []) is Outcome.RUNNING
    assert group_outcome(2, [ex(0, 0, 1.0)]) is Outcome.RUNNING  # one finished early: wait
    assert group_outcome(2, [ex(0, 0, 1.0), ex(1, 0, 2.0)]) is Outcome.SUCCEEDED
    assert group_outcome(2, [ex(1, 2, 1.0)]) is Outcome.FAILED
    assert group_outcome(2, [], peer_failure="node 1 failed") is Outcome.PEER_FAILED
    assert group_outcome(2, [], peer_failure="node 1: interrupted", peer_stopped=True) is Outcome.PEER_STOPPED
    assert group_outcome(2, [ex(1, 2, 1.0)], peer_failure="x") is Outcome.FAILED  # ours first
    assert group_outcome(2, [ex(1, 2, 1.0)], signum=signal.SIGINT) is Outcome.INTERRUPTED


def test_next_action_restarts_while_restarts_are_left() -> None:
    assert next_action(Outcome.RUNNING, 0, 3) is Action.WAIT
    assert next_action(Outcome.SUCCEEDED, 0, 3) is Action.FINISH
    assert next_action(Outcome.FAILED, 0, 0) is Action.STOP
    assert next_action(Outcome.FAILED, 0, 2) is Action.RESTART
    assert next_action(Outcome.FAILED, 1, 2) is Action.RESTART
    assert next_action(Outcome.FAILED, 2, 2) is Action.STOP
    assert next_action(Outcome.INTERRUPTED, 0, 5) is Action.STOP  # never restart on a signal
    # another node's failure restarts every node's group while restarts are left
    assert next_action(Outcome.PEER_FAILED, 0, 5) is Action.RESTART
    assert next_action(Outcome.PEER_FAILED, 5, 5) is Action.STOP
    assert next_action(Outcome.PEER_STOPPED, 0, 5) is Action.STOP  # (a node stopped for good)
    assert next_action(Outcome.RESCALE, 5, 5) is Action.RESTART  # (nodes join: no restart spent)


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (Outcome.SUCCEEDED, 0),
        # torchrun's: 1 for any failure, whatever the worker's code or signal (the report has it),
        (Outcome.FAILED, 1),
        (Outcome.INTERRUPTED, 1),  # (its SignalException leaves main: Python's 1)
        (Outcome.PEER_FAILED, 1),
        (Outcome.PEER_STOPPED, 1),
    ],
)
def test_exit_code(outcome: Outcome, code: int) -> None:
    assert exit_code(outcome) == code


# -- what workers get --------------------------------------------------------------------------
def test_worker_env_matches_torchrun() -> None:
    cfg = LaunchConfig("train.py", nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                       master_port=1234, run_id="job7", max_restarts=0)
    env = worker_env({"PATH": "/bin", "RANK": "99"}, cfg, 2, master_port=1234, restart_count=0,
                     secret="s3cret")
    assert env == {
        "PATH": "/bin",
        "LOCAL_RANK": "2",
        "RANK": "6",
        "GROUP_RANK": "1",
        "ROLE_RANK": "6",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "4",
        "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TDIST_AGENT_STORE": "10.0.0.1:1234",
        "TDIST_SECRET": "s3cret",
        "OMP_NUM_THREADS": "1",
    }
    # with a port for torch's own store: MASTER_PORT is that one, and nobody is the agent's client
    env = worker_env({}, cfg, 2, master_port=1234, restart_count=0, secret="s", torch_port=4321)
    assert env["MASTER_PORT"] == "4321" and env["TDIST_AGENT_STORE"] == "10.0.0.1:1234"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    # (also when the launcher's own environment says True: a job started inside a torchrun job)
    env = worker_env({"TORCHELASTIC_USE_AGENT_STORE": "True"}, cfg, 2, master_port=1234, restart_count=0, secret="s",
                     torch_port=4321)
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_worker_env_flight_record_prefix_unless_given() -> None:
    cfg = LaunchConfig("train.py")
    env = worker_env({}, cfg, 0, master_port=1, restart_count=0, secret="s", flight_record_prefix="/l/0/nccl_trace_rank_")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/l/0/nccl_trace_rank_"
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # (the user's place wins)
        env = worker_env({var: "/mine_"}, cfg, 0, master_port=1, restart_count=0, secret="s", flight_record_prefix="/l/")
        assert env.get("TORCH_FR_DUMP_TEMP_FILE", "/mine_") == "/mine_"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in worker_env({}, cfg, 0, master_port=1, restart_count=0, secret="s")


def test_worker_env_keeps_omp_num_threads_and_single_worker() -> None:
    cfg = LaunchConfig("train.py", nproc_per_node=2)
    assert worker_env({"OMP_NUM_THREADS": "8"}, cfg, 0, master_port=1, restart_count=3,
                      secret="s")["OMP_NUM_THREADS"] == "8"
    one = LaunchConfig("train.py", nproc_per_node=1)
    env = worker_env({}, one, 0, master_port=1, restart_count=3, secret="s")
    assert "OMP_NUM_THREADS" not in env
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3"


def test_worker_env_virtual_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # (torchrun's --virtual-local-rank: LOCAL_RANK 0, the worker's own device alone)
    cfg = LaunchConfig("train.py", nproc_per_node=2, virtual_local_rank=True)
    envs = [worker_env({}, cfg, r, master_port=1, restart_count=0, secret="s") for r in range(2)]
    assert [(e["LOCAL_RANK"], e["RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "0", "0"), ("0", "1", "1")]
    env = worker_env({"CUDA_VISIBLE_DEVICES": "4, 6"}, cfg, 1, master_port=1, restart_count=0, secret="s")
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="local rank 1 has no device in CUDA_VISIBLE_DEVICES=3"):
        LaunchConfig("train.py", nproc_per_node=2, virtual_local_rank=True)


def test_comma_separated_as_torchruns_filters() -> None:
    assert comma_separated("apple,orange") == ["apple", "orange"]
    assert comma_separated("a,,b,c") == ["a,b", "c"] and comma_separated("") == []


def test_parse_std_as_torchruns_std_from_str() -> None:
    assert parse_std("0") is Std.NONE and parse_std("3") is Std.ALL
    assert parse_std("0:3,1:0,2:1,3:2") == {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}
    assert parse_std("12:1") == {12: Std.OUT}  # (torchrun's pattern takes one digit only)
    for bad in ("4", "0:4", "1,2", "a", "0:1,", ""):
        with pytest.raises(ValueError, match="expected 0 \\(none\\)"):
            parse_std(bad)


def test_std_from_str_as_torchs() -> None:
    from tdist.elastic.multiprocessing import Std as PublicStd

    assert PublicStd is Std
    assert Std.from_str("0") is Std.NONE and Std.from_str("1") is Std.OUT
    assert Std.from_str("0:3,1:0,2:1,3:2") == {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}
    assert Std.OUT.from_str("2") is Std.ERR  # (a classmethod, as torch's)
    for bad in ("4", "0:4", "1,2", "x"):
        with pytest.raises(ValueError):
            Std.from_str(bad)
    assert set(Std.__members__) == {"NONE", "OUT", "ERR", "ALL"}  # (from_str is no member)


def test_to_map() -> None:
    assert to_map(Std.OUT, 2) == {0: Std.OUT, 1: Std.OUT}
    assert to_map({1: Std.OUT, 5: Std.ALL}, 2) == {0: Std.NONE, 1: Std.OUT}


@pytest.mark.parametrize(
    ("redirects", "tee", "console", "files"),
    [
        (Std.NONE, Std.NONE, Std.ALL, Std.NONE),
        (Std.ALL, Std.NONE, Std.NONE, Std.ALL),
        (Std.OUT, Std.NONE, Std.ERR, Std.OUT),
        (Std.NONE, Std.OUT, Std.ALL, Std.OUT),
        (Std.ERR, Std.OUT, Std.OUT, Std.ALL),  # (a tee'd stream is on the console too)
        (Std.ALL, Std.ALL, Std.ALL, Std.ALL),
    ],
)
def test_stream_route_as_torchruns_reify(redirects: Std, tee: Std, console: Std, files: Std) -> None:
    cfg = LaunchConfig("t.py", nproc_per_node=2, redirects=redirects, tee=tee)
    assert stream_route(cfg, 1) == StreamRoute(console=console, files=files)
    assert stream_route(cfg, 1).teed == tee  # (the console's prefixed streams)


def test_line_prefix_as_torchruns() -> None:
    # torch's TailLog header: [<role><local rank>]:, or the template with its macros substituted
    cfg = LaunchConfig("t.py", nproc_per_node=2, nnodes=2, node_rank=1)
    assert line_prefix(cfg, 1) == "[default1]:"
    assert line_prefix(dataclasses.replace(cfg, role="trainer"), 0) == "[trainer0]:"
    templated = dataclasses.replace(cfg, log_line_prefix_template="[${role_name}:${rank}/${local_rank}] $other ")
    assert line_prefix(templated, 1) == "[default:3/1] $other "


def test_stream_route_per_rank_filter_and_devnull() -> None:
    cfg = LaunchConfig("t.py", nproc_per_node=3, redirects={0: Std.OUT}, tee={1: Std.ERR},
                       local_ranks_filter=frozenset({0, 2}))
    assert stream_route(cfg, 0) == StreamRoute(console=Std.ERR, files=Std.OUT)
    assert stream_route(cfg, 1) == StreamRoute(console=Std.NONE, files=Std.ERR)  # (filtered: files only)
    assert stream_route(cfg, 1).teed == Std.NONE
    assert stream_route(cfg, 2) == StreamRoute(console=Std.ALL, files=Std.NONE)
    devnull = LaunchConfig("t.py", redirects=Std.ALL, log_dir=os.devnull)
    assert stream_route(devnull, 0) == StreamRoute(console=Std.ALL, files=Std.NONE)
    with pytest.raises(ValueError, match="--start-method 'thread'"):
        LaunchConfig("t.py", start_method="thread")


def test_worker_command() -> None:
    assert worker_command(LaunchConfig("a.py", ("--x", "1"))) == [sys.executable, "-u", "a.py", "--x", "1"]
    assert worker_command(LaunchConfig("pkg.mod", ("y",), module=True)) == [sys.executable, "-u", "-m", "pkg.mod", "y"]
    assert worker_command(LaunchConfig("/bin/echo", ("hi",), no_python=True)) == ["/bin/echo", "hi"]


def test_the_local_rank_macro_is_substituted_as_torchs_agent_does() -> None:
    from torch.distributed.elastic.utils.api import macros

    args = ("--rank=$local_rank", "--x=${local_rank}", "price$$5", "$other", "${local_rank}${local_rank}")
    ours = worker_command(LaunchConfig("/bin/echo", args, no_python=True), 3)[1:]
    assert ours == macros.substitute(list(args), "3") == ["--rank=3", "--x=3", "price$5", "$other", "33"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc_per_node": 0}, "--nproc-per-node must be at least 1"),
        ({"nnodes": 2, "node_rank": 2}, "--node-rank must be from 0 to nnodes - 1 = 1"),
        ({"master_port": 70000}, "port must have value from 0 to 65535 but was 70000."),
        ({"nnodes": 2, "master_port": 0}, "works on one node only"),
        ({"max_restarts": -1}, "must not be negative"),
        ({"module": True, "no_python": True}, "cannot be used together"),
    ],
)
def test_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchConfig("a.py", **kwargs)  # type: ignore[arg-type]


def test_job_secret() -> None:
    assert job_secret({"TDIST_SECRET": "abc"}, 1) == "abc"
    assert job_secret({"TDIST_SECRET": "abc"}, 3) == "abc"
    fresh = job_secret({}, 1)
    assert len(fresh) == 64 and fresh != job_secret({"TDIST_SECRET": ""}, 1)
    with pytest.raises(LaunchError, match="set TDIST_SECRET to the same value on every node"):
        job_secret({}, 2)


# -- the report --------------------------------------------------------------------------------
def test_describe_returncode() -> None:
    assert describe_returncode(3) == "3"
    assert describe_returncode(-9) == "-9 (SIGKILL)"
    assert describe_returncode(-200) == "-200"


def test_traceback_tail_picks_the_last_traceback() -> None:
    lines = ["noise\n", "Traceback (most recent call last):\n", "  old\n", "OldError\n",
             "more noise\n", "Traceback (most recent call last):\n", '  File "x.py", line 1\n',
             "ValueError: boom\n"]
    assert traceback_tail(lines) == 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom'
    assert traceback_tail(["a\n", "b\n", "c\n"], max_lines=2) == (
        "<N/A> (no Python traceback on stderr, which ended:)\n...\nb\nc"
    )
    assert traceback_tail([]).startswith("<N/A>")


def test_failure_report_shape() -> None:
    root, other = ex(1, 3, 1.0), ex(2, -9, 2.0)
    tails = {1: ["Traceback (most recent call last):\n", "ValueError: boom\n"]}
    report = format_failure_report("train.py", [root, other], host="node7", tails=tails)
    lines = report.splitlines()
    assert lines[0].startswith("=====") and lines[1] == "train.py FAILED"
    assert "Failures:" in lines
    assert "Root Cause (first observed failure):" in lines
    root_part = report.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_part
    assert "exitcode  : 3 (pid: 1001)" in root_part
    assert "host      : node7" in root_part
    assert "    ValueError: boom" in root_part
    others = report.split("Root Cause")[0]
    assert "exitcode  : -9 (pid: 1002)" in others  # (torchrun's form, and its line naming the signal)
    assert "traceback : Signal 9 (SIGKILL) received by PID 1002" in others
    single = format_failure_report("t.py", [root], host="h", tails={})
    assert "<NO_OTHER_FAILURES>" in single
    with pytest.raises(ValueError):
        format_failure_report("t.py", [], host="h", tails={})


def test_describe_exception() -> None:
    tb = ('Traceback (most recent call last):\n  File "a.py", line 3, in <module>\n    main()\n'
          '  File "a.py", line 2, in main\n    raise KeyError("k")\nKeyError: \'k\'\n')
    assert describe_exception(tb) == "KeyError: 'k' (raised at a.py:2, in main)"
    assert describe_exception("noise\n" + tb.replace("KeyError: 'k'", "ValueError: two\nlines")) == (
        "ValueError: two (raised at a.py:2, in main)"
    )
    assert describe_exception("no traceback here\n") is None
    # after init_process_group (torch's, which tdist's makes too) every line of an uncaught
    # exception's report begins with "[rankN]: "
    prefixed = "".join(f"[rank1]: {line}\n" if line else "\n" for line in tb.splitlines())
    assert describe_exception("[rank1]: noise\n" + prefixed) == "KeyError: 'k' (raised at a.py:2, in main)"
    # an RPC's exception, rebuilt on the caller: its last traceback is the remote one (tdist.rpc's
    # note), which ran on the callee, called by the caller's rpc_sync
    remote = (
        tb + "\nThe above exception was the direct cause of the following exception:\n\n" + tb
        + "On WorkerInfo(id=1, name=worker1), raised in rpc_sync(worker1, m.boom):\n"
        + tb.replace("a.py", "w.py")
    )
    assert describe_exception(remote) == (
        "KeyError: 'k' (raised on worker1 at w.py:2, in main, called by rpc_sync(worker1, m.boom))"
    )


def test_post_mortem() -> None:
    root = ex(1, -9, 1.0)
    stopped = WorkerExit(0, 0, 1000, -15, 2.0, stopped_by_agent=True)
    killed = WorkerExit(2, 2, 1002, -9, 2.0, stopped_by_agent=True)
    done = ex(3, 0, 0.5)
    pm = PostMortem(
        exits=[stopped, root, killed, done], outputs={0: ["a\n", "b\n"]}, dumps={0: "/d/nccl_trace_rank_0"},
        restarts=1, max_restarts=3, earlier=["attempt 0: worker rank 1 failed (exit code 4)"], logs="/l/run/attempt_1",
    )
    report = format_failure_report("t.py", [root], host="h", tails={}, post_mortem=pm)
    post = report.split("Post-mortem:\n")[1]
    assert post.splitlines() == [
        "  first failure : rank 1 (local_rank 1, host h): killed by signal SIGKILL",
        "  the others    :",
        "    rank 0 (local_rank 0) was running; stopped by the launcher with SIGTERM; its last output:",
        "      | a",
        "      | b",
        "    rank 2 (local_rank 2) was running; it did not stop on SIGTERM and was killed with SIGKILL; it had printed nothing",
        "    rank 3 (local_rank 3) had finished (exit code 0)",
        "  flight records:",
        "    rank 0: /d/nccl_trace_rank_0",
        "  restarts      : 1 of 3 used (--max-restarts)",
        "    attempt 0: worker rank 1 failed (exit code 4)",
        "  logs          : /l/run/attempt_1/<local rank>/",  # (nothing there: nothing named)
        "=" * 60,
    ]
    assert "Post-mortem" not in format_failure_report("t.py", [root], host="h", tails={})


def test_format_status() -> None:
    line = format_status(running=3, finished=1, failed=0, restarts=0, max_restarts=0, elapsed=65.2,
                         progress="rank0: epoch 3", width=100)
    assert line == "[tdist run] 3 running, 1 finished, 0 failed | 1:05 | rank0: epoch 3"
    line = format_status(running=0, finished=0, failed=1, restarts=1, max_restarts=2, elapsed=3725,
                         progress=None, width=100)
    assert line == "[tdist run] 0 running, 0 finished, 1 failed | restart 1/2 | 1:02:05"
    cut = format_status(running=2, finished=0, failed=0, restarts=0, max_restarts=0, elapsed=1,
                        progress="rank1: " + "x" * 200, width=40)
    assert len(cut) == 39 and cut.endswith("...")


def test_a_launch_config_takes_a_command_line_and_says_where_a_function_goes() -> None:
    with pytest.raises(TypeError, match="elastic_launch"):
        LaunchConfig(print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strs"):
        LaunchConfig("train.py", args=("--epochs", 3))  # type: ignore[arg-type]


def test_torchs_launcher_helpers_at_torchs_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.utils import api as theirs

    from tdist.elastic.utils import api as ours

    args = ["--r=${local_rank}", "$local_rank", "p$$", 7]
    assert ours.macros.substitute(args, "2") == theirs.macros.substitute(args, "2") == ["--r=2", "2", "p$", 7]
    assert ours.macros.local_rank == theirs.macros.local_rank
    monkeypatch.delenv("TDIST_NOT_SET", raising=False)
    with pytest.raises(ValueError, match="Environment variable TDIST_NOT_SET expected, but not set"):
        ours.get_env_variable_or_raise("TDIST_NOT_SET")
    sock = ours.get_socket_with_port()
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


# -- waits for other nodes say for whom ----------------------------------------------------------
def test_a_wait_for_other_nodes_names_them_after_30_s_then_every_minute(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import types
    from datetime import timedelta

    from tdist.elastic._agent import LocalAgent
    from tdist.store._hash import HashStore

    now = [0.0]

    class Store(HashStore):
        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
            now[0] += timeout.total_seconds() if timeout is not None else 0.0
            if now[0] >= 100.0:
                self.set("node2", "1")  # (the last node comes at 100 s)

    store = Store()
    store.set("node0", "1")
    store.set("node1", "1")
    me = types.SimpleNamespace(config=types.SimpleNamespace(node_rank=0), _clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        done = LocalAgent._until_keys(me, store, ["node0", "node1", "node2"], 600.0, lambda: False,  # type: ignore[arg-type]
                                      what="waiting for the nodes to join")
    assert done and now[0] == 100.0
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "node 0: waiting for the nodes to join: waited 30 s for node(s) [2] (at most 570 s more)",
        "node 0: waiting for the nodes to join: waited 90 s for node(s) [2] (at most 510 s more)",
    ], said
    caplog.clear()
    assert not LocalAgent._until_keys(me, store, ["node0", "node3"], now[0] + 40.0, lambda: False)  # type: ignore[arg-type]
    assert not caplog.records  # (without ``what``: a wait that says nothing)
