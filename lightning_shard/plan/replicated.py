"""Parameters FSDP2 cannot shard, kept whole on every rank beside the sharded ones, as DDP keeps all of them.

``fully_shard`` refuses a 0-d parameter ("fully_shard doesn't support scalar parameters": CLIP's and SigLIP's
``logit_scale``) and a non-contiguous one. They are handed to every ``fully_shard`` call as ``ignored_params``, so
FSDP2 leaves them as plain tensors: not sharded, not moved, not cast by the ``MixedPrecisionPolicy``, their gradients
not reduced. The rest of DDP's contract is kept here:

* placement: on the compute device (also under CPU offload: forward reads them there);
* gradients: averaged over every data-parallel rank (both mesh dimensions under HYBRID_SHARD) by a hook that runs
  when backward has accumulated a parameter's gradient - each micro-batch under the default
  ``gradient_accumulation="sharded"`` (averaging the running sum is exact: the part already averaged is the same on
  every rank), only the last one under ``"unsharded"`` (:func:`set_gradient_sync`). As with DDP, such a parameter
  must get a gradient on every rank or on none.
* precision: they keep their stored dtype in forward. For a 0-d parameter that changes no result's dtype - torch's
  type promotion lets a dimensioned bf16 tensor win over a 0-d fp32 one (``logit_scale.exp() * logits`` stays bf16)
  - and the scalar itself is used at full precision.
* checkpoints: torch's state-dict API returns them as plain tensors, which torch.distributed.checkpoint stores once
  and loads whole on every rank, at any world size.

Example:
    >>> [name for name, _ in unshardable_parameters(nn.Linear(2, 2))]
    []
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# Set on the root module by `replicate_unshardable_parameters`: read by `set_gradient_sync`.
_SYNC_ATTRIBUTE = "_lightning_shard_replicated_sync"


def unshardable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``module`` (each shared one once) that ``fully_shard`` refuses: 0-d or non-contiguous.

    Example:
        >>> class Scaled(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.scale = nn.Parameter(torch.tensor(2.0))
        >>> [name for name, _ in unshardable_parameters(Scaled())]
        ['scale']
    """
    return [(name, param) for name, param in module.named_parameters() if param.dim() == 0 or not param.is_contiguous()]


def replicate_unshardable_parameters(
    model: nn.Module, params: list[nn.Parameter], mesh: DeviceMesh, device: torch.device
) -> None:
    """Put ``params`` (kept out of ``fully_shard``) on ``device`` and average their gradients over ``mesh`` after
    each backward; call once the model is sharded (and materialised).

    Example:
        >>> replicate_unshardable_parameters(model, [model.logit_scale], mesh, torch.device("cpu"))  # doctest: +SKIP
    """
    if not params:
        return
    with torch.no_grad():
        for param in params:
            if not param.is_meta and param.device != device:
                param.data = param.data.to(device)  # the same Parameter, so optimizers built earlier keep it
    if mesh.size() == 1:
        return
    sync = {"enabled": True}
    setattr(model, _SYNC_ATTRIBUTE, sync)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]
    ranks = mesh.size()

    def average(param: torch.Tensor) -> None:
        if param.grad is None or not sync["enabled"]:
            return
        for group in groups:  # summed over each mesh dimension in turn: the sum over the whole mesh
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(ranks)

    for param in params:
        param.register_post_accumulate_grad_hook(average)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Average the replicated parameters' gradients in the coming backward passes (``enabled``), or let them
    accumulate per rank (accumulation micro-batches that skip FSDP2's reduce-scatter too).

    Example:
        >>> set_gradient_sync(nn.Linear(2, 2), False)  # a model without replicated parameters: nothing to do
    """
    sync = getattr(model, _SYNC_ATTRIBUTE, None)
    if sync is not None:
        sync["enabled"] = enabled
