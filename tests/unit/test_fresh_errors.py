"""``errors.fresh`` and ``errors.fail_future``: the copies raised in place of a kept exception
are the same exception in every way a caller can see, and the kept one never gains frames."""

from __future__ import annotations

import pytest
import torch

from tdist._core.errors import (
    CollectiveTimeoutError,
    DistError,
    PeerError,
    fail_future,
    fresh,
    origin,
)


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_copy_has_the_type_text_attributes_notes_and_causes_and_no_frames() -> None:
    cause = raised(OSError("reset"))
    kept = PeerError("rank 1 was lost", peer=1)
    kept.__cause__ = cause
    kept.__context__ = cause
    kept.__suppress_context__ = True
    kept.add_note("what rank 1 was doing")
    kept = raised(kept)
    assert kept.__traceback__ is not None
    copy = fresh(kept)
    assert copy is not kept and type(copy) is PeerError
    assert str(copy) == str(kept) and copy.args == kept.args and copy.peer == 1
    assert copy.__notes__ == ["what rank 1 was doing"]
    copy.add_note("a caller's own note")  # (on the copy alone: the next copy has the kept notes)
    assert kept.__notes__ == ["what rank 1 was doing"]
    assert copy.__suppress_context__ and copy.__traceback__ is None
    # its cause a copy too, without frames (one the copy kept would reach the frames below the
    # keeper's, and theirs through ``f_back``); one copy for the cause and the context alike
    assert type(copy.__cause__) is OSError and str(copy.__cause__) == "reset" and copy.__cause__ is not cause
    assert copy.__cause__.__traceback__ is None and copy.__context__ is copy.__cause__
    # where each was raised, as a summary without frames (what an RPC's remote traceback shows)
    assert [f.name for f in origin(copy)] == [f.name for f in origin(copy.__cause__)] == ["raised"]
    assert origin(fresh(copy)) is origin(copy)  # (a copy of a copy: where the first was raised)
    assert origin(kept) is None and origin(fresh(DistError("never raised"))) is None


def test_raising_copies_leaves_the_kept_one_without_frames() -> None:
    kept = DistError("the group is broken")
    for _ in range(3):
        with pytest.raises(DistError, match="the group is broken") as info:
            raise fresh(kept)
        assert info.value is not kept
    assert kept.__traceback__ is None


def test_a_class_with_two_builtin_bases_copies() -> None:
    # (``RuntimeError.__new__``, found first by name, refuses to make one: ``OSError``'s makes it)
    copy = fresh(CollectiveTimeoutError("all_reduce timed out"))
    assert type(copy) is CollectiveTimeoutError and isinstance(copy, TimeoutError)
    assert str(copy) == "all_reduce timed out"


class Coded(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"failed with code {code}")
        self.code = code


class Prefixed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(f"prefix: {message}")


class Slotted(Exception):
    __slots__ = ("_why",)

    def __init__(self, why: str) -> None:
        super().__init__()
        self._why = why

    def __str__(self) -> str:
        return self._why


@pytest.mark.parametrize(
    "exc",
    [
        OSError(2, "No such file", "/x"),
        StopIteration(5),
        KeyError("k"),
        Coded(3),  # (a constructor that takes other arguments than its args)
        Prefixed("m"),  # (one that rewrites its argument: called again, it would say "prefix: prefix: m")
    ],
    ids=lambda e: type(e).__name__,
)
def test_builtin_and_user_types_copy_without_their_constructor(exc: BaseException) -> None:
    copy = fresh(exc)
    assert copy is not exc and type(copy) is type(exc)
    assert str(copy) == str(exc) and copy.args == exc.args and vars(copy) == vars(exc)
    for name in ("filename", "errno", "strerror", "value", "code"):
        assert getattr(copy, name, None) == getattr(exc, name, None), name


def test_a_type_whose_copy_would_differ_is_given_back_itself() -> None:
    exc = Slotted("kept in a slot that no copy sees")
    assert fresh(exc) is exc


def test_a_failed_future_raises_a_copy_at_every_wait() -> None:
    fut: torch.futures.Future[object] = torch.futures.Future()
    kept = PeerError("rank 1 was lost", peer=1)
    fail_future(fut, kept)
    seen = []
    for get in (fut.wait, fut.wait, fut.value):
        with pytest.raises(PeerError, match="rank 1 was lost") as info:
            get()
        seen.append(info.value)
    assert all(e is not kept and e.peer == 1 for e in seen) and len({id(e) for e in seen}) == 3
    assert kept.__traceback__ is None
    assert fut.done()
    with pytest.raises(AssertionError, match="not an Exception"):  # (torch's check)
        fail_future(torch.futures.Future(), KeyboardInterrupt())
