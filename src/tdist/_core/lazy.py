"""Names of a package that load on first use (PEP 562).

``__getattr__, __dir__ = lazy.names(__name__, {"Name": ".module", ...})`` in a package's
``__init__``: ``package.Name`` imports ``module`` (relative to the package, or absolute) the
first time it is asked for, and keeps what it found in the package's namespace. A process that
needs one part of the package does not pay for the others (torch among them).
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # (typing is not imported at run time: see tdist/__init__)
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["names"]


def names(package: str, where: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose names ``where`` says where to
    find (name -> module)."""

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
