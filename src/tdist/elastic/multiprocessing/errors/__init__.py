"""``@record``: a worker's uncaught exception, written where its launcher reads it.

``torch.distributed.elastic.multiprocessing.errors`` under tdist's name. A worker's entry point
decorated with ``@record`` writes the exception that escapes it to the file named by
``TORCHELASTIC_ERROR_FILE`` (set by ``tdist run`` and by torchrun, one file per worker), as
torchelastic's JSON, before it propagates; the launcher's failure report then quotes that
exception's traceback (the "Root Cause") instead of the worker's last stderr lines. Without the
variable (the script run alone) nothing is written.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ChildFailedError", "ErrorHandler", "ProcessFailure", "get_error_handler", "record"]

# torch's classes of a failed launch (``elastic_launch`` raises them): the same classes, loaded
# on first use (this module imports no torch: the launcher reads error files without it)
_TORCHS = ("ChildFailedError", "ProcessFailure")


def __getattr__(name: str) -> Any:
    if name in _TORCHS:
        from torch.distributed.elastic.multiprocessing import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_F = TypeVar("_F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


class ErrorHandler:
    """Writes a worker's exception to its error file (torch's ``ErrorHandler``); subclass to
    change what is written."""

    def _get_error_file_path(self) -> str | None:
        return os.environ.get("TORCHELASTIC_ERROR_FILE")

    def initialize(self) -> None:
        """Called before the decorated function runs: a fatal signal (a segfault in an
        extension) dumps every thread's Python stack to stderr, which the launcher quotes."""
        try:
            faulthandler.enable(all_threads=True)
        except Exception as exc:  # (stderr may be closed or not a file)
            warnings.warn(f"Unable to enable fault handler. {type(exc).__name__}: {exc}", stacklevel=2)

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` (with the traceback being handled) to the error file, if there is one."""
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(e)),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file (the root cause of a failed launch) to this process's
        error file, its ``errorCode`` set to ``error_code`` unless 0 (torch's); without an
        error file of its own, the data is logged."""
        with open(rootcause_error_file, encoding="utf-8") as f:
            data = json.load(f)
        message = data.get("message") if isinstance(data, dict) else None
        if error_code and isinstance(message, dict):
            message["errorCode"] = error_code
        elif error_code:
            log.warning("the child error file %s holds no message to put error code %d in", rootcause_error_file, error_code)
        path = self._get_error_file_path()
        if not path:
            log.error("no TORCHELASTIC_ERROR_FILE to copy the child's error to; it was: %s", json.dumps(data))
            return
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)


def _first_failure(exc: BaseException) -> Any:
    """The first failure of torch's ``ChildFailedError`` ``exc``; ``None`` for any other."""
    errors = sys.modules.get("torch.distributed.elastic.multiprocessing.errors")
    if errors is None or not isinstance(exc, errors.ChildFailedError):
        return None
    return exc.get_first_failure()[1]


def get_error_handler() -> ErrorHandler:
    """The default ``ErrorHandler``."""
    return ErrorHandler()


def record(fn: _F | None = None, error_handler: ErrorHandler | None = None) -> Any:
    """Decorate a worker's entry point (``@record`` or ``@record(error_handler=...)``): an
    exception that escapes it is written to ``TORCHELASTIC_ERROR_FILE`` and raised again.
    ``SystemExit`` with code 0 returns None; another ``SystemExit`` passes through
    unrecorded, as torch's does."""
    handler = error_handler if error_handler is not None else get_error_handler()

    def wrap(f: _F) -> _F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except Exception as exc:
                failure = _first_failure(exc)
                if failure is None:
                    handler.record_exception(exc)
                elif os.path.isfile(failure.error_file):
                    # a launch that failed (``elastic_launch``, ``tdist.run.main``): what its
                    # first failed worker wrote is this process's error too, with its exit code
                    handler.dump_error_file(failure.error_file, failure.exitcode)
                raise

        return wrapper  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap
