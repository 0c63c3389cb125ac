"""What torch's own RPC tests check of a program, beyond values: the errors' types and words, a
callee's report of a failed function on its stderr, forked RRefs confirmed before the callee
runs, a timeout on the first contact, and RRefs after shutdown. Over both agents; ``TDIST_RPC_TEST_IMPL=torch`` runs it on
torch's (see ``_rpc_harness``).
"""

from __future__ import annotations

import io
import re
import sys
from typing import Any

import pytest
import torch

from . import rpc_funcs as f
from ._rpc_harness import BACKENDS, TIMEOUT_RE, TORCH, Worker, rpc, run

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", BACKENDS)]

if TORCH:
    import torch.distributed.rpc.internal as internal
else:
    import tdist.rpc.internal as internal  # type: ignore[no-redef]


class _Tee(io.TextIOBase):
    """``sys.stderr`` while a scenario runs: kept, and passed on."""

    def __init__(self, to: Any) -> None:
        self.to, self.kept = to, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return int(self.to.write(s))


def _torch_words(w: Worker) -> dict[str, Any]:
    p, q = w.peer(1), w.peer(2)
    tee = _Tee(sys.stderr)
    sys.stderr = tee
    out: dict[str, Any] = {}
    try:
        # a call that times out on the first contact with its callee is a timeout, and the
        # connection serves the next call
        with pytest.raises(RuntimeError, match=TIMEOUT_RE):
            rpc.rpc_sync(q, f.sleep_then, args=(0.5, 1), timeout=0.001)
        assert rpc.rpc_sync(q, f.add, args=(1, 1)) == 2

        # the first RRef this worker makes: ids as torch numbers them
        rref = rpc.remote(p, torch.add, args=(torch.ones(1), torch.ones(1)))
        me, owner = rpc.get_worker_info(), rpc.get_worker_info(p)
        with pytest.raises(RuntimeError, match=re.escape(
            f"For UserRRef(rref_id=GloballyUniqueId(created_on={w.rank}, local_id=0), "
            f"fork_id=GloballyUniqueId(created_on={w.rank}, local_id=1)), can't call localValue() on user "
            f"{me}. Call it on owner {owner}"
        )):
            rref.local_value()

        # a third worker that receives the RRef runs once the owner has confirmed its fork
        out["third_sees_confirmed"] = [
            rpc.rpc_sync(q, f.rref_info, args=(rpc.remote(p, f.add, args=(i, 1)),))["confirmed"] for i in range(5)
        ]

        # a proxy's method is looked up at the call, remote() too
        counter = rpc.remote(p, f.Counter, args=(1,))
        with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
            counter.rpc_sync().non_exist()
        with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
            counter.rpc_async().non_exist().wait()
        with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
            counter.remote().non_exist()

        # RRef.backward
        with pytest.raises(RuntimeError, match="tensors does not require grad and does not have a grad_fn"):
            rpc.RRef(torch.rand(10)).backward()
        with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
            rpc.RRef(torch.rand(10, requires_grad=True)).backward()
        with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
            rpc.RRef(torch.rand(10, requires_grad=True).sum()).backward(100)
        with pytest.raises(RuntimeError, match=re.escape("RRef should contain a tensor for .backward()")):
            rpc.RRef("foo").backward()
        with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to be specified"):
            rref.backward()

        # an exception that cannot be made from its message alone
        with pytest.raises(RuntimeError) as info:
            rpc.rpc_sync(p, f.raise_error, args=("ThreeArgError", f"three-from-{w.me}"))
        assert "Original exception on remote side was" in str(info.value) and "ThreeArgError" in str(info.value)

        # a torch operator whose arguments fit none of its schemas
        with pytest.raises(RuntimeError, match="Overloaded torch operator invoked from Python failed to match any schema"):
            rpc.rpc_sync(p, torch.add, args=())

        # the callee reports a function that raised on its stderr
        with pytest.raises(ValueError, match=f"reported-by-{p}"):
            rpc.rpc_sync(p, f.raise_error, args=("ValueError", f"reported-by-{p}"))
        w.barrier()  # every callee has printed
        out["stderr"] = tee.kept.getvalue()
    finally:
        sys.stderr = tee.to

    # after a graceful shutdown, this worker's user RRefs are deleted (torch's words)
    w.shutdown()
    with pytest.raises(RuntimeError, match=re.escape("Cannot call to_here() on it after deletion.")):
        rref.to_here()
    with pytest.raises(RuntimeError, match=re.escape("Cannot call fork an UserRRef after deletion.")):
        internal.serialize(rref)
    return out


def test_torchs_errors_reports_and_fork_confirmation(backend: str) -> None:
    results = run(_torch_words, backend, world_size=3)
    for rank, out in enumerate(results):
        assert out["third_sees_confirmed"] == [True] * 5, (rank, out)
        caller = f"worker{(rank - 1) % 3}"
        assert f"On WorkerInfo(id={rank}, name=worker{rank}):" in out["stderr"], (rank, out["stderr"])
        assert f"ValueError('reported-by-worker{rank}')" in out["stderr"], (rank, caller, out["stderr"])
        assert "Traceback" in out["stderr"]
