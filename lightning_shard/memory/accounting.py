"""Bytes this rank really holds: model parameters, gradients and optimizer states, counted from local shards.

Under FSDP2 ``fully_shard`` a parameter is a ``DTensor`` whose ``to_local()`` is this rank's shard; a plain tensor
(DDP, single device) is held whole. Tensors are deduplicated by their storage, and a storage is counted at its full
size, because that is what the allocator holds: FSDP2 keeps each local shard as a view into a padded buffer and lays
the reduce-scattered gradients of a parameter group out as views into one flat buffer.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(4, 2)
    >>> parameter_bytes(layer.parameters())
    40
"""

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.torch_compat.fsdp import fsdp_param_group, unsharded_gradient


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` stored on this rank: the local shard of a ``DTensor``, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the local parts of ``tensors`` (meta tensors count their own size)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        local = local_tensor(tensor)
        if local.is_meta:
            # Meta tensors have no storage to deduplicate by; count the logical size.
            total += local.nelement() * local.element_size()
            continue
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def parameter_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes held by this rank's (shards of the) parameters."""
    return held_bytes(parameters)


def gradient_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes held by this rank's gradients; parameters whose ``grad`` is ``None`` hold none."""
    return held_bytes(p.grad for p in parameters if p.grad is not None)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes held by the tensors in the optimizers' per-parameter state (e.g. AdamW ``exp_avg``, ``exp_avg_sq``)."""
    return held_bytes(
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def unsharded_gradients(model: nn.Module) -> list[torch.Tensor]:
    """The whole gradients FSDP2 holds for ``model``'s units outside a backward pass.

    They exist between accumulation micro-batches whose reduce-scatter was skipped
    (``set_requires_gradient_sync(False)``, i.e. ``gradient_accumulation="unsharded"``): per parameter, the
    gradient upcast to the reduce dtype (``FSDPParam.unsharded_accumulated_grad``, mixed precision) or else the
    autograd gradient of the gathered parameter. Read from FSDP2's per-parameter state, as torch's
    ``FSDPMemTracker`` does; a model without FSDP units has none.

    Example:
        >>> unsharded_gradients(nn.Linear(2, 2))
        []
    """
    grads = []
    for module in model.modules():
        group = fsdp_param_group(module)
        for fsdp_param in group.fsdp_params if group is not None else ():
            grad = unsharded_gradient(fsdp_param)
            if grad is not None:
                grads.append(grad)
    return grads
