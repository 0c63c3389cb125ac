"""The tdist exception tree derives from torch's classes where torch has them: code written
against ``torch.distributed`` that catches torch's errors catches tdist's."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch.distributed as td

from tdist._core import errors as e

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("ours", "torchs"),
    [
        (e.DistError, td.DistError),
        (e.DistBackendError, td.DistBackendError),
        (e.PeerError, td.DistBackendError),
        (e.DistNetworkError, td.DistNetworkError),
        (e.AuthenticationError, td.DistNetworkError),
        (e.DistStoreError, td.DistStoreError),
        (e.StoreTimeoutError, td.DistStoreError),
        (e.QueueEmptyError, td.QueueEmptyError),
        (e.DistTimeoutError, td.DistError),
    ],
)
def test_torch_handlers_catch_tdist_errors(ours: type[BaseException], torchs: type[BaseException]) -> None:
    with pytest.raises(torchs):
        raise ours("boom")
    assert issubclass(ours, RuntimeError)


def test_timeouts_stay_builtin_timeouts_and_errors_pickle() -> None:
    assert issubclass(e.StoreTimeoutError, TimeoutError) and issubclass(e.DistTimeoutError, TimeoutError)
    err = pickle.loads(pickle.dumps(e.PeerError("worker1 died", peer=1)))
    assert type(err) is e.PeerError and str(err) == "worker1 died" and err.peer == 1
    assert type(pickle.loads(pickle.dumps(e.StoreTimeoutError("late")))) is e.StoreTimeoutError


def _python(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_import_tdist_is_light_until_a_name_is_used() -> None:
    out = _python(
        "import sys, tdist as dist\n"
        "print('torch' in sys.modules)\n"
        "from tdist import TCPStore, all_reduce\n"
        "import torch.distributed as td\n"
        "print('torch' in sys.modules, issubclass(dist.DistStoreError, td.DistStoreError),\n"
        "      dist.distributed_c10d.all_reduce is all_reduce, 'init_rpc' in dir(dist.rpc),\n"
        "      set(dist.__all__) <= set(dir(dist)))\n"
    )
    assert out.splitlines() == ["False", "True True True True True"]


def test_the_tdist_command_builds_torchs_tree_without_torch() -> None:
    # what console_main does before it imports the launcher and the store
    out = _python(
        "import sys\n"
        "from tdist._core import _process\n"
        "_process.TORCHLESS = True\n"
        "from tdist._core import errors as e\n"
        "from tdist.elastic import launch\n"
        "from tdist.store import TCPStore\n"
        "print('torch' in sys.modules, [c.__name__ for c in e.QueueEmptyError.__mro__[1:6]],\n"
        "      issubclass(e.StoreTimeoutError, TimeoutError), issubclass(e.DistError, RuntimeError))\n"
    )
    assert out == (
        "False ['DistStoreError', 'DistError', '_TorchQueueEmptyError', '_TorchStoreError', "
        "'_TorchDistError'] True True"
    )
