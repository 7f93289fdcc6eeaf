"""lightning-shard for Lightning Fabric: ``Fabric(strategy="fully_sharded")`` on the same core as the Trainer's.

Importing ``lightning_shard`` registers the strategy names with Fabric's registry too:

    >>> import lightning as L
    >>> import lightning_shard  # noqa: F401
    >>> fabric = L.Fabric(strategy="fully_sharded", accelerator="cpu", devices=2)  # doctest: +SKIP

``ShardedAveragedModel`` keeps an averaged copy (EMA, SWA) of the sharded model for a Fabric loop (see
:mod:`lightning_shard.averaging`).
"""

from lightning_shard.averaging import ShardedAveragedModel
from lightning_shard.fabric.precision import ShardedPrecision
from lightning_shard.fabric.strategy import ShardedStrategy

__all__ = ["ShardedAveragedModel", "ShardedPrecision", "ShardedStrategy"]
