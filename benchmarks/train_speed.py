"""Training speed and memory of one GPT: Lightning's DDP, a hand-sharded ModelParallelStrategy, ``ShardedStrategy``.

One launch (2 CPU ranks, Lightning's popen launcher) per configuration, so each configuration's peak RSS is its own;
configurations run in rounds (A, B, C, ..., A, B, C, ...) so that machine load affects them alike.

    python benchmarks/train_speed.py                                  # -> benchmarks/results/training_speed.json
    python benchmarks/train_speed.py --configs ddp fs --rounds 1 --steps 4 --output /tmp/quick.json

Per launch and rank it records each step's time (``time.perf_counter`` between ``on_train_batch_start`` and
``on_train_batch_end``, each behind a barrier), the peak RSS, the loss and the model-state bytes counted from the
local shards (``lightning_shard.memory.accounting``) at the end of the last step, when parameters, gradients and
AdamW states all exist. A configuration's step time is the median, over all timed steps of all rounds, of the
slower rank's time; ratios are DDP's (or the anchor's) median step over the configuration's.

Configurations:
  ddp      Lightning ``DDPStrategy`` (the baseline).
  anchor   Lightning ``ModelParallelStrategy(data_parallel_size=2)``, the model built eagerly in ``configure_model``
           and ``fully_shard`` applied by hand to each Block and the root: what a user writes without this package.
  fs       ``ShardedStrategy("FULL_SHARD")``, the default path (FSDP2's own collectives on gloo).
  fs_shm   ``fs`` with ``cpu_collectives="shared_memory"`` (the opt-in CPU transport and its heap trim).
  sgo      ``ShardedStrategy("SHARD_GRAD_OP")``, the default path.
  fs_trim  diagnostic: ``fs`` with the transport's heap trim (every 5 optimizer steps) applied from outside by a
           callback, to measure whether the trim would pay on the default path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, barrier, cpu_trainer, median, peak_rss_bytes, random_token_dataset
from benchmarks.results_files import result_path, write_result

MODEL = dict(n_layer=6, n_head=8, n_embd=512, vocab_size=256, block_size=256, dropout=0.0, warmup_steps=2)
DEFAULTS = dict(batch_size=2, warmup=2, steps=20, devices=2, rounds=4)
DESCRIPTIONS = {
    "ddp": "Lightning DDPStrategy",
    "anchor": "Lightning ModelParallelStrategy + fully_shard by hand",
    "fs": "ShardedStrategy FULL_SHARD (default)",
    "fs_shm": 'FULL_SHARD, cpu_collectives="shared_memory"',
    "sgo": "ShardedStrategy SHARD_GRAD_OP (default)",
    "fs_trim": "FULL_SHARD + heap trim every 5 steps (diagnostic)",
}
CONFIGS = list(DESCRIPTIONS)
# config -> (sharding_strategy, cpu_collectives)
SHARDED = {
    "fs": ("FULL_SHARD", "gloo"),
    "fs_shm": ("FULL_SHARD", "shared_memory"),
    "sgo": ("SHARD_GRAD_OP", "gloo"),
    "fs_trim": ("FULL_SHARD", "gloo"),
}


# ---------------------------------------------------------------------------------------------------- worker side


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    import lightning_shard
    from examples.gpt.model import GPT
    from lightning_shard.cpu import HeapTrimmer
    from lightning_shard.memory.accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes

    class AnchorGPT(GPT):
        """What a user writes for Lightning's ModelParallelStrategy: eager build, ``fully_shard`` per Block + root."""

        def configure_model(self) -> None:
            if self.transformer is not None:
                return
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for block in self.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.state: dict[str, int] = {}
            self._start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            barrier()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            barrier()
            self.times.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"]))
            if batch_idx == args.warmup + args.steps - 1:
                params = list(pl_module.parameters())
                self.state = {
                    "param_bytes": parameter_bytes(params),
                    "grad_bytes": gradient_bytes(params),
                    "optimizer_bytes": optimizer_state_bytes(trainer.optimizers),
                }

    class TrimFromOutside(Callback):
        def __init__(self) -> None:
            self.trimmer = HeapTrimmer(every=5)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.trimmer.step()

    config = args.worker
    L.seed_everything(1234, verbose=False)
    module_cls: type = GPT
    callbacks: list[Callback] = []
    if config == "ddp":
        strategy: Any = DDPStrategy()
    elif config == "anchor":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
        module_cls = AnchorGPT
    else:
        sharding, collectives = SHARDED[config]
        strategy = lightning_shard.ShardedStrategy(
            sharding_strategy=sharding, auto_wrap_policy=["Block"], cpu_collectives=collectives
        )
        if config == "fs_trim":
            callbacks.append(TrimFromOutside())
    timer = StepTimer()
    total_steps = args.warmup + args.steps
    model = module_cls(**MODEL, max_steps=total_steps)
    data = random_token_dataset(args.batch_size * args.devices * total_steps, MODEL["block_size"], MODEL["vocab_size"])
    trainer = cpu_trainer(args.devices, strategy, [timer, *callbacks], max_steps=total_steps)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False))
    result = {
        "config": config,
        "rank": trainer.global_rank,
        "timed_step_seconds": timer.times[args.warmup :],
        "losses": timer.losses,
        "model_state": timer.state,
        "num_params": sum(p.numel() for p in trainer.strategy.model.parameters()),  # DTensor numel() is global
        "peak_rss_bytes": peak_rss_bytes(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{config}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- driver side


def launch(config: str, args: argparse.Namespace, out: Path, script: Path = Path(__file__)) -> list[dict[str, Any]]:
    """Run ``config`` once on ``args.devices`` CPU ranks (``script --worker config``); return each rank's record."""
    flags = ["--batch-size", args.batch_size, "--warmup", args.warmup, "--steps", args.steps, "--devices", args.devices]
    cmd = [sys.executable, str(script.resolve()), "--worker", config, "--out", str(out), *map(str, flags)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launcher sets threads per rank
    proc = subprocess.run(cmd, env={**env, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"{config} failed with exit code {proc.returncode}")
    ranks = []
    for rank in range(args.devices):
        path = out / f"{config}.rank{rank}.json"
        ranks.append(json.loads(path.read_text()))
        path.unlink()
    return ranks


def slowest_rank_steps(ranks: list[dict[str, Any]]) -> list[float]:
    return [max(times) for times in zip(*(r["timed_step_seconds"] for r in ranks), strict=True)]


def summarise(runs: list[dict[str, Any]], devices: int) -> dict[str, Any]:
    """One table row per configuration: step time and its ratios, peak RSS and its ratio, model state, final loss."""
    configs = list(dict.fromkeys(run["config"] for run in runs))
    steps = {
        c: median([s for run in runs if run["config"] == c for s in slowest_rank_steps(run["ranks"])]) for c in configs
    }
    rss = {c: max(r["peak_rss_bytes"] for run in runs if run["config"] == c for r in run["ranks"]) for c in configs}
    rows, state_ratio = [], {}
    for config in configs:
        last = [run for run in runs if run["config"] == config][-1]["ranks"]
        limit = 16 * last[0]["num_params"] / devices
        state = max(sum(r["model_state"].values()) for r in last)
        state_ratio[config] = state / limit
        rows.append(
            [
                config,
                DESCRIPTIONS[config],
                f"{steps[config]:.3f}",
                f"{steps['ddp'] / steps[config]:.2f}x" if "ddp" in steps else "-",
                f"{steps['anchor'] / steps[config]:.2f}x" if "anchor" in steps else "-",
                f"{rss[config] / 2**20:.0f}",
                f"{rss[config] / rss['ddp']:.3f}" if "ddp" in rss else "-",
                f"{state_ratio[config]:.3f}",
                f"{last[0]['losses'][-1]:.4f}",
            ]
        )
    notes = [
        f"GPT {MODEL['n_layer']} layers x {MODEL['n_embd']} wide, context {MODEL['block_size']}, fp32, AdamW; "
        "micro-batch 2 per rank.",
    ]
    if "ddp" in steps:
        for config in configs:
            per_round = [
                median(slowest_rank_steps(base["ranks"])) / median(slowest_rank_steps(run["ranks"]))
                for base, run in _pairs(runs, "ddp", config)
            ]
            if config != "ddp" and len(per_round) > 1:
                notes.append(f"`{config}` per round, speed vs DDP: " + ", ".join(f"{r:.2f}x" for r in per_round))
    notes += _targets(steps, rss, state_ratio)
    return {
        "title": "Training speed and memory: 2 CPU ranks",
        "question": "How fast does the default path train against Lightning's DDP and a hand-sharded "
        "ModelParallelStrategy, and what does the opt-in shared-memory transport add?",
        "columns": [
            "config",
            "what",
            "median step (s)",
            "speed vs DDP",
            "speed vs anchor",
            "peak RSS/rank (MiB)",
            "RSS / DDP",
            "model state / (16 B x params / N)",
            "final loss (rank 0)",
        ],
        "rows": rows,
        "notes": notes,
    }


def _targets(steps: dict[str, float], rss: dict[str, int], state_ratio: dict[str, float]) -> list[str]:
    """The product-shape issue's targets, each said to be met or not, with its figure."""
    checks = []
    if {"fs", "anchor"} <= steps.keys():
        ratio = steps["anchor"] / steps["fs"]
        checks.append(("default FULL_SHARD >= 0.97x the hand-sharded anchor", ratio >= 0.97, f"{ratio:.2f}x"))
    if {"fs", "ddp"} <= rss.keys():
        ratio = rss["fs"] / rss["ddp"]
        checks.append(("default FULL_SHARD peak RSS per rank below DDP's", ratio < 1, f"{ratio:.3f}x DDP's"))
    if {"fs_shm", "ddp"} <= steps.keys():
        ratio = steps["ddp"] / steps["fs_shm"]
        checks.append(('`cpu_collectives="shared_memory"` FULL_SHARD >= 0.95x DDP', ratio >= 0.95, f"{ratio:.3f}x"))
    sharded = [state_ratio[c] for c in ("fs", "fs_shm", "sgo") if c in state_ratio]
    if sharded:
        worst = max(sharded, key=lambda r: abs(r - 1))
        checks.append(("model state per rank within 5% of 16 B x params / N", abs(worst - 1) <= 0.05, f"{worst:.3f}"))
    return [f"Target: {what}: **{'met' if met else 'not met'}** ({figure})." for what, met, figure in checks]


def _pairs(runs: list[dict[str, Any]], base: str, config: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(base, config) launches of the same round."""
    by_round = {(run["round"], run["config"]): run for run in runs}
    rounds = sorted({run["round"] for run in runs})
    return [
        (by_round[r, base], by_round[r, config]) for r in rounds if (r, base) in by_round and (r, config) in by_round
    ]


def make_parser(description: str, configs: list[str], script: str) -> argparse.ArgumentParser:
    """The driver's and the worker's arguments: configurations, sizes, rounds, where the JSON goes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "tmp"), help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", default=configs, choices=configs)
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--output", default=str(result_path(script)))
    return parser


def drive(
    argv: list[str] | None, description: str, configs: list[str], script: str, worker: Callable, path: Path
) -> tuple[argparse.Namespace, list[dict[str, Any]], float] | None:
    """Parse the arguments; in a worker launch run ``worker`` (give ``None``), in the driver run the rounds of
    launches of ``path`` and give the arguments, the runs and when they started."""
    args = make_parser(description, configs, script).parse_args(argv)
    if args.worker:
        worker(args)
        return None
    start = time.perf_counter()
    return args, run_rounds(args, path), start


def main(argv: list[str] | None = None) -> None:
    if (ran := drive(argv, __doc__, CONFIGS, "train_speed", _worker, Path(__file__))) is None:
        return
    args, runs, start = ran
    command = "python benchmarks/train_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_runs(args, "train_speed", command, runs, summarise(runs, args.devices), start)


def run_rounds(args: argparse.Namespace, script: Path) -> list[dict[str, Any]]:
    """``args.rounds`` rounds of one launch per configuration (A, B, C, A, B, C, ...), printing each as it ends."""
    runs: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for config in args.configs:
            ranks = launch(config, args, Path(args.out), script)
            runs.append({"round": round_index, "config": config, "ranks": ranks})
            step, peak = median(slowest_rank_steps(ranks)), max(r["peak_rss_bytes"] for r in ranks) / 2**20
            print(f"round {round_index} {config:8s} median step {step:.3f}s  peak RSS {peak:.0f} MiB", flush=True)
    return runs


def write_runs(
    args: argparse.Namespace,
    script: str,
    command: str,
    runs: list[dict[str, Any]],
    report: dict[str, Any],
    start: float,
) -> None:
    """``script``'s section of ``args.output``: the command, machine, settings, every launch's records and the report
    table."""
    result = {
        "command": command.strip(),
        "settings": {k: getattr(args, k) for k in DEFAULTS},
        "model": MODEL,
        "wall_seconds": time.perf_counter() - start,
        "runs": runs,
        "report": report,
    }
    write_result(args.output, script, result)
    print(f"{script} ran {result['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
