"""Calling the model held by a LightningModule directly, outside the step methods.

FSDP gathers the root's parameters (embeddings, final norm, head - those in no smaller unit) only around the
root's ``forward`` and the methods registered as forward methods (Lightning's step methods). After ``fit`` a direct
call such as ``lightning_module.model.generate(...)`` or ``lightning_module.model(x)`` in a notebook would meet
sharded root parameters ("mixed torch.Tensor and DTensor"). So the ``forward`` and ``generate`` of each direct child
of the root that holds parameters run inside the root's FSDP forward hooks when the root's parameters are not
gathered already (inside a step method they are, and the call goes straight through). Every rank must make the
same calls: each gathers collectively. Hugging Face models are marked as FSDP-managed, so their ``generate`` keeps
all ranks stepping together until every rank has finished (``synced_gpus``).

Gathered copies must never outlive a change of the sharded values they were gathered from. FSDP's root keeps its
parameters gathered after its forward (backward needs them first) and drops them at the end of backward; a call
made after backward - a callback in ``on_before_optimizer_step``, ``generate`` after fit - would leave them gathered
with the values from before the next optimizer step or checkpoint load, and the next forward would use those. So a
direct call drops what it gathered, and the strategy drops every gathered copy after each optimizer step and each
checkpoint load (:func:`drop_gathered_parameters`).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_shard.hf.init import is_pretrained_model
from lightning_shard.torch_compat.fsdp import call_as_fsdp_forward, root_is_gathered

_METHODS = ("forward", "generate")


def gather_root_for_direct_calls(root: FSDPModule) -> None:
    """Make the direct children of the sharded ``root`` callable on their own (see module docstring).

    Example:
        >>> gather_root_for_direct_calls(sharded_lightning_module)  # doctest: +SKIP
        >>> sharded_lightning_module.model.generate(input_ids, max_new_tokens=8)  # doctest: +SKIP
    """
    if is_pretrained_model(root):
        root._is_fsdp_managed_module = True  # a Fabric model: the root itself is the transformers model
    for child in root.children():
        if is_pretrained_model(child):
            # What transformers' own FSDP2 setup sets: `generate` then defaults to `synced_gpus=True`.
            child._is_fsdp_managed_module = True
        if isinstance(child, FSDPModule) or type(child).forward is nn.Module.forward:
            continue  # a unit gathers its own parameters; a container (ModuleList, ModuleDict) is never called
        if next(child.parameters(), None) is None:
            continue  # nothing to gather (a torchmetrics metric)
        for name in _METHODS:
            if callable(getattr(child, name, None)):
                setattr(child, name, _gathering_root(root, getattr(child, name)))


def drop_gathered_parameters(model: nn.Module) -> None:
    """Reshard every FSDP unit of ``model`` that holds gathered parameters (see module docstring): call after the
    sharded values change, so that the next forward gathers them anew. A no-op for units already sharded.

    Example:
        >>> drop_gathered_parameters(sharded_lightning_module)  # doctest: +SKIP
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _gathering_root(root: FSDPModule, method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if root_is_gathered(root):  # inside a step method, or a unit without parameters of its own
            return method(*args, **kwargs)
        # As `register_fsdp_forward_method` runs a method of the root itself, then drop the gathered copies (a
        # backward through the output gathers them again in FSDP's pre-backward).
        try:
            return call_as_fsdp_forward(root, method, *args, **kwargs)
        finally:
            root.reshard()

    return call
