"""Worker identities: ``WorkerInfo`` (a worker's name and id, torch's record) and the rule a
worker's name must follow.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["WorkerInfo", "validate_name"]


_NAME_RE = re.compile(r"^[A-Za-z0-9_\-:]+$")
_MAX_NAME = 128
_MAX_ID = (1 << 15) - 1  # torch's worker ids are int16


class WorkerInfo:
    """A worker's name and id (``torch.distributed.rpc.WorkerInfo``): picklable, comparable.

    Raises:
        RuntimeError: the name is not valid (torch's rule and message).
        TypeError: the id is not an int16 (as torch's binding: -32768 to 32767).
    """

    __slots__ = ("id", "name")
    id: int
    name: str

    def __init__(self, name: str, id: int) -> None:
        validate_name(name)
        if not isinstance(id, int) or isinstance(id, bool):
            raise TypeError(f"WorkerInfo id must be an int, got {type(id).__name__}")
        if not -_MAX_ID - 1 <= id <= _MAX_ID:  # (torch's binding refuses it as an argument)
            raise TypeError(f"WorkerInfo(): RPC worker id {id} out of bound of int16_t.")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "id", id)

    def __setattr__(self, attr: str, value: object) -> None:
        raise AttributeError(f"WorkerInfo is read-only: cannot set {attr!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and other.id == self.id and other.name == self.name

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerInfo, (self.name, self.id))


def validate_name(name: object) -> str:
    """Raises ``RuntimeError`` (torch's rule and message) for a name that cannot be a worker's."""
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not _NAME_RE.match(name) or len(name) >= _MAX_NAME:
        raise RuntimeError(
            "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than "
            f"{_MAX_NAME} chars, but got {name}"
        )
    return name
