"""A rank's shard of a full-size tensor, cut on the host: materialisation never puts a whole tensor on the GPU.

The replay computes each tensor whole on the CPU (:mod:`lightning_shard.init.replay`). ``distribute_tensor`` would move
that whole tensor to the mesh's device first (on CUDA a full-size device copy, per rank, of the largest tensor: the
embedding of a 70B model is 2 GiB in fp32) and split it there; here each rank slices its chunk on the host and copies
only that to its shard, whatever the placements (the chunk DCP reads and writes for the DTensor).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from lightning_shard.torch_compat.distributed import local_chunk


def host_shard(full: torch.Tensor, live: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` (the whole tensor, on the host) for the DTensor ``live``: a view of ``full``.

    Example:
        >>> live.to_local().copy_(host_shard(full, live))  # doctest: +SKIP
    """
    offsets, sizes = local_chunk(live)
    return full[tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes, strict=True))]
