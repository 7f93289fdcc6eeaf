"""Averaged copies in saved checkpoints: which entry holds one, and its weights under the model's names.

A checkpoint keeps an averaged copy (:class:`~lightning_shard.averaging.ShardedAveragedModel`'s state dict, which is
``AveragedModel``'s: ``module.<name>`` per weight, plus ``n_averaged``) under a key its layout names: the Trainer's
``"averaged_model"``, or the key of the copy in a Fabric program's ``state``.
"""

from __future__ import annotations

import zipfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.layout import LAYOUT_KEY, StateLayout
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.checkpoint.read import locate, recorded_layout

# The prefix of the weights' names in an averaged copy's state dict.
AVERAGED_NAME_PREFIX = "module."


def averaged_key(layout: StateLayout, holds: Collection[str]) -> str | None:
    """The first averaged copy ``layout`` names that the checkpoint ``holds`` (its top-level keys), or None.

    Example:
        >>> averaged_key(StateLayout(), {"state_dict", "averaged_model"})
        'averaged_model'
    """
    return next((key for key in layout.averaged if key in holds), None)


def holds_averaged_copy(path: _PATH) -> bool:
    """Whether the checkpoint at ``path`` (either format) holds an averaged copy; call on every rank. Decided once,
    by rank 0, as a load decides what it reads: after the saves in flight are published and a checkpoint an
    interrupted publish moved aside is put back (:func:`~lightning_shard.checkpoint.read.locate`), then broadcast, so
    that every rank gets the same answer (or the same error) whatever its own view of the filesystem.

    Raises:
        FileNotFoundError: on every rank, when rank 0 finds nothing at ``path``.

    Example:
        >>> holds_averaged_copy("out/last.ckpt")  # doctest: +SKIP
        True
    """
    path, is_directory = locate(path)
    holds = _sharded_holds if is_directory else _full_holds
    return bool(broadcast_object(integrity.agreed(lambda: holds(path), rank() == 0)))


def _sharded_holds(path: Path) -> bool:
    metadata = integrity.read_metadata(path)
    return averaged_key(recorded_layout(path, metadata), top_level_keys(metadata)) is not None


def top_level_keys(metadata: Metadata) -> set[str]:
    """The top-level keys of a sharded checkpoint's state (``state_dict``, ``averaged_model``, ...)."""
    return {name.split(".", 1)[0] for name in metadata.state_dict_metadata}


def _full_holds(path: Path) -> bool:
    mmap = zipfile.is_zipfile(path)  # a file in torch's legacy format cannot be mapped; it is read
    checkpoint = integrity.load_full_file(path, map_location="cpu", weights_only=False, mmap=mmap)
    if not isinstance(checkpoint, dict):
        return False
    return averaged_key(StateLayout.from_record(checkpoint.get(LAYOUT_KEY)), set(checkpoint)) is not None


def averaged_state_dict(checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
    """The averaged weights of a loaded full checkpoint (``torch.load``), under the model's names: what
    ``model.load_state_dict`` takes.

    Raises:
        ValueError: the checkpoint holds no averaged copy.

    Example:
        >>> averaged_state_dict({"averaged_model": {"module.weight": 1.0, "n_averaged": 3}})
        {'weight': 1.0}
    """
    key = averaged_key(StateLayout.from_record(checkpoint.get(LAYOUT_KEY)), set(checkpoint))
    if key is None:
        raise ValueError(
            "The checkpoint holds no averaged weights: it was written without a weight-averaging callback (Trainer) "
            "or a ShardedAveragedModel in the saved state (Fabric)."
        )
    prefix = AVERAGED_NAME_PREFIX
    return {name[len(prefix) :]: value for name, value in checkpoint[key].items() if name.startswith(prefix)}
