"""``parallelize_module``: one function that reads top to bottom - which layers are split over the tensor-parallel
ranks, which modules are checkpointed, which become FSDP units, with which policies - in the manner of torchtitan's
``parallelize`` functions (tensor parallelism, activation checkpointing, compile, then ``fully_shard``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from lightning_shard.devices import materialization_devices
from lightning_shard.init.attached import AttachedState
from lightning_shard.init.materialize import has_meta_tensors, materialize_sharded_module
from lightning_shard.init.meta_window import end_meta_window, refuse_changes_after_recording
from lightning_shard.init.ties import Tie, check_ties, find_ties
from lightning_shard.plan.activation_checkpointing import SELECTIVE, selective_context_fn
from lightning_shard.plan.config import TENSOR_PARALLEL_DIM, ShardingConfig
from lightning_shard.plan.direct_calls import gather_root_for_direct_calls
from lightning_shard.plan.replicated import replicate_unshardable_parameters, unshardable_parameters
from lightning_shard.plan.wrap import plan_units
from lightning_shard.tensor_parallel import apply_tensor_parallel_plan
from lightning_shard.torch_compat.modules import (
    CHECKPOINT_WRAPPED_MODULE,
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    visible_name,
)


def parallelize_module(
    model: nn.Module,
    mesh: DeviceMesh,
    config: ShardingConfig,
    *,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    device: torch.device,
    forward_methods: Sequence[str] = (),
) -> list[nn.Module]:
    """Split (tensor parallelism), checkpoint, shard and materialise ``model`` in place; return the FSDP units below
    the root.

    Args:
        model: the model, built eagerly or on the meta device.
        mesh: 1-D (shard) or 2-D (replicate, shard) data-parallel mesh, with a last ``"tensor_parallel"`` dimension
            when ``config.tensor_parallel_size > 1``.
        config: the tensor-parallel plan, the wrap and checkpointing policies, ``reshard_after_forward`` and the CPU
            collectives.
        mp_policy, offload_policy: handed to every ``fully_shard`` call.
        device: where the model computes.
        forward_methods: methods of the root besides ``forward`` that run the model (Lightning's step methods).

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> mesh = init_device_mesh("cpu", (1,))  # doctest: +SKIP
        >>> parallelize_module(model, mesh, ShardingConfig(auto_wrap_policy={Block}),
        ...                    mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
        ...                    device=torch.device("cpu"))  # doctest: +SKIP
    """
    end_meta_window()  # what runs from here (sharding) is no construction of the model's
    refuse_changes_after_recording(model)
    meta = has_meta_tensors(model)
    # what the model as built ties and attaches to its tensors: sharding and materialisation make new tensors
    ties, attached = find_ties(model), AttachedState.of(model)
    if sharded_by_hand(model):
        units = _keep_sharding_by_hand(model, device, offload_policy, forward_methods, meta)
        _carry_through_setup(model, ties, attached)
        return units
    # What was built for real exists on every rank (the whole model, or a head beside a body built on the meta device);
    # make the replicas identical before each keeps its shard, as DDP does when it wraps a model.
    _broadcast_from_rank_zero(model, device)
    names = mesh.mesh_dim_names or ()
    if TENSOR_PARALLEL_DIM in names:
        apply_tensor_parallel_plan(model, mesh[TENSOR_PARALLEL_DIM], config.tensor_parallel_plan)
        mesh = mesh[tuple(name for name in names if name != TENSOR_PARALLEL_DIM)]  # FSDP's: the data-parallel dims
    units = _planned_units(model, config.auto_wrap_policy, "auto_wrap_policy")
    checkpointed = _planned_units(model, config.checkpointed_blocks, "activation_checkpointing", shards=False)
    selective = config.activation_checkpointing == SELECTIVE
    context_fn = selective_context_fn(config.selective_checkpointing_ops) if selective else None
    wrappers = _apply_activation_checkpointing(model, checkpointed, context_fn)
    if config.compile_kwargs is not None:  # under the run's `activation_memory_budget`, which the strategy sets
        _compile_units([wrappers.get(id(unit), unit) for unit in units], config.compile_kwargs)

    replicated = unshardable_parameters(model)
    if replicated:
        rank_zero_info(
            f"Kept whole on every rank, beside the shards (FSDP2 cannot shard a 0-d or non-contiguous parameter): "
            f"{', '.join(name for name, _ in replicated)}."
        )
    shard = partial(
        fully_shard,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params={param for _, param in replicated} or None,
    )
    sharded = [
        shard(wrappers.get(id(unit), unit), reshard_after_forward=config.unit_reshard_after_forward) for unit in units
    ]
    if config.forward_prefetch:
        # Units run in registration order in forward (the wrap policy selects them in module order).
        for unit, next_unit in pairwise(sharded):
            unit.set_modules_to_forward_prefetch([next_unit])
    # The root keeps its parameters gathered after forward (FSDP's default): backward needs them first.
    shard(model)
    if mesh.device_type == "cpu" and config.cpu_collectives == "shared_memory":
        # Opt-in and kept apart: the default is FSDP2's own collectives, the path GPU users run.
        from lightning_shard.cpu import install_shared_memory_collectives

        install_shared_memory_collectives(model)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    # `lightning_module.model.generate(...)` after fit, outside the step methods
    gather_root_for_direct_calls(model)

    if meta:
        _materialize(model, device, offload_policy)
    _carry_through_setup(model, ties, attached)
    # the parameters live now, not those `unshardable_parameters` saw: materialisation may have replaced them
    live = dict(model.named_parameters())
    replicate_unshardable_parameters(model, [live[name] for name, _ in replicated], mesh, device)
    setattr(model, _PARALLELIZED, True)
    return units


def _carry_through_setup(model: nn.Module, ties: list[Tie], attached: AttachedState) -> None:
    """Put what was attached to the model's tensors on the tensors that train, and refuse a tie that did not survive."""
    attached.restore(model)
    check_ties(model, ties)


def _planned_units(model: nn.Module, policy: Any, argument: str, shards: bool = True) -> list[nn.Module]:
    """The modules ``policy`` selects, saying on rank 0 what it had to leave out and when "auto" found no block."""
    plan = plan_units(model, policy, argument, shards)
    if plan.note:
        rank_zero_info(plan.note)
    if plan.left_out:
        # "auto" chose the class; a policy the user wrote named these modules and gets a warning.
        say = rank_zero_info if policy == "auto" else rank_zero_warn
        say(
            f"`{argument}` leaves modules that cannot be units of their own in the unit around them: "
            + "; ".join(f"`{name}` ({reason})" for name, reason in plan.left_out.items())
        )
    return plan.modules


def is_parallelized(model: nn.Module) -> bool:
    """Whether :func:`parallelize_module` has set ``model`` up already (a second ``fit`` of the same module).

    Example:
        >>> is_parallelized(nn.Linear(2, 2))
        False
    """
    return getattr(model, _PARALLELIZED, False)


def sharded_by_hand(model: nn.Module) -> bool:
    """Whether ``model`` came sharded from the user's own code (``configure_model()`` calling ``fully_shard`` /
    ``parallelize_module``, as under Lightning's ``ModelParallelStrategy``) with every parameter under a
    ``fully_shard``: then the strategy keeps that sharding rather than sharding it twice.

    Raises:
        ValueError: the model was sharded by hand in part only (parameters left outside ``fully_shard``), with the
            two ways out.

    Example:
        >>> sharded_by_hand(nn.Linear(2, 2))
        False
    """
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    split = any(isinstance(param, DTensor) for param in model.parameters())
    if not units and not split:
        return False
    covered = {id(param) for unit in units for param in unit.parameters()}
    left = [visible_name(name) for name, param in model.named_parameters() if id(param) not in covered]
    if left:
        done = "`fully_shard`" if units else "`parallelize_module` (tensor parallelism) but not `fully_shard`"
        raise ValueError(
            f"`configure_model()` applied {done} to part of {type(model).__name__} by hand, leaving {left[:4]} "
            f"({len(left)} parameters in all) outside `fully_shard`; the strategy would shard the model a second "
            "time. Either leave the sharding to the strategy - drop those calls and pass `tensor_parallel_size=...` "
            "and your plan as `tensor_parallel_plan` (a dict or `parallelize_fn(model, tp_mesh)`); FSDP follows "
            "`auto_wrap_policy` - or shard all of it by hand, the outermost module included (`fully_shard(self.model)`)"
            ", as under Lightning's ModelParallelStrategy, and the strategy keeps that."
        )
    return True


def _keep_sharding_by_hand(
    model: nn.Module,
    device: torch.device,
    offload_policy: OffloadPolicy,
    forward_methods: Sequence[str],
    meta: bool,
) -> list[nn.Module]:
    rank_zero_info(
        f"`configure_model()` sharded {type(model).__name__} itself (`fully_shard` / `parallelize_module`): the "
        "strategy keeps that sharding and does not apply its own tensor-parallel plan, wrap policy, activation "
        "checkpointing or compile."
    )
    if isinstance(model, FSDPModule):
        for name in forward_methods:
            register_fsdp_forward_method(model, name)
        gather_root_for_direct_calls(model)
    if meta:  # built under the strategy's meta-device context: the initialisation rule, as for its own sharding
        _materialize(model, device, offload_policy)
    setattr(model, _PARALLELIZED, True)
    return [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]


def _materialize(model: nn.Module, device: torch.device, offload_policy: OffloadPolicy) -> None:
    parameter_device, buffer_device = materialization_devices(
        device, cpu_offload=isinstance(offload_policy, CPUOffloadPolicy)
    )
    materialize_sharded_module(model, parameter_device, buffer_device)


# Set on a model :func:`parallelize_module` has set up.
_PARALLELIZED = "_lightning_shard_parallelized"


def _compile_units(units: list[nn.Module], compile_kwargs: dict[str, Any]) -> None:
    """``torch.compile`` each unit in place (``Module.compile``), after activation checkpointing wraps it and before
    ``fully_shard``, as torchtitan compiles each transformer block: the repeated blocks share one compiled graph,
    checkpointing is traced as part of it, and FSDP2's hooks (registered afterwards, excluded from tracing) run
    between the compiled blocks. In place, unlike ``torch.compile(module)``, so parameter names stay unchanged.

    Nested units are compiled at the innermost level only: a compiled parent would trace its children's hooks.
    """
    if not units:
        rank_zero_warn(
            "`compile` compiles the FSDP units (e.g. transformer blocks), but `auto_wrap_policy` selected none, so "
            "nothing is compiled; name the block class in `auto_wrap_policy`, e.g. `['Block']`."
        )
    selected = {id(unit) for unit in units}
    for unit in units:
        if not any(id(child) in selected for child in unit.modules() if child is not unit):
            unit.compile(**compile_kwargs)


def _apply_activation_checkpointing(
    model: nn.Module, modules: list[nn.Module], context_fn: Callable[[], Any] | None
) -> dict[int, nn.Module]:
    """Wrap ``modules`` in torch's non-reentrant ``checkpoint_wrapper``; map each module's id to its wrapper.
    ``context_fn``: selective checkpointing's per-op policy (:mod:`lightning_shard.plan.activation_checkpointing`);
    without
    it the whole module is recomputed.

    The wrapper adds ``_checkpoint_wrapped_module`` to parameter names; state dicts taken through
    torch.distributed.checkpoint and ``Module.state_dict()`` drop it again, so checkpoints keep the plain names.
    """
    if not modules:
        return {}
    selected = {id(m) for m in modules}
    selective = {"context_fn": context_fn} if context_fn is not None else {}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **selective),
        check_fn=lambda module: id(module) in selected,
    )
    return {
        id(getattr(wrapper, CHECKPOINT_WRAPPED_MODULE)): wrapper
        for wrapper in model.modules()
        if isinstance(wrapper, CheckpointWrapper)
    }


def _broadcast_from_rank_zero(model: nn.Module, device: torch.device) -> None:
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_meta:
                continue  # materialised later from rank 0's random stream
            # nccl broadcasts device tensors only; copy through `device` one tensor at a time.
            staged = tensor.detach().to(device)
            dist.broadcast(staged, src=0)
            tensor.copy_(staged)
