"""The plan ``tensor_parallel_plan="auto"`` applies to litgpt's ``GPT``, which declares none.

Split: the vocabulary of the token embedding (row-wise) and of ``lm_head`` (column-wise, the logits gathered for the
loss), and each block's MLP (``LLaMAMLP`` / ``GemmaMLP``: ``fc_1`` and ``fc_2`` column-wise, ``proj`` row-wise;
``GptNeoxMLP``: ``fc``, ``proj``) - most of a Llama-style model's parameters. Attention stays whole on every
tensor-parallel rank: litgpt fuses q, k and v into one ``attn.qkv`` of blocks ``[q | k | v]`` whose sizes differ under
grouped queries, and reads its head counts from the model's one shared ``Config``, so no column-wise split of it
gives each rank whole heads without changing litgpt's layout. To split attention as well, pass a
``parallelize_fn(model, tp_mesh)`` of your own.

litgpt is not imported: its models are recognised by class name.
"""

from __future__ import annotations

from torch import nn

from lightning_shard.tensor_parallel.plan import ResolvedPlan, module_plan, register_plan_source

# MLP classes: their layers into the hidden units (column-wise) and out of them (row-wise).
_MLPS = {
    "LLaMAMLP": (("fc_1", "fc_2"), "proj"),
    "GemmaMLP": (("fc_1", "fc_2"), "proj"),
    "GptNeoxMLP": (("fc",), "proj"),
}


def litgpt_plans(model: nn.Module, size: int) -> list[ResolvedPlan] | None:
    """The plans of the outermost litgpt ``GPT`` models in ``model``; ``None`` when it holds none.

    Example:
        >>> litgpt_plans(nn.Linear(2, 2), 2) is None
        True
    """
    origin = "litgpt GPT's plan (lightning-shard)"
    return [module_plan(gpt, _patterns(gpt), origin, prefix) for prefix, gpt in _outermost(model)] or None


def _patterns(gpt: nn.Module) -> dict[str, str]:
    patterns = {"transformer.wte": "rowwise", "lm_head": "colwise_gather_output"}
    mlp_classes = {type(block.mlp).__name__ for block in gpt.transformer.h}
    for name in sorted(mlp_classes & _MLPS.keys()):
        into, out = _MLPS[name]
        patterns |= {f"transformer.h.*.mlp.{layer}": "colwise" for layer in into}
        patterns[f"transformer.h.*.mlp.{out}"] = "rowwise"
    return patterns


def _outermost(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if type(module).__module__ == "litgpt.model" and type(module).__name__ == "GPT":
            found.append((prefix, module))
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return found


register_plan_source(litgpt_plans)
