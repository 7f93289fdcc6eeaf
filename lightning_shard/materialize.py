"""Materialising a sharded model that was created on the meta device.

The initialisation rule (documented in the README): a model created on the meta device is sharded first, then
each module that owns parameters or buffers is initialised, in ``model.modules()`` order, by its own
``reset_parameters()`` called on full-size tensors of that one module; every rank then keeps only its shard.
All ranks draw from rank 0's random-number stream, so for the same seed the weights equal a model built eagerly
on one process (where each module's constructor calls ``reset_parameters()`` in the same order), at any world
size. Only one module's full parameters exist at a time - never the whole model.

DTensor's own random ops cannot give this: on the CPU each rank would draw its shard from its local generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device.

    Example:
        >>> has_meta_tensors(nn.Linear(2, 2, device="meta"))
        True
    """
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize_sharded_module(
    root: nn.Module, device: torch.device, buffer_device: torch.device | None = None
) -> None:
    """Allocate ``root``'s meta tensors on ``device`` (buffers on ``buffer_device``, default ``device``) and initialise
    them module by module (see module docstring). Under CPU offload the parameter shards belong in CPU memory and the
    buffers on the compute device (:func:`~lightning_shard.devices.materialization_devices`).

    Raises:
        TypeError: naming the module classes that hold meta tensors but define no ``reset_parameters()``.

    Example:
        >>> model = nn.Linear(2, 2, device="meta")
        >>> materialize_sharded_module(model, torch.device("cpu"))
        >>> model.weight.is_meta
        False
    """
    if not has_meta_tensors(root):
        return
    buffer_device = buffer_device or device
    owners = [m for m in root.modules() if next(_own_tensors(m), None) is not None]
    missing = sorted({type(m).__name__ for m in owners if not callable(getattr(m, "reset_parameters", None))})
    if missing:
        raise TypeError(
            f"The model was created on the meta device, but these modules hold parameters or buffers and define no "
            f"`reset_parameters()` to initialise them: {missing}. Add a `reset_parameters()` method to them, or create "
            "the model in `__init__` instead of `configure_model()`."
        )
    # Allocate per owning module, not `root.to_empty()`: modules without parameters (torchmetrics metrics) would
    # have their states replaced by uninitialised memory.
    for module in owners:
        buffers = dict(module.named_buffers(recurse=False))
        module.to_empty(device=device, recurse=False)
        for name, buffer in buffers.items():
            # A buffer built for real (not on meta) keeps its values where `fully_shard` put it (the compute device).
            module._buffers[name] = torch.empty_like(buffer, device=buffer_device) if buffer.is_meta else buffer
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # FSDP re-registers the new sharded parameters after any `_apply`; run it without changing a tensor.
            module._apply(lambda tensor: tensor, recurse=False)
    _use_rank_zero_rng()
    initialized: set[int] = set()
    for module in owners:
        with _full_size_parameters(module, initialized):
            module.reset_parameters()  # type: ignore[operator]


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))


@contextmanager
def _full_size_parameters(module: nn.Module, initialized: set[int]) -> Iterator[None]:
    """Swap ``module``'s sharded (DTensor) parameters for full-size plain ones while its init runs, then copy
    each rank's shard back. A parameter shared with an earlier module (tied weights) keeps its first init."""
    sharded = {
        name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor) or id(p) in initialized
    }
    for name, param in sharded.items():
        local = param.to_local() if isinstance(param, DTensor) else param
        module._parameters[name] = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=local.device), requires_grad=param.requires_grad
        )
    try:
        yield
        with torch.no_grad():
            for name, param in sharded.items():
                if id(param) in initialized or not isinstance(param, DTensor):
                    continue
                full = module._parameters[name]
                shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
    finally:
        for name, param in sharded.items():
            module._parameters[name] = param
        initialized.update(id(p) for p in module.parameters(recurse=False))


def _use_rank_zero_rng() -> None:
    """Give every rank rank 0's generator state, so they all draw the same full-size tensors."""
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])
