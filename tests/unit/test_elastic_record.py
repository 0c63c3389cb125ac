"""``tdist.elastic.multiprocessing.errors.record`` (torchelastic's ``@record``) in-process: what it
writes to ``TORCHELASTIC_ERROR_FILE``, and what it lets through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tdist.elastic._policy import parse_error_file
from tdist.elastic.multiprocessing.errors import ErrorHandler, record

pytestmark = pytest.mark.timeout(30)


def test_record_writes_the_exception_and_raises_it_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main(x: int) -> int:
        raise ValueError(f"bad {x}")

    with pytest.raises(ValueError, match="bad 3"):
        main(3)
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "ValueError: bad 3"
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):") and "in main" in callstack
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    parsed = parse_error_file(str(path), path.read_text())
    assert parsed is not None and parsed.message == "ValueError: bad 3" and parsed.traceback == callstack
    assert main.__name__ == "main"


def test_record_returns_values_and_passes_exits_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert record(lambda: 5)() == 5

    def leave(code: int) -> None:
        raise SystemExit(code)

    assert record(leave)(0) is None  # exit code 0: returns, as torch's
    with pytest.raises(SystemExit):
        record(leave)(3)
    assert not path.exists()  # neither is recorded


def test_record_without_an_error_file_and_with_a_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(KeyError):
        record(lambda: {}["x"])()  # (nothing to write to)
    seen: list[BaseException] = []

    class Mine(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            seen.append(e)

    @record(error_handler=Mine())
    def fail() -> None:
        raise RuntimeError("mine")

    with pytest.raises(RuntimeError):
        fail()
    assert [str(e) for e in seen] == ["mine"]


def test_parse_error_file_refuses_what_is_not_one() -> None:
    assert parse_error_file("p", "not json") is None
    assert parse_error_file("p", json.dumps({"other": 1})) is None
    plain = parse_error_file("p", json.dumps({"message": "segfault"}))
    assert plain is not None and plain.message == "segfault"
