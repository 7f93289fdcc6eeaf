"""A 2-rank run of the tiny GPT example that a test stops with real signals, kills, requeues and restarts.

    python tests/preemption_run.py --out DIR --steps 12 [--act ATTEMPT:RANK:STEP:ACTION ...] [--async-save]
        [--slow-save SECONDS] [--ckpt-path last] [--step-sleep SECONDS] [--marker-step K]

Under Lightning's launcher (``--devices 2``), torchrun, or one process per rank with the variables srun sets. No
``PreemptionCheckpoint`` is added: the strategy's own (``preemption=True``, the default) handles the signals;
``ModelCheckpoint(dirpath=DIR/ckpts, every_n_train_steps=--every,
save_last=True)`` saves periodically; validation runs every ``--val-every`` steps. Data: the GPT example's
``TokenDataModule``, which resumes mid-epoch. Rank 0 appends ``{"attempt", "step", "loss"}`` (the mean loss over
ranks of each optimizer step) to ``DIR/losses.jsonl``.

``--act A:R:S:ACTION``: in attempt ``A`` (torchrun's restart count, else 0) rank ``R`` acts after optimizer step
``S``: ``SIGTERM``/``SIGUSR1``/``SIGINT`` sends that signal to itself; ``val-SIGTERM`` (etc.) sends it at the first
validation batch after step ``S``; ``killsave`` SIGKILLs itself in the next save, once its own shard files are
written. ``--slow-save S``: every background save takes at least ``S`` seconds more (a slow disk), so that a stop
meets a save in flight. ``--marker-step K``: rank 0 creates ``DIR/reached_K`` after step ``K`` (for signals sent from
outside).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_run import _arm_kill_after_write  # noqa: E402
from toy import GlobalLossRecorder  # noqa: E402

from examples.gpt.data import TokenDataModule  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard import ShardedStrategy  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class Events(L.Callback):
    """Carries out the ``--act`` actions of this rank and attempt, and writes the loss and marker files."""

    def __init__(self, args: argparse.Namespace, losses: GlobalLossRecorder) -> None:
        self.args, self.losses = args, losses
        self.events: list[tuple[int, str]] = []
        self.pending_val: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for event in self.args.act:
            attempt, rank, step, action = event.split(":")
            if int(attempt) == ATTEMPT and int(rank) == trainer.global_rank:
                self.events.append((int(step), action))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if trainer.is_global_zero:
            with open(self.args.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": ATTEMPT, "step": step, "loss": self.losses.losses[-1]}) + "\n")
            if step == self.args.marker_step:
                (self.args.out / f"reached_{step}").touch()
        for when, action in self.events:
            if when != step:
                continue
            print(f"[rank {trainer.global_rank}] attempt {ATTEMPT} step {step}: {action}", flush=True)
            if action == "killsave":
                _arm_kill_after_write()
            elif action.startswith("val-"):
                self.pending_val.append(action.removeprefix("val-"))
            else:
                os.kill(os.getpid(), signal.Signals[action])
        time.sleep(self.args.step_sleep)

    def on_validation_batch_start(self, *args: Any) -> None:
        while self.pending_val:
            os.kill(os.getpid(), signal.Signals[self.pending_val.pop()])


def slow_background_saves(seconds: float) -> None:
    """Every ``dcp.async_save`` completes ``seconds`` after its files are written, like a save to a slow disk."""
    original = dcp.async_save

    def slow(*args: Any, **kwargs: Any) -> Future:
        written, delayed = original(*args, **kwargs), Future()

        def later(done: Future) -> None:
            time.sleep(seconds)
            error = done.exception()
            delayed.set_exception(error) if error else delayed.set_result(done.result())

        written.add_done_callback(later)
        return delayed

    dcp.async_save = slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="ModelCheckpoint every_n_train_steps")
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--act", action="append", default=[], help="ATTEMPT:RANK:STEP:ACTION")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--slow-save", type=float, default=0.0)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--marker-step", type=int, default=-1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.slow_save:
        slow_background_saves(args.slow_save)

    L.seed_everything(0, verbose=False)
    losses = GlobalLossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardedStrategy(async_save=args.async_save),
        max_steps=args.steps,
        val_check_interval=args.val_every,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[
            losses,
            Events(args, losses),
            ModelCheckpoint(dirpath=args.out / "ckpts", every_n_train_steps=args.every, save_last=True),
        ],
        default_root_dir=args.out,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPT(n_layer=2, n_head=2, n_embd=16, vocab_size=256, block_size=16, warmup_steps=2, max_steps=args.steps)
    # 8 optimizer steps per epoch, so the runs cross an epoch boundary and stop mid-epoch.
    data = TokenDataModule(block_size=16, batch_size=2, samples_per_epoch=32, val_samples=8, max_bytes=20_000)
    trainer.fit(model, data, ckpt_path=args.ckpt_path)
    print(f"[rank {trainer.global_rank}] attempt {ATTEMPT}: finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
