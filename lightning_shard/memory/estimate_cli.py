"""``lightning-shard estimate``: per-rank memory of a LightningCLI config, before launching it.

Example:
    $ lightning-shard estimate --config configs/gpt3_13b.yaml --devices 8 --json
"""

import argparse
import importlib
import json
import os
import sys
from typing import Any

import torch
import yaml

from lightning_shard.memory.estimate import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    format_estimate_table,
    gpt_parameter_count,
)

_GPT_DIMS = ("n_layer", "n_embd", "vocab_size", "block_size")


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
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON instead of tables")
    return parser


def _model_section(config: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    model = config.get("model") or {}
    if "class_path" in model:
        return model["class_path"], dict(model.get("init_args") or {})
    return None, dict(model)


def _strategy_options(trainer: dict[str, Any]) -> dict[str, Any]:
    strategy = trainer.get("strategy")
    init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    return {
        "sharding_strategy": init_args.get("sharding_strategy", "FULL_SHARD"),
        "cpu_offload": bool(init_args.get("cpu_offload", False)),
        # The strategy takes a wrap policy here (e.g. ["Block"]); any policy means checkpointed blocks.
        "activation_checkpointing": bool(init_args.get("activation_checkpointing")),
    }


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


def _build_on_meta(model_class: type, init_args: dict[str, Any]) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_class(**init_args)
        if hasattr(model, "configure_model"):
            model.configure_model()
    return model


def estimate_from_config(args: argparse.Namespace) -> tuple[MemoryEstimate, dict[str, Any]]:
    """The estimate for the parsed command line, and the ``estimate_memory`` options behind it (for the table)."""
    with open(args.config) as file:
        config = yaml.safe_load(file) or {}
    trainer = config.get("trainer") or {}
    data = config.get("data") or {}
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
        "micro_batch_size": args.micro_batch_size or (data.get("init_args") or data).get("batch_size") or 1,
        "seq_len": args.seq_len or dims.get("block_size"),
        **{key: dims.get(key) for key in ("n_layer", "n_embd", "n_head", "vocab_size")},
    }
    model_class = _import_class(class_path) if class_path else None
    if model_class is not None:
        model: torch.nn.Module | int = _build_on_meta(model_class, dims)
    else:
        missing = [key for key in _GPT_DIMS if dims.get(key) is None]
        if missing:
            raise ValueError(f"no importable model class and the model section lacks {missing} for the GPT formula")
        model = gpt_parameter_count(*(dims[key] for key in _GPT_DIMS))[0]
    return estimate_memory(model, **options, **_strategy_options(trainer)), {"model": model, **options}


def estimate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-shard estimate``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        estimate, options = estimate_from_config(args)
    except (OSError, ValueError) as error:
        print(f"lightning-shard estimate: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"n_params": estimate.n_params, "per_rank": estimate.per_rank.to_dict()}, indent=2))
        return 0
    config = estimate.config
    print(
        f"{estimate.n_params:,} parameters on {config['world_size']} ranks ({config['num_nodes']} node(s)), "
        f"{config['precision']}, {config['optimizer']}, micro-batch {config['micro_batch_size']} x "
        f"{config['seq_len']} tokens\n"
    )
    print(
        f"Configured ({config['sharding_strategy']}, cpu_offload={config['cpu_offload']}, "
        f"activation_checkpointing={config['activation_checkpointing']}), per rank:"
    )
    for place, breakdown in (("device", estimate.device), ("cpu", estimate.cpu)):
        parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in breakdown.to_dict().items())
        print(f"  {place:>6} GiB: {parts}")
    print("\nAll options:")
    print(format_estimate_table(options.pop("model"), **options))
    return 0
