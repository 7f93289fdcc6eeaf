"""Training speed and memory of one GPT under Lightning Fabric: Fabric's DDP, Fabric's ``ModelParallelStrategy``
with ``fully_shard`` applied by hand, and ``lightning_shard.fabric.ShardedStrategy``.

The harness of ``train_speed.py`` (same model, sizes, rounds, timing and summary), with a Fabric loop in each
worker instead of a Trainer: one launch (2 CPU ranks, Fabric's launcher) per configuration and round.

    python benchmarks/fabric_speed.py                      # -> benchmarks/results/fabric_speed.json
    python benchmarks/fabric_speed.py --rounds 1 --steps 4 --output /tmp/quick.json

Each step - forward, ``fabric.backward``, ``optimizer.step``, ``zero_grad``, the scheduler - is timed between two
barriers; model state is counted from the local shards after the last step's optimizer step.

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

from benchmarks.common import barrier, peak_rss_bytes, random_token_dataset
from benchmarks.train_speed import MODEL, make_parser, run_rounds, summarise, write_result

DESCRIPTIONS = {
    "ddp": "Fabric DDPStrategy",
    "anchor": "Fabric ModelParallelStrategy + fully_shard by hand",
    "fs": "lightning_shard.fabric.ShardedStrategy FULL_SHARD",
}
CONFIGS = list(DESCRIPTIONS)


def _worker(args: Any) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from examples.gpt.model import GPT
    from lightning_shard.fabric import ShardedStrategy
    from lightning_shard.memory.accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes

    def shard_by_hand(model: GPT, device_mesh: Any) -> GPT:
        mesh = device_mesh["data_parallel"]
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    config = args.worker
    if config == "ddp":
        strategy: Any = DDPStrategy()
    elif config == "anchor":
        strategy = ModelParallelStrategy(shard_by_hand, data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = ShardedStrategy(auto_wrap_policy=["Block"])
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1234, verbose=False)
    total_steps = args.warmup + args.steps
    model = GPT(**MODEL, max_steps=total_steps)
    model.configure_model()  # built eagerly, as for the Trainer benchmark's anchor and DDP
    model = fabric.setup(model)
    configured = model.configure_optimizers()
    optimizer = fabric.setup_optimizers(configured["optimizer"])
    scheduler = configured["lr_scheduler"]["scheduler"]
    data = random_token_dataset(args.batch_size * args.devices * total_steps, MODEL["block_size"], MODEL["vocab_size"])
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False))
    times, losses, state = [], [], {}
    for step, (x, y) in enumerate(loader):
        barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        if step == total_steps - 1:
            params = list(model.parameters())
            state = {
                "param_bytes": parameter_bytes(params),
                "grad_bytes": gradient_bytes(params),
                "optimizer_bytes": optimizer_state_bytes([optimizer]),
            }
        optimizer.zero_grad()
        scheduler.step()
        barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    result = {
        "config": config,
        "rank": fabric.global_rank,
        "timed_step_seconds": times[args.warmup :],
        "losses": losses,
        "model_state": state,
        "num_params": sum(p.numel() for p in model.parameters()),  # DTensor numel() is global
        "peak_rss_bytes": peak_rss_bytes(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{config}.rank{fabric.global_rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    args = make_parser(__doc__, CONFIGS, "fabric_speed.json").parse_args(argv)
    if args.worker:
        _worker(args)
        return
    start = time.perf_counter()
    runs = run_rounds(args, Path(__file__))
    report = summarise(runs, args.devices)
    for row in report["rows"]:
        row[1] = DESCRIPTIONS[row[0]]
    report["title"] = "Training speed and memory under Lightning Fabric: 2 CPU ranks"
    report["question"] = (
        "How fast does `Fabric(strategy=\"fully_sharded\")` train against Fabric's DDP and Fabric's "
        "ModelParallelStrategy with `fully_shard` applied by hand (target: >= 0.97x the hand-sharded one)?"
    )
    command = "python benchmarks/fabric_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_result(args, command, runs, report, start)


if __name__ == "__main__":
    main()
