"""The memory estimate as a table: :func:`format_estimate_table` varies the sharding strategy, CPU offload and
activation checkpointing over :func:`~lightning_shard.memory.estimate.estimate_memory` (as DeepSpeed's estimator
prints), for ``lightning-shard estimate`` and ``lightning_shard.format_estimate_table``.

Takes a model (or its parameter count) and the estimate's other options; gives the table as text.
"""

from typing import Any

from torch import nn

from lightning_shard.memory.estimate import SHARDING_STRATEGIES, estimate_memory

GIB = 2**30


def format_estimate_table(model: nn.Module | int, **options: Any) -> str:
    """A DeepSpeed-estimator-style table: one row per sharding strategy × offload × activation checkpointing.

    ``options`` go to :func:`estimate_memory` (``world_size``, ``precision``, dims, ...), except the three varied here.

    Example:
        >>> print(format_estimate_table(1_000_000_000, world_size=8, largest_unit_params=0).splitlines()[2])
           FULL_SHARD    False     False             1.86          0.00
    """
    header = f"{'sharding':>13}  {'offload':>7}  {'act ckpt':>8}  {'device GiB/rank':>15}  {'CPU GiB/rank':>12}"
    lines = [header, "-" * len(header)]
    for strategy in SHARDING_STRATEGIES:
        for offload in (False, True):
            for checkpointing in (False, True):
                estimate = estimate_memory(
                    model,
                    **options,
                    sharding_strategy=strategy,
                    cpu_offload=offload,
                    activation_checkpointing=checkpointing,
                )
                lines.append(
                    f"{strategy:>13}  {offload!s:>7}  {checkpointing!s:>8}  "
                    f"{estimate.device.total_bytes / GIB:>15.2f}  {estimate.cpu.total_bytes / GIB:>12.2f}"
                )
    return "\n".join(lines)
