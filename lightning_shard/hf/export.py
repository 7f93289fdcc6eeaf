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
* Atomic: written into a hidden sibling of the output directory and renamed into place at the end.

transformers, huggingface_hub and safetensors (the ``[hf]`` extra) are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint.integrity import (
    _listed,
    check_sharded,
    full_model_shapes,
    load_full_file,
    mismatch_problems,
)
from lightning_shard.checkpoint.io import MODEL_KEY, _replace, _staging_path, is_sharded_checkpoint, read_sharded_keys
from lightning_shard.cpu.heap import release_freed_heap

DEFAULT_MAX_SHARD_SIZE = "5GB"
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
) -> HFExport:
    """Write the HF model inside ``checkpoint`` to ``out_dir`` for ``auto_class.from_pretrained(out_dir)``.

    Args:
        checkpoint: a sharded checkpoint directory or a full checkpoint file of :class:`ShardedCheckpointIO`.
        out_dir: the new directory; it must not exist or be empty.
        config_dir: a directory with the model's ``config.json`` (e.g. the pretrained model it was fine-tuned from).
        prefix: the LightningModule's attribute prefix of the HF model in the checkpoint's ``state_dict``
            (``"model."``); ``None`` finds it by matching the HF model's parameter names.
        max_shard_size: the largest safetensors file, in bytes or as ``"5GB"`` / ``"500MB"``; one shard is what the
            export holds in memory at a time.
        auto_class: the transformers auto class that builds the model from the config (``AutoModelForCausalLM``).

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
    model = _meta_model(config_dir, auto_class)
    aliases = saved_names(model)
    source = _open_checkpoint(checkpoint)
    if prefix is None:
        prefix = find_prefix(source.shapes, aliases, checkpoint)
    else:
        prefix = prefix.rstrip(".") + "." if prefix.rstrip(".") else ""  # "model" and "model." alike
        _check_prefix(prefix, source, aliases)
    keys = {name: _present_key(prefix, names, source.shapes) for name, names in aliases.items()}
    _check_shapes(checkpoint, source.shapes, keys, model)

    # The plan needs only sizes: meta tensors of the saved shapes and dtypes, in the HF model's order.
    planned = {name: torch.empty(source.shapes[k], dtype=source.dtypes[k], device="meta") for name, k in keys.items()}
    try:
        plan = split_torch_state_dict_into_shards(planned, filename_pattern=_WEIGHTS, max_shard_size=max_shard_size)
    except ValueError as error:
        raise ValueError(f"`max_shard_size={max_shard_size!r}`: {error}") from error
    staging = _staging_path(out_dir)
    staging.mkdir(parents=True)
    try:
        for file, names in plan.filename_to_tensors.items():
            with source.read({keys[name]: name for name in names}) as tensors:
                # `{"format": "pt"}` as save_pretrained writes it (transformers 4 refuses files without it).
                save_file({name: t.contiguous() for name, t in tensors.items()}, staging / file, {"format": "pt"})
            del tensors  # before the next shard is read, not after
            # What the shard's reads freed goes back to the OS: otherwise glibc keeps the fragments and each shard
            # starts higher (measured: +72..122 MiB left after 5 shards of 100MB from a sharded checkpoint).
            release_freed_heap()
        if plan.is_sharded:
            index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
            (staging / _INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name in CONFIG_FILES + TOKENIZER_FILES:
            if (config_dir / name).is_file():
                shutil.copy2(config_dir / name, staging / name)
        _replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return HFExport(out_dir, prefix, sorted(plan.filename_to_tensors), len(planned), plan.metadata["total_size"])


# ------------------------------------------------------------------ the HF model's names


def _meta_model(config_dir: Path, auto_class: Any) -> nn.Module:
    """The HF model of ``config_dir/config.json``, parameters on the meta device (no memory, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
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


def find_prefix(saved: Mapping[str, Any], aliases: Mapping[str, list[str]], checkpoint: Path | str = "") -> str:
    """The one prefix ``p`` under which ``saved`` holds every HF weight (``p + name`` or an alias of it).

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


def _prefix_counts(saved: Mapping[str, Any], aliases: Mapping[str, list[str]]) -> dict[str, int]:
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
    checkpoint: Path | str, saved: Mapping[str, Any], aliases: Mapping[str, list[str]], counts: Mapping[str, int]
) -> str:
    best = sorted(counts.items(), key=lambda item: -item[1])[:3]
    closest = "; ".join(f"{p!r} holds {n} of {len(aliases)}" for p, n in best) or "none holds any"
    return (
        f"The checkpoint {checkpoint} does not hold all {len(aliases)} weights of the model built from the config "
        f"under any one prefix ({closest}). Its weights: {_listed(sorted(saved))}. Is `--config` the model that "
        "was trained?"
    )


def _check_prefix(prefix: str, source: _Checkpoint, aliases: Mapping[str, list[str]]) -> None:
    missing = [name for name, names in aliases.items() if not any(prefix + alias in source.shapes for alias in names)]
    if not missing:
        return
    counts = _prefix_counts(source.shapes, aliases)
    complete = sorted(p for p, n in counts.items() if n == len(aliases))
    found = f"the weights are under {', '.join(map(repr, complete))}" if complete else "no prefix holds them all"
    raise ValueError(
        f"The checkpoint {source.path} has no weights under `prefix={prefix!r}` for {_listed(missing)} "
        f"({found}). Pass one of those, or leave `--prefix` out to find it automatically."
    )


def _present_key(prefix: str, names: list[str], saved: Mapping[str, Any]) -> str:
    """The checkpoint key of a weight named ``names[0]``: itself, or the first of its tied aliases that was saved."""
    return next(prefix + alias for alias in names if prefix + alias in saved)


def _check_shapes(checkpoint: Path, saved: Mapping[str, Any], keys: Mapping[str, str], model: nn.Module) -> None:
    state = model.state_dict()
    problems = mismatch_problems(
        {name: saved[key] for name, key in keys.items()}, {name: state[name].shape for name in keys}, strict=False
    )
    if problems:
        raise ValueError(
            f"The checkpoint {checkpoint} does not fit the model built from the config: {'; '.join(problems)}."
        )


# ------------------------------------------------------------------ reading the checkpoint, a few keys at a time


@dataclass
class _Checkpoint:
    """A checkpoint's weights: shape and dtype by ``state_dict`` name, and ``with read({key: new_name}) as tensors``
    (the tensors are valid inside the ``with`` block only)."""

    path: Path
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]
    read: Callable[[Mapping[str, str]], AbstractContextManager[dict[str, torch.Tensor]]]


def _open_checkpoint(path: Path) -> _Checkpoint:
    if is_sharded_checkpoint(path):
        entries = {
            key[len(MODEL_KEY) + 1 :]: entry
            for key, entry in check_sharded(path).state_dict_metadata.items()
            if key.startswith(MODEL_KEY + ".") and isinstance(entry, TensorStorageMetadata)
        }

        @contextmanager
        def read_sharded(keys: Mapping[str, str]) -> Iterator[dict[str, torch.Tensor]]:
            weights = read_sharded_keys(path, {f"{MODEL_KEY}.{key}" for key in keys})[MODEL_KEY]
            yield {name: weights.pop(key) for key, name in keys.items()}

        shapes = {key: torch.Size(entry.size) for key, entry in entries.items()}
        return _Checkpoint(path, shapes, {key: entry.properties.dtype for key, entry in entries.items()}, read_sharded)
    if path.is_dir():
        raise ValueError(f"{path} is a directory without torch.distributed.checkpoint metadata (.metadata).")

    @contextmanager
    def read_full(keys: Mapping[str, str]) -> Iterator[dict[str, torch.Tensor]]:
        # A fresh mapping per shard, released after it: the file's pages do not pile up in this process.
        with _mapped_weights(path) as weights:
            yield {name: weights[key] for key, name in keys.items()}

    with _mapped_weights(path) as weights:
        tensors = {key: value for key, value in weights.items() if isinstance(value, torch.Tensor)}
        return _Checkpoint(
            path,
            full_model_shapes(tensors, path),
            {key: tensor.dtype for key, tensor in tensors.items()},
            read_full,
        )


@contextmanager
def _mapped_weights(path: Path) -> Iterator[dict[str, Any]]:
    """A full checkpoint's ``state_dict``, memory-mapped: tensors are read from the file only when touched."""
    checkpoint = load_full_file(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(MODEL_KEY), Mapping):
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no {MODEL_KEY!r} mapping of weights.")
    try:
        yield checkpoint[MODEL_KEY]
    finally:
        del checkpoint


def _check_paths(checkpoint: Path, out_dir: Path, config_dir: Path) -> None:
    if not checkpoint.exists():
        raise FileNotFoundError(f"Checkpoint not found: {checkpoint}")
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {config_dir}: `--config` is the directory of config.json.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"The output directory {out_dir} exists and is not empty; choose a new one or empty it.")
