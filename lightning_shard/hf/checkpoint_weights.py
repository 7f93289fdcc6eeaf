"""A checkpoint's weights for an export, read a few keys at a time.

Takes a sharded (torch.distributed.checkpoint directory) or full (one ``torch.save`` file) checkpoint of
:class:`~lightning_shard.ShardedCheckpointIO` and which weights to export (``"trained"``, or ``"averaged"``: the
averaged copy saved beside the model, :mod:`lightning_shard.averaging`); gives a :class:`CheckpointWeights`
(:func:`open_checkpoint`): each weight's shape and dtype from the checkpoint's metadata, and reads of chosen keys
(DCP reads of those keys; a full file memory-mapped afresh for each read and released after it), so that an export
holds one output shard at a time, never the whole model. A small checkpoint's frozen weights, left out of it, are
read from the pretrained files instead (:func:`with_base`, :mod:`lightning_shard.hf.frozen_export`).

Example:
    >>> weights = open_checkpoint(Path("out/last.ckpt"))  # doctest: +SKIP
    >>> with weights.read({"model.lm_head.weight": "lm_head.weight"}) as tensors:  # doctest: +SKIP
    ...     tensors["lm_head.weight"].shape
    torch.Size([50257, 768])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint.averaged import AVERAGED_NAME_PREFIX, averaged_key, top_level_keys
from lightning_shard.checkpoint.integrity import check_sharded, full_model_shapes, load_full_file, read_metadata
from lightning_shard.checkpoint.layout import LAYOUT_KEY, MODEL_KEY, StateLayout
from lightning_shard.checkpoint.read import is_sharded_checkpoint, read_sharded_keys, recorded_layout
from lightning_shard.hf.frozen_export import BaseTensor
from lightning_shard.hf.frozen_weights import read_record

Weights = Literal["trained", "averaged"]
HYPER_PARAMETERS_KEY = LightningModule.CHECKPOINT_HYPER_PARAMS_KEY


@dataclass
class CheckpointWeights:
    """A checkpoint's weights: shape and dtype by ``state_dict`` name, and ``with read({key: new_name}) as tensors``
    (the tensors are valid inside the ``with`` block only); ``hyper_parameters()`` reads the LightningModule's;
    ``record``: what a small checkpoint leaves out (:mod:`lightning_shard.hf.frozen_weights`), else ``None``."""

    path: Path
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]
    read: Callable[[Mapping[str, str]], AbstractContextManager[dict[str, torch.Tensor]]]
    hyper_parameters: Callable[[], Any]
    record: dict[str, Any] | None

    @property
    def names(self) -> set[str]:
        """The names of the weights the run saved: those in the checkpoint and those it leaves out."""
        return {*self.shapes, *(self.record["parameters"] if self.record else ())}


def open_checkpoint(path: Path, weights: Weights = "trained") -> CheckpointWeights:
    if is_sharded_checkpoint(path):
        metadata = check_sharded(path)
        entry, prefix = _weights_entry(path, weights, recorded_layout(path, metadata), top_level_keys(metadata))
        stem = f"{entry}.{prefix}"
        entries = {
            key[len(stem) :]: meta
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(stem) and isinstance(meta, TensorStorageMetadata)
        }

        @contextmanager
        def read_sharded(keys: Mapping[str, str]) -> Iterator[dict[str, torch.Tensor]]:
            tensors = read_sharded_keys(path, {stem + key for key in keys})[entry]
            yield {name: tensors.pop(prefix + key) for key, name in keys.items()}

        def read_hyper_parameters() -> Any:
            if HYPER_PARAMETERS_KEY not in read_metadata(path).state_dict_metadata:
                return None
            return read_sharded_keys(path, {HYPER_PARAMETERS_KEY})[HYPER_PARAMETERS_KEY]

        shapes = {key: torch.Size(entry.size) for key, entry in entries.items()}
        dtypes = {key: entry.properties.dtype for key, entry in entries.items()}
        return CheckpointWeights(path, shapes, dtypes, read_sharded, read_hyper_parameters, read_record(path))
    if path.is_dir():
        raise ValueError(f"{path} is a directory without torch.distributed.checkpoint metadata (.metadata).")

    with _mapped_checkpoint(path) as checkpoint:
        layout = StateLayout.from_record(checkpoint.get(LAYOUT_KEY))
        entry, prefix = _weights_entry(path, weights, layout, set(checkpoint))

    @contextmanager
    def read_full(keys: Mapping[str, str]) -> Iterator[dict[str, torch.Tensor]]:
        # A fresh mapping per shard, released after it: the file's pages do not pile up in this process.
        with _mapped_checkpoint(path) as checkpoint:
            yield {name: checkpoint[entry][prefix + key] for key, name in keys.items()}

    def read_hyper_parameters() -> Any:
        with _mapped_checkpoint(path) as checkpoint:
            return checkpoint.get(HYPER_PARAMETERS_KEY)

    with _mapped_checkpoint(path) as checkpoint:
        tensors = {
            key[len(prefix) :]: value
            for key, value in checkpoint[entry].items()
            if key.startswith(prefix) and isinstance(value, torch.Tensor)
        }
        return CheckpointWeights(
            path,
            full_model_shapes(tensors, path),
            {key: tensor.dtype for key, tensor in tensors.items()},
            read_full,
            read_hyper_parameters,
            read_record(path),
        )


def _weights_entry(path: Path, weights: Weights, layout: StateLayout, holds: Collection[str]) -> tuple[str, str]:
    """The checkpoint entry holding the weights to export, and the prefix of their names in it: the model's
    (``"trained"``), or its averaged copy's (``"averaged"``: a ``ShardedAveragedModel`` state dict, whose names are the
    model's after ``module.``), the first the checkpoint's layout names that it holds."""
    if weights == "trained":
        return MODEL_KEY, ""
    if weights != "averaged":
        raise ValueError(f"weights={weights!r}: export the 'trained' weights or their 'averaged' copy.")
    key = averaged_key(layout, holds)
    if key is not None:
        return key, AVERAGED_NAME_PREFIX
    raise ValueError(
        f"The checkpoint {path} holds no averaged weights: it was written without a weight-averaging callback "
        "(Trainer) or a ShardedAveragedModel in the saved state (Fabric). Export its trained weights."
    )


def with_base(source: CheckpointWeights, base: Mapping[str, BaseTensor]) -> CheckpointWeights:
    """``source`` with the weights it leaves out, read from the pretrained files (``base``: key -> its reader)."""

    @contextmanager
    def read(keys: Mapping[str, str]) -> Iterator[dict[str, torch.Tensor]]:
        saved = {key: name for key, name in keys.items() if key not in base}
        with source.read(saved) if saved else nullcontext({}) as tensors:
            yield {**tensors, **{name: base[key].read() for key, name in keys.items() if key in base}}

    return dataclasses.replace(
        source,
        shapes={**source.shapes, **{key: tensor.shape for key, tensor in base.items()}},
        dtypes={**source.dtypes, **{key: tensor.dtype for key, tensor in base.items()}},
        read=read,
    )


def run_dtype(source: CheckpointWeights) -> torch.dtype | None:
    """The dtype the run held its floating-point parameters in, when the checkpoint's agree (the precision's: fp32
    master weights under "-mixed", as the loader read a bf16 base); ``None`` otherwise."""
    floating = {dtype for dtype in source.dtypes.values() if dtype.is_floating_point}
    return floating.pop() if len(floating) == 1 else None


@contextmanager
def _mapped_checkpoint(path: Path) -> Iterator[dict[str, Any]]:
    """A full checkpoint, memory-mapped: tensors are read from the file only when touched."""
    checkpoint = load_full_file(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(MODEL_KEY), Mapping):
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no {MODEL_KEY!r} mapping of weights.")
    try:
        yield checkpoint
    finally:
        del checkpoint
