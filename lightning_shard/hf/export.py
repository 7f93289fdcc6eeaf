"""Export the Hugging Face model inside a Lightning checkpoint as a directory ``from_pretrained`` loads.

``export_hf`` turns a sharded (torch.distributed.checkpoint directory) or full (one ``torch.save`` file) checkpoint
written by :class:`~lightning_shard.ShardedCheckpointIO` into ``config.json`` (+ ``generation_config.json`` and
tokenizer files when the config directory has them) and safetensors shards, as HF's ``save_pretrained`` writes them:
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.

* Names: the HF model is built on the meta device from the config; its state dict names, less tied aliases as HF's
  own ``remove_tied_weights_from_state_dict`` drops them (GPT-2 keeps ``transformer.wte.weight`` and drops
  ``lm_head.weight``), are looked up in the checkpoint under the LightningModule's attribute prefix (``model.`` for
  ``self.model = AutoModelForCausalLM...``), which is found by matching, or given.
* Memory: the output is split into shards of at most ``max_shard_size`` with huggingface_hub's
  ``split_torch_state_dict_into_shards`` (what ``save_pretrained`` uses), planned from the checkpoint's metadata, and
  written one shard at a time: only that shard's tensors are read (DCP reads of the chosen keys; a full file is
  memory-mapped and released after each shard), so one process holds at most one shard, never the whole model.
* dtype: the floating-point tensors are written in the dtype ``config.json`` names (``"dtype"``, older
  ``"torch_dtype"``), as ``save_pretrained`` of the original model writes them: a bf16 model fine-tuned under
  ``"bf16-mixed"`` (fp32 master weights in the checkpoint) comes out in bf16. ``dtype="checkpoint"`` keeps the
  checkpoint's (or name one, ``"float32"``); ``config.json`` is then rewritten by transformers to name it, so the
  files and the config never disagree.
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

import dataclasses
import json
import shutil
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint.averaged import AVERAGED_NAME_PREFIX, averaged_key, top_level_keys
from lightning_shard.checkpoint.integrity import (
    _listed,
    check_sharded,
    full_model_shapes,
    load_full_file,
    mismatch_problems,
    read_metadata,
)
from lightning_shard.checkpoint.layout import LAYOUT_KEY, MODEL_KEY, StateLayout
from lightning_shard.checkpoint.publish import discard, publish, staging_path
from lightning_shard.checkpoint.read import _recorded_layout, is_sharded_checkpoint, read_sharded_keys
from lightning_shard.cpu.heap import release_freed_heap
from lightning_shard.hf.frozen_export import BaseTensor, PretrainedBase
from lightning_shard.hf.frozen_weights import read_record
from lightning_shard.hf.peft_export import ADAPTER_WEIGHTS, PeftLayout, adapter_names, read_lora_config, save_adapter

DEFAULT_MAX_SHARD_SIZE = "5GB"
Weights = Literal["trained", "averaged"]
# Copied next to the weights when the config directory has them, so the export is a complete HF model directory.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
_WEIGHTS = "model{suffix}.safetensors"  # HF's SAFE_WEIGHTS_NAME with its shard suffix
_INDEX_FILE = "model.safetensors.index.json"
HYPER_PARAMETERS_KEY = LightningModule.CHECKPOINT_HYPER_PARAMS_KEY


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
    config = _load_config(config_dir)
    model = _meta_model(config, auto_class)
    hf_aliases = aliases = saved_names(model)
    source = _open_checkpoint(checkpoint, weights)
    base = None
    if source.record is not None:  # a small checkpoint: the files its frozen weights come from, checked first
        base = PretrainedBase.open(checkpoint, source.record, config_dir, _meta_model(config, auto_class))
    layout = None
    if merge_lora:
        layout = PeftLayout.build(model, aliases, read_lora_config(lora_config, source.hyper_parameters, checkpoint))
        aliases = layout.aliases
        read = _with_names(aliases, (name for names in layout.module_inputs.values() for name in names))
        prefix = _resolve_prefix(prefix, source, read)
        expected = {name: layout.shapes[name] for names in read.values() for name in names}
    else:
        prefix = _resolve_prefix(prefix, source, aliases)
        state = model.state_dict()
        expected = {alias: state[name].shape for name, names in aliases.items() for alias in names}
    if base is not None:
        run_names = {alias: aliases[name] for name, names in hf_aliases.items() for alias in names}
        source = _with_base(source, base.tensors(prefix, run_names, _run_dtype(source)))
    _check_shapes(source, prefix, expected)
    # name -> where it is saved (without the prefix); a merged tensor also reads its module's adapters
    own = {name: _present_key(prefix, names, source.shapes)[len(prefix) :] for name, names in aliases.items()}
    inputs = {name: [own[name], *(layout.inputs(name) if layout else [])] for name in own}

    # The plan needs only sizes: meta tensors of the saved shapes and the dtypes written, in the HF model's order.
    saved_dtypes = {name: source.dtypes[prefix + key] for name, key in own.items()}
    target = _target_dtype(dtype, config)
    written = {name: _written(saved, target) for name, saved in saved_dtypes.items()}
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
        _copy_config_files(config_dir, staging, _config_dtype(target, planned.values()))
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
    model = _meta_model(_load_config(config_dir), auto_class)
    source = _open_checkpoint(checkpoint)
    peft_config = read_lora_config(lora_config, source.hyper_parameters, checkpoint)
    layout = PeftLayout.build(model, saved_names(model), peft_config)
    names = adapter_names(layout)
    # The whole peft model must be there (the right --config and LoRA configuration), though only adapters are read.
    expected = _with_names(layout.aliases, names.values())
    prefix = _resolve_prefix(prefix, source, expected)
    _check_shapes(source, prefix, {name: layout.shapes[name] for names in expected.values() for name in names})
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


# ------------------------------------------------------------------ the HF model's names


def _load_config(config_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_dir, local_files_only=True)


def _meta_model(config: Any, auto_class: Any) -> nn.Module:
    """The HF model of ``config``, parameters on the meta device (no memory, no download)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return (auto_class or AutoModelForCausalLM).from_config(config)


def saved_names(model: nn.Module) -> dict[str, list[str]]:
    """The names HF saves (its state dict less tied aliases), each with its aliases: ``{kept: [kept, *aliases]}``.

    Example:
        >>> saved_names(gpt2_on_meta)["transformer.wte.weight"]  # doctest: +SKIP
        ['transformer.wte.weight', 'lm_head.weight']
    """
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    # Tied names share one Parameter object (meta tensors have no storage to compare).
    names_of: dict[int, list[str]] = {}
    for name in state:
        names_of.setdefault(id(model.get_parameter_or_buffer(name)), []).append(name)
    return {
        name: [name, *(alias for alias in names_of[id(model.get_parameter_or_buffer(name))] if alias != name)]
        for name in kept
    }


def find_prefix(saved: Collection[str], aliases: Mapping[str, list[str]], checkpoint: Path | str = "") -> str:
    """The one prefix ``p`` under which ``saved`` (a checkpoint's weight names) holds every HF weight (``p + name`` or
    an alias of it).

    Example:
        >>> find_prefix({"model.lm_head.weight": (4, 2), "loss.weight": (4,)}, {"lm_head.weight": ["lm_head.weight"]})
        'model.'
    """
    counts = _prefix_counts(saved, aliases)
    complete = sorted(p for p, n in counts.items() if n == len(aliases))
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise ValueError(
            f"The checkpoint {checkpoint} holds the model's {len(aliases)} weights under several prefixes: "
            f"{', '.join(map(repr, complete))}. Choose one with `--prefix` (`prefix=`)."
        )
    raise ValueError(_no_prefix_message(checkpoint, saved, aliases, counts))


def _prefix_counts(saved: Collection[str], aliases: Mapping[str, list[str]]) -> dict[str, int]:
    """Prefix -> how many HF weights the checkpoint holds under it (each weight counted once, by any alias)."""
    owner = {alias: name for name, names in aliases.items() for alias in names}
    found: dict[str, set[str]] = {}
    for key in saved:
        # Every split of `key` at a dot (and the whole key) is a candidate `prefix + name`.
        for cut in [0, *(i + 1 for i, char in enumerate(key) if char == ".")]:
            if key[cut:] in owner:
                found.setdefault(key[:cut], set()).add(owner[key[cut:]])
    return {p: len(names) for p, names in found.items()}


def _no_prefix_message(
    checkpoint: Path | str, saved: Collection[str], aliases: Mapping[str, list[str]], counts: Mapping[str, int]
) -> str:
    best = sorted(counts.items(), key=lambda item: -item[1])[:3]
    closest = "; ".join(f"{p!r} holds {n} of {len(aliases)}" for p, n in best) or "none holds any"
    adapters = sorted(key for key in saved if ".lora_A." in key)
    lora = (
        f" It holds LoRA adapters ({_listed(adapters)}): `--merge-lora` writes the model with them merged, "
        "`--adapter-only` the adapter alone; a LoRA configuration other than the run's (`--lora-config`) names "
        "other weights."
        if adapters
        else ""
    )
    return (
        f"The checkpoint {checkpoint} does not hold all {len(aliases)} weights of the model built from the config "
        f"under any one prefix ({closest}). Its weights: {_listed(sorted(saved))}. Is `--config` the model that "
        f"was trained?{lora}"
    )


def _resolve_prefix(prefix: str | None, source: _Checkpoint, aliases: Mapping[str, list[str]]) -> str:
    """``prefix`` normalised and checked, or found when ``None``: the one under which ``source`` holds ``aliases``."""
    if prefix is None:
        return find_prefix(source.names, aliases, source.path)
    prefix = prefix.rstrip(".") + "." if prefix.rstrip(".") else ""  # "model" and "model." alike
    _check_prefix(prefix, source, aliases)
    return prefix


def _with_names(aliases: Mapping[str, list[str]], names: Iterable[str]) -> dict[str, list[str]]:
    """``aliases`` plus an entry for each of ``names`` that none of them covers: all of it must be in the checkpoint."""
    covered = {alias for candidates in aliases.values() for alias in candidates}
    return {**aliases, **{name: [name] for name in names if name not in covered}}


def _check_prefix(prefix: str, source: _Checkpoint, aliases: Mapping[str, list[str]]) -> None:
    missing = [name for name, names in aliases.items() if not any(prefix + alias in source.names for alias in names)]
    if not missing:
        return
    counts = _prefix_counts(source.names, aliases)
    complete = sorted(p for p, n in counts.items() if n == len(aliases))
    found = f"the weights are under {', '.join(map(repr, complete))}" if complete else "no prefix holds them all"
    raise ValueError(
        f"The checkpoint {source.path} has no weights under `prefix={prefix!r}` for {_listed(missing)} "
        f"({found}). Pass one of those, or leave `--prefix` out to find it automatically."
    )


def _present_key(prefix: str, names: list[str], saved: Mapping[str, Any]) -> str:
    """The checkpoint key of a weight named ``names[0]``: itself, or the first of its tied aliases that was saved."""
    return next(prefix + alias for alias in names if prefix + alias in saved)


def _check_shapes(source: _Checkpoint, prefix: str, expected: Mapping[str, torch.Size]) -> None:
    """The shapes saved under ``prefix`` against ``expected`` (name without the prefix -> the model's shape)."""
    saved = {name: source.shapes[prefix + name] for name in expected if prefix + name in source.shapes}
    problems = mismatch_problems(saved, expected, strict=False)
    if problems:
        raise ValueError(
            f"The checkpoint {source.path} does not fit the model built from the config: {'; '.join(problems)}."
        )


# ------------------------------------------------------------------ the dtype written, and config.json naming it


def _target_dtype(dtype: str | torch.dtype, config: Any) -> torch.dtype | None:
    """The dtype floating-point tensors are written in; ``None``: each keeps the checkpoint's."""
    if dtype == "checkpoint":
        return None
    if dtype == "config":
        dtype = config.dtype  # None when config.json names none
        if dtype is None:
            return None
    target = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: use 'config', 'checkpoint' or a floating-point dtype such as 'bfloat16'.")
    return target


def _written(saved: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and saved.is_floating_point else saved


def _config_dtype(target: torch.dtype | None, tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """What ``config.json`` names: the dtype written, or (checkpoint dtypes) that of most floating-point elements."""
    if target is not None:
        return target
    counts: dict[torch.dtype, int] = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _copy_config_files(config_dir: Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """The config, generation config and tokenizer files of ``config_dir``; ``config.json`` rewritten by transformers
    (as ``save_pretrained`` writes it) when it does not name ``dtype``."""
    for name in CONFIG_FILES + TOKENIZER_FILES:
        if (config_dir / name).is_file():
            shutil.copy2(config_dir / name, out_dir / name)
    config = _load_config(config_dir)  # as the file says, not as building a model left it
    if dtype is not None and _target_dtype("config", config) != dtype:
        config.dtype = dtype
        config.save_pretrained(out_dir)


# ------------------------------------------------------------------ reading the checkpoint, a few keys at a time


@dataclass
class _Checkpoint:
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


def _open_checkpoint(path: Path, weights: Weights = "trained") -> _Checkpoint:
    if is_sharded_checkpoint(path):
        metadata = check_sharded(path)
        entry, prefix = _weights_entry(path, weights, _recorded_layout(path, metadata), top_level_keys(metadata))
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
        return _Checkpoint(path, shapes, dtypes, read_sharded, read_hyper_parameters, read_record(path))
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
        return _Checkpoint(
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


def _with_base(source: _Checkpoint, base: Mapping[str, BaseTensor]) -> _Checkpoint:
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


def _run_dtype(source: _Checkpoint) -> torch.dtype | None:
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


def _check_paths(checkpoint: Path, out_dir: Path, config_dir: Path) -> None:
    if not checkpoint.exists():
        raise FileNotFoundError(f"Checkpoint not found: {checkpoint}")
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {config_dir}: `--config` is the directory of config.json.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"The output directory {out_dir} exists and is not empty; choose a new one or empty it.")
