"""torch's own backends as tdist backends: a plug-in (``Backend.register_backend``) whose creator
returns torch's ``ProcessGroupGloo``, a C++ extension's backend (oneCCL's ``ccl``, the "dummy"
of torch's tutorial) or a Python subclass of torch's ``ProcessGroup``/``Backend``.

Theory of operation. Such a creator takes a torch ``Store`` (tdist hands it its group's store
as one: ``_torch_pg.StoreForTorch``), and the object it returns takes torch's option records
and gives torch's works. ``ForeignBackend`` is the tdist backend in front of it: each call
turns tdist's options into torch's (same camelCase fields; the reduce op as torch's
``ReduceOp``), calls the same-named method of torch's backend, and returns a
``ForeignWork``, a tdist ``Work`` that completes when torch's work does (through its future,
or, for a work that has none, when it is waited on). Everything else of tdist's group layer
(sub-groups, the object collectives, the flight record, autograd's rules) works on top as
on tdist's own backends.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from torch._C import _distributed_c10d as _c10d

from . import _types as T
from ._backend import Backend

__all__ = ["ForeignBackend", "ForeignWork", "is_torchs", "torch_options"]

_TORCH_OPTIONS = {
    T.AllreduceOptions: "AllreduceOptions",
    T.BroadcastOptions: "BroadcastOptions",
    T.ReduceOptions: "ReduceOptions",
    T.AllgatherOptions: "AllgatherOptions",
    T.GatherOptions: "GatherOptions",
    T.ScatterOptions: "ScatterOptions",
    T.ReduceScatterOptions: "ReduceScatterOptions",
    T.AllToAllOptions: "AllToAllOptions",
    T.BarrierOptions: "BarrierOptions",
}
_FIELDS = ("reduceOp", "rootRank", "rootTensor", "timeout", "asyncOp", "device_ids")


def is_torchs(backend: object) -> bool:
    """Whether a plug-in's backend object is one of torch's (its C++ classes, or a Python
    subclass of them), which takes torch's options; tdist's and duck-typed ones take tdist's."""
    return isinstance(backend, (_c10d.Backend, _c10d.ProcessGroup))


def torch_options(opts: T._Options) -> Any:
    """torch's option record for tdist's ``opts``: the fields both have."""
    c10d: Any = _c10d
    out = getattr(c10d, _TORCH_OPTIONS[type(opts)])()
    for name in _FIELDS:
        if not hasattr(out, name):
            continue
        value = getattr(opts, name, None)
        if value is None:
            continue
        if name == "reduceOp":
            red = T.as_red_op(value)
            value = c10d.ReduceOp(c10d.ReduceOp.RedOpType(int(red)))
        elif name == "timeout" and not isinstance(value, timedelta):
            value = timedelta(seconds=float(value))
        setattr(out, name, value)
    return out


class ForeignWork(T.Work):
    """A tdist ``Work`` over one of torch's."""

    def __init__(self, work: Any, op: str) -> None:
        super().__init__(op)
        self._w = work
        self._by_future = False
        fut = None
        with contextlib.suppress(Exception):  # (a work of a Python backend may have none)
            fut = work.get_future()
        if fut is not None:
            self._by_future = True
            fut.add_done_callback(self._settled)

    def _source(self) -> int:
        if self._op not in ("recv", "recv_anysource"):
            return -1
        try:
            return int(self._w._source_rank())
        except Exception:  # (torch's raises for a work that is not a receive)
            return -1

    def _settled(self, fut: Any) -> None:
        # (torch's work goes once it is done: its future holds this callback, so keeping it
        # would make a cycle through torch's objects, freed by the garbage collector whenever
        # it runs, at the interpreter's exit among them)
        source = self._source()
        self._w = None
        try:
            value = fut.value()
        except BaseException as exc:
            self._fail(exc)
            return
        result = value if isinstance(value, list) else ([] if value is None else [value])
        self._complete(result, source)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if not self._by_future and not self._is_done:
            try:
                if timeout is None or timeout == 0 or timeout == timedelta(0):
                    self._w.wait()
                else:
                    self._w.wait(timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
            except BaseException as exc:
                self._fail(exc)
            else:
                self._complete([], self._source())
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._by_future and not self._is_done and self._w.is_completed():
            self.wait()
        return self._is_done


class ForeignBackend(Backend):
    """tdist's backend in front of one of torch's (see the module)."""

    def __init__(self, backend: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.torch_backend = backend

    def name(self) -> str:
        for attr in ("name", "getBackendName"):
            with contextlib.suppress(Exception):
                return str(getattr(self.torch_backend, attr)())
        return type(self.torch_backend).__name__

    def _call(self, op: str, method: str, *args: Any) -> T.Work:
        return ForeignWork(getattr(self.torch_backend, method)(*args), op)

    def broadcast(self, tensors: list[torch.Tensor], opts: T.BroadcastOptions) -> T.Work:
        return self._call("broadcast", "broadcast", tensors, torch_options(opts))

    def allreduce(self, tensors: list[torch.Tensor], opts: T.AllreduceOptions) -> T.Work:
        return self._call("all_reduce", "allreduce", tensors, torch_options(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: T.ReduceOptions) -> T.Work:
        return self._call("reduce", "reduce", tensors, torch_options(opts))

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: T.AllgatherOptions
    ) -> T.Work:
        return self._call("all_gather", "allgather", output_tensors, input_tensors, torch_options(opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: T.AllgatherOptions) -> T.Work:
        return self._call("all_gather_into_tensor", "_allgather_base", output, input, torch_options(opts))

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: T.GatherOptions
    ) -> T.Work:
        return self._call("gather", "gather", output_tensors, input_tensors, torch_options(opts))

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: T.ScatterOptions
    ) -> T.Work:
        return self._call("scatter", "scatter", output_tensors, input_tensors, torch_options(opts))

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: T.ReduceScatterOptions
    ) -> T.Work:
        return self._call("reduce_scatter", "reduce_scatter", output_tensors, input_tensors, torch_options(opts))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: T.ReduceScatterOptions) -> T.Work:
        return self._call("reduce_scatter_tensor", "_reduce_scatter_base", output, input, torch_options(opts))

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: T.AllToAllOptions
    ) -> T.Work:
        return self._call("all_to_all", "alltoall", output_tensors, input_tensors, torch_options(opts))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: T.AllToAllOptions,
    ) -> T.Work:
        return self._call(
            "all_to_all_single", "alltoall_base", output, input, output_split_sizes, input_split_sizes,
            torch_options(opts),
        )

    def barrier(self, opts: T.BarrierOptions) -> T.Work:
        return self._call("barrier", "barrier", torch_options(opts))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> T.Work:
        return self._call("send", "send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> T.Work:
        return self._call("recv", "recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> T.Work:
        return self._call("recv_anysource", "recv_anysource", tensors, tag)

    def monitored_barrier(self, opts: T.BarrierOptions, wait_all_ranks: bool = False) -> None:
        method = getattr(self.torch_backend, "monitored_barrier", None)
        if method is None:
            super().monitored_barrier(opts, wait_all_ranks)
            return
        method(torch_options(opts), wait_all_ranks)

    def set_timeout(self, timeout: timedelta) -> None:
        setter = getattr(self.torch_backend, "_set_default_timeout", None)
        if setter is not None:
            setter(timeout)

    def shutdown(self) -> None:
        method = getattr(self.torch_backend, "shutdown", None)
        if method is not None:
            method()

    def abort(self) -> None:
        method = getattr(self.torch_backend, "abort", None)
        if method is None:
            self.shutdown()
        else:
            method()
