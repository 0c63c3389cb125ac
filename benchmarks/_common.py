"""Shared helpers for the side-by-side benchmarks: medians, tables, machine facts."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence


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
