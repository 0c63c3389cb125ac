"""``torch.distributed.elastic.timer.debug_info_logging``: what a file timer server logs about
the timers that expired in a pass."""

from __future__ import annotations

import logging

__all__ = ["log_debug_info_for_expired_timers"]

log = logging.getLogger(__name__)


def log_debug_info_for_expired_timers(run_id: str, expired_timers: dict[int, list[str]]) -> None:
    """Log the expired timers of run ``run_id`` (by pid, each as its JSON request), if any.

    Args:
        run_id: the job's id.
        expired_timers: the expired timers, by worker pid.
    """
    if expired_timers:
        log.info("timers expired in run %s: %s", run_id, expired_timers)
