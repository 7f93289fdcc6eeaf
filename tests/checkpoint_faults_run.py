"""Failed saves and damaged files on 2 ranks under torchrun (Fabric, the toy model, AdamW after one step).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/checkpoint_faults_run.py --out DIR \
        [--tmpfs MOUNTED_TMPFS]

Prints ``RESULT <json>`` on rank 0: per case, what each rank saw.

* ``failed_saves``: for each format (sharded, sharded in the background, full), a good save, then saves that fail
  with an ``OSError`` injected on one rank (EIO, EACCES: ``os.fsync`` raises) and, given ``--tmpfs`` (a size-limited
  tmpfs this process may remount, as root), with a real full disk (a ballast file fills it) and a read-only mount;
  after each: the error each rank raised, what is left in the staging folder, and the largest difference between
  the weights loaded from the path and the good save's.
* ``flipped_bytes``: one byte XOR 0xFF at offsets spread over every kind of stored item (metadata, model tensors,
  optimizer tensors, extra state) of a sharded and a full checkpoint; per offset, the error each rank raised on load.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_safety_run import fabric_model, fabric_run, report, train_step  # noqa: E402
from toy import FULL, outcome  # noqa: E402

from lightning_shard.checkpoint.publish import STAGING_DIR  # noqa: E402

FORMATS = {"sharded": {}, "sharded-async": {"async_save": True}, "full": {"state_dict_type": "full"}}
OFFSETS_PER_ITEM_KIND = 6


def save_and_wait(fabric: Any, path: Path, state: dict[str, Any]) -> None:
    fabric.save(path, state)
    fabric.strategy.checkpoint_io.wait()  # a background save's error comes here


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model.module, options=FULL).items()}


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


@contextlib.contextmanager
def injected(code: int, on_rank: int) -> Iterator[None]:
    """``os.fsync`` raises ``OSError(code)`` on ``on_rank`` (every save syncs what it wrote)."""
    original = os.fsync

    def failing(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    if dist.get_rank() == on_rank:
        os.fsync = failing
    try:
        yield
    finally:
        os.fsync = original


@contextlib.contextmanager
def on_rank_zero(make: Any, undo: Any) -> Iterator[None]:
    """A fault rank 0 makes (``make()``) for every rank, and takes back (``undo()``) once every rank is past it."""
    if dist.get_rank() == 0:
        make()
    dist.barrier()
    try:
        yield
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            undo()
        dist.barrier()


def fill(folder: Path) -> None:
    """Write a ballast file until the filesystem is full."""
    with contextlib.suppress(OSError), open(folder / "ballast", "wb") as stream:
        while True:
            stream.write(b"\0" * 4096)
            stream.flush()


def remount(mount: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True)


def failed_saves(out: Path, tmpfs: Path | None) -> dict[str, Any]:
    results = {}
    for name, settings in FORMATS.items():
        fabric, model, optimizer = fabric_run(**settings)
        fresh, fresh_optimizer = fabric_model(fabric)
        folder = (tmpfs or out) / name
        path = folder / "last.ckpt"
        train_step(fabric, model, optimizer)
        fabric.save(path, {"model": model, "optimizer": optimizer})
        fabric.strategy.checkpoint_io.wait()
        good = weights(model)
        train_step(fabric, model, optimizer)  # what the failing saves would write
        faults = {"EIO": injected(errno.EIO, 1), "EACCES": injected(errno.EACCES, 1)}
        if name == "full":  # rank 0 alone writes a full checkpoint
            faults = {"EIO": injected(errno.EIO, 0), "EACCES": injected(errno.EACCES, 0)}
        if tmpfs is not None:
            faults.update(
                ENOSPC=on_rank_zero(lambda: fill(tmpfs), (tmpfs / "ballast").unlink),
                EROFS=on_rank_zero(lambda: remount(tmpfs, "ro"), lambda: remount(tmpfs, "rw")),
            )
        for fault, context in faults.items():
            with context:
                raised = outcome(save_and_wait, fabric, path, {"model": model, "optimizer": optimizer})
            dist.barrier()
            leftovers = sorted(os.listdir(folder / STAGING_DIR)) if (folder / STAGING_DIR).exists() else []
            fabric.load(path, {"model": fresh, "optimizer": fresh_optimizer})
            results[f"{name}/{fault}"] = {
                "error": raised,
                "leftovers": leftovers,
                "loaded_vs_good": difference(weights(fresh), good),
            }
        dist.barrier()
    return results


def byte_ranges(path: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """Per kind of content, the ``(file, start, end)`` byte ranges that hold it."""
    metadata = path / ".metadata"
    kinds: dict[str, list[tuple[Path, int, int]]] = {"metadata": [(metadata, 0, metadata.stat().st_size)]}
    metadata = FileSystemReader(str(path)).read_metadata()
    for index, info in metadata.storage_data.items():
        if holds_nothing(metadata, index):
            continue
        kind = {"model": "model", "optimizer": "optimizer"}.get(index.fqn.split(".")[0], "extra state")
        kinds.setdefault(kind, []).append((path / info.relative_path, info.offset, info.offset + info.length))
    return kinds


def holds_nothing(metadata: Any, index: Any) -> bool:
    """An empty chunk (a rank's part of a tensor with fewer rows than ranks): no load reads it, so no flip in it
    changes what is loaded, nor is found."""
    entry = metadata.state_dict_metadata[index.fqn]
    return isinstance(entry, TensorStorageMetadata) and entry.chunks[index.index].sizes.numel() == 0


def full_byte_ranges(path: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """Per kind of record of a full checkpoint's zip, the ``(file, start, end)`` byte ranges of its data."""
    size = path.stat().st_size
    kinds: dict[str, list[tuple[Path, int, int]]] = {"zip structure": [(path, size - 400, size)]}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            header = path.read_bytes()[info.header_offset : info.header_offset + 30]  # the local header's lengths
            start = info.header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
            kind = "records of the archive's format"
            if info.filename.endswith(".pkl"):
                kind = "pickle (extra state, optimizer hyper-parameters)"
            elif "/data/" in info.filename:
                kind = "tensors"
            kinds.setdefault(kind, []).append((path, start, start + info.compress_size))
    return kinds


def flipped_bytes(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, settings in (("sharded", {}), ("full", {"state_dict_type": "full"})):
        fabric, model, optimizer = fabric_run(**settings)
        fresh, fresh_optimizer = fabric_model(fabric)
        path = out / f"flip-{name}.ckpt"
        train_step(fabric, model, optimizer)
        extra = {"w_copy": torch.arange(6.0), "note": {"lr_history": [0.1, 0.05]}}
        fabric.save(path, {"model": model, "optimizer": optimizer, "extra": extra})
        found = [(byte_ranges if name == "sharded" else full_byte_ranges)(path) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found)  # rank 0's reading of the files: the flips are its own
        ranges = found[0]
        for kind, spans in sorted(ranges.items()):
            offsets = [(file, start + (end - start) * i // OFFSETS_PER_ITEM_KIND) for i in range(OFFSETS_PER_ITEM_KIND)
                       for file, start, end in spans[i % len(spans) : i % len(spans) + 1]]  # fmt: skip
            for file, offset in offsets:
                original = file.read_bytes()
                if dist.get_rank() == 0:
                    damaged = bytearray(original)
                    damaged[offset] ^= 0xFF
                    file.write_bytes(damaged)
                dist.barrier()
                raised = outcome(fabric.load, path, {"model": fresh, "optimizer": fresh_optimizer})
                dist.barrier()
                if dist.get_rank() == 0:
                    file.write_bytes(original)
                dist.barrier()
                results[f"{name}/{kind}/{file.name}@{offset}"] = raised
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tmpfs", type=Path, default=None)
    args = parser.parse_args()
    report({"failed_saves": failed_saves(args.out, args.tmpfs), "flipped_bytes": flipped_bytes(args.out)})


if __name__ == "__main__":
    main()
