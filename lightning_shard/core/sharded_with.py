"""What a model was sharded with, so that a later run on the same model cannot silently ignore its own settings.

Sharding changes the model in place (FSDP units, checkpoint wrappers, the stored dtype of its parameters), and a
second ``Trainer`` or ``Fabric`` handed the same model keeps that sharding: a sharded model cannot be sharded again.
Its settings for the plan - precision, wrapping, activation checkpointing, compile, offload, tensor parallelism - would
then be ignored without a word (Trainer 2 asking for ``bf16-mixed`` and activation checkpointing would compute in
fp32 without checkpoint wrappers). So the first sharding records its settings on the model
(:func:`record_sharding`), and a later run compares its own with them (:func:`check_same_sharding`): the same
settings go on with the sharded model, other ones stop the run before any work, naming each difference. The settings
a run applies by itself each time (checkpoint format, gradient accumulation, ``activation_memory_budget``,
preemption, ...) may differ.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_shard.plan.config import ShardingConfig

# The ShardingConfig fields a run applies to the model itself, not to the sharded plan.
_PER_RUN = frozenset(
    {"state_dict_type", "gradient_accumulation", "save_frozen_pretrained_weights", "activation_memory_budget"}
)
# "auto" sharding chooses these when the model is sharded.
_CHOSEN = ("sharding_strategy", "cpu_offload")
_RECORD = "_lightning_shard_sharded_with"


@dataclass(frozen=True)
class ShardedWith:
    """The settings a model was sharded with: the configuration as requested and as applied ("auto" resolved), and
    the precision (its name and the gradient-reduction dtype)."""

    requested: ShardingConfig
    applied: ShardingConfig
    precision: str
    reduce_dtype: torch.dtype | None
    mesh: DeviceMesh | None = None


def record_sharding(
    model: nn.Module, requested: ShardingConfig, applied: ShardingConfig, precision: Any, mesh: DeviceMesh | None
) -> None:
    """Remember on ``model`` what it was sharded with (``precision``: the strategy's precision plugin) and on which
    mesh.

    Example:
        >>> record_sharding(model, requested, strategy.config, strategy.precision_plugin, mesh)  # doctest: +SKIP
    """
    setattr(model, _RECORD, ShardedWith(requested, applied, precision.precision, precision.reduce_dtype, mesh))


def sharded_mesh(model: nn.Module | None) -> DeviceMesh | None:
    """The mesh ``model`` was sharded on, if the strategy sharded it: a later run computes on it rather than on a
    mesh of its own, whose process groups (2-D meshes) would be created again for every run.

    Example:
        >>> sharded_mesh(nn.Linear(2, 2)) is None
        True
    """
    record: ShardedWith | None = getattr(model, _RECORD, None)
    return record.mesh if record is not None else None


def check_same_sharding(model: nn.Module, config: ShardingConfig, precision: Any) -> ShardingConfig:
    """For a run given ``model`` sharded already: ``config`` with the sharding the model has ("auto" choices
    included), when its plan settings and ``precision`` are those it was sharded with.

    Raises:
        ValueError: a setting differs, naming each one with both values, before any work.

    Example:
        >>> strategy.config = check_same_sharding(model, strategy.config, strategy.precision_plugin)  # doctest: +SKIP
    """
    record: ShardedWith | None = getattr(model, _RECORD, None)
    if record is None:
        return config  # sharded by the user's own code, which the strategy keeps as it is
    differences = [
        f"{field.name}={getattr(config, field.name)!r} (sharded with {getattr(record.requested, field.name)!r})"
        for field in fields(ShardingConfig)
        if field.name not in _PER_RUN and not _same_setting(field.name, config, record)
    ]
    if precision.precision != record.precision:
        differences.append(f"precision={precision.precision!r} (sharded with {record.precision!r})")
    if precision.reduce_dtype != record.reduce_dtype:
        differences.append(f"reduce_dtype={precision.reduce_dtype} (sharded with {record.reduce_dtype})")
    if differences:
        name = type(model).__name__.removeprefix("FSDP") if isinstance(model, FSDPModule) else type(model).__name__
        raise ValueError(
            f"{name} was sharded by an earlier run with other settings, and a sharded model cannot be "
            f"sharded again: this run asks for {', '.join(differences)}. Give this run the settings of the first, or "
            "build a new model for it (a new LightningModule, or the model built again) to shard with these."
        )
    return replace(config, **{name: getattr(record.applied, name) for name in _CHOSEN})


def _same_setting(name: str, config: ShardingConfig, record: ShardedWith) -> bool:
    value = _comparable(getattr(config, name))
    if name in _CHOSEN and value == _comparable(getattr(record.applied, name)):
        return True  # asking for what "auto" chose
    return value == _comparable(getattr(record.requested, name))


def _comparable(value: Any) -> Any:
    """Policies built again in a new run compare equal: callables by where they are defined, collections by
    their members."""
    if isinstance(value, (set, frozenset, list, tuple)):
        return tuple(sorted((_comparable(item) for item in value), key=repr))
    if isinstance(value, dict):
        return tuple(sorted(((key, _comparable(item)) for key, item in value.items()), key=repr))
    if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        return (getattr(value, "__module__", None), value.__qualname__)
    return value
