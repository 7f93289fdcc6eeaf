"""Checkpoint conversion and inspection: sharded directory <-> one ``torch.save`` file, and a summary of either."""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.async_save import wait_for_saves_in_flight
from lightning_shard.checkpoint.io import ShardedCheckpointIO
from lightning_shard.checkpoint.layout import LAYOUT_KEY, WORLD_SIZE_KEY, StateLayout
from lightning_shard.checkpoint.publish import discard, publish, staging_path
from lightning_shard.checkpoint.read import is_sharded_checkpoint, read_sharded_keys
from lightning_shard.checkpoint.writer import write_full_file


def convert(src: Path, dst: Path) -> str:
    """Convert a sharded checkpoint directory to one ``torch.save`` file, or the reverse; return the direction.

    Reads ``src`` once the background saves of this process are published. ``dst`` must not exist; the result is
    published as a save is (staged, then renamed into place), and never replaces what is not a checkpoint of this
    package (for the full file: anything) that appeared at ``dst`` meanwhile.

    Example:
        >>> convert(Path("out/last.ckpt"), Path("out/last-full.ckpt"))  # doctest: +SKIP
        'sharded -> full'
    """
    wait_for_saves_in_flight()
    if not src.exists():
        raise FileNotFoundError(f"Checkpoint not found: {src}")
    if dst.exists():
        raise FileExistsError(f"The destination {dst} exists; choose a new path or remove it first.")
    if is_sharded_checkpoint(src):
        staging = staging_path(dst, shared=False)
        staging.parent.mkdir(parents=True, exist_ok=True)
        try:
            # What torch's `dcp_to_torch_save` does (every entry read whole into this process, then `torch.save`),
            # through the checksummed reader and writer: a damaged shard stops it, the file carries its checksum.
            integrity.check_sharded(src)
            write_full_file(read_sharded_keys(src), staging)
            publish(staging, dst, replace=False)
        finally:
            discard(staging)  # left there only if something failed
        return "sharded -> full"
    if src.is_dir():
        raise ValueError(f"{src} is a directory without torch.distributed.checkpoint metadata (.metadata).")
    # Not torch's `torch_save_to_dcp`: it flattens every value into DCP leaves, which drops empty containers (a
    # `functools.partial` LR lambda's `{}`, a loop's empty state), and Lightning then fails to resume. Written as
    # the strategy writes a sharded checkpoint instead; the file is mapped, not read into memory.
    checkpoint = integrity.load_full_file(src, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(src))
    layout = _layout(checkpoint, src)
    with warnings.catch_warnings():
        # Writing from one process without a process group is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        ShardedCheckpointIO().save_sharded(checkpoint, dst, layout)
    return "full -> sharded"


def inspect(path: Path) -> dict[str, Any]:
    """Describe a checkpoint of either format: format, saving world size, step, parameters, top-level keys.

    Example:
        >>> inspect(Path("out/last.ckpt"))["format"]  # doctest: +SKIP
        'sharded'
    """
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    if is_sharded_checkpoint(path):
        return _inspect_sharded(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory without torch.distributed.checkpoint metadata (.metadata).")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    weights = [t for t in checkpoint[_layout(checkpoint, path).model].values() if isinstance(t, torch.Tensor)]
    return {
        "format": "full",
        "saved_world_size": None,
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "n_params": sum(t.numel() for t in weights),
        "param_bytes": sum(t.numel() * t.element_size() for t in weights),
        "keys": sorted(checkpoint),
    }


def _layout(checkpoint: Any, path: Path) -> StateLayout:
    """The layout a full checkpoint recorded (the Trainer's if none), refusing a file without its weights entry."""
    layout = StateLayout.from_record(checkpoint.get(LAYOUT_KEY) if isinstance(checkpoint, dict) else None)
    if not isinstance(checkpoint, dict) or layout.model not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no {layout.model!r} entry.")
    return layout


def _inspect_sharded(path: Path) -> dict[str, Any]:
    metadata = FileSystemReader(str(path)).read_metadata()
    keys = {LAYOUT_KEY} if LAYOUT_KEY in metadata.state_dict_metadata else set()
    scalars = read_sharded_keys(path, {"global_step", "epoch", WORLD_SIZE_KEY, *keys})
    prefix = StateLayout.from_record(scalars.get(LAYOUT_KEY)).model + "."
    weights = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    return {
        "format": "sharded",
        "saved_world_size": scalars.get(WORLD_SIZE_KEY),
        "global_step": scalars.get("global_step"),
        "epoch": scalars.get("epoch"),
        "n_params": sum(meta.size.numel() for meta in weights.values()),
        "param_bytes": sum(meta.size.numel() * meta.properties.dtype.itemsize for meta in weights.values()),
        "keys": sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata}),
    }
