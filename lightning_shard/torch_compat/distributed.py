"""torch.distributed's process groups, device meshes and DTensors: a group's timeout, a mesh's dimensions
flattened into one, and this rank's chunk of a DTensor.

Takes groups, meshes and DTensors; gives what they hold without a public getter.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout of a group's CPU backend (torch has no public getter); ``None`` if it cannot tell.

    Example:
        >>> group_timeout(dist.group.WORLD)  # doctest: +SKIP
        datetime.timedelta(seconds=1800)
    """
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def flatten_mesh_dims(mesh: Any, dims: tuple[str, ...], name: str) -> None:
    """Make ``mesh[name]`` the 1-D mesh over the dimensions ``dims`` together (``DeviceMesh._flatten``; torch has no
    public name for it): the strategy's ``"data_parallel"``, as Lightning's ``ModelParallelStrategy`` names it.

    Example:
        >>> flatten_mesh_dims(mesh, ("replicate", "shard"), "data_parallel")  # doctest: +SKIP
        >>> mesh["data_parallel"].size()  # doctest: +SKIP
        4
    """
    mesh[dims]._flatten(name)


def local_chunk(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of this rank's part of a DTensor in the global tensor: the chunk DCP saves and loads
    for it (``DTensor.__create_chunk_list__``).

    Example:
        >>> local_chunk(sharded_weight)  # doctest: +SKIP
        ((4, 0), (4, 8))
    """
    (chunk,) = dtensor.__create_chunk_list__()
    return tuple(chunk.offsets), tuple(chunk.sizes)
