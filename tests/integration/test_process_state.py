"""Process-wide state that tdist must leave alone, or own as torch does: torch's thread count,
the environment, the process's one default group; and what importing the command line costs."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import tdist as dist
from tdist.c10d._api import _destroy_all_worlds_for_tests
from tdist.c10d._threads import capped
from tdist.testing import run_threads

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_importing_the_command_line_does_not_import_torch() -> None:
    assert _python("import sys\nfrom tdist import cli\nprint('torch' in sys.modules)") == "False"
    assert _python("import sys\nimport tdist.cli\nprint('torch' in sys.modules)") == "False"


def test_a_worker_of_tdist_run_that_imports_tdist_does_not_import_torch(tmp_path: Path) -> None:
    """Its status thread (``TDIST_STATUS_DIR``) loads ``tdist.elastic._inspect``, and loaded the
    launcher's agent, and torch, with its package (1.2 s of CPU in a worker that needs none)."""
    code = (
        "import os, sys\n"
        f"os.environ.update(TDIST_STATUS_DIR={str(tmp_path)!r}, RANK='0', LOCAL_RANK='0', WORLD_SIZE='1')\n"
        "import tdist\n"
        "from tdist.elastic import report_progress\n"
        "print('torch' in sys.modules, 'tdist.elastic._inspect' in sys.modules)"
    )
    assert _python(code) == "False True"


def test_init_rpc_writes_no_environment_variable() -> None:
    code = (
        "import os, tdist.rpc as rpc\n"
        "written = []\n"
        "cls = type(os.environ)\n"
        "real = cls.__setitem__\n"
        "cls.__setitem__ = lambda self, k, v: (written.append(k), real(self, k, v))\n"
        "from tdist.testing import free_port\n"
        "opts = rpc.TensorPipeRpcBackendOptions(init_method=f'tcp://127.0.0.1:{free_port()}')\n"
        "rpc.init_rpc('w0', rank=0, world_size=1, rpc_backend_options=opts)\n"
        "rpc.rpc_sync('w0', max, args=(1, 2))\n"
        "rpc.shutdown()\n"
        "print(written)\n"
    )
    assert _python(code) == "[]"


@pytest.fixture
def _clean() -> Any:
    yield
    _destroy_all_worlds_for_tests()


def test_a_second_init_from_another_thread_raises_as_torchs_does(_clean: Any) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    errors: list[BaseException] = []
    seen: list[int] = []

    def other() -> None:
        seen.append(dist.get_world_size())  # a helper thread sees the process's group
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert seen == [1]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert "trying to initialize the default process group twice" in str(errors[0])
    dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize("shm", ["1", "0"], ids=["arena", "sockets"])
def test_collectives_never_change_torchs_thread_count(shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.set_num_threads is process-wide (threads started meanwhile inherit it, and a user
    # thread setting it at that moment would be undone): large collectives cap the intra-op
    # threads of their own thread only
    monkeypatch.setenv("TDIST_SHM", shm)
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    store = dist.HashStore()

    def body(rank: int, n: int) -> None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=30))
        try:
            t = torch.ones(4 << 20)
            dist.all_reduce(t)
            assert t[0].item() == n
        finally:
            dist.destroy_process_group()

    run_threads(body, 2, timeout=50)
    assert calls == []


def test_the_cap_is_this_threads_alone() -> None:
    torch_default = torch.get_num_threads()  # (2 on this machine's 2 cores)
    inside: list[int] = []
    others: list[int] = []
    ready, release = threading.Event(), threading.Event()

    def capped_thread() -> None:
        with capped(1):
            inside.append(torch.get_num_threads())
            ready.set()
            release.wait(10)
        inside.append(torch.get_num_threads())

    t = threading.Thread(target=capped_thread)
    t.start()
    assert ready.wait(10)
    others.append(torch.get_num_threads())  # this thread, meanwhile
    fresh = threading.Thread(target=lambda: others.append(torch.get_num_threads()))  # a new one
    fresh.start()
    fresh.join(10)
    release.set()
    t.join(10)
    assert inside == [1, torch_default]
    assert others == [torch_default, torch_default]
