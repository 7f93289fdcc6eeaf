"""lightning-shard: Fully Sharded Data Parallel (FSDP2) training for PyTorch Lightning.

Importing the package registers the strategy names with the Trainer's and Fabric's registries, so this is all a
user needs:

    >>> import lightning as L
    >>> import lightning_shard  # noqa: F401
    >>> trainer = L.Trainer(strategy="fully_sharded", accelerator="cpu", devices=2)  # doctest: +SKIP
    >>> fabric = L.Fabric(strategy="fully_sharded", accelerator="cpu", devices=2)  # doctest: +SKIP

The standalone packages ``pytorch_lightning`` and ``lightning_fabric`` get the same (see
:mod:`lightning_shard.standalone_packages`): ``pl.Trainer(strategy="fully_sharded")``, and the classes under
``lightning_shard.standalone`` (``lightning_shard.standalone.ShardedStrategy``, ``...ShardedMemoryMonitor``, ...).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_shard import fabric, hf  # `lightning_shard.hf.from_pretrained(...)`; transformers stays unimported
from lightning_shard.averaging import ShardedAveragedModel
from lightning_shard.checkpoint import CheckpointIntegrityError, ShardedCheckpointIO, is_sharded_checkpoint
from lightning_shard.core.preemption import PREEMPTED_EXIT_CODE
from lightning_shard.memory import (
    MemoryBreakdown,
    MemoryEstimate,
    ShardedMemoryMonitor,
    estimate_memory,
    format_estimate_table,
)
from lightning_shard.plan.config import ShardingConfig
from lightning_shard.plan.precision import ShardedPrecision
from lightning_shard.standalone_packages import load_when_imported
from lightning_shard.trainer.preemption import PreemptionCheckpoint
from lightning_shard.trainer.strategy import ShardedStrategy

ShardedStrategy.register_strategies(StrategyRegistry)
fabric.ShardedStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CheckpointIntegrityError",
    "MemoryBreakdown",
    "MemoryEstimate",
    "PreemptionCheckpoint",
    "ShardedAveragedModel",
    "ShardedCheckpointIO",
    "ShardedMemoryMonitor",
    "ShardedPrecision",
    "ShardedStrategy",
    "ShardingConfig",
    "estimate_memory",
    "fabric",
    "format_estimate_table",
    "hf",
    "is_sharded_checkpoint",
]

# `lightning_shard.standalone`: the same classes for `pytorch_lightning` and `lightning_fabric`, registered with them
# when either is imported (before or after this package). Last: it reads this namespace.
load_when_imported()
