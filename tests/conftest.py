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

from tdist.testing import free_port  # noqa: E402


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


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A private etcd on 127.0.0.1 for the session: (host, client port)."""
    binary = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if binary is None:
        pytest.fail("etcd is not installed: run scripts/setup.sh (it installs the etcd-server package)")
    data: Path = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
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


# -- where a test that runs past its timeout was -------------------------------------------------
# pytest-timeout's thread method prints every thread's stack, then ends the process with
# os._exit: under pytest-xdist that process is a worker, whose output is lost with it, and the
# run only says which test it was running. So a timer of every test writes the stacks, a second
# before its timeout, to its worker's file in a folder of the run; the file is emptied when the
# test ends in time, and the run prints what is left in the folder at its end. (A timer thread,
# as pytest-timeout's own, not faulthandler.dump_traceback_later: a process forked while that
# one is armed hangs at its exit, waiting for the watchdog thread that it does not have.)
import faulthandler  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from typing import IO, Any  # noqa: E402

_STACKS_VAR = "TDIST_TEST_STACKS_DIR"  # (the run's folder: set by the main process, for its workers)
_stacks_file: IO[str] | None = None


def pytest_configure(config: pytest.Config) -> None:
    if _STACKS_VAR not in os.environ and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[_STACKS_VAR] = tempfile.mkdtemp(prefix="tdist-test-stacks-")


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value: Any = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        if value is not None:
            return float(value)
    try:
        return float(item.config.getini("timeout") or 0)
    except (ValueError, TypeError):
        return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _stacks_file
    timeout, folder = _timeout_of(item), os.environ.get(_STACKS_VAR)
    armed = bool(folder and timeout > 2)
    if armed:
        if _stacks_file is None:
            name = os.environ.get("PYTEST_XDIST_WORKER", "main")
            _stacks_file = open(os.path.join(folder, f"{name}.txt"), "w")
        _stacks_file.seek(0)
        _stacks_file.truncate()
        _stacks_file.write(f"{item.nodeid} ran past its timeout ({timeout:g} s); its process's threads were at:\n")
        _stacks_file.flush()
        timer = threading.Timer(timeout - 1, faulthandler.dump_traceback, (_stacks_file,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if armed:
            assert _stacks_file is not None
            timer.cancel()
            timer.join()
            _stacks_file.seek(0)
            _stacks_file.truncate()
            _stacks_file.flush()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    folder = os.environ.get(_STACKS_VAR)
    if not folder or os.environ.get("PYTEST_XDIST_WORKER") or not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            text = f.read()
        if text.strip():
            terminalreporter.section(f"stacks of a test that ran past its timeout ({name[:-4]})", sep="~")
            terminalreporter.write(text)
    sys.stdout.flush()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = os.environ.get(_STACKS_VAR)
    if folder and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[_STACKS_VAR]
