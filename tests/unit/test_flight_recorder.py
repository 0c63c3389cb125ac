"""The flight recorder and the desync explanation without sockets: the ring, the dump format
(fed to torch's own analyzer in this process), ``explain`` and the rules it compares calls by,
the ``SIGUSR1`` handler's manners, and the answers' JSON."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tdist import HashStore
from tdist.c10d import _desync as D
from tdist.c10d import _flight_recorder as F

pytestmark = pytest.mark.timeout(60)


def _rec(rank: int, size: int = 3, cap: int = 16) -> F.Recorder:
    rec = F.Recorder(rank, size, cap, timeout_s=3.0)
    rec.identify("0", "default_pg", list(range(size)))
    return rec


def _done(e: list[Any]) -> list[Any]:
    e[F.STARTED] = e[F.DONE] = time.time_ns()
    return e


def test_record_ids_count_the_operations_of_every_group_in_order() -> None:
    a, b = _rec(0, cap=3), _rec(0, cap=8)
    t = torch.ones(1)
    made = []
    for i in range(6):  # the process made: b, a, a, a, a (a keeps its last 3), b
        made.append(_done(b.one("broadcast", t)) if i in (0, 5) else _done(a.one("all_reduce", t)))
        time.sleep(0.001)
    got = [(e[F.ID], e[F.OP], e[F.CSEQ]) for _, e in F._numbered([(a, a.entries()), (b, b.entries())])]
    # b's first entry is older than the oldest a still holds, after a dropped one: left out
    assert got == [(2, "all_reduce", 2), (3, "all_reduce", 3), (4, "all_reduce", 4), (5, "broadcast", 2)], got


def test_completion_times_are_discovered_by_the_next_operation() -> None:
    rec = _rec(0)
    t = torch.ones(3)
    first = rec.one("all_reduce", t)
    first[F.DONE] = F.UNTIMED  # (as the backend marks an operation done where it was issued)
    second = rec.one("broadcast", t)
    es = rec.entries()
    assert es[0][F.DONE] == second[F.CREATED] and es[0][F.INS] == (torch.Size([3]),)
    d = F.entry_dict(rec, es[0])
    assert d["state"] == "completed" and d["time_discovered_completed_ns"] == second[F.CREATED]
    second[F.DONE] = F.UNTIMED
    last = F.entry_dict(rec, rec.entries()[1])
    assert last["state"] == "completed" and last["time_discovered_completed_ns"] is None


def test_the_ring_keeps_the_last_n_in_order_and_never_a_tensor() -> None:
    rec = _rec(0, cap=4)
    t = torch.ones(2, 3)
    for _ in range(10):
        _done(rec.collective("all_reduce", (t.shape,), t.dtype))
    es = rec.entries()
    assert [e[F.CSEQ] for e in es] == [7, 8, 9, 10]
    assert [e[F.CSEQ] for e in rec.latest(2)] == [9, 10]
    assert not any(isinstance(x, torch.Tensor) for e in es for x in e)
    p = F.normalized(rec, rec.p2p("send", t.shape, t.dtype, 0, 1))
    assert (p[F.CSEQ], p[F.PSEQ], F.entry_dict(rec, p)["op_id"]) == (10, 1, 11)


def test_buffer_size_and_prefix_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDIST_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "7")
    assert F.buffer_size() == 7
    monkeypatch.setenv("TDIST_FR_BUFFER_SIZE", "0")
    assert F.buffer_size() == 0 and F.make_recorder(0, 2) is None
    monkeypatch.delenv("TDIST_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/x/y_")
    assert F.dump_prefix() == "/x/y_"


def test_dump_entries_in_torchs_format() -> None:
    rec = _rec(1)
    t = torch.ones(4, dtype=torch.float64)
    _done(rec.collective("all_gather", (t.shape,), t.dtype, (torch.Size([3, 4]),)))
    rec.collective("barrier", (), None)
    rec.p2p("recv", t.shape, t.dtype, 0, 1)[F.STARTED] = 0  # (as a backend that queues it)
    d = [F.entry_dict(rec, e) for e in rec.entries()]
    assert d[0]["profiling_name"] == "gloo:all_gather"
    assert (d[0]["input_sizes"], d[0]["output_sizes"], d[0]["input_dtypes"]) == ([[4]], [[3, 4]], ["Double"])
    assert (d[0]["state"], d[0]["retired"], d[0]["process_group"], d[0]["timeout_ms"]) == ("completed", True, ("0", "default_pg"), 3000)
    assert (d[1]["profiling_name"], d[1]["state"], d[1]["input_dtypes"]) == ("gloo:barrier", "started", [])
    assert (d[2]["profiling_name"], d[2]["is_p2p"], d[2]["state"]) == ("gloo:recv 1<-0", True, "scheduled")


def _analyze(dumps: dict[int, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> str:
    """torch's analyzer (``torchfrtrace``'s ``build_db``) on in-memory dumps; its log."""
    from torch.distributed.flight_recorder.components.builder import build_db

    details = {f"rank_{r}": {"rank": r, "entries": d["entries"], "version": d["version"], "pg_config": d["pg_config"]}
               for r, d in dumps.items()}
    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=False, mismatch_cap=10)
    logger = logging.getLogger("Flight Recorder")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="Flight Recorder"):
            build_db(details, args, F.FR_VERSION)
    finally:
        logger.removeHandler(caplog.handler)
    return caplog.text


def _dump_of(rec: F.Recorder) -> dict[str, Any]:
    return {"version": F.FR_VERSION, "pg_config": {rec.label: {"name": rec.label, "desc": rec.desc, "ranks": str(rec.ranks)}},
            "entries": [F.entry_dict(rec, e) for _, e in F._numbered([(rec, rec.entries())])]}


def test_torchs_analyzer_names_the_rank_that_skipped(caplog: pytest.LogCaptureFixture) -> None:
    recs = [_rec(r) for r in range(3)]
    t = torch.ones(8)
    for r, rec in enumerate(recs):
        _done(rec.collective("all_reduce", (t.shape,), t.dtype))
        if r != 2:
            rec.collective("all_reduce", (t.shape,), t.dtype)[F.STARTED] = time.time_ns()
    text = _analyze({r: _dump_of(rec) for r, rec in enumerate(recs)}, caplog)
    assert "Not all ranks joining collective, sequence number: 2" in text, text
    assert "missing ranks: {2}" in text, text


def test_torchs_analyzer_names_the_rank_that_called_another(caplog: pytest.LogCaptureFixture) -> None:
    recs = [_rec(r) for r in range(3)]
    t = torch.ones(8)
    for r, rec in enumerate(recs):
        rec.collective("broadcast" if r == 2 else "all_reduce", (t.shape,), t.dtype)[F.STARTED] = time.time_ns()
    text = _analyze({r: _dump_of(rec) for r, rec in enumerate(recs)}, caplog)
    assert "Culprit rank 2" in text and "COLLECTIVE_TYPE_MISMATCH" in text, text


# -- explain -------------------------------------------------------------------------------------
def _b(op: str, seq: int, sig: str = "float32[4]", state: str = "started", **kw: Any) -> dict[str, Any]:
    return {"op": op, "seq": seq, "sig": sig, "dtype": sig.split("[")[0], "state": state, "since_s": 1.5, "p2p": None, **kw}


def _h(*recent: dict[str, Any], last_completed: dict[str, Any] | None = None) -> dict[str, Any]:
    colls = [b["seq"] for b in recent if not b.get("p2p")]
    return {"recent": list(recent), "last_completed": last_completed, "last_seq": max(colls, default=0), "elsewhere": []}


def test_explain_names_the_rank_that_never_entered() -> None:
    bcast = _b("broadcast", 2, "float32[10]", "completed", where="train.py:88")
    ar = _b("all_reduce", 3, "float32[1024]")
    heads = {0: _h(bcast, ar, last_completed=bcast), 1: _h(bcast, ar), 2: _h(bcast), 3: _h(bcast, ar)}
    text = D.explain(0, 4, ar, heads, {}, "0")
    assert text == (
        "What the ranks of group '0' were doing: rank 2 never entered all_reduce #3 (float32[1024]); its last op is "
        "broadcast #2 (float32[10], completed 1.5 s ago) at train.py:88; ranks 0, 1, 3 are waiting in all_reduce #3 "
        "(float32[1024])."
    )


def test_explain_says_where_a_rank_that_never_entered_is_now() -> None:
    bcast = _b("broadcast", 2, "float32[10]", "completed")
    ar = _b("all_reduce", 3, "float32[1024]")
    late = {**_h(bcast), "now_at": "train.py:57 in evaluate"}
    text = D.explain(0, 2, ar, {0: _h(bcast, ar), 1: late}, {}, "0")
    assert "rank 1 never entered all_reduce #3 (float32[1024]); its last op is broadcast #2 (float32[10], completed 1.5 s ago); " \
        "its thread is now at train.py:57 in evaluate; rank 0 is waiting" in text, text
    # (one in another group's call: that call says where it is)
    late["elsewhere"] = [{"group": "tp", **_b("all_gather", 7)}]
    assert "now at" not in D.explain(0, 2, ar, {0: _h(bcast, ar), 1: late}, {}, "0")


def test_now_at_names_the_programs_frame_of_a_thread() -> None:
    here = threading.get_ident()
    assert D.now_at(here) == f"{os.path.basename(__file__)}:{sys._getframe().f_lineno} in test_now_at_names_the_programs_frame_of_a_thread"
    box: list[str | None] = []
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    box.append(D.now_at(t.ident or 0))
    assert box == [None]  # (a thread that is gone)


def test_explain_names_another_call_gone_silent_and_elsewhere() -> None:
    ar = _b("all_reduce", 3)
    done = _b("all_reduce", 2, state="completed")
    other = _h(done, _b("broadcast", 3))
    busy = _h(done)
    busy["elsewhere"] = [{"group": "tp", **_b("all_gather", 7)}]
    heads = {0: _h(done, ar, last_completed=done), 1: other, 2: None, 3: busy, 4: None}
    text = D.explain(0, 5, ar, heads, {4: "is gone (its process died)"}, "0", "did not answer")
    assert "rank 1 called broadcast #3 (float32[4]) where others called all_reduce #3 (float32[4])" in text
    assert "rank 2 did not answer; it took part in all_reduce #2 (float32[4]), the last collective completed here" in text
    assert "rank 3 never entered all_reduce #3 (float32[4]); its last op is all_reduce #2" in text
    assert "it is in all_gather #7 (float32[4]) of group 'tp' (started for 1.5 s)" in text
    assert "rank 4 is gone (its process died)" in text
    assert text.endswith("rank 0 is waiting in all_reduce #3 (float32[4]).")


def test_explain_a_point_to_point_operation_names_the_other_side() -> None:
    recv = {**_b("recv", 1, "float32[3]"), "p2p": [1, 0]}
    busy = _h(_b("barrier", 2, ""))
    text = D.explain(0, 3, recv, {0: _h(recv), 1: busy, 2: _h()}, {}, "0")
    assert text == (
        "What the ranks of group '0' were doing: rank 1, which was to send it, is in barrier #2 (running for "
        "1.5 s); rank 0 is waiting in recv 1->0 (p2p #1) (float32[3])."
    )
    send = {**_b("send", 1, "float32[3]"), "p2p": [1, 0]}
    assert "rank 0, which was to receive it, is gone" in D.explain(1, 3, send, {}, {0: "is gone"}, "0")
    assert "rank 0, which was to receive it, has recorded no operation" in D.explain(1, 3, send, {0: _h()}, {}, "0")


def test_compatible_calls_and_mismatches() -> None:
    ar = _b("all_reduce", 3, "float32[4]")
    assert D.compatible(ar, _b("all_reduce", 3, "float32[4]"))
    assert not D.compatible(ar, _b("all_reduce", 3, "float32[7]"))
    assert not D.compatible(ar, _b("broadcast", 3, "float32[4]"))
    # uneven all_gather and the root's lists of gather are legal; the dtype must agree
    assert D.compatible(_b("all_gather", 1, "float32[4]"), _b("all_gather", 1, "float32[9]"))
    assert not D.compatible(_b("gather", 1, "float32[4]"), _b("gather", 1, "int64[4]"))
    heads = {0: _h(ar), 1: _h(_b("all_reduce", 2, state="completed")), 2: _h(_b("broadcast", 3)), 3: None}
    assert D.mismatch(ar, heads) == [2]


def test_crossed_names_a_rank_that_waits_in_another_group_for_this_one() -> None:
    """Rank 0 waits in group 'a' for rank 1, which waits in group 'b' for rank 0 (which has not
    entered that call): a deadlock, where both are certain that they cannot issue more."""
    ar = _b("all_reduce", 1)
    theirs = {"group": "b", **_b("barrier", 1, "")}
    one = {**_h(), "stuck": True, "elsewhere": [theirs]}
    heads = {0: {**_h(ar), "stuck": True}, 1: one}
    assert D.crossed(ar, heads, 0, {"b": 0}) == (1, theirs)
    # no deadlock where: this rank entered the other call (or is not of its group) ...
    assert D.crossed(ar, heads, 0, {"b": 1}) is None
    assert D.crossed(ar, heads, 0, {}) is None
    # ... the other rank could still issue this call (another thread of it may) or entered it ...
    assert D.crossed(ar, {**heads, 1: {**one, "stuck": False}}, 0, {"b": 0}) is None
    assert D.crossed(ar, {**heads, 1: {**_h(_b("all_reduce", 1)), "stuck": True, "elsewhere": [theirs]}}, 0, {"b": 0}) is None
    # ... it has more than that one call in flight (it may be blocked in another), or its call there
    # is a point-to-point one (which may not need this rank), or this call is one
    two = {**one, "elsewhere": [theirs, {"group": "c", **_b("all_reduce", 4)}]}
    assert D.crossed(ar, {**heads, 1: two}, 0, {"b": 0, "c": 9}) is None
    p2p = {**one, "elsewhere": [{**theirs, "p2p": [1, 0]}]}
    assert D.crossed(ar, {**heads, 1: p2p}, 0, {"b": 0}) is None
    assert D.crossed({**ar, "p2p": [0, 1]}, heads, 0, {"b": 0}) is None
    assert D.crossed(ar, {**heads, 1: None}, 0, {"b": 0}) is None


def test_cycle_follows_the_waits_through_other_groups_back_to_this_rank() -> None:
    # the default group "0" of ranks 0-2; "a" = [0, 1], "b" = [1, 2], "c" = [2, 0]; rank 0 is in
    # a's all_reduce #1, rank 1 in b's, rank 2 in c's, none has entered the group it waits in
    def rank(r: int, group: str, members: list[int], entered: dict[str, int], stuck: bool = True) -> dict[str, Any]:
        call = {"group": group, "ranks": members, **_b("all_reduce", 1)}
        return {**_h(), "global_rank": r, "group": "0", "ranks": [0, 1, 2], "stuck": stuck, "elsewhere": [call], "entered": entered}

    mine = _b("all_reduce", 1)
    heads = {
        0: rank(0, "a", [0, 1], {"0": 0, "a": 1, "c": 0}),
        1: rank(1, "b", [1, 2], {"0": 0, "a": 0, "b": 1}),
        2: rank(2, "c", [2, 0], {"0": 0, "b": 0, "c": 1}),
    }
    entered = {"0": 0, "a": 1, "c": 0}
    hops = D.cycle(0, mine, "a", [0, 1], heads, entered)
    assert hops is not None and [(r, b["group"], nxt) for r, b, nxt in hops] == [(1, "b", 2), (2, "c", 0)]
    # no cycle: this rank has entered c's call (rank 2 does not wait for it), or rank 1 has
    # entered a's (this call does not wait for it), or a rank on the way is not certain of its
    # wait, did not answer, or has a second operation in flight, or this call is point-to-point
    assert D.cycle(0, mine, "a", [0, 1], heads, {**entered, "c": 1}) is None
    assert D.cycle(0, mine, "a", [0, 1], {**heads, 1: rank(1, "b", [1, 2], {"0": 0, "a": 1, "b": 1})}, entered) is None
    assert D.cycle(0, mine, "a", [0, 1], {**heads, 2: rank(2, "c", [2, 0], {"c": 1}, stuck=False)}, entered) is None
    assert D.cycle(0, mine, "a", [0, 1], {**heads, 2: None}, entered) is None
    two = {**heads[1], "elsewhere": [*heads[1]["elsewhere"], {"group": "d", "ranks": [1, 2], **_b("barrier", 1, "")}]}
    assert D.cycle(0, mine, "a", [0, 1], {**heads, 1: two}, entered) is None
    assert D.cycle(0, {**mine, "p2p": [0, 1]}, "a", [0, 1], heads, entered) is None
    # a rank waiting in the default group itself (its call in "recent"): followed as well
    in_default = {**_h(_b("barrier", 1, "")), "global_rank": 2, "group": "0", "ranks": [0, 1, 2], "stuck": True,
                  "entered": {"0": 1, "b": 0, "c": 0}}
    hops = D.cycle(0, mine, "a", [0, 1], {**heads, 2: in_default}, entered)
    assert hops is not None and [(r, b["group"], nxt) for r, b, nxt in hops] == [(1, "b", 2), (2, "0", 0)]


def test_receives_crossed_names_a_rank_that_receives_from_this_one() -> None:
    """Rank 0 receives from rank 1, which receives from rank 0: neither sends before its receive
    returns, where rank 1 is certain that it cannot (its head's ``stuck``)."""
    mine = _b("recv", 1, p2p=[1, 0])
    theirs = _b("recv", 1, p2p=[0, 1])
    one = {**_h(theirs), "stuck": True}
    assert D.receives_crossed(mine, {1: one}, 0) == 1
    # not where: rank 1 could still send (another thread of it may), it is in something else too,
    # or elsewhere, or its receive is from another rank, or it did not answer ...
    assert D.receives_crossed(mine, {1: {**one, "stuck": False}}, 0) is None
    assert D.receives_crossed(mine, {1: {**_h(theirs, _b("send", 2, p2p=[1, 2])), "stuck": True}}, 0) is None
    assert D.receives_crossed(mine, {1: {**one, "elsewhere": [{"group": "b", **_b("barrier", 1, "")}]}}, 0) is None
    assert D.receives_crossed(mine, {1: {**_h(_b("recv", 1, p2p=[2, 1])), "stuck": True}}, 0) is None
    assert D.receives_crossed(mine, {1: None}, 0) is None
    # ... or this call is a send, a collective, or a receive from any rank
    assert D.receives_crossed(_b("send", 1, p2p=[0, 1]), {1: one}, 0) is None
    assert D.receives_crossed(_b("all_reduce", 1), {1: one}, 0) is None
    assert D.receives_crossed(_b("recv", 1, p2p=[-1, 0]), {1: one}, 0) is None


def test_the_answers_are_json() -> None:
    """The answers travel as JSON (the store may be shared: never pickle)."""
    rec = _rec(0)
    e = rec.collective("all_reduce", (torch.Size([3]),), torch.float32)
    e[F.STARTED] = time.time_ns()
    h = json.loads(json.dumps(D.head(rec)))
    assert h["recent"][0]["sig"] == "float32[3]" and h["last_seq"] == 1 and h["global_rank"] == 0


def test_sigusr1_handler_only_where_the_program_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def mine(signum: int, frame: Any) -> None:
        pass

    old = signal.signal(signal.SIGUSR1, mine)
    try:
        monkeypatch.setattr(F, "_signal_done", False)
        assert F.install_signal_handler() is False
        assert signal.getsignal(signal.SIGUSR1) is mine
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        monkeypatch.setattr(F, "_signal_done", False)
        monkeypatch.setenv("TDIST_FR_SIGNAL", "0")
        assert F.install_signal_handler() is False
        monkeypatch.setattr(F, "_signal_done", False)
        monkeypatch.delenv("TDIST_FR_SIGNAL")
        assert F.install_signal_handler() is True
        assert signal.getsignal(signal.SIGUSR1) is F._on_signal
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_dump_being_written_has_a_name_torchs_analyzer_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's analyzer takes every file whose name contains the prefix (anywhere) for a rank's
    dump: the file a dump is written to before its rename must not contain it."""
    moves: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        moves.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(F.os, "replace", replace)
    path = str(tmp_path / "nccl_trace_rank_3")
    assert F.write_dump(path, 3) == path
    [(tmp, dst)] = moves
    assert dst == path and "rank_" not in os.path.basename(tmp) and os.path.dirname(tmp) == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nccl_trace_rank_3"]


def test_a_groups_failure_dump_is_not_replaced_by_its_later_failures(tmp_path: Path) -> None:
    """A rank that skipped a collective is asked for its dump when the others fail, carries on,
    and fails at its next call: its second failure dump recorded the collective it had skipped,
    and torch's analyzer then found no rank missing. A new group's failure writes it again, and
    an asked-for dump (``dump_all``) always does."""
    path = tmp_path / "rank_0"
    group = _rec(0)
    F.write_dump(str(path), 0, failed=group)
    at_failure = path.read_bytes()
    group.one("all_reduce", torch.ones(1))  # (what the rank does after: not in the failure's dump)
    F.write_dump(str(path), 0, failed=group)
    assert path.read_bytes() == at_failure
    F.write_dump(str(path), 0)  # (asked for)
    assert path.read_bytes() != at_failure
    path.unlink()
    F.write_dump(str(path), 0, failed=_rec(0))  # (another group's failure)
    assert path.exists()


class _CountingStore(HashStore):
    """A store whose clones are counted (a responder's connection is a clone)."""

    clones = 0

    def clone(self) -> HashStore:
        type(self).clones += 1
        return self


def test_a_responder_connects_after_its_group_forms_and_one_stopped_before_never_does() -> None:
    # stopped (destroy_process_group, or the process's exit) during the deferral: no connection,
    # and the thread is gone at once (an exit never waits on a connect to a store that is gone)
    _CountingStore.clones = 0
    r = D.Responder(_CountingStore(), _rec(0))
    r.stop()
    r.join(10)
    assert not r._thread.is_alive() and _CountingStore.clones == 0
    r = D.Responder(_CountingStore(), _rec(1))
    D._stop_responders_at_exit()
    r.join(10)
    assert not r._thread.is_alive() and _CountingStore.clones == 0
    # left alone, it connects once the deferral is over, and answers
    store = _CountingStore()
    rec = _rec(2)
    r = D.Responder(store, rec)
    try:
        store.set("fr/ask/2/1", json.dumps({"k": 7, "from": 0, "dump": None}))
        store.wait(["fr/head/7/2"])
        assert json.loads(store.get("fr/head/7/2"))["rank"] == 2
        assert _CountingStore.clones == 1
    finally:
        r.stop()
        r.join(10)


class _TorchLikeStore(HashStore):
    """A store that a responder treats as torch's (it looks for its requests instead of waiting
    on them), whose clones are itself, and whose first ``failing_gets`` reads fail."""

    failing_gets = 0
    failing_sets = 0

    def _torch_store(self) -> Any:
        return object()  # (not a TCPStore: no server to watch)

    def clone(self) -> HashStore:
        return self

    def get(self, key: str) -> bytes:
        if key.startswith("fr/ask/") and self.failing_gets:
            self.failing_gets -= 1
            raise TimeoutError("a slow store")
        return super().get(key)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        if self.failing_sets:
            self.failing_sets -= 1
            raise TimeoutError("a slow store")
        super().multi_set(keys, values)


def _ask(store: HashStore, rank: int, k: int) -> None:
    store.set(f"fr/ask/{rank}/{k}", json.dumps({"k": k, "from": 0, "dump": None}))


@pytest.mark.parametrize("kind", ["torch's", "tdist's"])
def test_a_request_number_that_never_comes_does_not_hold_up_the_later_ones(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # (an asker that took request number 1 and never wrote its request: it died, or its store
    # calls timed out on a loaded host; the responders waited for number 1 for good, and no
    # later diagnosis of the group heard from them: a culprit's dump never came)
    from datetime import timedelta

    monkeypatch.setattr(D, "_WAIT", timedelta(seconds=1.2))  # (a responder on tdist's store looks again after it)
    store = _TorchLikeStore() if kind == "torch's" else _CountingStore()
    r = D.Responder(store, _rec(2))
    try:
        assert r._ours is (kind == "tdist's")
        _ask(store, 2, 2)
        store.wait(["fr/head/2/2"], timedelta(seconds=20))
        assert json.loads(store.get("fr/head/2/2"))["rank"] == 2
        # two asks that land out of order, within the time a lost one is given: both answered
        _ask(store, 2, 4)
        _ask(store, 2, 3)
        store.wait(["fr/head/3/2", "fr/head/4/2"], timedelta(seconds=20))
        if isinstance(store, _TorchLikeStore):  # a request that cannot be read at once is read again, not passed over
            store.failing_gets = 2
        _ask(store, 2, 5)
        store.wait(["fr/head/5/2"], timedelta(seconds=20))
        assert not store.check(["fr/head/1/2"])  # (the lost one: nobody asked it)
    finally:
        r.stop()
        r.join(10)


def test_an_ask_whose_request_cannot_be_written_at_once_is_written_again() -> None:
    # (the asker took its number; a store slow for a moment failed the request's write: the
    # responders would pass the number over, and the diagnosis heard from nobody)
    store = _TorchLikeStore()
    store.failing_sets = 2
    r = D.Responder(store, _rec(1, size=2))
    try:
        heads, _ = D.ask_all(store, _rec(0, size=2), {}, grace=20.0)
        assert heads[1] is not None and heads[1]["rank"] == 1 and store.failing_sets == 0
    finally:
        r.stop()
        r.join(10)


def test_short_entries_read_as_full_ones_and_run_only_while_their_group_is_busy() -> None:
    rec = _rec(0, cap=4)
    busy = [True]
    rec.busy = lambda: busy[0]
    t = torch.ones(2, 3)
    first = rec.quick("all_reduce", t)
    assert type(first) is tuple and len(first) == F.SHORT
    # the newest, its group busy: running (the live view, the copies, the backend's own form)
    (live,) = rec.live(8)
    assert (live[F.OP], live[F.INS], live[F.INDT], live[F.DONE]) == ("all_reduce", t.shape, t.dtype, 0)
    assert live[F.STARTED] == live[F.CREATED] == first[0] and rec.index_of(live) == 0
    assert F.entry_dict(rec, rec.entries()[0])["state"] == "started"
    assert F.normalized(rec, first)[F.DONE] == 0 and F.current_op([rec]) is not None
    busy[0] = False  # (its lock free: it ended)
    assert F.entry_dict(rec, rec.entries()[0])["state"] == "completed" and F.current_op([rec]) is None
    busy[0] = True
    second = rec.quick("all_reduce", t)
    es = rec.entries()
    assert es[0][F.DONE] == second[0] and es[1][F.DONE] == 0  # (the first's end discovered by the second)
    assert [e[F.CSEQ] for e in es] == [1, 2] and es[1][F.INS] == (t.shape,)
    # a short entry whose backend must write into it (queued, or failed) takes its full form in place
    wide = rec.widen(second)
    assert rec.ring[1] is wide and rec.index_of(wide) == 1
    F.Recorder.failed(wide, RuntimeError("boom"))
    d = F.entry_dict(rec, rec.entries()[1])
    assert d["state"] == "started" and "boom" in str(rec.entries()[1][F.ERROR])
    # around the ring, short and full entries mixed: the last 4, in order, none running but the newest
    busy[0] = False
    for i in range(5):
        if i % 2:
            _done(rec.collective("broadcast", (t.shape,), t.dtype))
        else:
            rec.quick("all_reduce", t)
    assert [(e[F.OP], e[F.CSEQ]) for e in rec.entries()] == [
        ("broadcast", 4), ("all_reduce", 5), ("broadcast", 6), ("all_reduce", 7)]
    assert all(F.state_of(e) == "completed" for e in rec.entries())
    assert not any(isinstance(x, torch.Tensor) for e in rec.ring for x in e or ())


def test_dumps_on_failure_follow_tdists_variable_then_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TDIST_FR_DUMP_ON_FAILURE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    assert F.dump_on_failure()
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # (torch's documented switch)
    assert not F.dump_on_failure()
    monkeypatch.setenv("TDIST_FR_DUMP_ON_FAILURE", "1")  # (tdist's own says first)
    assert F.dump_on_failure()
    monkeypatch.setenv("TDIST_FR_DUMP_ON_FAILURE", "off")
    assert not F.dump_on_failure()


class _LostStore:
    """A store whose server has gone (every call fails as the client says then)."""

    def add(self, key: str, amount: int) -> int:
        from tdist._core.errors import DistNetworkError

        raise DistNetworkError("lost the connection to the store at 127.0.0.1:1 during ADD")


def test_a_store_lost_with_rank_0_says_that_rank_0_hosted_it() -> None:
    """(``env://`` and ``tcp://`` serve the store from global rank 0's process: once it is gone,
    the ranks that could not be asked are explained by it)"""
    rec = _rec(1)
    _, said = D.ask_all(_LostStore(), rec, {0: "its process has exited"}, grace=0.5)
    assert "could not be asked (DistNetworkError: lost the connection" in said, said
    assert "global rank 0, which is gone, hosted it" in said, said
    _, said = D.ask_all(_LostStore(), rec, {2: "its process has exited"}, grace=0.5)
    assert "hosted it" not in said, said  # (rank 0 lives: it is not why)
    sub = _rec(0)
    sub._ranks = [1, 2, 3]  # (a group without global rank 0: its rank 0 is global rank 1)
    _, said = D.ask_all(_LostStore(), sub, {0: "its process has exited"}, grace=0.5)
    assert "hosted it" not in said, said


# -- the watchdog's looks at a blocked collective ------------------------------------------------
def test_the_watchdog_looks_at_doubling_ages_at_most_max_gap_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Looks at ages 0.05, 0.1, 0.2, 0.4, 0.8, then every 0.5 s (``_MAX_GAP``): not at every
    round of the watchdog once the age passed ``_MAX_GAP`` (which made a warning of a long wait
    twice a second, with a question to every rank through the store). A group watched under
    the default setting, before the setting changed, keeps the watchdog's thread going: the
    thread reads the setting at each round (it took the first group's, 2 s, for the process)."""
    monkeypatch.delenv("TDIST_FR_CHECK_AFTER", raising=False)
    monkeypatch.setattr(D._Watchdog, "_PERIOD", 0.01)
    monkeypatch.setattr(D._Watchdog, "_MAX_GAP", 0.5)

    class Idle:
        def check(self, e: list[Any]) -> None:
            pass

    earlier, idle = _rec(1), Idle()
    D.watch(earlier, idle.check)
    monkeypatch.setenv("TDIST_FR_CHECK_AFTER", "0.05")
    rec = _rec(0)
    entry = rec.collective("all_reduce", (torch.Size([4]),), torch.float32)
    entry[F.STARTED] = time.time_ns()
    ages: list[float] = []
    enough = threading.Event()

    class Backend:
        def check(self, e: list[Any]) -> None:
            ages.append((time.time_ns() - e[F.STARTED]) / 1e9)
            if ages[-1] >= 2.0:
                enough.set()

    backend = Backend()
    D.watch(rec, backend.check)
    try:
        assert enough.wait(20)
    finally:
        D.unwatch(rec)
        D.unwatch(earlier)
    assert 7 <= len(ages) <= 10, ages  # (0.05, 0.1, 0.2, 0.4, 0.8, 1.3, 1.8, 2.3; a late round may merge two)
    assert all(b - a <= 0.5 + 0.2 for a, b in itertools.pairwise(ages)), ages


def test_explain_a_receive_from_any_rank_says_what_every_other_rank_does() -> None:
    recv = {**_b("recv", 1, "float32[3]"), "p2p": [-1, 0]}
    late = {**_h(_b("barrier", 2, "", "completed")), "now_at": "train.py:9 in load"}
    text = D.explain(0, 3, recv, {0: _h(recv), 1: _h(_b("all_reduce", 3)), 2: late}, {}, "0")
    assert text == (
        "What the ranks of group '0' were doing: rank 1 is in all_reduce #3 (float32[4], running for 1.5 s); "
        "rank 2 is in no operation of this group; its last is barrier #2 (completed 1.5 s ago); its thread is now at "
        "train.py:9 in load; rank 0 is waiting in recv any->0 (p2p #1) (float32[3]), from any rank."
    ), text
