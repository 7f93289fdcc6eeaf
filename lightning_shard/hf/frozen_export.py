"""``export-hf`` of a small checkpoint: the frozen pretrained weights it leaves out, read back from their files.

A checkpoint saved with ``ShardedStrategy(save_frozen_pretrained_weights=False)`` holds the trainable parameters (a
LoRA run's adapters) and records the frozen ones it leaves out with the safetensors files they were read from
(:mod:`lightning_shard.hf.frozen_weights`). A merged or plain export needs them; an adapter-only export does not.
:class:`PretrainedBase` checks the files of the ``--config`` directory against the record (file name, size and
safetensors header, the check resuming makes), matches their tensors to the model built from that config as the run's
loader matched them (transformers' conversion mapping: :func:`~lightning_shard.hf.pretrained.plan_files`), and gives
each left-out checkpoint key a reader of its whole tensor: plain file reads
(:class:`~lightning_shard.hf.safetensors_files.StoredTensor`), or a converted tensor (fused MoE experts) through its
conversion. The export calls these readers shard by shard, as it reads the checkpoint's own tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard.checkpoint.integrity import _listed
from lightning_shard.hf.conversion import LoadPlan, read_converted
from lightning_shard.hf.frozen_weights import RECORD_KEY, PretrainedFile, check_recorded_files
from lightning_shard.hf.pretrained import plan_files


@dataclass(frozen=True)
class BaseTensor:
    """A left-out weight as the export reads it: its shape, the dtype it is read in, and its reader."""

    shape: torch.Size
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


@dataclass
class PretrainedBase:
    """The pretrained files a checkpoint's left-out weights come from, checked against its record, and how they fill
    the model built from their config (``model``, on the meta device, not wrapped).

    Example:
        >>> base = PretrainedBase.open(Path("last.ckpt"), record, Path("pretrained"), meta_llama)  # doctest: +SKIP
        >>> base.tensors("model.", {"lm_head.weight": ["base_model.model.lm_head.weight"]}, None)  # doctest: +SKIP
        {'model.base_model.model.lm_head.weight': BaseTensor(shape=torch.Size([256, 128]), ...)}
    """

    checkpoint: Path
    record: dict[str, Any]
    model: nn.Module
    plan: LoadPlan

    @classmethod
    def open(cls, checkpoint: Path, record: dict[str, Any], directory: Path, model: nn.Module) -> PretrainedBase:
        """Check ``directory``'s safetensors files against ``record`` (the checkpoint's :data:`RECORD_KEY` entry) and
        plan how they fill ``model``.

        Raises:
            CheckpointIntegrityError: naming the recorded files that ``directory`` lacks or holds changed.
        """
        check_recorded_files(
            checkpoint,
            record,
            [PretrainedFile.of(file) for file in sorted(directory.glob("*.safetensors"))],
            missing_means=f"not in {directory}",
            fix=f"Pass the directory of the pretrained model the run read as `--config` (the checkpoint's "
            f"`{RECORD_KEY}` entry lists its files), or export the adapter alone (`--adapter-only`).",
        )
        return cls(checkpoint, record, model, plan_files(model, directory))

    def tensors(
        self, prefix: str, run_names: Mapping[str, Iterable[str]], dtype: torch.dtype | None
    ) -> dict[str, BaseTensor]:
        """The left-out weights under ``prefix``, by checkpoint key.

        Args:
            prefix: the LightningModule's attribute prefix of the model in the checkpoint (``"model."``).
            run_names: each tensor of ``model`` (its state-dict name, tied aliases too) -> the names, without the
                prefix, the run saved it under (peft's for a LoRA model: ``base_model.model.<name>``, ``base_layer``).
            dtype: the dtype to read floating-point tensors in (the run's parameters'); ``None``: the files'.

        Raises:
            ValueError: naming the left-out weights of the model that the files do not fill.
        """
        left_out = {name[len(prefix) :] for name in self.record["parameters"] if name.startswith(prefix)}
        found: dict[str, BaseTensor] = {}

        def add(name: str, shape: torch.Size, file_dtype: torch.dtype, read: Callable[[], torch.Tensor]) -> None:
            to = dtype if dtype is not None and file_dtype.is_floating_point else file_dtype
            for run_name in run_names.get(name, ()):
                if run_name in left_out:
                    found[prefix + run_name] = BaseTensor(shape, to, lambda: read().to(to))

        for key, name in self.plan.renamed.items():
            stored = self.plan.stored[key]
            add(name, torch.Size(stored.shape), stored.dtype, stored.read)
        for name, conversion in self.plan.outputs.items():
            first_source = self.plan.stored[self.plan.converted[conversion].sources[0][1]]
            shape = self.model.get_parameter_or_buffer(name).shape

            def read(conversion: str = conversion, name: str = name) -> torch.Tensor:
                return read_converted(self.model, self.plan, conversion)[name]

            add(name, shape, first_source.dtype, read)
        known = {run_name for names in run_names.values() for run_name in names}
        unfilled = sorted(prefix + name for name in left_out & known if prefix + name not in found)
        if unfilled:
            raise ValueError(
                f"The checkpoint {self.checkpoint} leaves out frozen pretrained weights that the files of "
                f"{self.plan.path} do not fill: {_listed(unfilled)}. Is `--config` the pretrained model the run "
                "started from?"
            )
        return found
