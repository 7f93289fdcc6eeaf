"""What an EMA of the weights costs a sharded run: the update's time against the step, and the memory it adds.

    python benchmarks/weight_averaging.py            # -> benchmarks/results/averaging.json

Two launches of the same run (Lightning's launcher, 2 CPU ranks, ``ShardedStrategy`` FULL_SHARD with each block a
unit, fp32, AdamW): the example GPT at 302.6M parameters (24 layers, width 1024, byte vocabulary, 64-token context)
built in ``configure_model`` (on the meta device, materialised shard by shard), ``--steps`` optimizer steps of
micro-batch ``--batch-size`` x 64 tokens per rank; the first step is warm-up and not timed.

* ``baseline``: no averaging.
* ``ema``: ``callbacks=[EMAWeightAveraging()]`` as a user writes it (decay 0.999): an fp32 copy of this rank's shards,
  updated after every optimizer step with one ``torch._foreach_lerp_`` over the local shards.

Per timed step and rank: the whole step (``on_train_batch_start`` to the end of ``on_train_batch_end``), the
optimizer step (from ``on_before_optimizer_step``, after backward, to ``on_train_batch_end``) and the EMA update
(the averaging callback's ``on_train_batch_end``, timed by callbacks around it). The update's throughput counts what
``_foreach_lerp_`` moves: the copy read and written and the parameter shards read, 12 B per local parameter. Memory
per rank: the RSS when training starts (model, optimizer and copy allocated) and the peak during training (the
kernel's high-water mark, reset then), against the copy's ``4 B x parameters / 2``, and what the update allocates
while it runs (the anonymous RSS sampled every millisecond).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    PeakRSS,
    launch_worker,
    median,
    random_token_dataset,
)
from benchmarks.results_files import result_path, write_result  # noqa: E402

MODEL = dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=256, block_size=64, dropout=0.0, warmup_steps=1)
RUNS = ("baseline", "ema")
MIB = 2**20
TARGET = 0.05  # of the step


# ------------------------------------------------------------------ worker side (one launch, 2 ranks)


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from benchmarks.common import sharded_trainer
    from examples.gpt.model import GPT

    class Clock(L.Callback):
        """Timestamps of each step's moments; one instance before and one after the averaging callback."""

        def __init__(self, last: bool, window: dict[str, PeakRSS]) -> None:
            # `window`: shared by the two clocks, the memory sampled while the averaging callback runs
            self.last, self.window, self.marks = last, window, []

        def on_train_batch_start(self, *_: Any) -> None:
            if not self.last:
                self.marks.append({"start": time.perf_counter()})

        def on_before_optimizer_step(self, *_: Any) -> None:
            if not self.last:
                self.marks[-1]["optimizer"] = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            if self.last:
                allocated = self.window.pop("update").result()["peak_anon_over_start_mib"]
                self.marks.append({"end": time.perf_counter(), "update_mib": allocated})
            else:
                self.marks[-1]["end"] = time.perf_counter()
                self.window["update"] = PeakRSS(reset_high_water_mark=False)

    class TrainingPeak(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.peak = PeakRSS()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.figures = self.peak.result()

    L.seed_everything(0, verbose=False)
    window: dict[str, PeakRSS] = {}
    before, after, peak = Clock(last=False, window=window), Clock(last=True, window=window), TrainingPeak()
    averaging = [EMAWeightAveraging()] if args.worker == "ema" else []
    trainer = sharded_trainer(2, [before, *averaging, after, peak], max_steps=args.steps)
    data = random_token_dataset(2 * args.batch_size * args.steps, MODEL["block_size"], MODEL["vocab_size"])
    model = GPT(**MODEL, max_steps=args.steps)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch_size))
    steps = [
        {
            "step_s": end["end"] - marks["start"],
            "optimizer_s": marks["end"] - marks["optimizer"],
            "update_s": end["end"] - marks["end"],
            "update_mib": end["update_mib"],
        }
        for marks, end in zip(before.marks, after.marks, strict=True)
    ][1:]  # the first step is warm-up
    local_params = sum(p.to_local().numel() for p in model.parameters())
    record = {
        "rank": trainer.global_rank,
        "steps": steps,
        "local_params": local_params,
        "averaged_bytes": averaging[0]._average_model.local_bytes() if averaging else 0,
        "rss_at_train_start_mib": peak.figures["rss_start_mib"],
        "peak_rss_training_mib": peak.figures["peak_rss_mib"],
    }
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if trainer.is_global_zero:
        total = sum(p.numel() for p in model.parameters())
        Path(args.out).write_text(json.dumps({"params": total, "ranks": records}))


# ------------------------------------------------------------------ driver side


def summarise(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The report: per run and rank, the medians of the timed steps and the memory figures."""
    params = results["ema"]["params"]
    expected_mib = 4 * params / 2 / MIB
    rows, notes = [], []
    ratios, throughputs = [], []
    for run in RUNS:
        for record in results[run]["ranks"]:
            step, optimizer = (median([s[k] for s in record["steps"]]) for k in ("step_s", "optimizer_s"))
            update = median([s["update_s"] for s in record["steps"]]) if run == "ema" else 0.0
            baseline = results["baseline"]["ranks"][record["rank"]]
            added = record["peak_rss_training_mib"] - baseline["peak_rss_training_mib"]
            at_start = record["rss_at_train_start_mib"] - baseline["rss_at_train_start_mib"]
            transient = max(s["update_mib"] for s in record["steps"])
            if run == "ema":
                ratios.append(update / step)
                throughputs.append(12 * record["local_params"] / update / 2**30)
            rows.append(
                [
                    run,
                    str(record["rank"]),
                    f"{step:.2f}",
                    f"{optimizer * 1000:.0f}",
                    f"{update * 1000:.0f}" if run == "ema" else "-",
                    f"{update / step:.1%} / {update / optimizer:.0%}" if run == "ema" else "-",
                    f"{12 * record['local_params'] / update / 2**30:.1f}" if run == "ema" else "-",
                    f"{record['rss_at_train_start_mib']:.0f}",
                    f"{record['peak_rss_training_mib']:.0f}",
                    f"{at_start:+.0f} / {added:+.0f}" if run == "ema" else "-",
                    f"{transient:.1f}",
                ]
            )
    copy_mib = results["ema"]["ranks"][0]["averaged_bytes"] / MIB
    worst = max(ratios)
    notes.append(
        f"{params / 1e6:.1f}M parameters; the copy is {copy_mib:.0f} MiB per rank (4 B x parameters / 2 = "
        f"{expected_mib:.0f} MiB). Update / step: {', '.join(f'{r:.1%}' for r in ratios)} (target < {TARGET:.0%}: "
        f"{'met' if worst < TARGET else 'not met'}); foreach update {', '.join(f'{t:.1f}' for t in throughputs)} "
        "GiB/s (12 B per local parameter: the copy read and written, the shard read)."
    )
    spread = max(
        abs(ranks[0]["peak_rss_training_mib"] - ranks[1]["peak_rss_training_mib"])
        for ranks in (results[run]["ranks"] for run in RUNS)
    )
    notes.append(
        "Added: the ema run's RSS when training starts and its peak RSS during training, minus the baseline's, per "
        f"rank (separate launches on a shared 2-vCPU machine; the two ranks of one run differ by up to {spread:.0f} "
        "MiB in peak RSS, so the peak's difference is that noisy). "
        "Allocated by the update: the anonymous RSS sampled every millisecond while the averaging callback runs, over "
        "its value before (the baseline's column is the same window with nothing in it)."
    )
    return {
        "title": "Weight averaging: the EMA update's cost against the step, and the memory it adds",
        "question": (
            f"On 2 CPU ranks, what does `callbacks=[EMAWeightAveraging()]` cost a {params / 1e6:.0f}M-parameter GPT "
            f"(micro-batch {args.batch_size} x {MODEL['block_size']} tokens per rank, FULL_SHARD, fp32, AdamW): the "
            "update's time against the training step and the optimizer step (target: under 5% of the step), the "
            "update's throughput, and peak memory against the same run without averaging (+4 B x parameters / 2)?"
        ),
        "columns": [
            "run",
            "rank",
            "step s (median)",
            "optimizer step ms",
            "EMA update ms",
            "update / step / optimizer step",
            "update GiB/s",
            "RSS at train start MiB",
            "peak RSS in training MiB",
            "added at train start / at the peak MiB",
            "allocated by the update MiB (max)",
        ],
        "rows": rows,
        "notes": notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is not timed")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences of 64 tokens per rank and step")
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=result_path("weight_averaging"))
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    started = time.perf_counter()
    sizes = ("--steps", str(args.steps), "--batch-size", str(args.batch_size))
    results = {run: launch_worker(__file__, "--worker", run, *sizes) for run in RUNS}
    command = f"python benchmarks/weight_averaging.py --steps {args.steps} --batch-size {args.batch_size}"
    report = summarise(results, args)
    write_result(args.out, "weight_averaging", {"command": command, "results": results, "report": report})
    print(f"{report['notes'][0]} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
