"""The tdist exception tree.

One root, shallow, with torch-compatible bases where torch users catch them. A second base is
in parentheses. A class defined in another module names it in brackets (relative to ``tdist``):
it is that subsystem's own, raised there alone, and stays next to the code that raises it;
the others are defined here. One class per name: a module that raises a
class of another imports it (``c10d._debug`` and ``c10d._shm`` both raise and re-export this
module's ``CollectiveMismatchError``)::

    DistError (RuntimeError)                    torch.distributed.DistError
    ├── DistBackendError                        a collective or backend failed
    │   ├── PeerError                           a named peer died, stalled or broke the protocol
    │   ├── CollectiveMismatchError (ValueError)  ranks called different collectives, or one
    │   │                                       with arguments that do not fit
    │   ├── CollectiveTimeoutError (DistTimeoutError)  a collective or point-to-point operation
    │   │                                       did not finish within its timeout
    │   ├── CollectiveArgumentError (ValueError)  [c10d._checks] an argument a collective cannot
    │   │                                       work with (where torch's gloo raises RuntimeError)
    │   └── OnMeta                              [c10d._checks] a tensor on the meta device reached
    │                                           a collective: caught there, which does nothing
    ├── DistNetworkError                        a connection could not be made or was lost
    │   ├── AuthenticationError                 the peer did not prove the shared secret
    │   └── TorchServerError                    [store._tcp] tdist's store client reached torch's
    │                                           own TCPStore server
    ├── DistStoreError                          a store operation failed
    │   ├── StoreTimeoutError (DistTimeoutError)  keys did not appear in time (ranks that
    │   │                                       never joined a rendezvous among them)
    │   │   └── EtcdStoreTimeoutError (LookupError)  [store._etcd] an EtcdStore's get/wait
    │   │                                       (torch documents LookupError there)
    │   ├── StoreValueError (ValueError)        a value was not what the command needs
    │   └── QueueEmptyError                     queue_pop(block=False) on an empty queue
    ├── ProtocolError                           bytes that break a wire protocol
    │   ├── LocalProtocolError                  we were asked to send something invalid
    │   └── RemoteProtocolError                 the peer sent something invalid
    │       └── Refused                         [transport._handshake] the peer proved the secret
    │                                           but may not join (another group, an unknown id)
    ├── ScheduleError (ValueError)              [c10d._schedules] bad arguments to a schedule
    │                                           builder, or schedules that do not fit together
    ├── LaunchError                             [elastic._agent] the launcher could not set the
    │                                           job up (bad options, no store, nodes missing)
    ├── RankFailedError                         [testing] a rank ended without a result
    ├── QuorumError                             [elastic._ft] no quorum of a fault-tolerant job
    │                                           can take this node: the job is over, or every
    │                                           member is gone with its state
    └── DistTimeoutError (TimeoutError)         any other deadline that expired
        ├── RpcTimeoutError                     [rpc._calls] an RPC or a to_here() did not finish
        │                                       within its timeout
        └── RankTimeoutError                    [testing] ranks still ran at the hard timeout

Each class that names a torch class on the right also derives from it, so code that catches
torch's (``except torch.distributed.DistStoreError``) catches ours too (except in the ``tdist``
command's own process, which runs no user code and does not import torch: ``_process``).
``TimeoutError`` here is the builtin (an ``OSError``): ``except TimeoutError`` catches every
tdist timeout. OS errors are translated into this tree once, at the I/O boundary, and chained
with ``from``.

Outside the tree, on purpose (``tests/unit/test_error_tree.py`` holds the same list)::

    RemoteError (RuntimeError)                  [rpc._errors] a remote function's exception
                                                whose type cannot be rebuilt on the caller
    RemoteTraceback (Exception)                 [rpc._errors] the remote traceback, set as the
                                                __cause__ of a rebuilt exception; never raised
    RendezvousError (Exception)                 [elastic.rendezvous] torchelastic's tree, with
    ├── RendezvousClosedError                   torch's bases
    ├── RendezvousTimeoutError
    ├── RendezvousConnectionError
    ├── RendezvousStateError
    └── RendezvousGracefulExitError

``RemoteError`` and ``RemoteTraceback`` stand for the user's exception, not for a failure of
tdist: an ``except DistError`` written for a lost peer or a broken connection must not catch a
bug in the remote function. ``RemoteError`` is a ``RuntimeError`` as torch's fallback is;
``RemoteTraceback`` an ``Exception`` as ``concurrent.futures``' own. torch's rendezvous errors
(``torch.distributed.elastic.rendezvous.api``) derive from ``Exception``, not ``RuntimeError``;
ours have the same bases, so an ``except`` clause treats them as it treats torch's.

Kept errors. An error that outlives its raise (a work's, a peer's, a future's, a broken group's
or store client's, one in a local past its ``except``) is never the one raised: it is kept as
``fresh(exc)`` and raised as ``fresh(kept)``; a torch future fails with ``fail_future``. An
exception raised holds every frame it passes, and a frame its caller's: kept where one of
those frames reaches it, it makes a cycle that holds them all until a collection
(``tests/integration/test_error_cycles.py``).
"""

from __future__ import annotations

import sys
from types import BuiltinFunctionType

from . import _process

TYPE_CHECKING = False  # (typing is not imported at run time: see tdist/__init__)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _E = TypeVar("_E", bound=BaseException)

if TYPE_CHECKING or not _process.TORCHLESS or "torch" in sys.modules:
    from torch.distributed import DistBackendError as _TorchBackendError
    from torch.distributed import DistError as _TorchDistError
    from torch.distributed import DistNetworkError as _TorchNetworkError
    from torch.distributed import DistStoreError as _TorchStoreError
    from torch.distributed import QueueEmptyError as _TorchQueueEmptyError
else:  # the `tdist` command's own process: torch's tree, without importing torch (see _process)

    class _TorchDistError(RuntimeError):
        """Stands in for ``torch.distributed.DistError``."""

    class _TorchBackendError(_TorchDistError):
        """Stands in for ``torch.distributed.DistBackendError``."""

    class _TorchNetworkError(_TorchDistError):
        """Stands in for ``torch.distributed.DistNetworkError``."""

    class _TorchStoreError(_TorchDistError):
        """Stands in for ``torch.distributed.DistStoreError``."""

    class _TorchQueueEmptyError(_TorchStoreError):
        """Stands in for ``torch.distributed.QueueEmptyError``."""

__all__ = [
    "AuthenticationError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "LocalProtocolError",
    "PeerError",
    "ProtocolError",
    "QueueEmptyError",
    "RemoteProtocolError",
    "StoreTimeoutError",
    "StoreValueError",
]


class DistError(_TorchDistError):
    """Root of every error raised by tdist (``torch.distributed.DistError``)."""


class DistBackendError(DistError, _TorchBackendError):
    """A process-group backend or collective failed (``torch.distributed.DistBackendError``)."""


class PeerError(DistBackendError):
    """A peer died, stalled, or broke the protocol. ``peer`` names it."""

    def __init__(self, message: str, peer: object = None) -> None:
        super().__init__(message)
        self.peer = peer


class CollectiveMismatchError(DistBackendError, ValueError):
    """Ranks called different collectives, or the same one with arguments that do not fit.

    Raised by the ``TDIST_DEBUG=DETAIL`` check before a collective (``c10d._debug``) and by the
    shared-memory arena, which compares every rank's description of each operation
    (``c10d._shm``); both modules re-export it.
    """


class DistNetworkError(DistError, _TorchNetworkError):
    """A connection could not be made or was lost (``torch.distributed.DistNetworkError``)."""


class AuthenticationError(DistNetworkError):
    """The other side did not prove knowledge of the job's shared secret."""


class DistStoreError(DistError, _TorchStoreError):
    """A store operation failed (``torch.distributed.DistStoreError``)."""


class StoreValueError(DistStoreError, ValueError):
    """A stored value cannot be used as the command needs (``add`` on a non-number)."""


class QueueEmptyError(DistStoreError, _TorchQueueEmptyError):
    """``queue_pop(block=False)`` found the queue empty (``torch.distributed.QueueEmptyError``)."""


class ProtocolError(DistError):
    """Bytes that break a wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to produce something the protocol cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""


class DistTimeoutError(DistError, TimeoutError):
    """A deadline expired."""


class StoreTimeoutError(DistStoreError, DistTimeoutError):
    """Keys awaited in a store did not appear before the timeout (also the checked join's
    ranks that never came: torch raises a ``DistStoreError`` there)."""


class CollectiveTimeoutError(DistBackendError, DistTimeoutError):
    """A collective or point-to-point operation did not finish within its timeout.

    A ``DistBackendError``, as torch's NCCL raises for one: the rank whose operation timed out
    and the ranks its failure aborted (``PeerError``) fail with one family, so one ``except``
    catches the failure on every rank. A ``DistTimeoutError`` (and ``TimeoutError``) too.
    """


def fresh(exc: _E) -> _E:
    """A copy of ``exc`` without frames: what to raise where ``exc`` is kept (on a work, a peer,
    a future, a broken group), and what to keep of an exception that is raised.

    An exception raised carries every frame it passes through, each with its locals, and a
    frame its caller's. Kept by an object that one of those frames reaches (a work's ``wait``
    raising the work's error; a future failed by a function that holds it), it makes a cycle
    that only the garbage collector frees, or nothing (a torch future keeps its error in C++):
    every caller's frame up to the catch lives on with what it holds (tensors; a torch store
    with its threads, which a forked child that collected it destroyed, and aborted). Raised
    again, it grows its traceback by the new frames each time.

    The copy (``copy_into``) has the same type, text, attributes and notes; its cause and
    context are copies too, made alike; where the exception was raised (its traceback, as
    ``traceback.extract_tb`` gives it, without the frames) stays with each (``origin``), for
    what reports it later (an RPC's remote traceback). Keep one, raise another, and no kept
    object refers to a frame. Where no copy is the same (a user's exception whose state cannot
    be set from outside), this gives ``exc`` itself, and its causes as they are.
    """
    return _fresh(exc, {})  # type: ignore[return-value]  # (of exc's own type)


def _fresh(exc: BaseException, made: dict[int, BaseException]) -> BaseException:
    done = made.get(id(exc))
    if done is not None:  # (a chain that loops: ``raise a.__cause__ from a``)
        return done
    try:
        new = copy_into(exc, type(exc))
    except Exception:  # (a ``__new__`` of a user's type that wants other arguments...)
        new = None
    if new is None:
        return exc
    made[id(exc)] = new
    if origin(exc) is None and exc.__traceback__ is not None:  # (a copy keeps its origin: copied)
        import traceback  # (on a failure only: 3 ms to import)

        new.__dict__[_ORIGIN] = traceback.extract_tb(exc.__traceback__)
    if exc.__cause__ is not None:
        new.__cause__ = _fresh(exc.__cause__, made)
    if exc.__context__ is not None:
        new.__context__ = _fresh(exc.__context__, made)
    return new


# the attribute of a copy ``fresh`` made that says where the exception it copies was raised:
# that traceback's summary (``traceback.StackSummary``: no frames). In ``__dict__``, as an
# attribute ``copy_into`` copies and pickling carries: no table can hold a built-in exception
# by a weak reference
_ORIGIN = "_tdist_origin"


def origin(exc: BaseException) -> Any:
    """Where the exception that ``exc``, a copy ``fresh`` made, was made from was raised: a
    ``traceback.StackSummary``; ``None`` if it was not raised, or ``exc`` is no such copy."""
    return getattr(exc, "__dict__", {}).get(_ORIGIN)


def fail_future(fut: Any, exc: BaseException) -> None:
    """``fut.set_exception(exc)`` for a ``torch.futures.Future``, except that it keeps a copy of
    ``exc`` (``fresh``) and its ``wait()`` and ``value()`` raise a copy of that each time.
    torch's keeps ``exc`` and raises it, whose traceback has (and gains) frames that may hold
    the future, which keeps it in C++, where the garbage collector cannot see: those frames,
    and what they held, were never freed."""
    if not isinstance(exc, Exception):  # (torch's own check and words)
        raise AssertionError(f"{exc} is of type {type(exc)}, not an Exception.")
    fut._set_unwrap_func(_raise_fresh)
    fut.set_result(fresh(exc))  # (the function that fails it may hold it: see ``fresh``)


def _raise_fresh(exc: BaseException) -> None:
    raise fresh(exc)


def copy_into(exc: BaseException, cls: type[BaseException]) -> BaseException | None:
    """``exc``'s state in a new instance of ``cls`` (``exc``'s type or one derived from it),
    made without calling a constructor (one may take other arguments than ``args``): its
    ``args``, ``__dict__`` (notes among it), the public fields kept outside them
    (``OSError.filename``, ``StopIteration.value``), cause and context; no traceback.

    Returns:
        The copy, or ``None`` where it would differ from ``exc`` in a public attribute or its
        text.

    Raises:
        what ``cls.__new__`` or the user's attributes raise (the caller fences it).
    """
    args = exc.args
    new = _blank(cls, args)
    new.args = args
    new.__dict__.update(getattr(exc, "__dict__", {}))
    notes = new.__dict__.get("__notes__")
    if type(notes) is list:  # (a caller's ``add_note`` on the copy stays off the original)
        new.__notes__ = list(notes)
    for name in dir(exc):
        if name.startswith("_") or name == "args":
            continue
        try:
            value = getattr(exc, name)
            if callable(value) or _same_value(getattr(new, name, None), value):
                continue
            setattr(new, name, value)
        except Exception:  # (read-only or derived: the comparison below decides)
            continue
    new.__cause__ = exc.__cause__
    new.__context__ = exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    if not same_public_state(exc, new) or _text(new) != _text(exc):
        return None
    return new


def _blank(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    """A new ``cls`` from its first ``__new__``, or, where that is a built-in one that refuses
    (a class with two built-in bases, ``CollectiveTimeoutError``: ``RuntimeError.__new__``,
    found first by name, refuses to make it; ``OSError``'s does), the next built-in one's. A
    ``__new__`` written in Python is the class's own say: what it raises is raised."""
    for base in cls.__mro__:
        make = base.__dict__.get("__new__")
        if make is None:
            continue
        if not isinstance(make, BuiltinFunctionType):
            return _checked(make(cls, *args), cls)
        try:
            new = make(cls, *args)
        except TypeError:  # (not kept: a cycle through this frame would keep the callers')
            continue
        if isinstance(new, cls):
            return new
    raise TypeError(f"no __new__ in the bases of {cls.__qualname__} makes one")


def _checked(made: object, cls: type[BaseException]) -> BaseException:
    """``made``, which a ``__new__`` of ``cls`` returned, if it is a ``cls``."""
    if not isinstance(made, cls):
        raise TypeError(f"{cls.__qualname__}.__new__ returned a {type(made).__qualname__}")
    return made


def same_public_state(old: BaseException, new: BaseException) -> bool:
    """Whether every public, non-callable attribute of ``new`` equals the one of ``old``."""
    # (__dict__ was copied: this catches state a constructor derives from its argument, a
    # property over args, or keeps outside __dict__: slots, C fields)
    for name in set(dir(old)) | set(dir(new)):
        if name.startswith("_") or name == "args":
            continue
        a = getattr(old, name, None)
        b = getattr(new, name, None)
        if callable(a) and callable(b):
            continue
        if not _same_value(a, b):
            return False
    return True


def _same_value(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and bool(a == b))


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as err:  # (a user's ``__str__``: two that fail alike are alike)
        return f"<str() failed: {type(err).__name__}>"
