"""Build the 13B GPT (``configs/gpt3_13b.yaml`` model args) on the meta device and wrap it with ``fully_shard`` per
Block + root for a world of 8, in one process, on a fake process group: no memory is allocated for weights.

    python benchmarks/meta_build.py                      # -> benchmarks/results/startup.json
    python benchmarks/meta_build.py --repeats 3 --world-size 8

Reports the seconds to build (``GPT(...).configure_model()`` under ``torch.device("meta")``), to apply activation
checkpointing wrappers (as ``ShardedStrategy`` does with ``activation_checkpointing=["Block"]``), to ``fully_shard``
every Block and the root, and the per-rank bytes the sharded parameters would take (meta tensors count their size).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from benchmarks.common import REPO, median
from benchmarks.results_files import result_path, write_result  # noqa: E402
from examples.gpt.model import GPT, Block
from lightning_shard.memory.accounting import parameter_bytes
from lightning_shard.plan.parallelize import _apply_activation_checkpointing


def build_and_wrap(model_args: dict, world_size: int, checkpointing: bool) -> dict:
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(**model_args)
        model.configure_model()
    built = time.perf_counter()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    wrappers = _apply_activation_checkpointing(model, blocks) if checkpointing else {}
    checkpointed = time.perf_counter()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for block in blocks:
        fully_shard(wrappers.get(id(block), block), mesh=mesh)
    fully_shard(model, mesh=mesh)
    wrapped = time.perf_counter()
    num_params = sum(p.numel() for p in model.parameters())
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    assert all(p.is_meta for p in model.parameters()), "the model was materialised"
    return {
        "activation_checkpointing": checkpointing,
        "build_seconds": built - start,
        "checkpoint_wrap_seconds": checkpointed - built,
        "fully_shard_seconds": wrapped - checkpointed,
        "total_seconds": wrapped - start,
        "num_params": num_params,
        "fsdp_units": units,
        "param_bytes_per_rank": parameter_bytes(model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "gpt3_13b.yaml"))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(result_path("meta_build")))
    args = parser.parse_args()

    model_args = yaml.safe_load(Path(args.config).read_text())["model"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    runs = []
    for repeat in range(args.repeats):
        for checkpointing in (False, True):
            run = build_and_wrap(model_args, args.world_size, checkpointing)
            run["repeat"] = repeat
            runs.append(run)
            print(
                f"repeat {repeat} AC={checkpointing!s:5s} build {run['build_seconds']:.2f}s  "
                f"AC wrap {run['checkpoint_wrap_seconds']:.2f}s  fully_shard {run['fully_shard_seconds']:.2f}s  "
                f"total {run['total_seconds']:.2f}s  ({run['num_params']:,} params, {run['fsdp_units']} units)",
                flush=True,
            )
    summary = {}
    for checkpointing in (False, True):
        sel = [r for r in runs if r["activation_checkpointing"] == checkpointing]
        summary["ac" if checkpointing else "plain"] = {
            key: median([r[key] for r in sel])
            for key in ("build_seconds", "checkpoint_wrap_seconds", "fully_shard_seconds", "total_seconds")
        }
    config = Path(args.config).resolve()
    config_name = str(config.relative_to(REPO)) if config.is_relative_to(REPO) else args.config
    report = {
        "title": "Building the 13B model on the meta device",
        "question": f"How long does {config_name}'s model take to build on meta and wrap for {args.world_size} ranks?",
        "columns": ["activation checkpointing", "build (s)", "AC wrap (s)", "fully_shard (s)", "total (s)"],
        "rows": [
            [name == "ac"]
            + [
                f"{summary[name][key]:.2f}"
                for key in ("build_seconds", "checkpoint_wrap_seconds", "fully_shard_seconds", "total_seconds")
            ]
            for name in ("plain", "ac")
        ],
        "notes": [
            f"{runs[0]['num_params']:,} parameters, {runs[0]['fsdp_units']} FSDP units, "
            f"{runs[0]['param_bytes_per_rank'] / 2**30:.2f} GiB of sharded parameters per rank; median of "
            f"{args.repeats} repeats, one process on a fake process group of {args.world_size}, no weight allocated."
        ],
    }
    write_result(
        Path(args.output),
        "meta_build",
        {
            "config": config_name,
            "model": model_args,
            "world_size": args.world_size,
            "runs": runs,
            "median": summary,
            "report": report,
        },
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
