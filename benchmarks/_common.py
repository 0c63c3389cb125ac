"""Shared helpers for the side-by-side benchmarks: medians, tables, machine facts."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine_line() -> str:
    return (
        f"{platform.node()} | {os.cpu_count()} cores | Python {platform.python_version()} | "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def busy_host(enabled: bool = True) -> Iterator[None]:
    """The "busy host" mode of the benchmarks: one busy loop per core, at the lowest priority
    (nice 19), for as long as the block runs, as a training job's other work leaves the host.
    Code that gets its speed from spinning on idle cores loses it here; the measured processes
    still get the CPU first when they want it."""
    if not enabled:
        yield
        return
    loop = "import os\nos.nice(19)\nwhile True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-S", "-c", loop]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def busy_for_the_run(enabled: bool) -> None:
    """``busy_host`` for the rest of this run (``--busy``): the loops stop when the process
    exits. For benchmarks whose measuring code is not one block."""
    if not enabled:
        return
    stack = contextlib.ExitStack()
    stack.enter_context(busy_host())
    atexit.register(stack.close)
    print("busy host: one low-priority busy loop per core", flush=True)


def before_fork() -> None:
    """Collect, then freeze this process's heap before forking measured children (Python's
    advice for fork without exec, ``gc.freeze``). Without it a child inherits the parent's
    collection counters, and its first full collection, which walks (and, through reference
    counts, copies on write) every object torch's import made, lands in whichever operation
    happens to allocate past the threshold: 60-140 ms added to one measurement, depending on
    the parent's history rather than on the code measured."""
    gc.collect()
    gc.freeze()


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """This machine's memcpy bandwidth (GB/s), measured with torch on pre-faulted buffers."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def spawned_program(module: str, worker: str, nprocs: int, args: Sequence[object], env: Mapping[str, str], timeout: float) -> float:
    """Run ``torch.multiprocessing.spawn(module.worker, args, nprocs)`` in a fresh interpreter
    (a real program's own launch: no launcher, torch's default threads), as the benchmark
    ``module`` of this folder; returns the CPU seconds of all its processes.

    Raises:
        SystemExit: the program failed (its stderr's end said).
    """
    code = (
        "import importlib, json, sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); "
        "m = importlib.import_module(sys.argv[2]); "
        "mp.spawn(getattr(m, sys.argv[3]), args=tuple(json.loads(sys.argv[4])), nprocs=int(sys.argv[5]))"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), module, worker, json.dumps(list(args)), str(nprocs)],
        env=dict(env), capture_output=True, text=True, timeout=timeout,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{module} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def program_env(omp_threads: int) -> dict[str, str]:
    """This process's environment for a spawned program, less what would steer it
    (``OMP_``, ``GOMP_``, ``MASTER_``, ``TDIST_``), with ``OMP_NUM_THREADS`` when given (not 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "MASTER_", "TDIST_"))}
    if omp_threads:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def side_by_side_table(impls: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``table`` of ``side_by_side`` rows."""
    return table(["metric", *impls] + (["tdist speed-up"] if len(rows[0]) > len(impls) + 1 else []), rows)


def side_by_side(label: str, runs: Mapping[str, Sequence[Mapping[str, float]]], metric: str, lower_is_better: bool = True) -> list[object]:
    """A table row: ``label``, each implementation's median of ``metric`` over its ``runs``,
    and, with both torch and tdist, tdist's speed-up (torch's over tdist's where lower is
    better)."""
    meds = {impl: median([r[metric] for r in rs]) for impl, rs in runs.items()}
    row: list[object] = [label, *(f"{m:.2f}" for m in meds.values())]
    if "torch" in meds and "tdist" in meds:
        row.append(f"{(meds['torch'] / meds['tdist'] if lower_is_better else meds['tdist'] / meds['torch']):.2f}x")
    return row


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)
