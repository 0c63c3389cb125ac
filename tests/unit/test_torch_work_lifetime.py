"""How long the torch backend keeps its works alive for torch's C++ side (``_torch_pg._Held``):
small works until used and a little after, large ones never beyond Python's references; safe
from several threads, and cheap with many works in flight."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from tdist.c10d import _torch_pg as tp

pytestmark = pytest.mark.timeout(60)


class _Pending:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _work(nbytes: int, done: bool = True) -> tp.TorchWork:
    return tp.TorchWork(_Pending(done), [torch.zeros(nbytes // 4)])  # type: ignore[arg-type]


def test_small_works_live_until_used_and_a_little_after_large_ones_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "_held", tp._Held())
    large = weakref.ref(_work(1 << 20))
    small = _work(16)
    probe = weakref.ref(small)
    del small
    gc.collect()
    assert large() is None  # (no tensor of size outlives Python's references)
    assert probe() is not None  # (torch's C++ may still wait on it)
    tp._held.used(probe())  # type: ignore[arg-type]
    for _ in range(tp._Held._AFTER - 1):
        tp._held.used(_work(16))
    gc.collect()
    assert probe() is not None  # (torch's reducer reads the future right after its wait)
    for _ in range(2):
        tp._held.used(_work(16))
    gc.collect()
    assert probe() is None


def test_many_works_in_flight_cost_little_and_threads_do_not_race(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "_held", tp._Held())
    started = time.perf_counter()
    pending = [_work(16, done=False) for _ in range(3000)]  # (none can be let go)
    assert time.perf_counter() - started < 10  # (was quadratic: a scan on every one past the cap)
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(5000):
                w = _work(16)
                tp._held.used(w)
                tp._held.used(w)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(id(w) in tp._held._works for w in pending)  # (pending ones are never let go)
