"""``breakpoint``: the Python debugger on one rank while every other rank waits for it
(``torch.distributed.breakpoint``)."""

from __future__ import annotations

import logging
import pdb
import sys
from datetime import timedelta
from typing import Any

__all__ = ["breakpoint"]

log = logging.getLogger(__name__)

_skipped: dict[tuple[str, int], int] = {}  # calls seen so far, by call site


class _TerminalPdb(pdb.Pdb):
    """pdb that talks to the terminal: a worker's own stdin is often not it (``tdist run``
    and ``torchrun`` give their workers other ones), so each session opens ``/dev/stdin``."""

    def interaction(self, *args: Any, **kwargs: Any) -> None:
        own = sys.stdin
        try:
            with open("/dev/stdin") as terminal:
                sys.stdin = terminal
                super().interaction(*args, **kwargs)
        finally:
            sys.stdin = own


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:
    """Stop in the debugger on ``rank`` only; every rank of the default group waits (a
    barrier) until that rank continues.

    Args:
        rank: the rank that stops (global).
        skip: let the first ``skip`` calls from this line pass without stopping.
        timeout_s: how long the other ranks wait for the debugging rank (``None``: the default
            group's timeout).
    """
    from ._collectives import barrier
    from ._world import get_rank

    if skip > 0:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        seen = _skipped[site] = _skipped.get(site, 0) + 1
        if seen <= skip:
            log.warning("Skip the breakpoint, counter=%d", seen)
            return
    if get_rank() == rank:
        debugger = _TerminalPdb()
        debugger.message(
            f"\n!!! ATTENTION !!!\n\nType 'up' to get to the frame that called dist.breakpoint(rank={rank})\n"
        )
        debugger.set_trace()  # (it stops on the barrier below: 'up' is the caller)
    barrier(timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
