"""``tdist.elastic.agent.server.local_elastic_agent``: the module path of torch's (see
``_local``)."""

from ._local import (
    TORCHELASTIC_ENABLE_FILE_TIMER,
    TORCHELASTIC_HEALTH_CHECK_PORT,
    TORCHELASTIC_TIMER_FILE,
    TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT,
    LocalElasticAgent,
)

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_TIMER_FILE",
    "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT",
    "LocalElasticAgent",
]
