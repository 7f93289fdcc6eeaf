"""``ShardingConfig``: the user's sharding settings, checked once at construction.

Every check here runs before any process starts, and every error names the value and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_shard.plan.activation_checkpointing import SELECTIVE, resolve_ops
from lightning_shard.plan.wrap import WrapPolicy, validate_policy
from lightning_shard.tensor_parallel.plan import TensorParallelPlan, check_tensor_parallel_settings

ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "auto"]
StateDictType = Literal["sharded", "full"]
CpuCollectives = Literal["gloo", "shared_memory"]
# Where gradients accumulate over the micro-batches of one optimizer step (Trainer(accumulate_grad_batches=k)).
GradientAccumulation = Literal["sharded", "unsharded"]
# The mesh dimension names Lightning's ModelParallelStrategy gives its 2-D mesh; the data-parallel one is an alias
# of the "replicate" / "shard" dimensions (flattened), which keep their names.
TENSOR_PARALLEL_DIM = "tensor_parallel"
DATA_PARALLEL_DIM = "data_parallel"


@dataclass(frozen=True)
class ShardingConfig:
    """What to shard and how; the strategy applies it, :func:`~lightning_shard.plan.parallelize.parallelize_module`
    reads it.

    Example:
        >>> ShardingConfig(sharding_strategy="SHARD_GRAD_OP").unit_reshard_after_forward
        False
        >>> ShardingConfig(sharding_strategy="HYBRID_SHARD").mesh_shape(world_size=8, devices_per_node=4)
        (2, 4)
        >>> ShardingConfig(tensor_parallel_size=2).mesh_shape(world_size=8, devices_per_node=4)
        (4,)
    """

    sharding_strategy: ShardingStrategyName = "FULL_SHARD"
    auto_wrap_policy: WrapPolicy = "auto"
    activation_checkpointing: WrapPolicy = None
    reshard_after_forward: bool | int | None = None
    forward_prefetch: bool = False
    cpu_offload: bool | CPUOffloadPolicy = False
    hybrid_shard_size: int | None = None
    # FSDPStrategy's `device_mesh=(replicas, shard_size)`: the replicas the user expects, checked against the world.
    hybrid_replicas: int | None = None
    state_dict_type: StateDictType = "sharded"
    cpu_collectives: CpuCollectives = "gloo"
    compile: bool | Mapping[str, Any] = False
    gradient_accumulation: GradientAccumulation = "sharded"
    save_frozen_pretrained_weights: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_plan: TensorParallelPlan = "auto"
    selective_checkpointing_ops: Sequence[str] | None = None
    activation_memory_budget: float | None = None

    def __post_init__(self) -> None:
        _check_choice("sharding_strategy", self.sharding_strategy, get_args(ShardingStrategyName))
        _check_choice("state_dict_type", self.state_dict_type, get_args(StateDictType))
        _check_choice("cpu_collectives", self.cpu_collectives, get_args(CpuCollectives))
        if isinstance(self.gradient_accumulation, int):
            raise TypeError(
                f"`gradient_accumulation={self.gradient_accumulation!r}` says where gradients accumulate, 'sharded' "
                "or 'unsharded'; the number of micro-batches is the Trainer's `accumulate_grad_batches`."
            )
        _check_choice("gradient_accumulation", self.gradient_accumulation, get_args(GradientAccumulation))
        validate_policy(self.auto_wrap_policy, "auto_wrap_policy")
        if self.activation_checkpointing != SELECTIVE:
            validate_policy(self.activation_checkpointing, "activation_checkpointing")
        _check_compile(self.compile)
        self._check_checkpointing_forms()
        check_tensor_parallel_settings(self.tensor_parallel_size, self.tensor_parallel_plan)
        if self.tensor_parallel_size > 1 and self.cpu_collectives != "gloo":
            raise ValueError(
                f"`cpu_collectives={self.cpu_collectives!r}` replaces FSDP2's collectives on data-parallel meshes "
                "only; with `tensor_parallel_size > 1` keep the default 'gloo'."
            )
        if not isinstance(self.cpu_offload, (bool, CPUOffloadPolicy)):
            raise TypeError(
                f"`cpu_offload={self.cpu_offload!r}` must be a bool or a `torch.distributed.fsdp.CPUOffloadPolicy`."
            )
        if self.sharding_strategy == "auto" and (self.cpu_offload or self.reshard_after_forward is not None):
            raise ValueError(
                "`sharding_strategy='auto'` chooses the sharding and CPU offload from the memory estimate; drop "
                "`cpu_offload` / `reshard_after_forward`, or name a sharding strategy such as 'FULL_SHARD'."
            )
        if self.cpu_offload and self.sharding_strategy == "NO_SHARD":
            raise ValueError(
                "`cpu_offload=True` with `sharding_strategy='NO_SHARD'` would copy every whole parameter between CPU "
                "and device each step; offload goes with sharding: use `sharding_strategy='FULL_SHARD'`."
            )
        for name in ("forward_prefetch", "save_frozen_pretrained_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}={getattr(self, name)!r}` must be True or False.")
        rafp = self.reshard_after_forward
        if rafp is not None and not isinstance(rafp, (bool, int)):
            raise TypeError(f"`reshard_after_forward={rafp!r}` must be a bool, an int shard size, or None.")
        if isinstance(rafp, int) and not isinstance(rafp, bool) and rafp < 2:
            raise ValueError(
                f"`reshard_after_forward={rafp}`: an int is the group size to reshard to after forward and must be "
                "at least 2 and divide the shard group size; use True/False for full or no resharding."
            )
        if rafp is not None and self.sharding_strategy == "NO_SHARD":
            raise ValueError(
                f"`reshard_after_forward={rafp!r}` has no effect with `sharding_strategy='NO_SHARD'` (nothing is "
                "sharded); drop it or choose 'FULL_SHARD'."
            )
        for name, what in (("hybrid_shard_size", "ranks per shard group"), ("hybrid_replicas", "shard groups")):
            size = getattr(self, name)
            if size is None:
                continue
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"`{name}={size!r}` must be an int number of {what}.")
            if size < 1:
                raise ValueError(f"`{name}={size}` must be a positive number of {what}.")
            if self.sharding_strategy != "HYBRID_SHARD":
                raise ValueError(
                    f"`{name}={size}` only applies to `sharding_strategy='HYBRID_SHARD'`, "
                    f"not {self.sharding_strategy!r}."
                )

    def _check_checkpointing_forms(self) -> None:
        ops = self.selective_checkpointing_ops
        if ops is not None:
            if self.activation_checkpointing != SELECTIVE:
                raise ValueError(
                    f"`selective_checkpointing_ops={ops!r}` lists the ops whose outputs selective checkpointing keeps; "
                    "it needs `activation_checkpointing='selective'`."
                )
            if isinstance(ops, str) or not ops:
                raise TypeError(f"`selective_checkpointing_ops={ops!r}` must be a non-empty list of op names.")
            resolve_ops(ops)
        budget = self.activation_memory_budget
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise ValueError(
                f"`activation_memory_budget={budget!r}` is the fraction of the activations to keep, from 0 (recompute "
                "everything that can be) to 1 (keep all): a number between 0 and 1."
            )
        if self.compile is False:
            raise ValueError(
                f"`activation_memory_budget={budget}` is a budget for torch.compile's partitioner, which decides what "
                "backward recomputes; it needs `compile=True`. Without compiling, use `activation_checkpointing="
                "'selective'` or a module policy such as `['Block']`."
            )
        if self.activation_checkpointing is not None:
            raise ValueError(
                f"`activation_memory_budget={budget}` lets the compiler choose what to recompute; it replaces "
                f"`activation_checkpointing={self.activation_checkpointing!r}`: drop one of them."
            )

    @property
    def checkpointed_blocks(self) -> WrapPolicy:
        """The modules ``activation_checkpointing`` names: ``"selective"`` checkpoints the ``"auto"`` blocks."""
        return "auto" if self.activation_checkpointing == SELECTIVE else self.activation_checkpointing

    @property
    def compile_kwargs(self) -> dict[str, Any] | None:
        """``torch.compile`` keyword arguments for each FSDP unit, or ``None`` to run eagerly.

        ``compile=True`` takes torch.compile's defaults (``fullgraph=False``: a model with a graph break still runs,
        the break falling back to eager; pass ``{"fullgraph": True}`` to make one an error).
        """
        if self.compile is False:
            return None
        return {} if self.compile is True else dict(self.compile)

    @property
    def unit_reshard_after_forward(self) -> bool | int:
        """``reshard_after_forward`` for the non-root units."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        # NO_SHARD's shard groups hold one rank: resharding would only copy.
        return self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")

    def mesh_shape(self, world_size: int, devices_per_node: int) -> tuple[int, ...]:
        """The data-parallel mesh: ``(dp,)`` to shard over all data-parallel ranks, ``(replicas, shard_size)``
        otherwise; ``dp`` is the world divided by ``tensor_parallel_size`` (the strategy adds the tensor-parallel
        dimension last, :meth:`mesh_dim_names`).

        NO_SHARD is FSDP2 on a ``(dp, 1)`` mesh: each parameter is replicated and "sharded" over one rank.
        "auto" gets the 1-D mesh until the model is known and the strategy is chosen. Under HYBRID_SHARD a shard
        group is one node's data-parallel ranks by default: ``devices_per_node / tensor_parallel_size``.
        """
        data_parallel = self.data_parallel_size(world_size)
        if self.sharding_strategy == "NO_SHARD":
            return (data_parallel, 1)
        if self.sharding_strategy != "HYBRID_SHARD":
            return (data_parallel,)
        shard_size = self.hybrid_shard_size or max(devices_per_node // self.tensor_parallel_size, 1)
        # Under tensor parallelism the data-parallel ranks are what the replicas and shard groups divide.
        ranks = "ranks" if self.tensor_parallel_size == 1 else "data-parallel ranks"
        world = "world size" if self.tensor_parallel_size == 1 else "data-parallel size"
        if self.hybrid_replicas is not None and self.hybrid_replicas * shard_size != data_parallel:
            raise ValueError(
                f"`device_mesh=({self.hybrid_replicas}, {shard_size})` describes {self.hybrid_replicas * shard_size} "
                f"{ranks}, but the job has {data_parallel} (num_nodes x devices / tensor_parallel_size); pass "
                f"`device_mesh=({data_parallel // shard_size}, {shard_size})` or `hybrid_shard_size={shard_size}` "
                "alone (the replicas follow from the world size)."
            )
        if data_parallel % shard_size:
            raise ValueError(
                f"`hybrid_shard_size={shard_size}` does not divide the {world} {data_parallel}; choose a divisor of "
                f"{data_parallel} (by default it is the devices per node / tensor_parallel_size)."
            )
        return (data_parallel // shard_size, shard_size)

    def data_parallel_size(self, world_size: int) -> int:
        """The ranks that see different data: the world divided by ``tensor_parallel_size``.

        Example:
            >>> ShardingConfig(tensor_parallel_size=2).data_parallel_size(8)
            4
        """
        if world_size % self.tensor_parallel_size:
            raise ValueError(
                f"`tensor_parallel_size={self.tensor_parallel_size}` does not divide the world size {world_size} "
                "(num_nodes x devices); choose a divisor, usually the devices of one node or fewer."
            )
        return world_size // self.tensor_parallel_size

    def mesh_dim_names(self, data_parallel_dims: int) -> tuple[str, ...]:
        """Names of the strategy's mesh dimensions: ``"shard"`` (and ``"replicate"`` before it on a 2-D
        data-parallel mesh), then ``"tensor_parallel"`` when ``tensor_parallel_size > 1``.

        Example:
            >>> ShardingConfig(sharding_strategy="HYBRID_SHARD", tensor_parallel_size=2).mesh_dim_names(2)
            ('replicate', 'shard', 'tensor_parallel')
        """
        names = ("replicate", "shard")[-data_parallel_dims:]
        return (*names, TENSOR_PARALLEL_DIM) if self.tensor_parallel_size > 1 else names


def _check_compile(value: object) -> None:
    """``compile`` is a bool or torch.compile's keyword arguments; try them on a function now (no compilation
    happens until it is called) so a misspelt mode, backend or option fails here, not after the processes start."""
    if isinstance(value, bool):
        return
    example = "e.g. `{'mode': 'max-autotune'}`"
    if not isinstance(value, Mapping):
        raise TypeError(f"`compile={value!r}` must be True, False or a dict of torch.compile arguments, {example}.")
    accepted = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(str(key) for key in value if key not in accepted)
    if unknown:
        raise ValueError(f"`compile={dict(value)!r}`: {unknown} are not torch.compile arguments; use {accepted}.")
    try:
        torch.compile(_identity, **value)
    except Exception as error:  # torch raises RuntimeError, AssertionError or its own InvalidBackend here
        raise ValueError(f"`compile={dict(value)!r}` is refused by torch.compile: {error}") from error


def _identity(x: Any) -> Any:
    return x


def _check_choice(argument: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{argument}={value!r}` is not one of {choices}.")
