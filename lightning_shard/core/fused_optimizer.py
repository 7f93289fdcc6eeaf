"""The optimizer step at memory speed: torch's fused kernels for the optimizers users write as they always do.

``torch.optim.AdamW(model.parameters())`` leaves ``fused`` and ``foreach`` unset, and torch then picks its ``foreach``
kernels: a chain of whole-list ops, each reading and writing every shard once more. Stepping an 8-bytes-per-parameter
state that way runs several times below memory speed (BENCHMARKS.md, "The optimizer step": on DTensor shards on a CPU
2.2 GB/s against 10.8 GB/s fused). The strategy therefore sets ``fused=True`` in the parameter groups of the
optimizers whose fused kernel torch has for the parameters' device, where the user left both ``fused`` and
``foreach`` unset - before the first step, so that the states are created as the fused step keeps them. The result
equals the user's optimizer up to float rounding (the fused kernel computes the same update in another order; tested
over 50 steps, ``tests/test_fused_optimizer.py``). Passing ``fused=False`` or ``foreach=True`` keeps torch's choice.

Switched: exactly :class:`torch.optim.Adam` and :class:`~torch.optim.AdamW` (a subclass may override ``step``),
without ``differentiable=True``, with floating-point parameters on a device torch has fused kernels for (the CPU too,
since torch 2.4), before the optimizer holds states. Not switched: SGD and Adagrad - torch has fused kernels for them,
but DTensor has no sharding rule for those (``aten._fused_sgd_`` raises ``NotImplementedError`` on shards); their
``foreach`` step reads and writes less state per parameter anyway.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_shard.torch_compat.optim import fused_kernel_devices

# Exactly these classes (not subclasses): their `step` reads `fused` from the parameter group at every step, and
# DTensor has sharding rules for their fused ops (`aten._fused_adam_`, `aten._fused_adamw_`).
_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def use_fused_kernels(optimizers: Iterable[Optimizer]) -> list[str]:
    """Set ``fused=True`` in the parameter groups of ``optimizers`` that qualify (module docstring); return the
    classes switched, said once on rank 0.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> use_fused_kernels([optimizer]), optimizer.param_groups[0]["fused"]
        (['AdamW'], True)
    """
    switched = []
    for optimizer in optimizers:
        groups = [group for group in optimizer.param_groups if _fusable(optimizer, group)]
        if groups and not optimizer.state:  # states made by another kernel stay with it
            for group in groups:
                group["fused"], group["foreach"] = True, False
            switched.append(type(optimizer).__name__)
    if switched:
        rank_zero_info(
            f"Stepping {sorted(set(switched))} with torch's fused kernels (`fused=True`), several times faster than "
            "the default `foreach` ones on sharded parameters; pass `fused=False` to the optimizer to keep those."
        )
    return switched


def _fusable(optimizer: Optimizer, group: dict) -> bool:
    if type(optimizer) not in _FUSABLE or group.get("fused") is not None or group.get("foreach") is not None:
        return False
    if group.get("differentiable"):
        return False
    devices = fused_kernel_devices()
    return all(p.is_floating_point() and p.device.type in devices for p in group["params"])
