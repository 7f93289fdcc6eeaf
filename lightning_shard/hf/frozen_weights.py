"""Frozen pretrained weights left out of checkpoints: a LoRA run's base model, read from its files again on resume.

With ``ShardedStrategy(save_frozen_pretrained_weights=False)`` a checkpoint (sharded or full) leaves out every
parameter that is frozen (``requires_grad=False``) and was read from pretrained files by
:func:`lightning_shard.hf.from_pretrained` - a LoRA run's whole base model - so it holds the trainable parameters,
buffers, optimizer and loop states. It records (under :data:`RECORD_KEY`) the names left out and the files they were
read from (:class:`PretrainedFile`: path, size, a SHA-256 of the safetensors header and one of sampled contents,
taken when the run read them). Resuming builds the model as before (``configure_model()`` reads the base from the
files again); :func:`names_to_skip_on_resume` checks that this run read the same files (by name, size, header and
contents) and returns the names the checkpoint does not hold, which the checkpoint IO then neither expects nor loads.
Training does not change frozen parameters, so the resumed model equals the saved one. Checkpoints saved before the
contents were recorded still load, their files checked by name, size and header (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.checkpoint.read import locate, read_sharded_keys
from lightning_shard.torch_compat.modules import visible_name

# The checkpoint entry that names the weights left out and their files.
RECORD_KEY = "frozen_pretrained_weights"
# Set on a model loaded by `load_pretrained_shards`: its `_Loaded` record.
_LOADED = "_lightning_shard_loaded_files"
# Read from the start and the end of every tensor's data (all of a smaller tensor) for the content hash. Training
# changes nearly every element of what it trains, so a fine-tune of the same architecture differs there in every
# tensor it changed, also in a layer-wise or head-only fine-tune that leaves most of a file alone; two reads per tensor
# cost milliseconds, where hashing the whole file would read it (`benchmarks/hf_loading.py --content-hash`).
_SAMPLE_BYTES = 4096


@dataclass(frozen=True)
class PretrainedFile:
    """A safetensors file as a checkpoint records it: its size, a SHA-256 of its header (names, dtypes, shapes,
    offsets) and one of sampled contents (the first and the last 4 KiB of every tensor's data, in file order).
    ``content_sha256`` is empty in records written before it existed.

    Example:
        >>> PretrainedFile.of("checkpoints/llama/model.safetensors")  # doctest: +SKIP
        PretrainedFile(path='/.../model.safetensors', size=1032, header_sha256='3f1c...', content_sha256='9a0e...')
    """

    path: str
    size: int
    header_sha256: str
    content_sha256: str = ""

    @classmethod
    def of(cls, path: str | os.PathLike) -> PretrainedFile:
        path = Path(path).resolve()
        with open(path, "rb") as handle:
            length_bytes = handle.read(8)
            (length,) = struct.unpack("<Q", length_bytes)
            header = handle.read(length)
            content = hashlib.sha256(length_bytes + header)
            for start, end in _sampled_ranges(json.loads(header), data_start=8 + length):
                handle.seek(start)
                content.update(handle.read(end - start))
        header_sha256 = hashlib.sha256(length_bytes + header).hexdigest()
        return cls(str(path), path.stat().st_size, header_sha256, content.hexdigest())


def _sampled_ranges(header: dict[str, Any], data_start: int) -> list[tuple[int, int]]:
    """The byte ranges of the file read for the content hash, in file order, merged where they touch."""
    ranges: list[tuple[int, int]] = []
    for entry in sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda e: e["data_offsets"]):
        start, end = (data_start + offset for offset in entry["data_offsets"])
        for piece in ((start, min(end, start + _SAMPLE_BYTES)), (max(start, end - _SAMPLE_BYTES), end)):
            if ranges and piece[0] <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], piece[1]))
            elif piece[0] < piece[1]:
                ranges.append(piece)
    return ranges


@dataclass(eq=False)
class _Loaded:
    files: tuple[PretrainedFile, ...]
    tensors: list[torch.Tensor]


def note_loaded(model: nn.Module, files: Iterable[str], tensors: list[torch.Tensor]) -> None:
    """Remember that ``tensors`` of ``model`` were read from ``files`` (called by the pretrained loader).

    Example:
        >>> note_loaded(model, ["checkpoints/llama/model.safetensors"], loaded)  # doctest: +SKIP
    """
    model.__dict__[_LOADED] = _Loaded(tuple(PretrainedFile.of(file) for file in sorted(set(files))), tensors)


def frozen_pretrained_weights(root: nn.Module) -> dict[str, tuple[PretrainedFile, ...]]:
    """The frozen parameters of ``root`` read from pretrained files, by state-dict name, with those files.

    Example:
        >>> list(frozen_pretrained_weights(lora_module))[:1]  # doctest: +SKIP
        ['model.base_model.model.model.embed_tokens.weight']
    """
    files_of: dict[int, tuple[PretrainedFile, ...]] = {}
    for module in root.modules():
        loaded: _Loaded | None = module.__dict__.get(_LOADED)
        if loaded is not None:
            files_of.update({id(tensor): loaded.files for tensor in loaded.tensors})
    return {
        visible_name(name): files_of[id(param)]
        for name, param in root.named_parameters(remove_duplicate=False)
        if not param.requires_grad and id(param) in files_of
    }


def checkpoint_record(weights: dict[str, tuple[PretrainedFile, ...]]) -> dict[str, Any]:
    """What a checkpoint records under :data:`RECORD_KEY` about the ``weights`` it leaves out.

    Example:
        >>> record = checkpoint_record({"lm_head.weight": (PretrainedFile("/m/model.safetensors", 1032, "3f1c"),)})
        >>> record["parameters"], record["files"][0]["size"]
        (['lm_head.weight'], 1032)
    """
    files = sorted({file for group in weights.values() for file in group}, key=lambda file: file.path)
    return {"parameters": sorted(weights), "files": [asdict(file) for file in files]}


def names_to_skip_on_resume(path: str | os.PathLike, root: nn.Module) -> list[str]:
    """The names the checkpoint at ``path`` leaves out (none for a checkpoint without the record), once checked
    against what this run read from pretrained files; call on every rank (every rank raises the same error).

    Raises:
        CheckpointIntegrityError: naming the recorded files that this run did not read (missing) or read with
            another size or header (changed), or the left-out parameters this model did not read from files.

    Example:
        >>> names_to_skip_on_resume("out/last.ckpt", lightning_module)[:1]  # doctest: +SKIP
        ['model.base_model.model.lm_head.weight']
    """
    record = read_record(path)
    if record is None:
        return []
    integrity.agreed(lambda: _check(path, record, frozen_pretrained_weights(root)))
    return list(record["parameters"])


def _check(path: str | os.PathLike, record: dict[str, Any], current: dict[str, tuple[PretrainedFile, ...]]) -> None:
    not_read = sorted(set(record["parameters"]) - set(current))
    if not_read:
        raise integrity.CheckpointIntegrityError(
            f"The checkpoint {path} leaves out {len(record['parameters'])} frozen pretrained parameters, to be read "
            f"from their files, but this model did not read {len(not_read)} of them from pretrained files "
            f"({not_read[:4]}...). "
            "Build it in `configure_model()` with `lightning_shard.hf.from_pretrained` on the same files."
        )
    check_recorded_files(
        path,
        record,
        {file for group in current.values() for file in group},
        missing_means="not read by this run",
        fix=f"Point `from_pretrained` at the original files (the checkpoint's `{RECORD_KEY}` entry lists them), or "
        "resume from a checkpoint saved with `save_frozen_pretrained_weights=True`.",
    )


def check_recorded_files(
    path: str | os.PathLike, record: dict[str, Any], found: Iterable[PretrainedFile], missing_means: str, fix: str
) -> None:
    """Check the files ``found`` against those the checkpoint at ``path`` records (``record``), by file name, size,
    header and sampled contents (by name, size and header only, with a warning, where the record is older than the
    content hash): resuming checks the files this run read, ``export-hf`` those of its ``--config`` directory.

    Raises:
        CheckpointIntegrityError: naming the recorded files missing from ``found`` (``missing_means`` says what that
            means) and those whose size, header or contents changed, then ``fix``.

    Example:
        >>> check_recorded_files("out/last.ckpt", record, [PretrainedFile.of("llama/model.safetensors")],
        ...                      "not in llama", "Pass the pretrained directory.")  # doctest: +SKIP
    """
    by_name = {Path(file.path).name: file for file in found}
    missing, changed, unsampled = [], [], []
    for saved in (PretrainedFile(**file) for file in record["files"]):
        now = by_name.get(Path(saved.path).name)
        if now is None:
            missing.append(saved.path)
        elif now.size != saved.size:
            changed.append(f"{now.path} ({now.size} bytes; the checkpoint's was {saved.size} bytes)")
        elif now.header_sha256 != saved.header_sha256:
            changed.append(f"{now.path} (another safetensors header: other tensors, dtypes or shapes)")
        elif not saved.content_sha256:
            unsampled.append(now.path)
        elif now.content_sha256 != saved.content_sha256:
            changed.append(f"{now.path} (the same tensors with other values: another fine-tune of the same model?)")
    if unsampled and not missing and not changed:
        rank_zero_warn(
            f"The checkpoint {path} was saved by an older lightning-shard, which recorded the pretrained files by "
            f"name, size and safetensors header only: {unsampled} are taken to be the files the run read, without "
            "checking their values. A checkpoint saved from now on records their contents too."
        )
    if missing or changed:
        problems = ([f"missing ({missing_means}): {missing}"] if missing else []) + (
            [f"changed since the checkpoint was saved: {changed}"] if changed else []
        )
        raise integrity.CheckpointIntegrityError(
            f"The checkpoint {path} leaves out the frozen pretrained weights, to be read again from the files it "
            f"records, but files are {'; '.join(problems)}. {fix}"
        )


def read_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the checkpoint at ``path`` (``None`` when it leaves nothing out); a damaged checkpoint raises
    on every rank.

    Example:
        >>> read_record("out/last.ckpt")["files"][0]["size"]  # doctest: +SKIP
        3219984
    """
    path, is_directory = locate(path)  # rank 0 decides which collectives follow
    if is_directory:
        metadata = integrity.agreed(lambda: integrity.read_metadata(path))
        assert metadata is not None
        if RECORD_KEY not in metadata.state_dict_metadata:
            return None
        return read_sharded_keys(path, {RECORD_KEY})[RECORD_KEY]

    def read_full() -> dict[str, Any] | None:
        mmap = zipfile.is_zipfile(path)  # torch's legacy format cannot be mapped
        checkpoint = integrity.load_full_file(path, map_location="cpu", weights_only=False, mmap=mmap)
        return checkpoint.get(RECORD_KEY) if isinstance(checkpoint, dict) else None

    return broadcast_object(integrity.agreed(read_full, here=rank() == 0))
