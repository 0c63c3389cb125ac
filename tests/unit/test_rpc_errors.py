"""How exceptions cross an RPC: capture on the callee, a pickled record on the wire, rebuild."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import pickle
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NoReturn

import pytest
import torch

from tdist.rpc._errors import (
    MAX_PICKLED_BYTES,
    MAX_TEXT_CHARS,
    RemoteError,
    RemoteExceptionRecord,
    RemoteTraceback,
    capture,
    describe_call,
    plain_type,
    rebuild,
)

WORKER = "worker1 (id 1)"
ORIGIN = "On WorkerInfo(id=1, name=worker1)"  # torch's phrase for that worker, in the texts
CALL = "rpc_sync(worker1, tests.fn)"


# --- user exceptions, importable on the "caller" (this module) ------------------------------


class UserValueError(ValueError):
    pass


class WithCode(RuntimeError):
    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class ThreeFields(Exception):
    def __init__(self, host: str, port: int, why: str) -> None:
        super().__init__(host, port, why)
        self.host, self.port, self.why = host, port, why


class FieldsNotInArgs(Exception):
    """Pickles fine, but loads calls FieldsNotInArgs(message) and fails."""

    def __init__(self, host: str, port: int, why: str) -> None:
        super().__init__(f"{host}:{port}: {why}")
        self.host, self.port, self.why = host, port, why


class CustomStr(Exception):
    def __str__(self) -> str:
        return f"custom<{self.args[0]}>"


class WithLock(ValueError):
    """The constructor makes an attribute that does not pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class ReasonProperty(ValueError):
    @property
    def reason(self) -> str:
        return str(self.args[0])


class Prefixing(Exception):
    def __init__(self, message: str) -> None:
        super().__init__("prefix: " + message)


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class BadRepr(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


class BadReduce(Exception):
    def __reduce__(self) -> NoReturn:
        raise RuntimeError("__reduce__ is broken")


class BadEverything(Exception):
    def __init__(self, a: object, b: object) -> None:
        super().__init__(a, b)

    def __str__(self) -> str:
        raise SystemExit("str")

    def __repr__(self) -> str:
        raise KeyboardInterrupt

    def __reduce__(self) -> NoReturn:
        raise GeneratorExit


class UserInterrupt(KeyboardInterrupt):
    pass


# --- helpers --------------------------------------------------------------------------------


def raised(exc: BaseException) -> BaseException:
    """``exc`` after being raised and caught, so it has a traceback."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def over_the_wire(exc: BaseException, worker: str = WORKER) -> RemoteExceptionRecord:
    """Capture on the callee and pickle the record across, as the agent will."""
    record = capture(exc, worker)
    return pickle.loads(pickle.dumps(record))


def remote_call(fn: Callable[[], object], call: str | None = CALL) -> BaseException:
    """Run ``fn`` "remotely" and return what the caller gets."""
    try:
        fn()
    except BaseException as exc:
        record = capture(exc, WORKER)
    else:
        raise AssertionError("fn did not raise")
    return rebuild(pickle.loads(pickle.dumps(record)), call=call)


def kind(exc: BaseException) -> type[BaseException]:
    """The user's type of what the caller got (which may be that type and ``RuntimeError``)."""
    return plain_type(type(exc))


def full_text(exc: BaseException) -> str:
    """Everything a reader can see: the str, the notes and the cause."""
    notes = "\n".join(getattr(exc, "__notes__", []))
    return f"{exc}\n{notes}\n{exc.__cause__}"


def throw(exc: BaseException) -> NoReturn:
    raise exc


def divide() -> float:
    return 1 / 0


def raise_value_error() -> NoReturn:
    raise ValueError("Expected error")


# --- the record -----------------------------------------------------------------------------


def test_record_is_plain_data_and_pickles() -> None:
    record = over_the_wire(raised(ValueError("boom")))
    assert dataclasses.is_dataclass(record)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.message = "x"  # type: ignore[misc]
    for field in dataclasses.fields(record):
        assert type(getattr(record, field.name)) in (str, bytes, type(None)), field.name
    assert record.type_module == "builtins" and record.type_qualname == "ValueError"
    assert record.message == "boom" and record.exc_repr == "ValueError('boom')"
    assert record.worker == WORKER and record.pickled is not None
    assert record.traceback.startswith("Traceback (most recent call last):")
    assert record.traceback.endswith("ValueError: boom")
    # Loads without tdist's help: nothing but a dataclass of builtins.
    assert pickle.loads(pickle.dumps(record)) == record


def test_exception_never_raised_has_a_one_line_traceback() -> None:
    record = capture(ValueError("never raised"), WORKER)
    assert record.traceback == "ValueError: never raised"


# --- message form: the original type, the message extended -----------------------------------


@pytest.mark.parametrize(
    ("fn", "cls", "message"),
    [
        (raise_value_error, ValueError, "Expected error"),
        (divide, ZeroDivisionError, "division by zero"),
        (lambda: len(3), TypeError, "object of type 'int' has no len()"),  # type: ignore[arg-type]
        (lambda: torch.ones(2) @ torch.ones(3), RuntimeError, None),
        (lambda: throw(RuntimeError("rt")), RuntimeError, "rt"),
        (lambda: exec("assert 1 == 2, 'not equal'"), AssertionError, "not equal"),
        (lambda: exec("raise UserValueError('user')", globals()), UserValueError, "user"),
    ],
)
def test_message_form_keeps_type_and_puts_origin_in_str(
    fn: Callable[[], object], cls: type[BaseException], message: str | None
) -> None:
    exc = remote_call(fn)
    assert kind(exc) is cls
    text = str(exc)
    if message is not None:
        assert text.startswith(message + "\n\n" + ORIGIN + ", raised in " + CALL + ":\n")
    assert "Traceback (most recent call last):" in text
    assert ORIGIN in text and CALL in text
    assert len(exc.args) == 1 and exc.args[0] == text
    # Nothing else attached: the text is printed once.
    assert not hasattr(exc, "__notes__") and exc.__cause__ is None


def test_pytest_raises_match_on_the_original_message() -> None:
    exc = remote_call(raise_value_error)
    with pytest.raises(ValueError, match=r"^Expected error") as info:
        raise exc
    # torch's tests: assertRaisesRegex(ValueError, "Expected error") is a re.search.
    assert re.search("Expected error", str(info.value))
    # The remote frame is named in the text.
    assert "in raise_value_error" in str(info.value)
    assert 'raise ValueError("Expected error")' in str(info.value)


def test_message_form_without_call() -> None:
    exc = remote_call(raise_value_error, call=None)
    assert str(exc).startswith(f"Expected error\n\n{ORIGIN}:\nTraceback")


def test_message_form_keeps_extra_attributes() -> None:
    exc = remote_call(lambda: throw(WithCode("bad code", code=7)))
    assert kind(exc) is WithCode and exc.code == 7  # type: ignore[attr-defined]
    assert str(exc).startswith("bad code\n\nOn WorkerInfo(")


def test_remote_notes_travel() -> None:
    def fn() -> NoReturn:
        err = ValueError("with a note")
        err.add_note("remote note")
        raise err

    exc = remote_call(fn)
    assert type(exc) is ValueError and exc.__notes__ == ["remote note"]
    assert str(exc).startswith("with a note\n\nOn WorkerInfo(")


def test_chained_causes_are_in_the_traceback() -> None:
    def fn() -> NoReturn:
        try:
            try:
                {}["inner"]
            except KeyError:
                raise OSError("context") from None
        except OSError as err:
            raise ValueError("outer") from err

    exc = remote_call(fn)
    assert type(exc) is ValueError
    text = str(exc)
    assert "OSError: context" in text
    assert "The above exception was the direct cause of the following exception:" in text
    assert "KeyError" not in text  # `from None` suppressed it remotely, so here too

    def implicit() -> NoReturn:
        try:
            raise KeyError("first")
        except KeyError:
            raise ValueError("second")  # noqa: B904 (the implicit chain is the point)

    text = str(remote_call(implicit))
    assert "KeyError: 'first'" in text
    assert "During handling of the above exception, another exception occurred:" in text


def test_raised_inside_a_callback_keeps_type() -> None:
    # An async_execution function completes its future from a callback; the agent captures
    # what wait() raises. set_exception keeps the object, so the type survives.
    def async_fn() -> torch.futures.Future[Any]:
        source: torch.futures.Future[int] = torch.futures.Future()
        result: torch.futures.Future[Any] = torch.futures.Future()

        def callback(fut: torch.futures.Future[int]) -> None:
            try:
                {}[fut.wait()]
            except KeyError as err:
                result.set_exception(err)

        source.add_done_callback(callback)
        source.set_result(5)
        return result

    exc = remote_call(lambda: async_fn().wait())
    assert kind(exc) is KeyError and exc.args == (5,)
    assert "in callback" in full_text(exc)


# --- note form: args untouched, origin in a note and a RemoteTraceback cause -----------------


@pytest.mark.parametrize(
    ("make", "check"),
    [
        (lambda: {}["k"], lambda e: kind(e) is KeyError and e.args == ("k",)),
        (lambda: {}[("a", 1)], lambda e: kind(e) is KeyError and e.args == (("a", 1),)),
        (lambda: {}[3], lambda e: kind(e) is KeyError and e.args == (3,) and str(e) == "3"),
        (
            lambda: open("/nonexistent/tdist-test"),
            lambda e: (
                kind(e) is FileNotFoundError
                and e.errno == errno.ENOENT
                and e.filename == "/nonexistent/tdist-test"
            ),
        ),
        (
            lambda: throw(OSError(errno.EPIPE, "Broken pipe")),
            lambda e: (
                kind(e) is BrokenPipeError
                and e.errno == errno.EPIPE
                and e.strerror == "Broken pipe"
            ),
        ),
        (lambda: next(iter(())), lambda e: kind(e) is StopIteration and e.args == ()),
        (
            lambda: throw(StopIteration("v")),
            lambda e: kind(e) is StopIteration and e.value == "v" and e.args == ("v",),
        ),
        (
            lambda: throw(StopIteration(42)),
            lambda e: kind(e) is StopIteration and e.value == 42,
        ),
        (lambda: exec("assert False"), lambda e: kind(e) is AssertionError and e.args == ()),
        (
            lambda: throw(ThreeFields("h", 29500, "refused")),
            lambda e: kind(e) is ThreeFields and (e.host, e.port, e.why) == ("h", 29500, "refused"),
        ),
        (
            lambda: throw(CustomStr("x")),
            lambda e: kind(e) is CustomStr and str(e) == "custom<x>",
        ),
        (
            lambda: throw(ValueError(1, 2)),
            lambda e: type(e) is ValueError and e.args == (1, 2),
        ),
        (
            lambda: throw(ReasonProperty("why")),
            lambda e: kind(e) is ReasonProperty and e.reason == "why",
        ),
        (
            lambda: throw(ValueError()),
            lambda e: type(e) is ValueError and e.args == (),
        ),
    ],
)
def test_note_form_keeps_type_and_args(
    make: Callable[[], object], check: Callable[[Any], bool]
) -> None:
    exc = remote_call(make)
    assert check(exc), repr(exc)
    (note,) = exc.__notes__
    assert note.startswith(f"{ORIGIN}, raised in {CALL}:\nTraceback (most recent call last):")
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert str(exc.__cause__) == note
    assert exc.__cause__.worker == WORKER and exc.__cause__.call == CALL
    assert exc.__cause__.remote_traceback in note


def test_key_error_prints_remote_traceback() -> None:
    import traceback

    exc = remote_call(lambda: {}["missing"])
    try:
        raise exc
    except KeyError as caught:
        printed = "".join(traceback.format_exception(caught))
    assert f"RemoteTraceback: {ORIGIN}" in printed
    assert printed.rstrip().endswith("KeyError: 'missing'")  # the note's last line
    assert "The above exception was the direct cause" in printed


def test_a_message_rewritten_by_the_constructor_is_quoted() -> None:
    exc = remote_call(lambda: throw(Prefixing("x")))
    # Unpickling called Prefixing("prefix: x"): the type is kept, the remote text is quoted.
    assert kind(exc) is Prefixing
    assert "The message on the remote side was: prefix: x" in exc.__notes__[0]


# --- rebuilt from the message alone (no usable pickle) ---------------------------------------


def test_unpicklable_attribute_rebuilt_from_message() -> None:
    record = over_the_wire(raised(WithLock("locked out")))
    assert record.pickled is None
    exc = rebuild(record, call=CALL)
    assert kind(exc) is WithLock
    assert str(exc).startswith("locked out\n\n")
    assert "attributes not derived from it were not kept" in str(exc)
    assert ORIGIN in str(exc) and "Traceback" in str(exc)


def test_bad_reduce_rebuilt_from_message() -> None:
    record = over_the_wire(raised(BadReduce("no pickle")))
    assert record.pickled is None
    exc = rebuild(record)
    assert kind(exc) is BadReduce and str(exc).startswith("no pickle\n\n")


def test_a_constructor_of_other_arguments_than_its_args_keeps_type_and_fields() -> None:
    # plain pickling would call FieldsNotInArgs("h:1: why") on the caller, which fails: the
    # exception travels as its type, args and attributes, rebuilt without its constructor
    exc = rebuild(over_the_wire(raised(FieldsNotInArgs("h", 1, "why"))), call=CALL)
    assert kind(exc) is FieldsNotInArgs and exc.args == ("h:1: why",)
    assert (exc.host, exc.port, exc.why) == ("h", 1, "why")
    assert str(exc).startswith("h:1: why")
    assert ORIGIN in "".join(exc.__notes__) and "Traceback" in "".join(exc.__notes__)
    assert isinstance(exc.__cause__, RemoteTraceback)


class TwoArgValueError(ValueError):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}-{b}")


def test_a_type_torch_cannot_make_from_its_message_is_a_runtime_error_saying_what_it_was() -> None:
    # torch's RPC calls type(message), and for a type that refuses it raises a RuntimeError
    # whose text says "Original exception on remote side was ...": ours keeps the type, and
    # is that RuntimeError, whose str() says so too
    for original, text in [(FieldsNotInArgs("h", 1, "why"), "h:1: why"), (TwoArgValueError(1, 2), "1-2")]:
        exc = rebuild(over_the_wire(raised(original)), call=CALL)
        assert kind(exc) is type(original) and isinstance(exc, RuntimeError)
        assert str(exc).startswith(text)
        assert f"Original exception on remote side was {type(original).__name__}(" in str(exc)
        # a second hop says it once, and the type is still kept
        again = rebuild(over_the_wire(raised(exc)), call=CALL)
        assert kind(again) is type(original) and str(again).count("Original exception on remote side") == 1
    # a type made from its message reads as it did
    assert "Original exception" not in str(rebuild(over_the_wire(raised(KeyError("k")))))
    assert "Original exception" not in str(rebuild(over_the_wire(raised(UserValueError("u")))))


def test_a_class_that_says_how_to_pickle_it_is_not_rebuilt_without_its_constructor() -> None:
    exc = rebuild(over_the_wire(raised(BadReduce("no pickle"))))
    assert kind(exc) is BadReduce  # (from its message: its __reduce__ is not bypassed)


def test_non_string_argument_is_not_rebuilt_as_its_str() -> None:
    lock = threading.Lock()
    exc = remote_call(lambda: throw(ValueError(lock)))
    assert type(exc) is RemoteError and exc.remote_type == "ValueError"


def test_huge_pickle_is_dropped_and_message_form_used() -> None:
    big = "y" * (MAX_PICKLED_BYTES + 10)
    record = over_the_wire(raised(ValueError(big)))
    assert record.pickled is None and len(record.message) <= MAX_TEXT_CHARS
    exc = rebuild(record)
    assert type(exc) is ValueError and str(exc).startswith("y" * 1000)


# --- RemoteError fallback --------------------------------------------------------------------


def test_local_class_becomes_remote_error() -> None:
    class LocalError(Exception):
        pass

    exc = remote_call(lambda: throw(LocalError("local boom")))
    assert type(exc) is RemoteError and isinstance(exc, RuntimeError)
    assert exc.remote_type.endswith("<locals>.LocalError")
    assert exc.worker == WORKER and exc.call == CALL and exc.message == "local boom"
    assert "local class" in exc.reason
    assert exc.remote_traceback.endswith("LocalError: local boom")
    text = str(exc)
    assert text.startswith(f"{exc.remote_type}: local boom\n")
    assert ORIGIN in text and CALL in text and exc.remote_traceback in text
    with pytest.raises(RuntimeError, match="local boom"):
        raise exc


def test_missing_module_becomes_remote_error() -> None:
    module = types.ModuleType("tdist_vanishing_module")
    exec("class Gone(Exception):\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        record = over_the_wire(raised(module.Gone("gone")))
    finally:
        del sys.modules[module.__name__]
    assert record.pickled is not None  # it pickled on the callee...
    exc = rebuild(record)  # ...and the caller lacks the module
    assert type(exc) is RemoteError and exc.remote_type == "tdist_vanishing_module.Gone"
    assert "cannot be imported here" in exc.reason and "gone" in str(exc)


@pytest.mark.parametrize(
    "exc",
    [
        KeyboardInterrupt(),
        SystemExit(3),
        GeneratorExit(),
        UserInterrupt("u"),
        asyncio.CancelledError(),
    ],
)
def test_base_exceptions_are_never_rebuilt_as_such(exc: BaseException) -> None:
    out = rebuild(over_the_wire(raised(exc)), call=CALL)
    assert type(out) is RemoteError and isinstance(out, Exception)
    assert "is not an Exception" in out.reason
    assert type(exc).__name__ in str(out) and ORIGIN in str(out)


def test_remote_error_crosses_a_second_hop() -> None:
    class LocalError(Exception):
        pass

    first = remote_call(lambda: throw(LocalError("deep")))
    assert isinstance(first, RemoteError)
    record = over_the_wire(raised(first), worker="worker2 (id 2)")
    assert record.pickled is not None
    second = rebuild(record, call="rpc_sync(worker2, relay)")
    assert type(second) is RemoteError
    assert second.remote_type == first.remote_type and second.worker == WORKER
    # Message form again: the first hop's text, then the second hop's origin.
    assert str(second).startswith(
        str(first) + "\n\nOn WorkerInfo(id=2, name=worker2), raised in rpc_sync(worker2, relay):"
    )


# --- also a RuntimeError, as torch raises it ---------------------------------------------------


class Sealed(Exception):
    """Refuses subclasses: cannot be made a RuntimeError too."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("Sealed is final")


@pytest.mark.parametrize(
    ("make", "cls", "fields"),
    [
        (lambda: {}["k"], KeyError, {"args": ("k",)}),
        (lambda: exec("assert False, 'nope'"), AssertionError, {}),
        (divide, ZeroDivisionError, {}),
        (
            lambda: open("/nonexistent/tdist-test"),
            FileNotFoundError,
            {"errno": errno.ENOENT, "filename": "/nonexistent/tdist-test", "strerror": "No such file or directory"},
        ),
        (lambda: throw(StopIteration(42)), StopIteration, {"value": 42}),
        (lambda: throw(ThreeFields("h", 29500, "refused")), ThreeFields, {"host": "h", "port": 29500}),
        (lambda: throw(FieldsNotInArgs("h", 1, "why")), FieldsNotInArgs, {"args": ("h:1: why",), "why": "why"}),
        (lambda: throw(CustomStr("x")), CustomStr, {}),
        (lambda: throw(AttributeError("gone")), AttributeError, {}),
    ],
)
def test_types_torch_raises_as_runtime_error_are_also_runtime_errors(
    make: Callable[[], object], cls: type[BaseException], fields: dict[str, Any]
) -> None:
    exc = remote_call(make)
    # both: ``except RuntimeError`` (torch) and ``except KeyError`` (the original) catch it
    assert isinstance(exc, cls) and isinstance(exc, RuntimeError), type(exc).__mro__
    assert kind(exc) is cls and type(exc) is not cls
    names = (type(exc).__name__, type(exc).__qualname__, type(exc).__module__)
    assert names == (cls.__name__, cls.__qualname__, cls.__module__)
    assert repr(exc).startswith(f"{cls.__name__}(")
    for name, value in fields.items():
        assert getattr(exc, name) == value, name
    assert ORIGIN in full_text(exc) and "Traceback" in full_text(exc)
    # one class per type
    assert type(remote_call(make)) is type(exc)
    # it pickles as the original type (FieldsNotInArgs does not load back, as itself), and
    # crosses a second hop as the first
    if cls is not FieldsNotInArgs:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls and back.args == exc.args
    second = rebuild(over_the_wire(raised(exc), worker="worker2 (id 2)"), call="rpc_sync(worker2, relay)")
    assert kind(second) is cls and isinstance(second, RuntimeError)
    for name, value in fields.items():
        assert getattr(second, name) == value, name
    assert "On WorkerInfo(id=2, name=worker2)" in full_text(second)


@pytest.mark.parametrize(
    "make",
    [
        raise_value_error,
        lambda: len(3),  # type: ignore[arg-type]
        lambda: throw(UserValueError("user")),
        lambda: throw(WithCode("rt", code=3)),
        lambda: throw(NotImplementedError("ni")),
    ],
)
def test_types_torch_keeps_are_not_made_runtime_errors(make: Callable[[], object]) -> None:
    # torch re-raises ValueError and TypeError as such (``except RuntimeError`` misses them)
    exc = remote_call(make)
    assert plain_type(type(exc)) is type(exc)
    assert isinstance(exc, RuntimeError) == (not isinstance(exc, (ValueError, TypeError)))


@pytest.mark.parametrize(
    ("make", "remote_type"),
    [
        (lambda: throw(Exception("plain")), "Exception"),
        (lambda: throw(Sealed("sealed")), f"{__name__}.Sealed"),
    ],
)
def test_a_type_that_cannot_be_made_a_runtime_error_becomes_remote_error(
    make: Callable[[], object], remote_type: str
) -> None:
    exc = remote_call(make)
    assert type(exc) is RemoteError and exc.remote_type == remote_type
    assert "cannot be combined with RuntimeError" in exc.reason
    assert ORIGIN in str(exc) and "Traceback" in str(exc)


def test_a_remote_error_raised_again_in_a_then_callback_reads_as_torchs() -> None:
    from tdist.rpc._future import Future

    exc = remote_call(lambda: {}["k"])
    source = Future()
    source.set_exception(exc)
    with pytest.raises(KeyError) as info:
        source.then(lambda f: f.wait()).wait()
    got = info.value
    assert isinstance(got, RuntimeError) and kind(got) is KeyError
    assert str(got) == "Got the following error when running the callback: KeyError: 'k'"
    assert type(pickle.loads(pickle.dumps(got))) is KeyError  # (what a remote caller gets)


def test_origin_names_the_worker_as_torch_does() -> None:
    exc = remote_call(lambda: throw(RuntimeError("rt")))
    assert f"\n\n{ORIGIN}, raised in {CALL}:\nTraceback" in str(exc)
    other = rebuild(over_the_wire(raised(RuntimeError("rt")), worker="just-a-label"))
    assert "\n\nOn just-a-label:\nTraceback" in str(other)


def test_remote_error_and_remote_traceback_pickle() -> None:
    err = RemoteError(
        "m", remote_type="a.B", remote_traceback="tb", worker="w", call="c", reason="r"
    )
    err.add_note("a note")
    back = pickle.loads(pickle.dumps(err))
    assert back.__notes__ == ["a note"]
    assert type(back) is RemoteError and str(back) == str(err)
    assert (back.remote_type, back.remote_traceback, back.worker, back.call, back.reason) == (
        "a.B",
        "tb",
        "w",
        "c",
        "r",
    )
    tb = RemoteTraceback("w", "c", "tb")
    assert str(pickle.loads(pickle.dumps(tb))) == str(tb) == "On w, raised in c:\ntb"


# --- never lost ------------------------------------------------------------------------------


def test_broken_str_is_captured() -> None:
    record = over_the_wire(raised(BadStr("payload")))
    assert record.message.startswith("<str() failed: RuntimeError: __str__ is broken")
    assert "payload" in record.message  # the repr fallback shows the args
    exc = rebuild(record, call=CALL)
    assert kind(exc) is BadStr and exc.args == ("payload",)
    assert ORIGIN in exc.__notes__[0]


def test_broken_repr_is_captured() -> None:
    record = over_the_wire(raised(BadRepr("r")))
    assert record.exc_repr == "<BadRepr('r'); repr() failed>"
    exc = rebuild(record)
    assert kind(exc) is BadRepr and str(exc).startswith("r\n\n")


def test_everything_broken_still_yields_text() -> None:
    record = over_the_wire(raised(BadEverything(1, 2)))
    assert record.pickled is None
    assert "<str() failed: SystemExit" in record.message
    assert record.exc_repr == "<BadEverything(1, 2); repr() failed>"
    assert "Traceback (most recent call last):" in record.traceback
    exc = rebuild(record, call=CALL)
    assert type(exc) is RemoteError
    text = str(exc)
    assert f"{__name__}.BadEverything" in text and ORIGIN in text and "in raised" in text


def test_enormous_message_is_truncated_with_a_marker() -> None:
    message = "x" * 100_000 + "END"
    record = over_the_wire(raised(ValueError(message)))
    for text in (record.message, record.exc_repr, record.traceback):
        assert len(text) <= MAX_TEXT_CHARS
        assert re.search(r"\[\.\.\. \d+ characters cut \.\.\.\]", text)
    assert record.message.startswith("x" * 40_000) and record.message.endswith("END")
    assert record.traceback.startswith("Traceback") and record.traceback.endswith("END")
    # The pickle is within bounds, so the caller gets the whole original message.
    exc = rebuild(record)
    assert type(exc) is ValueError and str(exc).startswith(message + "\n\nOn WorkerInfo(")


def test_rebuild_of_a_garbage_record_never_raises() -> None:
    record = RemoteExceptionRecord(
        type_module=None,  # type: ignore[arg-type]
        type_qualname=3,  # type: ignore[arg-type]
        message="msg",
        exc_repr="?",
        traceback="tb",
        worker="w",
        pickled=b"not a pickle",
    )
    exc = rebuild(record)
    assert type(exc) is RemoteError and "msg" in str(exc)
    exc = rebuild(dataclasses.replace(capture(raised(ValueError("v")), "w"), pickled=b"\x80junk"))
    assert type(exc) is ValueError and str(exc).startswith("v\n\n")  # rebuilt from the message


def test_capture_never_raises_on_a_non_string_worker() -> None:
    record = capture(raised(ValueError("v")), 7)  # type: ignore[arg-type]
    assert record.worker == "7"


# --- describe_call ---------------------------------------------------------------------------


class Holder:
    def method(self) -> None:
        pass

    def __call__(self) -> None:
        pass

    def __repr__(self) -> str:
        return "Holder()"


class BadReprCallable:
    def __call__(self) -> None:
        pass

    def __repr__(self) -> str:
        raise RuntimeError("no")


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (divide, f"{__name__}.divide"),
        (Holder.method, f"{__name__}.Holder.method"),
        (Holder().method, f"{__name__}.Holder.method"),
        (Holder, f"{__name__}.Holder"),
        (len, "len"),
        (torch.add, "torch.add"),
        ([].append, "list.append"),
        (Holder(), "Holder()"),
        (BadReprCallable(), "<BadReprCallable(); repr() failed>"),
    ],
)
def test_describe_call(fn: object, expected: str) -> None:
    assert describe_call(fn) == expected


def test_describe_call_partial_lambda_and_long_repr() -> None:
    import functools

    assert describe_call(functools.partial(divide)) == f"partial({__name__}.divide)"
    assert describe_call(lambda: None).endswith(
        "test_describe_call_partial_lambda_and_long_repr.<locals>.<lambda>"
    )

    class Long:
        def __repr__(self) -> str:
            return "L" * 1000

    assert len(describe_call(Long())) <= 200
