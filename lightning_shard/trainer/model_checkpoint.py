"""Lightning's checkpoint callbacks under the publishing rules of :mod:`~lightning_shard.checkpoint.publish`.

* ``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a link to the checkpoint it has just saved. Lightning
  removes what is at ``last.ckpt`` (a directory with ``shutil.rmtree``), then links, at once: under ``async_save``
  the link would point at a checkpoint still being written (dangling if the job dies first). Here the link goes
  through :meth:`ShardedCheckpointIO.link`: made once the target is published, in one rename, replacing only a link
  or a checkpoint of this package.
* Lightning looks for the checkpoints to resume from (``ckpt_path="last"``, SLURM's ``hpc`` numbering) by listing
  the folders before the strategy does anything: a checkpoint that a publish without ``RENAME_EXCHANGE`` had moved
  aside when a kill interrupted it is put back before that (:func:`restore_checkpoint_folders`, run at launch).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard.checkpoint.io import ShardedCheckpointIO
from lightning_shard.checkpoint.publish import restore_interrupted_in
from lightning_shard.core.undo import UndoLog

if TYPE_CHECKING:
    import lightning.pytorch as pl


def link_when_published(callbacks: Iterable[Any], io: ShardedCheckpointIO, undo_log: UndoLog) -> None:
    """Make the ``ModelCheckpoint`` among ``callbacks`` link ``last`` through ``io`` (see module docstring) for this
    run: ``undo_log`` takes the change back, so that the callback handed to another Trainer links as Lightning does.

    Example:
        >>> link_when_published(trainer.checkpoint_callbacks, trainer.strategy.checkpoint_io,
        ...                     trainer.strategy.undo_log)  # doctest: +SKIP
    """
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint):
            # ModelCheckpoint calls `self._link_checkpoint(trainer, filepath, linkpath)`, a staticmethod: the
            # instance's attribute takes its place.
            undo_log.set_attribute(callback, "_link_checkpoint", functools.partial(_link, io))


def _link(io: ShardedCheckpointIO, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        io.link(filepath, linkpath)
    trainer.strategy.barrier()


def restore_checkpoint_folders(trainer: pl.Trainer) -> list[Path]:
    """Put back the checkpoints that interrupted publishes moved aside in the folders Lightning scans for checkpoints
    (``default_root_dir`` and every checkpoint callback's ``dirpath``); the paths restored. Safe on every process.

    Example:
        >>> restore_checkpoint_folders(trainer)  # doctest: +SKIP
        [PosixPath('ckpts/last.ckpt')]
    """
    folders = {trainer.default_root_dir, *(getattr(callback, "dirpath", None) for callback in trainer.callbacks)}
    return [path for folder in sorted(str(f) for f in folders if f) for path in restore_interrupted_in(Path(folder))]
