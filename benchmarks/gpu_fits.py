"""Where the GPU check's items run and the fits they share: the target (one GPU, or 2 CPU ranks in ``--cpu-smoke``),
the Trainer built for it, the tiny GPT's fit and what every such fit must show.

Takes ``--cpu-smoke`` (``make_target``) and a precision / strategy; gives a fitted Trainer with its recorded losses and
memory monitor, and the checks and figures of a fit (``check_fit``). The items themselves are in ``gpu_items.py``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from benchmarks.common import REPO  # noqa: E402
from examples.gpt.data import TokenDataModule  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard import ShardedMemoryMonitor, ShardedPrecision  # noqa: E402

MIB = 2**20


@dataclass(frozen=True)
class Target:
    """Where and at which sizes the items run: one GPU, or (``--cpu-smoke``) 2 CPU ranks at the smallest sizes."""

    accelerator: str
    devices: int
    tiny: dict[str, Any]
    batch_size: int
    steps: int  # part 1: steps per fit; the sharded checkpoint is taken halfway
    max_bytes: int  # text the data module reads
    tolerance: float  # |loss difference| a resumed or reloaded run may show
    xl: dict[str, Any] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.accelerator == "gpu"

    @property
    def device_type(self) -> str:
        return "cuda" if self.on_gpu else "cpu"


def make_target(cpu_smoke: bool) -> Target:
    tiny = yaml.safe_load((REPO / "configs" / "gpt_tiny.yaml").read_text())["model"]
    if cpu_smoke:
        return Target(
            accelerator="cpu",
            devices=2,
            tiny={**tiny, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
            batch_size=2,
            steps=4,
            max_bytes=100_000,
            tolerance=1e-5,  # CPU kernels are deterministic: measured 0
        )
    return Target(
        accelerator="gpu",
        devices=1,
        tiny=tiny,
        batch_size=16,
        steps=8,
        max_bytes=2_000_000,
        # bf16 compute with fp32 master weights; cuBLAS / SDPA backward may sum in another order between two runs
        tolerance=1e-3,
        xl=yaml.safe_load((REPO / "configs" / "gpt3_xl.yaml").read_text())["model"],
    )


class LossRecorder(Callback):
    """The mean over ranks of each step's loss (one process's loss of the global batch)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


class SynchronisedStepTimer(Callback):
    """Seconds per training step (forward, backward, optimizer step), the device's queue drained at both ends."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        _synchronize(trainer.strategy.root_device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        _synchronize(trainer.strategy.root_device)
        self.seconds.append(time.perf_counter() - self._start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_trainer(
    target: Target,
    strategy: Any,
    precision: str,
    steps: int,
    callbacks: list[Callback],
    devices: int | None = None,
    **kw: Any,
):
    """A Trainer on the target's accelerator that logs nothing by itself (``kw``: the item's other settings)."""
    # Lightning turns `precision="16-mixed"` into bf16 on a CPU accelerator; the plugin keeps fp16 there.
    cpu_fp16 = precision == "16-mixed" and not target.on_gpu
    return L.Trainer(
        accelerator=target.accelerator,
        devices=devices or target.devices,
        strategy=strategy,
        **({"plugins": [ShardedPrecision(precision)]} if cpu_fp16 else {"precision": precision}),
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def tiny_data(target: Target) -> TokenDataModule:
    """The example's byte-level text for one tiny fit: ``steps`` batches per rank and 2 validation batches."""
    world = target.devices
    return TokenDataModule(
        block_size=target.tiny["block_size"],
        batch_size=target.batch_size,
        samples_per_epoch=target.steps * target.batch_size * world,
        val_samples=2 * target.batch_size * world,
        max_bytes=target.max_bytes,
    )


def fit_tiny(
    target: Target, precision: str, strategy: Any, ckpt_path: Path | None = None, checkpoint_dir: Path | None = None
) -> tuple[L.Trainer, GPT, LossRecorder, ShardedMemoryMonitor]:
    """Fit the tiny GPT (seed 1234) with validation and, given ``checkpoint_dir``, a checkpoint every half run."""
    L.seed_everything(1234, verbose=False)
    model = GPT(**target.tiny, max_steps=target.steps)
    losses, monitor = LossRecorder(), ShardedMemoryMonitor(log_every_n_steps=target.steps // 2)
    callbacks: list[Callback] = [losses, monitor]
    if checkpoint_dir is not None:
        saver = ModelCheckpoint(checkpoint_dir, filename="{step}", every_n_train_steps=target.steps // 2, save_top_k=-1)
        callbacks.append(saver)
    trainer = make_trainer(
        target,
        strategy,
        precision,
        target.steps,
        callbacks,
        val_check_interval=target.steps // 2,
        limit_val_batches=2,
        gradient_clip_val=1.0,
        use_distributed_sampler=False,
        enable_checkpointing=checkpoint_dir is not None,
    )
    trainer.fit(model, datamodule=tiny_data(target), ckpt_path=ckpt_path)
    return trainer, model, losses, monitor


def check_fit(target: Target, trainer: L.Trainer, model: GPT, losses: LossRecorder, monitor: ShardedMemoryMonitor):
    """What every part-1 fit must show, and the figures it reports."""
    root = trainer.strategy.root_device
    val_loss = float(trainer.callback_metrics["val_loss"])
    last = monitor.history[-1]["ranks"][0] if monitor.history else {}
    checks = {
        "losses finite": bool(losses.losses) and all(math.isfinite(x) for x in losses.losses),
        "val_loss finite": math.isfinite(val_loss),
        "module on the root device": model.device == root,
        "metric state on the root device": model.val_loss.mean_value.device == root,
    }
    figures: dict[str, Any] = {"losses": losses.losses, "val_loss": val_loss, "root_device": str(root)}
    if target.on_gpu:
        checks["monitor has CUDA figures"] = last.get("cuda_max_allocated_bytes", 0) > 0
        figures["monitor_cuda_max_allocated_MiB"] = last.get("cuda_max_allocated_bytes", 0) / MIB
    else:
        figures["monitor"] = "CUDA figures skipped on CPU"
    return checks, figures
