"""Checkpoints: ``ShardedCheckpointIO`` (sharded torch.distributed.checkpoint directories and full files), the
integrity checks run before loading, and conversion / inspection for the ``lightning-shard`` command."""

from lightning_shard.checkpoint.convert import convert, inspect
from lightning_shard.checkpoint.integrity import CheckpointIntegrityError
from lightning_shard.checkpoint.io import ShardedCheckpointIO, is_sharded_checkpoint, read_sharded_keys

__all__ = [
    "CheckpointIntegrityError",
    "ShardedCheckpointIO",
    "convert",
    "inspect",
    "is_sharded_checkpoint",
    "read_sharded_keys",
]
