"""peft's LoRA adapters on a tensor-parallel base layer: the adapters follow their base layer's plan.

peft's ``get_peft_model`` replaces an adapted ``nn.Linear`` (``q_proj``) by a ``lora.Linear`` that holds the original
as ``base_layer`` and adds ``lora_A[adapter]`` (in -> r) and ``lora_B[adapter]`` (r -> out), computing
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. A plan entry naming ``q_proj`` then goes to ``base_layer``,
and of the adapters the one that touches the split dimension takes the same style, so that both terms of the sum
come out with the same layout:

* column-wise base (output features split): ``lora_B`` column-wise too (its output is this rank's slice of the
  features), ``lora_A`` replicated (its input is the whole ``x`` every rank holds);
* row-wise base (input features split, the partial outputs summed): ``lora_A`` row-wise too (its input is this
  rank's slice of ``x``; its output summed over the ranks), ``lora_B`` replicated.

Found by duck typing, without importing peft.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

SplitKind = Literal["colwise", "rowwise"]


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer around a base layer (``lora.Linear`` and its kin).

    Example:
        >>> is_lora_layer(nn.Linear(2, 2))
        False
    """
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def adapted_targets(name: str, module: nn.Module, kind: SplitKind | None) -> list[tuple[str, nn.Module]]:
    """The modules a plan entry for ``module`` (named ``name``) applies to: ``module`` itself, or for a LoRA layer its
    base layer and the adapters that follow its split (module docstring).

    Raises:
        ValueError: a LoRA layer under a style that is neither column- nor row-wise (an embedding's, a norm's), or
            with adapters whose split has no such rule (DoRA's magnitude vector, LoRA embeddings).

    Example:
        >>> adapted_targets("mlp.fc", nn.Linear(2, 2), "colwise")[0][0]
        'mlp.fc'
    """
    if not is_lora_layer(module):
        return [(name, module)]
    extra = [attr for attr in ("lora_magnitude_vector", "lora_embedding_A") if len(getattr(module, attr, ()) or ())]
    if kind is None or extra:
        what = f"its {extra[0]}" if extra else "this style"
        raise ValueError(
            f"`{name}` is a peft LoRA layer whose tensor-parallel plan entry cannot be carried over to its adapters "
            f"({what}): adapters follow column-wise and row-wise linear layers only. Leave `{name}` out of the "
            "tensor-parallel plan (replicated), or out of the LoRA `target_modules`."
        )
    adapters = module.lora_B if kind == "colwise" else module.lora_A
    side = "lora_B" if kind == "colwise" else "lora_A"
    return [(f"{name}.base_layer", module.base_layer)] + [
        (f"{name}.{side}.{adapter}", layer) for adapter, layer in adapters.items()
    ]
