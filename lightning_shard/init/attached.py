"""What user code and libraries attach to a model's parameters and buffers, carried through setup.

``fully_shard`` replaces each parameter by a new DTensor and materialisation gives each meta tensor new memory
(``torch.utils.swap_tensors`` / a new ``Parameter``): the Python object a hook or a flag was attached to is no longer
the one that trains (a gradient hook registered on a meta parameter in ``configure_model()`` never runs; transformers'
``_is_hf_initialized`` flags vanish). :class:`AttachedState` notes, per place in the model, each tensor's Python
attributes and its gradient hooks before setup and puts them on whatever tensor holds that place after it.

Example:
    >>> layer = nn.Linear(2, 2)
    >>> layer.weight._is_hf_initialized = True
    >>> state = AttachedState.of(layer)
    >>> layer.weight = nn.Parameter(torch.zeros(2, 2))
    >>> state.restore(layer)
    >>> layer.weight._is_hf_initialized
    True
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

# Python-side tables of a tensor's hooks; setting them registers the hooks with autograd again.
_HOOK_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")
# Attributes torch sets itself on a parameter (FSDP2's DTensor parameters: `_is_param`): the live tensor's stay.
_TORCH_ATTRIBUTES = frozenset({"_is_param"})


class AttachedState:
    """Each tensor's attributes and hooks by where it is held (``(id(module), table, name)``)."""

    def __init__(self, saved: dict[tuple[int, str, str], tuple[dict[str, Any], list[Any]]]) -> None:
        self.saved = saved

    @classmethod
    def of(cls, root: nn.Module) -> AttachedState:
        """Note what is attached to ``root``'s parameters and buffers now."""
        saved = {}
        for module in root.modules():
            for table in ("_parameters", "_buffers"):
                for name, tensor in module.__dict__[table].items():
                    if tensor is None:
                        continue
                    attributes = {k: v for k, v in tensor.__dict__.items() if k not in _TORCH_ATTRIBUTES}
                    hooks = [getattr(tensor, hook_table) for hook_table in _HOOK_TABLES]
                    if attributes or any(hooks):
                        saved[(id(module), table, name)] = (attributes, hooks)
        return cls(saved)

    def restore(self, root: nn.Module) -> None:
        """Put what was noted on the tensors that hold the same places in ``root`` now; what was attached since is
        kept (a flag set again keeps its new value, a hook registered since stays beside the old ones)."""
        modules = {id(m): m for m in root.modules()}
        for (module_id, table, name), (attributes, hooks) in self.saved.items():
            live = modules[module_id].__dict__[table].get(name) if module_id in modules else None
            if live is None:
                continue
            for key, value in attributes.items():
                live.__dict__.setdefault(key, value)
            for hook_table, noted in zip(_HOOK_TABLES, hooks, strict=True):
                _carry_hooks(live, hook_table, noted)


def _carry_hooks(live: torch.Tensor, hook_table: str, noted: OrderedDict | None) -> None:
    if not noted:
        return
    current = getattr(live, hook_table)
    if current is None or current is noted:
        merged = noted  # the same table object, so the handles `register_hook` returned still remove them
    else:
        merged = current
        for handle_id, hook in noted.items():
            merged.setdefault(handle_id, hook)
    setattr(live, hook_table, merged)  # (re)registers the table with autograd for this tensor
