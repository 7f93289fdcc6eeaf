"""A vocabulary-parallel loss: the output layer's logits stay split over the tensor-parallel ranks.

With a ``"loss_parallel"`` entry in the dict plan (the output layer, split column-wise as ``"colwise"`` does, its
logits left as DTensors split over the vocabulary instead of gathered), the Trainer strategy runs the step methods
and the backward inside torch's ``loss_parallel()``, so ``F.cross_entropy`` on those logits computes the softmax over
the split vocabulary with two small all-reduces instead of gathering batch x sequence x vocabulary logits on every
rank. What a step returns reaches Lightning as plain tensors: a DTensor replicated over its mesh (the loss) becomes
its local tensor, differentiably. What stays a DTensor is what the user's code sees of the logits (``.full_tensor()``
gathers them, e.g. to sample) and the loss inside the step (``self.log`` takes it as it is).

A Fabric loop enters ``torch.distributed.tensor.parallel.loss_parallel()`` itself, around the loss and its backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor

LOSS_PARALLEL_STYLE = "loss_parallel"


def uses_loss_parallel(plan: object) -> bool:
    """Whether the dict ``plan`` leaves an output layer's logits split for a vocabulary-parallel loss.

    Example:
        >>> uses_loss_parallel({"lm_head": "loss_parallel"}), uses_loss_parallel("auto")
        (True, False)
    """
    return isinstance(plan, Mapping) and any(style == LOSS_PARALLEL_STYLE for style in plan.values())


def local_outputs(output: Any) -> Any:
    """``output`` with each DTensor replicated over its whole mesh (a loss computed under ``loss_parallel()``)
    replaced by its local tensor, which carries the gradient back into the DTensor graph.

    Example:
        >>> local_outputs({"loss": 1.0})
        {'loss': 1.0}
    """
    return apply_to_collection(output, DTensor, _local_if_replicated)


def _local_if_replicated(tensor: DTensor) -> Any:
    return tensor.to_local() if all(placement.is_replicate() for placement in tensor.placements) else tensor
