"""Calling the model held by a LightningModule directly, outside the step methods.

FSDP gathers the root's parameters (embeddings, final norm, head - those in no smaller unit) only around the
root's ``forward`` and the methods registered as forward methods (Lightning's step methods). After ``fit`` a direct
call such as ``lightning_module.model.generate(...)`` or ``lightning_module.model(x)`` in a notebook would meet
sharded root parameters ("mixed torch.Tensor and DTensor"). So the ``forward`` and ``generate`` of each direct child
of the root that holds parameters run inside the root's FSDP forward hooks when the root's parameters are not
gathered already (inside a step method they are, and the call goes straight through). Every rank must make the
same calls: each gathers collectively. Hugging Face models are marked as FSDP-managed, so their ``generate`` keeps
all ranks stepping together until every rank has finished (``synced_gpus``).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_shard.hf.init import is_pretrained_model

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


def _gathering_root(root: FSDPModule, method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        state = root._get_fsdp_state()
        group = getattr(state, "_fsdp_param_group", None)
        if group is None or group.is_unsharded:
            return method(*args, **kwargs)
        # As `register_fsdp_forward_method` runs a method of the root itself: FSDP's pre/post-forward, so the
        # parameters are gathered now and their gradients, if any, reduce-scattered in backward.
        args, kwargs = state._pre_forward(root, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward(root, args, output)

    return call
