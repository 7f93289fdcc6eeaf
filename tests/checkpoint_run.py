"""Checkpoint scenarios for the toy model, run as real processes (Lightning's launcher starts the other ranks).

    python tests/checkpoint_run.py train  --devices 2 --out DIR --steps 4 [--format sharded|full] [--reference]
    python tests/checkpoint_run.py resume --devices N --out DIR --ckpt PATH --steps 8 [--reference]
    python tests/checkpoint_run.py topk   --devices 2 --out DIR

Each writes ``result.pt`` on rank 0: per-step global losses and the full weights and optimizer state (gathered
with torch.distributed.checkpoint's state-dict API) at the start and the end of training, and the scheduler's and
callback's state at the end.

The model carries the Lightning state that flattening checkpoints loses: an LR scheduler whose lambda is a
``functools.partial`` (``LambdaLR`` saves it as ``{}``) and a callback whose state holds an empty list.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import GlobalLossRecorder, StateRecorder, ToyModel, rank_slice_loader  # noqa: E402

import lightning_shard  # noqa: E402

GLOBAL_BATCH = 8


def decay(step: int, rate: float) -> float:
    return rate**step


class ScheduledToyModel(ToyModel):
    """``ToyModel`` with a per-step ``LambdaLR`` whose lambda is a ``functools.partial``."""

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(decay, rate=0.9))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepCounter(L.Callback):
    """A callback with state: batches seen, and a list that stays empty."""

    def __init__(self) -> None:
        self.batches, self.notes = 0, []

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "notes": list(self.notes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches, self.notes = state_dict["batches"], state_dict["notes"]


def make_trainer(args: argparse.Namespace, callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    strategy = (
        "auto"
        if args.reference
        else lightning_shard.ShardedStrategy(state_dict_type=args.format, async_save=args.async_save)
    )
    return L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "resume", "topk"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--format", choices=["sharded", "full"], default="sharded")
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--reference", action="store_true", help="Lightning's single-device strategy")
    parser.add_argument("--async-save", action="store_true", help="DCP async_save for sharded checkpoints")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, verbose=False)
    model = ScheduledToyModel()
    losses, states, counter = GlobalLossRecorder(), StateRecorder(), StepCounter()
    if args.mode == "topk":
        saver = ModelCheckpoint(
            dirpath=args.out / "ckpts", monitor="step", mode="max", save_top_k=2, every_n_train_steps=1, save_last=True
        )
        trainer = make_trainer(args, [losses, states, counter, saver], enable_checkpointing=True)
    else:
        trainer = make_trainer(args, [losses, states, counter], enable_checkpointing=False)
    if args.ckpt is not None and args.ckpt.is_file() and not args.reference:
        _forbid_reading_checkpoints_off_rank_zero()
    trainer.fit(model, train_dataloaders=rank_slice_loader(GLOBAL_BATCH), ckpt_path=args.ckpt)
    if args.mode == "train":
        trainer.save_checkpoint(args.out / "model.ckpt")
        trainer.save_checkpoint(args.out / "weights.ckpt", weights_only=True)
    if trainer.is_global_zero:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        lightning_state = {
            "scheduler": scheduler.state_dict(),
            "lr": scheduler.get_last_lr(),
            "callback": counter.state_dict(),
        }
        torch.save({"losses": losses.losses, **states.states, **lightning_state}, args.out / "result.pt")


def _forbid_reading_checkpoints_off_rank_zero() -> None:
    """A full checkpoint is read by rank 0 and broadcast; make any other rank's read fail the run."""
    load = torch.load

    def guarded_load(source: Any, *args: Any, **kwargs: Any) -> Any:
        # In-memory loads (broadcast_object_list unpickles through torch.load) are fine; files are not.
        if isinstance(source, (str, os.PathLike)) and dist.is_initialized() and dist.get_rank() != 0:
            raise AssertionError(f"rank {dist.get_rank()} read a checkpoint file")
        return load(source, *args, **kwargs)

    torch.load = guarded_load


if __name__ == "__main__":
    main()
