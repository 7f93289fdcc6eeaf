"""The ``lightning-shard`` command: ``convert``, ``inspect`` and ``estimate``.

lightning-shard convert out/last.ckpt out/last-full.ckpt      # sharded directory -> one file
lightning-shard convert out/last-full.ckpt out/sharded.ckpt    # one file -> sharded directory
lightning-shard inspect out/last.ckpt
lightning-shard estimate --config configs/gpt3_13b.yaml --devices 8 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint_io import MODEL_KEY, WORLD_SIZE_KEY, is_sharded_checkpoint, read_sharded_keys


def convert(src: Path, dst: Path) -> str:
    """Convert a sharded checkpoint directory to one ``torch.save`` file, or the reverse; return the direction.

    Example:
        >>> convert(Path("out/last.ckpt"), Path("out/last-full.ckpt"))  # doctest: +SKIP
        'sharded -> full'
    """
    if not src.exists():
        raise FileNotFoundError(f"Checkpoint not found: {src}")
    if dst.exists():
        raise FileExistsError(f"The destination {dst} exists; choose a new path or remove it first.")
    if is_sharded_checkpoint(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        dcp_to_torch_save(src, dst)
        return "sharded -> full"
    if src.is_dir():
        raise ValueError(f"{src} is a directory without torch.distributed.checkpoint metadata (.metadata).")
    torch_save_to_dcp(src, dst)
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
    if not isinstance(checkpoint, dict) or MODEL_KEY not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no {MODEL_KEY!r} entry.")
    weights = [t for t in checkpoint[MODEL_KEY].values() if isinstance(t, torch.Tensor)]
    return {
        "format": "full",
        "saved_world_size": None,
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "n_params": sum(t.numel() for t in weights),
        "param_bytes": sum(t.numel() * t.element_size() for t in weights),
        "keys": sorted(checkpoint),
    }


def _inspect_sharded(path: Path) -> dict[str, Any]:
    metadata = FileSystemReader(str(path)).read_metadata()
    weights = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_KEY + ".") and isinstance(meta, TensorStorageMetadata)
    }
    scalars = read_sharded_keys(path, {"global_step", "epoch", WORLD_SIZE_KEY})
    return {
        "format": "sharded",
        "saved_world_size": scalars.get(WORLD_SIZE_KEY),
        "global_step": scalars.get("global_step"),
        "epoch": scalars.get("epoch"),
        "n_params": sum(meta.size.numel() for meta in weights.values()),
        "param_bytes": sum(meta.size.numel() * meta.properties.dtype.itemsize for meta in weights.values()),
        "keys": sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata}),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-shard`` console script."""
    parser = argparse.ArgumentParser(prog="lightning-shard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert_parser = commands.add_parser("convert", help="sharded directory <-> full file")
    convert_parser.add_argument("src", type=Path)
    convert_parser.add_argument("dst", type=Path)
    inspect_parser = commands.add_parser("inspect", help="describe a checkpoint")
    inspect_parser.add_argument("path", type=Path)
    inspect_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands.add_parser("estimate", help="per-rank memory estimate", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "estimate":
        from lightning_shard.memory import estimate_main

        return estimate_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "convert":
            print(f"{convert(args.src, args.dst)}: {args.src} -> {args.dst}")
        else:
            info = inspect(args.path)
            print(json.dumps(info, indent=2) if args.json else "\n".join(f"{k:>16}: {v}" for k, v in info.items()))
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"lightning-shard {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
