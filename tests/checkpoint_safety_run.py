"""What checkpoint saves may replace, loads right after background saves, and ranks that see a path differently, on
2 ranks under torchrun (the Trainer and Fabric in the same processes, sharing the process group).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/checkpoint_safety_run.py --out DIR

Prints ``RESULT <json>`` on rank 0: per scenario, what each rank saw. Rank 0's publish of a background save is
slowed by ``SLOW_PUBLISH`` seconds where a scenario needs a save still in flight (a slow filesystem), so that a load,
a link or the other rank that does not wait for it sees the previous checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import FULL, QUIET, ToyModel, outcome, rank_slice_loader  # noqa: E402

import lightning_shard  # noqa: E402
import lightning_shard.checkpoint.async_save as async_save  # noqa: E402
from lightning_shard.checkpoint import convert  # noqa: E402
from lightning_shard.fabric import ShardedStrategy as FabricStrategy  # noqa: E402

SLOW_PUBLISH = 0.5


def user_folder(path: Path) -> list[str]:
    (path / "sub").mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("notes")
    (path / "sub" / "data.txt").write_text("data")
    return files_in(path)


def files_in(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.is_dir() else []


@contextlib.contextmanager
def slow_publish() -> Iterator[None]:
    """Rank 0 publishes a save ``SLOW_PUBLISH`` seconds late."""
    original = async_save.publish

    def late(*args: Any, **kwargs: Any) -> None:
        time.sleep(SLOW_PUBLISH)
        original(*args, **kwargs)

    async_save.publish = late if dist.get_rank() == 0 else original
    try:
        yield
    finally:
        async_save.publish = original


def trainer(out: Path, steps: int, callbacks: list[Any], **strategy: Any) -> L.Trainer:
    settings = {**QUIET, "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks)}
    return L.Trainer(accelerator="cpu", devices=2, strategy=lightning_shard.ShardedStrategy(**strategy),
                     max_steps=steps, default_root_dir=out, callbacks=list(callbacks), **settings)  # fmt: skip


def fit(
    out: Path, steps: int, callbacks: list[Any] | None = None, ckpt_path: Path | None = None, **strategy: Any
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    run = trainer(out, steps, callbacks or [], **strategy)
    run.fit(ToyModel(), train_dataloaders=rank_slice_loader(8), ckpt_path=ckpt_path)
    return run


# ------------------------------------------------------------------ scenarios


def trainer_saves_into_a_results_folder(out: Path) -> dict[str, Any]:
    """``trainer.save_checkpoint("runs")`` where ``runs`` holds the user's files: sharded and full."""
    found = {}
    for kind in ("sharded", "full"):
        run = fit(out / f"trainer-{kind}", 1, state_dict_type=kind)
        results = out / f"results-trainer-{kind}"
        before = user_folder(results) if dist.get_rank() == 0 else None
        dist.barrier()
        error = outcome(run.save_checkpoint, results)
        found[kind] = {"error": error, "kept": files_in(results) == before if dist.get_rank() == 0 else None}
    return found


def fabric_saves_into_a_results_folder(out: Path) -> dict[str, Any]:
    found = {}
    for kind in ("sharded", "full"):
        fabric, model, optimizer = fabric_run(state_dict_type=kind)
        results = out / f"results-fabric-{kind}"
        before = user_folder(results) if dist.get_rank() == 0 else None
        dist.barrier()
        state = {"model": model, "optimizer": optimizer, "step": 1}
        error = outcome(fabric.save, results, state)
        found[kind] = {"error": error, "kept": files_in(results) == before if dist.get_rank() == 0 else None}
    return found


def fabric_run(**strategy: Any) -> tuple[L.Fabric, Any, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(**strategy))
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    return fabric, *fabric_model(fabric)


def fabric_model(fabric: L.Fabric) -> tuple[Any, Any]:
    model = ToyModel()
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def train_step(fabric: L.Fabric, model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    x, y = next(iter(rank_slice_loader(8)))
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    return {k: v.clone() for k, v in get_model_state_dict(model.module, options=FULL).items()}


def fabric_loads_right_after_a_background_save(out: Path) -> dict[str, Any]:
    """Save step 1, then step 2 to the same path in the background and at once ``load`` it into a fresh model; then
    save step 3 and read what is on disk once ``wait()`` returns on each rank; then save step 4 and at once
    ``convert`` it (each rank its own copy). Each must find the step just saved."""
    fabric, model, optimizer = fabric_run(async_save=True)
    fresh, fresh_optimizer = fabric_model(fabric)
    path = out / "fabric-async.ckpt"
    train_step(fabric, model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    step_two = train_step(fabric, model, optimizer)
    with slow_publish():
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        fabric.load(path, state)
        loaded = get_model_state_dict(fresh.module, options=FULL)
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
        fabric.strategy.checkpoint_io.wait()
        after_wait = step_on_disk(path)
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 4})
        converted = out / f"rank{dist.get_rank()}" / "fabric-async-full.ckpt"
        convert(path, converted)
    return {
        "loaded_step": state["step"],
        "loaded_weights_vs_step_2": max(((loaded[k] - step_two[k]).abs().max().item() for k in step_two), default=0.0),
        "after_wait": after_wait,
        "converted_step": torch.load(converted, weights_only=False)["step"],
    }


def step_on_disk(path: Path) -> int:
    """The ``step`` entry of the sharded checkpoint at ``path``, read by this process alone (no collective)."""
    found = {"step": 0}
    dcp.load(found, checkpoint_id=path, no_dist=True)
    return found["step"]


class StartStep(L.Callback):
    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.step = trainer.global_step


def trainer_resumes_right_after_a_background_save(out: Path) -> dict[str, Any]:
    """A checkpoint of step 1, then one of step 2 to the same path in the background (``trainer.save_checkpoint``
    after ``fit``); at once a new Trainer's ``fit(ckpt_path=...)`` must resume from step 2."""
    path = out / "trainer-async.ckpt"
    fit(out / "trainer-async", 1, async_save=True).save_checkpoint(path)  # published when that fit's IO is done
    second = fit(out / "trainer-async", 2, ckpt_path=path, async_save=True)
    start = StartStep()
    with slow_publish():
        second.save_checkpoint(path)
        fit(out / "trainer-async", 3, [start], ckpt_path=path)
    return {"saved_step": second.global_step, "resumed_from": start.step}


class LinkWatcher(L.Callback):
    """At the start of every step (after the previous step's ModelCheckpoint linked `last.ckpt`), rank 0 records
    whether `last.ckpt` exists and, if it does, whether what it points at is a published checkpoint."""

    def __init__(self, last: Path) -> None:
        self.last, self.seen = last, []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and os.path.lexists(self.last):
            self.seen.append((self.last.is_symlink(), (self.last / ".metadata").is_file()))


def last_link_under_background_saves(out: Path) -> dict[str, Any]:
    ckpts = out / "link-ckpts"
    watcher = LinkWatcher(ckpts / "last.ckpt")
    saver = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=-1, save_last="link")
    with slow_publish():
        fit(out / "link", 4, [watcher, saver], async_save=True)
    return {"seen": watcher.seen, "last": os.readlink(ckpts / "last.ckpt") if dist.get_rank() == 0 else None}


def ranks_that_see_the_path_differently(out: Path) -> dict[str, Any]:
    """Rank 1's filesystem view is stale (a network filesystem's attribute cache just after a rename): the sharded
    directory looks like a file to it. The load must follow rank 0's view on both ranks."""
    fabric, model, optimizer = fabric_run()
    path = out / "stale-view.ckpt"
    saved = train_step(fabric, model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fresh = fabric.setup(ToyModel())
    views = {"is_dir": False, "is_file": True, "exists": True}
    originals = {name: getattr(Path, name) for name in views}
    if dist.get_rank() == 1:
        for name, seen in views.items():
            setattr(Path, name, lambda self, name=name, seen=seen: seen if self == path else originals[name](self))
    try:
        error = outcome(fabric.load, path, {"model": fresh}, strict=False)
    finally:
        for name, method in originals.items():
            setattr(Path, name, method)
    loaded = get_model_state_dict(fresh.module, options=FULL)
    # whole weights on rank 0, none on rank 1
    return {"error": error, "difference": max(((loaded[k] - saved[k]).abs().max().item() for k in saved), default=0.0)}


SCENARIOS = [
    trainer_saves_into_a_results_folder,
    fabric_saves_into_a_results_folder,
    fabric_loads_right_after_a_background_save,
    trainer_resumes_right_after_a_background_save,
    last_link_under_background_saves,
    ranks_that_see_the_path_differently,
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="scenario names (default: all)")
    args = parser.parse_args()
    results = {}
    for scenario in SCENARIOS:
        if not args.only or scenario.__name__ in args.only:
            results[scenario.__name__] = scenario(args.out)
    report(results)


def report(results: dict[str, Any]) -> None:
    """Print every rank's ``results`` on rank 0 as ``RESULT <json>`` (call on every rank)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)


if __name__ == "__main__":
    main()
