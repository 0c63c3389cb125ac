"""Suite-wide setup.

Many tests fork worker processes from the pytest process. A torch op that runs in parallel in
the pytest process starts torch's OpenMP thread pool there, and a process forked afterwards
hangs in its first parallel op (the pool's threads are not copied). One intra-op thread in the
pytest process keeps any test from planting that trap for the tests after it; forked workers
set their own thread counts.
"""

import multiprocessing

import torch

torch.set_num_threads(1)

# Ranks that must not inherit the pytest process's state start from Python's forkserver
# (``run_processes(..., start_method="forkserver")``), which imports torch once per pytest
# process instead of once per rank, as "spawn" would (about 1.5 s of CPU each).
multiprocessing.set_forkserver_preload(["torch"])


# -- an etcd server, for the etcd store and rendezvous (scripts/setup.sh installs etcd) --------
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _flight_record_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The flight-record dumps that failing groups write (on by default) go to the session's
    temporary folder, not /tmp/nccl_trace_rank_N (tests that look at dumps set their own)."""
    if "TDIST_FR_DUMP_TEMP_FILE" in os.environ or "TORCH_FR_DUMP_TEMP_FILE" in os.environ:
        yield
        return
    # (torch's name, which tdist reads too: tests that start programs strip every TDIST_ variable)
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(tmp_path_factory.mktemp("fr") / "rank_")
    try:
        yield
    finally:
        os.environ.pop("TORCH_FR_DUMP_TEMP_FILE", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A private etcd on 127.0.0.1 for the session: (host, client port)."""
    binary = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if binary is None:
        pytest.fail("etcd is not installed: run scripts/setup.sh (it installs the etcd-server package)")
    data: Path = tmp_path_factory.mktemp("etcd")
    client, peer = _free_port(), _free_port()
    with open(data / "log.txt", "wb") as log:
        proc = subprocess.Popen(
            [binary, "--data-dir", str(data / "d"), "--name", "tdist-test",
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"tdist-test=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", client), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"etcd did not start: {(data / 'log.txt').read_text()[-2000:]}")
                time.sleep(0.05)
        yield "127.0.0.1", client
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
