"""The README's demo: data-parallel training under tdist run, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rank0_lines(nproc: int, example: str, *args: str, timeout: float) -> list[str]:
    """``tdist run --nproc-per-node nproc examples/<example> args...`` from a clean environment:
    rank 0's output lines (``--local-ranks-filter 0``: the others' are not shown; the run must
    succeed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "MASTER_", "RANK", "WORLD_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "tdist.cli", "run", "--nproc-per-node", str(nproc), "--master-port", "0",
         "--local-ranks-filter", "0", str(ROOT / "examples" / example), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2])  # (the README's command; odd world sizes: the c10d tests)
def test_train_demo_converges_with_identical_parameters(nproc: int) -> None:
    lines = _rank0_lines(nproc, "train.py", "--epochs", "4", timeout=100)
    assert sum(line.startswith("epoch ") for line in lines) == 4
    accuracy = float(lines[-2].rsplit(" ", 1)[-1])
    assert accuracy > 0.7, lines
    assert lines[-1].endswith("parameters identical on every rank: True"), lines


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "epochs"), [("tdist", 1)])
def test_ddp_demo_trains_torchs_ddp_under_tdist_run(backend: str, epochs: int) -> None:
    """The README's first command: torch's DDP on the tdist backend, a program that calls
    ``torch.distributed.init_process_group`` itself (torch's own store at MASTER_PORT, as
    under torchrun). (``--backend gloo`` runs the same program on torch's own backend: the
    benchmarks do; not repeated here, for the suite's time.)"""
    # (3 steps of each epoch: the whole program, at a quarter of its compute)
    lines = _rank0_lines(2, "ddp_demo.py", "--epochs", str(epochs), "--limit", "3", "--backend", backend, timeout=140)
    assert lines[0].startswith(f"DDP on {backend}: 2 workers, 33.9 M parameters"), lines
    assert sum(line.startswith("epoch ") for line in lines) == epochs
    assert "all 2 workers hold identical parameters" in lines[-1], lines
