"""What the estimator and the simulator both read off a model: its wrap units, parameter counts and the mesh."""

from torch import nn

from lightning_shard.config import ShardingConfig


def wrap_units(module: nn.Module) -> list[nn.Module]:
    """The blocks a default wrap policy shards as units: the children of ``ModuleList`` / ``Sequential`` containers."""
    return [
        child
        for container in module.modules()
        if isinstance(container, (nn.ModuleList, nn.Sequential))
        for child in container.children()
        if any(True for _ in child.parameters())
    ]


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """``(total, largest unit)`` parameter counts; tied parameters count once, the root unit holds what no block does.

    Example:
        >>> count_parameters(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        (30, 20)
    """
    # module.parameters() yields a tied parameter once.
    total = sum(p.numel() for p in module.parameters())
    units = wrap_units(module)
    unit_sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_units)
    return total, max([root, *unit_sizes])


def mesh_shape(sharding_strategy: str, world_size: int, num_nodes: int) -> tuple[int, ...]:
    """The strategy's data-parallel mesh for ``world_size`` ranks on ``num_nodes`` nodes (one node = one shard group).

    Example:
        >>> mesh_shape("HYBRID_SHARD", world_size=8, num_nodes=2)
        (2, 4)
    """
    config = ShardingConfig(sharding_strategy=sharding_strategy)  # type: ignore[arg-type]
    return config.mesh_shape(world_size, devices_per_node=world_size // num_nodes)
