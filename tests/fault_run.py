"""Fault scenarios for the reliability tests, run as real 2-process jobs.

    python tests/fault_run.py raise --where fit|validate|save --rank R --out DIR   (or under torchrun)
    python tests/fault_run.py killsave --out DIR        rank 1 SIGKILLs itself while writing its shard
    torchrun --nproc_per_node 2 tests/fault_run.py integrity --out DIR

``raise`` / ``killsave`` save ``last.ckpt`` (and a top-1 file) every 2 steps of 4; the fault hits the step-4 save.
``integrity`` saves a sharded and a full checkpoint, damages copies of them, loads each into a model through
``trainer.fit(ckpt_path=...)`` in the same processes and writes ``integrity_rank{R}.json``: per case, the
error each rank raised and how long it took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import WIDTH, ToyModel, rank_slice_loader  # noqa: E402

from lightning_shard import ShardedCheckpointIO, ShardedStrategy  # noqa: E402

GLOBAL_BATCH = 8
# Short enough that a regression (a rank left waiting in a collective) fails the run instead of hanging it.
PG_TIMEOUT = timedelta(seconds=60)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class FaultyModel(ToyModel):
    """Raises in ``training_step`` / ``validation_step`` on one rank."""

    def __init__(self, where: str = "", fail_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where, self.fail_rank = where, fail_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.where == "fit" and self.global_rank == self.fail_rank and batch_idx == 1:
            raise RuntimeError(f"injected failure in training_step on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.where == "validate" and self.global_rank == self.fail_rank and batch_idx == 1:
            raise RuntimeError(f"injected failure in validation_step on rank {self.global_rank}")
        return super().validation_step(batch, batch_idx)


class FailingCheckpointIO(ShardedCheckpointIO):
    """From the ``fail_from``-th save on, rank ``fail_rank`` raises (``mode="raise"``) or arms a SIGKILL that fires
    once its shard files are written, before the save's metadata and rename (``mode="kill"``)."""

    def __init__(self, mode: str, fail_rank: int = 1, fail_from: int = 3) -> None:
        super().__init__()
        self.mode, self.fail_rank, self.fail_from, self.calls = mode, fail_rank, fail_from, 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.calls += 1
        if self.calls >= self.fail_from and _rank() == self.fail_rank:
            print(f"[rank {_rank()}] fault: {self.mode} in save #{self.calls} of {path}", flush=True)
            if self.mode == "raise":
                raise RuntimeError(f"injected failure in save_checkpoint on rank {_rank()}")
            _arm_kill_after_write()
        super().save_checkpoint(checkpoint, path, storage_options)


def _arm_kill_after_write() -> None:
    original = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        future = original(self, *args, **kwargs)
        future.wait()  # this rank's shard file is complete on disk
        print(f"[rank {_rank()}] SIGKILL after writing shards into {self.path}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die


def trainer_for(out: Path, steps: int, checkpoint_io: ShardedCheckpointIO | None = None, **strategy: Any) -> L.Trainer:
    saver = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_last=True, save_top_k=1,
                            monitor="step", mode="max")  # fmt: skip
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardedStrategy(timeout=PG_TIMEOUT, checkpoint_io=checkpoint_io, **strategy),
        max_steps=steps,
        callbacks=[saver],
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def run_fault(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    loader = rank_slice_loader(GLOBAL_BATCH)
    if args.mode == "killsave":
        trainer = trainer_for(args.out, 4, FailingCheckpointIO("kill"))
        trainer.fit(ToyModel(), train_dataloaders=loader)
    elif args.where == "save":
        trainer = trainer_for(args.out, 4, FailingCheckpointIO("raise", fail_rank=args.rank))
        trainer.fit(ToyModel(), train_dataloaders=loader)
    elif args.where == "fit":
        trainer_for(args.out, 4).fit(FaultyModel("fit", args.rank), train_dataloaders=loader)
    else:
        trainer_for(args.out, 4).validate(FaultyModel("validate", args.rank), dataloaders=loader)
    print(f"[rank {_rank()}] finished without the injected fault", flush=True)


# ------------------------------------------------------------------ integrity (one torchrun job, many loads)


class ManyBlocks(ToyModel):
    def __init__(self) -> None:
        super().__init__(n_blocks=4)


class FewBlocks(ToyModel):
    def __init__(self) -> None:
        super().__init__(n_blocks=2)


class WideHead(ToyModel):
    def _build(self) -> None:
        super()._build()
        self.head = nn.Linear(WIDTH, 2)


def _damage(good_sharded: Path, good_full: Path, out: Path) -> dict[str, Path]:
    """Copies of the good checkpoints, each with one kind of damage (rank 0 writes them)."""
    cases = {}

    def copy(name: str, source: Path) -> Path:
        target = out / "damaged" / name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
        cases[name] = target
        return target

    shard = copy("sharded_truncated_shard", good_sharded) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (copy("sharded_missing_shard", good_sharded) / "__1_0.distcp").unlink()
    metadata = copy("sharded_damaged_metadata", good_sharded) / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 3])
    (copy("sharded_without_metadata", good_sharded) / ".metadata").unlink()
    full = copy("full_truncated", good_full)
    full.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    return cases


def run_integrity(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    out = args.out
    trainer = trainer_for(out / "sharded", 2)
    trainer.fit(ToyModel(), train_dataloaders=rank_slice_loader(GLOBAL_BATCH))
    good_sharded = out / "good_sharded.ckpt"
    trainer.save_checkpoint(good_sharded)
    trainer = trainer_for(out / "full", 2, state_dict_type="full")
    trainer.fit(ToyModel(), train_dataloaders=rank_slice_loader(GLOBAL_BATCH))
    good_full = out / "good_full.ckpt"
    trainer.save_checkpoint(good_full)
    damaged = _damage(good_sharded, good_full, out) if dist.get_rank() == 0 else {}
    holder = [damaged]
    dist.broadcast_object_list(holder, src=0)
    damaged = holder[0]

    cases: list[tuple[str, type[ToyModel], Path]] = [
        ("sharded_intact", ToyModel, good_sharded),
        ("full_intact", ToyModel, good_full),
        *((name, ToyModel, path) for name, path in damaged.items()),
        ("sharded_missing_keys", ManyBlocks, good_sharded),
        ("sharded_unexpected_keys", FewBlocks, good_sharded),
        ("sharded_misshaped_key", WideHead, good_sharded),
        ("full_missing_keys", ManyBlocks, good_full),
        ("full_unexpected_keys", FewBlocks, good_full),
        ("full_misshaped_key", WideHead, good_full),
        ("missing_path", ToyModel, out / "no_such.ckpt"),
    ]
    if args.only:
        cases = [case for case in cases if case[0] in args.only]
    results: dict[str, dict[str, Any]] = {}
    for name, model_class, path in cases:
        dist.barrier()
        L.seed_everything(0, verbose=False)
        start = time.monotonic()
        try:
            trainer_for(out / "resume" / name, 3).fit(
                model_class(), train_dataloaders=rank_slice_loader(GLOBAL_BATCH), ckpt_path=path
            )
            error = None
        except Exception as caught:  # noqa: BLE001 - the error is the result
            error = f"{type(caught).__name__}: {caught}"
        results[name] = {"error": error, "seconds": round(time.monotonic() - start, 2)}
        print(f"[rank {dist.get_rank()}] {name}: {results[name]}", flush=True)
    (out / f"integrity_rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["raise", "killsave", "integrity"])
    parser.add_argument("--where", choices=["fit", "validate", "save"], default="fit")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="integrity: run only these cases")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "integrity":
        run_integrity(args)
    else:
        run_fault(args)


if __name__ == "__main__":
    main()
