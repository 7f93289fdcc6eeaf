"""The dtype an export writes its weights in, and the config files written beside them.

Takes the model's config directory and the ``dtype=`` of :func:`~lightning_shard.hf.export.export_hf`; gives the dtype
each floating-point tensor is written in (:func:`target_dtype`, :func:`written_dtype`: by default the one
``config.json`` names, ``"dtype"`` or older ``"torch_dtype"``, as ``save_pretrained`` of the original model writes it),
and copies ``config.json``, ``generation_config.json`` and the tokenizer files into the export
(:func:`copy_config_files`), ``config.json`` rewritten by transformers where it would name another dtype than the
files hold.

Example:
    >>> written_dtype(torch.float32, torch.bfloat16), written_dtype(torch.int64, torch.bfloat16)
    (torch.bfloat16, torch.int64)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

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


def load_config(config_dir: Path) -> Any:
    """The model's config, as ``config.json`` in ``config_dir`` says."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_dir, local_files_only=True)


def target_dtype(dtype: str | torch.dtype, config: Any) -> torch.dtype | None:
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


def written_dtype(saved: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and saved.is_floating_point else saved


def config_dtype(target: torch.dtype | None, tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """What ``config.json`` names: the dtype written, or (checkpoint dtypes) that of most floating-point elements."""
    if target is not None:
        return target
    counts: dict[torch.dtype, int] = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def copy_config_files(config_dir: Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """The config, generation config and tokenizer files of ``config_dir``; ``config.json`` rewritten by transformers
    (as ``save_pretrained`` writes it) when it does not name ``dtype``."""
    for name in CONFIG_FILES + TOKENIZER_FILES:
        if (config_dir / name).is_file():
            shutil.copy2(config_dir / name, out_dir / name)
    config = load_config(config_dir)  # as the file says, not as building a model left it
    if dtype is not None and target_dtype("config", config) != dtype:
        config.dtype = dtype
        config.save_pretrained(out_dir)
