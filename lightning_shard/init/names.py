"""How the initialisation's errors name what they refuse: a tensor by its dotted name, a module by its class, and a
long list cut short. Takes names and modules; gives strings.

Example:
    >>> joined("layers.0", "weight"), shown([f"t{i}" for i in range(10)])
    ('layers.0.weight', "['t0', 't1', 't2', 't3', 't4', 't5', 't6', 't7', ... (10 in all)]")
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_shard.torch_compat.modules import visible_name


def joined(prefix: str, name: str) -> str:
    return visible_name(".".join(filter(None, [prefix, name])))


def shown(names: list[str]) -> str:
    return str(names[:8])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > 8 else "]")


def class_name(module: nn.Module) -> str:
    return type(module).__name__.removeprefix("FSDP" if isinstance(module, FSDPModule) else "")
