"""``tdist.optim``: ``DistributedOptimizer`` (``torch.distributed.optim``), and torch's optimizers
that run over a process group (``ZeroRedundancyOptimizer``, ``PostLocalSGDOptimizer``,
``as_functional_optim``), which run on tdist's groups as on gloo's."""

from __future__ import annotations

from torch.distributed.optim import (
    PostLocalSGDOptimizer,
    ZeroRedundancyOptimizer,
    as_functional_optim,
)

# torch's private names that code imports from torch.distributed.optim (torchrec's
# ``_apply_optimizer_in_backward``, ``_NamedOptimizer``, the functional optimizers)
from torch.distributed.optim.apply_optimizer_in_backward import (
    _apply_optimizer_in_backward as _apply_optimizer_in_backward,
)
from torch.distributed.optim.apply_optimizer_in_backward import (
    _get_in_backward_optimizers as _get_in_backward_optimizers,
)
from torch.distributed.optim.functional_adadelta import _FunctionalAdadelta as _FunctionalAdadelta
from torch.distributed.optim.functional_adagrad import _FunctionalAdagrad as _FunctionalAdagrad
from torch.distributed.optim.functional_adam import _FunctionalAdam as _FunctionalAdam
from torch.distributed.optim.functional_adamax import _FunctionalAdamax as _FunctionalAdamax
from torch.distributed.optim.functional_adamw import _FunctionalAdamW as _FunctionalAdamW
from torch.distributed.optim.functional_rmsprop import _FunctionalRMSprop as _FunctionalRMSprop
from torch.distributed.optim.functional_rprop import _FunctionalRprop as _FunctionalRprop
from torch.distributed.optim.functional_sgd import _FunctionalSGD as _FunctionalSGD
from torch.distributed.optim.named_optimizer import _NamedOptimizer as _NamedOptimizer

from ._distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer", "as_functional_optim"]
