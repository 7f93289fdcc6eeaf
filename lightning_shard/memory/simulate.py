"""``estimate_memory(..., mode="simulate")``: run one real training step of the sharded model under fake tensors.

The model is built under ``FakeTensorMode`` (no storage is allocated), wrapped with ``fully_shard`` per unit on a
fake process group of the requested size, and trained for two steps (the second one has optimizer states) while
``FSDPMemTracker`` records the bytes one rank would hold, by category, at the peak. Everything runs on the CPU
device, so this measures the device-side footprint of a non-offloaded run; ``cpu_offload`` is not simulated.

The fake process group is global state of the process, so the simulation runs in a spawned subprocess: the model
and input functions must be picklable (module-level functions or ``functools.partial`` of them).

Example:
    >>> from functools import partial
    >>> from lightning_shard.memory import estimate_memory
    >>> est = estimate_memory(partial(nn.Linear, 64, 64), mode="simulate", world_size=4,
    ...                       input_fn=partial(torch.randn, 8, 64))  # doctest: +SKIP
"""

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.memory.breakdown import MemoryBreakdown, MemoryEstimate
from lightning_shard.memory.units import count_parameters, mesh_shape, wrap_units

# FSDPMemTracker categories (``_FSDPRefType`` values) summed into each MemoryBreakdown field.
_CATEGORIES = {
    "params": ("Sharded Param", "Buffer"),
    "grads": ("Sharded Grad", "Unsharded Grad"),
    "optimizer_states": ("OptState",),
    "gathered_peak": ("Unsharded Param", "All Gather", "Reduce Scatter"),
    "activations": ("Activation", "Temp", "Inputs"),
}
_LOW_PRECISION = {"bf16": torch.bfloat16, "16": torch.float16}


def simulate_memory(
    model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any], config: dict[str, Any]
) -> MemoryEstimate:
    """Simulate one rank of the run described by ``config`` (the keys ``estimate_memory`` fills) in a subprocess."""
    if config["cpu_offload"]:
        raise ValueError("simulate mode runs everything on the CPU device, so it cannot separate offloaded memory")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        n_params, peak = pool.submit(_simulate_in_this_process, model_fn, input_fn, config).result()
    return MemoryEstimate(n_params=n_params, device=MemoryBreakdown(**peak), cpu=MemoryBreakdown(), config=config)


def _make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name in ("adam", "adamw"):
        return torch.optim.AdamW(params)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if name == "sgd" else 0.0)


def _simulate_in_this_process(
    model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any], config: dict[str, Any]
) -> tuple[int, dict[str, int]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=config["world_size"], store=FakeStore())
    try:
        # The mesh is built from real rank lists; under FakeTensorMode that would be a data-dependent op.
        # A 2-D (replicate, shard) mesh makes fully_shard replicate across the first dimension (HSDP).
        shape = mesh_shape(config["sharding_strategy"], config["world_size"], config["num_nodes"])
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        precision, _, kind = config["precision"].partition("-")
        low = _LOW_PRECISION.get(precision)
        mp_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if kind == "mixed" else None
        with FakeTensorMode():
            # "-true" low precision builds the parameters in that dtype (Module.to would swap fake tensors).
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(low if kind == "true" and low else torch.float32)
            try:
                model = model_fn()
            finally:
                torch.set_default_dtype(default_dtype)
            n_params = count_parameters(model)[0]
            if config["activation_checkpointing"]:
                units = {id(unit) for unit in wrap_units(model)}
                apply_activation_checkpointing(model, check_fn=lambda module: id(module) in units)
            shard_kwargs = {"mesh": mesh, "reshard_after_forward": config["sharding_strategy"] != "SHARD_GRAD_OP"}
            if mp_policy is not None:
                shard_kwargs["mp_policy"] = mp_policy
            for unit in wrap_units(model):
                fully_shard(unit, **shard_kwargs)
            fully_shard(model, **shard_kwargs)
            optimizer = _make_optimizer(config["optimizer"], model.parameters())
            inputs = input_fn()
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((inputs,))
            with tracker:
                for step in range(2):  # the second step holds the optimizer states created by the first
                    if step:
                        # Per-module stats are per iteration (the tracker refuses a second call of the root);
                        # the global peak it keeps is what is read below.
                        tracker.reset_mod_stats()
                    output = model(inputs)
                    loss = output if output.ndim == 0 else output.float().mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        by_name = {getattr(key, "value", key): value for key, value in peak.items()}
        return n_params, {field: sum(by_name.get(c, 0) for c in cats) for field, cats in _CATEGORIES.items()}
    finally:
        dist.destroy_process_group()
