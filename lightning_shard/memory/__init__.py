"""Per-rank memory: measure it during a fit (``ShardedMemoryMonitor``) and estimate it before one."""

from lightning_shard.memory.callback import ShardedMemoryMonitor

__all__ = ["ShardedMemoryMonitor"]
