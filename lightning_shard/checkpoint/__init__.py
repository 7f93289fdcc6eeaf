"""Checkpoints: ``ShardedCheckpointIO`` writes and reads sharded (torch.distributed.checkpoint) directories and full
(one ``torch.save`` file) checkpoints, checked before loading; conversion and inspection for ``lightning-shard``.

Which module does what:

* the plugin: :mod:`.io` (``ShardedCheckpointIO``: orders the steps below); :mod:`.layout` (where a checkpoint keeps
  the weights, optimizer states and averaged copies: Trainer or Fabric); :mod:`.ranks` (process-group helpers).
* save path: :mod:`.save` (the target check, the payload DCP writes, rank 0's actions); :mod:`.writer` (the
  checksummed DCP writer and the full-file writer); :mod:`.save_errors` (why and where a save failed, on every rank).
* async: :mod:`.async_save` (background saves, published by rank 0; loads wait for them).
* publish / atomicity: :mod:`.publish` (staging folder, rename into place, interrupted publishes put back);
  :mod:`.target` (what a save may replace).
* load path: :mod:`.load` (into the sharded model, optimizers and averaged copies); :mod:`.unit_load` (a full file
  broadcast by rank 0, one FSDP unit at a time).
* reading: :mod:`.read` (what a path holds, a sharded checkpoint's entries read whole, its recorded layout);
  :mod:`.reader` (the DCP reader that reads each tensor in place).
* integrity / checksums: :mod:`.integrity` (checks before a load, agreed by every rank); :mod:`.checksums` (per
  item and per file); :mod:`.record_names` (which tensor a damaged zip record holds).
* extra state: :mod:`.extra_state` (entries beside the model and optimizers, DTensors and per-rank values kept).
* optimizer state: :mod:`.optimizer_state` (parameters that had no state when saved).
* averaged copies: :mod:`.averaged` (which entry holds one, its weights under the model's names).
* conversion: :mod:`.convert` (sharded <-> full, and ``inspect``); :mod:`.model_parallel` (checkpoints of
  Lightning's ``ModelParallelStrategy``).
"""

from lightning_shard.checkpoint.convert import convert, inspect
from lightning_shard.checkpoint.integrity import CheckpointIntegrityError
from lightning_shard.checkpoint.io import ShardedCheckpointIO
from lightning_shard.checkpoint.read import is_sharded_checkpoint, read_sharded_keys

__all__ = [
    "CheckpointIntegrityError",
    "ShardedCheckpointIO",
    "convert",
    "inspect",
    "is_sharded_checkpoint",
    "read_sharded_keys",
]
