"""Fault-tolerant training without restarts: a job whose process group is re-formed in place
among the surviving processes (and processes that join later), keeping their Python state,
model and optimizer in memory.

``Manager`` is made by every process of the job on one shared store::

    mgr = ft.Manager(store, min_size=2, max_size=4,
                     state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                     load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                                 opt.load_state_dict(sd["optim"])),
                     on_reconfigure=lambda quorum: rebuild_ddp_and_scale_lr(quorum.world_size))
    mgr.start()
    while mgr.current_step < steps:
        with mgr.step() as outcome:        # a lost rank: the survivors re-form, the step is
            train_one_step(mgr.rank, mgr.world_size)   # reported (outcome.committed), not raised
    mgr.shutdown()

Under ``tdist run --ft --max-restarts N``, ``Manager(ft.job_store(), ...)``: a worker that fails
is restarted alone and joins the running job; the others go on.

See ``tdist.elastic._ft`` for the theory of operation and ``tdist.elastic._quorum`` for the
quorum's state machine.
"""

from ._ft import Manager, Quorum, QuorumError, StepOutcome, job_store

__all__ = ["Manager", "Quorum", "QuorumError", "StepOutcome", "job_store"]
