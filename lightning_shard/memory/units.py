"""What the estimator and the simulator both read off a model and its settings: its wrap units, parameter counts, the
mesh and the activation checkpointing mode."""

from collections.abc import Collection
from typing import NamedTuple

from torch import nn

from lightning_shard.plan.config import ShardingConfig
from lightning_shard.plan.replicated import unshardable_parameters


def wrap_units(module: nn.Module) -> list[nn.Module]:
    """The blocks a default wrap policy shards as units: the children of ``ModuleList`` / ``Sequential`` containers."""
    return [
        child
        for container in module.modules()
        if isinstance(container, (nn.ModuleList, nn.Sequential))
        for child in container.children()
        if any(True for _ in child.parameters())
    ]


class ParameterCounts(NamedTuple):
    """Parameters of a model and of its largest wrap unit, all of them and those that train (``requires_grad``)."""

    total: int
    largest_unit: int
    trainable: int
    largest_unit_trainable: int


def count_parameters(module: nn.Module, split: Collection[int] = (), tensor_parallel_size: int = 1) -> ParameterCounts:
    """Parameter counts of ``module``; tied parameters count once, the root unit holds what no block does.

    Frozen parameters (``requires_grad=False``, e.g. the base of a LoRA model) are in ``total`` and ``largest_unit``
    only: they are stored and gathered, but have no gradient and no optimizer state. ``largest_unit_trainable`` is the
    most trainable parameters of one unit: the size of the largest reduce-scatter. Under tensor parallelism the counts
    are one tensor-parallel rank's: the parameters in ``split`` (ids) count ``1 / tensor_parallel_size`` of theirs.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> model[0].requires_grad_(False)
        Linear(in_features=4, out_features=4, bias=True)
        >>> count_parameters(model)
        ParameterCounts(total=30, largest_unit=20, trainable=10, largest_unit_trainable=10)
    """
    split = set(split)

    def numel(param: nn.Parameter) -> int:
        return -(-param.numel() // tensor_parallel_size) if id(param) in split else param.numel()

    units = wrap_units(module)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    # module.parameters() yields a tied parameter once.
    groups = [list(unit.parameters()) for unit in units] + [[p for p in module.parameters() if id(p) not in in_units]]
    sizes = [sum(numel(p) for p in group) for group in groups]
    trainable_sizes = [sum(numel(p) for p in group if p.requires_grad) for group in groups]
    return ParameterCounts(
        total=sum(numel(p) for p in module.parameters()),
        largest_unit=max(sizes),
        trainable=sum(numel(p) for p in module.parameters() if p.requires_grad),
        largest_unit_trainable=max(trainable_sizes),
    )


def replicated_parameter_counts(module: nn.Module) -> tuple[int, int]:
    """``(all, trainable)`` elements of the parameters kept whole on every rank because ``fully_shard`` cannot shard
    them (0-d, non-contiguous; see :mod:`lightning_shard.plan.replicated`).

    Example:
        >>> import torch
        >>> model = nn.Linear(2, 2)
        >>> model.scale = nn.Parameter(torch.tensor(1.0))
        >>> replicated_parameter_counts(model)
        (1, 1)
    """
    params = [param for _, param in unshardable_parameters(module)]
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def mesh_shape(
    sharding_strategy: str, world_size: int, num_nodes: int, tensor_parallel_size: int = 1
) -> tuple[int, ...]:
    """The strategy's data-parallel mesh for ``world_size`` ranks on ``num_nodes`` nodes (one node = one shard group),
    ``tensor_parallel_size`` of them computing on the same data.

    Example:
        >>> mesh_shape("HYBRID_SHARD", world_size=8, num_nodes=2)
        (2, 4)
        >>> mesh_shape("HYBRID_SHARD", world_size=16, num_nodes=2, tensor_parallel_size=4)
        (2, 2)
    """
    config = ShardingConfig(sharding_strategy=sharding_strategy, tensor_parallel_size=tensor_parallel_size)  # type: ignore[arg-type]
    return config.mesh_shape(world_size, devices_per_node=world_size // num_nodes)


def checkpointing_mode(activation_checkpointing: bool | str | None) -> str:
    """``"none"``, ``"full"`` or ``"selective"`` for the estimator's ``activation_checkpointing`` (a bool: none or
    full).

    Example:
        >>> checkpointing_mode(True), checkpointing_mode("selective")
        ('full', 'selective')
    """
    if activation_checkpointing in (False, None, "none"):
        return "none"
    if activation_checkpointing in (True, "full"):
        return "full"
    if activation_checkpointing == "selective":
        return "selective"
    raise ValueError(
        f"activation_checkpointing must be a bool, 'none', 'full' or 'selective', got {activation_checkpointing!r}"
    )
