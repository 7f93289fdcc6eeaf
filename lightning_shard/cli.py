"""The ``lightning-shard`` command: ``convert``, ``inspect``, ``export-hf`` and ``estimate``.

lightning-shard convert out/last.ckpt out/last-full.ckpt      # sharded directory -> one file
lightning-shard convert out/last-full.ckpt out/sharded.ckpt    # one file -> sharded directory
lightning-shard inspect out/last.ckpt
lightning-shard export-hf out/last.ckpt out/hf --config out/pretrained   # -> AutoModelForCausalLM.from_pretrained
lightning-shard export-hf out/last.ckpt out/ema --config out/pretrained --weights averaged  # the EMA weights
lightning-shard export-hf out/last.ckpt out/merged --config out/pretrained --merge-lora  # a LoRA run, merged
lightning-shard export-hf out/last.ckpt out/lora --config out/pretrained --adapter-only  # -> PeftModel.from_pretrained
lightning-shard estimate --config configs/gpt3_13b.yaml --devices 8 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_shard.checkpoint.convert import convert, inspect
from lightning_shard.checkpoint.integrity import CheckpointIntegrityError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-shard`` console script."""
    parser = argparse.ArgumentParser(prog="lightning-shard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert_parser = commands.add_parser("convert", help="sharded directory <-> full file")
    convert_parser.add_argument("src", type=Path)
    convert_parser.add_argument("dst", type=Path)
    inspect_parser = commands.add_parser("inspect", help="describe a checkpoint")
    inspect_parser.add_argument("path", type=Path)
    inspect_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    export_parser = commands.add_parser("export-hf", help="a checkpoint's HF model -> a from_pretrained directory")
    export_parser.add_argument("checkpoint", type=Path, help="sharded directory or full file")
    export_parser.add_argument("out_dir", type=Path, help="new directory (must not exist or be empty)")
    export_parser.add_argument("--config", type=Path, required=True, help="directory with the model's config.json")
    export_parser.add_argument("--prefix", help="the HF model's key prefix in the checkpoint (default: found)")
    export_parser.add_argument("--max-shard-size", help="largest safetensors file (default 5GB)")
    export_parser.add_argument(
        "--dtype",
        help="dtype of the weights written: 'config' (default: what config.json names, as save_pretrained writes), "
        "'checkpoint' (e.g. fp32 master weights), or a dtype such as bfloat16; config.json names the one written",
    )
    export_parser.add_argument(
        "--weights",
        choices=("trained", "averaged"),
        default="trained",
        help="the trained weights (default) or their averaged copy (EMA/SWA: a weight-averaging callback's, or a "
        "ShardedAveragedModel saved with fabric.save)",
    )
    lora = export_parser.add_mutually_exclusive_group()
    lora.add_argument("--merge-lora", action="store_true", help="a peft LoRA run: the model with the adapters merged")
    lora.add_argument(
        "--adapter-only",
        action="store_true",
        help="a peft LoRA run: adapter_config.json + adapter_model.safetensors for PeftModel.from_pretrained",
    )
    export_parser.add_argument(
        "--lora-config",
        type=Path,
        help="the run's LoRA configuration: adapter_config.json (or its directory) or a JSON object of LoraConfig "
        "fields (default: from the checkpoint's hyper-parameters)",
    )
    commands.add_parser("estimate", help="per-rank memory estimate", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "estimate":
        from lightning_shard.memory import estimate_main

        return estimate_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "convert":
            print(f"{convert(args.src, args.dst)}: {args.src} -> {args.dst}")
        elif args.command == "export-hf":
            _export_hf(args)
        else:
            info = inspect(args.path)
            print(json.dumps(info, indent=2) if args.json else "\n".join(f"{k:>16}: {v}" for k, v in info.items()))
    except (
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        ValueError,
        ImportError,
        CheckpointIntegrityError,
    ) as error:
        print(f"lightning-shard {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _export_hf(args: argparse.Namespace) -> None:
    from lightning_shard.hf import export_adapter, export_hf
    from lightning_shard.hf.export import DEFAULT_MAX_SHARD_SIZE

    if args.adapter_only:
        given = [flag for flag, value in (("--dtype", args.dtype), ("--max-shard-size", args.max_shard_size)) if value]
        if args.weights == "averaged":
            raise ValueError("`--adapter-only` writes the trained adapter; `--weights averaged` exports a whole model.")
        if given:
            raise ValueError(f"{' and '.join(given)}: the adapter is written in one file, in the checkpoint's dtype.")
        done = export_adapter(
            args.checkpoint, args.out_dir, args.config, prefix=args.prefix, lora_config=args.lora_config
        )
    else:
        done = export_hf(
            args.checkpoint,
            args.out_dir,
            args.config,
            prefix=args.prefix,
            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
            dtype=args.dtype or "config",
            merge_lora=args.merge_lora,
            lora_config=args.lora_config,
            weights=args.weights,
        )
    print(
        f"exported {done.num_tensors} tensors ({done.total_bytes / 2**20:.1f} MiB) under prefix {done.prefix!r} "
        f"of {args.checkpoint} to {done.out_dir} in {len(done.files)} safetensors file(s)"
    )


if __name__ == "__main__":
    sys.exit(main())
