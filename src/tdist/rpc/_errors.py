"""How an exception raised by a remote function crosses an RPC, sans-IO.

Theory of operation
-------------------
The callee turns the exception into a :class:`RemoteExceptionRecord` with :func:`capture`: plain
strings (type name, message, repr, formatted traceback, worker) plus, when it survives a
pickle round trip, the pickled exception itself. The record is what travels; it pickles with
plain pickle and holds no reference to user objects. The caller turns the record back into an
exception with :func:`rebuild` and raises it. Neither function raises: every piece of user code
they run (``__str__``, ``__repr__``, ``__reduce__``, constructors, imports) is fenced, and a
failure only lowers the fidelity of the result. Whatever happens, the caller gets an exception
whose text holds the remote message, the worker and the remote traceback.

torch keeps the type of ``ValueError``, ``TypeError`` and ``RuntimeError`` only (it calls
``type(message)`` with a text that starts ``On WorkerInfo(...)``) and raises every other one as
a ``RuntimeError("KeyError: On WorkerInfo(id=1, name=worker1): ...")``. We keep every type the
caller can import, with its attributes, and put the message first so a regex written for the
original message still matches; the origin says ``On WorkerInfo(id=1, name=worker1)`` as torch's
text does. A type torch turns into a ``RuntimeError`` is raised as an instance of a class made
from it and ``RuntimeError`` (rule 5), so code written for torch's ``except RuntimeError`` keeps
catching it.

Rebuilding, in order (first match wins):

1. The record's type is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``,
   ``GeneratorExit``, ``asyncio.CancelledError``): :class:`RemoteError`. Raising those on the
   caller would stop or cancel the caller, which is not what the remote failure means.
2. ``pickled`` unpickles to an exception of exactly the recorded type: that object is the
   original (its ``args`` and ``__dict__`` travelled). Then it is *decorated*:

   a. *Message form*, when the type is message-shaped: ``args == (some_str,)``, the type's
      ``__str__`` is ``BaseException.__str__`` (so ``str(e) == args[0]``), and
      ``type(e)(longer_text)`` plus the original ``__dict__`` gives an exception whose every
      public non-callable attribute is unchanged (``StopIteration("v").value`` would change,
      so ``StopIteration`` fails this test). The exception is rebuilt with the message
      extended::

          Expected error

          On WorkerInfo(id=1, name=worker1), raised in rpc_sync(worker1, mod.fn):
          Traceback (most recent call last):
            ...
          ValueError: Expected error

      Nothing else is attached: a note or a cause would print the traceback twice.
   b. *Note form*, for every other type (``KeyError``, ``OSError``, several arguments, a
      custom ``__str__``, non-string arguments): ``args`` stay untouched; the same text goes
      into a PEP 678 note (``e.__notes__``, printed under the exception line) and
      ``e.__cause__`` is set to a :class:`RemoteTraceback` with that text, as
      ``concurrent.futures`` does. An uncaught exception therefore prints the remote traceback
      twice (once in the cause, once in the note); that is the price of each being complete on
      its own for code that reads only one of them.
   An exception whose constructor takes other arguments than its ``args`` (``MyError(code,
   detail)`` calling ``super().__init__(text)``) does not survive plain pickling, which calls
   ``MyError(text)`` on the caller; it travels as its type, ``args`` and ``__dict__``, and is
   rebuilt without its constructor (``_Bare``), attributes and all.
3. No usable pickle, but the type is importable on the caller and message-shaped (as in 2a,
   tested against ``type(message)``), and ``repr(type(message))`` equals the remote repr (so
   the one argument was that string): it is rebuilt in message form from the message alone.
   Attributes its constructor does not derive from the message are lost, and the text says so.
4. Otherwise: :class:`RemoteError` (a ``RuntimeError``, as torch's fallback), whose text holds
   the original qualified type name, the message, the reason, the worker, the call and the
   remote traceback::

       mod.fn.<locals>.LocalError: boom

       (The original type was not rebuilt here: fn.<locals>.LocalError is a local class and
       cannot be imported here.)

       On WorkerInfo(id=1, name=worker1), raised in rpc_sync(worker1, mod.fn):
       Traceback (most recent call last):
         ...

5. *Also a RuntimeError*: the exception rules 2 and 3 give, unless it is a ``RuntimeError``,
   ``ValueError`` or ``TypeError`` already, becomes an instance of ``class KeyError(KeyError,
   RuntimeError)``: one class per type, made here, with the type's name, qualified name and
   module (so it prints as ``KeyError: 'k'``), and the original's ``args``, ``__dict__``, the
   fields the constructor sets outside them (``OSError.filename``, ``StopIteration.value``),
   notes, cause and traceback. It pickles as the original type (a second hop rebuilds it the
   same way); :func:`plain_type` gives that type. Where the two cannot be combined (a class that
   refuses subclasses, ``Exception`` itself, state that does not carry over): rule 4's
   :class:`RemoteError`. A type that ``type(message)`` cannot make (its constructor takes other
   arguments), which torch raises as a ``RuntimeError`` saying "Original exception on remote
   side was ...", is made such a class too, even a ``ValueError``, and its ``str()`` ends with
   that sentence (kept out of its pickle).

Finding the type imports its module on the caller, as unpickling would; connections are
authenticated before anything is unpickled or imported.

If the rebuilt message differs from the one captured remotely (a constructor that rewrites its
argument), the remote message is quoted in the added text too.

Raise the result with a plain ``raise exc``: ``raise exc from something`` would replace the
:class:`RemoteTraceback` cause of the note form.

Texts are bounded: the message, the repr and the traceback are cut to
:data:`MAX_TEXT_CHARS` characters each with a marker, and a pickle larger than
:data:`MAX_PICKLED_BYTES` is not sent (the exception is then rebuilt by rule 3 or 4).

Capture what the user function raised, as the object. ``torch.futures.Future.then`` turns an
exception raised in its callback into a ``RuntimeError`` holding only the text, so the type is
gone before :func:`capture` sees it; ``set_exception(original)`` keeps the object.

Thread safety: every function here is pure apart from the user code it runs; safe from any
thread.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import logging
import pickle
import re
import threading
import traceback as _traceback
import types
from dataclasses import dataclass
from typing import Any, cast

from .._core.errors import copy_into, origin, same_public_state

__all__ = [
    "MAX_PICKLED_BYTES",
    "MAX_TEXT_CHARS",
    "RemoteError",
    "RemoteExceptionRecord",
    "RemoteTraceback",
    "capture",
    "describe_call",
    "plain_type",
    "rebuild",
    "runtime_twin",
]

logger = logging.getLogger(__name__)

MAX_TEXT_CHARS = 64 * 1024
"""Longest message, repr or traceback a record carries; longer ones are cut in the middle."""

MAX_PICKLED_BYTES = 4 * 1024 * 1024
"""Largest pickled exception a record carries; a larger one is dropped (the text still goes)."""

_MAX_CALL_CHARS = 200
_PICKLE_PROTOCOL = 5


@dataclass(frozen=True)
class RemoteExceptionRecord:
    """An exception raised by a remote function, as it crosses the wire.

    Only ``str``, ``bytes`` and ``None`` fields, so it pickles with plain pickle and holds no
    reference to user objects.

    Attributes:
        type_module: ``type(exc).__module__`` on the remote side.
        type_qualname: ``type(exc).__qualname__`` on the remote side.
        message: ``str(exc)``, cut to :data:`MAX_TEXT_CHARS`.
        exc_repr: ``repr(exc)``, cut to :data:`MAX_TEXT_CHARS`.
        traceback: The formatted remote traceback, chained causes and contexts included.
        worker: The worker that raised it, e.g. ``"worker1 (id 1)"``.
        pickled: ``pickle.dumps(exc)`` if that round-trips to the same type, else ``None``.
    """

    type_module: str
    type_qualname: str
    message: str
    exc_repr: str
    traceback: str
    worker: str
    pickled: bytes | None

    @property
    def type_name(self) -> str:
        """The qualified type name, ``builtins`` left out (``KeyError``, ``mod.MyError``)."""
        return _qualified(self.type_module, self.type_qualname)


class RemoteError(RuntimeError):
    """A remote exception whose type cannot be rebuilt on the caller.

    A ``RuntimeError``, like torch's fallback, so ``except RuntimeError`` keeps working. It
    stands for the user's exception, not for a tdist failure, hence not a ``DistError``.

    Attributes:
        message: The remote ``str(exc)``.
        remote_type: The remote exception's qualified type name.
        remote_traceback: The formatted remote traceback.
        worker: The worker that raised it.
        call: The call that failed, or ``None``.
        reason: Why the original type was not rebuilt.
    """

    def __init__(
        self,
        message: str,
        remote_type: str = "",
        remote_traceback: str = "",
        worker: str = "",
        call: str | None = None,
        reason: str = "",
    ) -> None:
        self.message = message
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.worker = worker
        self.call = call
        self.reason = reason
        head = f"{remote_type}: {message}" if remote_type else message
        if reason:
            head = f"{head}\n\n(The original type was not rebuilt here: {reason}.)"
        if worker or call or remote_traceback:
            head += _origin_text(worker, call, remote_traceback)
        super().__init__(head)

    def __reduce__(self) -> tuple[Any, ...]:
        # The constructor arguments are not self.args, so say how to call it again: a
        # RemoteError must cross a second RPC (A calls B calls C) with its fields.
        return (
            type(self),
            (
                self.message,
                self.remote_type,
                self.remote_traceback,
                self.worker,
                self.call,
                self.reason,
            ),
            self.__dict__,  # notes and any attribute set after construction
        )


class RemoteTraceback(Exception):
    """The remote side of a rebuilt exception, set as its ``__cause__`` in the note form.

    ``str()`` is the worker, the call and the remote traceback, so printing the chain shows
    where the exception came from (like ``concurrent.futures.process._RemoteTraceback``).

    Attributes:
        worker: The worker that raised the exception.
        call: The call that failed, or ``None``.
        remote_traceback: The formatted remote traceback.
    """

    def __init__(
        self, worker: str = "", call: str | None = None, remote_traceback: str = ""
    ) -> None:
        self.worker = worker
        self.call = call
        self.remote_traceback = remote_traceback
        super().__init__(_origin_text(worker, call, remote_traceback).lstrip("\n"))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.worker, self.call, self.remote_traceback), self.__dict__)


# --- capture (callee side) ------------------------------------------------------------------


def capture(exc: BaseException, worker: str) -> RemoteExceptionRecord:
    """Turn an exception raised by a remote function into a record for the wire.

    Call it inside the ``except`` block, or with an exception whose ``__traceback__`` is set,
    so the traceback is the one of the raise.

    Args:
        exc: The exception the function raised (any ``BaseException``).
        worker: The worker that ran the function, as it should read in messages.

    Returns:
        The record. Never raises: a broken ``__str__``, ``__repr__`` or ``__reduce__`` only
        costs the part of the record it spoils.
    """
    # (a ``then`` callback's error, a RuntimeError too for the callers of torch's futures: the
    # caller gets what the callback raised, ``rpc._future``)
    original = getattr(exc, "_tdist_original", None)
    if isinstance(original, BaseException):
        exc = original
    try:
        return _capture(exc, worker)
    except BaseException as err:  # a last fence: the caller must hear about the failure
        return RemoteExceptionRecord(
            type_module="builtins",
            type_qualname="Exception",
            message=f"<the remote exception could not be captured: {_describe_failure(err)}>",
            exc_repr="<unavailable>",
            traceback="",
            worker=_safe_str(worker),
            pickled=None,
        )


def _capture(exc: BaseException, worker: str) -> RemoteExceptionRecord:
    cls = plain_type(type(exc))
    module = _safe_attr_str(cls, "__module__", "builtins")
    qualname = _safe_attr_str(cls, "__qualname__", "") or _safe_attr_str(cls, "__name__", "?")
    message = _truncate(_safe_str(exc), keep_head=True)
    return RemoteExceptionRecord(
        type_module=module,
        type_qualname=qualname,
        message=message,
        exc_repr=_truncate(_safe_repr(exc), keep_head=True),
        traceback=_truncate(_format_traceback(exc), keep_head=False),
        worker=worker if isinstance(worker, str) else _safe_str(worker),
        pickled=_pickle_round_trip(exc),
    )


def _pickle_round_trip(exc: BaseException) -> bytes | None:
    """``pickle.dumps(exc)`` if it loads back to the same type, else the exception without its
    constructor (``_Bare``) if that does, else ``None``."""
    # dumps succeeding proves little: an exception whose constructor needs arguments that are
    # not in self.args pickles fine and fails in loads, on the caller, too late to fall back.
    data = _round_trip(exc, exc)
    if data is None and _plain_reduce(exc):
        data = _round_trip(_Bare(exc), exc)
    return data


def _round_trip(obj: object, exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)
        if len(data) > MAX_PICKLED_BYTES:
            logger.debug("%s pickles to %d bytes; sending its text only", type(exc), len(data))
            return None
        back = pickle.loads(data)
    except BaseException as err:  # user __reduce__/__init__ may raise anything
        logger.debug("%s does not pickle round-trip: %s", type(exc), _describe_failure(err))
        return None
    if type(back) is not plain_type(type(exc)):
        return None
    return data


def _plain_reduce(exc: BaseException) -> bool:
    """Whether ``exc`` pickles through ``BaseException``'s own reduction (its class does not
    say how to pickle it; one that does is not second-guessed)."""
    cls = plain_type(type(exc))
    return all(getattr(cls, name) is getattr(BaseException, name) for name in ("__reduce__", "__reduce_ex__", "__getstate__"))


class _Bare:
    """An exception as its type, ``args`` and ``__dict__``, rebuilt without calling its
    constructor (``_rebuild_bare``): for the classes whose constructor takes other arguments
    than ``self.args`` (``MyError(code, detail)`` calling ``super().__init__(text)``), which
    plain pickling calls with the wrong ones on the caller."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        exc = self.exc
        state = {k: v for k, v in getattr(exc, "__dict__", {}).items() if k != _ORIGINAL}  # (ours only)
        return (_rebuild_bare, (plain_type(type(exc)), exc.args, state))


def _rebuild_bare(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _format_traceback(exc: BaseException) -> str:
    try:
        report = _traceback.TracebackException.from_exception(exc)
        _raised_where(report, exc, set())
        return "".join(report.format()).rstrip("\n")
    except BaseException:
        pass
    # A chain the formatter chokes on: the frames of the exception itself still tell a lot.
    try:
        frames = "".join(_traceback.format_tb(exc.__traceback__))
    except BaseException:
        frames = ""
    head = "Traceback (most recent call last):\n" if frames else ""
    return f"{head}{frames}{type(exc).__name__}: {_safe_str(exc)}"


def _raised_where(report: _traceback.TracebackException, exc: BaseException, seen: set[int]) -> None:
    """Where an exception of the chain is a kept copy (``errors.fresh``: a failed future's),
    the frames where the exception it copies was raised, not where the copy was."""
    if id(exc) in seen:
        return
    seen.add(id(exc))
    where = origin(exc)
    if where is not None:
        report.stack = where
    if report.__cause__ is not None and exc.__cause__ is not None:
        _raised_where(report.__cause__, exc.__cause__, seen)
    if report.__context__ is not None and exc.__context__ is not None:
        _raised_where(report.__context__, exc.__context__, seen)


# --- rebuild (caller side) ------------------------------------------------------------------


def rebuild(record: RemoteExceptionRecord, *, call: str | None = None) -> BaseException:
    """Turn a record back into the exception to raise on the caller.

    See the module docstring for the rules. Raise the result with a plain ``raise exc``.

    Args:
        record: What :func:`capture` produced on the remote side.
        call: The call that failed, e.g. ``"rpc_sync(worker1, mod.fn)"``; it goes into the
            text.

    Returns:
        The original type with its attributes where it can be rebuilt, else a
        :class:`RemoteError`. Always an ``Exception``; never raises.
    """
    try:
        return _rebuild(record, call)
    except BaseException as err:  # a last fence, e.g. a record with fields of the wrong type
        reason = f"rebuilding it failed: {_describe_failure(err)}"
    try:
        return RemoteError(
            _safe_str(record.message),
            remote_type=_safe_str(record.type_module) + "." + _safe_str(record.type_qualname),
            remote_traceback=_safe_str(record.traceback),
            worker=_safe_str(record.worker),
            call=call if isinstance(call, str) else None,
            reason=reason,
        )
    except BaseException:
        return RemoteError(_safe_str(record), reason=reason)


def _rebuild(record: RemoteExceptionRecord, call: str | None) -> BaseException:
    cls, why_not = _find_type(record)
    if cls is not None and not issubclass(cls, Exception):
        return _fallback(
            record,
            call,
            f"{cls.__name__} is not an Exception; raising it here would stop the caller",
        )
    if record.pickled is not None:
        exc, why_not_pickle = _unpickle(record)
        if exc is not None:
            if not isinstance(exc, Exception):
                return _fallback(record, call, f"{type(exc).__name__} is not an Exception")
            return _also_runtime_error(_decorate(exc, record, call), record, call)
        why_not = why_not or why_not_pickle
    else:
        why_not = why_not or "it did not pickle on the remote side"
    if cls is not None:
        plain = _from_message(cls, record)
        if plain is not None:
            lost = "rebuilt from its message; attributes not derived from it were not kept"
            rebuilt = _with_message(plain, record, call, remark=f"{why_not}, so it was {lost}")
            if rebuilt is not None:
                return _also_runtime_error(rebuilt, record, call)
        why_not += ", and it cannot be rebuilt from its message alone"
    return _fallback(record, call, why_not)


def _unpickle(record: RemoteExceptionRecord) -> tuple[BaseException | None, str]:
    assert record.pickled is not None
    try:
        exc = pickle.loads(record.pickled)
    except BaseException as err:  # a missing module, a constructor that raises here...
        return None, f"unpickling it failed: {_describe_failure(err)}"
    if not isinstance(exc, BaseException):
        return None, f"it unpickled to a {type(exc).__name__}"
    if _qualified(type(exc).__module__, type(exc).__qualname__) != record.type_name:
        return None, f"it unpickled to a {type(exc).__qualname__}"
    return exc, ""


def _find_type(record: RemoteExceptionRecord) -> tuple[type[BaseException] | None, str]:
    """The recorded type as the caller knows it, else ``None`` and why not."""
    module, qualname = record.type_module, record.type_qualname
    if "<locals>" in qualname.split("."):
        return None, f"{qualname} is a local class and cannot be imported here"
    try:
        obj: Any = builtins if module == "builtins" else importlib.import_module(module)
    except BaseException as err:
        return None, f"module {module!r} cannot be imported here ({_describe_failure(err)})"
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except BaseException:
        return None, f"{qualname} is not defined in module {module!r} here"
    if not isinstance(obj, type) or not issubclass(obj, BaseException):
        return None, f"{record.type_name} is not an exception type here"
    if _qualified(obj.__module__, obj.__qualname__) != record.type_name:
        return None, f"{record.type_name} is an alias of {obj.__qualname__} here"
    return obj, ""


def _from_message(cls: type[BaseException], record: RemoteExceptionRecord) -> BaseException | None:
    """``cls(record.message)`` if that is what the remote exception was, else ``None``."""
    if not issubclass(cls, Exception) or not _message_shaped_type(cls):
        return None
    try:
        exc = cls(record.message)
        same = type(exc) is cls and exc.args == (record.message,)
        # The repr tells whether the one remote argument was this string (KeyError('k') vs a
        # ValueError of a non-string object whose str is the message).
        here = repr(exc)
        if _was_truncated(record.message):
            # Both texts were cut remotely at different points; their starts still compare.
            same = same and here[:1024] == record.exc_repr[:1024]
        else:
            same = same and here == record.exc_repr
    except BaseException:
        return None
    return exc if same else None


def _decorate(exc: Exception, record: RemoteExceptionRecord, call: str | None) -> Exception:
    if _message_shaped_type(type(exc)):
        try:
            args = exc.args
        except BaseException:
            args = ()
        if len(args) == 1 and type(args[0]) is str:
            extended = _with_message(exc, record, call)
            if extended is not None:
                return extended
    return _with_note(exc, record, call)


def _with_message(
    exc: BaseException, record: RemoteExceptionRecord, call: str | None, remark: str = ""
) -> Exception | None:
    """``type(exc)(message + origin)`` with ``exc``'s state, if nothing else changes."""
    message: str = exc.args[0]
    extra = _remark_lines(exc, record, remark)
    text = message + extra + _origin_text(record.worker, call, record.traceback)
    try:
        new = type(exc)(text)
        new.__dict__.update(exc.__dict__)
        if type(new) is not type(exc) or new.args != (text,) or str(new) != text:
            return None
        if not same_public_state(exc, new):
            return None
    except BaseException:
        return None
    assert isinstance(new, Exception)
    return new


def _with_note(exc: Exception, record: RemoteExceptionRecord, call: str | None) -> Exception:
    text = (
        _remark_lines(exc, record) + _origin_text(record.worker, call, record.traceback)
    ).lstrip("\n")
    try:
        exc.add_note(text)
    except BaseException:
        logger.debug("could not add a note to %s", type(exc))
    try:
        exc.__cause__ = RemoteTraceback(record.worker, call, record.traceback)
    except BaseException:
        logger.debug("could not set the cause of %s", type(exc))
    return exc


# --- also a RuntimeError ---------------------------------------------------------------------

_TORCH_KEEPS = (RuntimeError, ValueError, TypeError)
"""The types torch's ``rpc_sync``/``rpc_async`` re-raise as such; it turns every other one into
a ``RuntimeError``, which is what code written for torch catches."""

_ALSO_RUNTIME: dict[type[BaseException], type[BaseException] | None] = {}
_also_lock = threading.Lock()


def plain_type(cls: type[BaseException]) -> type[BaseException]:
    """The user's exception type behind ``cls``: ``KeyError`` for the ``KeyError`` that is also a
    ``RuntimeError`` (:func:`rebuild`, or a ``then`` callback's error, ``rpc._future``), ``cls``
    itself otherwise."""
    base = cls.__dict__.get("_tdist_base")
    return base if isinstance(base, type) else cls


_ALSO_RUNTIME_UNMADE: dict[type[BaseException], type[BaseException] | None] = {}

_ORIGINAL = "_tdist_original"
"""The attribute (in ``__dict__``) of a rebuilt exception whose type cannot be made from its
message alone: ``str()`` adds it (``_str_and_original``). torch's RPC raises a ``RuntimeError``
for such a type whose text says "Original exception on remote side was ..."; code written for
it looks for that phrase, and ours keeps the type besides."""


def _str_and_original(self: BaseException) -> str:
    text = cast(Any, type(self))._tdist_base.__str__(self)
    original = self.__dict__.get(_ORIGINAL)
    return text if not original else f"{text}\n\n{original}"


def _made_from_message(kind: type[BaseException], message: str) -> bool:
    """Whether ``kind(message)`` works (torch's RPC rebuilds a remote exception so). It runs
    the type's constructor, fenced, as rebuilding from the message does."""
    try:
        kind(message)
    except BaseException:
        return False
    return True


def _also_reduce(self: BaseException) -> Any:
    # pickled as the user's type, which the other side imports (this class is made here and
    # shares its name: pickling it by reference would find the user's class and refuse)
    cls = type(self)
    rv = super(cls, self).__reduce__()
    return _as_plain(rv, cls)


def _also_reduce_ex(self: BaseException, protocol: Any) -> Any:
    cls = type(self)
    rv = super(cls, self).__reduce_ex__(protocol)
    return _as_plain(rv, cls)


def _as_plain(rv: Any, cls: type[BaseException]) -> Any:
    if not isinstance(rv, tuple) or not rv:
        return rv
    base = plain_type(cls)
    head: Any = base if rv[0] is cls else rv[0]
    rest = list(rv[1:])
    if rest and isinstance(rest[0], tuple) and rest[0] and rest[0][0] is cls:  # copyreg.__newobj__
        rest[0] = (base, *rest[0][1:])
    if len(rest) > 1 and isinstance(rest[1], dict) and _ORIGINAL in rest[1]:  # (this side's only)
        rest[1] = {k: v for k, v in rest[1].items() if k != _ORIGINAL}
    return (head, *rest)


def runtime_twin(
    kind: type[BaseException],
    namespace: dict[str, Any],
    cache: dict[type[BaseException], type[BaseException] | None],
) -> type[BaseException] | None:
    """A class derived from ``kind`` and ``RuntimeError``, under ``kind``'s name, qualified
    name and module, with ``namespace`` in its body (and ``_tdist_base``, :func:`plain_type`'s);
    one per ``kind`` in ``cache``. ``None`` where the two cannot be combined (a final class, a
    layout or MRO conflict, an ``__init_subclass__`` that refuses)."""
    with _also_lock:
        if kind in cache:
            return cache[kind]

        def body(ns: dict[str, Any]) -> None:
            ns.update({
                "__module__": kind.__module__,
                "__qualname__": kind.__qualname__,
                "__doc__": kind.__doc__,
                "_tdist_base": kind,
                **namespace,
            })

        made: type[BaseException] | None
        try:
            made = types.new_class(kind.__name__, (kind, RuntimeError), exec_body=body)
        except BaseException as err:
            logger.debug("%s cannot be combined with RuntimeError: %s", kind, _describe_failure(err))
            made = None
        cache[kind] = made
        return made


def _also_runtime_type(kind: type[BaseException], unmade: bool = False) -> tuple[type[BaseException] | None, str]:
    """The class derived from ``kind`` and ``RuntimeError`` for a remote error (one per
    ``kind``: :func:`runtime_twin`), pickled as ``kind``; else ``None`` and why not. With
    ``unmade`` (``kind(message)`` fails), its ``str()`` also says what the remote exception was."""
    namespace: dict[str, Any] = {"__reduce__": _also_reduce, "__reduce_ex__": _also_reduce_ex}
    if unmade:
        namespace["__str__"] = _str_and_original
    made = runtime_twin(kind, namespace, _ALSO_RUNTIME_UNMADE if unmade else _ALSO_RUNTIME)
    if made is None:
        return None, f"{kind.__qualname__} cannot be combined with RuntimeError"
    return made, ""


def _also_runtime_error(exc: Exception, record: RemoteExceptionRecord, call: str | None) -> Exception:
    """``exc`` as an instance of its type and ``RuntimeError`` too (torch raises a
    ``RuntimeError`` for it), with its ``args``, attributes, notes, cause and context; ``exc``
    itself where torch keeps the type; a :class:`RemoteError` where they cannot be combined."""
    kind = type(exc)
    unmade = not _made_from_message(kind, record.message)
    if issubclass(kind, _TORCH_KEEPS) and not unmade:
        return exc
    made, why_not = _also_runtime_type(kind, unmade)
    if made is not None:
        try:
            both = _copy_into(exc, made)
            if both is not None:
                if unmade:  # (what torch's text says when it cannot make the type: see _ORIGINAL)
                    both.__dict__[_ORIGINAL] = f"Original exception on remote side was {record.exc_repr}"
                return both
            why_not = f"{kind.__qualname__}'s state does not carry over to a RuntimeError subclass"
        except BaseException as err:  # a __new__ of its own, a broken attribute...
            why_not = f"{kind.__qualname__} cannot be made a RuntimeError too ({_describe_failure(err)})"
    return _fallback(record, call, why_not)


def _copy_into(exc: Exception, made: type[BaseException]) -> Exception | None:
    new = copy_into(exc, made)
    if new is None:
        return None
    assert isinstance(new, Exception)
    return new.with_traceback(exc.__traceback__)


def _fallback(record: RemoteExceptionRecord, call: str | None, reason: str) -> RemoteError:
    return RemoteError(
        record.message,
        remote_type=record.type_name,
        remote_traceback=record.traceback,
        worker=record.worker,
        call=call,
        reason=reason,
    )


def _remark_lines(exc: BaseException, record: RemoteExceptionRecord, remark: str = "") -> str:
    lines = []
    here = _truncate(_safe_str(exc), keep_head=True)
    if here != record.message:
        lines.append(f"The message on the remote side was: {record.message}")
    if remark:
        lines.append(f"Note: {remark}.")
    return "".join(f"\n\n{line}" for line in lines)


_LABEL = re.compile(r"(?P<name>.*) \(id (?P<id>-?\d+)\)", re.DOTALL)


def _origin_text(worker: str, call: str | None, remote_traceback: str) -> str:
    where = f"On {_worker_phrase(worker)}"
    if call:
        where += f", raised in {call}"
    if remote_traceback:
        return f"\n\n{where}:\n{remote_traceback}"
    return f"\n\n{where} (no remote traceback)."


def _worker_phrase(worker: str) -> str:
    """torch's ``WorkerInfo(id=1, name=worker1)`` for an agent's label ``worker1 (id 1)`` (its
    form, ``RpcAgent.label``), so that a text matched against torch's keeps matching."""
    match = _LABEL.fullmatch(worker)
    if match is None:
        return worker or "a remote worker"
    return f"WorkerInfo(id={match['id']}, name={match['name']})"


def _message_shaped_type(cls: type[BaseException]) -> bool:
    # The default __str__ returns args[0] for one argument: the text we extend is what str()
    # shows. A custom __str__ (KeyError, OSError, user classes) would hide or mangle it.
    return getattr(cls, "__str__", None) is BaseException.__str__


# --- describe_call --------------------------------------------------------------------------


def describe_call(fn: object) -> str:
    """A readable qualified name for a callable, for messages.

    Args:
        fn: A function, builtin, method, class, ``functools.partial`` or any object.

    Returns:
        ``module.qualname`` where the callable has them (``builtins`` left out), else a short
        ``repr``. Never raises.
    """
    try:
        if isinstance(fn, functools.partial):
            return f"partial({describe_call(fn.func)})"
        qualname = getattr(fn, "__qualname__", None)
        if isinstance(qualname, str) and qualname:
            module = getattr(fn, "__module__", None)
            if not isinstance(module, str):
                module = ""
            name = getattr(fn, "__name__", None)
            if module and isinstance(fn, types.BuiltinFunctionType) and isinstance(name, str):
                # A C function exported by a module: torch.add, not its implementation
                # class's torch._VariableFunctionsClass.add.
                return _qualified(module, name)
            return _qualified(module, qualname)
    except BaseException:
        pass
    text = _safe_repr(fn)
    if len(text) > _MAX_CALL_CHARS:
        text = text[: _MAX_CALL_CHARS - 3] + "..."
    return text


# --- small fenced helpers -------------------------------------------------------------------


def _qualified(module: str | None, qualname: str) -> str:
    if not module or module == "builtins":
        return qualname
    return f"{module}.{qualname}"


def _truncate(text: str, *, keep_head: bool) -> str:
    """Cut ``text`` to :data:`MAX_TEXT_CHARS` with a marker.

    ``keep_head`` keeps mostly the start (a message: regexes anchor there); otherwise mostly
    the end (a traceback: the innermost frames and the exception line are at the end).
    """
    if len(text) <= MAX_TEXT_CHARS:
        return text
    budget = MAX_TEXT_CHARS - 100  # room for the marker
    head = budget * 3 // 4 if keep_head else budget // 4
    tail = budget - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"


def _was_truncated(text: str) -> bool:
    return len(text) > MAX_TEXT_CHARS - 200 and "characters cut ...]" in text


def _safe_str(obj: object) -> str:
    try:
        text = str(obj)
        if isinstance(text, str):
            return text
    except BaseException as err:
        return f"<str() failed: {_describe_failure(err)}; repr: {_safe_repr(obj)}>"
    return f"<str() returned a {type(text).__name__}>"


def _safe_repr(obj: object) -> str:
    try:
        text = repr(obj)
        if isinstance(text, str):
            return text
    except BaseException:
        pass
    try:
        args = obj.args if isinstance(obj, BaseException) else ()
        inner = ", ".join(_plain_repr(a) for a in args)
    except BaseException:
        inner = "..."
    return f"<{type(obj).__qualname__}({inner}); repr() failed>"


def _plain_repr(obj: object) -> str:
    try:
        text = repr(obj)
        return text if isinstance(text, str) else "?"
    except BaseException:
        return f"<{type(obj).__qualname__}>"


def _safe_attr_str(obj: object, name: str, default: str) -> str:
    try:
        value = getattr(obj, name, default)
    except BaseException:
        return default
    return value if isinstance(value, str) else default


def _describe_failure(err: BaseException) -> str:
    try:
        return f"{type(err).__name__}: {err}"
    except BaseException:
        return type(err).__name__
