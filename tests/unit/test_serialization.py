"""Pickle-5 out-of-band serialization, with bytes alone."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from tdist._core.errors import RemoteProtocolError
from tdist.transport._serialization import dumps, loads


def join(parts: list[memoryview]) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in parts))


DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # (float8 and the wider unsigned types lack torch.equal on CPU: compare their bytes)
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_roundtrip_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.arange(24) % 5).to(dtype).reshape(2, 3, 4)
    out = loads(join(dumps({"t": t, "n": 3, "scalar": t[1, 2, 3], "empty": t[:0]})))
    assert out["n"] == 3 and same(out["t"], t)
    assert out["scalar"].shape == () and same(out["scalar"], t[1, 2, 3])
    assert out["empty"].shape == (0, 3, 4) and out["empty"].dtype == dtype


def test_received_tensors_view_the_buffer_even_unaligned() -> None:
    # a tensor's bytes may start at any offset of the received buffer: it still views them
    # (no copy), writable, with the values sent
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    data = join(dumps((b"x", t)))
    shifted = bytearray(1) + data
    _, out = loads(memoryview(shifted)[1:])
    assert torch.equal(out, t)
    out += 1  # writable: it is the buffer's memory
    _, again = loads(memoryview(shifted)[1:])
    assert torch.equal(again, t + 1)


def test_views_empty_grad_and_numpy() -> None:
    m = torch.arange(20.0).reshape(4, 5)
    obj = {
        "col": m[:, 1],
        "empty": torch.empty(0, 3),
        "leaf": torch.ones(2, requires_grad=True),
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "nested": [torch.tensor(7), ("x", b"y")],
    }
    out = loads(join(dumps(obj)))
    assert torch.equal(out["col"], m[:, 1])
    assert out["empty"].shape == (0, 3)
    assert out["leaf"].requires_grad and torch.equal(out["leaf"].detach(), torch.ones(2))
    assert np.array_equal(out["arr"], obj["arr"])
    assert out["nested"][0].item() == 7 and out["nested"][1] == ("x", b"y")


def test_payloads_travel_out_of_band_without_copies() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    parts = dumps([t])
    assert len(parts) == 3  # header, pickle, the tensor's bytes
    assert parts[1].nbytes < 1024  # the pickle holds no payload
    addr = ctypes.addressof(ctypes.c_char.from_buffer(parts[2]))
    assert addr == t.data_ptr()  # a view of the tensor's own memory
    data = join(parts)
    (back,) = loads(data)
    base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    assert base <= back.data_ptr() < base + len(data)  # a view into the received buffer
    assert torch.equal(back, t)


@pytest.mark.parametrize("bad", [b"", b"XXXX" + b"\0" * 12, b"TDS1" + b"\1\0\0\0" + b"\0" * 8])
def test_malformed_input_is_an_error(bad: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        loads(bytearray(bad))


class _Big:
    pass


class _Nested:
    """Serializes something else while it is being pickled (as an RRef fork may)."""

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return (bytes, (bytes(b"".join(bytes(p) for p in dumps({"inner": [1, 2]}))),))


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("no pickling")


def test_dumps_keeps_nothing_alive_and_survives_errors() -> None:
    import gc
    import weakref

    obj = _Big()
    ref = weakref.ref(obj)
    small, large = dumps([obj]), dumps([obj, b"x" * (1 << 17)])
    del obj
    gc.collect()
    assert ref() is None  # no pickler's memo holds the message's objects
    assert loads(join(small))[0].__class__ is _Big
    assert loads(join(large))[1] == b"x" * (1 << 17)
    assert not large[1].readonly  # a large pickle is its own writable memory
    inner = loads(join(dumps(_Nested())))
    assert loads(bytearray(inner)) == {"inner": [1, 2]}
    with pytest.raises(RuntimeError, match="no pickling"):
        dumps([torch.ones(3), _Unpicklable()])
    out = loads(join(dumps({"after": torch.arange(3)})))  # nothing left over from the failure
    assert list(out) == ["after"] and torch.equal(out["after"], torch.arange(3))


class _Refuses:
    def __reduce__(self) -> object:
        return (_refuse, ("no",))


def _refuse(text: str) -> None:
    raise ValueError(text)


def test_lenient_loads_reads_the_plain_data_around_what_cannot_be_rebuilt() -> None:
    import sys
    import types

    from tdist.transport._serialization import Placeholder, loads_parts

    module = types.ModuleType("only_in_this_test")
    exec("class Gone:\n    def __init__(self):\n        self.x = [1]\n", module.__dict__)
    sys.modules["only_in_this_test"] = module
    try:
        obj = ((0, 7), (0, 8), module.Gone(), _Refuses(), {"k": [1.5, "s"]}, torch.arange(4.0))
        parts = dumps(obj)
    finally:
        del sys.modules["only_in_this_test"]
    data = bytearray(b"".join(parts))
    with pytest.raises((AttributeError, ModuleNotFoundError)):
        loads(data)
    for got in (loads(data, lenient=True), loads_parts(b"".join(parts[:2]), list(parts[2:]), lenient=True)):
        assert got[:2] == ((0, 7), (0, 8))
        assert isinstance(got[2], Placeholder) and isinstance(got[3], Placeholder)
        assert got[4] == {"k": [1.5, "s"]}
        assert isinstance(got[5], Placeholder)  # the tensor's rebuilder is a function too
    # the refusing reducer alone: the strict load raises its error, the lenient one does not
    data = bytearray(b"".join(dumps(((1, 2), _Refuses()))))
    with pytest.raises(ValueError, match="no"):
        loads(data)
    assert loads(data, lenient=True)[0] == (1, 2)


def test_requires_grad_of_non_leaves_sparse_tensors_and_copyreg_types() -> None:
    import re

    x = torch.ones(2, requires_grad=True)
    sparse = torch.eye(3).to_sparse()
    obj = {"non_leaf": x * 2, "sparse": sparse, "layout": torch.sparse_coo, "pattern": re.compile("a+")}
    out = loads(join(dumps(obj)))
    # as torch's RPC: a tensor that requires grad arrives as a leaf that requires grad
    assert out["non_leaf"].requires_grad and out["non_leaf"].is_leaf
    assert torch.equal(out["non_leaf"].detach(), torch.full((2,), 2.0))
    # what copyreg knows how to pickle (torch.layout, re.Pattern) pickles here too
    assert out["sparse"].layout == torch.sparse_coo and torch.equal(out["sparse"].to_dense(), torch.eye(3))
    assert out["layout"] is torch.sparse_coo and out["pattern"].pattern == "a+"


class _Late:
    """A type only copyreg can pickle (its own reduction refuses)."""

    def __reduce__(self) -> Any:
        raise TypeError("pickled without copyreg")


def _make_late() -> _Late:
    return _Late.__new__(_Late)


def test_a_type_registered_with_copyreg_later_is_pickled_through_it() -> None:
    import copyreg

    copyreg.pickle(_Late, lambda obj: (_make_late, ()))
    try:
        assert isinstance(loads(join(dumps([_Late()])))[0], _Late)
    finally:
        del copyreg.dispatch_table[_Late]


def test_views_keep_their_storage_strides_and_sharing_as_torch_rpc_sends_them() -> None:
    small = torch.arange(16.0)
    parts = dumps((small[::2], small[1:5], small))
    assert len(parts) == 3  # one storage, sent once for the three tensors
    every_other, window, whole = loads(join(parts))
    assert every_other.stride() == (2,) and not every_other.is_contiguous()
    assert window.storage_offset() == 1 and window.untyped_storage().nbytes() == 64
    assert torch.equal(every_other, small[::2]) and torch.equal(window, small[1:5]) and torch.equal(whole, small)
    whole[2] = -1.0  # one storage on arrival, as with torch: a write shows through every view
    assert every_other[1].item() == -1.0 and window[1].item() == -1.0

    # a whole tensor first, then views of its storage (another dtype too): one storage on
    # arrival as well (torch's pickler shares storages in any order)
    base = torch.zeros(4)
    parts = dumps((base, base[1:], base.view(torch.int32)[2:], base.view(2, 2)))
    assert len(parts) == 3  # the storage's bytes once
    first, tail, ints, square = loads(join(parts))
    tail.add_(1.0)
    assert first.tolist() == [0.0, 1.0, 1.0, 1.0] and square.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    assert ints.dtype == torch.int32 and ints.storage_offset() == 2 and ints.shape == (2,)
    assert ints.tolist() == first.view(torch.int32)[2:].tolist()
    assert first.untyped_storage().data_ptr() == ints.untyped_storage().data_ptr()
    leaf = torch.ones(3, requires_grad=True)
    back_leaf, back_view = loads(join(dumps((leaf, leaf.detach()[1:]))))
    assert back_leaf.requires_grad and not back_view.requires_grad
    assert back_view.untyped_storage().data_ptr() == back_leaf.untyped_storage().data_ptr()

    t = torch.arange(12.0).reshape(3, 4).t()  # strides kept: still a transpose
    (back,) = loads(join(dumps((t,))))
    assert back.stride() == (1, 4) and torch.equal(back, t)

    # a small view of a large storage is copied out alone (torch's rule: it saves at least half
    # of a storage of at least 8 KiB)
    big = torch.arange(4096.0)
    for view in (big[:100], big[::2]):
        (back,) = loads(join(dumps((view,))))
        assert back.is_contiguous() and back.untyped_storage().nbytes() == view.numel() * 4
        assert torch.equal(back, view)
    (back,) = loads(join(dumps((big[:3000],))))  # most of the storage: sent whole, with its offset
    assert back.untyped_storage().nbytes() == big.untyped_storage().nbytes() and torch.equal(back, big[:3000])

    g = torch.arange(8.0, requires_grad=True)
    (back,) = loads(join(dumps((g[::2],))))  # (a non-leaf view that requires grad)
    assert back.requires_grad and torch.equal(back.detach(), g.detach()[::2])


def test_conjugate_and_negative_bits_travel_with_the_tensor_as_torch_sends_them() -> None:
    z = torch.tensor([1 + 2j, 3 + 4j, 5 + 6j])
    big = torch.complex(torch.arange(2048.0), torch.ones(2048))  # (a small view of it: copied out)
    sent = (
        z.conj(), z.conj()[1:], z.conj().imag, z.conj()[::2], big.conj()[:4],
        torch.tensor([1.0, -2.0])._neg_view(), z.conj().imag.requires_grad_(False),
    )
    back = loads(join(dumps(sent)))
    for got, want in zip(back, sent, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())
    assert back[0].is_conj() and back[1].is_conj() and back[2].is_neg()  # (lazy on arrival too, as torch's)
    # a view and the tensor beside it in one message still share one storage
    plain, conj = loads(join(dumps((z, z.conj()))))
    plain[0] = 7 + 8j
    assert conj[0].item() == 7 - 8j
    leaf = torch.tensor([1.0 + 1j], requires_grad=True)
    (got,) = loads(join(dumps((leaf.conj(),))))
    assert got.requires_grad and got.detach().resolve_conj().tolist() == [1 - 1j]


# Threads that pickle views of the same storages (an RPC server replying with its model to
# several callers at once) while the garbage collector runs often. A pickler reused with
# clear_memo() between messages crashed this with SIGSEGV within seconds: the collector visits
# a pickler's memo, and clear_memo frees the memo's objects before it empties the table.
_GC_STRESS = """
import gc, sys, threading
import torch
from tdist.transport._serialization import dumps, loads

base = torch.arange(4096.0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(40)])
shared = [base[i::7] for i in range(7)] + [base[i * 64 : i * 64 + 100] for i in range(30)]
gc.set_threshold(50, 5, 5)
failed = []

def reply():
    try:
        for _ in range(60):
            parts = dumps((model, shared, list(model.parameters())))
            back = loads(bytearray(b"".join(bytes(p) for p in parts)))
            assert torch.equal(back[1][3], shared[3])
    except BaseException as exc:
        failed.append(exc)

threads = [threading.Thread(target=reply) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not failed, failed
print("done")
"""


def test_threads_pickling_views_of_shared_storages_survive_garbage_collection() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _GC_STRESS], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "done", (proc.returncode, proc.stderr[-3000:])


def test_two_storages_at_one_address_are_not_taken_for_one() -> None:
    # (torch.frombuffer twice over one buffer: two storages of different sizes, one address)
    buf = bytearray(16)
    small = torch.frombuffer(buf, dtype=torch.float32, count=2)
    large = torch.frombuffer(buf, dtype=torch.float32)
    assert small.data_ptr() == large.data_ptr()
    back_small, back_large = loads(join(dumps((small, large))))
    assert back_small.shape == (2,) and back_large.shape == (4,)
