"""Parsing a remote device (torch's ``torch.distributed._remote_device`` formats).

``"<worker name>/<device>"`` (``"trainer0/cpu"``, ``"ps0/cuda:0"``), ``"rank:<rank>/<device>"``,
``"<worker name>"`` or ``"rank:<rank>"`` (the device is then ``cpu``), or a bare ``"<device>"``
(a local device: no worker).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RemoteDevice", "parse"]


@dataclass(frozen=True)
class RemoteDevice:
    worker_name: str | None
    rank: int | None
    device: torch.device


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


def parse(remote_device: str | torch.device) -> RemoteDevice:
    """Raises: ValueError (torch's message) for a string of none of the formats; RuntimeError
    (``torch.device``'s) for a bad device; TypeError for another type."""
    error = (
        f"Could not parse remote_device: {remote_device}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )
    if isinstance(remote_device, torch.device):
        return RemoteDevice(None, None, remote_device)
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1 and _is_device(fields[0]):
        return RemoteDevice(None, None, torch.device(fields[0]))
    elif len(fields) == 1:
        worker, device = fields[0], "cpu"
    else:
        raise ValueError(error)
    if not worker:
        raise ValueError(error)
    dev = torch.device(device)  # (a bad device: torch.device's RuntimeError, as torch's)
    parts = worker.split(":")
    if len(parts) == 2:
        if parts[0] == "rank" and parts[1].isdigit():
            return RemoteDevice(None, int(parts[1]), dev)
        raise ValueError(error)
    if len(parts) > 2:
        raise ValueError(error)
    return RemoteDevice(worker, None, dev)
