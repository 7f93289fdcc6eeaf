"""Per-rank memory: measure it during a fit (``ShardedMemoryMonitor``) and estimate it before one."""

from lightning_shard.memory.callback import ShardedMemoryMonitor
from lightning_shard.memory.estimate import MemoryBreakdown, MemoryEstimate, estimate_memory, format_estimate_table
from lightning_shard.memory.estimate_cli import estimate_main

__all__ = [
    "MemoryBreakdown",
    "MemoryEstimate",
    "ShardedMemoryMonitor",
    "estimate_main",
    "estimate_memory",
    "format_estimate_table",
]
