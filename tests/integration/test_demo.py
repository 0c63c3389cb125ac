"""The README's demo: data-parallel training under tdist run, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2])  # (the README's command; odd world sizes: the c10d tests)
def test_train_demo_converges_with_identical_parameters(nproc: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_", "MASTER_", "RANK", "WORLD_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "tdist.cli", "run", "--nproc-per-node", str(nproc), "--master-port", "0",
         str(ROOT / "examples" / "train.py"), "--epochs", "4"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[rank0]:")]
    assert sum(line.startswith("[rank0]:epoch ") for line in lines) == 4
    accuracy = float(lines[-2].rsplit(" ", 1)[-1])
    assert accuracy > 0.7, lines
    assert lines[-1].endswith("parameters identical on every rank: True"), lines
