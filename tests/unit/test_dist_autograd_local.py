"""Distributed autograd without RPC (torch's private ``_init``, ``_new_context``,
``_release_context``, ``_get_max_id``), run beside torch's own module: the same script, each in
a fresh interpreter (a worker id is for the life of the process), prints the same lines."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import importlib, sys
import torch
da = importlib.import_module(sys.argv[1])

def show(fn):
    try:
        print("ok", fn())
    except Exception as exc:
        print(type(exc).__name__, str(exc).replace("torch.distributed.autograd", "X"))

def enter():
    with da.context() as cid:
        return cid

show(enter)  # (no RPC, no _init: refused)
show(lambda: da._get_max_id())
da._init(3)
show(lambda: da._init(3))
show(lambda: da._init(4))
show(enter)
show(lambda: da._get_max_id())
ctx = da._new_context()
show(lambda: ctx._context_id() == da._current_context()._context_id())
show(lambda: da._new_context())
show(lambda: da._release_context(ctx._context_id()))
show(lambda: da._current_context())
show(lambda: da._release_context(12345))
show(lambda: da._retrieve_context(ctx._context_id()))
t = torch.ones(2, requires_grad=True)
with da.context() as cid:
    da.backward(cid, [(t * 3).sum()])
    da.backward(cid, [(t * t).sum()])
    print(sorted(g.tolist() for g in da.get_gradients(cid).values()), t.grad)
    print(da._get_debug_info())
print(da._get_debug_info(), flush=True)
import os
os._exit(0)  # (torch's container, made without RPC, can abort the interpreter's teardown)
"""


def _run(module: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, module], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_local_contexts_behave_as_torchs() -> None:
    ours, theirs = _run("tdist.autograd"), _run("torch.distributed.autograd")
    assert ours == theirs
    assert ours[0].startswith("RuntimeError Need to initialize distributed autograd")
    assert ours[4] == f"ok {3 << 48}"
