"""Fault-tolerant DDP without restarts: 4 workers train a classifier with torch's
DistributedDataParallel on the tdist backend; one worker is killed (SIGKILL) in the middle of
the run, the three survivors re-form their process group in place and go on, and a fifth
worker joins later, receives the model and optimizer state from a live peer (no checkpoint
file) and takes part from the next step.

    .venv/bin/python examples/ft_ddp.py [--steps 120] [--kill-at 40] [--join-at 80]

This process is the launcher: it hosts the job's store (the one part that must not fail: it
is not fault tolerant itself), starts the workers (this file with ``--worker``) and a fifth
one that waits until the job has reached ``--join-at`` steps (and two steps past the kill)
before it asks to join (a spare kept ready: starting Python and torch takes seconds), and kills one worker when rank 0 has
reached ``--kill-at`` steps. Each
worker runs ``tdist.elastic.ft.Manager``; the global batch stays 240 samples whatever the
world size (each rank takes ``240 / world_size``), so the loss curve does not jump when the
world changes. Rank 0 prints the loss of every step (a new rank 0 also the last ones its lost predecessor could not); every worker prints each re-form. At
the end the launcher checks that every worker that finished holds the same parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

GLOBAL_BATCH = 240  # divisible by 1..6: the per-rank share is whole for every world size here


# -- a worker -----------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tdist as dist
    from tdist.elastic import ft

    torch.set_num_threads(1)
    me = f"[w{args.worker}]"
    logging.basicConfig(format=f"{me} %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("tdist.c10d").setLevel(logging.ERROR)  # (the ft log says it more briefly)
    store = dist.TCPStore(args.host, args.port, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    teacher = torch.nn.Linear(32, 10)  # (labels: the argmax of a fixed random linear map)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(7))
    live: dict[str, Any] = {"ddp": None}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(GLOBAL_BATCH, 32, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            return x, teacher(x).argmax(1)

    def on_reconfigure(q: ft.Quorum) -> None:
        # the batch maths: the global batch stays, each rank's share follows the world size
        # (scale the learning rate here instead if the per-rank batch should stay)
        live["ddp"] = None  # (the old DDP's hooks on the parameters go with it: no gc.collect(),
        live["ddp"] = DDP(model)  # which costs 0.1-0.5 s with torch loaded)
        if q.previous_world_size == 0:
            how = f"joined at step {q.step}" + (f", state from rank {q.source}" if q.rank in q.healed else "")
        else:
            lost = f", lost {', '.join(q.lost)}" if q.lost else ""
            joined = f", joined {', '.join(q.joined)}" if q.joined else ""
            how = f"re-formed at step {q.step}{lost}{joined}"
        print(
            f"{me} quorum {q.epoch}: {how}; world {q.previous_world_size} -> {q.world_size}, rank {q.rank}, "
            f"per-rank batch {GLOBAL_BATCH // q.world_size}; {q.seconds * 1000:.0f} ms",
            flush=True,
        )

    mgr = ft.Manager(
        store, min_size=2, max_size=4, initial_size=4, timeout=30, join_timeout=120,
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        on_reconfigure=on_reconfigure,
    )
    print(f"{me} pid {os.getpid()} is node {mgr.name}", flush=True)
    if args.join_after:  # (a spare, up and ready: it asks to join once the job is that far,
        # and two steps past the kill: the job ran without the lost worker first, whatever the
        # machine's load did to the launcher's timing)
        def far_enough() -> bool:
            if not store.check(["progress", "killed_at"]):
                return False
            return int(store.get("progress")) >= max(args.join_after, int(store.get("killed_at")) + 2)

        while not far_enough():
            time.sleep(0.01)
        print(f"{me} asking to join after step {store.get('progress').decode()}", flush=True)
    mgr.start()
    loss_sum = torch.zeros(1)
    lines: dict[int, str] = {}  # (the last steps' log lines: a new rank 0 prints those its predecessor could not)
    printed: int | None = None  # (the last step printed, known here while this worker is rank 0)
    while mgr.current_step < args.steps:
        with mgr.step() as outcome:
            step, rank, size = mgr.current_step, mgr.rank, mgr.world_size
            x, y = batch(step)
            n = GLOBAL_BATCH // size
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(live["ddp"](x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
            loss.backward()
            loss_sum.fill_(loss.item() / size)
            dist.all_reduce(loss_sum)  # (the global batch's loss, for the log)
            time.sleep(args.pace)
            opt.step()  # (last: a step that fails has not touched the state)
        if not outcome.committed:
            print(f"{me} step {outcome.number} failed ({type(outcome.error).__name__}): tried again with {mgr.world_size} ranks", flush=True)
            continue
        lines[outcome.number] = f"step {outcome.number:4d} | world {size} | loss {loss_sum.item():.4f}"
        lines.pop(outcome.number - 3, None)
        if mgr.rank != 0:
            printed = None
            continue
        if printed is None:  # (rank 0 from now: where the last rank 0 stopped printing)
            printed = int(store.get("printed")) if store.check(["printed"]) else -1
        for number in sorted(n for n in lines if n > printed):
            print(lines[number], flush=True)
        printed = outcome.number
        store.set("printed", str(printed))
        store.set("progress", str(mgr.current_step))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    mgr.shutdown()
    store.set(f"final/{args.worker}", digest)
    print(f"{me} done: {mgr.current_step} steps, parameters {digest}", flush=True)


# -- the launcher -------------------------------------------------------------------------------
def launcher(args: argparse.Namespace) -> int:
    from tdist.store import TCPStore

    secret = secrets.token_hex(16)
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False, secret=secret)
    env = {**os.environ, "TDIST_SECRET": secret}

    def start(i: int, join_after: int = 0) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, __file__, "--worker", str(i), "--host", "127.0.0.1", "--port", str(store.port),
               "--steps", str(args.steps), "--pace", str(args.pace), "--join-after", str(join_after)]
        return subprocess.Popen(cmd, env=env)

    def progress() -> int:
        return int(store.get("progress")) if store.check(["progress"]) else 0

    t0 = time.monotonic()
    procs = {i: start(i) for i in range(4)}
    victim, newcomer = 2, 4
    # the newcomer starts now (importing torch takes seconds on a busy machine) and asks to
    # join the running job after step --join-at, as a spare that was kept ready would
    procs[newcomer] = start(newcomer, args.join_at)
    print(f"[launcher] started w0-w3; w{newcomer} waits to join after step {args.join_at}", flush=True)
    try:
        while progress() < args.kill_at:
            time.sleep(0.005)
        time.sleep(args.pace / 2)  # (somewhere inside a step)
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = progress()
        store.set("killed_at", str(killed_at))
        print(f"[launcher] killed w{victim} (pid {procs[victim].pid}) with SIGKILL after step {killed_at}", flush=True)
        codes = {i: p.wait(timeout=300) for i, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    finished = [i for i, code in codes.items() if code == 0]
    digests = {store.get(f"final/{i}").decode() for i in finished}
    print(
        f"[launcher] {time.monotonic() - t0:.1f} s; exit codes {codes}; workers {finished} finished with "
        f"{'identical' if len(digests) == 1 else 'DIFFERENT'} parameters",
        flush=True,
    )
    store.close()
    expected = {0, 1, 3, 4}
    return 0 if set(finished) == expected and len(digests) == 1 and codes[victim] == -signal.SIGKILL else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, default=40)
    parser.add_argument("--join-at", type=int, default=80)
    parser.add_argument("--pace", type=float, default=0.02, help="seconds each step sleeps (to watch it)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--join-after", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
