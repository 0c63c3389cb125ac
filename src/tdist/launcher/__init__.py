"""``torch.distributed.launcher`` under tdist's name: ``elastic_launch`` (see ``api``)."""

from .api import LaunchConfig, elastic_launch, launch_agent

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]
