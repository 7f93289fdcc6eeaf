"""Reading tensors of safetensors files with plain file reads: a rank's rows (torch.distributed.checkpoint's
``HuggingFaceStorageReader``, subclassed) or a whole tensor that a conversion needs (:class:`StoredTensor`).

Plain reads instead of ``safe_open``, which maps the whole file: every page a rank touches then counts in its RSS until
the file is closed, so a rank's RSS grew by its slices twice (its shard, and the mapped pages behind it: +592 MiB for a
256 MiB shard of a 134M-parameter model).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from lightning_shard.torch_compat.checkpoint import check_hf_reader_hook


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, read when indexed: what transformers' conversions index (its loaders hand
    them safetensors slices).

    Example:
        >>> stored = StoredTensor("model.safetensors", "lm_head.weight", (128, 64), torch.bfloat16)  # doctest: +SKIP
        >>> stored[...].shape  # doctest: +SKIP
        torch.Size([128, 64])
    """

    file: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def read(self) -> torch.Tensor:
        if not self.file:
            raise OSError(f"{self.name!r} is split over several files (a DCP-sharded export); it cannot be converted.")
        tensor = torch.empty(self.shape, dtype=self.dtype)
        read_rows(self.file, self.name, 0, tensor)
        return tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read()[index]


def stored_tensors(metadata: Any) -> dict[str, StoredTensor]:
    """The tensors that ``HuggingFaceStorageReader.read_metadata()`` found, by name."""
    files: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, []).append(info.relative_path)
    return {
        name: StoredTensor(
            files[name][0] if len(files[name]) == 1 else "", name, tuple(entry.size), entry.properties.dtype
        )
        for name, entry in metadata.state_dict_metadata.items()
    }


def read_rows(file: str, name: str, first_row: int, out: torch.Tensor) -> None:
    """Read ``len(out)`` rows of tensor ``name`` of ``file``, from ``first_row`` on, into the contiguous ``out`` (the
    file's dtype, on the CPU). A 0-d tensor is read whole."""
    header_bytes, tensors = _safetensors_header(file, os.stat(file).st_mtime_ns)
    start, end = tensors[name]["data_offsets"]
    shape = tensors[name]["shape"]
    row_bytes = (end - start) // shape[0] if shape and shape[0] else 0
    wanted = out.numel() * out.element_size()
    with open(file, "rb") as handle:
        handle.seek(8 + header_bytes + start + first_row * row_bytes)
        if handle.readinto(out.view(-1).view(torch.uint8).numpy()) != wanted:
            raise OSError(f"{file} ended inside {name!r}: truncated file?")


@cache
def slice_reader_class(base: type) -> type:
    """``HuggingFaceStorageReader`` reading each rank's rows with plain file reads instead of through the mapping.

    FSDP2 shards along dim 0, so a rank's slice of a tensor is one contiguous byte range of the file; it is read
    straight into the target (through a buffer of the slice's size when the dtype or device differs: a bf16 file
    into fp32 shards). Other slices take the base class's path. The hook it overrides is torch's private per-request
    one: checked to exist (``torch_compat.checkpoint.check_hf_reader_hook``), or every rank would silently read whole
    files.
    """
    check_hf_reader_hook(base)

    class SafetensorsSliceReader(base):  # type: ignore[misc, valid-type]
        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            info = self.storage_data[req.storage_index]
            shape = list(info.shape)
            if not shape or list(req.lengths[1:]) != shape[1:] or any(req.storage_offsets[1:]):
                return super()._process_read_request(f, req, planner)
            target = planner.resolve_tensor(req).detach()
            direct = target.dtype == info.dtype and target.device.type == "cpu" and target.is_contiguous()
            buffer = target if direct else torch.empty(list(req.lengths), dtype=info.dtype)
            read_rows(info.relative_path, req.storage_index.fqn, req.storage_offsets[0], buffer)
            if not direct:
                target.copy_(buffer)
            planner.commit_tensor(req, target)

    return SafetensorsSliceReader


@cache
def _safetensors_header(file: str, modified_ns: int) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header: its length and ``{name: {"dtype", "shape", "data_offsets"}}`` (the format's
    first 8 bytes are the little-endian header length, then the JSON header, then the data). Cached per file
    version (``modified_ns``): read once, not once per tensor."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return length, json.loads(handle.read(length))
