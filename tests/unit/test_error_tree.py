"""The tdist exception tree derives from torch's classes where torch has them: code written
against ``torch.distributed`` that catches torch's errors catches tdist's."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import subprocess
import sys
from collections import defaultdict

import pytest
import torch.distributed as td
import torch.distributed.elastic.rendezvous.api as torch_rdzv

import tdist
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
        (e.CollectiveTimeoutError, td.DistBackendError),
    ],
)
def test_torch_handlers_catch_tdist_errors(ours: type[BaseException], torchs: type[BaseException]) -> None:
    with pytest.raises(torchs):
        raise ours("boom")
    assert issubclass(ours, RuntimeError)


def test_timeouts_stay_builtin_timeouts_and_errors_pickle() -> None:
    assert issubclass(e.StoreTimeoutError, TimeoutError) and issubclass(e.DistTimeoutError, TimeoutError)
    assert issubclass(e.CollectiveTimeoutError, e.DistTimeoutError)  # (an ``except`` of either catches it)
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


# Every exception class tdist defines outside the DistError tree, and why; drawn, with the same
# reasons, in the second figure of tdist._core.errors's docstring
OUTSIDE_THE_TREE = {
    # a remote function's exception whose type cannot be rebuilt on the caller: the user's
    # error, not tdist's (``except DistError`` must not catch a bug in the remote function); a
    # RuntimeError, as torch's fallback
    "tdist.rpc._errors.RemoteError",
    # the remote traceback, only ever the __cause__ of a rebuilt exception (as
    # concurrent.futures' _RemoteTraceback)
    "tdist.rpc._errors.RemoteTraceback",
    # torch-mandated: torchelastic's rendezvous errors derive from Exception, not RuntimeError
    # (torch.distributed.elastic.rendezvous.api), and ours keep its bases
    "tdist.elastic.rendezvous.RendezvousError",
    "tdist.elastic.rendezvous.RendezvousClosedError",
    "tdist.elastic.rendezvous.RendezvousTimeoutError",
    "tdist.elastic.rendezvous.RendezvousConnectionError",
    "tdist.elastic.rendezvous.RendezvousStateError",
    "tdist.elastic.rendezvous.RendezvousGracefulExitError",
}


def _tdist_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in tdist, found by importing every module of the package
    and walking BaseException's subclasses (so a class nested in another or made in a function
    at import counts too)."""

    def failed(name: str) -> None:
        raise AssertionError(f"importing {name} failed")

    for info in pkgutil.walk_packages(tdist.__path__, "tdist.", onerror=failed):
        importlib.import_module(info.name)
    found: dict[type[BaseException], None] = {}
    todo: list[type[BaseException]] = [BaseException]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found[sub] = None
                todo.append(sub)
    return [c for c in found if c.__module__.partition(".")[0] == "tdist"]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_one_tree_one_class_per_name_and_every_class_drawn() -> None:
    classes = _tdist_exception_classes()
    by_name: dict[str, list[str]] = defaultdict(list)
    for cls in classes:
        by_name[cls.__name__].append(_qualified(cls))
    assert {n: q for n, q in by_name.items() if len(q) > 1} == {}, "one class per name"
    outside = {_qualified(c) for c in classes if not issubclass(c, e.DistError)}
    assert outside == OUTSIDE_THE_TREE  # (a stale entry fails as well as a new class)
    assert e.__doc__ is not None
    undrawn = sorted(c.__name__ for c in classes if c.__name__ not in e.__doc__)
    assert undrawn == [], "draw them in the docstring of tdist._core.errors"
    # found there at all: the walk reaches classes defined outside _core.errors
    assert {"RpcTimeoutError", "Refused", "RankTimeoutError", "LaunchError"} <= set(by_name)


def test_the_rendezvous_errors_keep_torchs_bases() -> None:
    from tdist.elastic import rendezvous as ours

    for qualified in sorted(q for q in OUTSIDE_THE_TREE if ".rendezvous." in q):
        name = qualified.rpartition(".")[2]
        mine, torchs = getattr(ours, name), getattr(torch_rdzv, name)
        assert [b.__name__ for b in mine.__mro__] == [b.__name__ for b in torchs.__mro__], name
