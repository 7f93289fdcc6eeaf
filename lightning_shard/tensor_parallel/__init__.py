"""Tensor parallelism on the mesh's ``tensor_parallel`` dimension: which modules of a model are split across the ranks
of one tensor-parallel group, and how (``ShardedStrategy(tensor_parallel_size=k, tensor_parallel_plan=...)``).

:mod:`~lightning_shard.tensor_parallel.plan` holds the plan forms and their checks and applies them;
:mod:`~lightning_shard.tensor_parallel.lora` makes peft's LoRA adapters follow their base layer's plan;
:mod:`~lightning_shard.tensor_parallel.litgpt` is litgpt's plan.
:func:`~lightning_shard.plan.parallelize.parallelize_module` calls :func:`apply_tensor_parallel_plan` first, before
activation checkpointing, compile and ``fully_shard`` (torchtitan's order).
"""

from lightning_shard.tensor_parallel.plan import (
    PLAN_STYLES,
    ResolvedPlan,
    TensorParallelPlan,
    apply_tensor_parallel_plan,
    check_tensor_parallel_settings,
    register_plan_source,
    resolve_plan,
    split_parameters,
)

__all__ = [
    "PLAN_STYLES",
    "ResolvedPlan",
    "TensorParallelPlan",
    "apply_tensor_parallel_plan",
    "check_tensor_parallel_settings",
    "register_plan_source",
    "resolve_plan",
    "split_parameters",
]

from lightning_shard.tensor_parallel import litgpt as _litgpt  # noqa: E402, F401  (registers litgpt's plan)
