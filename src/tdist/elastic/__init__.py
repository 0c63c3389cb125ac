"""Launching and supervising jobs: the agent behind ``tdist run`` (the project's torchrun).

``launch(LaunchConfig(...))`` runs one node's workers and returns the exit code; the decisions
it makes (root cause, restarts, exit code, worker environment) are pure functions in
``tdist.elastic._policy``.

The names load on first use: a worker of ``tdist run`` imports ``tdist.elastic._inspect`` when
it imports tdist (``tdist._under_tdist_run``), and a worker that never imports torch must not
import it there (the agent's modules do, through the exception tree: about 1.2 s of CPU).
"""

from __future__ import annotations

from .._core import lazy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._agent import LaunchError, LocalAgent, launch
    from ._inspect import report_progress
    from ._policy import LaunchConfig

__all__ = ["LaunchConfig", "LaunchError", "LocalAgent", "launch", "report_progress"]

_WHERE = {
    "LaunchConfig": "._policy",
    "LaunchError": "._agent",
    "LocalAgent": "._agent",
    "launch": "._agent",
    "report_progress": "._inspect",
}

__getattr__, __dir__ = lazy.names(__name__, _WHERE)
