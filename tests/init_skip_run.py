"""What materialisation computes when a checkpoint load follows setup (:mod:`lightning_shard.init.init_skip`); one
launch.

    python tests/init_skip_run.py --devices 2 --out DIR

Scenarios (results in ``DIR/result.pt`` on rank 0):

* ``straight``: 8 steps from a fresh start, a sharded checkpoint at step 4 (and a full one written from it).
* ``resume`` / ``resume_full``: a new Trainer resumes from the step-3 checkpoint (sharded / one file) to step 6: the
  replay draws nothing and runs no op; the final weights equal ``straight``'s.
* ``resume_last``: ``fit(ckpt_path="last")``, as a requeued job relaunches: Lightning selects ``straight``'s last
  checkpoint, which the strategy learns before setup; nothing replayed.
* ``partial``: the same with a new head the checkpoint lacks (``strict_loading=False``): only what that head needs is
  replayed, and it equals the eager build's head; the draws before it are jumped over, not drawn.
* every fresh start splits the replay between the ranks (``drawn_by_rank``: together they draw what the eager build
  draws, each a share).
* ``unwritten``: a load that leaves a tensor unwritten (simulated): the check after the load names it.
* ``fabric`` / ``fabric_resume``: the same with Fabric: ``fabric.load`` right after ``fabric.setup``.

Every scenario also records whether the user's ``AdamW(params, lr=...)`` steps fused (``fused_optimizer``).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy import FULL, QUIET, outcome, rank_slice_loader  # noqa: E402

import lightning_shard  # noqa: E402
import lightning_shard.fabric  # noqa: E402
import lightning_shard.init.chunk_fills as chunk_fills  # noqa: E402
import lightning_shard.init.materialize as materialize  # noqa: E402
import lightning_shard.init.replay as replay  # noqa: E402
from lightning_shard.checkpoint.io import ShardedCheckpointIO  # noqa: E402
from lightning_shard.init.unset import fill_unset  # noqa: E402

WIDTH, GLOBAL_BATCH, STEPS, SAVE_AT = 16, 16, 8, 4  # 4 batches an epoch: saved at an epoch's end


class Net(L.LightningModule):
    """Input layer -> 2 blocks -> output layer tied to the input layer's weight, a rotary-style buffer and a random
    one; ``new_head``: one more layer the checkpoint lacks, and a non-persistent buffer."""

    def __init__(self, new_head: bool = False) -> None:
        super().__init__()
        self.new_head = new_head
        self.strict_loading = not new_head

    def configure_model(self) -> None:
        if hasattr(self, "inp"):
            return
        self.inp = nn.Linear(WIDTH, WIDTH, bias=False)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(2)])
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out.weight = self.inp.weight
        self.register_buffer("freq", 1.0 / (100 ** (torch.arange(0, WIDTH, 2).float() / WIDTH)))
        self.register_buffer("noise", torch.randn(WIDTH) * 0.01)
        if self.new_head:
            self.head = nn.Linear(WIDTH, 1)
            self.register_buffer("position", torch.arange(WIDTH).float() / WIDTH, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(nn.functional.pad(x, (0, WIDTH - x.shape[-1]))) + self.noise
        h = self.blocks(h) * self.freq.repeat(2)
        h = self.out(h)
        return (self.head(h * self.position) if self.new_head else h).sum(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Counted(TorchDispatchMode):
    """Counts the elements that random ops draw while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # floating point: a jump over draws moves the generator with integer draws of its own
        if torch.Tag.nondeterministic_seeded in func.tags and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.drawn += out.numel()
        return out


COUNTS = {"drawn": 0, "replayed": 0, "sentinel": 0}


def _count_materialisation() -> None:
    """Count, in every materialisation, the elements drawn, the recorded ops the replay runs and the elements given
    the sentinel at allocation."""
    initialize, run, drawn = materialize._initialize, replay.Replay.run, chunk_fills._drawn
    fill_unset = materialize.fill_unset
    for fill in (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default):
        chunk_fills._ranges_hold(fill, torch.float32)  # checked once per process, now: its draws are not the model's

    def counted_initialize(*args: Any, **kwargs: Any) -> None:
        with Counted() as counted:
            initialize(*args, **kwargs)
        COUNTS["drawn"] += counted.drawn

    def counted_run(self: replay.Replay, op: Any) -> None:
        if isinstance(op, replay.Overwrite) or op.seq in self.needed or (op.random and self.draws(op)):
            COUNTS["replayed"] += 1
        run(self, op)

    def counted_drawn(*args: Any) -> torch.Tensor:  # a rank's chunk of a weight filled in place (no dispatch mode)
        out = drawn(*args)
        COUNTS["drawn"] += out.numel()
        return out

    def counted_fill(tensor: torch.Tensor) -> torch.Tensor:
        COUNTS["sentinel"] += tensor.numel()
        return fill_unset(tensor)

    materialize._initialize = counted_initialize
    materialize.fill_unset = counted_fill
    replay.Replay.run = counted_run
    chunk_fills._drawn = counted_drawn


class HeadAtStart(Callback):
    """The new head's whole weight when training starts (after the restore)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weight = pl_module.head.weight
        self.weight = (weight.full_tensor() if isinstance(weight, DTensor) else weight).detach().clone()


def fit(out: Path, steps: int, ckpt_path: Any = None, new_head: bool = False, **extra: Any) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    COUNTS.update(drawn=0, replayed=0, sentinel=0)
    head = HeadAtStart()
    saver = ModelCheckpoint(dirpath=out, every_n_train_steps=SAVE_AT, save_top_k=-1, filename="{step}", save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=extra.pop("devices"),
        strategy="fully_sharded",
        max_steps=steps,
        callbacks=[saver, head] if new_head else [saver],
        **{**QUIET, "enable_checkpointing": True},
    )
    model = Net(new_head=new_head)
    trainer.fit(model, train_dataloaders=rank_slice_loader(GLOBAL_BATCH), ckpt_path=ckpt_path)
    result = {"weights": get_model_state_dict(model, options=FULL), **COUNTS}
    result["local_tensors"] = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    result["drawn_by_rank"] = [None] * dist.get_world_size()
    dist.all_gather_object(result["drawn_by_rank"], COUNTS["drawn"])
    result["fused"] = trainer.optimizers[0].param_groups[0]["fused"]  # the user wrote `AdamW(params, lr=0.01)`
    if new_head:
        result["head"] = head.weight
    return result


def eager_head() -> torch.Tensor:
    """The head of the eager one-process build with the same seed."""
    L.seed_everything(0, verbose=False)
    model = Net(new_head=True)
    model.configure_model()
    return model.head.weight.detach().clone()


def eager_drawn(new_head: bool) -> int:
    """The elements the eager one-process build draws."""
    with Counted() as counted:
        Net(new_head=new_head).configure_model()
    return counted.drawn


def unwritten(out: Path, devices: int, ckpt: Path) -> str:
    load_into = ShardedCheckpointIO.load_into

    def load_missing_one(self: ShardedCheckpointIO, path: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = load_into(self, path, model, *args, **kwargs)
        weight = model.blocks[1][1].weight
        with torch.no_grad():  # as if the load missed it
            fill_unset(weight.to_local() if isinstance(weight, DTensor) else weight)
        return result

    ShardedCheckpointIO.load_into = load_missing_one
    try:
        fit(out, STEPS, ckpt, devices=devices)
    except RuntimeError as error:
        return str(error)
    finally:
        ShardedCheckpointIO.load_into = load_into
    return "no error"


def fabric_run(fabric: L.Fabric, checkpoint: Path, resume: bool, told: bool = False) -> dict[str, Any]:
    """Fabric: ``STEPS`` steps saving at ``SAVE_AT``, or a fresh model and optimizer that ``fabric.load`` the
    checkpoint right after setup and train on to ``STEPS`` (``told``: setup inside ``checkpoint_follows``)."""
    L.seed_everything(0, verbose=False)
    COUNTS.update(drawn=0, replayed=0, sentinel=0)
    model = Net()
    with fabric.init_module(empty_init=True):
        model.configure_model()
    with fabric.strategy.checkpoint_follows(checkpoint) if told else nullcontext():
        model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(checkpoint, state)
    for step in range(state["step"], STEPS):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
        fabric.backward(nn.functional.mse_loss(model(x), x.sum(-1)))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if state["step"] == SAVE_AT and not resume:
            fabric.save(checkpoint, state)
    fused = optimizer.param_groups[0]["fused"]
    local_tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    weights = get_model_state_dict(model, options=FULL)
    return {"weights": weights, "fused": fused, "local_tensors": local_tensors, **COUNTS}


def fabric_unloaded(fabric: L.Fabric, checkpoint: Path) -> dict[str, str]:
    """``checkpoint_follows`` without the load: what a forward and a save say; then what the load lets run."""
    model = Net()
    with fabric.init_module(empty_init=True):
        model.configure_model()
    with fabric.strategy.checkpoint_follows(checkpoint):
        model = fabric.setup(model)
    x = torch.randn(4, WIDTH)
    seen = {
        "forward": outcome(lambda: model(x)),
        "save": outcome(lambda: fabric.save(checkpoint.with_name("early.ckpt"), {"model": model})),
    }
    fabric.load(checkpoint, {"model": model}, strict=False)
    return {**seen, "forward_after_load": outcome(lambda: model(x))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    _count_materialisation()
    results: dict[str, Any] = {}
    results["straight"] = fit(args.out / "straight", STEPS, devices=args.devices)
    ckpt = args.out / "straight" / f"step={SAVE_AT}.ckpt"
    full = args.out / "full.ckpt"
    if dist.get_rank() == 0:
        dcp_to_torch_save(ckpt, full)
    dist.barrier()
    results["resume"] = fit(args.out / "resume", STEPS, ckpt, devices=args.devices)
    results["resume_full"] = fit(args.out / "resume_full", STEPS, full, devices=args.devices)
    # what `ckpt_path="last"` (a requeued job's relaunch) selects: `straight`'s step-8 checkpoint; no step is left
    results["resume_last"] = fit(args.out / "straight", STEPS, "last", devices=args.devices)
    results["partial"] = fit(args.out / "partial", STEPS, ckpt, new_head=True, devices=args.devices)
    results["partial_fresh"] = fit(args.out / "partial_fresh", 1, new_head=True, devices=args.devices)
    results["eager_head"] = eager_head()
    results["eager_drawn"] = {"plain": eager_drawn(False), "new_head": eager_drawn(True)}
    results["unwritten"] = unwritten(args.out / "unwritten", args.devices, ckpt)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=lightning_shard.fabric.ShardedStrategy())
    fabric.launch()
    results["fabric"] = fabric_run(fabric, args.out / "fabric.ckpt", resume=False)
    results["fabric_resume"] = fabric_run(fabric, args.out / "fabric.ckpt", resume=True)
    results["fabric_told"] = fabric_run(fabric, args.out / "fabric.ckpt", resume=True, told=True)
    results["fabric_unloaded"] = fabric_unloaded(fabric, args.out / "fabric.ckpt")
    if dist.get_rank() == 0:
        torch.save(results, args.out / "result.pt")


if __name__ == "__main__":
    main()
