"""``tdist.elastic.agent.server``: torchelastic's elastic agent API
(``torch.distributed.elastic.agent.server``).

The agent is the control plane of a job on one node: it starts the workers with what they need
to call ``init_process_group``, watches them, restarts them all when one fails (up to
``WorkerSpec.max_restarts``), and restarts them with the new members when nodes join. Usage::

    params = RendezvousParameters("c10d", "localhost:0", run_id, min_nodes=1, max_nodes=1)
    spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=get_rendezvous_handler(params),
                      entrypoint=train, args=(...), max_restarts=1)
    result = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs()).run()
    if result.is_failed(): ...result.failures[rank]...  else: ...result.return_values[rank]...

``LocalElasticAgent`` runs on tdist's launcher (``tdist run``'s agent); ``SimpleElasticAgent``
is torch's scaffolding for agents of one's own. See ``local_elastic_agent`` for what a rendezvous handler
must provide and where tdist's agent differs from torch's.
"""

from . import api, local_elastic_agent
from .api import (
    ElasticAgent,
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from .local_elastic_agent import (
    TORCHELASTIC_ENABLE_FILE_TIMER,
    TORCHELASTIC_TIMER_FILE,
    LocalElasticAgent,
)

__all__ = [  # (torch's package: its modules, api's names, two of local_elastic_agent's constants)
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "ElasticAgent",
    "LocalElasticAgent",
    "RunResult",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "api",
    "local_elastic_agent",
]
