"""transformers models' own tensor-parallel plans, applied by transformers' own code (``tensor_parallel_plan="auto"``).

A ``PreTrainedModel`` carries its plan as ``tp_plan``: its config's ``base_model_tp_plan`` under the base model's
prefix, the vocabulary-split input embedding transformers adds to it, and the class's own entries (``lm_head:
colwise_gather_output``), with ``*`` standing for layer numbers. When transformers loads a model with ``tp_plan`` it
expands those rules to one entry per module and per parameter (``_expand_parallel_plan``) before calling
``transformers.distributed.tensor_parallel.apply_tensor_parallelism``, which splits only the entries that name a
parameter and installs the forward of those that name a module - a rule left at module level would split nothing.
Here: the same expansion and the same function, on the tensor-parallel mesh dimension, before ``fully_shard``; a peft
LoRA layer's entry moved to its base layer and the adapter that follows it
(:mod:`lightning_shard.tensor_parallel.lora`).

transformers stays optional: a model is looked at only if transformers is already imported and says it is one of its.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_shard.hf.init import outermost_pretrained_models
from lightning_shard.tensor_parallel.lora import SplitKind, adapted_targets
from lightning_shard.tensor_parallel.plan import ResolvedPlan, check_ties, register_plan_source


def transformers_plans(model: nn.Module, size: int) -> list[ResolvedPlan] | None:
    """The plans of the outermost transformers models in ``model``; ``None`` when it holds none.

    Raises:
        ValueError: a transformers model without a plan (empty ``base_model_tp_plan``), or whose attention heads
            ``size`` does not divide.

    Example:
        >>> transformers_plans(nn.Linear(2, 2), 2) is None
        True
    """
    return [_plan(hf_model) for hf_model in outermost_pretrained_models(model)] or None


def _plan(hf_model: nn.Module) -> ResolvedPlan:
    name = type(hf_model).__name__
    rules = dict(getattr(hf_model, "tp_plan", None) or {})
    if not rules:
        raise ValueError(
            f"{name} has no tensor-parallel plan (its config's `base_model_tp_plan` is empty), so "
            "`tensor_parallel_plan='auto'` cannot split it. Pass the plan yourself: a dict of module-name patterns to "
            "styles or a callable `parallelize_fn(model, tp_mesh)`."
        )
    expand = getattr(hf_model, "_expand_parallel_plan", None)
    if expand is None:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} does not expand tensor-parallel plans as the version this was "
            "built on does (5.24: `PreTrainedModel._expand_parallel_plan`); upgrade transformers, or pass the plan "
            "as a dict of module-name patterns to styles."
        )
    entries = _follow_adapters(hf_model, expand(rules))
    origin = f"{name}.tp_plan (transformers)"
    modules = dict(hf_model.named_modules())
    split = {id(modules[entry]) for entry in entries if entry in modules}
    checks = [partial(_check_heads, hf_model, origin), partial(check_ties, hf_model, split, origin)]
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    splits = [params[name] for name, style in entries.items() if name in params and _splits(name, style)]
    return ResolvedPlan(origin, partial(_apply, hf_model, entries), checks, splits)


def _apply(hf_model: nn.Module, entries: dict[str, str], mesh: DeviceMesh) -> None:
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    apply_tensor_parallelism(hf_model, mesh, entries)


def _follow_adapters(hf_model: nn.Module, expanded: dict[str, str]) -> dict[str, str]:
    """``expanded`` with each entry for a peft LoRA layer replaced by entries for its base layer and the adapter that
    follows its split (module and parameters, parameters first, as transformers expands them)."""
    modules = dict(hf_model.named_modules())
    entries: dict[str, str] = {}
    for name, style in expanded.items():
        module = modules.get(name)
        if module is None:  # a parameter entry: its module's entry follows it
            entries[name] = style
            continue
        for target_name, target in adapted_targets(name, module, _split_kind(style)):
            if target is not module:
                entries.update({f"{target_name}.{param}": style for param, _ in target.named_parameters(recurse=False)})
            entries[target_name] = style
    return entries


def _splits(parameter: str, style: str) -> bool:
    """Whether ``style`` splits ``parameter`` (a row-wise layer's bias is replicated: added after the sum)."""
    kind = _split_kind(style)
    if kind == "rowwise":
        return not parameter.endswith(".bias")
    return kind == "colwise" or style.startswith("embedding_")


def _split_kind(style: str) -> SplitKind | None:
    if style.startswith(("colwise", "packed_colwise")):
        return "colwise"
    if style.startswith(("rowwise", "packed_rowwise")):
        return "rowwise"
    return None


def _check_heads(hf_model: nn.Module, origin: str, size: int) -> None:
    config: Any = hf_model.config.get_text_config()
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(
                f"{origin}: `tensor_parallel_size={size}` does not divide the model's {field}={heads}; every rank "
                "computes whole attention heads. Choose a tensor-parallel size that divides it."
            )


register_plan_source(transformers_plans)
