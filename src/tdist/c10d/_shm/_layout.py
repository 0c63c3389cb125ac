"""The arena's segment: its layout, the control-block words, operation descriptors.

Segment
-------
Rank 0 creates one anonymous shared-memory file (``memfd_create``), sizes it, maps it and
publishes it in the group's store; the others open it through ``/proc/<rank 0's pid>/fd/<n>``
and map it. Each rank's heartbeat thread faults its mapping in after
its first beat, in the background (collectives soon find it mapped; forming the group does not
wait for it). Its layout::

    header line       magic, version, world size, frames K, frame bytes F, ...
    control blocks    one per rank, a whole number of 64-byte lines:
        line 0        W, X, D: progress counters (frames), written by the owner only
        line 1        SLEEP: nonzero while the owner blocks in the kernel
        line 2        heartbeat (monotonic seconds), pid, state (starting/ready/failed/closed)
        lines 3-11    error text of a failed rank
        then          two operation descriptors (by parity of the operation number)
    data              one ring per rank: K frames of F bytes each (page aligned)

Each word has one writer, so plain aligned 8-byte loads and stores are atomic enough. The
protocol relies on x86's total store order: x86 keeps stores in order and loads in order, so
"write the data, then bump the counter" on one side and "see the counter, then read the data"
on the other is safe without fences (Python has no way to issue one). Other architectures
(ARM, POWER) reorder stores and loads, and the same code would read torn frames there, so the
arena refuses them (``memory_order_ok``): the ``tcp`` backend logs why and runs collectives
over its sockets instead.

The segment never grows: every collective streams through the rings in frames of ``F`` bytes
(``frame_bytes``: 1 MiB up to 4 ranks, less beyond), whatever its size. That bounds the shared
memory used (8 MiB for 2 ranks, about 16 MiB for more), needs no re-mapping (so no generation counter,
no second exchange through the store, no growth while a peer reads), and keeps the working set
in the last-level cache: the frames one rank writes are read by the others before they leave
it, and are overwritten in place K frames later, mostly without a trip to DRAM. Measured
here, a 64 MiB all_reduce between 2 processes took 16-17 ms with 1 MiB frames against
24-27 ms with 2-8 MiB frames: staging that outgrows the cache costs more than the extra
hand-offs of small frames, so a slot as large as the tensor would likely be slower still.

Operation descriptors (``_Desc``) name dtypes by a code every process computes alike
(``_dtype_code``), so that a mismatch message can name a peer's dtype.
"""

from __future__ import annotations

import enum
import platform
import zlib
from typing import NamedTuple

import torch

__all__ = ["default_frame_bytes", "memory_order_ok"]

_MAGIC = 0x316D737473696474  # b"tdistsm1", little-endian
_VERSION = 1
_HEADER_WORDS = 8

# word offsets inside a rank's control block (8-byte words; a line is 8 words)
_W, _X, _D = 0, 1, 2
_SLEEP = 8
_HB, _PID, _STATE = 16, 17, 18
_ERRLEN, _ERR = 24, 25
_ERR_BYTES = 64 * 8
_DESC = 96
_DESC_HEAD = 8  # seq + 1, kind, dtype, redop + 1, root + 1, numel, f0, nsizes

_STARTING, _READY, _FAILED, _CLOSED = 0, 1, 2, 3


# machines whose memory model keeps stores and loads in order (total store order)
_TSO_MACHINES = frozenset(("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"))


def memory_order_ok() -> str | None:
    """None when this machine keeps the store and load order the arena's counters rely on
    (x86); else why the arena cannot run here."""
    machine = platform.machine()
    if machine.lower() in _TSO_MACHINES:
        return None
    return (
        f"this host is {machine or 'an unknown architecture'}, whose memory model may reorder "
        "stores and loads; the shared-memory arena relies on x86's total store order"
    )


class _Kind(enum.IntEnum):
    # (1 was the set-up barrier's: an arena forms without one)
    BARRIER = 2
    ALL_REDUCE = 3
    BROADCAST = 4
    REDUCE = 5
    ALL_GATHER = 6
    GATHER = 7
    SCATTER = 8
    REDUCE_SCATTER = 9
    ALL_TO_ALL = 10


class _Desc(NamedTuple):
    """One rank's published description of an operation (see ``_write_desc``)."""

    seq: int
    kind: int
    dtype: int
    redop: int
    root: int
    numel: int
    f0: int
    sizes: tuple[int, ...]


_dtype_names: dict[int, str] = {}
_dtype_codes: dict[torch.dtype, int] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """A code for ``dtype`` that every process computes alike (``hash(str)`` is salted)."""
    code = _dtype_codes.get(dtype)
    if code is None:
        code = zlib.crc32(str(dtype).encode())
        _dtype_codes[dtype] = code
        _dtype_names.setdefault(code, str(dtype).removeprefix("torch."))
    return code


def _dtype_name(code: int) -> str:
    """The name of a dtype code a peer published (one this process may never have used)."""
    if code not in _dtype_names:
        for value in vars(torch).values():
            if isinstance(value, torch.dtype):
                _dtype_code(value)
    return _dtype_names.get(code, f"dtype#{code:x}")

def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_frame_bytes(size: int) -> int:
    """The default frame: 1 MiB up to 4 ranks, then smaller so that the segment stays near
    16 MiB (Docker's default /dev/shm is 64 MiB), never under 256 KiB or 4 KiB per rank.

    1 MiB measured best for a 64 MiB all_reduce between 2 processes here (512 KiB: +3%,
    2 MiB: +40%: the frames in flight no longer fit the last-level cache).
    """
    return _round_up(max(256 << 10, 4096 * size, min(1 << 20, (4 << 20) // size)), 4096)
