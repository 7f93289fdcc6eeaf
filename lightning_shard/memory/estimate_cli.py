"""``lightning-shard estimate``: per-rank memory of a LightningCLI config, before launching it.

The config's ``trainer.accumulate_grad_batches``, the strategy's ``gradient_accumulation`` and a weight-averaging
callback in ``trainer.callbacks`` (its fp32 averaged copy, on the device or with ``device: cpu`` in host memory) count
too. With
``--mode simulate`` the model is also trained for two steps under fake tensors (:mod:`lightning_shard.memory.simulate`;
token-id inputs of ``micro-batch x seq-len``: ``vocab_size`` from the model section, else from the config of the
transformers model it builds; the length from ``--seq-len``, the model's ``block_size`` or the data's), and the
simulated figures are printed next to the formula's.

Frozen parameters cost their stored copy only (no gradient, no optimizer state). A model whose class freezes them
(a LoRA module built by the config) is counted as built. For a config that does not say it, ``--lora-rank R
--lora-targets q_proj,v_proj`` puts peft LoRA adapters of rank ``R`` on the modules those names match (peft's own
``target_modules`` matching, on the model built on the meta device; needs peft) and freezes the rest, as
``get_peft_model`` does; ``--trainable-parameters N`` just says how many parameters train (formula only).

Example:
    $ lightning-shard estimate --config configs/gpt3_13b.yaml --devices 8 --json
    $ lightning-shard estimate --config configs/gpt3_13b.yaml --devices 8 --mode simulate \
        --model-class examples.gpt.model.GPT
    $ lightning-shard estimate --config configs/hf_llama_tiny.yaml --lora-rank 8 --lora-targets q_proj,v_proj
    $ lightning-shard estimate --config configs/hf_llama_tiny_lora.yaml --model-class examples.hf.model.HFCausalLM \
        --mode simulate
"""

import argparse
import importlib
import json
import os
import sys
from functools import partial
from typing import Any, get_args

import torch
import yaml

from lightning_shard.memory.breakdown import MemoryEstimate
from lightning_shard.memory.estimate import estimate_memory
from lightning_shard.memory.estimate_table import GIB, format_estimate_table
from lightning_shard.memory.transformer_sizes import gpt_parameter_count
from lightning_shard.memory.units import count_parameters
from lightning_shard.plan.config import GradientAccumulation

_GPT_DIMS = ("n_layer", "n_embd", "vocab_size", "block_size")
# What `estimate_from_config` returns besides the `estimate_memory` keyword arguments.
_NOT_OPTIONS = ("model", "model_class", "init_args", "lora")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-shard estimate",
        description="Estimate per-rank memory (model states, gathered units, activations) of a LightningCLI config.",
    )
    parser.add_argument("--config", required=True, help="LightningCLI YAML with `model:` and `trainer:` sections")
    parser.add_argument("--devices", type=int, help="devices per node (default: trainer.devices)")
    parser.add_argument("--nodes", type=int, help="number of nodes (default: trainer.num_nodes or 1)")
    parser.add_argument(
        "--model-class", help="import path of the model class (default: model.class_path; else the GPT formula)"
    )
    parser.add_argument("--micro-batch-size", type=int, help="sequences per rank (default: data batch_size or 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: model block_size)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "sgd_nomomentum"))
    parser.add_argument(
        "--tensor-parallel-size", type=int, help="ranks splitting each layer (default: the strategy's setting, else 1)"
    )
    parser.add_argument(
        "--gradient-accumulation",
        choices=get_args(GradientAccumulation),
        help="where gradients accumulate over micro-batches (default: the strategy's setting, else 'sharded')",
    )
    parser.add_argument(
        "--mode",
        choices=("formula", "simulate"),
        default="formula",
        help="simulate: also train two steps under fake tensors (no real storage; 13B: 1.5 minutes)",
    )
    lora = parser.add_argument_group("fine-tuning some parameters only (the rest frozen: no gradient, no optimizer)")
    lora.add_argument("--lora-rank", type=int, help="rank of peft LoRA adapters put on --lora-targets")
    lora.add_argument(
        "--lora-targets", type=_names, help="comma-separated module names for the adapters, as peft's target_modules"
    )
    lora.add_argument(
        "--trainable-parameters", type=int, help="how many parameters train (formula mode; instead of --lora-*)"
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON instead of tables")
    return parser


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def _lora_settings(args: argparse.Namespace) -> tuple[int, list[str]] | None:
    """``(rank, targets)`` of the adapters to add, or ``None``; a half-given or conflicting request is an error."""
    if args.lora_rank is None and args.lora_targets is None:
        return None
    if args.lora_rank is None or not args.lora_targets:
        raise ValueError("--lora-rank and --lora-targets go together, e.g. --lora-rank 8 --lora-targets q_proj,v_proj")
    if args.trainable_parameters is not None:
        raise ValueError("pass either --trainable-parameters or --lora-rank/--lora-targets, not both")
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, got {args.lora_rank}")
    return args.lora_rank, args.lora_targets


def _model_section(config: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    model = config.get("model") or {}
    if "class_path" in model:
        return model["class_path"], dict(model.get("init_args") or {})
    return None, dict(model)


def _strategy_options(trainer: dict[str, Any]) -> dict[str, Any]:
    strategy = trainer.get("strategy")
    init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    return {
        "tensor_parallel_size": init_args.get("tensor_parallel_size", 1),
        "tensor_parallel_plan": init_args.get("tensor_parallel_plan", "auto"),
        "gradient_accumulation": init_args.get("gradient_accumulation", "sharded"),
        "sharding_strategy": init_args.get("sharding_strategy", "FULL_SHARD"),
        "cpu_offload": bool(init_args.get("cpu_offload", False)),
        # The strategy takes a wrap policy here (e.g. ["Block"]): any policy means checkpointed blocks, recomputed whole
        # unless "selective" (per op).
        "activation_checkpointing": checkpointed
        if (checkpointed := init_args.get("activation_checkpointing")) == "selective"
        else bool(checkpointed),
    }


def _weight_averaging(trainer: dict[str, Any]) -> str | None:
    """Where the config's weight-averaging callback (Lightning's ``WeightAveraging`` or a subclass) keeps its copy."""
    from lightning.pytorch.callbacks import WeightAveraging

    for callback in trainer.get("callbacks") or []:
        if not isinstance(callback, dict) or "class_path" not in callback:
            continue
        module_name, _, class_name = str(callback["class_path"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name or "lightning.pytorch.callbacks"), class_name)
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, WeightAveraging):
            device = (callback.get("init_args") or {}).get("device")
            return "cpu" if device is not None and torch.device(device).type == "cpu" else "device"
    return None


def _import_class(class_path: str) -> type | None:
    module_name, _, class_name = class_path.rpartition(".")
    # Config class paths such as examples.gpt.model.GPT are relative to the project root, like `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        print(f"could not import {class_path} ({error}); counting parameters with the GPT formula", file=sys.stderr)
        return None


def _build(model_class: type, init_args: dict[str, Any], lora: tuple[int, list[str]] | None = None) -> torch.nn.Module:
    """The model with its layers, as a Trainer would build it (``configure_model``), on the current device; with
    ``lora = (rank, targets)`` peft's LoRA adapters are put on it and the rest frozen, as ``get_peft_model`` does."""
    model = model_class(**init_args)
    if hasattr(model, "configure_model"):
        model.configure_model()
    if lora is not None:
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError as error:
            raise ValueError(f"--lora-rank/--lora-targets need peft: pip install peft ({error})") from error
        rank, targets = lora
        model = inject_adapter_in_model(LoraConfig(r=rank, target_modules=targets), model)
    return model


def _build_on_meta(model_class: type, init_args: dict[str, Any], lora: tuple[int, list[str]] | None) -> torch.nn.Module:
    with torch.device("meta"):
        return _build(model_class, init_args, lora)


def _configured_vocab_size(model: torch.nn.Module) -> int | None:
    """The vocabulary of a model that does not take it as an argument: the config of a transformers model in it (also
    inside a LightningModule or peft's wrapper)."""
    for module in model.modules():
        size = getattr(getattr(module, "config", None), "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def estimate_from_config(args: argparse.Namespace) -> tuple[MemoryEstimate, dict[str, Any]]:
    """The formula estimate for the parsed command line, and the ``estimate_memory`` options behind it (for the table
    and the simulation: ``model``, ``model_class``, ``init_args``, then the keyword arguments)."""
    with open(args.config) as file:
        config = yaml.safe_load(file) or {}
    trainer = config.get("trainer") or {}
    data = (config.get("data") or {}).get("init_args") or config.get("data") or {}
    class_path, dims = _model_section(config)
    class_path = args.model_class or class_path
    devices = args.devices or trainer.get("devices")
    if not isinstance(devices, int):
        raise ValueError(f"trainer.devices is {devices!r}; pass --devices N")
    nodes = args.nodes or trainer.get("num_nodes") or 1
    options: dict[str, Any] = {
        "world_size": devices * nodes,
        "num_nodes": nodes,
        "precision": trainer.get("precision", "32-true"),
        "optimizer": args.optimizer,
        "accumulate_grad_batches": trainer.get("accumulate_grad_batches") or 1,
        "micro_batch_size": args.micro_batch_size or data.get("batch_size") or 1,
        "seq_len": args.seq_len or dims.get("block_size") or data.get("block_size"),
        "weight_averaging": _weight_averaging(trainer),
        **{key: dims.get(key) for key in ("n_layer", "n_embd", "n_head", "vocab_size")},
    }
    lora = _lora_settings(args)
    model_class = _import_class(class_path) if class_path else None
    if model_class is not None:
        model: torch.nn.Module | int = _build_on_meta(model_class, dims, lora)
        options["vocab_size"] = options["vocab_size"] or _configured_vocab_size(model)
    else:
        if lora is not None:
            raise ValueError("--lora-rank/--lora-targets need the model's modules: an importable model.class_path")
        missing = [key for key in _GPT_DIMS if dims.get(key) is None]
        if missing:
            raise ValueError(f"no importable model class and the model section lacks {missing} for the GPT formula")
        model = gpt_parameter_count(*(dims[key] for key in _GPT_DIMS))[0]
    if args.trainable_parameters is not None:
        if isinstance(model, torch.nn.Module):
            # A count, not a choice of parameters: the module's own counts, with this many of them trained.
            counts = count_parameters(model)
            model, options["largest_unit_params"] = counts.total, counts.largest_unit
        options["trainable_params"] = args.trainable_parameters
    strategy = _strategy_options(trainer)
    if args.gradient_accumulation:
        strategy["gradient_accumulation"] = args.gradient_accumulation
    if args.tensor_parallel_size:
        strategy["tensor_parallel_size"] = args.tensor_parallel_size
    # The table varies sharding, offload and checkpointing; the rest holds for every row.
    for key in ("gradient_accumulation", "tensor_parallel_size", "tensor_parallel_plan"):
        options[key] = strategy.pop(key)
    estimate = estimate_memory(model, **options, **strategy)
    return estimate, {"model": model, "model_class": model_class, "init_args": dims, "lora": lora, **options}


def simulate_from_config(estimate: MemoryEstimate, options: dict[str, Any]) -> MemoryEstimate:
    """Simulate the configuration ``estimate`` was computed for (see :mod:`lightning_shard.memory.simulate`)."""
    config, init_args = estimate.config, options["init_args"]
    if options["model_class"] is None:
        raise ValueError("simulate mode builds the model: the config needs an importable model.class_path")
    if "trainable_params" in options:
        raise ValueError(
            "simulate mode trains the parameters the model marks trainable: say which with --lora-rank/--lora-targets "
            "(--trainable-parameters is a count, for the formula)"
        )
    if options["vocab_size"] is None or config["seq_len"] is None:
        raise ValueError(
            "simulate mode feeds token ids of micro-batch x seq-len: the model section needs vocab_size (or the "
            "model a transformers config that names it), and block_size (or data.block_size, or pass --seq-len)"
        )
    return estimate_memory(
        partial(_build, options["model_class"], init_args, options["lora"]),
        mode="simulate",
        input_fn=partial(torch.randint, 0, options["vocab_size"], (config["micro_batch_size"], config["seq_len"])),
        **{key: value for key, value in config.items() if key != "mode"},
    )


def estimate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-shard estimate``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        estimate, options = estimate_from_config(args)
        simulated = simulate_from_config(estimate, options) if args.mode == "simulate" else None
    except (OSError, ValueError) as error:
        print(f"lightning-shard estimate: {error}", file=sys.stderr)
        return 2
    if args.json:
        counts = ("n_params", "trainable_params")
        payload = {key: estimate.to_dict()[key] for key in (*counts, "per_rank", "device", "cpu")}
        if simulated is not None:
            payload = {**{key: payload[key] for key in counts}, "formula": payload, "simulated": simulated.to_dict()}
        print(json.dumps(payload, indent=2))
        return 0
    config = estimate.config
    frozen = estimate.n_params - estimate.trainable_params
    split = f", tensor parallel over {config['tensor_parallel_size']}" if config["tensor_parallel_size"] > 1 else ""
    print(
        f"{estimate.n_params:,} parameters{f' ({frozen:,} frozen)' if frozen else ''} on {config['world_size']} "
        f"ranks ({config['num_nodes']} node(s){split}), "
        f"{config['precision']}, {config['optimizer']}, micro-batch {config['micro_batch_size']} x "
        f"{config['seq_len']} tokens, {config['accumulate_grad_batches']} accumulated "
        f"({config['gradient_accumulation']})\n"
    )
    print(
        f"Configured ({config['sharding_strategy']}, cpu_offload={config['cpu_offload']}, "
        f"activation_checkpointing={config['activation_checkpointing']}), per rank:"
    )
    for place, breakdown in (("device", estimate.device), ("cpu", estimate.cpu)):
        print(f"  {place:>9} GiB: {_gib(breakdown.to_dict())}")
    if simulated is not None:
        assert simulated.simulation is not None
        print(f"  simulated GiB: {_gib(simulated.device.to_dict())}")
        print(
            f"  (simulation: {simulated.simulation['wall_seconds']:.0f} s, peak RSS "
            f"{simulated.simulation['peak_rss_bytes'] / GIB:.2f} GiB; device only, FSDPMemTracker's peak)"
        )
    print("\nAll options:")
    print(format_estimate_table(options["model"], **{k: v for k, v in options.items() if k not in _NOT_OPTIONS}))
    return 0


def _gib(values: dict[str, int]) -> str:
    return ", ".join(f"{name} {value / GIB:.2f}" for name, value in values.items())
