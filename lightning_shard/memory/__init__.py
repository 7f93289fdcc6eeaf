"""Per-rank memory: measure it during a fit (``ShardedMemoryMonitor``), estimate it before one (formula or
simulation), and let the estimate choose the sharding (``sharding_strategy="auto"``)."""

from lightning_shard.memory.auto_sharding import choose_sharding
from lightning_shard.memory.breakdown import MemoryBreakdown, MemoryEstimate
from lightning_shard.memory.callback import ShardedMemoryMonitor
from lightning_shard.memory.estimate import estimate_memory
from lightning_shard.memory.estimate_cli import estimate_main
from lightning_shard.memory.estimate_table import format_estimate_table

__all__ = [
    "MemoryBreakdown",
    "MemoryEstimate",
    "ShardedMemoryMonitor",
    "choose_sharding",
    "estimate_main",
    "estimate_memory",
    "format_estimate_table",
]
