"""The ``mpi`` backend under SLURM's ``srun``: a private one-node SLURM (munged, slurmctld,
slurmd from Debian's slurm-wlm and munge, which scripts/setup.sh installs) in a temporary
directory, and jobs of mpi_worker.py's cases started by ``srun --mpi=pmi2``: MPICH's wheel takes
rank and world size from SLURM's PMI (its own PMI-1 client, over the ``PMI_FD`` that SLURM's pmi2
plugin hands each task)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tdist.testing import free_port
from tests.mpi.test_mpi_backend import WORKER, check_ops

pytestmark = pytest.mark.timeout(90)


def _binary(name: str) -> str:
    path = shutil.which(name) or next((p for d in ("/usr/sbin", "/usr/bin") if os.access(p := f"{d}/{name}", os.X_OK)), None)
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/setup.sh (it installs slurmd, slurmctld, slurm-client and munge)")
    return path


def _die_with_parent() -> None:  # (in the child, before exec: SIGTERM when pytest goes, even by os._exit)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Slurm:
    """The private cluster: its directory and the environment its commands need."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}:\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(self.root.glob("*.log"))
        )

    def run(self, n: int, args: list[str], env: dict[str, str], mpi: str = "pmi2", timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``srun`` of ``args`` on ``n`` tasks (more than the node's 2 CPUs: ``--overcommit``)."""
        cmd = [_binary("srun"), "-n", str(n), "--overcommit", f"--mpi={mpi}", "--kill-on-bad-exit=1", "--time=1",
               "--job-name=tdist-test", *args]
        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"srun ran past {timeout} s: {exc.stdout!r} {exc.stderr!r}\n{self.logs()}") from None

    def srun(self, n: int, case: str, timeout: float = 60) -> list[dict[str, Any]]:
        """Run ``case`` on ``n`` ranks; every rank's result, by rank."""
        out = Path(tempfile.mkdtemp(dir=self.root, prefix="out-"))
        env = dict(self.env, PYTHONPATH=os.pathsep.join(sys.path), MPI_TEST_OUT=str(out))
        proc = self.run(n, [sys.executable, WORKER, case], env, timeout=timeout)
        files = sorted(out.glob("*.json"), key=lambda p: int(p.stem))
        results = [json.loads(p.read_text()) for p in files]
        assert proc.returncode == 0 and len(results) == n, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], self.logs())
        return results


def _wait(what: str, ready: Any, procs: list[subprocess.Popen[bytes]], slurm: Slurm, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while not ready():
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            pytest.fail(f"{what} (exited: {dead}):\n{slurm.logs()}")
        time.sleep(0.1)


def _processes_under(root: Path) -> list[int]:
    """Processes whose environment names ``root`` (the job's tasks, the daemons' children): what
    a failed job may leave behind."""
    mark = str(root).encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (d / "environ").read_bytes():
                    pids.append(int(d.name))
    return pids


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    munged, slurmctld, slurmd = _binary("munged"), _binary("slurmctld"), _binary("slurmd")
    mungekey, sinfo, scancel = _binary("mungekey"), _binary("sinfo"), _binary("scancel")
    root = Path(tempfile.mkdtemp(prefix="tdist-slurm-"))
    root.chmod(0o755)  # (munged wants its socket's directories searchable by all)
    node = socket.gethostname().split(".")[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_"))}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env["SLURM_CONF"] = str(root / "slurm.conf")
    for d in ("state", "spool"):
        (root / d).mkdir()
    (root / "plugstack.conf").write_text("")
    (root / "slurm.conf").write_text(
        f"""ClusterName=tdist
FirstJobId={random.randrange(1000, 60_000_000)}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
PlugStackConfig={root}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    subprocess.run([mungekey, "--create", f"--keyfile={root}/munge.key"], check=True, timeout=10)
    procs: list[subprocess.Popen[bytes]] = []
    slurm = Slurm(root, env)

    def start(*cmd: str, log: str) -> None:
        with open(root / log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent))

    def node_idle() -> bool:
        got = subprocess.run([sinfo, "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
        return got.stdout.strip() == "idle"

    try:
        start(munged, "-F", f"--socket={root}/munge.sock", f"--key-file={root}/munge.key",
              f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed", log="munged.log")
        _wait("munged did not start", (root / "munge.sock").exists, procs, slurm, within=10)
        start(slurmctld, "-D", "-f", env["SLURM_CONF"], log="slurmctld.out.log")
        start(slurmd, "-D", "-N", node, "-f", env["SLURM_CONF"], log="slurmd.out.log")
        _wait("the node did not come up idle", node_idle, procs, slurm)
        yield slurm
    finally:
        if len(procs) == 3 and all(p.poll() is None for p in procs):
            subprocess.run([scancel, "--quiet", "--full", "--jobname=tdist-test"], env=env, capture_output=True, timeout=10)
        for p in reversed(procs):  # (slurmd, slurmctld, munged)
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for pid in _processes_under(root):  # (a job's tasks or step daemon that outlived it)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def test_srun_runs_every_op_with_torchs_results(slurm: Slurm) -> None:
    """Three ranks under ``srun --mpi=pmi2``: rank and world size come from SLURM's PMI
    (mpi_worker.py names its result file by SLURM's ``PMI_RANK``, and checks it against tdist's
    rank), and every op gives torch's results, as under mpiexec."""
    check_ops(slurm.srun(3, "ops"))


def test_srun_rank_and_world_size_come_from_mpi_and_given_ones_are_ignored(slurm: Slurm) -> None:
    for got in slurm.srun(2, "args"):
        assert any("are ignored since they are assigned by the MPI runtime" in w for w in got["warnings"])
        assert got["all_reduce"] == 2.0


def test_srun_without_pmi_fails_at_once_saying_what_to_pass(slurm: Slurm) -> None:
    """``srun`` without ``--mpi=pmi2`` (SLURM's default ``none``) makes every task a one-rank MPI
    job: ``init_process_group("mpi")`` raises on each, naming the flag, instead of a job of
    lone ranks that fails later on an out-of-range peer."""
    env = dict(slurm.env, PYTHONPATH=os.pathsep.join(sys.path))
    program = "import tdist\ntdist.init_process_group('mpi')\nprint('formed', tdist.get_world_size())"
    proc = slurm.run(2, [sys.executable, "-c", program], env, mpi="none")
    assert proc.returncode != 0 and "formed" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "srun started 2 tasks, but MPI sees a world of 1" in proc.stderr, proc.stderr[-3000:]
    assert "--mpi=pmi2" in proc.stderr
