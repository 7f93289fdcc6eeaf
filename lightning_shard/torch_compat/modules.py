"""``nn.Module`` internals and torch's module wrappers: the activation-checkpoint wrapper (torch keeps it under a
private module), the module names it and ``torch.compile`` insert into parameter names, and which buffers a module
saves in its state dict.

Takes modules and parameter names; gives names as torch's state-dict API gives them, and the wrapper to apply.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401  (re-exported)
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

# Module names that torch's wrappers insert into parameter names and its state-dict API leaves out again:
# activation checkpointing's ``CheckpointWrapper`` and ``torch.compile``'s ``OptimizedModule``.
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"

HIDDEN_MODULE_NAMES = frozenset({CHECKPOINT_WRAPPED_MODULE, "_orig_mod"})


def visible_name(name: str) -> str:
    """A parameter's name as torch's state-dict API gives it: without the wrappers' module names.

    Example:
        >>> visible_name("layers.0._checkpoint_wrapped_module.attn.weight")
        'layers.0.attn.weight'
    """
    return ".".join(part for part in name.split(".") if part not in HIDDEN_MODULE_NAMES)


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` is part of its state dict (``register_buffer(persistent=True)``).

    Example:
        >>> norm = nn.BatchNorm1d(2)
        >>> is_persistent_buffer(norm, "running_mean")
        True
    """
    return name not in module._non_persistent_buffers_set
