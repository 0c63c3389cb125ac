"""Launching and supervising jobs: the agent behind ``tdist run`` (the project's torchrun).

``launch(LaunchConfig(...))`` runs one node's workers and returns the exit code; the decisions
it makes (root cause, restarts, exit code, worker environment) are pure functions in
``tdist.elastic._policy``.
"""

from ._agent import LaunchError, LocalAgent, launch
from ._inspect import report_progress
from ._policy import LaunchConfig

__all__ = ["LaunchConfig", "LaunchError", "LocalAgent", "launch", "report_progress"]
