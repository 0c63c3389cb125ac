"""``tdist.constants``: ``torch.distributed.constants``, the default deadlines of a group.

``default_pg_timeout`` (30 minutes) is every group's operation deadline when none is given;
``default_pg_nccl_timeout`` is ``None``, as in a torch built without NCCL (tdist drives CPU
tensors only).
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["default_pg_nccl_timeout", "default_pg_timeout"]

default_pg_timeout: timedelta = timedelta(minutes=30)
default_pg_nccl_timeout: timedelta | None = None
