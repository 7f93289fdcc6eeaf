"""``sharding_strategy="auto"``: the least communication that fits, chosen from the memory estimate.

Options are tried from the cheapest in communication to the most frugal in memory - NO_SHARD (one all-reduce
per step), SHARD_GRAD_OP (no all-gather in backward), FULL_SHARD, then FULL_SHARD with CPU offload (CUDA only) -
and the first whose estimated per-rank device memory stays within ``headroom`` of the device's memory wins.
Activations are not part of this estimate (the micro-batch is unknown when the model is sharded): the headroom
leaves room for them. The whole gradients kept between micro-batches under ``gradient_accumulation="unsharded"``
(with ``accumulate_grad_batches > 1``) are counted: they sit on the device of every option, offload included.
Frozen parameters (``requires_grad=False``, a LoRA model's base) are counted as the model has them: stored and
gathered, without gradients or optimizer states, so a LoRA run may fit with less sharding than its full fine-tune.
A weight-averaging callback's fp32 copy is counted where it will be kept (``weight_averaging``): beside the sharded
parameters on the device, or in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_shard.memory.estimate import WeightAveragingPlace, estimate_memory
from lightning_shard.memory.units import count_parameters
from lightning_shard.plan.config import GradientAccumulation
from lightning_shard.tensor_parallel import TensorParallelPlan

GIB = 2**30
_OPTIONS = (("NO_SHARD", False), ("SHARD_GRAD_OP", False), ("FULL_SHARD", False), ("FULL_SHARD", True))


@dataclass(frozen=True)
class ShardingChoice:
    """The chosen sharding strategy, whether to offload, and why."""

    sharding_strategy: str
    cpu_offload: bool
    reason: str


def choose_sharding(
    model: nn.Module,
    *,
    world_size: int,
    precision: str,
    activation_checkpointing: bool | str,
    device_memory_bytes: int,
    can_offload: bool,
    accumulate_grad_batches: int = 1,
    gradient_accumulation: GradientAccumulation = "sharded",
    weight_averaging: WeightAveragingPlace | None = None,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: TensorParallelPlan = "auto",
    headroom: float = 0.7,
) -> ShardingChoice:
    """Pick the sharding for ``model`` (meta device is fine) on ranks with ``device_memory_bytes`` each; under tensor
    parallelism the estimate is one tensor-parallel rank's share of the model, sharded over the data-parallel ranks.

    Example:
        >>> choice = choose_sharding(nn.Linear(1000, 1000), world_size=2, precision="32-true",
        ...                          activation_checkpointing=False, device_memory_bytes=2**30, can_offload=False)
        >>> choice.sharding_strategy
        'NO_SHARD'
    """
    budget = int(device_memory_bytes * headroom)
    accumulating_whole = gradient_accumulation == "unsharded" and accumulate_grad_batches > 1
    needs = []
    total, _, trainable, _ = count_parameters(model)
    counts = f"{total:,} parameters" + (f", {total - trainable:,} of them frozen" if trainable < total else "")
    if tensor_parallel_size > 1:
        counts += f", split over {tensor_parallel_size} tensor-parallel ranks"
    for sharding_strategy, offload in _OPTIONS:
        if offload and not can_offload:
            continue
        estimate = estimate_memory(
            model,
            world_size=world_size,
            sharding_strategy=sharding_strategy,  # type: ignore[arg-type]
            precision=precision,
            cpu_offload=offload,
            activation_checkpointing=activation_checkpointing,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_accumulation=gradient_accumulation,
            weight_averaging=weight_averaging,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_plan=tensor_parallel_plan,
        )
        label = sharding_strategy + (" + CPU offload" if offload else "")
        needs.append(f"{label} {_size(estimate.device.total_bytes)}")
        if estimate.device.total_bytes <= budget:
            reason = (
                f"estimated per-rank model state ({counts}) {'; '.join(needs)}; budget {_size(budget)} "
                f"({headroom:.0%} of {_size(device_memory_bytes)}): {label} is the cheapest that fits"
            )
            return ShardingChoice(sharding_strategy, offload, reason)
    raise MemoryError(
        f"No sharding fits: estimated per-rank model state ({counts}) {'; '.join(needs)}, but the budget is "
        f"{_size(budget)} ({headroom:.0%} of {_size(device_memory_bytes)}). Use more ranks, a lower "
        "precision ('bf16-true'), or CPU offload on CUDA"
        + (", or keep accumulated gradients sharded (gradient_accumulation='sharded')." if accumulating_whole else ".")
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


def device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    """Memory one rank may use: the GPU's total memory, or this machine's RAM shared by its local ranks.

    Example:
        >>> device_memory_bytes(torch.device("cpu"), 2) > 0
        True
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().total // max(local_world_size, 1)
