"""A rank's part of a tensor: its shard of a full-size tensor, cut on the host (:func:`host_shard`: materialisation
never puts a whole tensor on the GPU), and what it holds of a live tensor (:func:`local`).

The replay computes each tensor whole on the CPU (:mod:`lightning_shard.init.replay`). ``distribute_tensor`` would move
that whole tensor to the mesh's device first (on CUDA a full-size device copy, per rank, of the largest tensor: the
embedding of a 70B model is 2 GiB in fp32) and split it there; here each rank slices its chunk on the host and copies
only that to its shard, whatever the placements (the chunk DCP reads and writes for the DTensor).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from lightning_shard.torch_compat.distributed import local_chunk


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, a plain tensor whole.

    Example:
        >>> weight = torch.zeros(2); local(weight) is weight
        True
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def host_shard(full: torch.Tensor, live: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` (the whole tensor, on the host) for the DTensor ``live``: a view of ``full``.

    Example:
        >>> live.to_local().copy_(host_shard(full, live))  # doctest: +SKIP
    """
    offsets, sizes = local_chunk(live)
    return full[tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes, strict=True))]
