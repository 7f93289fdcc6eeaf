"""Training speed and memory of one GPT under Lightning Fabric: Fabric's DDP, Fabric's ``ModelParallelStrategy``
with ``fully_shard`` applied by hand, and ``lightning_shard.fabric.ShardedStrategy``.

The harness of ``train_speed.py`` (same model, sizes, rounds, timing and summary), with a Fabric loop in each
worker instead of a Trainer: one launch (2 CPU ranks, Fabric's launcher) per configuration and round.

    python benchmarks/fabric_speed.py                      # -> benchmarks/results/training_speed.json
    python benchmarks/fabric_speed.py --rounds 1 --steps 4 --output /tmp/quick.json

Each step - forward, ``fabric.backward``, ``optimizer.step``, ``zero_grad``, the scheduler - is timed between two
barriers; model state is counted from the local shards after the last step's optimizer step. A last, paired launch
holds the anchor and ``fs`` in the same two processes and alternates their steps, so that the load of a shared
machine falls on both alike; its ratio is reported beside the per-launch table.

Configurations:
  ddp      Fabric ``DDPStrategy`` (the baseline).
  anchor   Fabric ``ModelParallelStrategy(parallelize_fn=...)``, the function applying ``fully_shard`` to each Block
           and the root: what a Fabric user writes without this package.
  fs       ``lightning_shard.fabric.ShardedStrategy`` (FULL_SHARD, the default path).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import barrier, median, peak_rss_bytes, random_token_dataset
from benchmarks.train_speed import (
    MODEL,
    drive,
    launch,
    slowest_rank_steps,
    summarise,
    write_runs,
)

DESCRIPTIONS = {
    "ddp": "Fabric DDPStrategy",
    "anchor": "Fabric ModelParallelStrategy + fully_shard by hand",
    "fs": "lightning_shard.fabric.ShardedStrategy FULL_SHARD",
}
CONFIGS = list(DESCRIPTIONS)


def _worker(args: Any) -> None:
    import torch

    total_steps = args.warmup + args.steps
    if args.worker == "paired":
        # Both sharded models in the same two processes, their steps alternating (order swapped every step): the
        # machine's load falls on both alike, which separate launches on a shared machine cannot promise.
        runs = {config: _setup(config, args, total_steps) for config in ("anchor", "fs")}
        times: dict[str, list[float]] = {config: [] for config in runs}
        for step in range(total_steps):
            for config in ("anchor", "fs") if step % 2 == 0 else ("fs", "anchor"):
                fabric, model, optimizer, scheduler, loader = runs[config]
                times[config].append(_timed_step(fabric, model, optimizer, scheduler, next(iter(loader)))[0])
        result: dict[str, Any] = {key: {"timed_step_seconds": values[args.warmup :]} for key, values in times.items()}
        rank = fabric.global_rank
    else:
        fabric, model, optimizer, scheduler, loader = _setup(args.worker, args, total_steps)
        step_times, losses, state = [], [], {}
        for step, batch in enumerate(loader):
            seconds, loss, counted = _timed_step(fabric, model, optimizer, scheduler, batch, step == total_steps - 1)
            step_times.append(seconds)
            losses.append(loss)
            state = counted or state
        rank = fabric.global_rank
        result = {
            "config": args.worker,
            "rank": rank,
            "timed_step_seconds": step_times[args.warmup :],
            "losses": losses,
            "model_state": state,
            "num_params": sum(p.numel() for p in model.parameters()),  # DTensor numel() is global
            "peak_rss_bytes": peak_rss_bytes(),
        }
    torch.distributed.barrier()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.worker}.rank{rank}.json").write_text(json.dumps(result))


def _setup(config: str, args: Any, total_steps: int) -> tuple[Any, ...]:
    """Fabric, the set-up model, optimizer, scheduler and data loader of one configuration."""
    import lightning as L
    import torch
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from examples.gpt.model import GPT
    from lightning_shard.fabric import ShardedStrategy

    def shard_by_hand(model: GPT, device_mesh: Any) -> GPT:
        mesh = device_mesh["data_parallel"]
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    if config == "ddp":
        strategy: Any = DDPStrategy()
    elif config == "anchor":
        strategy = ModelParallelStrategy(shard_by_hand, data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = ShardedStrategy(auto_wrap_policy=["Block"])
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1234, verbose=False)
    model = GPT(**MODEL, max_steps=total_steps)
    model.configure_model()  # built eagerly, as for the Trainer benchmark's anchor and DDP
    model = fabric.setup(model)
    configured = model.configure_optimizers()
    optimizer = fabric.setup_optimizers(configured["optimizer"])
    data = random_token_dataset(args.batch_size * args.devices * total_steps, MODEL["block_size"], MODEL["vocab_size"])
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False))
    return fabric, model, optimizer, configured["lr_scheduler"]["scheduler"], loader


def _timed_step(
    fabric: Any, model: Any, optimizer: Any, scheduler: Any, batch: Any, count_state: bool = False
) -> tuple[float, float, dict[str, int]]:
    """One training step between two barriers: its seconds, its loss, and (``count_state``) the model-state bytes
    after the optimizer step, when parameters, gradients and AdamW states all exist."""
    import torch.nn.functional as F

    from lightning_shard.memory.accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes

    x, y = batch
    barrier()
    start = time.perf_counter()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    fabric.backward(loss)
    optimizer.step()
    state = {}
    if count_state:
        params = list(model.parameters())
        state = {
            "param_bytes": parameter_bytes(params),
            "grad_bytes": gradient_bytes(params),
            "optimizer_bytes": optimizer_state_bytes([optimizer]),
        }
    optimizer.zero_grad()
    scheduler.step()
    barrier()
    return time.perf_counter() - start, float(loss), state


def main(argv: list[str] | None = None) -> None:
    if (ran := drive(argv, __doc__, CONFIGS, "fabric_speed", _worker, Path(__file__))) is None:
        return
    args, runs, start = ran
    report = summarise(runs, args.devices)
    for row in report["rows"]:
        row[1] = DESCRIPTIONS[row[0]]
    if {"anchor", "fs"} <= set(args.configs):
        paired = launch("paired", args, Path(args.out), Path(__file__))
        runs.append({"round": "paired", "config": "paired", "ranks": paired})
        anchor, fs = (slowest_rank_steps([rank[config] for rank in paired]) for config in ("anchor", "fs"))
        ratio = median([a / f for a, f in zip(anchor, fs, strict=True)])
        report["notes"].append(
            f"Paired launch (anchor and fs in the same 2 processes, steps alternating, {args.steps} each): fs "
            f"{ratio:.2f}x the anchor's speed (median over steps of the slower rank's time ratio)."
        )
        report["notes"].append(
            f"Target: FULL_SHARD >= 0.97x the hand-sharded anchor, paired: **{'met' if ratio >= 0.97 else 'not met'}**"
            f" ({ratio:.2f}x)."
        )
    report["title"] = "Training speed and memory under Lightning Fabric: 2 CPU ranks"
    report["question"] = (
        "How fast does `Fabric(strategy=\"fully_sharded\")` train against Fabric's DDP and Fabric's "
        "ModelParallelStrategy with `fully_shard` applied by hand (target: >= 0.97x the hand-sharded one)?"
    )
    command = "python benchmarks/fabric_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_runs(args, "fabric_speed", command, runs, report, start)


if __name__ == "__main__":
    main()
