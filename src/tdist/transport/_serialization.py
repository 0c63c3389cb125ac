"""Objects to scatter-gather buffers and back: pickle protocol 5 with out-of-band buffers.

Theory of operation. ``dumps`` pickles an object with protocol 5; every buffer that can travel
out of band (numpy arrays natively, CPU torch tensors through ``reducer_override``) is left out
of the pickle stream and returned as its own ``memoryview`` of the object's memory, so a sender
passes ``[header, pickle, *buffers]`` to ``sendmsg`` without copying any payload. The header
says how long the pickle and each buffer are. ``loads`` splits one received buffer the same way
and rebuilds the object with the buffers as views into it: a tensor comes back sharing the
received memory (``torch.frombuffer``), not copied again. No I/O here.

Format (little-endian): ``magic "TDS1" | u32 nbuffers | u64 pickle_len | nbuffers x u64`` then
the pickle, then the buffers back to back.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import struct
import threading
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from .._core.errors import RemoteProtocolError

__all__ = ["Placeholder", "dumps", "loads", "loads_parts"]

_MAGIC = b"TDS1"
_HEAD = struct.Struct("<4sIQ")
_LEN = struct.Struct("<Q")


# dtypes travel by name (a short string pickles faster than torch's dtype object, which pickle
# saves as a global); those numpy shares are rebuilt through numpy, the fastest way to wrap bytes
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_NAMES = {d: name for name, d in _DTYPES.items()}
_NUMPY = {
    name: np.dtype(name)
    for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128")
}


def _with_bits(t: torch.Tensor, bits: dict[str, bool] | None) -> torch.Tensor:
    """``t`` with the conjugate and negative bits of the tensor that was sent (torch's
    metadata: ``{"conj": True}``, ``{"neg": True}``): the bytes went as they are in memory."""
    if bits:
        torch._C._set_tensor_metadata(t, bits)  # type: ignore[attr-defined]
    return t


def _rebuild_tensor(
    buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool, bits: dict[str, bool] | None = None
) -> torch.Tensor:
    raw = buf.raw() if isinstance(buf, pickle.PickleBuffer) else memoryview(buf)
    npd = _NUMPY.get(dtype)
    if raw.nbytes and npd is not None:
        t = torch.from_numpy(np.frombuffer(raw, dtype=npd).reshape(shape))
    else:
        tdt = _DTYPES.get(dtype)
        if tdt is None:
            raise RemoteProtocolError(f"unknown tensor dtype {dtype!r} (sent by a different torch?)")
        if raw.nbytes == 0:
            t = torch.empty(shape, dtype=tdt)
        else:
            t = torch.frombuffer(raw, dtype=torch.uint8).view(tdt).reshape(shape)
    _with_bits(t, bits)
    if requires_grad:
        t.requires_grad_(True)
    return t


# A view travels with its whole storage (its offset and strides kept, and views of one storage
# in one message sharing it on arrival), as torch's RPC sends it, unless copying out just its
# elements saves at least half of a storage of at least this size (torch's rule). A whole
# tensor travels alone (the fast path), unless a view sent before it in the message shares its
# storage; a view sent after it names it (the pickler's memo) and shares its memory on arrival.
_RECOPY_MIN = 8 * 1024


class _Storage:
    """A tensor storage in one message: pickled once however many views use it (the pickler's
    memo), its bytes out of band."""

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def __reduce__(self) -> Any:
        return (_rebuild_storage, (pickle.PickleBuffer(self.raw),))


def _rebuild_storage(buf: Any) -> torch.Tensor:
    raw = buf.raw() if isinstance(buf, pickle.PickleBuffer) else memoryview(buf)
    if raw.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(raw, dtype=torch.uint8)


def _rebuild_view(
    base: torch.Tensor, dtype: str, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
    requires_grad: bool, bits: dict[str, bool] | None = None,
) -> torch.Tensor:
    tdt = _DTYPES.get(dtype)
    if tdt is None:
        raise RemoteProtocolError(f"unknown tensor dtype {dtype!r} (sent by a different torch?)")
    t = _with_bits(torch.empty(0, dtype=tdt).set_(base.untyped_storage(), offset, shape, stride), bits)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _storage_of(storage: Any) -> _Storage:
    storages = _message.storages
    assert storages is not None  # (only a reducer of dumps calls this)
    key = storage.data_ptr()
    entry = storages.get(key)
    if isinstance(entry, _Storage):
        return entry
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    made = storages[key] = _Storage(whole.numpy() if whole.numel() else bytearray())
    return made


# what is told of a tensor on another device than the CPU met while pickling (RPC refuses one
# that no device map sends, as torch's does: ``rpc._agent``); ``None``: nothing
device_hook: list[Callable[[torch.Tensor], None] | None] = [None]


def _reduce_tensor(obj: torch.Tensor) -> Any:
    # plain CPU tensors travel as raw bytes beside the pickle (subclasses such as nn.Parameter
    # match no entry of the dispatch table and keep torch's own reduction, their data comes
    # here, as do sparse, quantized and non-CPU tensors, which keep torch's reduction too)
    if obj.layout != torch.strided or obj.is_quantized or not obj.is_cpu:
        hook = device_hook[0]
        if hook is not None and obj.device.type != "cpu":
            hook(obj)
        return cast(Any, obj).__reduce_ex__(5)
    t = obj.detach() if obj.requires_grad else obj
    # a lazily conjugated or negated tensor (``z.conj()``, ``z.conj().imag``) goes as its bytes
    # in memory with its bits, as torch's pickling sends it; its bits are set again on arrival
    bits: dict[str, bool] | None = None
    if t.is_conj() or t.is_neg():
        bits = torch._C._get_tensor_metadata(t)  # type: ignore[attr-defined]
        t = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    useful = t.numel() * t.element_size()
    storage = t.untyped_storage()
    whole = storage.nbytes()
    seen = _message.storages
    ptr = storage.data_ptr() if whole and seen is not None else 0
    if ptr and seen:
        prior = seen.get(ptr)
        if prior is not None:
            # a storage this message sent already: with a view's storage, or named by the
            # whole tensor sent as it; both share one storage on arrival, as torch's (two
            # storages at one address, of different sizes, are not one)
            # (either rebuilds as a tensor on that storage: ``_rebuild_view`` takes both)
            size = prior.raw.nbytes if isinstance(prior, _Storage) else prior.untyped_storage().nbytes()
            if size == whole:
                return (_rebuild_view, (prior, _NAMES[obj.dtype], t.storage_offset(), tuple(t.shape), tuple(t.stride()), obj.requires_grad, bits))
    if (whole != useful or t.storage_offset() or not t.is_contiguous()) and not (whole >= _RECOPY_MIN and whole >= 2 * useful):
        # a view: with its storage, offset and strides, sharing the storage with the
        # message's other views
        return (_rebuild_view, (_storage_of(storage), _NAMES[obj.dtype], t.storage_offset(), tuple(t.shape), tuple(t.stride()), obj.requires_grad, bits))
    if not t.is_contiguous():
        t = t.contiguous()
    elif ptr and whole == useful:
        seen[ptr] = obj  # type: ignore[index]  # (its storage whole: a later view may name it)
    if t.numel() == 0:
        raw: Any = bytearray()
    else:
        try:
            raw = t.numpy()  # a contiguous array: its buffer is the tensor's memory
        except TypeError:  # a dtype numpy lacks (bfloat16, ...): view the bytes
            raw = t.reshape(-1).view(torch.uint8).numpy()
    if bits is not None:
        return (_rebuild_tensor, (pickle.PickleBuffer(raw), _NAMES[obj.dtype], tuple(obj.shape), obj.requires_grad, bits))
    return (_rebuild_tensor, (pickle.PickleBuffer(raw), _NAMES[obj.dtype], tuple(obj.shape), obj.requires_grad))


# consulted by exact type, in C: no Python call for the objects that are not tensors. It stands
# in for copyreg's table (torch.layout, re.Pattern, numpy's ufuncs are pickled through it), so
# it holds a copy of that, kept up to date with what is registered later
_DISPATCH: dict[type, Any] = {}
_synced = [-1]  # the size of copyreg's table when _DISPATCH copied it


def _script_function(qualified_name: str) -> Any:
    """The TorchScript function named ``qualified_name`` (``__torch__.module.name``) in this
    process: compiled already, or compiled by importing its module."""
    fn = torch.jit._state._python_cu.find_function(qualified_name)
    if fn is None:
        module, _, name = qualified_name.removeprefix("__torch__.").rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except ImportError:
            fn = None
        if not isinstance(fn, torch.jit.ScriptFunction):
            raise RemoteProtocolError(f"no TorchScript function {qualified_name} here (is its module importable?)")
    return fn


def _reduce_script_function(fn: Any) -> Any:
    # by name, as torch's RPC sends it: the receiver finds (or compiles) its own
    return (_script_function, (fn.qualified_name,))


def _load_script_module(saved: bytes) -> Any:
    return torch.jit.load(io.BytesIO(saved))  # type: ignore[no-untyped-call]


def _reduce_script_module(module: Any) -> Any:
    # a scripted or traced module, whose pickling torch refuses: as ``torch.jit.save`` writes
    # it (torch's RPC sends a module so, where it is the whole result), anywhere in a message
    saved = io.BytesIO()
    torch.jit.save(module, saved)
    return (_load_script_module, (saved.getvalue(),))


# (the classes ``torch.jit.script``, ``torch.jit.trace`` and ``torch.jit.load`` make; exact types)
_SCRIPT_MODULES = (torch.jit._script.RecursiveScriptModule, torch.jit._trace.TracedModule, torch.jit._trace.TopLevelTracedModule)


def _sync_dispatch() -> None:
    _DISPATCH.clear()
    _DISPATCH.update(copyreg.dispatch_table)
    _DISPATCH[torch.Tensor] = _reduce_tensor
    _DISPATCH[torch.jit.ScriptFunction] = _reduce_script_function
    for kind in _SCRIPT_MODULES:
        _DISPATCH[kind] = _reduce_script_module
    _synced[0] = len(copyreg.dispatch_table)


_sync_dispatch()


class _Message(threading.local):
    """The storages of the views in the message this thread is pickling (``None`` outside
    ``dumps``; a reducer that serializes something itself nests a table of its own)."""

    # storage address -> its _Storage (sent for a view), or the tensor sent as the whole of it
    storages: dict[int, _Storage | torch.Tensor] | None = None


_message = _Message()


_SCALARS = frozenset((type(None), bool, int, float, str, bytes))  # nothing of ours to reduce


def dumps(obj: Any) -> list[memoryview]:
    """``obj`` as buffers to send back to back: a header, the pickle, the out-of-band payloads.

    Every call pickles with a pickler of its own, dropped when it returns. A pickler kept and
    reused (``clear_memo()`` between messages) crashes the interpreter: CPython's garbage
    collector visits a pickler's memo (3.11.7 on), and ``clear_memo`` releases the memo's
    objects one by one before it empties the table, so a collection that a deallocation starts
    meanwhile (in this thread, or in another one while this one waits for the GIL) visits
    objects already freed. Tensors made while pickling (a Parameter's ``.data``) live in the
    memo only, and their deallocation is such a point. A pickler being deallocated is untracked
    first, so nothing visits its memo while it is emptied.
    """
    if type(obj) in _SCALARS:  # a reply such as None: one call does it
        plain = memoryview(pickle.dumps(obj, protocol=5))
        return [memoryview(_HEAD.pack(_MAGIC, 0, plain.nbytes)), plain]
    if len(copyreg.dispatch_table) != _synced[0]:
        _sync_dispatch()  # something registered with copyreg since
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = pickle.Pickler(stream, protocol=5, buffer_callback=buffers.append)
    pickler.dispatch_table = _DISPATCH
    outer = _message.storages
    _message.storages = {}
    try:
        pickler.dump(obj)
    finally:
        _message.storages = outer
    del pickler
    body = stream.getbuffer()  # writable memory of its own (cross-memory copies need that)
    if not buffers:
        return [memoryview(_HEAD.pack(_MAGIC, 0, body.nbytes)), body]
    views = [b.raw() for b in buffers]
    head = _HEAD.pack(_MAGIC, len(views), body.nbytes) + b"".join(_LEN.pack(v.nbytes) for v in views)
    return [memoryview(head), body, *views]


class Placeholder:
    """What a lenient ``loads`` makes of every class and function the pickle names: it takes
    any arguments, state and items, and stands for the object that could not be rebuilt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Placeholder:
        return Placeholder()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _Lenient(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return Placeholder


def _unpickle(body: memoryview, buffers: list[memoryview] | None, lenient: bool) -> Any:
    if lenient:
        return _Lenient(io.BytesIO(body), buffers=buffers).load()
    return pickle.loads(body, buffers=buffers)


def loads(data: bytes | bytearray | memoryview, lenient: bool = False) -> Any:
    """The object ``dumps`` made, its buffers viewing ``data`` (keep ``data`` writable).

    ``lenient``: every class and function the pickle names is rebuilt as a ``Placeholder``, so
    that nothing the receiver lacks (or whose rebuilding raises) keeps the plain data around
    it (ids, numbers, strings, containers) from being read.

    Raises:
        RemoteProtocolError: ``data`` is not a whole ``dumps`` message.
    """
    view = memoryview(data).cast("B")
    if view.nbytes >= _HEAD.size:
        magic, nbuf, plen = _HEAD.unpack_from(view, 0)
        if nbuf == 0 and magic == _MAGIC and _HEAD.size + plen == view.nbytes and not lenient:  # no buffers
            return pickle.loads(view[_HEAD.size :])
    pos, plen, lengths = _header(view)
    if pos + plen + sum(lengths) != view.nbytes:
        raise RemoteProtocolError("serialized object sizes do not add up")
    body = view[pos : pos + plen]
    pos += plen
    parts = []
    for n in lengths:
        parts.append(view[pos : pos + n])
        pos += n
    return _unpickle(body, parts, lenient)


def _header(view: memoryview) -> tuple[int, int, list[int]]:
    """Where the pickle starts, its length, and the buffers' lengths."""
    if view.nbytes < _HEAD.size:
        raise RemoteProtocolError("serialized object shorter than its header")
    magic, nbuf, plen = _HEAD.unpack_from(view, 0)
    if magic != _MAGIC:
        raise RemoteProtocolError(f"not a serialized object (magic {bytes(magic)!r})")
    pos = _HEAD.size + nbuf * _LEN.size
    if pos > view.nbytes:
        raise RemoteProtocolError("serialized object header runs past its end")
    return pos, plen, [_LEN.unpack_from(view, _HEAD.size + i * _LEN.size)[0] for i in range(nbuf)]


def loads_parts(prefix: bytes | bytearray | memoryview, buffers: list[memoryview], lenient: bool = False) -> Any:
    """Like ``loads`` for a message whose out-of-band buffers arrived apart from its header and
    pickle (``prefix``), e.g. copied one by one from another process's memory.

    Raises:
        RemoteProtocolError: the parts do not match the header.
    """
    view = memoryview(prefix).cast("B")
    pos, plen, lengths = _header(view)
    if pos + plen != view.nbytes or lengths != [b.nbytes for b in buffers]:
        raise RemoteProtocolError("serialized object sizes do not add up")
    return _unpickle(view[pos:], buffers, lenient)
