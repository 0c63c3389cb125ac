"""``tdist.master_worker``: torch 0.3's master-worker mode, the master's API.

Every rank calls ``tdist.init_master_worker(backend, init_method, ...)``: rank 0 (the master)
returns and runs the program, the other ranks serve it until it ends. The master makes tensors
on the workers (``remote_tensor``, ``tensor``, ``spread``, ``on_each_worker``), works on them
there (``RemoteTensor``'s methods, torch functions, ``run``), fetches them (``fetch``,
``gather``) and runs collectives among the workers (``all_reduce``, ``reduce``, ``broadcast``,
``all_gather``, ``barrier``). Experimental, as it was in torch 0.3. See ``tdist._master_worker``.
"""

from ._master_worker import (
    RemoteTensor,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    fetch,
    gather,
    init_master_worker,
    on_each_worker,
    reduce,
    remote_tensor,
    run,
    shutdown,
    spread,
    tensor,
    workers,
)

__all__ = [
    "RemoteTensor",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "fetch",
    "gather",
    "init_master_worker",
    "on_each_worker",
    "reduce",
    "remote_tensor",
    "run",
    "shutdown",
    "spread",
    "tensor",
    "workers",
]
