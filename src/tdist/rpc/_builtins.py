"""Torch operators called over RPC with plain Python values, as torch's RPC calls them.

Torch's RPC runs a builtin operator (``rpc_sync(to, torch.add, args=(1, 1))``) by matching its
arguments against the operator's schemas in order, the dispatcher's overloads first, without
turning numbers into tensors: ``torch.add(1, 1)`` runs ``aten::add.int`` and returns the int
``2``, ``torch.add(1.5, 1)`` runs ``aten::add.complex`` and returns ``(2.5+0j)``,
``torch.sqrt(4)`` returns the float ``2.0``. Called from Python, the same functions return
tensors. ``call`` makes that choice when no argument is a tensor (with a tensor, the first
schemas, the tensor ones, are the ones Python picks too); when no schema matches it calls the
function as Python does, and arguments that fit no overload raise torch's RPC's
``RuntimeError`` (Python's ``TypeError`` says why).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["call"]

_PLAIN = (bool, int, float, complex, str, type(None))
_schemas: dict[Any, Any] = {}  # function -> (operator packet, schemas) or None (not an operator)


def _operator(func: Any) -> Any:
    found = _schemas.get(func, False)
    if found is not False:
        return found
    entry = None
    try:
        name = torch.jit._builtins._find_builtin(func)  # type: ignore[no-untyped-call]
    except Exception:
        name = None
    if isinstance(name, str) and name.startswith("aten::"):
        base = name.removeprefix("aten::")
        packet = getattr(torch.ops.aten, base, None)
        if packet is not None:
            entry = (packet, torch._C._jit_get_schemas_for_operator(name))
    _schemas[func] = entry
    return entry


def _plain(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_plain(e) for e in x)
    return isinstance(x, _PLAIN)


def _fits(x: Any, t: Any) -> bool:
    """Whether the plain value ``x`` converts to the schema type ``t`` as torch's RPC converts
    it (numbers never to tensors)."""
    kind = type(t).__name__
    if kind == "OptionalType":
        return x is None or _fits(x, t.getElementType())
    if kind in ("AnyType", "VarType"):
        return True
    if x is None:
        return kind == "NoneType"
    if kind == "IntType":
        return isinstance(x, int)
    if kind == "FloatType":
        return isinstance(x, (int, float))
    if kind in ("ComplexType", "NumberType"):
        return isinstance(x, (int, float, complex))
    if kind == "BoolType":
        return isinstance(x, bool)
    if kind == "StringType":
        return isinstance(x, str)
    if kind == "ListType":
        return isinstance(x, (list, tuple)) and all(_fits(e, t.getElementType()) for e in x)
    return False


def _matches(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    params = schema.arguments
    positional = [p for p in params if not p.kwarg_only]
    if len(args) > len(positional):
        return False
    names = {p.name for p in params}
    if any(k not in names for k in kwargs):
        return False
    for i, p in enumerate(params):
        if i < len(args) and not p.kwarg_only:
            if p.name in kwargs or not _fits(args[i], p.type):
                return False
        elif p.name in kwargs:
            if not _fits(kwargs[p.name], p.type):
                return False
        elif not p.has_default_value():
            return False
    return True


def call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``; a torch operator given only plain values (numbers, strings,
    lists of them) runs the overload torch's RPC would pick."""
    if type(func) is types.BuiltinFunctionType and _plain(args) and _plain(tuple(kwargs.values())):
        op = _operator(func)
        if op is not None:
            packet, schemas = op
            for schema in schemas:
                if _matches(schema, args, kwargs):
                    overload = getattr(packet, schema.overload_name or "default", None)
                    if overload is not None:
                        return overload(*args, **kwargs)
                    break
    try:
        return func(*args, **kwargs)
    except TypeError as exc:
        if type(func) is not types.BuiltinFunctionType or _operator(func) is None:
            raise
        # torch's RPC matches an operator's arguments to its schemas and says so (a RuntimeError)
        raise RuntimeError(f"Overloaded torch operator invoked from Python failed to match any schema:\n{exc}") from None
