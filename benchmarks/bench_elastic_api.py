"""torchelastic's programmatic API and group surgery, side by side with torch.

Run: .venv/bin/python benchmarks/bench_elastic_api.py [--rounds 5] [--only start_processes,agent,shrink]

Each row runs the same work with torch and with tdist, the two alternating inside each round,
each measurement in a fresh parent process (so neither pays the other's imports), and prints
medians over ``--rounds`` rounds with the ratio (tdist's time / torch's):

- ``start_processes``: ``start_processes(name, fn, {0: (0,), 1: (1,)}, envs, DefaultLogsSpecs())``
  with a module-level function that returns its argument, then ``wait()``: from the call until
  both return values are in (two new interpreters each; torch's spawn, tdist's new interpreter);
- ``agent``: ``LocalElasticAgent(WorkerSpec(fn, local_world_size=2, static rendezvous), ...).run()``
  with the same function: from the call until the ``RunResult``;
- ``shrink``: 3 ranks on ``gloo`` (torch) or tdist's default, one leaves: what the 2 survivors
  do to go on, timed on rank 0 until one all-reduce on the new group is done. torch serves
  ``shrink_group`` on NCCL only (gloo: ``TypeError``), so its survivors do what a torch user
  does instead: ``destroy_process_group()`` and ``init_process_group`` again with the new ranks
  on a fresh prefix of the same store. tdist's survivors call ``shrink_group([2])``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import busy_for_the_run, free_port, machine_line, median, table

IMPLS = ("torch", "tdist")


def echo(x: int) -> int:
    return x


def _start_processes(impl: str) -> float:
    if impl == "torch":
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    else:
        from tdist.elastic.multiprocessing import DefaultLogsSpecs, start_processes  # type: ignore[no-redef]
    with tempfile.TemporaryDirectory() as logs:
        envs = {r: {"LOCAL_RANK": str(r)} for r in range(2)}
        t0 = time.perf_counter()
        ctx = start_processes("bench", echo, {0: (0,), 1: (1,)}, envs, DefaultLogsSpecs(log_dir=logs), start_method="spawn")
        result = ctx.wait(timeout=60)
        took = time.perf_counter() - t0
        ctx.close()
    assert result is not None and result.return_values == {0: 0, 1: 1}, result
    return took


def _agent(impl: str) -> float:
    if impl == "torch":
        from torch.distributed.elastic.agent.server import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    else:
        from tdist.elastic.agent.server import WorkerSpec  # type: ignore[no-redef]
        from tdist.elastic.agent.server.local_elastic_agent import LocalElasticAgent  # type: ignore[no-redef]
        from tdist.elastic.multiprocessing import DefaultLogsSpecs  # type: ignore[no-redef]
        from tdist.elastic.rendezvous import RendezvousParameters  # type: ignore[no-redef]
        from tdist.elastic.rendezvous.registry import get_rendezvous_handler  # type: ignore[no-redef]
    with tempfile.TemporaryDirectory() as logs:
        t0 = time.perf_counter()
        params = RendezvousParameters(
            backend="static", endpoint=f"127.0.0.1:{free_port()}", run_id="bench", min_nodes=1, max_nodes=1, rank=0
        )
        spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=get_rendezvous_handler(params), entrypoint=echo, args=(7,))
        result = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=logs), start_method="spawn").run()
        took = time.perf_counter() - t0
    assert result is not None and not result.is_failed() and result.return_values == {0: 7, 1: 7}, result
    return took


def _shrink_rank(impl: str, rank: int, port: int, out: str) -> None:
    """One of 3 ranks: after one all-reduce rank 2 leaves; ranks 0 and 1 go on with 2."""
    from datetime import timedelta

    import torch

    if impl == "torch":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    else:
        import tdist as dist  # type: ignore[no-redef]

        store = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))  # type: ignore[assignment]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    dist.all_reduce(torch.ones(1))
    if rank == 2:
        dist.destroy_process_group()
        return
    t0 = time.perf_counter()
    if impl == "torch":
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore("shrunk", store), rank=rank, world_size=2)
    else:
        dist.shrink_group([2])  # type: ignore[attr-defined]
    t = torch.ones(1)
    dist.all_reduce(t)
    took = time.perf_counter() - t0
    assert t.item() == 2.0
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(took))


def _shrink(impl: str) -> float:
    if impl == "torch":
        import torch.distributed as dist
    else:
        import tdist as dist  # type: ignore[no-redef]
    master = dist.TCPStore("127.0.0.1", 0, is_master=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "took")
        procs = [
            subprocess.Popen([sys.executable, __file__, "--shrink-rank", impl, str(r), str(master.port), out])
            for r in range(3)
        ]
        codes = [p.wait(timeout=120) for p in procs]
        del master
        assert codes == [0, 0, 0], codes
        with open(out) as f:
            return float(f.read())


CASES = {"start_processes": _start_processes, "agent": _agent, "shrink": _shrink}


def _one(case: str, impl: str) -> float:
    """A fresh parent process for one measurement."""
    res = subprocess.run(
        [sys.executable, __file__, "--one", case, impl], capture_output=True, text=True, timeout=300
    )
    if res.returncode != 0:
        raise SystemExit(f"{case} {impl}: exit code {res.returncode}\n{res.stdout}\n{res.stderr}")
    return float(res.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(repr(CASES[sys.argv[2]](sys.argv[3])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--shrink-rank":
        _shrink_rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--busy", action="store_true", help="one low-priority busy loop per core meanwhile")
    args = ap.parse_args()
    busy_for_the_run(args.busy)
    cases = args.only.split(",")
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = IMPLS if r % 2 == 0 else tuple(reversed(IMPLS))
        for case in cases:
            for impl in order:
                results.setdefault((case, impl), []).append(_one(case, impl))
    print(machine_line())
    print(f"medians of {args.rounds} alternating rounds (ms, lower is better)\n")
    rows = []
    for case in cases:
        t = median(results[(case, "torch")]) * 1e3
        d = median(results[(case, "tdist")]) * 1e3
        rows.append([case, f"{t:.1f}", f"{d:.1f}", f"{d / t:.2f}x"])
    print(table(["case", "torch ms", "tdist ms", "tdist/torch"], rows))
    for case in cases:
        for impl in IMPLS:
            print(f"  {case} {impl}: " + ", ".join(f"{x * 1e3:.1f}" for x in results[(case, impl)]))


if __name__ == "__main__":
    main()
