"""Buffers under data parallelism: every rank holds rank 0's after each optimizer step, as under DDP.

``fully_shard`` shards parameters only; buffers stay whole on every rank, and what a forward writes into them -
BatchNorm's running statistics, ``num_batches_tracked``, any running average a model keeps - comes from that rank's
own batch. Left alone, the ranks' copies drift apart (a ResNet's running statistics differ by 0.3 after 3 steps),
evaluation then differs per rank, and a checkpoint keeps whichever copy its writer held.

torch's ``DistributedDataParallel`` (``broadcast_buffers=True``, its default and Lightning's) broadcasts rank 0's
buffers at the start of each training forward, so rank 0's buffers only ever see rank 0's batches, and the other
ranks compute with them. Here the strategy broadcasts rank 0's buffers after each optimizer step
(:func:`broadcast_buffers`): rank 0's buffers evolve exactly as under DDP, every forward after a step (training or
evaluation) uses them on every rank, and every checkpoint - written at a step boundary - holds the buffers all ranks
agree on. Between the micro-batches of one accumulated step each rank's own batches update its copy, as under DDP's
``no_sync``. The cost is DDP's: one broadcast per buffer dtype and device, of all buffers, per optimizer step.
``Trainer(sync_batchnorm=True)`` instead makes BatchNorm compute its statistics over all ranks' batches
(``SyncBatchNorm``), as one process would over the whole batch.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.checkpoint.ranks import all_gathered


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers of ``model``: one broadcast per (device, dtype) of the buffers, flattened
    together. Call on every rank; does nothing without a process group of more than one rank.

    Example:
        >>> broadcast_buffers(torch.nn.BatchNorm1d(4))  # no process group: nothing to do
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for buffer in _buffers_every_rank_holds(model):
        groups[(buffer.device, buffer.dtype)].append(buffer)
    # The same order on every rank: by name, grouped in first-seen order.
    for buffers in groups.values():
        flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
        dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers, flat.split([buffer.numel() for buffer in buffers]), strict=True):
            buffer.copy_(value.view_as(buffer))


def _buffers_every_rank_holds(model: nn.Module) -> list[torch.Tensor]:
    """``model``'s plain buffers that every rank holds under the same name, shape, dtype and device type, by name: a
    buffer one rank alone created or cast (a cache a model builds lazily) would otherwise put the ranks' broadcasts
    out of step, and hang them."""
    named = sorted(
        # A DTensor buffer (a tensor-parallel plan's) is placed by its mesh already; a meta one holds nothing.
        (name, buffer)
        for name, buffer in model.named_buffers()
        if not isinstance(buffer, DTensor) and not buffer.is_meta
    )
    entries = [(name, tuple(buffer.shape), str(buffer.dtype), buffer.device.type) for name, buffer in named]
    gathered = all_gathered(entries)
    common = set(entries).intersection(*(set(other) for other in gathered))
    return [buffer for (name, buffer), entry in zip(named, entries, strict=True) if entry in common]
