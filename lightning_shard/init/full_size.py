"""Full-size stand-ins for sharded parameters while an initialisation that is not replayed op by op runs.

Takes a module whose parameters are sharded (DTensors); gives it full-size plain parameters on the CPU for the length of
its initialisation (a library's init, a ``reset_parameters()``: they draw from the CPU generator, as in an eager
build), then writes each rank's shard back (:func:`~lightning_shard.init.replay.write_shards`). Used by the plan's
fallback (:mod:`lightning_shard.init.init_plan`) and by a library's steps (:mod:`lightning_shard.init.libraries`).

Example:
    >>> swap = FullSizeParameters()
    >>> layer = nn.Linear(2, 2)
    >>> swap.swap_in(layer); layer.reset_parameters(); swap.mark_initialized(layer); swap.write_back(layer)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.init.construction_log import HolderKey
from lightning_shard.init.names import class_name
from lightning_shard.init.replay import write_shards
from lightning_shard.init.unset import fill_unset, holds_unset
from lightning_shard.torch_compat.tensors import storage_key

_CPU = torch.device("cpu")


class FullSizeParameters:
    """Swaps a module's sharded (DTensor) parameters for full-size plain ones on the CPU while its initialisation runs
    (a library's init, a ``reset_parameters()``: they draw from the CPU generator, as in an eager build), then copies
    each rank's shard back. The full-size tensors start as the sentinel (:mod:`lightning_shard.init.unset`). A parameter
    shared with a module initialised earlier (tied weights), or one left on the meta device (not part of the sharded
    model), gets a scratch tensor that is dropped.

    Args:
        keep: parameters to leave in place, not swapped (those already loaded from pretrained files).
        device: where the full-size stand-ins live (``meta``: to find what an init writes, drawing nothing).
        refuse_unset: what should have written every element (e.g. "its model's initialisation (Hugging Face
            `_init_weights`)"): :meth:`write_back` then raises, naming the parameter and this, if an init left a
            sentinel. ``None``: the sentinel is written back, for the check after materialisation.

    Example:
        >>> swap = FullSizeParameters()
        >>> layer = nn.Linear(2, 2)
        >>> swap.swap_in(layer); layer.reset_parameters(); swap.mark_initialized(layer); swap.write_back(layer)
    """

    def __init__(
        self,
        keep: Callable[[nn.Parameter], bool] = lambda p: False,
        refuse_unset: str | None = None,
        device: torch.device = _CPU,
    ) -> None:
        self.keep = keep
        self.refuse_unset = refuse_unset
        self.device = device
        # on the meta device: the storage of each full-size stand-in -> the parameter it stands in for (the stand-ins
        # kept, so that no later one takes a storage's address)
        self.stand_ins: dict[int, tuple[HolderKey, torch.Tensor]] = {}
        self._initialized: set[int] = set()
        # places whose parameter the eager build replaced after the running init (a later tie): it writes scratch
        self.replaced_later: set[HolderKey] = set()
        # module id -> {name: (the module's own parameter, whether its full-size stand-in is scratch)}
        self._pending: dict[int, dict[str, tuple[nn.Parameter, bool]]] = {}

    def with_policy(self, keep: Callable[[nn.Parameter], bool], refuse_unset: str | None) -> FullSizeParameters:
        """The same record of initialised parameters under another ``keep`` / ``refuse_unset`` policy."""
        other = FullSizeParameters(keep, refuse_unset, self.device)
        other._initialized = self._initialized
        return other

    def initialized(self, param: torch.Tensor) -> None:
        """Note that ``param`` was initialised elsewhere: modules sharing it get scratch tensors."""
        self._initialized.add(id(param))

    def swap_in(self, module: nn.Module) -> None:
        if id(module) in self._pending:
            return
        swapped = {}
        for name, param in module.named_parameters(recurse=False):
            replaced = (id(module), "_parameters", name) in self.replaced_later
            scratch = id(param) in self._initialized or param.is_meta or replaced
            if not (isinstance(param, DTensor) or scratch) or self.keep(param):
                continue
            full = torch.empty(param.shape, dtype=param.dtype, device=self.device)
            if not full.is_meta:
                fill_unset(full)
            module.register_parameter(name, nn.Parameter(full, requires_grad=param.requires_grad))
            if full.is_meta:
                self.stand_ins[storage_key(full)] = ((id(module), "_parameters", name), full)
            swapped[name] = (param, scratch)
        self._pending[id(module)] = swapped

    def mark_initialized(self, module: nn.Module) -> None:
        """Call once ``module``'s init has run: later modules sharing its parameters get scratch tensors."""
        swapped = self._pending.get(id(module), {})
        self._initialized.update(
            id(swapped[name][0] if name in swapped else param)
            for name, param in module.named_parameters(recurse=False)
            if (id(module), "_parameters", name) not in self.replaced_later
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
                    if scratch or not isinstance(param, DTensor) or full.is_meta:
                        continue
                    if self.refuse_unset is not None and holds_unset(full):
                        raise RuntimeError(
                            f"`{class_name(module)}.{name}` was left uninitialised: {self.refuse_unset} does not "
                            "cover it. Build the model in `__init__` instead of on the meta device, or load it with "
                            "`lightning_shard.hf.from_pretrained`."
                        )
                    write_shards(full.detach(), param)
        finally:
            for name, (param, _) in swapped.items():
                module.register_parameter(name, param)
