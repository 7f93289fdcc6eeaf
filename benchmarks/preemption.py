"""Preemption costs: how long a checkpoint blocks the step loop, synchronous against ``async_save=True``, and what the
stop agreement of ``PreemptionCheckpoint`` costs per step.

    python benchmarks/preemption.py                        # -> benchmarks/results/preemption.json
    python benchmarks/preemption.py --skip-stall           # the agreement only (no 355M model)

Stall (one launch, 2 CPU ranks, Lightning's launcher): GPT-3 medium dims (24 layers x 1024, vocab 50272; context 64
to keep the steps short: 354M parameters) + AdamW, FULL_SHARD, one sample of 64 tokens per rank and step. After
steps 2, 4 and 6 a synchronous sharded checkpoint; right after the one of step 6 a background one of the same state
(whose files must equal the synchronous one's: the check that the async path writes what it staged), then background
ones after steps 8, 10 and 12. Stall = the wall time of ``trainer.save_checkpoint`` on the slower rank: what the step
loop waits for (a background save also waits there for the one before it, if that is still writing). Also recorded:
each background save's write time (until its files are published) and the step times: the step after a background
save overlaps its writing, and on CPU ranks the writer thread competes with training for the same cores. Checkpoints
go to ``--dir`` (default: a temporary directory on the disk) and are deleted as the run goes.

Agreement (one launch per lag, 2 CPU ranks): the tiny GPT (2 layers x 64, context 64), 600 optimizer steps, the
callback's ``on_train_batch_end`` (the vote) switched on and off in alternating blocks of 10 steps in the same
processes (the machine's load affects both alike). Step time = rank 0's wall time from ``on_train_batch_start`` to the
end of ``on_train_batch_end``; the vote's own time = the callback's ``on_train_batch_end``. Run with the vote's
outcome read one step after it started (lag 1, what ``PreemptionCheckpoint`` uses) and two steps after (lag 2).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import barrier, launch_worker, machine, median, random_token_dataset, sharded_trainer  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

STALL_MODEL = dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50272, block_size=64, dropout=0.0, warmup_steps=1)
VOTE_MODEL = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64, dropout=0.0, warmup_steps=1)
SYNC_AFTER, ASYNC_AFTER = (2, 4, 6), (6, 8, 10, 12)
VOTE_STEPS, VOTE_BLOCK = 600, 10


def _stall_worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from examples.gpt.model import GPT

    class Saves(Callback):
        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []
            self.steps: list[dict[str, Any]] = []
            self.published_at: dict[str, float] = {}
            self.saved: list[Path] = []

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            self.step_start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            io, step = trainer.strategy.checkpoint_io, trainer.global_step
            self.steps.append({"step": step, "seconds": time.perf_counter() - self.step_start})
            kinds = (["sync"] if step in SYNC_AFTER else []) + (["async"] if step in ASYNC_AFTER else [])
            for kind in kinds:
                io.async_save = kind == "async"
                path = Path(args.dir) / f"step{step}-{kind}.ckpt"
                start = time.perf_counter()
                trainer.save_checkpoint(path, weights_only=False)
                self.records.append({"step": step, "kind": kind, "stall": time.perf_counter() - start,
                                     "path": path.name, "started": start})  # fmt: skip
                if kind == "async":
                    io._in_flight.published.add_done_callback(lambda _, name=path.name: self._published(name))
                self._delete_published(trainer)
                self.saved.append(path)

        def _published(self, name: str) -> None:
            self.published_at[name] = time.perf_counter()

        def _delete_published(self, trainer: L.Trainer) -> None:
            # Every earlier save is published by now (a background save waits for the one before it); the step-6
            # pair stays for the comparison.
            if trainer.is_global_zero:
                for path in self.saved:
                    if path.name not in ("step6-sync.ckpt", "step6-async.ckpt"):
                        shutil.rmtree(path, ignore_errors=True)

    L.seed_everything(1234, verbose=False)
    model = GPT(**STALL_MODEL, max_steps=max(ASYNC_AFTER))
    saves = Saves()
    trainer = sharded_trainer(args.devices, [saves], max_steps=max(ASYNC_AFTER))
    data = torch.utils.data.DataLoader(random_token_dataset(64, 64, STALL_MODEL["vocab_size"]), batch_size=1)
    trainer.fit(model, data)  # teardown waits for the last background save
    records = [dict(r, written=saves.published_at.get(r["path"], float("nan")) - r["started"]) for r in saves.records]
    gathered = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, {"records": records, "steps": saves.steps})
    barrier()
    if trainer.is_global_zero:
        pair = [Path(args.dir) / f"step6-{kind}.ckpt" for kind in ("sync", "async")]
        shard_files = sorted(p.name for p in pair[0].glob("*.distcp"))
        equal = shard_files == sorted(p.name for p in pair[1].glob("*.distcp")) and all(
            filecmp.cmp(pair[0] / name, pair[1] / name, shallow=False) for name in shard_files
        )
        size = sum(p.stat().st_size for p in pair[0].iterdir())
        num_params = sum(p.numel() for p in trainer.strategy.model.parameters())
        result = {"ranks": gathered, "equal": equal, "bytes": size, "num_params": num_params}
        Path(args.out).write_text(json.dumps(result))


def _vote_worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from examples.gpt.model import GPT
    from lightning_shard import PreemptionCheckpoint
    from lightning_shard.core.preemption import StopVote

    class TimedVote(PreemptionCheckpoint):
        """The callback, its vote switched on and off in blocks of steps, timing the steps and its own hook."""

        def __init__(self) -> None:
            super().__init__()
            self.requests.vote = StopVote(lag=args.lag)
            self.records: list[dict[str, Any]] = []

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            self.step_start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            on = (trainer.global_step - 1) // VOTE_BLOCK % 2 == 1
            start = time.perf_counter()
            if on:
                super().on_train_batch_end(trainer, *rest)
            end = time.perf_counter()
            self.records.append({"on": on, "step": end - self.step_start, "hook": end - start})

    L.seed_everything(1234, verbose=False)
    callback = TimedVote()
    trainer = sharded_trainer(args.devices, [callback], max_steps=VOTE_STEPS)
    # PreemptionCheckpoint wants a `last` checkpoint to write to outside SLURM; nothing is saved here.
    trainer.callbacks.append(ModelCheckpoint(dirpath=args.dir, save_last=True, every_n_train_steps=10**9))
    data = torch.utils.data.DataLoader(random_token_dataset(VOTE_STEPS * 2, 64, 256), batch_size=1)
    trainer.fit(GPT(**VOTE_MODEL, max_steps=VOTE_STEPS), data)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"records": callback.records}))


def _summarise(stall: dict[str, Any] | None, votes: dict[int, dict[str, Any]]) -> dict[str, Any]:
    rows, notes = [], []
    if stall is not None:
        ranks = [rank["records"] for rank in stall["ranks"]]
        saves = [
            {**records[0], "stall": max(r["stall"] for r in records), "written": max(r["written"] for r in records)}
            for records in zip(*ranks, strict=True)
        ]
        sync = [s for s in saves if s["kind"] == "sync"]
        background = [s for s in saves if s["kind"] == "async"]
        sync_stall = median([s["stall"] for s in sync])
        for save in saves:
            what = f"after step {save['step']}: {'synchronous' if save['kind'] == 'sync' else 'async_save'}"
            if save is background[0]:
                what += " (first: allocates the staging buffers)"
            against = f"synchronous median {sync_stall:.2f} s"
            written = f", written in {save['written']:.2f} s" if save["kind"] == "async" else ""
            rows.append([what, f"stall {save['stall']:.2f} s{written}", against, f"{save['stall'] / sync_stall:.3f}"])
        steady = median([s["stall"] for s in background[1:]])
        ratio = steady / sync_stall
        rows.append(["async_save stall, median after the first", f"{steady:.2f} s", against, f"{ratio:.3f}"])
        steps = stall["ranks"][0]["steps"]
        # The step after a background save runs while it writes (each took less than that step).
        after_async = {save["step"] + 1 for save in background}
        plain = median([s["seconds"] for s in steps[1:] if s["step"] not in after_async])
        overlapped = [f"{s['seconds']:.1f} (step {s['step']})" for s in steps if s["step"] in after_async]
        notes += [
            f"GPT {stall['num_params']:,} parameters + AdamW (fp32) on 2 CPU ranks, FULL_SHARD: each checkpoint "
            f"{stall['bytes'] / 1e9:.2f} GB (torch.distributed.checkpoint, files fsynced).",
            f"Target: the async_save stall at most a quarter of the synchronous save's: "
            f"**{'met' if ratio <= 0.25 else 'not met'}** ({ratio:.3f} after the first; the first, which allocates "
            f"the staging buffers, {background[0]['stall'] / sync_stall:.3f}).",
            "The background save of step 6 wrote the same shard files, byte for byte, as the synchronous save of "
            f"the same state: {'yes' if stall['equal'] else 'NO'}.",
            f"Step times (rank 0): the steps right after a background save, which ran while it wrote: "
            f"{', '.join(overlapped)} s; the other steps after the first: median {plain:.1f} s. On CPU ranks the "
            "writer shares the cores with training, so much of the time a save no longer blocks comes back as "
            "slower steps; on GPUs training runs on the device while the CPU writes.",
        ]
    for lag, result in votes.items():
        rows += _vote_rows(result["records"], lag)
    notes.append(
        f"Stop agreement: tiny GPT ({VOTE_MODEL['n_layer']} layers x {VOTE_MODEL['n_embd']}), {VOTE_STEPS} steps, the "
        f"vote on and off in alternating blocks of {VOTE_BLOCK} in the same 2 processes (the first two blocks "
        "dropped); step times are medians of the blocks' medians. The vote: one all-reduce (max) of 2 int32 per "
        "rank on a gloo group of its own, started without waiting at each optimizer step; its outcome is read "
        "`lag` steps later (PreemptionCheckpoint uses 1). The vote's own time is starting the all-reduce and reading "
        "the outcome (waiting if it is unfinished). On a shared machine whose 2 cores are busy with other jobs, the "
        "p90 and max include waits for a core, and block-to-block noise exceeds the differences."
    )
    return {
        "title": "Preemption: checkpoint stalls (synchronous vs async_save) and the stop agreement's cost",
        "question": "How long does a checkpoint block the step loop with async_save=True against a synchronous save "
        "(target: a quarter at most), and does agreeing on a stop at every optimizer step show in the step time?",
        "columns": ["measure", "value", "against", "ratio"],
        "rows": rows,
        "notes": notes,
    }


def _vote_rows(records: list[dict[str, Any]], lag: int) -> list[list[str]]:
    records = records[2 * VOTE_BLOCK :]  # the first two blocks include warm-up
    on = [r for r in records if r["on"]]
    blocks = [records[i : i + VOTE_BLOCK] for i in range(0, len(records), VOTE_BLOCK)]
    block_medians = {flag: [median([r["step"] for r in b]) for b in blocks if b[0]["on"] == flag] for flag in (1, 0)}
    step_on, step_off = median(block_medians[1]), median(block_medians[0])
    # Each block with the vote against the block without it just before it: the load drifts more slowly than that.
    paired = median([with_ - without for without, with_ in zip(block_medians[0], block_medians[1], strict=False)])
    hooks = sorted(r["hook"] for r in on)
    hook, hook_p90 = median(hooks), hooks[int(0.9 * len(hooks))]
    return [
        [f"stop agreement, lag {lag}: step time with the vote", f"{step_on * 1e3:.2f} ms",
         f"without {step_off * 1e3:.2f} ms", f"{step_on / step_off:.3f}"],
        [f"stop agreement, lag {lag}: a block with the vote - the block before it without (median)",
         f"{paired * 1e3:+.2f} ms", f"step {step_off * 1e3:.2f} ms", f"{paired / step_off:+.3f}"],
        [f"stop agreement, lag {lag}: the vote's own time per step, median (p90, max)",
         f"{hook * 1e6:.0f} us ({hook_p90 * 1e6:.0f}, {hooks[-1] * 1e6:.0f})", f"step {step_on * 1e3:.2f} ms",
         f"{hook / step_on:.4f}"],
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["stall", "vote"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--lag", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--skip-stall", action="store_true", help="only the agreement's cost")
    parser.add_argument("--output", default=str(result_path("preemption")))
    args = parser.parse_args()
    if args.worker:
        {"stall": _stall_worker, "vote": _vote_worker}[args.worker](args)
        return

    machine_start, start = machine(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="preempt-bench-", dir=args.dir) as tmp:
        common = ["--dir", tmp, "--devices", str(args.devices)]
        votes = {lag: launch_worker(__file__, "--worker", "vote", "--lag", str(lag), *common) for lag in (1, 2)}
        stall = None if args.skip_stall else launch_worker(__file__, "--worker", "stall", *common)
    report = _summarise(stall, votes)
    for row in report["rows"]:
        print(" | ".join(row))
    write_result(
        Path(args.output),
        "preemption",
        {
            "benchmark": "preemption",
            "machine_start": machine_start,
            "wall_seconds": time.perf_counter() - start,
            "stall_model": STALL_MODEL,
            "vote_model": VOTE_MODEL,
            "stall": stall,
            "votes": votes,
            "report": report,
        },
    )


if __name__ == "__main__":
    main()
