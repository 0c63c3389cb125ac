"""``torch.distributed.elastic.metrics.api``'s names (implemented in ``_api``)."""

from ._api import *  # noqa: F403  (the module path of torch's: the same names, one list)
from ._api import __all__ as __all__
