"""Python objects as byte tensors for the object collectives (``all_gather_object``, ...).

Objects are pickled with the standard pickler, as torch does, into a ``uint8`` tensor; the
receiving side is told the exact byte count first, so padding never reaches the unpickler.
Unpickling runs arbitrary code: the object collectives are for peers you trust, as in torch.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["object_to_tensor", "objects_to_tensor", "tensor_to_object", "tensor_to_objects"]


def object_to_tensor(obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Pickle ``obj``.

    Returns:
        ``(bytes, size)``: a ``uint8`` tensor of the pickle and a one-element ``int64`` tensor
        holding its length.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled.
    """
    f = io.BytesIO()
    pickle.Pickler(f).dump(obj)
    data = bytearray(f.getbuffer())
    byte_tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return byte_tensor, torch.tensor([byte_tensor.numel()], dtype=torch.long)


def tensor_to_object(tensor: torch.Tensor, size: int | torch.Tensor) -> Any:
    """Unpickle the first ``size`` bytes of the ``uint8`` tensor ``tensor``."""
    n = int(size.item()) if isinstance(size, torch.Tensor) else int(size)
    flat = tensor.detach().reshape(-1)[:n].to(torch.uint8).contiguous().cpu()
    return pickle.Unpickler(io.BytesIO(flat.numpy().tobytes())).load()


def objects_to_tensor(objs: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pickle each object; returns the concatenated bytes and an ``int64`` tensor of sizes."""
    parts = [object_to_tensor(o) for o in objs]
    if not parts:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.long)
    data = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    return data, torch.cat([p[1] for p in parts])


def tensor_to_objects(data: torch.Tensor, sizes: torch.Tensor) -> list[Any]:
    """Split ``data`` by ``sizes`` and unpickle each piece (the inverse of ``objects_to_tensor``)."""
    out = []
    offset = 0
    for n in sizes.tolist():
        out.append(tensor_to_object(data[offset : offset + n], n))
        offset += n
    return out
