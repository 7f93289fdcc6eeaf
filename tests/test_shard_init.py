"""Materialisation copies each rank's shard from the host, never the whole tensor to the device
(``lightning_shard.init.shard_init``): a CPU stand-in on a fake 4-rank process group, as rank 1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_shard.init.replay import write_shards


@pytest.fixture
def fake_rank_one() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("shape", "placements"),
    [((4,), [Shard(0)]), ((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Replicate(), Shard(0)])],
)
def test_each_rank_gets_its_chunk_and_nothing_whole_moves_to_a_device(
    fake_rank_one: None, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], placements: list[Any]
) -> None:
    mesh = init_device_mesh("cpu", shape)
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    live = distribute_tensor(torch.zeros(10, 6), mesh, placements, src_data_rank=None)
    moved: list[int] = []
    to = torch.Tensor.to

    def recording_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if any(isinstance(a, (str, torch.device)) for a in (*args, *kwargs.values())):
            moved.append(self.numel())  # a move to a device (on a GPU: a device copy of this size)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    with torch.no_grad():
        write_shards(full, live)
    monkeypatch.undo()
    assert full.numel() not in moved
    reference = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()  # torch's own split
    assert torch.equal(live.to_local(), reference)
