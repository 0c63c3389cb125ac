"""A forked child has torch's autograd engine rebuilt before any of its threads runs autograd.

torch marks its engine stale in a forked child and rebuilds it, unguarded, at the first use,
which may come from two threads at once (two RPC requests computing in their distributed
autograd contexts): a segmentation fault in the engine's destructor, in a few of 1,000 forks
where two threads start at once. tdist asks for the engine in the child's fork hook, while the
child has one thread (``tdist.c10d._threads``).
"""

from __future__ import annotations

import os
import select
from typing import Any

import torch

from tdist.c10d import _threads  # noqa: F401 (its fork hook)


def test_a_forked_child_asks_for_the_autograd_engine_in_its_fork_hook() -> None:
    engine = torch.autograd.Variable._execution_engine
    r, w = os.pipe()

    class Spy:
        def is_checkpoint_valid(self) -> Any:
            os.write(w, b"asked")
            return engine.is_checkpoint_valid()

    torch.autograd.Variable._execution_engine = Spy()  # type: ignore[assignment]
    try:
        pid = os.fork()
        if pid == 0:  # (the hooks have run: nothing else to do here)
            os._exit(0)
    finally:
        torch.autograd.Variable._execution_engine = engine
    os.close(w)
    try:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        ready, _, _ = select.select([r], [], [], 10)
        assert ready and os.read(r, 16) == b"asked", "the child's fork hooks did not ask for the engine"
    finally:
        os.close(r)
