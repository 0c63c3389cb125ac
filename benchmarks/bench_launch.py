"""The launcher side by side: ``tdist run`` against ``torchrun``, same script, same machine.

Run: .venv/bin/python benchmarks/bench_launch.py [--rounds 5] [--nproc 2] [--program torch]

Each run starts ``--nproc`` workers on this node; every worker forms the default group with its
own library (``init_process_group("gloo")``), all-reduces a tensor, leaves the group and exits.
``--program torch``: under both launchers the workers run torch's ``torch.distributed`` (under
``tdist run`` its ``env://`` is a client of the job's store, in torch's protocol, as of
torchrun's agent store).
Measured from the moment the launcher is started, in wall time:

- ``workers started``: until the last worker runs its first line (the launcher's own start-up:
  importing what it needs, its store, spawning);
- ``job done``: until the launcher has exited with every worker's status.

Every figure is the median over ``--rounds`` rounds, the two launchers alternating inside each
round. Both launchers are the ones a user types: ``tdist run`` and ``torchrun``, as console
scripts of this environment.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import busy_for_the_run, machine_line, median, table

WORKER = """\
import os, sys, time
with open(os.path.join(os.environ["BENCH_OUT"], "start" + os.environ["RANK"]), "w") as f:
    f.write(repr(time.time()))
if os.environ["BENCH_IMPL"] == "torch":
    import torch.distributed as dist
else:
    import tdist as dist
import torch
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
dist.destroy_process_group()
"""

BIN = Path(sys.executable).parent
COMMANDS = {
    "torch": [str(BIN / "torchrun")],
    "tdist": [str(BIN / "tdist"), "run"],
}


def one_run(impl: str, nproc: int, work: Path, program: str) -> tuple[float, float]:
    for f in work.glob("start*"):
        f.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TDIST_"))}
    env.update(BENCH_OUT=str(work), BENCH_IMPL=impl if program == "own" else "torch")
    # --standalone: one node, a free port, a run id of its own; the same command line for both
    cmd = [*COMMANDS[impl], "--standalone", "--nproc-per-node", str(nproc), str(work / "worker.py")]
    t0 = time.time()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    done = time.time() - t0
    if res.returncode != 0:
        raise SystemExit(f"{impl}: exit code {res.returncode}\n{res.stdout}\n{res.stderr}")
    starts = [float((work / f"start{r}").read_text()) for r in range(nproc)]
    return max(starts) - t0, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    ap.add_argument("--program", choices=("own", "torch"), default="own",
                    help="the workers' library: each launcher's own, or torch's under both")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    results: dict[str, list[tuple[float, float]]] = {impl: [] for impl in COMMANDS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "worker.py").write_text(WORKER)
        for r in range(args.rounds):
            order = list(COMMANDS) if r % 2 == 0 else list(reversed(COMMANDS))
            for impl in order:
                results[impl].append(one_run(impl, args.nproc, work, args.program))
    print(machine_line())
    library = "each launcher's own library" if args.program == "own" else "torch.distributed under both"
    print(f"{args.nproc} workers on this node ({library}); medians of {args.rounds} alternating rounds (seconds)\n")
    rows = []
    for i, what in enumerate(("workers started", "job done")):
        t = median([x[i] for x in results["torch"]])
        d = median([x[i] for x in results["tdist"]])
        rows.append([what, t, d, f"{d / t:.2f}x"])
    print(table(["from launcher start to", "torchrun", "tdist run", "tdist/torch"], rows))


if __name__ == "__main__":
    main()
