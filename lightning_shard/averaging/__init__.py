"""Weight averaging (EMA, SWA) for sharded models: the averaged copy kept as fp32 shards beside the parameters.

* :class:`ShardedAveragedModel` - torch's ``AveragedModel`` for a sharded model; the Fabric form.
* :mod:`~lightning_shard.averaging.callbacks` - Lightning's ``WeightAveraging`` / ``EMAWeightAveraging`` callbacks
  given that copy by the Trainer strategy, so ``callbacks=[EMAWeightAveraging()]`` works as written.
"""

from lightning_shard.averaging.averaged_model import ShardedAveragedModel

__all__ = ["ShardedAveragedModel"]
