"""Weight averaging (EMA, SWA) runs of the toy model; results are saved per scenario on rank 0.

    python tests/averaging_run.py --devices 2 --out TWO ema custom swa bf16_mixed bf16_true resume resume_full fabric
    python tests/averaging_run.py --devices 1 --reference --out REF --from TWO ema custom swa resharded

``--reference``: Lightning's single-device strategy with Lightning's own callbacks (``resharded`` excepted: the
sharded strategy on one rank, from TWO's 2-rank checkpoint).

Lightning's launcher re-runs this script for rank 1. The Trainer scenarios use Lightning's callbacks as a user writes
them (``EMAWeightAveraging``, ``WeightAveraging`` and a subclass in the docstring's style); 4 batches an epoch, 8
steps, validation every 2 steps. Each records after every optimizer step the averaged and the trained weights
(gathered), the model's weights inside validation (the averaged ones swapped in) and after it, the validation losses,
and the final weights. Scenarios:

* ``ema``: ``EMAWeightAveraging(decay=0.8)``, the model built in ``configure_model`` (where it was built is recorded),
  sharded checkpoints at every epoch end; after fit, ``validate`` again, and a Trainer without the callback
  validates the step-8 checkpoint. ``custom``: a ``WeightAveraging`` subclass
  with ``multi_avg_fn`` and its own ``should_update``. ``swa``: ``WeightAveraging()`` (equal weights).
  ``bf16_mixed`` (full checkpoints at every epoch end, ``validate`` after fit) / ``bf16_true``: ``ema`` in those
  precisions.
* ``resume``: ``ema`` resumed from its step-4 checkpoint; ``resume_full``: the same after ``convert`` to one file.
* ``resharded`` (1 rank): ``ema``'s 2-rank step-4 checkpoint resumed on one rank.
* ``fabric``: a Fabric loop with ``ShardedAveragedModel``: ``update()`` after each step, validation inside
  ``swapped_in()``, ``fabric.save`` at step 4, then a fresh model, optimizer and copy ``fabric.load`` it and train on.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import FULL, QUIET, GlobalLossRecorder, RankSliceBatchSampler, ToyModel, dataset  # noqa: E402

import lightning_shard  # noqa: E402
from lightning_shard.averaging import ShardedAveragedModel  # noqa: E402
from lightning_shard.checkpoint import convert  # noqa: E402

GLOBAL_BATCH = 16  # 4 batches an epoch: the step-4 checkpoint falls on an epoch boundary
MAX_STEPS = 8
DECAY = 0.8  # far from 1, so that 8 steps move the average visibly
CHECKPOINT = "epoch=0-step=4.ckpt"
# The scenarios that write a checkpoint at each epoch end, in this format.
CHECKPOINTS = {"ema": "sharded", "bf16_mixed": "full"}


class EMAEveryOtherStep(WeightAveraging):
    """A subclass as Lightning's docstring writes one: its own averaging function and update schedule."""

    def __init__(self) -> None:
        super().__init__(multi_avg_fn=get_ema_multi_avg_fn(0.7), use_buffers=False)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx >= 2 and step_idx % 2 == 0


class BuiltWhere(ToyModel):
    """``ToyModel(build="configure")`` recording where ``configure_model`` built the layers: on the meta device under
    the sharded strategy, whatever the averaging callback does."""

    def configure_model(self) -> None:
        if self.embed is None:
            super().configure_model()
            self.built_on = str(self.embed.weight.device)


def loader() -> DataLoader:
    return DataLoader(dataset(), batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH))


def full(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of gathered values (with one rank they can be the live tensors)."""
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, state)


def averaged_weights(callback: WeightAveraging) -> dict[str, torch.Tensor]:
    """The callback's averaged copy, gathered: ``AveragedModel.module`` is a copy of the LightningModule (Lightning),
    ``ShardedAveragedModel.module`` holds its shards under the same names (here)."""
    return full(get_model_state_dict(callback._average_model.module, options=FULL))


class Recorder(L.Callback):
    """Listed after the averaging callback, so its hooks see what that one did."""

    def __init__(self, averaging: WeightAveraging) -> None:
        self.averaging = averaging
        self.steps: list[dict[str, Any]] = []
        self.validations: list[dict[str, Any]] = []
        self.at_start: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_start = {"averaged": averaged_weights(self.averaging), "step": trainer.global_step}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        trained = full(get_model_state_dict(pl_module, options=FULL))
        self.steps.append({"averaged": averaged_weights(self.averaging), "trained": trained})

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._fitting(trainer) and args[1] == 0:  # batch_idx
            inside = full(get_model_state_dict(pl_module, options=FULL))
            self.validations.append({"step": trainer.global_step, "inside": inside})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fitting(trainer):
            self.validations[-1]["after"] = full(get_model_state_dict(pl_module, options=FULL))
            self.validations[-1]["val_loss"] = float(trainer.callback_metrics["val_loss"])

    @staticmethod
    def _fitting(trainer: L.Trainer) -> bool:
        return trainer.state.fn == "fit" and not trainer.sanity_checking


def averaging_callback(name: str) -> WeightAveraging:
    if name == "custom":
        return EMAEveryOtherStep()
    if name == "swa":
        return WeightAveraging()
    return EMAWeightAveraging(decay=DECAY)


def run_trainer(name: str, args: argparse.Namespace) -> None:
    precision = {"bf16_mixed": "bf16-mixed", "bf16_true": "bf16-true"}.get(name, "32-true")
    kind = {"resume": "ema", "resume_full": "ema", "resharded": "ema"}.get(name, name)
    averaging = averaging_callback(kind)
    recorder, losses = Recorder(averaging), GlobalLossRecorder()
    callbacks: list[L.Callback] = [averaging, recorder, losses]
    state_dict_type = CHECKPOINTS.get(name)
    if state_dict_type:
        callbacks.append(ModelCheckpoint(args.out / name, save_top_k=-1, save_on_train_epoch_end=True))
    L.seed_everything(0, verbose=False)
    model = BuiltWhere(build="configure")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=_strategy(name, args, state_dict_type),
        precision=precision,
        max_steps=MAX_STEPS,
        val_check_interval=2,
        limit_val_batches=2,
        callbacks=callbacks,
        **{**QUIET, "enable_checkpointing": state_dict_type is not None},
    )
    trainer.fit(model, loader(), loader(), ckpt_path=_resumed_from(name, args))
    result: dict[str, Any] = {
        "losses": losses.losses,
        "steps": recorder.steps,
        "validations": recorder.validations,
        "at_start": recorder.at_start,
        "final": full(get_model_state_dict(model, options=FULL)),
        "built_on": getattr(model, "built_on", None),
        "class_after_fit": type(averaging) is type(averaging_callback(kind)),
    }
    if isinstance(trainer.strategy, lightning_shard.ShardedStrategy):
        result["averaged_bytes"] = averaging._average_model.local_bytes()
        result["model_bytes"] = sum(p.to_local().nbytes for p in model.parameters())
    if name in ("ema", "bf16_mixed"):
        result["val_after_fit"] = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
    if name == "ema":
        result["val_from_checkpoint"] = _validate_checkpoint(args.out / name / "epoch=1-step=8.ckpt", args)
    if trainer.is_global_zero:
        torch.save(result, args.out / f"{name}.pt")


def _validate_checkpoint(path: Path, args: argparse.Namespace) -> float:
    """``validate(ckpt_path=...)`` by a Trainer without the averaging callback, on a fresh model."""
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=_strategy("ema", args, None), limit_val_batches=2, **QUIET
    )
    return trainer.validate(BuiltWhere(build="configure"), loader(), ckpt_path=path, verbose=False)[0]["val_loss"]


def _strategy(name: str, args: argparse.Namespace, state_dict_type: str | None) -> Any:
    if args.reference and name != "resharded":
        return "auto"
    return lightning_shard.ShardedStrategy(state_dict_type=state_dict_type)


def _resumed_from(name: str, args: argparse.Namespace) -> Path | None:
    if name in ("resume", "resharded"):
        return (args.source or args.out) / "ema" / CHECKPOINT
    if name != "resume_full":
        return None
    converted = args.out / "ema_full.ckpt"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not converted.exists():
        convert(args.out / "ema" / CHECKPOINT, converted)
    if dist.is_initialized():
        dist.barrier()
    return converted


# ------------------------------------------------------------------ Fabric


def run_fabric(args: argparse.Namespace) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=lightning_shard.fabric.ShardedStrategy())
    fabric.launch()
    first = _fabric_loop(fabric, args.out / "fabric.ckpt", stop_at=4)
    resumed = _fabric_loop(fabric, args.out / "fabric.ckpt", start_at=4)
    if fabric.global_rank == 0:
        torch.save({"first": first, "resumed": resumed}, args.out / "fabric.pt")


def _fabric_loop(fabric: L.Fabric, checkpoint: Path, stop_at: int | None = None, start_at: int = 0) -> dict[str, Any]:
    """Train to step 8 (saving at ``stop_at``), or from ``checkpoint`` at ``start_at``, recording every step."""
    L.seed_everything(0, verbose=False)
    model = ToyModel()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    ema = ShardedAveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    state = {"model": model, "optimizer": optimizer, "ema": ema, "step": 0}
    if start_at:
        fabric.load(checkpoint, state)
    records = []
    batches = [batch for _ in range(2) for batch in loader()]
    for step in range(state["step"], MAX_STEPS):
        x, y = batches[step]
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        state["step"] = step + 1
        record = {"trained": full(get_model_state_dict(model, options=FULL))}
        with ema.swapped_in():
            record["inside"] = full(get_model_state_dict(model, options=FULL))
        record["after"] = full(get_model_state_dict(model, options=FULL))
        record["averaged"] = full(get_model_state_dict(ema.module, options=FULL))
        records.append(record)
        if state["step"] == stop_at:
            fabric.save(checkpoint, state)
    return {"steps": records, "n_averaged": int(ema.n_averaged)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from", dest="source", type=Path, help="where `ema` wrote its checkpoints")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        if name == "fabric":
            run_fabric(args)
        else:
            run_trainer(name, args)


if __name__ == "__main__":
    main()
