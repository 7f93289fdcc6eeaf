"""Fabric's ``state`` dict and the checkpoint machinery: which entry is the sharded model, which are optimizers and
averaged copies (:class:`~lightning_shard.averaging.ShardedAveragedModel`), what the rest becomes on save and where
it goes on load.

``fabric.save(path, {"model": model, "optimizer": optimizer, "ema": ema, "step": 3})`` writes the model's, the
optimizer's and the averaged copy's states under their keys (sharded as DCP tensors, or gathered into one file) and
everything else whole; the
checkpoint records that layout (:class:`~lightning_shard.checkpoint.layout.StateLayout`), so the Trainer strategy
finds the weights in it too, and a Trainer checkpoint's ``state_dict`` / ``optimizer_states`` load into a Fabric
``state``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_shard.averaging import ShardedAveragedModel
from lightning_shard.checkpoint.io import ShardedCheckpointIO
from lightning_shard.checkpoint.layout import LAYOUT_KEY, WORLD_SIZE_KEY, StateLayout


def sharded_model(state: Mapping[str, Any], action: str) -> tuple[str, nn.Module]:
    """The key and module of the one sharded model in ``state``.

    Raises:
        ValueError: none, or more than one (a checkpoint holds one sharded model).
    """
    found = [(key, value) for key, value in state.items() if isinstance(value, FSDPModule)]
    if len(found) != 1:
        what = "no model set up" if not found else f"{len(found)} sharded models ({[key for key, _ in found]})"
        raise ValueError(
            f"`fabric.{action}(path, state)` needs the one model set up by `fabric.setup` in `state`, e.g. "
            f"`{{'model': model, 'optimizer': optimizer}}`; it holds {what}. Save or load each model on its own path."
        )
    return found[0]


def layout_of(
    state: Mapping[str, Any], action: str
) -> tuple[nn.Module, dict[str, Optimizer], dict[str, ShardedAveragedModel], StateLayout]:
    """The sharded model, the optimizers and the averaged copies by key, and the checkpoint layout they make."""
    model_key, model = sharded_model(state, action)
    optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
    averaged = {key: value for key, value in state.items() if isinstance(value, ShardedAveragedModel)}
    return model, optimizers, averaged, StateLayout(model_key, tuple(optimizers), tuple(averaged))


def checkpoint_from_state(
    state: Mapping[str, Any],
    io: ShardedCheckpointIO,
    full: bool,
    filter: Mapping[str, Callable[[str, Any], bool]] | None = None,
) -> tuple[dict[str, Any], StateLayout]:
    """The checkpoint dict to write for ``state``: the model's and optimizers' state dicts (their shards, or gathered
    to rank 0 when ``full``), ``state_dict()`` of other stateful objects, the rest as it is; ``filter`` as Fabric's.

    Example:
        >>> checkpoint, layout = checkpoint_from_state({"model": model, "step": 3}, io, full=False)  # doctest: +SKIP
    """
    model, _, _, layout = layout_of(state, "save")
    checkpoint: dict[str, Any] = {}
    for key, value in state.items():
        if value is model:
            converted = io.model_state(model, full=full)
        elif isinstance(value, Optimizer):
            converted = io.optimizer_state(model, value, full=full)
        elif isinstance(value, ShardedAveragedModel):
            converted = io.model_state(value, full=full)
        elif isinstance(value, _Stateful):
            converted = value.state_dict()
        else:
            converted = value
        _apply_filter(key, dict(filter or {}), converted, checkpoint)
    return checkpoint, layout


def restore_rest(state: dict[str, Any], rest: dict[str, Any], layout: StateLayout, strict: bool) -> dict[str, Any]:
    """Put the loaded entries ``state`` asks for (besides the model and optimizers) into it - ``load_state_dict``
    for stateful objects, replaced otherwise - and return what it did not ask for, as Fabric does."""
    for bookkeeping in (LAYOUT_KEY, WORLD_SIZE_KEY):
        rest.pop(bookkeeping, None)
    requested = set(state) - layout.tensor_keys()
    _validate_keys_for_strict_loading(requested, rest.keys(), strict=strict)
    _move_state_into(source=rest, destination=state, keys=requested)
    return rest
