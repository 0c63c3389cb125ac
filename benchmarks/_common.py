"""Shared helpers for the side-by-side benchmarks: medians, tables, machine facts."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Sequence


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine_line() -> str:
    return (
        f"{platform.node()} | {os.cpu_count()} cores | Python {platform.python_version()} | "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )


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
