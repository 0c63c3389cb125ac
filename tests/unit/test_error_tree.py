"""The tdist exception tree derives from torch's classes where torch has them: code written
against ``torch.distributed`` that catches torch's errors catches tdist's."""

from __future__ import annotations

import pickle

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
