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
    held_tensor,
    holders,
)
from lightning_shard.init.init_plan import InitPlan
from lightning_shard.init.init_skip import defer_check, loaded_keys
from lightning_shard.init.libraries import LIBRARIES
from lightning_shard.init.meta_window import end_meta_window, meta_window
from lightning_shard.init.names import joined
from lightning_shard.init.rng_timeline import callers_random_state_kept, rng_timeline
from lightning_shard.init.shard_init import local
from lightning_shard.init.skipped_draws import SKIPPED
from lightning_shard.init.ties import find_ties, retie
from lightning_shard.init.unset import edges, fill_unset, uninitialized_memory_filled
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
    # A checkpoint load follows (the Trainer's restore): what it writes is not replayed.
    loaded, loaded_whole = loaded_keys(root)
    # What the replay writes whole needs no sentinel first; one it leaves unwritten gets it afterwards (_initialize).
    # What the load writes whole or not at all needs it only at its edges: no memory is touched twice.
    written = plan.written_back(loaded)
    unfilled = {id(held_tensor(plan.modules, key)) for key in written}
    at_edges = {id(held_tensor(plan.modules, key)) for key in loaded_whole}
    allocated = _allocate_meta_tensors(root, device, buffer_device or device, unfilled, at_edges)
    retie(root, ties)  # a plain parameter reallocated module by module is a new object in each holder
    for module in root.modules():
        if isinstance(module, FSDPModule):
            reregister_sharded_parameters(module)
    # The caller's stream as the eager build leaves it, now (not when a deferred replay runs: draws made after setup
    # must see it), also when a load makes the replay unnecessary.
    SKIPPED.pay(skip=plan.undrawn())
    _initialize(root, plan, logs, allocated, (loaded, loaded_whole), written)


def _initialize(
    root: nn.Module,
    plan: InitPlan,
    logs: list[ConstructionLog],
    allocated: list[tuple[str, nn.Module, str, str]],
    loads: tuple[set[HolderKey], set[HolderKey]],
    written: set[HolderKey],
) -> None:
    """Replay what the tensors not loaded need, check them, and leave the check of the others to the load (``loads``:
    the tensors it writes, and those of them it writes whole); ``written``: the tensors allocated without the
    sentinel, for the replay to write."""
    loaded, loaded_whole = loads
    unloaded = [entry for entry in allocated if _holder(entry) not in loaded]
    plan.leave_to_load(loaded)
    with torch.no_grad(), callers_random_state_kept(), uninitialized_memory_filled():
        plan.run(rng_timeline(logs))
    for _, module, table, name in unloaded:
        live = module.__dict__[table][name]
        if (id(module), table, name) in written and id(live) not in plan.replayed:
            fill_unset(local(live))  # nothing wrote it: the check below names it
    left_to_load = [entry for entry in allocated if _holder(entry) in loaded]
    refuse_unwritten(unloaded, plan.replayed)
    if left_to_load:
        at_edges = frozenset(entry[0] for entry in left_to_load if _holder(entry) in loaded_whole)
        defer_check(root, partial(refuse_unwritten, left_to_load, {}, by_load=True, at_edges=at_edges))
    forget_construction(root)


def _holder(entry: tuple[str, nn.Module, str, str]) -> HolderKey:
    """The key of an allocated tensor (``(name, module, table, name in module)``) as the plan and the load name it."""
    _, module, table, name = entry
    return id(module), table, name


def _allocate_meta_tensors(
    root: nn.Module, device: torch.device, buffer_device: torch.device, unfilled: set[int], at_edges: set[int]
) -> list[tuple[str, nn.Module, str, str]]:
    """Give each meta parameter (on ``device``) and buffer (on ``buffer_device``) memory holding the sentinel (none
    for those in ``unfilled``, at their edges for those in ``at_edges``, by id); return ``(name, module, table, name
    in module)`` of each. Per module, not ``root.to_empty()``: tensors built for real (a head built in ``__init__``,
    torchmetrics states) keep their values."""
    allocated = []
    for prefix, module in root.named_modules():
        meta = [(table, name) for (_, table, name), tensor in holders(module) if tensor.is_meta]
        if meta:
            params = {id(p) for p in module._parameters.values() if p is not None}
            allocate = partial(
                _allocate, params=params, devices=(device, buffer_device), unfilled=unfilled, at_edges=at_edges
            )
            module._apply(allocate, recurse=False)
            allocated += [(joined(prefix, name), module, table, name) for table, name in meta]
    return allocated


def _allocate(
    tensor: torch.Tensor,
    params: set[int],
    devices: tuple[torch.device, torch.device],
    unfilled: set[int],
    at_edges: set[int],
) -> torch.Tensor:
    if not tensor.is_meta:
        return tensor
    new = torch.empty_like(tensor, device=devices[0] if id(tensor) in params else devices[1])
    if id(tensor) in at_edges:
        for edge in edges(local(new)):
            fill_unset(edge)
    elif id(tensor) not in unfilled:
        fill_unset(local(new))
    return new
