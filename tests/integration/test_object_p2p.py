"""send_object_list / recv_object_list carry tensors out of band, between real processes."""

from __future__ import annotations

import pytest
import torch

import tdist as dist
from tdist.testing import free_port, run_processes

pytestmark = pytest.mark.timeout(60)


def _body(rank: int, world: int, port: int) -> list[object]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: the cross-memory path
        if rank == 0:
            dist.send_object_list([{"w": big, "step": 3}, "hello", torch.tensor([1, 2], dtype=torch.int8)], dst=1)
            got = [None]
            sender = dist.recv_object_list(got)  # from any rank
            return [sender, got[0]]
        got3: list[object] = [None, None, None]
        sender = dist.recv_object_list(got3, src=0)
        first = got3[0]
        assert isinstance(first, dict)
        assert torch.equal(first["w"], big) and first["step"] == 3
        assert got3[1] == "hello" and torch.equal(got3[2], torch.tensor([1, 2], dtype=torch.int8))  # type: ignore[arg-type]
        dist.send_object_list([("back", rank)], dst=0)
        return [sender]
    finally:
        dist.destroy_process_group()


def test_objects_with_tensors_between_processes() -> None:
    results = run_processes(_body, 2, free_port(), timeout=50)
    assert results[1] == [0]
    assert results[0] == [1, ("back", 1)]
