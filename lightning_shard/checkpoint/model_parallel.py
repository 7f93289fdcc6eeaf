"""Sharded checkpoints written by Lightning's own ``ModelParallelStrategy``, for a run moving to this strategy.

Lightning writes them as a torch.distributed.checkpoint directory holding the model's state dict under
``"state_dict"`` and each optimizer's (keyed by parameter names, as here) under ``"optimizer_0"``, ``"optimizer_1"``,
..., and the rest of the Trainer's checkpoint (loops, callbacks, schedulers, ...) in a ``meta.pt`` file beside the
shards, written by rank 0 with ``torch.save``. TP-split or not, the tensors are saved whole-tensor-addressed, so they
load at any mesh shape.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_shard.checkpoint.layout import StateLayout

# Lightning's `_METADATA_FILENAME` (lightning.fabric.strategies.fsdp / model_parallel).
LIGHTNING_META_FILE = "meta.pt"
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")


def model_parallel_layout(path: str | Path, metadata: Metadata) -> StateLayout | None:
    """The layout of a ModelParallelStrategy checkpoint at ``path``, or None if it is not one.

    Example:
        >>> model_parallel_layout("out/last.ckpt", metadata)  # doctest: +SKIP
        StateLayout(model='state_dict', optimizers=('optimizer_0',))
    """
    if not (Path(path) / LIGHTNING_META_FILE).is_file():
        return None
    tops = {(metadata.planner_data or {}).get(key, (key,))[0] for key in metadata.state_dict_metadata}
    if "state_dict" not in tops:
        return None
    optimizers = sorted((key for key in tops if _OPTIMIZER_KEY.fullmatch(str(key))), key=lambda k: int(k[10:]))
    return StateLayout("state_dict", tuple(optimizers))


def with_model_parallel_entries(path: str | Path, rest: dict[str, Any]) -> dict[str, Any]:
    """``rest`` of a loaded ModelParallelStrategy checkpoint with the entries Lightning kept in ``meta.pt``.

    Example:
        >>> with_model_parallel_entries("out/last.ckpt", {})["global_step"]  # doctest: +SKIP
        200
    """
    entries = torch.load(Path(path) / LIGHTNING_META_FILE, map_location="cpu", weights_only=False)
    return {**entries, **rest}
