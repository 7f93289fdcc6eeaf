"""Materialise: a sharded model that was created on the meta device gets its values, as an eager build gave them.

The initialisation rule (docs/creating_the_model.md): a model created on the meta device is sharded first, then its
tensors are initialised as its construction initialised them, in the order an eager build on one process runs, from
rank 0's random stream, on the CPU (the eager build's generator), on full-size tensors of a few tensors at a time;
every rank keeps only its shards. So for the same seed the weights equal the eager build at any world size and on any
device, and the whole model never exists on a rank. Who initialises what:

1. A library that initialises its own models (transformers: :mod:`lightning_shard.hf.init` registers it with
   :func:`~lightning_shard.init.libraries.register_library`) claims the models built by its constructors, as they were
   built - a wrapper's own modules inside them (peft's LoRA adapters) are not theirs - and initialises them where
   their constructors ended.
2. Every other tensor built under a recording gets what its construction did to it
   (:mod:`lightning_shard.init.construction`), replayed exactly (:mod:`lightning_shard.init.replay`): every op,
   including those computing a tensor from others (a rotary table from ``arange``, layer scale
   ``init_values * torch.ones(dim)``, a cast, a deep copy), and the random generator's seeds and restores.
3. A module built on the meta device outside any recording (``nn.Linear(..., device="meta")``, your own
   ``torch.device("meta")`` block) runs its ``reset_parameters()`` first, in ``model.modules()`` order; without one it
   is an error naming it. Tensors built for real keep their values (rank 0's).

Then the safety net that does not rest on the recorder (:mod:`lightning_shard.init.verify`): every tensor allocated here
starts as a sentinel (:mod:`lightning_shard.init.unset`), and one that nothing wrote is an error naming it - never
uninitialised memory.

Takes a model built under :func:`meta_construction` (or on the meta device outside any recording) and sharded; gives it
allocated and initialised (:func:`materialize_sharded_module`), in the pipeline's order: the plan
(:mod:`lightning_shard.init.init_plan`), then the allocation here, then the replay the plan drives, then the check.

DTensor's own random ops cannot give this: on the CPU each rank would draw its shard from its local generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_shard.init.construction_log import (
    ConstructionLog,
    HolderKey,
    construction_logs,
    forget_construction,
    holders,
)
from lightning_shard.init.init_plan import InitPlan
from lightning_shard.init.init_skip import defer_check, loaded_keys
from lightning_shard.init.libraries import LIBRARIES
from lightning_shard.init.meta_window import end_meta_window, meta_window
from lightning_shard.init.names import joined
from lightning_shard.init.replay import callers_random_state_kept, rng_timeline
from lightning_shard.init.shard_init import local
from lightning_shard.init.skipped_draws import SKIPPED
from lightning_shard.init.ties import find_ties, retie
from lightning_shard.init.unset import fill_unset, uninitialized_memory_filled
from lightning_shard.init.verify import refuse_unwritten
from lightning_shard.torch_compat.fsdp import reregister_sharded_parameters


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

    Records what construction does to each tensor (:mod:`lightning_shard.init.construction`), so that materialisation
    can match an eager build, inside each registered library's construction context.

    Example:
        >>> with meta_construction():
        ...     layer = nn.Linear(2, 2)
        >>> layer.weight.is_meta
        True
    """
    contexts = [library.construction_context() for library in LIBRARIES]
    with meta_window(*contexts, torch.device("meta")):
        yield


def materialize_sharded_module(
    root: nn.Module, device: torch.device, buffer_device: torch.device | None = None
) -> None:
    """Allocate ``root``'s meta tensors on ``device`` (buffers on ``buffer_device``, default ``device``) and initialise
    them by the rule in the module docstring; tensors that are not on the meta device keep their values. Under CPU
    offload the parameter shards belong in CPU memory and the buffers on the compute device
    (:func:`~lightning_shard.devices.materialization_devices`). Call on every rank.

    Raises:
        TypeError: naming the tensors that nothing can initialise as an eager build does - before anything is
            allocated.
        RuntimeError: naming the tensors that nothing wrote (a sentinel left in them), after the replay.

    Example:
        >>> model = nn.Linear(2, 2, device="meta")
        >>> materialize_sharded_module(model, torch.device("cpu"))
        >>> model.weight.is_meta
        False
    """
    end_meta_window()
    if not has_meta_tensors(root):
        return
    logs = construction_logs(root)
    libraries = [model for library in LIBRARIES for model in library.claim(root, logs)]
    plan = InitPlan(root, logs, libraries)
    ties = find_ties(root)
    allocated = _allocate_meta_tensors(root, device, buffer_device or device)
    retie(root, ties)  # a plain parameter reallocated module by module is a new object in each holder
    for module in root.modules():
        if isinstance(module, FSDPModule):
            reregister_sharded_parameters(module)
    # The caller's stream as the eager build leaves it, now (not when a deferred replay runs: draws made after setup
    # must see it), also when a load makes the replay unnecessary.
    SKIPPED.pay(skip=plan.undrawn())
    # A checkpoint load follows (the Trainer's restore): what it writes is not replayed.
    _initialize(root, plan, logs, allocated, loaded_keys(root))


def _initialize(
    root: nn.Module,
    plan: InitPlan,
    logs: list[ConstructionLog],
    allocated: list[tuple[str, nn.Module, str, str]],
    loaded: set[HolderKey],
) -> None:
    """Replay what the tensors not ``loaded`` need, check them, and leave the check of the others to the load."""
    unloaded = [entry for entry in allocated if (id(entry[1]), entry[2], entry[3]) not in loaded]
    plan.leave_to_load(loaded)
    with torch.no_grad(), callers_random_state_kept(), uninitialized_memory_filled():
        plan.run(rng_timeline(logs))
    left_to_load = [entry for entry in allocated if (id(entry[1]), entry[2], entry[3]) in loaded]
    refuse_unwritten(unloaded, plan.replayed)
    if left_to_load:
        defer_check(root, partial(refuse_unwritten, left_to_load, {}, by_load=True))
    forget_construction(root)


def _allocate_meta_tensors(
    root: nn.Module, device: torch.device, buffer_device: torch.device
) -> list[tuple[str, nn.Module, str, str]]:
    """Give each meta parameter (on ``device``) and buffer (on ``buffer_device``) memory holding the sentinel; return
    ``(name, module, table, name in module)`` of each. Per module, not ``root.to_empty()``: tensors built for real (a
    head built in ``__init__``, torchmetrics states) keep their values."""
    allocated = []
    for prefix, module in root.named_modules():
        meta = [(table, name) for (_, table, name), tensor in holders(module) if tensor.is_meta]
        if meta:
            params = {id(p) for p in module._parameters.values() if p is not None}
            module._apply(partial(_allocate, params=params, device=device, buffer_device=buffer_device), recurse=False)
            allocated += [(joined(prefix, name), module, table, name) for table, name in meta]
    return allocated


def _allocate(
    tensor: torch.Tensor, params: set[int], device: torch.device, buffer_device: torch.device
) -> torch.Tensor:
    if not tensor.is_meta:
        return tensor
    new = torch.empty_like(tensor, device=device if id(tensor) in params else buffer_device)
    fill_unset(local(new))
    return new
