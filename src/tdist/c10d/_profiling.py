"""Collectives in torch's profiler: each operation of a ``ProcessGroup`` is a range named as
torch's backends name theirs (``"gloo:all_reduce"``: the group's backend name, then the
operation), from the call to the operation's completion, in ``torch.profiler`` and
``torch.autograd.profiler`` output and traces ("Profiling Collective Communication" in torch's
documentation). Inside ``record_comm(name)`` a range called ``name`` spans it too, as torch's
gloo records both.

Theory of operation. ``profiled(title, op)`` wraps a ``ProcessGroup`` method. While no profiler
runs the wrapper costs one check of torch's profiler state (tens of nanoseconds). While one runs,
the call is a ``record_function`` range named as torch's operator (``"c10d::allreduce_"``), and
inside it a range with the backend's title opens before the method and closes when its ``Work``
completes: at once for an operation done in the call, else in the thread that completes it (an
asynchronous range, as torch's backends record theirs). The profiler's output then has the
names torch's gloo gives it.

``record_comm`` keeps the name where torch keeps its own (``_set_comm_profiling_name``), so
torch's collectives inside the block, DDP's on a twin group among them, see it as well.

Thread-safety: the name is per thread in torch; the wrapper reads it in the calling thread.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch.autograd.profiler import record_function

from ._types import Work

__all__ = ["profiled", "record_comm"]

_F = TypeVar("_F", bound=Callable[..., Any])

_enabled: Callable[[], bool] = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
_c10d = torch._C._distributed_c10d
_get_name: Callable[[], str] = getattr(_c10d, "_get_comm_profiling_name", lambda: "")
_set_name: Callable[[str], None] = getattr(_c10d, "_set_comm_profiling_name", lambda name: None)


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Within the block, this thread's collectives are also named ``name`` in the profiler
    (beside the backend's ``"gloo:all_reduce"``, as torch's gloo shows them); torch's
    ``record_comm``.

    Args:
        name: the profiling name of the collectives issued in the block.
    """
    before = _get_name()
    _set_name(name)
    try:
        yield
    finally:
        _set_name(before)


def profiled(title: str, op: str) -> Callable[[_F], _F]:
    """Decorate a ``ProcessGroup`` method that returns a ``Work`` (or None, when done): while a
    profiler runs, the call is a range ``"c10d::<op>"`` (torch's operator's name) until it
    returns, and within it ``"<backend>:<title>"`` (and the ``record_comm`` name, if one is
    set) until the work completes, as torch's gloo records its operations."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _enabled():
                return method(self, *args, **kwargs)
            with record_function(f"c10d::{op}"):
                named = _get_name()
                spans = [record_function(n) for n in (named, f"{self._backend_name}:{title}") if n]
                for span in spans:
                    span.__enter__()  # type: ignore[no-untyped-call]

                def close(_work: object = None) -> None:
                    for span in reversed(spans):
                        span.__exit__(None, None, None)

                try:
                    work = method(self, *args, **kwargs)
                except BaseException:
                    close()
                    raise
                done = getattr(work, "_work", work)  # (a torch twin's work wraps ours)
                if isinstance(done, Work):
                    done.add_done_callback(close)
                else:
                    close()
                return work

        return cast(_F, run)

    return wrap
