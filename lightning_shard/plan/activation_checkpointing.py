"""Selective activation checkpointing: which ops of a checkpointed block keep their outputs for backward.

``activation_checkpointing="selective"`` checkpoints the blocks the ``"auto"`` policy names (``_no_split_modules``, else
the repeated block) with torchtitan's per-op policy (through
``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the expensive ops - matrix
multiplications, attention, the reduce-scatter of tensor parallelism with sequence parallelism - are saved, except every
second matrix multiplication's; everything cheap (norms, activations, dropout, views) is recomputed in backward. So
backward recomputes about half the matmuls, not the whole block, for about half the memory of no checkpointing.
``selective_checkpointing_ops`` replaces the list of saved ops (names of aten op overloads: ``"aten.mm.default"``,
``"aten._scaled_dot_product_flash_attention.default"``, ...).

The per-module form (``activation_checkpointing=["Block"]``: the whole block recomputed, its input alone kept) and
the memory-budget form under ``compile=True`` (``activation_memory_budget=0.5``: the compiler's min-cut partitioner
chooses what to recompute to keep about that fraction of the activations; torchtitan's ``memory_budget`` mode) are the
other two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_shard.torch_compat.dispatch import OpOverload

SELECTIVE = "selective"

# torchtitan's save list, plus the CPU kernels of the same ops (addmm: a linear layer with a bias).
DEFAULT_SAVED_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)
# The ops counted as matrix multiplications: every second one is recomputed.
_MATMULS = ("aten.mm.default", "aten.addmm.default")


def resolve_ops(names: Sequence[str]) -> set[OpOverload]:
    """The op overloads ``names`` name (``"aten.mm.default"``: ``torch.ops.aten.mm.default``).

    Raises:
        ValueError: a name that is not an op overload, naming it.

    Example:
        >>> resolve_ops(["aten.mm.default"]) == {torch.ops.aten.mm.default}
        True
    """
    ops = set()
    for name in names:
        namespace, _, rest = str(name).partition(".")
        op_name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
        except (AttributeError, RuntimeError) as error:
            raise ValueError(
                f"`selective_checkpointing_ops` names {name!r}, which is not an op overload; name them as "
                f"'namespace.op.overload', e.g. {list(DEFAULT_SAVED_OPS[:2])}."
            ) from error
        ops.add(op)
    return ops


def selective_context_fn(names: Sequence[str] | None = None) -> Callable[[], Any]:
    """``context_fn`` for ``torch.utils.checkpoint`` (and ``checkpoint_wrapper``): a fresh per-op policy for each
    checkpointed call, saving the outputs of ``names`` (default :data:`DEFAULT_SAVED_OPS`) but every second matmul's.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> checkpoint(layer, x, use_reentrant=False, context_fn=selective_context_fn()).shape
        torch.Size([2, 4])
    """
    saved = resolve_ops(names if names is not None else DEFAULT_SAVED_OPS)
    matmuls = resolve_ops(_MATMULS)
    return partial(_contexts, saved, matmuls)


def _contexts(saved: set[Any], matmuls: set[Any]) -> Any:
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # The recomputation runs the same ops in the same order: count them apart so both passes agree.
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
