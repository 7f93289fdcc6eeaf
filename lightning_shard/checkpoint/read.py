"""Reading a checkpoint without a model: what a path holds, and a sharded checkpoint's entries read whole.

* :func:`is_sharded_checkpoint`: takes a path, gives whether it is a torch.distributed.checkpoint directory.
* :func:`locate`: takes a path, gives it and whether it is a directory (sharded) or a file, as rank 0 sees it once the
  saves in flight are published; call on every rank.
* :func:`read_sharded_keys`: takes a sharded checkpoint and keys, gives those entries whole in this process (no
  process group needed), read with :class:`~lightning_shard.checkpoint.reader.InPlaceFileSystemReader`.
* ``recorded_layout``: takes a sharded checkpoint and its metadata, gives the
  :class:`~lightning_shard.checkpoint.layout.StateLayout` it recorded.

Example:
    >>> is_sharded_checkpoint("missing.ckpt")
    False
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.async_save import wait_for_saves_in_flight
from lightning_shard.checkpoint.layout import LAYOUT_KEY, TRAINER_LAYOUT, StateLayout
from lightning_shard.checkpoint.model_parallel import model_parallel_layout
from lightning_shard.checkpoint.publish import clean_leftovers
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.checkpoint.reader import InPlaceFileSystemReader
from lightning_shard.torch_compat.checkpoint import load_state_dict_from_keys

_DCP_METADATA = ".metadata"


def is_sharded_checkpoint(path: _PATH) -> bool:
    """Whether ``path`` is a directory written by torch.distributed.checkpoint.

    Example:
        >>> is_sharded_checkpoint("missing.ckpt")
        False
    """
    return Path(path).is_dir() and (Path(path) / _DCP_METADATA).is_file()


def locate(path: _PATH) -> tuple[Path, bool]:
    """Wait for the saves in flight, then let rank 0 decide whether ``path`` is a directory (sharded) or a file, after
    putting back a checkpoint an interrupted publish moved aside; call on every rank. Every rank gets rank 0's
    answer: ranks whose views of a network filesystem differ (just after a rename) never take different paths.

    Raises:
        FileNotFoundError: on every rank, when rank 0 finds nothing at ``path``.

    Example:
        >>> locate("missing.ckpt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: Checkpoint not found: missing.ckpt
    """
    wait_for_saves_in_flight()
    path = Path(path)
    is_directory = broadcast_object(_is_directory_here(path) if rank() == 0 else None)
    if is_directory is None:
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    return path, is_directory


def _is_directory_here(path: Path) -> bool | None:
    clean_leftovers(path)
    return path.is_dir() if path.exists() else None


def read_sharded_keys(path: _PATH, keys: set[str] | None = None) -> dict[str, Any]:
    """Read ``keys`` (default: all) of a sharded checkpoint whole into this process.

    Example:
        >>> read_sharded_keys("out/last.ckpt", {"global_step"})  # doctest: +SKIP
        {'global_step': 200}
    """
    with warnings.catch_warnings():
        # Reading into one process without a process group is the point here, not an accident.
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        try:
            return load_state_dict_from_keys(keys, str(path), InPlaceFileSystemReader(path))
        except CheckpointException as error:  # a damaged item: the reader's error naming it
            raise integrity.unwrapped(error) from None


def recorded_layout(path: Path, metadata: Metadata) -> StateLayout:
    """The layout a sharded checkpoint recorded (one small pickled entry); the Trainer's if it recorded none."""
    entry = metadata.state_dict_metadata.get(LAYOUT_KEY)
    if entry is None:  # the Trainer's, or Lightning's ModelParallelStrategy's
        return model_parallel_layout(path, metadata) or TRAINER_LAYOUT
    target: dict[str, Any] = {LAYOUT_KEY: entry}
    load_without_collectives(target, InPlaceFileSystemReader(path, metadata), dcp.DefaultLoadPlanner())
    return StateLayout.from_record(target[LAYOUT_KEY])


def load_without_collectives(target: dict[str, Any], reader: dcp.StorageReader, planner: dcp.LoadPlanner) -> None:
    """``dcp.load`` into ``target`` by this process alone (``no_dist``), whether or not a process group exists."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
