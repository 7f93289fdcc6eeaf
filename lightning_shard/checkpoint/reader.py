"""``InPlaceFileSystemReader``: torch.distributed.checkpoint's ``FileSystemReader``, reading each saved tensor straight
into the tensor it is loaded into.

``FileSystemReader`` ``torch.load``-s every saved tensor into new memory and then copies it into its target: each
byte is copied twice (the first time into freshly faulted pages) and every tensor is unpickled on its own. That was
most of a sharded load's time (profile in ``benchmarks/checkpoint_io.py``'s notes). A DCP storage file holds each
tensor as one ``torch.save`` archive at a known offset; this reader asks torch's own archive reader
(``PyTorchFileReader.get_record_offset``, what ``torch.load(mmap=True)`` relies on) where the tensor's bytes start
and reads them with one ``readinto`` into the target. It does so only when the saved chunk is exactly what the
target needs (same chunking, so no resharding) and the archive holds one contiguous tensor of the saved dtype and
shape; anything else - resharding, byte items, transformed (e.g. compressed) storage, another layout - goes through
``FileSystemReader`` unchanged. Same files, same format.

It also takes the ``Metadata`` the integrity check has already read, so a load reads ``.metadata`` once, and
verifies the checksum of every stored item it reads (:mod:`~lightning_shard.checkpoint.checksums`): a damaged byte
raises :class:`~lightning_shard.checkpoint.integrity.CheckpointIntegrityError` naming the file and the tensor or
object it holds. Items read in place are hashed from their target's memory and their archive's few header bytes;
the others as ``FileSystemReader`` slices them (``_slice_file``, see ``torch_compat.checkpoint.DCP_READER_SLICE_HOOK``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_shard.checkpoint import checksums
from lightning_shard.checkpoint.integrity import CheckpointIntegrityError
from lightning_shard.torch_compat.checkpoint import PyTorchFileReader, file_view

_STORAGE_RECORD = "data/0"  # the one storage of a one-tensor ``torch.save`` archive


class InPlaceFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that reads whole saved chunks directly into their targets.

    Args:
        path: the checkpoint directory.
        metadata: its ``Metadata`` if already read (returned by :meth:`read_metadata` instead of reading again).

    Example:
        >>> metadata = FileSystemReader("out/last.ckpt").read_metadata()  # doctest: +SKIP
        >>> dcp.load(state, storage_reader=InPlaceFileSystemReader("out/last.ckpt", metadata))  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        # (archive length, dtype, shape) -> the layout of a plain archive of that kind opened before.
        self._layouts: dict[tuple[int, torch.dtype, tuple[int, ...]], _Layout] = {}
        self._names: dict[tuple[str, int], MetadataIndex] | None = None  # (file, offset) -> the item stored there

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None or args or kwargs:
            return super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        metadata = self.read_metadata()
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        others: list[ReadItem] = []
        for relative_path, items in by_file.items():
            path = os.path.join(self.path, relative_path)
            # Two handles: a buffered one for the archive directories, an unbuffered one for the data itself so
            # `readinto` lands in the target without an intermediate buffer.
            with open(path, "rb") as archive_stream, open(path, "rb", buffering=0) as data_stream:
                for item in items:
                    if not self._read_in_place(item, planner, metadata, archive_stream, data_stream):
                        others.append(item)
        if others:
            return super().read_data(dataclasses.replace(plan, items=others), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_in_place(
        self, item: ReadItem, planner: LoadPlanner, metadata: Metadata, archive_stream: Any, data_stream: Any
    ) -> bool:
        """Read ``item`` straight into its target if it is a whole saved chunk in a plain archive; else False."""
        info = self.storage_data[item.storage_index]
        entry = metadata.state_dict_metadata.get(item.storage_index.fqn)
        if item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
            return False
        if not isinstance(entry, TensorStorageMetadata):
            return False
        sizes = _saved_chunk_sizes(entry, item.storage_index)
        if sizes is None or any(item.storage_offsets) or tuple(item.lengths) != sizes:
            return False  # a part of a saved chunk: resharding, which FileSystemReader's narrow handles
        data_offset = self._plain_data_offset(archive_stream, info.offset, info.length, entry.properties.dtype, sizes)
        if data_offset is None:
            return False
        target = planner.resolve_tensor(item).detach()
        if target.shape != sizes:
            return False
        direct = target.device.type == "cpu" and target.dtype == entry.properties.dtype and target.is_contiguous()
        buffer = target if direct else torch.empty(sizes, dtype=entry.properties.dtype)
        _read_exactly(data_stream, info.offset + data_offset, buffer)
        recorded = checksums.item_checksum(info)
        if recorded is not None:
            data_end = data_offset + buffer.numel() * buffer.element_size()
            # The archive's bytes around the tensor's (its headers, ~1 KB) by offset: no seek of the buffered stream.
            fd = data_stream.fileno()
            chunks = (
                os.pread(fd, data_offset, info.offset),
                _bytes_of(buffer),
                os.pread(fd, info.length - data_end, info.offset + data_end),
            )
            self._verify(item.storage_index, info, checksums.checksum_of(chunks, recorded))
        if not direct:
            target.copy_(buffer)
        planner.commit_tensor(item, target)
        return True

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        """The stored item at ``sinfo``, read whole and verified (``FileSystemReader`` reads it from this)."""
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)  # short if the file is: the checksum, or DCP, names it
        recorded = checksums.item_checksum(sinfo)
        if recorded is not None:
            if self._names is None:
                self._names = {(i.relative_path, i.offset): index for index, i in self.storage_data.items()}
            index = self._names.get((sinfo.relative_path, sinfo.offset))
            self._verify(index, sinfo, checksums.checksum_of([data], recorded))
        return io.BytesIO(data)

    def _verify(self, index: MetadataIndex | None, info: Any, actual: str) -> None:
        recorded = checksums.item_checksum(info)
        if actual == recorded:
            return
        what = "an item" if index is None else repr(index.fqn)
        if index is not None and index.offset is not None and any(index.offset):
            what += f" (its chunk at {tuple(index.offset)})"
        raise CheckpointIntegrityError(
            f"Damaged checkpoint file {os.path.join(self.path, info.relative_path)}: bytes {info.offset} to "
            f"{info.offset + info.length} hold {what} and do not match the checksum written at save ({actual} read, "
            f"{recorded} written). The checkpoint cannot be loaded as it is; load an earlier one."
        )

    def _plain_data_offset(
        self, stream: Any, offset: int, length: int, dtype: torch.dtype, sizes: torch.Size
    ) -> int | None:
        """Where the tensor's bytes start inside the archive at ``offset``, if it is one contiguous ``dtype``
        tensor of shape ``sizes`` filling its storage (DCP's own writes); None otherwise."""
        key = (length, dtype, tuple(sizes))
        known = self._layouts.get(key)
        if known is not None:
            # An archive of the same length, dtype and shape was opened already. Where its pickle (dtype, shape,
            # strides, storage) sits, this one's holds the same bytes: torch.save laid both out alike, so the tensor
            # starts at the same offset. Opening every archive with torch's zip reader cost as much as reading.
            stream.seek(offset + known.pickle_offset)
            if stream.read(len(known.pickle)) == known.pickle:
                return known.data_offset
        layout = _open_plain(stream, offset, length, dtype, sizes)
        if layout is not None:
            self._layouts[key] = layout
        return layout.data_offset if layout is not None else None


@dataclass(frozen=True)
class _Layout:
    """Where a one-tensor ``torch.save`` archive keeps its pickle and its tensor's bytes."""

    pickle_offset: int
    pickle: bytes
    data_offset: int


def _open_plain(stream: Any, offset: int, length: int, dtype: torch.dtype, sizes: torch.Size) -> _Layout | None:
    """The layout of the archive at ``offset`` if it holds one contiguous ``dtype`` tensor of shape ``sizes`` filling
    its storage, in this machine's byte order; None otherwise (or if torch's reader cannot open it)."""
    try:
        archive = PyTorchFileReader(file_view(stream, offset, length))
        records = archive.get_all_records()
        if [name for name in records if name.startswith("data/")] != [_STORAGE_RECORD]:
            return None
        if "byteorder" in records and archive.get_record("byteorder") != sys.byteorder.encode():
            return None
        layout = torch.load(file_view(stream, offset, length), map_location="meta", weights_only=True)
        plain = (
            isinstance(layout, torch.Tensor)
            and layout.dtype == dtype
            and layout.shape == sizes
            and layout.is_contiguous()
            and layout.storage_offset() == 0
            and layout.untyped_storage().nbytes() == layout.numel() * layout.element_size()
        )
        if not plain:
            return None
        pickle = archive.get_record("data.pkl")
        return _Layout(archive.get_record_offset("data.pkl"), pickle, archive.get_record_offset(_STORAGE_RECORD))
    except Exception:  # anything unusual: FileSystemReader reads it (and raises its own error if damaged)
        return None


def _saved_chunk_sizes(entry: TensorStorageMetadata, index: MetadataIndex) -> torch.Size | None:
    if index.index is not None and index.index < len(entry.chunks):
        chunk = entry.chunks[index.index]
        if index.offset is None or tuple(chunk.offsets) == tuple(index.offset):
            return torch.Size(chunk.sizes)
    for chunk in entry.chunks:
        if index.offset is not None and tuple(chunk.offsets) == tuple(index.offset):
            return torch.Size(chunk.sizes)
    return None


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _read_exactly(stream: Any, offset: int, tensor: torch.Tensor) -> None:
    view = _bytes_of(tensor)
    stream.seek(offset)
    done = 0
    while done < len(view):
        count = stream.readinto(view[done:])
        if not count:
            raise EOFError(f"{stream.name}: {len(view) - done} bytes missing at offset {offset + done}")
        done += count
