"""Materialising a sharded model that was created on the meta device.

The initialisation rule (documented in the README): a model created on the meta device is sharded first, then
each module that owns parameters or buffers is initialised, in ``model.modules()`` order, by its own
``reset_parameters()`` called on full-size tensors of that one module; every rank then keeps only its shard.
All ranks draw from rank 0's random-number stream, so for the same seed the weights equal a model built eagerly
on one process (where each module's constructor calls ``reset_parameters()`` in the same order), at any world
size. Only one module's full parameters exist at a time - never the whole model.

A Hugging Face ``PreTrainedModel`` in the tree is initialised at its place in that order as transformers itself
initialises it - its ``_init_weights`` in transformers' order, buffers included - or loaded from its pretrained
files; see :mod:`lightning_shard.hf.init`.

DTensor's own random ops cannot give this: on the CPU each rank would draw its shard from its local generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_shard.hf import init as hf_init
from lightning_shard.hf.pretrained import explain_meta_from_pretrained
from lightning_shard.torch_compat import reregister_sharded_parameters


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device.

    Example:
        >>> has_meta_tensors(nn.Linear(2, 2, device="meta"))
        True
    """
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


@contextmanager
def meta_construction() -> Iterator[None]:
    """Create modules on the meta device, to be materialised after sharding by :func:`materialize_sharded_module`.

    Also records the random draws of Hugging Face constructors (so materialisation can match an eager build) and
    turns transformers' refusal of ``from_pretrained`` on the meta device into an error naming what works.

    Example:
        >>> with meta_construction():
        ...     layer = nn.Linear(2, 2)
        >>> layer.weight.is_meta
        True
    """
    with explain_meta_from_pretrained(), torch.device("meta"), hf_init.record_constructor_draws():
        yield


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
    hf_models = {id(model): model for model in hf_init.outermost_pretrained_models(root)}
    in_hf_model = {id(m) for model in hf_models.values() for m in model.modules()}
    owners = [m for m in root.modules() if next(_own_tensors(m), None) is not None]
    missing = sorted(
        {
            type(m).__name__
            for m in owners
            if id(m) not in in_hf_model and not callable(getattr(m, "reset_parameters", None))
        }
    )
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
            setattr(module, name, torch.empty_like(buffer, device=buffer_device) if buffer.is_meta else buffer)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            reregister_sharded_parameters(module)
    _use_rank_zero_rng()
    swap = FullSizeParameters()
    owner_ids = {id(m) for m in owners}
    for module in root.modules():
        if id(module) in hf_models:
            hf_init.initialize_hf_model(module, device, swap)
        elif id(module) in owner_ids and id(module) not in in_hf_model:
            swap.swap_in(module)
            module.reset_parameters()  # type: ignore[operator]
            swap.mark_initialized(module)
            swap.write_back(module)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))


class FullSizeParameters:
    """Swaps a module's sharded (DTensor) parameters for full-size plain ones while its initialisation runs, then
    copies each rank's shard back. A parameter shared with a module initialised earlier (tied weights) keeps that
    first init: the later module initialises a scratch tensor that is dropped.

    Args:
        unset: ``"empty"`` leaves the full-size tensors uninitialised (``reset_parameters()`` writes every value);
            ``"nan"`` fills floating-point ones with NaN and :meth:`write_back` raises if an init left any (a
            parameter that a Hugging Face ``_init_weights`` does not cover would otherwise be uninitialised memory).
        keep: parameters to leave in place, not swapped (those already loaded from pretrained files).

    Example:
        >>> swap = FullSizeParameters()
        >>> layer = nn.Linear(2, 2)
        >>> swap.swap_in(layer); layer.reset_parameters(); swap.mark_initialized(layer); swap.write_back(layer)
    """

    def __init__(self, unset: str = "empty", keep: Callable[[nn.Parameter], bool] = lambda p: False) -> None:
        self.unset = unset
        self.keep = keep
        self._initialized: set[int] = set()
        # module id -> {name: (the module's own parameter, whether its full-size stand-in is scratch)}
        self._pending: dict[int, dict[str, tuple[nn.Parameter, bool]]] = {}

    def with_policy(self, unset: str, keep: Callable[[nn.Parameter], bool]) -> FullSizeParameters:
        """The same record of initialised parameters under another ``unset`` / ``keep`` policy."""
        other = FullSizeParameters(unset, keep)
        other._initialized = self._initialized
        return other

    def swap_in(self, module: nn.Module) -> None:
        if id(module) in self._pending:
            return
        swapped = {}
        for name, param in module.named_parameters(recurse=False):
            scratch = id(param) in self._initialized
            if not (isinstance(param, DTensor) or scratch) or self.keep(param):
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
            if self.unset == "nan" and not scratch and full.is_floating_point():
                full.fill_(float("nan"))
            module.register_parameter(name, nn.Parameter(full, requires_grad=param.requires_grad))
            swapped[name] = (param, scratch)
        self._pending[id(module)] = swapped

    def mark_initialized(self, module: nn.Module) -> None:
        """Call once ``module``'s init has run: later modules sharing its parameters get scratch tensors."""
        swapped = self._pending.get(id(module), {})
        self._initialized.update(
            id(swapped[name][0] if name in swapped else param) for name, param in module.named_parameters(recurse=False)
        )

    def write_back(self, module: nn.Module) -> None:
        """Copy each rank's shard of ``module``'s full-size parameters into its DTensors and put them back."""
        swapped = self._pending.pop(id(module), None)
        if swapped is None:
            return
        try:
            with torch.no_grad():
                for name, (param, scratch) in swapped.items():
                    full = getattr(module, name)
                    if scratch or not isinstance(param, DTensor):
                        continue
                    if self.unset == "nan" and full.is_floating_point() and bool(full.isnan().any()):
                        owner = type(module).__name__.removeprefix("FSDP" if isinstance(module, FSDPModule) else "")
                        raise RuntimeError(
                            f"`{owner}.{name}` was left uninitialised: its model's initialisation "
                            "(Hugging Face `_init_weights`) does not cover it. Build the model in `__init__` "
                            "instead of on the meta device, or load it with `lightning_shard.hf.from_pretrained`."
                        )
                    shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
        finally:
            for name, (param, _) in swapped.items():
                module.register_parameter(name, param)


def _use_rank_zero_rng() -> None:
    """Give every rank rank 0's generator state, so they all draw the same full-size tensors."""
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])
