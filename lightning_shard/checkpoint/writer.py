"""``ChecksummedFileSystemWriter``: torch.distributed.checkpoint's ``FileSystemWriter``, recording a checksum of every
item it writes (see :mod:`~lightning_shard.checkpoint.checksums`) and naming the cause and the place of a failed
write.

:func:`write_full_file` does the same for a full checkpoint file.

Same files, same format: each item's checksum is one more attribute of its storage record in ``.metadata``, and
``.metadata`` ends with its own. The items are hashed once this rank's files are written, read back from the page
cache (torch's writer gives no hook per item).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_shard.checkpoint import checksums
from lightning_shard.checkpoint.save_errors import raise_named

_METADATA = ".metadata"


class ChecksummedFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` whose items and ``.metadata`` carry checksums; an ``OSError`` while writing (full
    disk, read-only filesystem, permissions, I/O error) is raised as an ``OSError`` of the same ``errno`` naming
    this rank's files, which survives DCP's gathering of every rank's errors (the errors torch's zip writer raises
    instead, ``unexpected pos 704 vs 598``, say neither).

    Example:
        >>> dcp.save(state, storage_writer=ChecksummedFileSystemWriter("ckpts/.staging/last.ckpt"))  # doctest: +SKIP
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = super().write_data(plan, planner).wait()
            _add_checksums(Path(self.path), results)
        except Exception as error:
            raise_named(error, f"{self.path}/{plan.storage_data.prefix}*.distcp")
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
            checksums.seal_metadata(Path(self.path) / _METADATA)
        except Exception as error:
            raise_named(error, os.path.join(self.path, _METADATA))


def _add_checksums(directory: Path, results: Sequence[WriteResult]) -> None:
    by_file: dict[str, list[WriteResult]] = {}
    for result in results:
        by_file.setdefault(result.storage_data.relative_path, []).append(result)
    for relative_path, written in by_file.items():
        infos = sorted((result.storage_data for result in written), key=lambda info: info.offset)
        with open(directory / relative_path, "rb") as stream:
            digests = checksums.range_checksums(stream, [(info.offset, info.length) for info in infos])
        for info, digest in zip(infos, digests, strict=True):
            info.checksum = digest


def write_full_file(checkpoint: Any, path: Path) -> None:
    """``torch.save`` ``checkpoint`` to ``path`` through a Python file, so that a failed write raises its
    ``OSError`` (torch's own file writer reports ``unexpected pos``), synced, with its checksum
    (:func:`~lightning_shard.checkpoint.checksums.seal_full_file`).

    Example:
        >>> write_full_file({"state_dict": weights}, Path("ckpts/.staging/last.ckpt.tmp-1"))  # doctest: +SKIP
    """
    try:
        with open(path, "wb") as stream:
            writer = checksums.HashingWriter(stream)
            torch.save(checkpoint, writer)
            stream.flush()
            os.fsync(stream.fileno())
        checksums.seal_full_file(path, writer.checksum())
    except Exception as error:
        raise_named(error, str(path))
