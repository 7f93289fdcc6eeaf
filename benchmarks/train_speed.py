"""Training speed and memory of the same GPT under DDP, a hand-written FSDP2 anchor and ``ShardedStrategy``.

One launch (2 CPU ranks, Lightning's popen launcher) per configuration, so each configuration's peak RSS is its
own; the configurations are run in rounds (A, B, C, ..., A, B, C, ...) so machine load affects them alike.

    python benchmarks/train_speed.py                       # every configuration, 2 rounds -> results/train_speed.json
    python benchmarks/train_speed.py --configs ddp fs --rounds 1

Per launch and rank it records the step times (``time.perf_counter`` between ``on_train_batch_start`` and
``on_train_batch_end``, each behind a barrier), the peak RSS, the loss per step and the model-state bytes counted
from the local shards (``lightning_shard.memory.accounting``) at the end of the last step, when parameters,
gradients and AdamW states all exist.

Configurations (``CONFIGS``):
  ddp            Lightning ``DDPStrategy``.
  anchor         Lightning ``ModelParallelStrategy`` (data_parallel_size=2), the model built eagerly on every rank in
                 ``configure_model`` and ``fully_shard`` applied by hand per Block and to the root (what a user writes).
  fs, fs_ac      ``ShardedStrategy("FULL_SHARD")`` without / with ``activation_checkpointing=["Block"]``.
  sgo, sgo_ac    ``SHARD_GRAD_OP``;  ns, ns_ac: ``NO_SHARD``.
  fs_prefetch    fs + ``ShardedStrategy(forward_prefetch=True)``
                 (``unit[i].set_modules_to_forward_prefetch([unit[i+1]])``). Runs 1, 2 and the check run
                 applied it from outside, with explicit backward prefetch as well.
  fs_last        fs + the last Block kept gathered after forward (``blocks[-1].set_reshard_after_forward(False)``):
                 backward starts with it, so one all-gather per step is saved.
  fs_threads     fs + ``torch.set_num_threads(cpu_count // devices)`` on every rank (in the callback's ``setup``).
                 Measured the gap that ``ShardedStrategy`` had until it built the popen launcher on every rank as
                 DDPStrategy does (commit f2e3f93); since then plain ``fs`` sets the same thread count.
  fs_both        explicit forward + backward prefetch (from outside) + fs_last;  fs_all: fs_threads + fs_both.
  fs_fsdpcomms   fs with FSDP2's own ``all_gather_single`` / ``reduce_scatter_single`` put back in place of
                 the strategy's collectives (what the strategy did before it installed ``gloo_comms``).
  fs_gloocomms   fs with ``lightning_shard.cpu.gloo_comms`` put back in place of ``shm_comms`` (gloo carries the data;
                 what the strategy did before it installed ``shm_comms``).
  fs_nocomm      diagnostic: fs with the all-gather skipped and the reduce-scatter a local copy, so FSDP2's own work
                 (copies, hooks, allocation) is timed without communication; its losses are meaningless.
  fs_gloobarrier fs with gloo's barrier in place of ``shm_barrier``'s futex barrier inside the shared-memory
                 collectives (the ranks are told they cannot use it), i.e. what the strategy did before
                 ``shm_barrier``.
  fs_notrim      fs without ``lightning_shard.cpu.heap``'s trim after each optimizer step (replaced by a no-op in
                 the worker), so ``fs`` against it is what the trim bought.
  fs_foreach     fs + AdamW's multi-tensor (foreach) path: on CPU torch defaults to the per-parameter loop, which
                 under FSDP2 dispatches every elementwise op through DTensor; ddp_foreach: the same for DDP.
The last three apply a change from the outside (a callback after the strategy's setup); nothing in the strategy
is edited.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, barrier, machine, median, peak_rss_bytes, random_token_dataset, write_json

MODEL = dict(n_layer=6, n_head=8, n_embd=512, vocab_size=256, block_size=256, dropout=0.0, warmup_steps=2)
DEFAULTS = dict(batch_size=2, warmup=2, steps=8, devices=2)

CONFIGS = ["ddp", "anchor", "fs", "fs_ac", "sgo", "sgo_ac", "ns", "ns_ac", "fs_threads", "fs_prefetch", "fs_last"]
EXTRA_CONFIGS = [
    "fs_both",
    "fs_all",
    "fs_foreach",
    "ddp_foreach",
    "fs_mmap",
    "ddp_mmap",
    "fs_fsdpcomms",
    "fs_gloocomms",
    "fs_gloobarrier",
    "fs_nocomm",
    "fs_notrim",
]
# Process environment per configuration (set for the launch; the popen launcher hands it to every rank).
# glibc raises its mmap threshold dynamically (up to 32 MiB) after large blocks are freed; FSDP2 frees and
# re-allocates unsharded block buffers every step, so later ones land on the heap and fragment it. A fixed
# threshold keeps large buffers in mmap, which returns them to the OS on free.
CONFIG_ENV = {
    "fs_mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "ddp_mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
DESCRIPTIONS = {
    "ddp": "Lightning DDPStrategy",
    "anchor": "Lightning ModelParallelStrategy + fully_shard by hand (eager build)",
    "fs": "ShardedStrategy FULL_SHARD",
    "fs_ac": "ShardedStrategy FULL_SHARD + activation checkpointing",
    "sgo": "ShardedStrategy SHARD_GRAD_OP",
    "sgo_ac": "ShardedStrategy SHARD_GRAD_OP + activation checkpointing",
    "ns": "ShardedStrategy NO_SHARD",
    "ns_ac": "ShardedStrategy NO_SHARD + activation checkpointing",
    "fs_prefetch": "FULL_SHARD + ShardedStrategy(forward_prefetch=True)",
    "fs_last": "FULL_SHARD + last Block not resharded after forward (from outside)",
    "fs_both": "FULL_SHARD + explicit prefetch + last Block kept gathered (from outside)",
    "fs_threads": "FULL_SHARD + torch threads = cores // ranks on every rank, as DDP's launcher sets (from outside)",
    "fs_all": "FULL_SHARD + threads + explicit prefetch + last Block kept gathered (from outside)",
    "fs_foreach": "FULL_SHARD + AdamW(foreach=True) (from outside: param_groups['foreach'] = True)",
    "ddp_foreach": "DDPStrategy + AdamW(foreach=True) (the same change for the baseline)",
    "fs_mmap": "FULL_SHARD + MALLOC_MMAP_THRESHOLD_=131072 in the environment (fixed glibc mmap threshold)",
    "ddp_mmap": "DDPStrategy + MALLOC_MMAP_THRESHOLD_=131072 (the same for the baseline)",
    "fs_fsdpcomms": "FULL_SHARD with FSDP2's default gloo collectives put back (from outside), i.e. before gloo_comms",
    "fs_gloocomms": "FULL_SHARD with gloo_comms put back (from outside), i.e. before shm_comms",
    "fs_gloobarrier": "FULL_SHARD with gloo's barrier in the shared-memory collectives (from outside), i.e. before "
    "shm_barrier",
    "fs_nocomm": "FULL_SHARD with no communication at all (diagnostic: wrong numbers, FSDP2's own cost)",
    "fs_notrim": "FULL_SHARD without the heap trim after each optimizer step (from outside), i.e. before cpu_heap",
}


# ---------------------------------------------------------------------------------------------------- worker side


def _replacement_comms(kind: str) -> tuple[Any, Any]:
    """FSDP2's default collectives (``"fsdp"``), ``gloo_comms``' (``"gloo"``), or ones that communicate nothing
    (``"none"``, for timing only)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from lightning_shard.cpu.gloo_comms import GlooAllGather, GlooReduceScatter

    class LocalAllGather(GlooAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return None  # this rank's chunk is already in place (FSDP2's copy-in); the others keep stale bytes

    class LocalReduceScatter(GlooReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])

    if kind == "fsdp":
        return DefaultAllGather(), DefaultReduceScatter()
    if kind == "gloo":
        return GlooAllGather(), GlooReduceScatter()
    return LocalAllGather(), LocalReduceScatter()


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import lightning_shard
    from examples.gpt.model import GPT
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
            self._t0 = 0.0
            self.setup_peak_rss = 0
            self.first_step_peak_rss = 0
            # Phase split of each step on this rank (no extra barriers): forward (start -> on_before_backward),
            # backward incl. gradient reduction (-> on_after_backward), the rest (optimizer step, scheduler, logging).
            self.phases: list[tuple[float, float, float]] = []
            self._marks: dict[str, float] = {}

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._marks["fwd"] = time.perf_counter()

        def on_after_backward(self, trainer, pl_module) -> None:
            self._marks["bwd"] = time.perf_counter()

        def on_train_start(self, trainer, pl_module) -> None:
            # After configure_model, sharding/materialisation and optimizer creation, before the first step.
            self.setup_peak_rss = peak_rss_bytes()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            barrier()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            end = time.perf_counter()
            if "fwd" in self._marks and "bwd" in self._marks:
                fwd, bwd = self._marks["fwd"], self._marks["bwd"]
                self.phases.append((fwd - self._t0, bwd - fwd, end - bwd))
            self._marks.clear()
            barrier()
            self.times.append(time.perf_counter() - self._t0)
            self.losses.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))
            if batch_idx == 0:
                self.first_step_peak_rss = peak_rss_bytes()
            if batch_idx == args.warmup + args.steps - 1:
                params = list(pl_module.parameters())
                self.state = {
                    "param_bytes": parameter_bytes(params),
                    "grad_bytes": gradient_bytes(params),
                    "optimizer_bytes": optimizer_state_bytes(trainer.optimizers),
                }

    class OutsideTweaks(Callback):
        """Speed ideas applied to the sharded model after the strategy's setup (nothing in the strategy is edited)."""

        def __init__(
            self, prefetch: bool, keep_last: bool, threads: bool, foreach: bool = False, comms: str | None = None
        ) -> None:
            self.prefetch, self.keep_last, self.threads, self.foreach = prefetch, keep_last, threads, foreach
            self.comms = comms  # None: the strategy's; "fsdp": FSDP2's defaults; "gloo": gloo_comms; "none": nothing

        def setup(self, trainer, pl_module, stage) -> None:
            if self.threads:
                # What lightning.fabric.utilities.distributed._set_num_threads_if_needed does for DDP's ranks.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // trainer.strategy.num_processes))

        def on_fit_start(self, trainer, pl_module) -> None:
            model = trainer.strategy.model
            blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
            if self.prefetch:
                for i, block in enumerate(blocks):
                    if i + 1 < len(blocks):
                        block.set_modules_to_forward_prefetch([blocks[i + 1]])
                    if i > 0:
                        block.set_modules_to_backward_prefetch([blocks[i - 1]])
            if self.keep_last and blocks:
                blocks[-1].set_reshard_after_forward(False)
            if self.comms is not None:
                all_gather, reduce_scatter = _replacement_comms(self.comms)
                for module in [model, *blocks]:
                    module.set_custom_all_gather(all_gather)
                    module.set_custom_reduce_scatter(reduce_scatter)
            if self.foreach:
                for optimizer in trainer.optimizers:
                    for group in optimizer.param_groups:
                        group["foreach"] = True

    config = args.worker
    if config == "fs_notrim":
        import lightning_shard.strategy

        lightning_shard.strategy.HeapTrimmer.step = lambda self: False
    if config == "fs_gloobarrier":
        import lightning_shard.cpu.shm_comms

        lightning_shard.cpu.shm_comms._barrier_namespace = lambda: None
    L.seed_everything(1234, verbose=False)
    module_cls = GPT
    callbacks: list[Callback] = []
    if config in ("ddp", "ddp_foreach", "ddp_mmap"):
        strategy: Any = DDPStrategy()
        if config == "ddp_foreach":
            callbacks.append(OutsideTweaks(prefetch=False, keep_last=False, threads=False, foreach=True))
    elif config == "anchor":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
        module_cls = AnchorGPT
    else:
        base = config.split("_")[0]
        sharding = {"fs": "FULL_SHARD", "sgo": "SHARD_GRAD_OP", "ns": "NO_SHARD"}[base]
        strategy = lightning_shard.ShardedStrategy(
            sharding_strategy=sharding,
            auto_wrap_policy=["Block"],
            activation_checkpointing=["Block"] if config.endswith("_ac") else None,
            forward_prefetch=config == "fs_prefetch",
        )
        if config in (
            "fs_threads",
            "fs_last",
            "fs_both",
            "fs_all",
            "fs_foreach",
            "fs_fsdpcomms",
            "fs_gloocomms",
            "fs_nocomm",
        ):
            callbacks.append(
                OutsideTweaks(
                    prefetch=config in ("fs_both", "fs_all"),
                    keep_last=config in ("fs_last", "fs_both", "fs_all"),
                    threads=config in ("fs_threads", "fs_all"),
                    foreach=config == "fs_foreach",
                    comms={"fs_fsdpcomms": "fsdp", "fs_gloocomms": "gloo", "fs_nocomm": "none"}.get(config),
                )
            )
    timer = StepTimer()
    total_steps = args.warmup + args.steps
    model = module_cls(**MODEL, max_steps=total_steps)
    data = random_token_dataset(args.batch_size * args.devices * total_steps, MODEL["block_size"], MODEL["vocab_size"])
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision="32-true",
        max_steps=total_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *callbacks],
    )
    start = time.perf_counter()
    trainer.fit(model, loader)
    fit_seconds = time.perf_counter() - start
    num_params = sum(p.numel() for p in trainer.strategy.model.parameters())  # DTensor numel() is global
    result = {
        "config": config,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "torch_threads": torch.get_num_threads(),
        "step_seconds": timer.times,
        "timed_step_seconds": timer.times[args.warmup :],
        "losses": timer.losses,
        "phase_seconds": timer.phases,
        "model_state": timer.state,
        "num_params": num_params,
        "peak_rss_bytes": peak_rss_bytes(),
        "setup_peak_rss_bytes": timer.setup_peak_rss,
        "first_step_peak_rss_bytes": timer.first_step_peak_rss,
        "fit_seconds": fit_seconds,
        "loadavg_end": list(os.getloadavg()),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{config}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- driver side


def _launch(config: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        config,
        "--out",
        str(out),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--devices",
        str(args.devices),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env["PYTHONWARNINGS"] = "ignore"
    env.update(CONFIG_ENV.get(config, {}))
    load_before = list(os.getloadavg())
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"{config} failed with exit code {proc.returncode}")
    ranks = []
    for r in range(args.devices):
        path = out / f"{config}.rank{r}.json"
        data = json.loads(path.read_text())
        path.unlink()
        data["launch_wall_seconds"] = wall
        data["loadavg_start"] = load_before
        ranks.append(data)
    return ranks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "tmp"), help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS + EXTRA_CONFIGS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--devices", type=int, default=DEFAULTS["devices"])
    parser.add_argument("--output", default=str(RESULTS / "train_speed.json"))
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return

    out = Path(args.out)
    runs: list[dict[str, Any]] = []
    machine_start = machine()
    start = time.perf_counter()
    for round_index in range(args.rounds):
        for config in args.configs:
            ranks = _launch(config, args, out)
            step = median([max(r["timed_step_seconds"][i] for r in ranks) for i in range(args.steps)])
            print(
                f"round {round_index} {config:12s} median step {step:.3f}s  peak RSS "
                f"{[round(r['peak_rss_bytes'] / 2**20) for r in ranks]} MiB  load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            runs.append({"round": round_index, "config": config, "ranks": ranks})
    result = {
        "benchmark": "train_speed",
        "command": "python benchmarks/train_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {**DEFAULTS, **{k: getattr(args, k) for k in DEFAULTS}, "rounds": args.rounds},
        "model": MODEL,
        "descriptions": DESCRIPTIONS,
        "machine_start": machine_start,
        "machine_end": machine(),
        "wall_seconds": time.perf_counter() - start,
        "runs": runs,
    }
    write_json(Path(args.output), result)
    print(f"wrote {args.output} in {result['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
