"""Process-group helpers for checkpoint code that also runs without a process group (conversion, one-process loads):
then there is one rank, 0, and nothing to wait for or send."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized


def rank() -> int:
    """This process's rank, 0 without a process group.

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if _distributed_is_initialized() else 0


def world_size() -> int:
    """The number of ranks, 1 without a process group."""
    return dist.get_world_size() if _distributed_is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    if _distributed_is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (default: all; pickled); ``obj`` itself without a process group.

    Example:
        >>> broadcast_object({"step": 3})
        {'step': 3}
    """
    if not _distributed_is_initialized() or dist.get_world_size(group) == 1:
        return obj  # rank 0 keeps its own object in a broadcast too
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def all_gathered(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` of ``group`` (default: all; pickled), in rank order; ``[obj]`` without a process group.

    Example:
        >>> all_gathered({"unset": []})
        [{'unset': []}]
    """
    if not _distributed_is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
