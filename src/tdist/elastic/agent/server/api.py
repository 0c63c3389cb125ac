"""``tdist.elastic.agent.server.api``: the module path of torch's (see ``_api``)."""

from ._api import (
    ElasticAgent,
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

__all__ = ["ElasticAgent", "RunResult", "SimpleElasticAgent", "Worker", "WorkerGroup", "WorkerSpec", "WorkerState"]
