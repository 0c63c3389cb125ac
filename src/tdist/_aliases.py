"""torch's own distributed training stack under tdist's module paths.

FSDP, distributed checkpoints, DTensor, device meshes, pipelining, DDP's communication hooks
and torch's functional collectives are torch's code, and run on tdist as torch's backend (the
default group's twin, ``c10d._torch_pg``). A program ported by changing its imports
(``torch.distributed`` -> ``tdist``) keeps them: ``import tdist.checkpoint as dcp`` and ``from
tdist.fsdp import fully_shard`` give torch's very modules, the same objects as under
``torch.distributed`` (one copy of each, so their classes and registries are shared).

A finder at the front of ``sys.meta_path`` answers for ``tdist.<name>`` and everything below it,
for the names in ``ALIASED`` (a few of them inside packages of tdist's own, such as
``optim.zero_redundancy_optimizer``), by importing ``torch.distributed.<name>...``. Nothing is imported
until such a name is.

tdist is the backend torch picks for CPU tensors when it forms the default group itself
(``default_world_on_tdist``, called when tdist registers its backend with torch, and again at
such an import): torch's device meshes (``init_device_mesh``) and ``fully_shard`` without a mesh
call ``init_process_group()`` with no backend when no group exists. A ported program that relies
on that (as pytorch/examples' tensor-parallel ones do, even one that changed only its ``import
torch.distributed as dist`` line and still calls torch's ``init_device_mesh``) must get tdist's
group, which ``tdist.is_initialized``, ``tdist.get_rank`` and ``tdist.destroy_process_group``
see, not a gloo group of torch's behind tdist's back.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["ALIASED", "default_world_on_tdist", "install"]

#: the sub-packages and modules of ``torch.distributed`` that tdist does not implement itself
ALIASED = frozenset(
    {
        "_composable",
        "_composable_state",
        "_functional_collectives",
        "_functional_collectives_impl",
        "_shard",
        "_sharded_tensor",
        "_sharding_spec",
        "_state_dict_utils",
        "_symmetric_memory",
        "_tensor",
        "_tools",
        "algorithms",
        "argparse_util",
        "c10d_logger",
        "checkpoint",
        "collective_utils",
        "config",
        "debug",
        "device_mesh",
        "fsdp",
        "logging_handlers",
        "pipelining",
        "remote_device",
        "tensor",
        "utils",
        # (modules of torch's inside packages tdist implements: torch's optimizers over a group)
        "nn.jit",
        "optim.apply_optimizer_in_backward",
        "optim.functional_adadelta",
        "optim.functional_adagrad",
        "optim.functional_adam",
        "optim.functional_adamax",
        "optim.functional_adamw",
        "optim.functional_rmsprop",
        "optim.functional_rprop",
        "optim.functional_sgd",
        "optim.named_optimizer",
        "optim.post_localSGD_optimizer",
        "optim.utils",
        "optim.zero_redundancy_optimizer",
        # (torch's analyzer of flight-record dumps, which reads tdist's as they are)
        "flight_recorder.components",
        "flight_recorder.fr_trace",
        # (torchelastic's utilities, whose module paths ported code imports)
        "elastic.multiprocessing.redirects",
        "elastic.rendezvous.etcd_server",  # (torch's test helper: starts an etcd binary)
        "elastic.multiprocessing.subprocess_handler",
        "elastic.multiprocessing.tail_log",
        "elastic.utils.data.cycling_iterator",
        "elastic.utils.data.elastic_distributed_sampler",
        "elastic.utils.log_level",
        "elastic.utils.logging",
        "elastic.utils.process_state",
        "elastic.agent.server.health_check_server",  # (launch_agent's health_check_server)
        "elastic.control_plane",  # (worker_main: torch's worker server, its own C++)
    }
)

_PREFIX = "tdist."


def default_world_on_tdist() -> None:
    """Make ``"tdist"`` torch's default backend for CPU tensors where it was gloo (torch's own
    default), so that a group torch forms on its own, ``init_process_group()`` with no backend,
    runs on tdist. Called when tdist registers its backend with torch (both imported), when a
    program imports torch's stack by tdist's names, and by ``tdist.init_device_mesh`` (a
    program may have set the map back); a program that names its backend is not affected."""
    backend = getattr(sys.modules.get("torch.distributed"), "Backend", None)
    if backend is None or "tdist" not in getattr(backend, "backend_list", ()):
        return
    defaults = backend.default_device_backend_map
    if defaults.get("cpu") == "gloo":
        defaults["cpu"] = "tdist"


class _Existing:  # (a loader; importlib.abc's base costs an import of typing)
    """Loads ``tdist.<name>`` as torch's module of that name, imported once."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        default_world_on_tdist()
        return module

    def get_code(self, fullname: str) -> types.CodeType | None:
        """torch's module's code (``python -m tdist.<name>`` runs it as ``__main__``, as
        ``python -m torch.distributed.<name>`` does: runpy asks the loader)."""
        spec = importlib.util.find_spec(self.target)
        loader = None if spec is None else spec.loader
        get_code = getattr(loader, "get_code", None)
        return None if get_code is None else get_code(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (torch's import ran it); the import system has put the alias's spec
        on torch's module, and torch's own goes back (its relative imports read it)."""
        if getattr(module, "__spec__", None) is not self.spec:
            try:
                module.__spec__ = self.spec
            except AttributeError:  # (a module that refuses new attributes kept its own)
                pass


class _Finder:  # (a meta path finder)
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith(_PREFIX):
            return None
        parts = name.split(".")
        if not any(".".join(parts[1:k]) in ALIASED for k in range(2, len(parts) + 1)):
            return None
        torch_name = "torch.distributed." + name[len(_PREFIX):]
        found = importlib.util.find_spec(torch_name)
        if found is None:
            return None
        is_package = found.submodule_search_locations is not None
        spec = importlib.machinery.ModuleSpec(name, _Existing(torch_name), origin=found.origin, is_package=is_package)  # type: ignore[arg-type]
        spec.has_location = found.has_location  # (``python -m``'s ``sys.argv[0]`` is the origin)
        return spec


_finder = _Finder()


def install() -> None:
    """Put the finder first in ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _finder)
