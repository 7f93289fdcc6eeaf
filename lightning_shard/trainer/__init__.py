"""The Trainer adapter: ``ShardedStrategy`` for ``lightning.pytorch``, its launcher, preemption callback and
checkpoint callback, over the shared core (:mod:`lightning_shard.core`)."""
