"""The module-level c10d API without a real backend: argument rules, errors before init, backend
names, ``ReduceOp``, ``P2POp``, object pickling, rank mapping, debug fingerprints, the
monitored-barrier protocol over a ``HashStore``, group bookkeeping with an in-process fake
backend, and the public surface against ``torch.distributed``."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as tdd

import tdist as dist
from tdist.c10d import _checks as C
from tdist.c10d import _group as G
from tdist.c10d._api import _default_group, _destroy_all_worlds_for_tests
from tdist.c10d._backend import Backend as BackendImpl
from tdist.c10d._backend_config import implementation_for, parse_device_backend_string
from tdist.c10d._debug import (
    CollectiveChecker,
    CollectiveMismatchError,
    Fingerprint,
    compare,
)
from tdist.c10d._objects import (
    object_to_tensor,
    objects_to_tensor,
    tensor_to_object,
    tensor_to_objects,
)
from tdist.c10d._types import RedOpType, Work, as_red_op
from tdist.testing import run_threads

pytestmark = pytest.mark.timeout(30)

NOT_INIT = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)


@pytest.fixture(autouse=True)
def _clean_world() -> Iterator[None]:
    _destroy_all_worlds_for_tests()
    yield
    _destroy_all_worlds_for_tests()


# -- a fake backend: no communication; for world size 1 every operation is local ------------
class FakeBackend(BackendImpl):
    """Completes every operation at once; correct for a group of one rank."""

    created: list[FakeBackend] = []

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.store = store
        self.timeout = timeout
        self.calls: list[tuple[str, Any]] = []
        self.closed = False
        FakeBackend.created.append(self)

    def name(self) -> str:
        return "fake1"

    def _done(self, op: str, opts: Any, result: list[torch.Tensor] | None = None) -> Work:
        self.calls.append((op, opts))
        return Work.completed(result or [], op)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        return self._done("broadcast", opts, tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        return self._done("allreduce", opts, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        return self._done("reduce", opts, tensors)

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any) -> Work:
        output_tensors[0][0].copy_(input_tensors[0])
        return self._done("allgather", opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:
        output.copy_(input.reshape(output.shape))
        return self._done("_allgather_base", opts)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any) -> Work:
        output_tensors[0][0].copy_(input_tensors[0])
        return self._done("gather", opts)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any) -> Work:
        output_tensors[0].copy_(input_tensors[0][0])
        return self._done("scatter", opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any) -> Work:
        output_tensors[0].copy_(input_tensors[0][0])
        return self._done("reduce_scatter", opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:
        output.copy_(input.reshape(output.shape))
        return self._done("_reduce_scatter_base", opts)

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any) -> Work:
        output_tensors[0].copy_(input_tensors[0])
        return self._done("alltoall", opts)

    def alltoall_base(self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any) -> Work:
        output.copy_(input)
        return self._done("alltoall_base", (out_splits, in_splits))

    def barrier(self, opts: Any) -> Work:
        return self._done("barrier", opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        return self._done("send", (dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        return self._done("recv", (src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        work = Work("recv")
        work._complete(tensors, source_rank=0)
        return work

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def shutdown(self) -> None:
        self.closed = True


def _fake_creator(store: Any, rank: int, size: int, timeout: timedelta) -> BackendImpl:
    return FakeBackend(store, rank, size, timeout)


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dist.Backend.register_backend("fake1", _fake_creator, devices=["cpu"])


def _init1(**kwargs: Any) -> dist.HashStore:
    store = kwargs.pop("store", None) or dist.HashStore()
    dist.init_process_group("fake1", store=store, rank=0, world_size=1, **kwargs)
    return store


# -- errors before init ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.get_rank(),
        lambda: dist.get_world_size(),
        lambda: dist.all_reduce(torch.ones(1)),
        lambda: dist.broadcast(torch.ones(1), 0),
        lambda: dist.barrier(),
        lambda: dist.new_group([0]),
        lambda: dist.get_backend(),
        lambda: dist.send(torch.ones(1), 1),
        lambda: dist.P2POp(dist.isend, torch.ones(1), 1),
        lambda: dist.all_gather_object([None], 1),
    ],
)
def test_calls_before_init_raise_torchs_error(call: Any) -> None:
    with pytest.raises(ValueError, match=r"^Default process group has not been initialized"):
        call()
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == NOT_INIT


def test_state_before_init() -> None:
    assert not dist.is_initialized()
    assert dist.group.WORLD is None and dist.GroupMember.WORLD is None
    assert dist.GroupMember.NON_GROUP_MEMBER == -100 == tdd.GroupMember.NON_GROUP_MEMBER
    assert dist.get_rank(dist.GroupMember.NON_GROUP_MEMBER) == -1
    assert dist.get_world_size(dist.GroupMember.NON_GROUP_MEMBER) == -1
    assert dist.get_pg_count() == 0
    # torch's ``group is GroupMember.WORLD``, both None before init: the identity
    assert dist.get_global_rank(None, 3) == 3 == tdd.get_global_rank(None, 3)  # type: ignore[arg-type]
    assert dist.get_group_rank(None, 2) == 2 == tdd.get_group_rank(None, 2)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match=r"not been initialized"):
        dist.destroy_process_group()
    dist.destroy_process_group(dist.GroupMember.NON_GROUP_MEMBER)  # a no-op, as torch


def test_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dist.is_available() and dist.is_gloo_available()
    assert not dist.is_nccl_available() and not dist.is_ucc_available() and not dist.is_xccl_available()
    assert dist.is_mpi_available()  # (mpi4py, installed by the set-up)
    assert dist.is_backend_available("gloo") and dist.is_backend_available("tcp")
    assert dist.is_backend_available("cpu:gloo") and not dist.is_backend_available("nccl")
    assert dist.is_backend_available("fake1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.is_torchelastic_launched()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_node_local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert dist.get_node_local_rank(fallback_rank=2) == 2
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is not in the environment"):
        dist.get_node_local_rank()
    assert dist.default_pg_timeout == tdd.default_pg_timeout == timedelta(minutes=30)


# -- backend names -----------------------------------------------------------------------------
def test_backend_strings_as_torch() -> None:
    for name in ["gloo", "GLOO", "Gloo", "nccl", "MPI", "undefined", "cpu:gloo", "custom_x"]:
        assert dist.Backend(name) == tdd.Backend(name)
    assert dist.Backend.GLOO == "gloo" == tdd.Backend.GLOO
    assert dist.Backend.NCCL == "nccl" and dist.Backend.MPI == "mpi" and dist.Backend.UCC == "ucc"
    assert dist.Backend.TCP == "tcp"
    assert type(dist.Backend("gloo")) is str
    with pytest.raises(ValueError, match=r"Backend constructor parameter must be string-ish"):
        dist.Backend(3)  # type: ignore[arg-type]
    assert dist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.get_default_backend_for_device(torch.device("cuda")) == "nccl"
    with pytest.raises(ValueError, match=r"Default backend not registered for device"):
        dist.get_default_backend_for_device("meta")


def test_which_implementation_serves_a_name() -> None:
    for name in ["gloo", "GLOO", "tcp", "undefined", "cpu:gloo", "cpu:gloo,cuda:nccl", "cpu:tcp"]:
        assert implementation_for(name) == "tcp"
    assert implementation_for("fake1") == "fake1"
    for name in ["nccl", "NCCL", "ucc", "xccl", "cuda:nccl"]:
        with pytest.raises(RuntimeError, match=r"doesn't have .* built in"):
            implementation_for(name)
    assert parse_device_backend_string("CPU:Gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match=r"Invalid device:backend pairing"):
        parse_device_backend_string("cpu:gloo:x")
    with pytest.raises(ValueError, match=r"Duplicate device type cpu"):
        parse_device_backend_string("cpu:gloo,cpu:tcp")


def test_backend_config_strings() -> None:
    assert str(dist.BackendConfig("undefined")) == "cpu:gloo"
    assert str(dist.BackendConfig("gloo")) == str(tdd.BackendConfig(tdd.Backend("gloo")))
    assert str(dist.BackendConfig("cpu:gloo")) == "cpu:gloo"


def test_register_backend_adds_a_name() -> None:
    with pytest.warns(UserWarning, match=r"Device capability of unit_plugin unspecified"):
        dist.Backend.register_backend("unit_plugin", _fake_creator)
    assert dist.Backend.UNIT_PLUGIN == "unit_plugin"  # type: ignore[attr-defined]
    assert "unit_plugin" in dist.Backend.backend_list
    assert dist.is_backend_available("unit_plugin")


# -- ReduceOp ----------------------------------------------------------------------------------
def test_reduce_op_and_its_deprecated_alias() -> None:
    assert dist.ReduceOp.SUM == RedOpType.SUM and int(dist.ReduceOp.MAX) == int(tdd.ReduceOp.MAX)
    for name in ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]:
        assert int(getattr(dist.ReduceOp, name)) == int(getattr(tdd.ReduceOp.RedOpType, name))
    assert dist.ReduceOp(dist.ReduceOp.MIN) == dist.ReduceOp.MIN
    with pytest.raises(TypeError):
        dist.ReduceOp()  # type: ignore[call-arg]  # (an op must be named, as torch's)
    with pytest.warns(FutureWarning, match=r"reduce_op"):
        assert dist.reduce_op.SUM == dist.ReduceOp.SUM
    assert C.supports_complex(RedOpType.SUM) and not C.supports_complex(RedOpType.MAX)
    assert dist.supports_complex(dist.ReduceOp.AVG) == tdd.supports_complex(tdd.ReduceOp.AVG)
    assert dist.supports_complex(reduceOp=dist.ReduceOp.SUM)  # torch's keyword


def test_reduce_op_members_are_instances_of_reduce_op_as_in_torch() -> None:
    for ours, theirs in [(dist.ReduceOp.SUM, tdd.ReduceOp.SUM), (dist.ReduceOp(dist.ReduceOp.MAX),
                                                                  tdd.ReduceOp(tdd.ReduceOp.MAX))]:
        assert isinstance(ours, dist.ReduceOp) == isinstance(theirs, tdd.ReduceOp) is True
    assert not isinstance(0, dist.ReduceOp) and not isinstance("sum", dist.ReduceOp)
    assert dist.ReduceOp(dist.ReduceOp.MAX) == dist.ReduceOp.MAX  # (the other way round: False, as torch's)
    assert dist.ReduceOp(dist.ReduceOp.MAX) == dist.ReduceOp(dist.ReduceOp.MAX) != dist.ReduceOp.MIN


def test_an_op_of_either_library_goes_to_the_functions_of_both() -> None:
    """``tdist.ReduceOp`` is torch's: a program that takes its ops from one library and its
    functions from the other (or hands them to torch's modules) works both ways."""
    assert dist.ReduceOp is tdd.ReduceOp and dist.ReduceOp.MAX is tdd.ReduceOp.MAX
    for op in (tdd.ReduceOp.MAX, tdd.ReduceOp(tdd.ReduceOp.MAX), tdd.ReduceOp.RedOpType.MAX, RedOpType.MAX):
        assert as_red_op(op) is RedOpType.MAX
    assert as_red_op(tdd._make_nccl_premul_sum(2.0)) is RedOpType.PREMUL_SUM
    for bad in (4, "max", None, torch.ones(1)):
        with pytest.raises(ValueError, match="Invalid ReduceOp"):
            as_red_op(bad)


# -- argument checks ---------------------------------------------------------------------------
def test_non_tensor_arguments_raise_torchs_type_error() -> None:
    with pytest.raises(TypeError) as ours:
        C.as_tensor([1], "tensor")
    with pytest.raises(TypeError) as theirs:
        tdd.distributed_c10d._check_single_tensor([1], "tensor")
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError) as ours:
        C.as_tensor_list((torch.ones(1),), "tensor_list")
    with pytest.raises(TypeError) as theirs:
        tdd.distributed_c10d._check_tensor_list((torch.ones(1),), "tensor_list")
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match=r"elements of type"):
        C.as_tensor_list([torch.ones(1), 3], "tensor_list")


def test_numpy_arrays_share_memory() -> None:
    a = np.arange(4, dtype=np.int32)
    t = C.as_tensor(a, "tensor")
    t.add_(10)
    assert a.tolist() == [10, 11, 12, 13]
    ts = C.as_tensor_list([np.zeros(2), torch.ones(2)], "tensor_list")
    assert [x.dtype for x in ts] == [torch.float64, torch.float32]
    ro = np.zeros(3)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match=r"read-only numpy array"):
        C.as_tensor(ro, "tensor")
    with pytest.raises(ValueError, match=r"cannot share"):
        C.as_tensor(np.arange(4)[::-1], "tensor")


def test_dtype_mismatch_message_is_torchs() -> None:
    a, b = torch.ones(1), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError) as ours:
        C.ensure_same_dtype([a, b], a)
    with pytest.raises(ValueError) as theirs:
        tdd.distributed_c10d._ensure_all_tensors_same_dtype([a, b], a)
    assert str(ours.value) == str(theirs.value)
    C.ensure_same_dtype(torch.ones(1, dtype=torch.complex64), torch.ones(1))  # complex with its reals


def test_rank_and_list_checks() -> None:
    with pytest.raises(ValueError, match=r"^Invalid destination rank: destination rank should not be"):
        C.check_not_self_rank(1, 1, "destination")
    C.check_not_self_rank(1, 0, "destination")
    with pytest.raises(C.CollectiveArgumentError, match=r"broadcast: invalid root rank: 5"):
        C.check_root_rank(5, 2, "broadcast", "src")
    with pytest.raises(RuntimeError) as err:
        C.check_root_rank(-1, 2, "reduce", "dst")
    assert isinstance(err.value, ValueError)  # both what torch users catch and what it is
    with pytest.raises(C.CollectiveArgumentError, match=r"output tensor list size 1.*group \(2\)"):
        C.check_list_len([1], 2, "all_gather", "output tensor list")
    with pytest.raises(ValueError, match=r"^Argument ``gather_list`` must be specified on destination rank.$"):
        C.check_rooted_list(0, 0, [], "gather", "gather_list", 2)
    with pytest.raises(ValueError, match=r"must NOT be specified on non-destination ranks"):
        C.check_rooted_list(1, 0, [torch.ones(1)], "gather", "gather_list", 2)
    with pytest.raises(ValueError, match=r"scatter_list`` must be specified on source rank"):
        C.check_rooted_list(0, 0, None, "scatter", "scatter_list", 2)
    with pytest.raises(C.CollectiveArgumentError, match=r"size 3"):
        C.check_rooted_list(0, 0, [1, 2, 3], "gather", "gather_list", 2)
    with pytest.raises(TypeError, match=r"tag must be an int"):
        C.check_tag("x")


def test_bitwise_ops_need_integers() -> None:
    with pytest.raises(C.CollectiveArgumentError, match=r"Cannot use ReduceOp.BAND with non-integral dtype"):
        C.check_bitwise_dtype(RedOpType.BAND, [torch.ones(1)], "all_reduce")
    C.check_bitwise_dtype(RedOpType.BXOR, [torch.ones(1, dtype=torch.bool)], "all_reduce")
    C.check_bitwise_dtype(RedOpType.SUM, [torch.ones(1)], "all_reduce")
    with pytest.raises(ValueError, match=r"^all_reduce does not support RedOpType.MAX on complex tensors$"):
        C.check_complex_op(RedOpType.MAX, [torch.ones(1, dtype=torch.cfloat)], "all_reduce")


def test_gather_into_tensor_shapes() -> None:
    inp = torch.ones(2, 3)
    C.check_all_gather_single(torch.empty(8, 3), inp, 4, "all_gather_into_tensor")  # concatenated
    C.check_all_gather_single(torch.empty(4, 2, 3), inp, 4, "all_gather_into_tensor")  # stacked
    C.check_all_gather_single(torch.empty(3), torch.tensor(1.0), 3, "x")  # scalars stack
    with pytest.raises(C.CollectiveArgumentError, match=r"must be \(8, 3\) \(concatenated\) or \(4, 2, 3\)"):
        C.check_all_gather_single(torch.empty(24), inp, 4, "all_gather_into_tensor")
    C.check_reduce_scatter_single(torch.empty(2), torch.empty(6), 3, "reduce_scatter_tensor")
    with pytest.raises(C.CollectiveArgumentError, match=r"input tensor size must be equal to world_size"):
        C.check_reduce_scatter_single(torch.empty(2), torch.empty(5), 3, "reduce_scatter_tensor")


def test_split_sizes() -> None:
    t = torch.empty(6, 2)
    assert C.check_split_sizes(t, None, 3, "a2a", "input") == [2, 2, 2]
    assert C.check_split_sizes(t, [], 2, "a2a", "input") == [3, 3]
    assert C.check_split_sizes(t, [1, 0, 5], 3, "a2a", "input") == [1, 0, 5]
    with pytest.raises(C.CollectiveArgumentError, match=r"not divisible by the group size"):
        C.check_split_sizes(t, None, 4, "a2a", "input")
    with pytest.raises(C.CollectiveArgumentError, match=r"Split sizes doesn't match total dim 0 size"):
        C.check_split_sizes(t, [1, 2, 2], 3, "a2a", "input")
    with pytest.raises(C.CollectiveArgumentError, match=r"has 2 entries, but the group has 3"):
        C.check_split_sizes(t, [3, 3], 3, "a2a", "input")
    with pytest.raises(C.CollectiveArgumentError, match=r"must not be negative"):
        C.check_split_sizes(t, [7, -1], 2, "a2a", "input")


# -- objects -----------------------------------------------------------------------------------
def test_object_pickling_round_trip() -> None:
    objs = [1, "two", {"three": [3.0]}, None, torch.arange(3), b""]
    data, sizes = objects_to_tensor(objs)
    assert data.dtype == torch.uint8 and sizes.dtype == torch.long and sizes.numel() == len(objs)
    assert int(sizes.sum()) == data.numel()
    back = tensor_to_objects(data, sizes)
    assert back[:4] == objs[:4] and back[5] == b""
    assert torch.equal(back[4], objs[4])
    t, n = object_to_tensor({"a": 1})
    padded = torch.cat([t, torch.zeros(7, dtype=torch.uint8)])
    assert tensor_to_object(padded, n) == {"a": 1}
    assert objects_to_tensor([])[0].numel() == 0


# -- rank mapping (pure) -----------------------------------------------------------------------
def test_rank_mapping_helpers() -> None:
    ranks = {3: 0, 1: 1, 5: 2}
    assert G.group_rank_of(ranks, 5, "g") == 2
    assert G.global_rank_of(ranks, 1, "g") == 1
    with pytest.raises(ValueError, match=r"^Global rank 2 is not part of group g$"):
        G.group_rank_of(ranks, 2, "g")
    with pytest.raises(ValueError, match=r"^Group rank 3 is not part of group g$"):
        G.global_rank_of(ranks, 3, "g")
    assert G.canonical_rank(ranks, 3, None, False, "g") == 0
    assert G.canonical_rank(ranks, None, 2, True, "g") == 5
    assert G.canonical_rank(ranks, None, 2, False, "g") == 2
    assert G.canonical_rank(None, 7, None, False, "world") == 7  # default group: identity
    with pytest.raises(ValueError, match=r"Can't specify both group_rank and global_rank"):
        G.canonical_rank(ranks, 3, 0, False, "g")
    with pytest.raises(ValueError, match=r"Must specify global_rank or group_rank"):
        G.canonical_rank(ranks, None, None, False, "g")


def test_new_group_rank_rules_match_torch() -> None:
    assert G.new_group_ranks(None, 3) == [0, 1, 2]
    assert G.new_group_ranks([2, 0], 3) == [0, 2]
    assert G.new_group_ranks([2, 0], 3, sort_ranks=False) == [2, 0]
    with pytest.raises(ValueError, match=r"^ranks list must not contain duplicate entries, got \[0, 0\]$"):
        G.new_group_ranks([0, 0], 2)
    with pytest.raises(ValueError, match=r"^Rank 7 is out of range. Valid ranks are 0 to 1 \(world_size=2\)$"):
        G.new_group_ranks([0, 7], 2)
    with pytest.raises(ValueError, match=r"less or equal to the world size"):
        G.new_group_ranks([0, 1, 2], 2)
    with pytest.raises(TypeError):
        G.new_group_ranks(["a"], 2)  # type: ignore[list-item]
    assert G.subgroup_rank_lists([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"^The arg 'group_size' \(3\) must not exceed the world size \(2\)$"):
        G.subgroup_rank_lists([0, 1], 3)
    with pytest.raises(ValueError, match=r"must be divisible"):
        G.subgroup_rank_lists([0, 1, 2], 2)
    with pytest.raises(ValueError, match=r"must be positive"):
        G.subgroup_rank_lists([0, 1], 0)
    with pytest.raises(ValueError, match=r"^Rank 1 has appeared in both subgroup \[0, 1\] and \[1\]$"):
        G.check_disjoint([[0, 1], [1]])
    with pytest.raises(ValueError, match=r"cannot be empty"):
        G.check_disjoint([])


# -- debug fingerprints ------------------------------------------------------------------------
def test_fingerprint_json_round_trip() -> None:
    fp = Fingerprint("all_gather", dtype="float32", sends={0: (1, 2)}, recvs={1: (3,)}, root=None)
    assert Fingerprint.from_json(fp.to_json()) == fp
    assert "all_gather(dtype=float32)" == fp.describe()


def test_compare_names_ranks_and_what_differs() -> None:
    a = Fingerprint("all_reduce", dtype="float32", shape=(4,), reduce_op="SUM")
    b = Fingerprint("broadcast", dtype="float32", shape=(4,), root=0)
    assert compare([a, a, a], 0) is None
    msg = compare([a, b, a], 2, seq=7, group="0")
    assert msg is not None
    assert msg.startswith("Detected mismatch between collectives on ranks (collective #7 of group '0')")
    assert "Rank 2 is running collective: all_reduce(op=SUM, dtype=float32, shape=[4])" in msg
    assert "but rank 1 is running collective: broadcast(root=0" in msg
    assert "differ in the following aspects: operation. " in msg  # (not the root/reduction of one op)
    c = Fingerprint("all_reduce", dtype="float64", shape=(4,), reduce_op="SUM")
    msg = compare([a, c], 0)
    assert msg is not None and "differ in the following aspects: dtype." in msg
    assert "ranks [0]: all_reduce" in msg and "ranks [1]: all_reduce" in msg


def test_compare_checks_who_sends_what_to_whom() -> None:
    def ag(mine: tuple[int, ...], outs: list[tuple[int, ...]]) -> Fingerprint:
        return Fingerprint("all_gather", dtype="int64", sends=dict.fromkeys(range(len(outs)), mine),
                           recvs=dict(enumerate(outs)))

    # uneven but consistent
    assert compare([ag((1,), [(1,), (2,)]), ag((2,), [(1,), (2,)])], 0) is None
    msg = compare([ag((1,), [(1,), (3,)]), ag((2,), [(1,), (3,)])], 1)
    assert msg is not None and "rank 1 sends a tensor of shape [2] to rank 0, which expects shape [3]" in msg


def test_checker_over_a_store_agrees_on_every_rank() -> None:
    store = dist.HashStore()

    def body(rank: int, ws: int) -> list[str]:
        checker = CollectiveChecker(dist.PrefixStore("dbg", store), rank, ws, timedelta(seconds=5), "g")
        out = []
        checker.check(Fingerprint("barrier"))
        try:
            checker.check(Fingerprint("all_reduce", dtype="float32", shape=(rank,), reduce_op="SUM"))
            out.append("ok")
        except CollectiveMismatchError as exc:
            out.append(str(exc))
        checker.check(Fingerprint("barrier"))
        return out

    results = run_threads(body, 3, timeout=20)
    for rank, (msg,) in enumerate(results):
        assert f"Rank {rank} is running collective: all_reduce(op=SUM, dtype=float32, shape=[{rank}])" in msg
        assert "collective #1 of group 'g'" in msg
    assert not store.check(["dbg/0/0"])  # old fingerprints are cleaned up


def test_checker_names_ranks_that_never_arrive() -> None:
    store = dist.HashStore()
    checker = CollectiveChecker(store, 0, 3, timedelta(milliseconds=100), "g")
    store.set("0/2", Fingerprint("barrier").to_json())
    with pytest.raises(dist.DistBackendError, match=r"ranks \[1\] did not reach collective #0"):
        checker.check(Fingerprint("barrier"))


def test_debug_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = dist.get_debug_level()
    try:
        monkeypatch.delenv("TDIST_DEBUG", raising=False)
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL
        monkeypatch.setenv("TDIST_DEBUG", "INFO")  # ours wins
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() == dist.DebugLevel.INFO
        monkeypatch.setenv("TDIST_DEBUG", "loud")
        with pytest.raises(ValueError, match=r"^The value of TDIST_DEBUG must be OFF, INFO, or DETAIL.$"):
            dist.set_debug_level_from_env()
        assert str(dist.DebugLevel.DETAIL) == str(tdd.DebugLevel.DETAIL)
        assert int(dist.DebugLevel.DETAIL) == int(tdd.DebugLevel.DETAIL)
    finally:
        dist.set_debug_level(before)


# -- the monitored barrier protocol over a store -----------------------------------------------
def test_monitored_barrier_passes_and_names_missing_ranks() -> None:
    store = dist.HashStore()

    def ok(rank: int, ws: int) -> str:
        G.monitored_barrier_via_store(store, rank, ws, 0, timedelta(seconds=5), False)
        return "ok"

    assert run_threads(ok, 3, timeout=20) == ["ok"] * 3

    def late(rank: int, ws: int, wait_all: bool, reported: threading.Event) -> str:
        if rank in (1, 3):  # late: they come once rank 0 has given up on them
            assert reported.wait(15), "rank 0's monitored barrier never ended"
        try:
            G.monitored_barrier_via_store(store, rank, ws, 1 + wait_all, timedelta(milliseconds=200), wait_all)
        except dist.DistBackendError as exc:
            return str(exc)
        finally:
            if rank == 0:
                reported.set()
        return "ok"

    first = run_threads(late, 4, False, threading.Event(), timeout=20)
    assert first[0] == "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 200 ms"
    assert all("Rank 1 failed to pass monitoredBarrier in 200 ms (as reported by rank 0)" in m for m in first[1:])
    every = run_threads(late, 4, True, threading.Event(), timeout=20)
    assert every[0] == "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 200 ms"


def test_monitored_barrier_without_rank_0() -> None:
    with pytest.raises(dist.DistBackendError, match=r"successfully reached monitoredBarrier, but received errors"):
        G.monitored_barrier_via_store(dist.HashStore(), 1, 2, 0, timedelta(milliseconds=10), False)


# -- init_process_group rules ------------------------------------------------------------------
def test_init_argument_rules() -> None:
    s = dist.HashStore()
    with pytest.raises(AssertionError, match=r"^Cannot specify both init_method and store.$"):
        dist.init_process_group(store=s, init_method="env://", rank=0, world_size=1)
    with pytest.raises(AssertionError, match=r"^world_size must be positive if using store$"):
        dist.init_process_group(store=s, rank=0)
    with pytest.raises(AssertionError, match=r"^rank must be non-negative if using store$"):
        dist.init_process_group(store=s, world_size=1)
    with pytest.raises(TypeError, match=r"^Expected timeout argument to be of type datetime.timedelta"):
        dist.init_process_group("fake1", store=s, rank=0, world_size=1, timeout=5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"doesn't have NCCL built in"):
        dist.init_process_group("nccl", store=s, rank=0, world_size=1)
    with pytest.raises(AssertionError, match=r"Unknown c10d backend type NOPE"):
        dist.init_process_group("nope", store=s, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"device_id is an int"):
        dist.init_process_group("fake1", store=s, rank=0, world_size=1, device_id=0)
    with pytest.raises(ValueError, match=r"Invalid rank 2 for world size 2"):
        dist.init_process_group("fake1", store=s, rank=2, world_size=2)
    assert not dist.is_initialized()


def test_extended_api_plugins_get_the_options_record() -> None:
    seen: list[Any] = []

    def creator(opts: Any, pg_options: Any) -> BackendImpl:
        seen.append((opts.group_rank, opts.group_size, opts.group_id, opts.global_ranks_in_group, pg_options))
        return FakeBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout)

    dist.Backend.register_backend("fake_ext", creator, extended_api=True, devices="cpu")
    dist.init_process_group("FAKE_EXT", store=dist.HashStore(), rank=0, world_size=1, pg_options="o")
    assert seen == [(0, 1, "0", [0], "o")]
    assert dist.get_backend() == "fake_ext"
    # (without mpi4py there is no mpi backend: torch's words, and what to install)
    with mock.patch("tdist.c10d._lifecycle.mpi4py_installed", return_value=False):
        with pytest.raises(RuntimeError, match=r"doesn't have MPI built in.*mpi4py"):
            dist.new_group([0], backend="mpi")


def test_init_env_rendezvous_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"environment variable RANK expected"):
        dist.init_process_group("fake1")
    assert not dist.is_initialized()


def test_init_twice_destroy_and_again() -> None:
    store = _init1()
    assert dist.is_initialized()
    assert dist.get_rank() == 0 and dist.get_world_size() == 1
    assert dist.get_backend() == "fake1" and dist.get_pg_count() == 1
    world = dist.group.WORLD
    assert world is dist.GroupMember.WORLD and world is dist.distributed_c10d._get_default_group()
    # a process's own world: torch's default group runs on ours, and group.WORLD is that twin,
    # which torch's modules take (DDP, FSDP, PowerSGDState(process_group=dist.group.WORLD))
    assert isinstance(world, torch.distributed.ProcessGroup) and world.rank() == 0 and world.size() == 1
    assert torch.distributed.distributed_c10d._get_default_group() is world
    # torch's private store helpers: the default group's namespace, by our handle or torch's
    default_store = dist.distributed_c10d._get_default_store()
    assert isinstance(default_store, dist.PrefixStore)
    assert dist.distributed_c10d._get_process_group_store(world) is default_store
    assert dist.distributed_c10d._get_process_group_store(_default_group()) is default_store
    pg = _default_group()
    # (both count as groups, as with torch.distributed; only the first is tdist's own)
    assert isinstance(pg, dist.ProcessGroup) and isinstance(world, dist.ProcessGroup)
    assert G.is_ours(pg) and not G.is_ours(world)
    assert pg.group_name == "0" and pg.group_desc == "default_pg" and pg.name() == "fake1"
    assert pg.rank() == 0 and pg.size() == 1
    with pytest.raises(ValueError, match=r"^trying to initialize the default process group twice!$"):
        dist.init_process_group("fake1", store=dist.HashStore(), rank=0, world_size=1)
    backend = FakeBackend.created[-1]
    dist.destroy_process_group()
    assert backend.closed and not dist.is_initialized() and dist.group.WORLD is None
    _init1(store=store)  # the same store again: a fresh namespace
    assert FakeBackend.created[-1].store is not backend.store
    assert dist.get_pg_count() == 1
    dist.destroy_process_group()


def test_store_layout_follows_torch() -> None:
    store = _init1()
    backend = FakeBackend.created[-1]
    backend.store.set("k", "v")
    assert store.get("0//cpu//k") == b"v"  # torch's "<group>/" then "<device>/" prefixes
    sub = dist.new_group([0])
    FakeBackend.created[-1].store.set("k", "w")
    assert store.get("0//1//cpu//k") == b"w"
    # a process's own world hands out torch's twin of the group (see test_init_twice...)
    assert isinstance(sub, torch.distributed.ProcessGroup) and sub.group_name == "1"
    assert _default_group().group_name == "0"


def test_backend_name_as_asked() -> None:
    _init1()
    assert dist.get_backend() == "fake1" and dist.get_backend_config() == "cpu:fake1"
    dist.destroy_process_group()
    # the timeout reaches the backend
    _init1(timeout=timedelta(seconds=7))
    assert FakeBackend.created[-1].timeout == timedelta(seconds=7)


def test_the_name_torch_knows_tdist_by_is_a_backend_of_tdists_own() -> None:
    """``import tdist as dist; dist.init_process_group("tdist")``, as a program that wrote
    torch's ``init_process_group(backend="tdist")`` and then changed its import says: the tcp
    backend, named as asked, as torch's group of it is."""
    assert dist.is_backend_available("tdist") and dist.Backend.TDIST == "tdist" == dist.Backend("TDIST")
    assert dist.is_backend_available("mpi") == dist.is_mpi_available()  # (the two say the same)
    dist.init_process_group("tdist", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "tdist" == tdd.get_backend() and dist.get_backend_config() == "cpu:tdist"
        assert dist.group.WORLD.name() == "tdist"
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_groups_of_one_rank() -> None:
    _init1()
    sub = dist.new_group([0], timeout=timedelta(seconds=3), group_desc="mine")
    assert isinstance(sub, torch.distributed.ProcessGroup)  # torch's twin of ours
    sub_backend = FakeBackend.created[-1]
    assert sub.group_desc == "mine" and sub_backend.timeout == timedelta(seconds=3)
    assert dist.get_rank(sub) == 0 and dist.get_world_size(sub) == 1
    assert dist.get_process_group_ranks(sub) == [0] and dist.get_process_group_ranks(None) == [0]
    assert dist.get_group_rank(sub, 0) == 0 and dist.get_global_rank(sub, 0) == 0
    assert dist.get_group_rank(dist.group.WORLD, 9) == 9  # identity on the default group, as torch
    with pytest.raises(ValueError, match=r"^Global rank 4 is not part of group"):
        dist.get_group_rank(sub, 4)
    with pytest.raises(ValueError, match=r"^Group rank 4 is not part of group"):
        dist.get_global_rank(sub, 4)
    for lookup in (dist.get_group_rank, dist.get_global_rank):  # (None is no group here, as torch)
        with pytest.raises(ValueError, match=r"^Group None is not registered"):
            lookup(None, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"group must be a ProcessGroup"):  # (torch: ValueError too)
        dist.all_reduce(torch.ones(1), group=5)  # type: ignore[arg-type]
    mine, subs = dist.new_subgroups(1)
    assert mine is subs[0] and len(subs) == 1
    with pytest.raises(ValueError, match=r"Default group size only takes effect when CUDA"):
        dist.new_subgroups()
    mine2, subs2 = dist.new_subgroups_by_enumeration([[0]])
    assert mine2 is subs2[0]
    local = dist.new_group([0], use_local_synchronization=True)
    assert isinstance(local, torch.distributed.ProcessGroup) and len(local.group_name) == 40  # a hash
    dist.destroy_process_group(sub)
    assert sub_backend.closed
    with pytest.raises(ValueError, match=r"^Invalid process group specified$"):
        dist.destroy_process_group(sub)
    with pytest.raises(ValueError, match=r"not registered"):
        dist.get_group_rank(sub, 0)


def test_collectives_reach_the_backend_with_group_ranks_and_options() -> None:
    _init1()
    backend = FakeBackend.created[-1]
    t = torch.ones(2)
    assert dist.all_reduce(t, op=dist.ReduceOp.MAX) is None
    op, opts = backend.calls[-1]
    assert op == "allreduce" and opts.reduceOp == RedOpType.MAX and opts.asyncOp is False
    work = dist.broadcast(t, 0, async_op=True)
    assert isinstance(work, Work) and work.is_completed()
    assert backend.calls[-1][1].rootRank == 0 and backend.calls[-1][1].asyncOp is True
    dist.reduce(t, 0, op=dist.ReduceOp.PRODUCT)
    assert backend.calls[-1][1].reduceOp == RedOpType.PRODUCT
    dist.barrier(timeout=timedelta(seconds=2))
    assert backend.calls[-1][1].timeout == timedelta(seconds=2)
    c = torch.ones(3, dtype=torch.cfloat)
    dist.all_reduce(c)  # complex travels as reals
    assert backend.calls[-1][0] == "allreduce"
    with pytest.raises(ValueError, match=r"does not support RedOpType.MIN on complex tensors"):
        dist.all_reduce(c, op=dist.ReduceOp.MIN)
    # (torch's all_reduce raises ValueError, gloo's reduce RuntimeError: both are caught)
    with pytest.raises(RuntimeError, match=r"reduce does not support RedOpType.MAX on complex tensors"):
        dist.reduce(c, dst=0, op=dist.ReduceOp.MAX)
    with pytest.raises(TypeError, match=r"Invalid ReduceOp"):
        dist.all_reduce(t, op="sum")  # type: ignore[arg-type]
    with pytest.raises(C.CollectiveArgumentError, match=r"Cannot use ReduceOp.BOR"):
        dist.all_reduce(t, op=dist.ReduceOp.BOR)
    with pytest.raises(C.CollectiveArgumentError, match=r"invalid root rank: 3"):
        dist.broadcast(t, 3)
    with pytest.raises(ValueError, match=r"Must specify global_rank or group_rank"):
        dist.broadcast(t)
    with pytest.raises(ValueError, match=r"Can't specify both"):
        dist.broadcast(t, 0, group_src=0)


def test_single_rank_collectives_and_numpy() -> None:
    _init1()
    a = np.arange(3, dtype=np.float32)
    out = [np.zeros(3, dtype=np.float32)]
    dist.all_gather(out, a)
    assert out[0].tolist() == [0.0, 1.0, 2.0]
    big = torch.zeros(1, 3)
    with pytest.warns(FutureWarning, match=r"all_gather_into_tensor` is deprecated"):
        dist.all_gather_into_tensor(big, torch.ones(3))
    assert big.tolist() == [[1.0, 1.0, 1.0]]
    g = [torch.zeros(2)]
    dist.gather(torch.ones(2), g, dst=0)
    assert g[0].tolist() == [1.0, 1.0]
    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), 3.0)], src=0)
    assert s.tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match=r"``scatter_list`` must be specified on source rank"):
        dist.scatter(s, None, src=0)
    with pytest.raises(C.CollectiveArgumentError, match=r"invalid tensor size at index 0 of gather_list"):
        dist.gather(torch.ones(2), [torch.zeros(3)], dst=0)
    r = torch.zeros(2)
    dist.reduce_scatter(r, [torch.full((2,), 5.0)])
    assert r.tolist() == [5.0, 5.0]
    with pytest.raises(C.CollectiveArgumentError, match=r"input tensor list size 2"):
        dist.reduce_scatter(r, [r, r])
    with pytest.warns(FutureWarning, match=r"reduce_scatter_tensor` is deprecated"):
        dist.reduce_scatter_tensor(r, torch.full((2,), 6.0))
    assert r.tolist() == [6.0, 6.0]
    o = [torch.zeros(1)]
    dist.all_to_all(o, [torch.ones(1)])
    assert o[0].item() == 1.0
    x = torch.zeros(4)
    dist.all_to_all_single(x, torch.arange(4.0))
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert FakeBackend.created[-1].calls[-1] == ("alltoall_base", ([4], [4]))
    objs: list[Any] = [None]
    dist.all_gather_object(objs, {"k": 1})
    assert objs == [{"k": 1}]
    with pytest.raises(IndexError, match=r"object_list has 0 entries, but the group has 1 ranks"):
        dist.all_gather_object([], 1)
    lst = [1, "a"]
    dist.broadcast_object_list(lst)
    assert lst == [1, "a"]
    gl: list[Any] = [None]
    dist.gather_object("x", gl)
    assert gl == ["x"]
    so: list[Any] = [None]
    dist.scatter_object_list(so, ["only"])
    assert so == ["only"]
    with pytest.raises(ValueError, match=r"^Expected argument scatter_object_output_list to be a list of size at least 1.$"):
        dist.scatter_object_list([], ["only"])
    dist.monitored_barrier(timeout=timedelta(seconds=1))
    with pytest.warns(UserWarning, match=r"Please specify timeout arg as a timedelta"):
        dist.monitored_barrier(timeout=1.0)


def test_multigpu_and_coalesced_forms_on_one_rank() -> None:
    _init1()
    ts = [torch.tensor([1, 5]), torch.tensor([4, 2])]
    dist.all_reduce_multigpu(ts, op=dist.ReduceOp.MAX)
    assert [t.tolist() for t in ts] == [[4, 5], [4, 5]]
    ts = [torch.tensor([1]), torch.tensor([2]), torch.tensor([3])]
    dist.broadcast_multigpu(ts, 0, src_tensor=1)
    assert [t.item() for t in ts] == [2, 2, 2]
    ts = [torch.tensor([1]), torch.tensor([2]), torch.tensor([3])]
    dist.reduce_multigpu(ts, 0, dst_tensor=2)
    assert [t.item() for t in ts] == [1, 2, 6]
    outs = [[torch.zeros(1), torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]]
    dist.all_gather_multigpu(outs, [torch.tensor([7.0]), torch.tensor([8.0])])
    assert [[t.item() for t in lst] for lst in outs] == [[7.0, 8.0], [7.0, 8.0]]
    rs = [torch.zeros(1), torch.zeros(1)]
    dist.reduce_scatter_multigpu(rs, [[torch.tensor([1.0]), torch.tensor([2.0])], [torch.tensor([10.0]), torch.tensor([20.0])]])
    assert [t.item() for t in rs] == [11.0, 22.0]
    c = [torch.ones(2), torch.ones(3)]
    with pytest.warns(FutureWarning, match=r"all_reduce_coalesced"):
        fut = dist.all_reduce_coalesced(c, async_op=True)
    assert [t.tolist() for t in fut.wait()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]
    outs2 = [[torch.zeros(1), torch.zeros(2)]]
    with pytest.warns(FutureWarning, match=r"all_gather_coalesced"):
        dist.all_gather_coalesced(outs2, [torch.tensor([3.0]), torch.tensor([4.0, 5.0])])
    assert [t.tolist() for t in outs2[0]] == [[3.0], [4.0, 5.0]]


def test_point_to_point_rules_on_one_rank() -> None:
    _init1()
    with pytest.raises(ValueError, match=r"^Invalid destination rank: destination rank should not be the same"):
        dist.send(torch.ones(1), 0)
    with pytest.raises(ValueError, match=r"^Invalid source rank: source rank should not be the same"):
        dist.recv(torch.ones(1), 0)
    with pytest.raises(C.CollectiveArgumentError, match=r"invalid destination rank 3"):
        dist.isend(torch.ones(1), 3)
    with pytest.raises(TypeError, match=r"tag must be an int"):
        dist.isend(torch.ones(1), 0, tag="x")  # type: ignore[arg-type]
    work = dist.isend(torch.ones(1), 0)  # to oneself: allowed, as torch
    assert isinstance(work, Work)
    with pytest.raises(ValueError, match=r"^Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend``"):
        dist.P2POp(dist.send, torch.ones(1), 0)
    op = dist.P2POp(dist.isend, torch.ones(1), 0)
    assert op.peer == 0 and op.group_peer == 0 and op.group is dist.group.WORLD
    assert repr(op) == "P2POp(isend pg=0, group_src=0, group_dst=0,  torch.Size([1]), torch.float32)"
    with pytest.raises(ValueError, match=r"Each op is expected to to be of type"):
        dist.batch_isend_irecv([1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"p2p_op_list is empty"):
        dist.batch_isend_irecv([])
    works = dist.batch_isend_irecv([op, dist.P2POp(dist.irecv, torch.ones(1), 0)])
    assert len(works) == 2


# -- world per thread --------------------------------------------------------------------------
def test_ranks_as_threads_get_worlds_of_their_own() -> None:
    store = dist.HashStore()
    barrier = threading.Barrier(3)

    def body(rank: int, ws: int) -> tuple[Any, ...]:
        dist.init_process_group("fake1", store=store, rank=rank, world_size=ws)
        try:
            sub = dist.new_group([2, 0])
            barrier.wait(5)
            if sub == dist.GroupMember.NON_GROUP_MEMBER:
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    assert dist.all_reduce(torch.ones(1), group=sub) is None
                return ("non-member", dist.get_rank(sub), str(w[0].message))
            assert isinstance(sub, dist.ProcessGroup)
            return (dist.get_rank(), dist.get_rank(sub), dist.get_world_size(sub),
                    dist.get_process_group_ranks(sub), dist.get_global_rank(sub, 1))
        finally:
            dist.destroy_process_group()

    res = run_threads(body, 3, timeout=20)
    assert res[0] == (0, 0, 2, [0, 2], 2)
    assert res[2] == (2, 1, 2, [0, 2], 2)
    assert res[1] == ("non-member", -1,
                      "Running all_reduce on global rank 1 which does not belong to the given group.")
    assert not dist.is_initialized()


def test_other_threads_see_the_first_world() -> None:
    _init1()
    seen: list[Any] = []
    t = threading.Thread(target=lambda: seen.append((dist.is_initialized(), dist.get_rank())))
    t.start()
    t.join(5)
    assert seen == [(True, 0)]


# -- the public surface ------------------------------------------------------------------------
DELIBERATELY_MISSING = {
    # DDP's C++ machinery (reducer, comm hooks, bucketing): torch's, not a communication layer
    "BuiltinCommHookType": "DDP internals",
    "GradBucket": "DDP internals",
    "Logger": "DDP internals",
    "Reducer": "DDP internals",
    "_register_builtin_comm_hook": "DDP internals",
    "_register_comm_hook": "DDP internals",
    "_compute_bucket_assignment_by_size": "DDP internals",
    "_DEFAULT_FIRST_BUCKET_BYTES": "DDP internals",
    "_broadcast_coalesced": "DDP internals",
    "_verify_params_across_processes": "DDP internals",
    # device meshes and accelerator-only features
    "DeviceMesh": "device meshes are out of scope",
    "init_device_mesh": "device meshes are out of scope",
    "device_mesh": "device meshes are out of scope",
    "_mesh_layout": "device meshes are out of scope",
    "_pycute": "device meshes are out of scope",
    "split_group": "NCCL-only in torch",
    "shrink_group": "NCCL-only in torch",
    "_make_nccl_premul_sum": "NCCL-only in torch",
    "_time_estimator": "NCCL-only in torch",
    # C++ classes of torch's own backends and wrappers
    "ProcessGroupGloo": "gloo's C++ class; our tcp backend serves backend='gloo'",
    "_Backend": "torch's C++ backend base; ours is tdist.c10d._backend.Backend",
    "_Work": "torch's C++ Work; ours is tdist.Work",
    "_create_process_group_wrapper": "torch's debug wrapper; ours is CollectiveChecker",
    "_ControlCollectives": "torch's C++ store collectives",
    "_StoreCollectives": "torch's C++ store collectives",
    "_test_python_store": "torch's C++ test helper",
    "_create_store_from_options": "torch's C++ helper",
    "_coalescing_manager": "coalescing is an NCCL optimization; not implemented",
    "_CoalescingManager": "coalescing is an NCCL optimization; not implemented",
    "_meta_registrations": "torch compile internals",
    "_is_spmd_types_available": "torch compile internals",
    "record_comm": "torch's tracing hook",
    "GroupName": "a typing alias",
    "RankType": "a typing alias",
    "_get_process_group_name": "private",
    "_rank_not_in_group": "private",
    "_remote_device": "RPC device strings; not part of c10d",
    "remote_device": "RPC device strings; not part of c10d",
    "breakpoint": "a pdb helper; not implemented",
    "_breakpoint_cache": "a pdb helper; not implemented",
    "_make_distributed_pdb": "a pdb helper; not implemented",
    # submodules that are other parts of tdist, or torch's own
    "rpc": "tdist.rpc is a separate module",
    "autograd": "tdist.autograd is a separate module",
    "algorithms": "torch's DDP algorithms",
    "config": "torch's config module",
    "constants": "torch's constants module",
    "utils": "torch's utils module",
    "c10d_logger": "torch's logging module",
    "logging_handlers": "torch's logging module",
    "distributed_c10d": "torch's module; ours is tdist.c10d._api",
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_public_surface_against_torch() -> None:
    theirs = {
        n for n in dir(tdd)
        if (not n.startswith("__") and not isinstance(getattr(tdd, n), types.ModuleType))
        or n in ("rpc", "autograd", "algorithms", "distributed_c10d", "device_mesh", "config",
                 "constants", "utils", "c10d_logger", "logging_handlers")
    }
    theirs -= {"sys", "torch", "typing", "traceback", "timedelta", "log", "logging"}
    missing = {n for n in theirs if not hasattr(dist, n)}
    unexplained = sorted(missing - set(DELIBERATELY_MISSING))
    assert not unexplained, f"torch.distributed names missing from tdist: {unexplained}"
    # everything torch.distributed.distributed_c10d promises in __all__ is present
    promised = set(tdd.distributed_c10d.__all__) - set(DELIBERATELY_MISSING)
    assert not sorted(n for n in promised if not hasattr(dist, n))
    for n in ["all_reduce_multigpu", "broadcast_multigpu", "reduce_multigpu", "all_gather_multigpu",
              "reduce_scatter_multigpu", "monitored_barrier", "set_debug_level", "Work"]:
        assert hasattr(dist, n)
    assert sorted(dist.__all__) == sorted(set(dist.__all__))
    for n in dist.__all__:
        assert hasattr(dist, n), n


@pytest.mark.parametrize(
    "program",
    [
        # the module path first (torch's custom-scheme recipe), then the function
        "from tdist.rendezvous import register_rendezvous_handler\nimport tdist\nfn = tdist.rendezvous",
        # the function first (the package loaded), then the module path
        "import tdist\ntdist.init_process_group\nfn = tdist.rendezvous\nimport tdist.rendezvous",
    ],
)
def test_rendezvous_is_a_module_path_and_a_function_in_any_import_order(program: str) -> None:
    import subprocess
    import sys

    check = (
        "\nfrom tdist.rendezvous import register_rendezvous_handler, _rendezvous_handlers"
        "\nregister_rendezvous_handler('mine', lambda url, **kw: iter([(None, 0, 1)]))"
        "\nassert next(fn('mine://x')) == (None, 0, 1) and 'tcp' in _rendezvous_handlers"
        "\nstore, rank, world = next(fn('tcp://127.0.0.1:0?rank=0&world_size=1'))"
        "\nprint(rank, world, type(store).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", program + check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "TCPStore"]


_LOG_PROGRAM = """
import logging, sys
import torch
if sys.argv[1] == "basicConfig":
    logging.basicConfig(level=logging.WARNING)  # (the program's own logging takes tdist's records)
if sys.argv[1] == "root_info":  # (as hydra does: torch's c10d prints nothing more for it)
    logging.basicConfig(level=logging.INFO)
import tdist as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
print("done")
"""


@pytest.mark.parametrize(
    ("level", "setup", "ready_lines", "warnings_shown"),
    [
        ("INFO", "", 1, True),
        ("0", "", 1, True),
        ("INFO", "basicConfig", 1, True),  # (once, by the program's handler)
        ("ERROR", "", 0, False),
        ("", "", 0, True),
        ("", "root_info", 0, True),
    ],
)
def test_torch_cpp_log_level_shows_tdists_log(level: str, setup: str, ready_lines: int, warnings_shown: bool) -> None:
    # torch's TORCH_CPP_LOG_LEVEL=INFO prints what c10d does on stderr; tdist's c10d says it too
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "TDIST_SECRET")}
    env["TORCH_CPP_LOG_LEVEL"] = level
    done = subprocess.run(
        [sys.executable, "-c", _LOG_PROGRAM, setup or "-"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0 and done.stdout.split() == ["done"], done.stderr
    assert done.stderr.count("process group '0' ready") == ready_lines, done.stderr
    assert ("accepts any client" in done.stderr) == warnings_shown, done.stderr


def test_work_is_success_while_pending_as_torchs() -> None:
    """torch's ``is_success`` is ``!exception_`` (deprecated): True until the work fails."""
    work = Work("all_reduce")
    assert not work.is_completed() and work.is_success()
    work._fail(RuntimeError("lost"))
    assert work.is_completed() and not work.is_success()
    done = Work("all_reduce")
    done._complete([])
    assert done.is_completed() and done.is_success()


def test_destroying_a_group_after_the_default_one_is_torchs_value_error() -> None:
    _init1()
    world, sub = dist.group.WORLD, dist.new_group([0])
    dist.destroy_process_group()
    for gone in (world, sub):  # (torch looks them up in its map of groups, empty now)
        with pytest.raises(ValueError, match=r"^Invalid process group specified$"):
            dist.destroy_process_group(gone)
        # torch's gloo group lives on in its object and still runs collectives; tdist's
        # destroy released the group's connections: a ValueError naming the group
        with pytest.raises(ValueError, match=r"is not registered"):
            dist.all_reduce(torch.ones(1), group=gone)
    with pytest.raises(AssertionError, match=r"^Process group cannot be None"):
        dist.destroy_process_group()


def test_distributed_c10d_is_an_attribute_of_a_fresh_import() -> None:
    """``import tdist as dist; dist.distributed_c10d`` as the first use, as with torch's package
    (where torch.distributed has it loaded)."""
    code = "import tdist as dist; print(dist.distributed_c10d.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "tdist.distributed_c10d", done.stderr


def test_process_group_takes_torchs_two_constructors() -> None:
    """``ProcessGroup(rank, size)`` (torch's tests subclass it so for a Python backend) and
    ``ProcessGroup(store, rank, size)``."""

    class Dummy(dist.ProcessGroup):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)

    for pg in (Dummy(1, 2), dist.ProcessGroup(0, 3), dist.ProcessGroup(dist.HashStore(), 1, 2), dist.ProcessGroup(rank=0, size=2)):
        assert (pg.rank(), pg.size()) in ((1, 2), (0, 3), (0, 2))
    with pytest.raises(RuntimeError, match="without a store"):
        Dummy(0, 1).get_group_store()
    with pytest.raises(TypeError):
        dist.ProcessGroup(0)  # type: ignore[call-arg]
    # name(): "undefined" for a bare group, a Python backend's getBackendName() (as torch's)
    assert Dummy(0, 1).name() == "undefined"

    class Named(Dummy):
        def getBackendName(self) -> str:
            return "Dummy"

    assert Named(0, 1).name() == "Dummy"


@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_torchs_twin_of_a_group_is_named_by_the_backend_the_program_asked_for(backend: str) -> None:
    """torch's test_init_process_group_for_all_backends: after ``init_process_group("gloo")``
    the default group's ``name()`` is "gloo" (torch's twin of tdist's group, which torch's own
    code knows as running on "tdist"); a sub-group's twin too."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.distributed_c10d._get_default_group()
        assert world.name() == backend and dist.get_backend() == backend
        assert tdd.get_backend() == "tdist"  # (torch's view: its group runs on tdist's backend)
        sub = dist.new_group([0])
        assert sub.name() == backend and isinstance(sub, tdd.ProcessGroup)
    finally:
        dist.destroy_process_group()
