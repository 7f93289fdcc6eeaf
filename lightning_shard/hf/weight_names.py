"""The Hugging Face model's weight names, and where a checkpoint holds them.

Takes the model's ``config.json`` (built on the meta device: :func:`meta_model`) and a checkpoint's weight names;
gives the names ``save_pretrained`` writes, each with its tied aliases (:func:`saved_names`: HF's own
``remove_tied_weights_from_state_dict``; GPT-2 keeps ``transformer.wte.weight`` and drops ``lm_head.weight``), the
LightningModule's attribute prefix under which the checkpoint holds them all (``model.`` for
``self.model = AutoModelForCausalLM...``: :func:`find_prefix`, or given and checked: :func:`resolve_prefix`), and
errors that name what does not fit (:func:`check_shapes`).

Example:
    >>> find_prefix({"model.lm_head.weight": (4, 2), "loss.weight": (4,)}, {"lm_head.weight": ["lm_head.weight"]})
    'model.'
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard.checkpoint.integrity import _listed, mismatch_problems
from lightning_shard.hf.checkpoint_weights import CheckpointWeights


def meta_model(config: Any, auto_class: Any) -> nn.Module:
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


def resolve_prefix(prefix: str | None, source: CheckpointWeights, aliases: Mapping[str, list[str]]) -> str:
    """``prefix`` normalised and checked, or found when ``None``: the one under which ``source`` holds ``aliases``."""
    if prefix is None:
        return find_prefix(source.names, aliases, source.path)
    prefix = prefix.rstrip(".") + "." if prefix.rstrip(".") else ""  # "model" and "model." alike
    _check_prefix(prefix, source, aliases)
    return prefix


def with_names(aliases: Mapping[str, list[str]], names: Iterable[str]) -> dict[str, list[str]]:
    """``aliases`` plus an entry for each of ``names`` that none of them covers: all of it must be in the checkpoint."""
    covered = {alias for candidates in aliases.values() for alias in candidates}
    return {**aliases, **{name: [name] for name in names if name not in covered}}


def _check_prefix(prefix: str, source: CheckpointWeights, aliases: Mapping[str, list[str]]) -> None:
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


def present_key(prefix: str, names: list[str], saved: Mapping[str, Any]) -> str:
    """The checkpoint key of a weight named ``names[0]``: itself, or the first of its tied aliases that was saved."""
    return next(prefix + alias for alias in names if prefix + alias in saved)


def check_shapes(source: CheckpointWeights, prefix: str, expected: Mapping[str, torch.Size]) -> None:
    """The shapes saved under ``prefix`` against ``expected`` (name without the prefix -> the model's shape)."""
    saved = {name: source.shapes[prefix + name] for name in expected if prefix + name in source.shapes}
    problems = mismatch_problems(saved, expected, strict=False)
    if problems:
        raise ValueError(
            f"The checkpoint {source.path} does not fit the model built from the config: {'; '.join(problems)}."
        )
