"""Recovering from a lost rank: tdist's in-place re-form (``tdist.elastic.ft``) against
torchrun's ``--max-restarts`` restart of the same DDP job, same machine, same model; and the
hand-over of a 256 MiB state to a joining rank.

Run: .venv/bin/python benchmarks/bench_ft.py [--rounds 3] [--world 4] [--only recovery|join]

Recovery. A DDP job (an MLP of 4.7 M parameters, SGD with momentum, a global batch of 240
split over the ranks) runs on ``--world`` ranks; at step ``--kill-at`` one rank kills itself
with SIGKILL inside backward (while DDP's buckets are all-reduced), after writing the time.
Measured (``time.monotonic``, one clock for every process of this host): from the death to
the end of the next training step completed by the job.

- torchrun: ``torchrun --standalone --nproc-per-node W --max-restarts 1`` (its default
  ``--monitor-interval`` of 0.1 s; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which
  torch 2.13's restarted workers fail to connect: pytorch/pytorch#135712) of the job written
  the usual way: ``init_process_group
  ("gloo")``, rank 0 saves a checkpoint (model, optimizer, step) every ``--ckpt-every`` steps
  (to a temporary file, renamed), and a started worker loads the newest. torchrun notices the
  death, stops the survivors, re-rendezvouses, starts W new workers, which import torch, form
  the group, load the checkpoint, wrap DDP, and train: the next step completed is the first
  after the checkpoint; the steps since it are done again ("progress regained": until the step
  that was lost is done).
- tdist: the same job on ``tdist.elastic.ft.Manager`` (its workers started by this process,
  which hosts the store): the survivors' step fails, they re-form the group in place among
  themselves (W - 1 ranks), re-create DDP, and do the lost step again.

Join. Two members hold a 256 MiB state (2 Linear 4096x4096 and SGD's momentum for them); a
third process calls ``Manager.start()``. Measured: the transfer (the joiner's receive of the
state, from the first byte asked to ``load_state_dict`` done), the joiner's whole admission
(from ``start()`` to its first step: waiting for the members' step boundary, the new group,
the transfer), the members' pause for it, and, for scale, writing and reading the same state
through a checkpoint file in ``/dev/shm`` with ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_line, median, table

BIN = Path(sys.executable).parent
SRC = str(Path(__file__).resolve().parent.parent / "src")

WORKER = r'''
import json, os, signal, sys, time
from datetime import timedelta
import torch

mode, out = sys.argv[1], sys.argv[2]
cfg = json.loads(sys.argv[3])
torch.set_num_threads(1)
GLOBAL = 240

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 10))

def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL, 256, generator=g), torch.randint(0, 10, (GLOBAL,), generator=g)

def note(name, value):
    with open(os.path.join(out, name), "w") as f:
        f.write(repr(value))

def train_step(ddp, opt, net, step, rank, size, victim):
    x, y = batch(step)
    n = GLOBAL // size
    opt.zero_grad()
    if victim:
        def die(grad):
            note("death", time.monotonic())
            os.kill(os.getpid(), signal.SIGKILL)
        next(net.parameters()).register_hook(die)
    torch.nn.functional.cross_entropy(ddp(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
    opt.step()

if mode == "torchrun":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    ckpt = os.path.join(out, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt)
        net.load_state_dict(sd["model"]); opt.load_state_dict(sd["optim"]); step = sd["step"]
    ddp = DDP(net)
    first = True
    while step < cfg["steps"]:
        victim = attempt == 0 and step == cfg["kill_at"] and rank == size - 1
        train_step(ddp, opt, net, step, rank, size, victim)
        step += 1
        if rank == 0:
            now = time.monotonic()
            if attempt == 1 and first:
                note("next_step", now)
            if attempt == 1 and step == cfg["kill_at"] + 1:
                note("regained", now)
            first = False
            if step % cfg["ckpt_every"] == 0:
                torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "step": step}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()
elif mode == "tdist":
    import tdist as dist
    from tdist.elastic import ft
    from torch.nn.parallel import DistributedDataParallel as DDP
    store = dist.TCPStore("127.0.0.1", cfg["port"], timeout=timedelta(seconds=60))
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    live = {}
    def on_reconfigure(q):
        live["ddp"] = None
        live["ddp"] = DDP(net)
        if q.lost:
            note(f"reformed{q.rank}", [time.monotonic(), q.seconds])
    mgr = ft.Manager(store, min_size=1, max_size=cfg["world"], initial_size=cfg["world"], timeout=30,
                     state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict()},
                     load_state_dict=lambda sd: (net.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
                     on_reconfigure=on_reconfigure)
    mgr.start()
    me = cfg["index"]
    while mgr.current_step < cfg["steps"]:
        step = mgr.current_step
        with mgr.step() as outcome:
            victim = step == cfg["kill_at"] and me == cfg["world"] - 1
            train_step(live["ddp"], opt, net, step, mgr.rank, mgr.world_size, victim)
        if outcome.committed and mgr.rank == 0 and mgr.world_size < cfg["world"] and not os.path.exists(os.path.join(out, "next_step")):
            note("next_step", time.monotonic())
    mgr.shutdown()
elif mode == "join":
    import tdist as dist
    from tdist.elastic import ft
    store = dist.TCPStore("127.0.0.1", cfg["port"], timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    joiner = cfg["index"] == 2
    if not joiner:  # (momentum buffers: one step)
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    mark = {}
    def load(sd):
        t0 = time.monotonic()
        net.load_state_dict(sd["model"]); opt.load_state_dict(sd["optim"])
        mark["load_state_dict"] = time.monotonic() - t0
    def on_reconfigure(q):
        if q.epoch == 2:
            mark["quorum"] = q
            note(f"joined{cfg['index']}", [time.monotonic(), q.seconds])
    mgr = ft.Manager(store, min_size=1, max_size=3, initial_size=2, timeout=60, join_timeout=120,
                     state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict()},
                     load_state_dict=load, on_reconfigure=on_reconfigure)
    if joiner:
        store.wait(["members_ready"])
        t0 = time.monotonic()
        mgr.start()
        note("join", {"start_to_member": time.monotonic() - t0, "transfer": mark["quorum"].transfer,
                      "load_state_dict": mark["load_state_dict"]})
        nbytes = sum(t.numel() * t.element_size() for t in net.parameters()) * 2
        note("bytes", nbytes)
    else:
        mgr.start()
        if mgr.rank == 0:
            store.set("members_ready", b"")
    while mgr.current_step < cfg["steps"]:
        with mgr.step():
            time.sleep(0.01)
    mgr.shutdown()
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TDIST_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _read(work: Path, name: str) -> object:
    return eval((work / name).read_text())  # (our own repr of floats, lists and dicts)


def run_torchrun(args: argparse.Namespace, work: Path) -> dict[str, float]:
    cfg = {"steps": args.steps, "kill_at": args.kill_at, "ckpt_every": args.ckpt_every}
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.world), "--max-restarts", "1",
           str(work / "worker.py"), "torchrun", str(work), json.dumps(cfg)]
    # torch 2.13's torchrun shares its rendezvous store with the workers, and a restarted
    # worker then finds the keys of the attempt before (gloo connects to dead ports:
    # pytorch/pytorch#135712); torch's workaround is this switch
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"torchrun job failed ({res.returncode}):\n{res.stderr[-3000:]}")
    death = float(_read(work, "death"))  # type: ignore[arg-type]
    return {
        "next_step": float(_read(work, "next_step")) - death,  # type: ignore[arg-type]
        "regained": float(_read(work, "regained")) - death,  # type: ignore[arg-type]
    }


def _serve() -> tuple[object, int, str]:
    from tdist.store import TCPStore

    secret = secrets.token_hex(16)
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False, secret=secret)
    return store, store.port, secret


def run_tdist(args: argparse.Namespace, work: Path) -> dict[str, float]:
    store, port, secret = _serve()
    env = {**_env(), "TDIST_SECRET": secret}
    procs = []
    try:
        for i in range(args.world):
            cfg = {"steps": args.steps, "kill_at": args.kill_at, "port": port, "world": args.world, "index": i}
            procs.append(subprocess.Popen(
                [sys.executable, str(work / "worker.py"), "tdist", str(work), json.dumps(cfg)], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            ))
        codes = [p.wait(timeout=600) for p in procs]
        if sorted(codes) != sorted([0] * (args.world - 1) + [-9]):
            raise RuntimeError(f"tdist job failed: exit codes {codes}:\n" + "\n".join(p.stderr.read()[-2000:] for p in procs if p.stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        store.close()  # type: ignore[attr-defined]
    death = float(_read(work, "death"))  # type: ignore[arg-type]
    reformed = [_read(work, f"reformed{r}") for r in range(args.world - 1)]
    next_step = float(_read(work, "next_step")) - death  # type: ignore[arg-type]
    return {
        "next_step": next_step, "regained": next_step,
        "reformed": max(float(r[0]) for r in reformed) - death,  # type: ignore[index]
    }


def run_join(args: argparse.Namespace, work: Path) -> dict[str, float]:
    store, port, secret = _serve()
    env = {**_env(), "TDIST_SECRET": secret}
    procs = []
    try:
        for i in range(3):
            cfg = {"steps": 1_000_000 if i < 2 else 0, "port": port, "index": i}
            procs.append(subprocess.Popen(
                [sys.executable, str(work / "worker.py"), "join", str(work), json.dumps(cfg)], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            ))
        deadline = time.monotonic() + 300
        while not (work / "bytes").exists():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("join run failed:\n" + "\n".join(p.stderr.read()[-2000:] for p in procs if p.stderr and p.poll()))
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        store.close()  # type: ignore[attr-defined]
    join = _read(work, "join")
    members = [_read(work, f"joined{i}") for i in range(2)]
    assert isinstance(join, dict)
    return {
        "transfer": join["transfer"], "load_state_dict": join["load_state_dict"],
        "admission": join["start_to_member"],
        "member_pause": max(float(m[1]) for m in members),  # type: ignore[index]
        "mib": float(_read(work, "bytes")) / (1 << 20),  # type: ignore[arg-type]
    }


def file_round_trip() -> tuple[float, float]:
    """torch.save and torch.load of the same 256 MiB state through /dev/shm."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(base, f"bench_ft_{os.getpid()}.pt")
    try:
        t0 = time.perf_counter()
        torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, path)
        saved = time.perf_counter() - t0
        other = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(2)))
        fresh = torch.optim.SGD(other.parameters(), lr=0.01, momentum=0.9)
        t0 = time.perf_counter()
        sd = torch.load(path)
        other.load_state_dict(sd["model"])
        fresh.load_state_dict(sd["optim"])
        loaded = time.perf_counter() - t0
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return saved, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--only", choices=["recovery", "join"], default=None)
    args = parser.parse_args()
    print(machine_line())
    if args.only in (None, "recovery"):
        results: dict[str, list[dict[str, float]]] = {"torchrun": [], "tdist": []}
        for r in range(args.rounds):
            order = ["torchrun", "tdist"] if r % 2 == 0 else ["tdist", "torchrun"]
            for impl in order:
                with tempfile.TemporaryDirectory() as tmp:
                    work = Path(tmp)
                    (work / "worker.py").write_text(WORKER)
                    res = run_torchrun(args, work) if impl == "torchrun" else run_tdist(args, work)
                results[impl].append(res)
                print(f"round {r + 1} {impl}: " + ", ".join(f"{k} {v:.3f} s" for k, v in res.items()), flush=True)
        tr = {k: median([x[k] for x in results["torchrun"]]) for k in ("next_step", "regained")}
        td = {k: median([x[k] for x in results["tdist"]]) for k in ("next_step", "regained", "reformed")}
        print(f"\nRecovery: DDP on {args.world} ranks, one killed with SIGKILL inside backward at step {args.kill_at}; "
              f"torchrun checkpoints every {args.ckpt_every} steps; medians of {args.rounds} rounds")
        print(table(
            ["from the death to", "torchrun --max-restarts 1", "tdist ft (in place)", "tdist/torchrun"],
            [
                ["the next completed step", f"{tr['next_step']:.3f} s", f"{td['next_step']:.3f} s", f"{td['next_step'] / tr['next_step']:.3f}x"],
                ["the lost step done again", f"{tr['regained']:.3f} s", f"{td['regained']:.3f} s", f"{td['regained'] / tr['regained']:.3f}x"],
            ],
        ))
        print(f"(tdist: the group re-formed and DDP re-created {td['reformed'] * 1000:.0f} ms after the death)")
    if args.only in (None, "join"):
        joins = []
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                (work / "worker.py").write_text(WORKER)
                res = run_join(args, work)
            joins.append(res)
            print(f"round {r + 1} join: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
        saves, loads = zip(*(file_round_trip() for _ in range(args.rounds)), strict=True)
        m = {k: median([j[k] for j in joins]) for k in joins[0]}
        print(f"\nJoin: a {m['mib']:.0f} MiB state (2 Linear 4096x4096 + SGD momentum) to a third rank; medians of {args.rounds}")
        print(table(
            ["", "seconds"],
            [
                ["transfer to the joiner (receive + load_state_dict)", f"{m['transfer']:.3f}"],
                ["  of which load_state_dict", f"{m['load_state_dict']:.3f}"],
                ["joiner: start() to member with the state", f"{m['admission']:.3f}"],
                ["members' pause for the re-form", f"{m['member_pause']:.3f}"],
                ["for scale: torch.save of the state to /dev/shm", f"{median(saves):.3f}"],
                ["for scale: torch.load + load_state_dict from /dev/shm", f"{median(loads):.3f}"],
            ],
        ))
        print(f"transfer rate: {m['mib'] / 1024 / m['transfer']:.2f} GiB/s")


if __name__ == "__main__":
    main()
