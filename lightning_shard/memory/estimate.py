"""Per-rank memory estimate for sharded (FSDP2 ``fully_shard``) training, before running it.

Formula (ZeRO-style accounting, per rank; ``Ψ`` parameters, ``N`` ranks a parameter is sharded over, ``U`` the
parameters of the largest wrap unit):

* model states: parameters ``p`` B, gradients ``g`` B, optimizer states ``k × p`` B per parameter, divided by ``N``.
  Frozen parameters (``requires_grad=False``: the base of a LoRA model) have no gradient and no optimizer state, so
  ``Ψ_t`` trainable of ``Ψ`` parameters cost ``(p × Ψ + (g + k × p) × Ψ_t) / N``. ``"32-true"``: p = g = 4.
  ``"bf16-mixed"`` / ``"16-mixed"``: sharded parameters, frozen or not, and gradients stay fp32 (p = g = 4, FSDP2
  ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``). ``"bf16-true"`` / ``"16-true"``: p = g = 2.
  ``k`` = 2 for Adam/AdamW (``exp_avg``, ``exp_avg_sq``), 1 for SGD with momentum, 0 without.
* gathered units: FSDP2 computes on a gathered copy of each unit in the compute dtype (``c`` = 2 B in 16-bit, 4 B in
  fp32), also on a one-rank shard group. FULL_SHARD / HYBRID_SHARD hold about three units at once - the root (kept
  gathered from its forward to the end of backward), the unit computing and the next one's all-gather buffer -
  ``3 × U × c``; SHARD_GRAD_OP and NO_SHARD keep every unit gathered from its forward to its backward, ``Ψ × c``.
  Plus one unit's reduce-scatter input in the reduce dtype, ``U_t × g`` (``U_t``: the most trainable parameters of
  one unit; FSDP2 reduces only the gradients that exist).
* sharding: FULL_SHARD / SHARD_GRAD_OP shard over all ``world_size`` ranks, HYBRID_SHARD over the ranks of one node
  (``world_size / num_nodes``), NO_SHARD not at all.
* ``cpu_offload`` moves the sharded parameters, gradients and optimizer states to host memory; the gathered units and
  activations stay on the device.
* parameters ``fully_shard`` cannot shard (0-d such as CLIP's ``logit_scale``, non-contiguous) are kept whole on every
  rank (:mod:`lightning_shard.plan.replicated`): ``p``, ``g`` and ``k × p`` B each, undivided, on the device also under
  ``cpu_offload``.
* gradient accumulation over ``k = accumulate_grad_batches`` micro-batches: by default (``gradient_accumulation=
  "sharded"``) every micro-batch is reduce-scattered into the sharded gradients, which costs nothing more. With
  ``"unsharded"`` and ``k > 1`` the non-final micro-batches skip the reduce-scatter and FSDP2 keeps every
  trainable parameter's whole gradient, in the reduce dtype (``g`` B: fp32 under the mixed precisions), on every rank
  until the last micro-batch's reduce-scatter: ``accumulated_grads = g × Ψ_t``, on the device also under ``cpu_offload``
  (they are the gradients of the gathered parameters, which live there). Meanwhile the sharded gradients do not
  exist on the device (Lightning frees them after the previous step; the last reduce-scatter creates them as it
  frees the whole ones), so the device's ``grads`` is 0 at its peak; with ``cpu_offload`` they stay on the host.
* tensor parallelism (``tensor_parallel_size = t > 1``): the plan's split parameters (``Ψ_s`` of ``Ψ``: the linear
  layers' weights, column-wise biases, vocabulary-split embeddings) count ``1/t`` per rank, the rest whole: every count
  above is one tensor-parallel rank's, ``Ψ - Ψ_s + Ψ_s/t``, and FSDP shards it over the ``world_size / t``
  data-parallel ranks.
* activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2):
  ``s·b·h·(34 + 5·a·s/h)`` bytes per layer in 16-bit (doubled in fp32) for sequence ``s``, micro-batch ``b``, width
  ``h``, heads ``a``; under tensor parallelism without sequence parallelism (their eq. 4) ``s·b·h·(10 + 24/t +
  5·a·s/(h·t))``: the norms' and dropouts' activations stay whole on every rank. The ``5·a·s/h`` term is the attention
  scores, softmax and its dropout mask; fused attention (``scaled_dot_product_attention``'s flash and memory-efficient
  kernels, what the example GPT, transformers' ``"sdpa"`` and litgpt use) keeps none of it, so it is counted only with
  ``fused_attention=False`` (eager attention). With activation checkpointing (``activation_checkpointing=True`` or
  ``"full"``) each layer keeps only its input, ``2·s·b·h`` (16-bit), plus one layer recomputed in full; with
  ``"selective"`` (the per-op policy of :mod:`lightning_shard.plan.activation_checkpointing`) also the outputs it saves,
  the first and third of a GPT block's four matmuls (qkv ``3h``, MLP in ``4h``) and attention's (``h``), split over
  the tensor-parallel ranks: ``2·s·b·h·(1 + 8/t)`` per layer, plus one layer recomputed in full. Plus ``4·s·b·V`` for
  the fp32 logits fed to the loss. Zero unless ``n_layer``, ``n_embd``, ``n_head`` and ``seq_len`` are given. All of
  them at once: an upper bound of what backward holds at its peak.
* weight averaging (EMA, SWA; :mod:`lightning_shard.averaging`): an fp32 copy of every parameter, sharded like them,
  ``4 × Ψ / N`` B, beside the sharded parameters (``weight_averaging="device"``: on the device, or on the host under
  ``cpu_offload``) or in host memory (``"cpu"``, the callbacks' ``device="cpu"``).
* activations are counted as for full fine-tuning also when most parameters are frozen: an upper bound there (a
  frozen layer needs no input saved for its weight gradient, LoRA adapters save little more).
* not counted: the optimizer step's temporaries (foreach AdamW's, up to a few times the sharded parameters: the
  peak of small models with few activations) and the allocator's fragmentation.

LoRA example: the same 13B base frozen, 0.1% trainable (Ψ_t ≈ 13.1e6): ``(4 × 13.1e9 + 12 × 13.1e6) / 8`` B ≈
6.1 GiB of model states per rank instead of 24.4.

Worked example: GPT-3 13B (Ψ ≈ 13.1e9) on 8 ranks, FULL_SHARD, bf16-mixed, AdamW: model states
``(4 + 4 + 8) × 13.1e9 / 8 ≈ 26.2e9`` B ≈ 24.4 GiB per rank, plus ``(3 × 2 + 4) B × U`` (U ≈ 317e6 for a
5140-wide block) ≈ 3.0 GiB of gathered units and communication buffers. Published figures this sits between: the
ZeRO paper's ``16Ψ/N`` for mixed-precision Adam (Rajbhandari et al. 2019, ≈ 24.2 GiB for Ψ = 13e9, N = 8);
DeepSpeed's ZeRO-3 estimator (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, no offload:
``18Ψ/N + 4U`` B ≈ 28.4 GiB with U = 325e6); and fairseq's FSDP notes, which train the 13B GPT-3 configuration on
32 GB V100s only with ``--cpu-offload --checkpoint-activations`` — model states plus activations of a few GiB exceed
32 GB without them.

Example:
    >>> estimate = estimate_memory(13_100_000_000, world_size=8, precision="bf16-mixed", largest_unit_params=0)
    >>> round(estimate.device.total_bytes / 2**30, 1)
    24.4
    >>> lora = estimate_memory(13_100_000_000, trainable_params=13_100_000, world_size=8, precision="bf16-mixed",
    ...                        largest_unit_params=0)
    >>> round(lora.device.total_bytes / 2**30, 1)
    6.1
"""

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, get_args

from torch import nn

from lightning_shard.memory.breakdown import MemoryBreakdown, MemoryEstimate
from lightning_shard.memory.simulate import simulate_memory
from lightning_shard.memory.transformer_sizes import activation_bytes, gpt_parameter_count
from lightning_shard.memory.units import checkpointing_mode, count_parameters, mesh_shape, replicated_parameter_counts
from lightning_shard.plan.config import GradientAccumulation
from lightning_shard.plan.precision import PRECISION_ALIASES
from lightning_shard.tensor_parallel import TensorParallelPlan, split_parameters

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")

# Bytes per parameter: sharded parameter, gradient, one optimizer state, gathered (compute) copy.
_PRECISION_BYTES = {
    "32-true": (4, 4, 4, 4),
    "bf16-mixed": (4, 4, 4, 2),
    "16-mixed": (4, 4, 4, 2),
    "bf16-true": (2, 2, 2, 2),
    "16-true": (2, 2, 2, 2),
}

OPTIMIZER_STATES_PER_PARAM = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_nomomentum": 0}

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
# Where an averaged copy lives: beside the sharded parameters, or in host memory.
WeightAveragingPlace = Literal["device", "cpu"]


def _normalise_precision(precision: str | int) -> str:
    name = PRECISION_ALIASES.get(str(precision), str(precision))
    if name not in _PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(_PRECISION_BYTES)}, got {precision!r}")
    return name


def _shard_degree(sharding_strategy: str, world_size: int, num_nodes: int, tensor_parallel_size: int) -> int:
    if sharding_strategy == "HYBRID_SHARD" and world_size % num_nodes:
        raise ValueError(f"HYBRID_SHARD needs world_size ({world_size}) divisible by num_nodes ({num_nodes})")
    # The ranks a parameter is sharded over: the last dimension of the strategy's own data-parallel mesh.
    return mesh_shape(sharding_strategy, world_size, num_nodes, tensor_parallel_size)[-1]


def estimate_memory(
    model: nn.Module | int | Callable[[], nn.Module],
    *,
    mode: Literal["formula", "simulate"] = "formula",
    world_size: int = 1,
    num_nodes: int = 1,
    sharding_strategy: ShardingStrategy = "FULL_SHARD",
    precision: str | int = "32-true",
    cpu_offload: bool = False,
    activation_checkpointing: bool | str = False,
    optimizer: str = "adamw",
    accumulate_grad_batches: int = 1,
    gradient_accumulation: GradientAccumulation = "sharded",
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    n_layer: int | None = None,
    n_embd: int | None = None,
    n_head: int | None = None,
    vocab_size: int | None = None,
    fused_attention: bool = True,
    largest_unit_params: int | None = None,
    trainable_params: int | None = None,
    input_fn: Callable[[], Any] | None = None,
    weight_averaging: WeightAveragingPlace | None = None,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: TensorParallelPlan = "auto",
) -> MemoryEstimate:
    """Estimate the memory of one rank; see the module docstring for the formula and the published figures.

    ``model`` is a module (meta device is fine), a parameter count, or — for ``mode="simulate"`` — a picklable
    function building the module, which is built on the meta device and trained under fake tensors (see
    :mod:`lightning_shard.memory.simulate`, which also needs ``input_fn``). The largest wrap unit comes from the
    module's ``ModuleList``/``Sequential`` children, or from ``n_layer``/``n_embd``/``vocab_size``/``seq_len`` (GPT
    formula), or from ``largest_unit_params``; failing all three the whole model counts as one unit (an upper bound).
    Trainable and frozen parameters come from the module's ``requires_grad`` flags; for a parameter count,
    ``trainable_params`` says how many train (default: all), and each unit is assumed to train the same fraction.
    ``accumulate_grad_batches`` and ``gradient_accumulation`` are the Trainer's and the strategy's settings;
    ``fused_attention=False`` counts the attention scores that eager (unfused) attention keeps for backward.
    ``weight_averaging``: ``"device"`` or ``"cpu"`` counts an averaged copy kept there (module docstring).
    ``tensor_parallel_size`` / ``tensor_parallel_plan``: the strategy's; the plan (resolved on the module as the
    strategy resolves it) says which parameters split.

    Example:
        >>> est = estimate_memory(1_000_000, world_size=2, largest_unit_params=0)
        >>> est.per_rank.params, est.per_rank.grads, est.per_rank.optimizer_states
        (2000000, 2000000, 4000000)
        >>> est = estimate_memory(1_000_000, world_size=2, largest_unit_params=0, accumulate_grad_batches=4,
        ...                       gradient_accumulation="unsharded")
        >>> est.per_rank.grads, est.per_rank.accumulated_grads
        (0, 4000000)
        >>> est = estimate_memory(1_000_000, trainable_params=10_000, world_size=2, largest_unit_params=0)
        >>> est.per_rank.params, est.per_rank.grads, est.per_rank.optimizer_states
        (2000000, 20000, 40000)
        >>> estimate_memory(1_000_000, world_size=2, largest_unit_params=0, weight_averaging="cpu").cpu.averaged_weights
        2000000
    """
    if sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding_strategy must be one of {SHARDING_STRATEGIES}, got {sharding_strategy!r}")
    if optimizer not in OPTIMIZER_STATES_PER_PARAM:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES_PER_PARAM)}, got {optimizer!r}")
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
        raise TypeError(f"accumulate_grad_batches must be an int, got {accumulate_grad_batches!r}")
    if accumulate_grad_batches < 1:
        raise ValueError(f"accumulate_grad_batches must be at least 1, got {accumulate_grad_batches}")
    if gradient_accumulation not in get_args(GradientAccumulation):
        raise ValueError(
            f"gradient_accumulation must be one of {get_args(GradientAccumulation)}, got {gradient_accumulation!r}"
        )
    if weight_averaging not in (None, *get_args(WeightAveragingPlace)):
        raise ValueError(f"weight_averaging must be None, 'device' or 'cpu', got {weight_averaging!r}")
    precision = _normalise_precision(precision)
    checkpointing_mode(activation_checkpointing)
    config = {
        "mode": mode,
        "world_size": world_size,
        "num_nodes": num_nodes,
        "sharding_strategy": sharding_strategy,
        "precision": precision,
        "cpu_offload": cpu_offload,
        "activation_checkpointing": activation_checkpointing,
        "fused_attention": fused_attention,
        "optimizer": optimizer,
        "accumulate_grad_batches": accumulate_grad_batches,
        "gradient_accumulation": gradient_accumulation,
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "weight_averaging": weight_averaging,
        "tensor_parallel_size": tensor_parallel_size,
        "tensor_parallel_plan": tensor_parallel_plan,
    }
    if trainable_params is not None and not isinstance(model, int):
        raise ValueError(
            "trainable_params is for a parameter count; a module says which parameters train by their requires_grad"
        )
    if mode == "simulate":
        if tensor_parallel_size > 1:
            # fully_shard of a tensor-parallel parameter builds its 2-D mesh with tensor ops (DeviceMesh._concatenate),
            # which FakeTensorMode cannot run (a data-dependent `nonzero`; torch 2.13).
            raise ValueError('mode="simulate" does not simulate tensor parallelism; use the formula (mode="formula")')
        if input_fn is None or not callable(model) or isinstance(model, nn.Module):
            raise ValueError('mode="simulate" needs `model` as a function building the module, and `input_fn`')
        simulated = simulate_memory(model, input_fn, config)
        shards = _shard_degree(sharding_strategy, world_size, num_nodes, tensor_parallel_size)
        device, cpu = _with_averaged_copy(simulated.device, simulated.cpu, simulated.n_params, shards, weight_averaging)
        return replace(simulated, device=device, cpu=cpu)
    if mode != "formula":
        raise ValueError(f'mode must be "formula" or "simulate", got {mode!r}')

    if isinstance(model, nn.Module):
        split = _split_parameters(model, tensor_parallel_plan, tensor_parallel_size)
        n_params, largest, trainable, largest_trainable = count_parameters(model, split, tensor_parallel_size)
        whole = count_parameters(model) if split else None  # what the model holds, for the report
    elif tensor_parallel_size > 1:
        raise ValueError("a tensor-parallel estimate needs the model (a module): its plan says which parameters split")
    elif isinstance(model, int):
        n_params, largest, trainable = model, model, _trainable_count(model, trainable_params)
        whole = None
        if None not in (n_layer, n_embd, vocab_size, seq_len):
            largest = gpt_parameter_count(n_layer, n_embd, vocab_size, seq_len)[1]
        largest_trainable = _trainable_share(largest, trainable, n_params)
    else:
        raise TypeError(f"model must be an nn.Module or a parameter count in formula mode, got {type(model).__name__}")
    if largest_unit_params is not None:
        largest, largest_trainable = largest_unit_params, _trainable_share(largest_unit_params, trainable, n_params)

    param_b, grad_b, state_b, compute_b = _PRECISION_BYTES[precision]
    shards = _shard_degree(sharding_strategy, world_size, num_nodes, tensor_parallel_size)
    states = OPTIMIZER_STATES_PER_PARAM[optimizer]
    replicated, replicated_trainable = replicated_parameter_counts(model) if isinstance(model, nn.Module) else (0, 0)
    sharded = MemoryBreakdown(
        params=math.ceil((n_params - replicated) * param_b / shards),
        grads=math.ceil((trainable - replicated_trainable) * grad_b / shards),
        optimizer_states=math.ceil((trainable - replicated_trainable) * states * state_b / shards),
    )
    # Units kept gathered (module docstring), plus one unit's reduce-scatter input in the reduce dtype.
    kept = n_params if sharding_strategy in ("SHARD_GRAD_OP", "NO_SHARD") else 3 * largest
    gathered = kept * compute_b + largest_trainable * grad_b
    activations = 0
    if None not in (n_layer, n_embd, n_head, seq_len):
        activations = activation_bytes(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            vocab_size=vocab_size,
            compute_bytes=compute_b,
            activation_checkpointing=activation_checkpointing,
            fused_attention=fused_attention,
            tensor_parallel_size=tensor_parallel_size,
        )
    accumulated = trainable * grad_b if gradient_accumulation == "unsharded" and accumulate_grad_batches > 1 else 0
    on_device = MemoryBreakdown(
        # the replicated parameters' gradients are among the whole ones while those are held
        params=replicated * param_b,
        grads=0 if accumulated else replicated_trainable * grad_b,
        accumulated_grads=accumulated,
        optimizer_states=replicated_trainable * states * state_b,
        gathered_peak=gathered,
        activations=activations,
    )
    if cpu_offload:
        device, cpu = on_device, sharded
    else:
        # The whole gradients stand in for the sharded ones while they are held (module docstring).
        device, cpu = replace(sharded, grads=0 if accumulated else sharded.grads) + on_device, MemoryBreakdown()
    # Beside the shards is on the host when they are offloaded.
    place = "cpu" if weight_averaging and cpu_offload else weight_averaging
    device, cpu = _with_averaged_copy(device, cpu, n_params, shards, place)
    reported = (whole.total, whole.trainable) if whole is not None else (n_params, trainable)
    return MemoryEstimate(n_params=reported[0], trainable_params=reported[1], device=device, cpu=cpu, config=config)


def _split_parameters(model: nn.Module, plan: TensorParallelPlan, size: int) -> set[int]:
    if size == 1:
        return set()
    split = split_parameters(model, plan, size)
    if split is None:
        raise ValueError(
            "a `parallelize_fn` plan splits whatever it does, which only applying it tells; estimate with the plan as "
            "a dict of module-name patterns to styles (or 'auto'), or use mode='simulate'"
        )
    return split


def _with_averaged_copy(
    device: MemoryBreakdown, cpu: MemoryBreakdown, n_params: int, shards: int, weight_averaging: str | None
) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """``device`` and ``cpu`` with the averaged copy (fp32, sharded like the parameters) where it is kept."""
    if weight_averaging is None:
        return device, cpu
    copy = MemoryBreakdown(averaged_weights=math.ceil(n_params * 4 / shards))
    return (device + copy, cpu) if weight_averaging == "device" else (device, cpu + copy)


def _trainable_share(unit: int, trainable: int, n_params: int) -> int:
    """The trainable parameters of a unit of ``unit`` parameters, when units train the model's fraction."""
    return math.ceil(unit * trainable / n_params) if n_params else 0


def _trainable_count(n_params: int, trainable_params: int | None) -> int:
    if trainable_params is None:
        return n_params
    if isinstance(trainable_params, bool) or not isinstance(trainable_params, int):
        raise TypeError(f"trainable_params must be an int, got {trainable_params!r}")
    if not 0 <= trainable_params <= n_params:
        raise ValueError(
            f"trainable_params must be between 0 and the {n_params:,} parameters, got {trainable_params:,}"
        )
    return trainable_params
