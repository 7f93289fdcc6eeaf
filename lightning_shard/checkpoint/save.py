"""The save path's steps before and around the write, for both formats, on every rank.

* :func:`check_target`: rank 0 looks at what the path holds and every rank refuses alike what may not be replaced
  (:mod:`~lightning_shard.checkpoint.target`).
* :func:`sharded_payload`: takes a checkpoint dict and its :class:`~lightning_shard.checkpoint.layout.StateLayout`,
  gives what ``dcp.save`` writes: the weights and optimizer states (and the extra state's tensors) as DCP tensors,
  everything else as one pickled object per key (:class:`_Pickled`), the layout and the world size recorded.
* :func:`recorded`: a checkpoint with its layout recorded (what a full file holds).
* :func:`by_rank_zero`: an action (writing, publishing) run by rank 0, its error raised on every rank.

Example:
    >>> holds_shards({"state_dict": {"w": torch.zeros(2)}})
    False
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.extra_state import EXTRA_KEY, encode_extra
from lightning_shard.checkpoint.layout import LAYOUT_KEY, MODEL_KEY, WORLD_SIZE_KEY, StateLayout
from lightning_shard.checkpoint.publish import clean_leftovers
from lightning_shard.checkpoint.ranks import broadcast_object, rank, world_size
from lightning_shard.checkpoint.target import Target


def holds_shards(checkpoint: dict[str, Any]) -> bool:
    """Whether the Trainer's ``checkpoint`` holds the model's DTensor shards (a sharded save) rather than whole
    tensors gathered to rank 0 (a full one)."""
    return any(isinstance(value, DTensor) for value in checkpoint.get(MODEL_KEY, {}).values())


def check_target(path: Path) -> None:
    """Rank 0 looks at what ``path`` holds (after putting back a checkpoint an interrupted publish moved aside);
    every rank raises the same refusal if it may not be replaced."""
    target = broadcast_object(_target_here(path) if rank() == 0 else None)
    target.check_replaceable(path)


def _target_here(path: Path) -> Target:
    clean_leftovers(path)
    return Target.at(path)


def sharded_payload(checkpoint: dict[str, Any], layout: StateLayout) -> dict[str, Any]:
    """What ``dcp.save`` writes for ``checkpoint``: the trees of tensors (and bytes) ``layout`` names, which DCP
    flattens and shards, and everything else kept whole; call on every rank (the extra state is compared across
    ranks)."""
    checkpoint = encode_extra(checkpoint, layout.tensor_keys(), full=False)
    tensor_keys = layout.tensor_keys() | {EXTRA_KEY}  # trees of tensors and bytes, which DCP flattens
    payload = {
        key: value if key in tensor_keys else _opaque(value) for key, value in recorded(checkpoint, layout).items()
    }
    payload[WORLD_SIZE_KEY] = world_size()
    return payload


def recorded(checkpoint: dict[str, Any], layout: StateLayout) -> dict[str, Any]:
    """``checkpoint`` with its layout recorded, unless it is the Trainer's."""
    return checkpoint if layout.is_trainer else {**checkpoint, LAYOUT_KEY: layout.record()}


def by_rank_zero(action: Callable[[], None]) -> None:
    """Run ``action`` (writing, publishing) on rank 0; every rank returns once it is done, or raises: rank 0 its own
    error, the others a :class:`CheckpointIntegrityError` quoting it (none is left waiting at a barrier)."""
    error = None
    if rank() == 0:
        try:
            action()
        except Exception as caught:
            error = caught
    try:
        integrity.agree(error)
    except integrity.CheckpointIntegrityError:
        if error is not None:
            raise error from None
        raise


class _Pickled:
    """A value DCP stores as one pickled object instead of flattening it into leaves.

    DCP's flattening drops empty containers (a ``LambdaLR``'s ``lr_lambdas: [{}]``, a callback's ``{}``), which
    Lightning then misses on restore. It unpickles through ``pickle.loads`` to the original object, so neither
    ``dcp_to_torch_save`` nor a reader needs lightning_shard.

    The value is pickled when the save starts: a background save writes the state of that moment, and DCP's async
    staging, which deep-copies the state dict, copies this snapshot as it is (a deep copy through ``__reduce__``
    would hand DCP the unwrapped value to flatten).
    """

    def __init__(self, value: Any) -> None:
        self.data = pickle.dumps(value)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.data,)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Pickled:
        return self  # immutable


def _opaque(value: Any) -> Any:
    """Everything but the model and optimizer states (which DCP shards) is kept whole."""
    return value if isinstance(value, (torch.Tensor, str, int, float, bool, type(None))) else _Pickled(value)
