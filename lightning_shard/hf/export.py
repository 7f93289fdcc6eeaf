"""Export the Hugging Face model inside a Lightning checkpoint as a directory ``from_pretrained`` loads.

``export_hf`` turns a sharded (torch.distributed.checkpoint directory) or full (one ``torch.save`` file) checkpoint
written by :class:`~lightning_shard.ShardedCheckpointIO` into ``config.json`` (+ ``generation_config.json`` and
tokenizer files when the config directory has them) and safetensors shards, as HF's ``save_pretrained`` writes them:
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.

* Names: the HF model is built on the meta device from the config; its state dict names, less tied aliases as HF's
  own ``remove_tied_weights_from_state_dict`` drops them (GPT-2 keeps ``transformer.wte.weight`` and drops
  ``lm_head.weight``), are looked up in the checkpoint under the LightningModule's attribute prefix (``model.`` for
  ``self.model = AutoModelForCausalLM...``), which is found by matching, or given
  (:mod:`lightning_shard.hf.weight_names`).
* Memory: the output is split into shards of at most ``max_shard_size`` with huggingface_hub's
  ``split_torch_state_dict_into_shards`` (what ``save_pretrained`` uses), planned from the checkpoint's metadata, and
  written one shard at a time: only that shard's tensors are read (DCP reads of the chosen keys; a full file is
  memory-mapped and released after each shard: :mod:`lightning_shard.hf.checkpoint_weights`), so one process holds
  at most one shard, never the whole model.
* dtype: the floating-point tensors are written in the dtype ``config.json`` names (``"dtype"``, older
  ``"torch_dtype"``), as ``save_pretrained`` of the original model writes them: a bf16 model fine-tuned under
  ``"bf16-mixed"`` (fp32 master weights in the checkpoint) comes out in bf16. ``dtype="checkpoint"`` keeps the
  checkpoint's (or name one, ``"float32"``); ``config.json`` is then rewritten by transformers to name it, so the
  files and the config never disagree (:mod:`lightning_shard.hf.export_config`).
* LoRA runs (peft): ``merge_lora=True`` writes the model with the adapters merged; :func:`export_adapter` writes the
  adapter alone (:mod:`lightning_shard.hf.peft_export`).
* Small checkpoints (``save_frozen_pretrained_weights=False``): the frozen weights they leave out are read from the
  pretrained files in ``config_dir``, checked against the checkpoint's record first
  (:mod:`lightning_shard.hf.frozen_export`), one output shard at a time like the checkpoint's own; the adapter alone
  needs none of them.
* Averaged weights: ``weights="averaged"`` (``--weights averaged``) writes the run's averaged copy (EMA, SWA; saved
  beside the model by :mod:`lightning_shard.averaging`) instead of its trained weights, the default.
* Atomic: written into a hidden staging folder beside the output directory and renamed into place at the end, only
  where there is nothing (or an empty directory) then: a directory filled meanwhile is refused, never replaced.

transformers, huggingface_hub and safetensors (the ``[hf]`` extra) are imported inside the functions that need them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.publish import discard, publish, staging_path
from lightning_shard.cpu.heap import release_freed_heap
from lightning_shard.hf.checkpoint_weights import Weights, open_checkpoint, run_dtype, with_base
from lightning_shard.hf.export_config import config_dtype, copy_config_files, load_config, target_dtype, written_dtype
from lightning_shard.hf.frozen_export import PretrainedBase
from lightning_shard.hf.peft_export import ADAPTER_WEIGHTS, PeftLayout, adapter_names, read_lora_config, save_adapter
from lightning_shard.hf.weight_names import (
    check_shapes,
    meta_model,
    present_key,
    resolve_prefix,
    saved_names,
    with_names,
)

DEFAULT_MAX_SHARD_SIZE = "5GB"
_WEIGHTS = "model{suffix}.safetensors"  # HF's SAFE_WEIGHTS_NAME with its shard suffix
_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFExport:
    """What :func:`export_hf` wrote: the directory, the checkpoint prefix it read, the weight files, tensors, bytes."""

    out_dir: Path
    prefix: str
    files: list[str]
    num_tensors: int
    total_bytes: int


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    config_dir: str | Path,
    prefix: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    auto_class: Any = None,
    dtype: str | torch.dtype = "config",
    merge_lora: bool = False,
    lora_config: Any = None,
    weights: Weights = "trained",
) -> HFExport:
    """Write the HF model inside ``checkpoint`` to ``out_dir`` for ``auto_class.from_pretrained(out_dir)``.

    Args:
        checkpoint: a sharded checkpoint directory or a full checkpoint file of :class:`ShardedCheckpointIO`.
        out_dir: the new directory; it must not exist or be empty.
        config_dir: a directory with the model's ``config.json`` (e.g. the pretrained model it was fine-tuned from;
            for a checkpoint that leaves out frozen pretrained weights, the directory of their files).
        prefix: the LightningModule's attribute prefix of the HF model in the checkpoint's ``state_dict``
            (``"model."``); ``None`` finds it by matching the HF model's parameter names.
        max_shard_size: the largest safetensors file, in bytes or as ``"5GB"`` / ``"500MB"``; one shard is what the
            export holds in memory at a time.
        auto_class: the transformers auto class that builds the model from the config (``AutoModelForCausalLM``).
        dtype: the dtype of the floating-point tensors written: ``"config"``, the one ``config.json`` names (as
            ``save_pretrained`` of the original model writes it; the checkpoint's when it names none),
            ``"checkpoint"`` (e.g. the fp32 master weights of a "-mixed" run), or a dtype (``"bfloat16"``).
            ``config.json`` names the dtype written.
        merge_lora: the checkpoint holds a peft LoRA model: write it with the adapters merged into the base weights
            (:mod:`lightning_shard.hf.peft_export`).
        lora_config: with ``merge_lora``, the run's LoRA configuration (default: from the checkpoint's
            hyper-parameters; see :func:`~lightning_shard.hf.peft_export.read_lora_config`).
        weights: ``"trained"`` (the model's weights) or ``"averaged"``: the averaged copy (EMA, SWA) of a run with a
            weight-averaging callback or a ``ShardedAveragedModel`` (:mod:`lightning_shard.averaging`).

    Example:
        >>> export_hf("out/last.ckpt", "out/hf", "out/pretrained")  # doctest: +SKIP
        HFExport(out_dir=PosixPath('out/hf'), prefix='model.', files=['model.safetensors'], ...)
    """
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file
    except ImportError as error:
        raise ImportError(f"export_hf needs the [hf] extra: pip install 'lightning-shard[hf]' ({error})") from error

    checkpoint, out_dir, config_dir = Path(checkpoint), Path(out_dir), Path(config_dir)
    _check_paths(checkpoint, out_dir, config_dir)
    if lora_config is not None and not merge_lora:
        raise ValueError("A LoRA configuration (`--lora-config`) goes with `--merge-lora` or `--adapter-only`.")
    config = load_config(config_dir)
    model = meta_model(config, auto_class)
    hf_aliases = aliases = saved_names(model)
    source = open_checkpoint(checkpoint, weights)
    base = None
    if source.record is not None:  # a small checkpoint: the files its frozen weights come from, checked first
        base = PretrainedBase.open(checkpoint, source.record, config_dir, meta_model(config, auto_class))
    layout = None
    if merge_lora:
        layout = PeftLayout.build(model, aliases, read_lora_config(lora_config, source.hyper_parameters, checkpoint))
        aliases = layout.aliases
        read = with_names(aliases, (name for names in layout.module_inputs.values() for name in names))
        prefix = resolve_prefix(prefix, source, read)
        expected = {name: layout.shapes[name] for names in read.values() for name in names}
    else:
        prefix = resolve_prefix(prefix, source, aliases)
        state = model.state_dict()
        expected = {alias: state[name].shape for name, names in aliases.items() for alias in names}
    if base is not None:
        run_names = {alias: aliases[name] for name, names in hf_aliases.items() for alias in names}
        source = with_base(source, base.tensors(prefix, run_names, run_dtype(source)))
    check_shapes(source, prefix, expected)
    # name -> where it is saved (without the prefix); a merged tensor also reads its module's adapters
    own = {name: present_key(prefix, names, source.shapes)[len(prefix) :] for name, names in aliases.items()}
    inputs = {name: [own[name], *(layout.inputs(name) if layout else [])] for name in own}

    # The plan needs only sizes: meta tensors of the saved shapes and the dtypes written, in the HF model's order.
    saved_dtypes = {name: source.dtypes[prefix + key] for name, key in own.items()}
    target = target_dtype(dtype, config)
    written = {name: written_dtype(saved, target) for name, saved in saved_dtypes.items()}
    planned = {name: torch.empty(source.shapes[prefix + own[name]], dtype=written[name], device="meta") for name in own}
    try:
        plan = split_torch_state_dict_into_shards(planned, filename_pattern=_WEIGHTS, max_shard_size=max_shard_size)
    except ValueError as error:
        raise ValueError(f"`max_shard_size={max_shard_size!r}`: {error}") from error
    staging = staging_path(out_dir)
    staging.mkdir(parents=True)
    try:
        for file, names in plan.filename_to_tensors.items():
            with source.read({prefix + key: key for name in names for key in inputs[name]}) as tensors:
                shard = {}
                for name in names:
                    tensor = layout.merged(name, tensors) if layout and name in layout.owners else tensors[own[name]]
                    shard[name] = tensor.to(written[name]).contiguous()
                # `{"format": "pt"}` as save_pretrained writes it (transformers 4 refuses files without it).
                save_file(shard, staging / file, {"format": "pt"})
            del tensors, shard  # before the next shard is read, not after
            # What the shard's reads freed goes back to the OS: otherwise glibc keeps the fragments and each shard
            # starts higher (measured: +72..122 MiB left after 5 shards of 100MB from a sharded checkpoint).
            release_freed_heap()
        if plan.is_sharded:
            index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
            (staging / _INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        copy_config_files(config_dir, staging, config_dtype(target, planned.values()))
        publish(staging, out_dir, replace=False)
    finally:
        discard(staging)  # left there only if something failed
    return HFExport(out_dir, prefix, sorted(plan.filename_to_tensors), len(planned), plan.metadata["total_size"])


def export_adapter(
    checkpoint: str | Path,
    out_dir: str | Path,
    config_dir: str | Path,
    prefix: str | None = None,
    auto_class: Any = None,
    lora_config: Any = None,
) -> HFExport:
    """Write the LoRA adapter of the peft model inside ``checkpoint`` for ``PeftModel.from_pretrained(base, out_dir)``:
    ``adapter_config.json`` and ``adapter_model.safetensors``, by peft's own ``save_pretrained``.

    ``config_dir`` holds the base model's ``config.json``; ``prefix`` and ``auto_class`` as for :func:`export_hf`;
    ``lora_config`` the run's LoRA configuration (default: from the checkpoint's hyper-parameters; see
    :func:`~lightning_shard.hf.peft_export.read_lora_config`). Only the adapter tensors are read.

    Example:
        >>> export_adapter("out/last.ckpt", "out/adapter", "out/pretrained")  # doctest: +SKIP
        HFExport(out_dir=PosixPath('out/adapter'), prefix='model.', files=['adapter_model.safetensors'], ...)
    """
    checkpoint, out_dir, config_dir = Path(checkpoint), Path(out_dir), Path(config_dir)
    _check_paths(checkpoint, out_dir, config_dir)
    model = meta_model(load_config(config_dir), auto_class)
    source = open_checkpoint(checkpoint)
    peft_config = read_lora_config(lora_config, source.hyper_parameters, checkpoint)
    layout = PeftLayout.build(model, saved_names(model), peft_config)
    names = adapter_names(layout)
    # The whole peft model must be there (the right --config and LoRA configuration), though only adapters are read.
    expected = with_names(layout.aliases, names.values())
    prefix = resolve_prefix(prefix, source, expected)
    check_shapes(source, prefix, {name: layout.shapes[name] for names in expected.values() for name in names})
    staging = staging_path(out_dir)
    staging.mkdir(parents=True)
    try:
        with source.read({prefix + name: name for name in names.values()}) as tensors:
            save_adapter(layout, tensors, staging)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
        publish(staging, out_dir, replace=False)
    finally:
        discard(staging)  # left there only if something failed
    return HFExport(out_dir, prefix, [ADAPTER_WEIGHTS], len(names), total)


def _check_paths(checkpoint: Path, out_dir: Path, config_dir: Path) -> None:
    if not checkpoint.exists():
        raise FileNotFoundError(f"Checkpoint not found: {checkpoint}")
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {config_dir}: `--config` is the directory of config.json.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"The output directory {out_dir} exists and is not empty; choose a new one or empty it.")
