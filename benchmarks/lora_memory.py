"""LoRA against full fine-tuning of a 155M-parameter Llama on 2 CPU ranks: model state and peak RSS per rank, against
the memory estimate's formula.

    python benchmarks/lora_memory.py                 # -> benchmarks/results/memory.json

One launch (Lightning's launcher, 2 CPU ranks, ``ShardedStrategy`` FULL_SHARD, fp32, AdamW) per run:

* full: ``LlamaForCausalLM`` (width 1024, 12 layers, SwiGLU 2816, vocabulary 256: 154.7M parameters) built eagerly in
  the LightningModule's ``__init__``, every parameter trained.
* lora: the same model wrapped by peft's ``get_peft_model`` with rank-8 adapters on ``q_proj`` and ``v_proj`` (0.39M
  trainable parameters, the rest frozen), AdamW over the trainable parameters only.

Each trains ``--steps`` optimizer steps of micro-batch 1 x ``--seq-len`` tokens. Per rank: the model state as
``ShardedMemoryMonitor`` counts it at the last step (the local shards of parameters, gradients and optimizer states),
the RSS when training starts (model built, sharded, optimizer made), the peak RSS during training (the kernel's
high-water mark, reset when training starts) and over the whole process (including the eager build, when every rank
holds the whole model before it is sharded). The formula is ``estimate_memory`` of the same module (frozen
parameters: stored copy only) on 2 ranks: model states, and its device total with three gathered blocks, one block's
reduce-scatter and the activations (Korthikanti et al.'s GPT formula, an approximation for Llama's SwiGLU MLP).
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

from benchmarks.common import RESULTS, PeakRSS, cpu_trainer, random_token_dataset, small_llama, status_mib  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

LLAMA = small_llama(16, vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
RUNS = ("full", "lora")
MIB = 2**20


def build(run: str) -> Any:
    """The Llama of :data:`LLAMA`, wrapped with the adapters of :data:`LORA` for ``run == "lora"``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    if run == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    return model


# ------------------------------------------------------------------ worker side (one launch, 2 ranks)


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    import lightning_shard
    from lightning_shard.memory import ShardedMemoryMonitor

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(args.worker)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class TrainingPeak(Callback):
        """RSS when training starts, and the peak from then on (and over the whole process before that)."""

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.process_peak_mib = status_mib("VmHWM")["VmHWM"]
            self.peak = PeakRSS()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.figures = self.peak.result()

    L.seed_everything(0, verbose=False)
    monitor, peak = ShardedMemoryMonitor(log_every_n_steps=1), TrainingPeak()
    strategy = lightning_shard.ShardedStrategy(sharding_strategy="FULL_SHARD")
    trainer = cpu_trainer(2, strategy, [monitor, peak], max_steps=args.steps)
    data = random_token_dataset(2 * args.steps, args.seq_len, LLAMA["vocab_size"])
    trainer.fit(FineTune(), torch.utils.data.DataLoader(data, batch_size=1))
    record = {
        "rank": trainer.global_rank,
        "rss_at_train_start_mib": peak.figures["rss_start_mib"],
        "peak_rss_training_mib": peak.figures["peak_rss_mib"],
        "peak_rss_process_mib": max(peak.process_peak_mib, peak.figures["peak_rss_mib"]),
        "training_seconds": peak.figures["seconds"],
    }
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if trainer.is_global_zero:
        last = monitor.history[-1]
        for rank_record, counted in zip(records, last["ranks"], strict=True):
            rank_record["model_state"] = {k: counted[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
        Path(args.out).write_text(json.dumps({"step": last["step"], "ranks": records}))


def launch(run: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train ``run`` once on 2 CPU ranks; the per-rank records."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", run, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--seq-len", str(args.seq_len)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launcher sets threads per rank
    proc = subprocess.run(cmd, env={**env, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"{run} failed with exit code {proc.returncode}")
    result = json.loads(out.read_text())
    out.unlink()
    return {**result, "seq_len": args.seq_len}


# ------------------------------------------------------------------ driver side


def formula(run: str, seq_len: int) -> dict[str, Any]:
    """``estimate_memory`` of the run's module, built on the meta device, on 2 ranks."""
    import torch

    from lightning_shard.memory import estimate_memory

    with torch.device("meta"):
        model = build(run)
    dims = {"n_layer": 12, "n_embd": 1024, "n_head": 16, "vocab_size": LLAMA["vocab_size"], "seq_len": seq_len}
    estimate = estimate_memory(model, world_size=2, precision="32-true", micro_batch_size=1, **dims)
    return estimate.to_dict()


def report(runs: dict[str, dict[str, Any]], formulas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows, peaks = [], {}
    for run in RUNS:
        estimate = formulas[run]["device"]
        model_state = estimate["params"] + estimate["grads"] + estimate["optimizer_states"]
        for record in runs[run]["ranks"]:
            state = record["model_state"]
            # The process without its model: at train start the parameter shards are the only model state.
            baseline = record["rss_at_train_start_mib"] - state["params_bytes"] / MIB
            peak = record["peak_rss_training_mib"] - baseline
            peaks[run, record["rank"]] = record["peak_rss_training_mib"]
            rows.append(
                [
                    run,
                    record["rank"],
                    f"{formulas[run]['n_params']:,} ({formulas[run]['trainable_params']:,})",
                    " / ".join(f"{state[k] / MIB:.1f}" for k in ("params_bytes", "grads_bytes", "optimizer_bytes")),
                    " / ".join(f"{estimate[k] / MIB:.1f}" for k in ("params", "grads", "optimizer_states")),
                    f"{sum(state.values()) / model_state:.3f}",
                    f"{record['peak_rss_training_mib']:.0f}",
                    f"{peak:.0f}",
                    f"{estimate['total_bytes'] / MIB:.0f}",
                    f"{peak / (estimate['total_bytes'] / MIB):.2f}",
                ]
            )
    state = {run: max(sum(r["model_state"].values()) for r in runs[run]["ranks"]) / MIB for run in RUNS}
    peak = {run: max(v for (r, _), v in peaks.items() if r == run) for run in RUNS}
    build_peaks = [r["peak_rss_process_mib"] > r["peak_rss_training_mib"] for run in RUNS for r in runs[run]["ranks"]]
    return {
        "title": "LoRA vs full fine-tuning: memory per rank on 2 CPU ranks",
        "question": "Do frozen parameters cost only their stored copy (no gradient, no AdamW states), as the "
        "estimator counts them, and what does that save per rank?",
        "columns": [
            "run",
            "rank",
            "parameters (trainable)",
            "measured params / grads / AdamW (MiB)",
            "formula params / grads / AdamW (MiB)",
            "model state measured / formula",
            "peak RSS in training (MiB)",
            "peak RSS over the process baseline (MiB)",
            "formula device total (MiB)",
            "peak over baseline / formula total",
        ],
        "rows": rows,
        "notes": [
            f"Llama {LLAMA['num_hidden_layers']} layers x {LLAMA['hidden_size']} wide, SwiGLU "
            f"{LLAMA['intermediate_size']}, vocabulary {LLAMA['vocab_size']}, fp32, FULL_SHARD, AdamW, micro-batch "
            f"1 x {runs['full']['seq_len']} tokens, {runs['full']['step']} steps; LoRA rank {LORA['r']} on "
            f"{', '.join(LORA['target_modules'])} (peft get_peft_model in __init__).",
            f"Model state per rank: LoRA {state['lora']:.0f} MiB vs full {state['full']:.0f} MiB "
            f"({state['full'] / state['lora']:.2f}x less); peak RSS in training {peak['lora']:.0f} vs "
            f"{peak['full']:.0f} MiB ({peak['full'] / peak['lora']:.2f}x less).",
            "Model state counted by ShardedMemoryMonitor at the last step (local shards; each FSDP2 shard is a view "
            "of a padded buffer, counted whole). Formula: estimate_memory of the same module, frozen parameters "
            "stored only (no gradient, no optimizer state).",
            "Process baseline: RSS when training starts less the rank's parameter shards (interpreter, torch, "
            "transformers). Formula device total: model states + 3 gathered blocks + one block's reduce-scatter + "
            "activations (Korthikanti et al.'s GPT formula; Llama's SwiGLU MLP keeps more). Not in the formula: "
            "AdamW's foreach temporaries (up to a few times the trained shards) and the allocator's cache.",
            "The eager build in __init__ (every rank holds the whole fp32 model, 590 MiB, before it is sharded) "
            + (
                "raised a process's peak above its training peak."
                if any(build_peaks)
                else "stayed below the training peak on every rank."
            ),
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--output", default=str(result_path("lora_memory")))
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    start = time.perf_counter()
    runs, formulas = {}, {}
    for run in RUNS:
        runs[run] = launch(run, args, RESULTS / f"tmp_lora_memory_{run}.json")
        formulas[run] = formula(run, args.seq_len)
        states = [sum(r["model_state"].values()) / MIB for r in runs[run]["ranks"]]
        print(f"{run}: model state per rank {[round(s, 1) for s in states]} MiB", flush=True)
    write_result(
        Path(args.output),
        "lora_memory",
        {
            "model": LLAMA,
            "lora": LORA,
            "settings": {"steps": args.steps, "seq_len": args.seq_len, "micro_batch_size": 1, "world_size": 2},
            "wall_seconds": time.perf_counter() - start,
            "runs": runs,
            "formula": formulas,
            "report": report(runs, formulas),
        },
    )


if __name__ == "__main__":
    main()
