"""``estimate_memory(..., mode="simulate")``: train the sharded model for two optimizer steps under fake tensors.

No real storage is ever allocated, whatever the model's size: the model is built on the meta device (as the
strategy's ``model_sharded_context`` does for ``configure_model()``), then checkpointed, sharded and materialised by
the strategy's own :func:`~lightning_shard.plan.parallelize.parallelize_module` inside ``FakeTensorMode``, so every
parameter, gradient, optimizer state, activation and input is a fake tensor (shape, dtype and device; no data). The
process group is torch's fake one of the requested size; ``FSDPMemTracker`` records the bytes one rank would hold,
by category, at the peak. The 13B GPT on 8 ranks simulates in 82 s on 2 shared CPU cores with 0.38 GiB of peak RSS
(docs/memory.md).

The steps follow Lightning's order. The first optimizer step runs one micro-batch, to create the optimizer states;
the second runs ``min(accumulate_grad_batches, 2)`` (a third would hold what the second does). Each first
micro-batch's forward runs before ``zero_grad``, so the previous step's gradients are held with its activations, as
in a Lightning fit; under ``gradient_accumulation="unsharded"`` the non-final micro-batches skip the reduce-scatter,
as ``ShardedStrategy.block_backward_sync`` does. Parameters keep the ``requires_grad`` the model gives them: frozen
ones (a LoRA model's base) get no gradient, and the optimizer is built over the trainable ones only. A transformers
model is built as in a run, but its pretrained files are not read (:func:`lightning_shard.hf.from_pretrained`'s load
has no values to write) and its init's check for tensors left unset is skipped (no values to check); the loss is
taken from its output's first tensor, the logits.

Everything runs on the CPU device, so this measures the device-side footprint of a run without offload;
``cpu_offload`` is not simulated. The fake process group is global state of the process, so the simulation runs
in a spawned subprocess: the model and input functions must be picklable (module-level functions or
``functools.partial`` of them).

Example:
    >>> from functools import partial
    >>> from lightning_shard.memory import estimate_memory
    >>> est = estimate_memory(partial(nn.Linear, 64, 64), mode="simulate", world_size=4,
    ...                       input_fn=partial(torch.randn, 8, 64))  # doctest: +SKIP
"""

import multiprocessing
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import OffloadPolicy

from lightning_shard.init.materialize import meta_construction
from lightning_shard.memory.accounting import unsharded_gradients
from lightning_shard.memory.breakdown import MemoryBreakdown, MemoryEstimate
from lightning_shard.memory.process_memory import host_memory
from lightning_shard.memory.units import ParameterCounts, checkpointing_mode, count_parameters
from lightning_shard.plan.config import ShardingConfig
from lightning_shard.plan.parallelize import parallelize_module
from lightning_shard.plan.precision import ShardedPrecision
from lightning_shard.torch_compat.dispatch import tree_leaves
from lightning_shard.torch_compat.fsdp import memory_simulation_tools

# FSDPMemTracker categories (``_FSDPRefType`` values) summed into each MemoryBreakdown field. "Unsharded Grad" is a
# unit's whole gradient before its reduce-scatter - a per-unit transient - unless accumulation is unsharded, where
# the simulation tags the whole gradients kept between micro-batches with it.
_CATEGORIES = {
    "params": ("Sharded Param", "Buffer"),
    "grads": ("Sharded Grad",),
    "accumulated_grads": (),
    "optimizer_states": ("OptState",),
    "gathered_peak": ("Unsharded Param", "All Gather", "Reduce Scatter"),
    "activations": ("Activation", "Temp", "Inputs"),
}


def simulate_memory(
    model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any], config: dict[str, Any]
) -> MemoryEstimate:
    """Simulate one rank of the run described by ``config`` (the keys ``estimate_memory`` fills) in a subprocess."""
    if config["cpu_offload"]:
        raise ValueError("simulate mode runs everything on the CPU device, so it cannot separate offloaded memory")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        counts, peak, simulation = pool.submit(_simulate_reporting_errors, model_fn, input_fn, config).result()
    return MemoryEstimate(
        n_params=counts.total,
        trainable_params=counts.trainable,
        device=MemoryBreakdown(**peak),
        cpu=MemoryBreakdown(),
        config=config,
        simulation=simulation,
    )


def _make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    # Over the trainable parameters only, as a LoRA module's `configure_optimizers` builds it.
    params = [p for p in model.parameters() if p.requires_grad]
    if name in ("adam", "adamw"):
        return torch.optim.AdamW(params)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if name == "sgd" else 0.0)


def _loss(output: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        # a tuple, dict or transformers' ModelOutput (a pytree): its first tensor, the logits
        output = next(leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor))
    return output if output.ndim == 0 else output.float().mean()


def _simulate_reporting_errors(
    model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any], config: dict[str, Any]
) -> tuple[ParameterCounts, dict[str, int], dict[str, float]]:
    """:func:`_simulate_in_this_process`, its errors sent back as text: some (fake tensor ops) do not pickle, and the
    parent would see only that."""
    try:
        return _simulate_in_this_process(model_fn, input_fn, config)
    except Exception:
        raise RuntimeError(f"The simulation failed:\n{traceback.format_exc()}") from None


def _simulate_in_this_process(
    model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any], config: dict[str, Any]
) -> tuple[ParameterCounts, dict[str, int], dict[str, float]]:
    # Imported here, in the simulating subprocess only: the tracker's imports take seconds.
    tools = memory_simulation_tools()

    start = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=config["world_size"], store=tools["FakeStore"]())
    try:
        sharding = ShardingConfig(
            sharding_strategy=config["sharding_strategy"],
            activation_checkpointing=_checkpointed(config["activation_checkpointing"]),
            gradient_accumulation=config["gradient_accumulation"],
        )
        # The mesh is built from real rank lists, outside FakeTensorMode (there it would be a data-dependent op).
        shape = sharding.mesh_shape(config["world_size"], config["world_size"] // config["num_nodes"])
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        precision = ShardedPrecision(config["precision"])
        # As the strategy's `model_sharded_context`: build on the meta device in the stored dtype, convert "-true"
        # precisions.
        with meta_construction(), precision.tensor_init_context():
            model = precision.convert_module(model_fn())
        counts = count_parameters(model)
        # The meta parameters are inputs to the ops fully_shard runs on them; materialisation then allocates fake
        # CPU tensors in their place.
        with tools["FakeTensorMode"](allow_non_fake_inputs=True):
            policies = {"mp_policy": precision.mp_policy, "offload_policy": OffloadPolicy()}
            parallelize_module(model, mesh, sharding, **policies, device=torch.device("cpu"))
            optimizer = _make_optimizer(config["optimizer"], model)
            inputs = input_fn()
            tracker = tools["FSDPMemTracker"](model, optimizer)
            tracker.track_inputs((inputs,))
            skip_sync = sharding.gradient_accumulation == "unsharded"
            micro_batches = min(config["accumulate_grad_batches"], 2)
            with tracker:
                # The first step only creates the optimizer states the second one holds.
                _optimizer_step(model, optimizer, inputs, tracker, micro_batches=1, skip_sync=skip_sync)
                _optimizer_step(model, optimizer, inputs, tracker, micro_batches=micro_batches, skip_sync=skip_sync)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        by_name = {getattr(key, "value", key): value for key, value in peak.items()}
        breakdown = {field: sum(by_name.get(c, 0) for c in cats) for field, cats in _CATEGORIES.items()}
        held = "accumulated_grads" if skip_sync and micro_batches > 1 else "gathered_peak"
        breakdown[held] += by_name.get(tools["UNSHARDED_GRAD"].value, 0)
        simulation = {"wall_seconds": time.perf_counter() - start, "peak_rss_bytes": host_memory()["peak_rss_bytes"]}
        return counts, breakdown, simulation
    finally:
        dist.destroy_process_group()


def _checkpointed(activation_checkpointing: bool | str) -> str | None:
    """The strategy's setting for the estimator's mode: the ``"auto"`` blocks, recomputed whole or per op."""
    mode = checkpointing_mode(activation_checkpointing)
    return {"none": None, "full": "auto", "selective": "selective"}[mode]


def _optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Any,
    tracker: Any,
    *,
    micro_batches: int,
    skip_sync: bool,
) -> None:
    """One optimizer step over ``micro_batches``, in Lightning's order (see the module docstring)."""
    tools = memory_simulation_tools()
    for micro_batch in range(micro_batches):
        # Per-module stats are per iteration (the tracker refuses a second call of the root); the global peak it
        # keeps is what is read.
        tracker.reset_mod_stats()
        final = micro_batch == micro_batches - 1
        loss = _loss(model(inputs))  # the model's output is not kept, as in a training step
        if micro_batch == 0:
            optimizer.zero_grad(set_to_none=True)
        model.set_requires_gradient_sync(final or not skip_sync)  # type: ignore[operator]
        loss.backward()
        if not final:
            for grad in unsharded_gradients(model):
                # FSDP2 upcasts them in its post-backward hook, which the tracker counts as "Temp".
                tools["tag"](tracker, grad, tools["UNSHARDED_GRAD"])
    optimizer.step()
