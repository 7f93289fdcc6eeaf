"""The prepared one-GPU check of ``ShardedStrategy``: does the CUDA path work, and how fast is it?

Part 1, the tiny GPT (``configs/gpt_tiny.yaml``'s model section, the example's byte-level stdlib text): fits in
bf16-mixed, 16-mixed (grad scaler) and ``fully_sharded_offload``, each with validation metrics, gradient clipping and
``ShardedMemoryMonitor``'s CUDA figures; a sharded save at step 4 and a resume whose losses equal the uninterrupted
run's; a full (one-file) save whose loaded weights validate to the same loss.

Part 2, GPT-3 XL (1.3B, ``configs/gpt3_xl.yaml``'s model section, random tokens), bf16-mixed, eager and compiled
(``ShardedStrategy(compile=True)``), activation checkpointing off, full (``["Block"]``) and selective (per op):
tokens/s, MFU against the device's dense bf16 peak (looked up by its exact name, or ``--peak-tflops``), each step
timed between ``torch.cuda.synchronize()`` calls, peak allocated and reserved memory and their ratio to
``lightning_shard.estimate_memory``'s figure.

Part 3, on a machine with two or more GPUs (and in ``--cpu-smoke`` on 2 CPU ranks, the tiny GPT): the same model on
2 devices as FSDP alone and as tensor parallelism over both (``tensor_parallel_size=2``), the same global batch:
their losses agree, tokens/s and peak memory of each.

Every item runs in its own subprocess, so one failure does not hide the others; ``benchmarks/results/gpu_check.json``
records each item's figures, pass/fail and error, and a table is printed. No LightningCLI (the GPU machine has no
jsonargparse): the Trainer is built here from the YAML's model section.

    python benchmarks/gpu_check.py                # one GPU, part 1 then part 2, about 5-6 minutes
    python benchmarks/gpu_check.py --cpu-smoke    # part 1 on 2 CPU ranks at the smallest sizes (CI runs this)

FLOPs per token follow the PaLM paper's appendix B (as nanoGPT's ``estimate_mfu``): 6 x parameters for the matmuls
of forward and backward, plus 12 x layers x width x context for attention scores and values; the learned position
table is a lookup and is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks.common import REPO, RESULTS, machine, median, random_token_dataset, write_json  # noqa: E402
from examples.gpt.data import TokenDataModule  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard import ShardedMemoryMonitor, ShardedPrecision, ShardedStrategy, estimate_memory  # noqa: E402

# Dense bf16 tensor-core peaks (no sparsity) from NVIDIA's data sheets, in FLOP/s, keyed by the exact name
# torch.cuda.get_device_name() reports: the same chip has different peaks in its SXM, PCIe and NVL forms.
PEAK_BF16_FLOPS = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989.4e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989.4e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
}
# Seconds an item may run before its processes are ended: part 1 takes about 30 s per item on a GPU, a compiled
# 1.3B configuration about 2 minutes (mostly inductor).
ITEM_TIMEOUT_S = {1: 180, 2: 300, 3: 300}
# Items that run on more devices than the target's one GPU: tensor parallelism needs two.
ITEM_DEVICES = {"tensor_parallel": 2}
CHECKPOINTING = {"none": None, "full": ["Block"], "selective": "selective"}
GIB, MIB = 2**30, 2**20


def peak_flops(device_name: str, override_tflops: float | None) -> float:
    """The device's dense bf16 peak in FLOP/s: ``--peak-tflops`` if given, else its exact name's data-sheet figure.

    Example:
        >>> peak_flops("NVIDIA H100 PCIe", None) / 1e12
        756.0
    """
    if override_tflops is not None:
        return override_tflops * 1e12
    if device_name in PEAK_BF16_FLOPS:
        return PEAK_BF16_FLOPS[device_name]
    raise ValueError(
        f"no dense bf16 peak known for the device {device_name!r} (known: {', '.join(PEAK_BF16_FLOPS)}); "
        "pass --peak-tflops with its data-sheet figure (dense, not sparse)"
    )


def training_flops_per_token(model: GPT) -> float:
    """Model FLOPs of one training token (forward + backward), PaLM appendix B.

    Example:
        >>> model = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
        >>> model.configure_model()
        >>> training_flops_per_token(model)  # 6 x (34,176 - 16 x 32) + 12 x 2 x 32 x 16
        214272.0
    """
    hp = model.hparams
    params = sum(p.numel() for p in model.parameters()) - model.transformer["wpe"].weight.numel()
    return float(6 * params + 12 * hp.n_layer * hp.n_embd * hp.block_size)


def throughput(
    step_seconds: list[float], warmup: int, tokens_per_step: int, flops_per_token: float, peak: float
) -> dict[str, float]:
    """Median step time after ``warmup`` steps, tokens/s and MFU.

    Example:
        >>> throughput([9.0, 1.0, 3.0, 2.0], warmup=1, tokens_per_step=100, flops_per_token=1e9, peak=1e12)
        {'median_step_seconds': 2.0, 'tokens_per_s': 50.0, 'mfu': 0.05}
    """
    step = median(step_seconds[warmup:])
    tokens_per_s = tokens_per_step / step
    return {"median_step_seconds": step, "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak}


def estimated_device_bytes(model: GPT, *, precision: str, activation_checkpointing: bool | str, batch_size: int) -> int:
    """``lightning_shard.estimate_memory``'s device figure for one rank of ``model`` with these settings (the one
    place the estimator is called; keyword arguments only).

    Example:
        >>> model = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
        >>> model.configure_model()
        >>> estimated_device_bytes(model, precision="bf16-mixed", activation_checkpointing=False, batch_size=2) > 0
        True
    """
    hp = model.hparams
    estimate = estimate_memory(
        sum(p.numel() for p in model.parameters()),
        world_size=1,
        sharding_strategy="FULL_SHARD",
        precision=precision,
        cpu_offload=False,
        activation_checkpointing=activation_checkpointing,
        optimizer="adamw",
        micro_batch_size=batch_size,
        seq_len=hp.block_size,
        n_layer=hp.n_layer,
        n_embd=hp.n_embd,
        n_head=hp.n_head,
        vocab_size=hp.vocab_size,
    )
    return estimate.device.total_bytes


# ---------------------------------------------------------------------------------------------- running one item


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


def _trainer(
    target: Target,
    strategy: Any,
    precision: str,
    steps: int,
    callbacks: list[Callback],
    devices: int | None = None,
    **kw: Any,
):
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


def _tiny_data(target: Target) -> TokenDataModule:
    world = target.devices
    return TokenDataModule(
        block_size=target.tiny["block_size"],
        batch_size=target.batch_size,
        samples_per_epoch=target.steps * target.batch_size * world,
        val_samples=2 * target.batch_size * world,
        max_bytes=target.max_bytes,
    )


def _fit_tiny(
    target: Target, precision: str, strategy: Any, ckpt_path: Path | None = None, checkpoint_dir: Path | None = None
) -> tuple[L.Trainer, GPT, LossRecorder, ShardedMemoryMonitor]:
    L.seed_everything(1234, verbose=False)
    model = GPT(**target.tiny, max_steps=target.steps)
    losses, monitor = LossRecorder(), ShardedMemoryMonitor(log_every_n_steps=target.steps // 2)
    callbacks: list[Callback] = [losses, monitor]
    if checkpoint_dir is not None:
        saver = ModelCheckpoint(checkpoint_dir, filename="{step}", every_n_train_steps=target.steps // 2, save_top_k=-1)
        callbacks.append(saver)
    trainer = _trainer(
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
    trainer.fit(model, datamodule=_tiny_data(target), ckpt_path=ckpt_path)
    return trainer, model, losses, monitor


def _fit_figures(target: Target, trainer: L.Trainer, model: GPT, losses: LossRecorder, monitor: ShardedMemoryMonitor):
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


def item_bf16_resume(target: Target, work: Path) -> list[dict[str, Any]]:
    """bf16-mixed fit with a sharded checkpoint halfway; a second fit resumes from it to the same end."""
    trainer, model, losses, monitor = _fit_tiny(target, "bf16-mixed", ShardedStrategy(), checkpoint_dir=work / "ckpt")
    fit_checks, fit_figures = _fit_figures(target, trainer, model, losses, monitor)
    half = target.steps // 2
    ckpt = work / "ckpt" / f"step={half}.ckpt"
    resumed_trainer, _, resumed, _ = _fit_tiny(target, "bf16-mixed", ShardedStrategy(), ckpt_path=ckpt)
    difference = max(abs(a - b) for a, b in zip(losses.losses[half:], resumed.losses, strict=True))
    val_difference = abs(float(resumed_trainer.callback_metrics["val_loss"]) - fit_figures["val_loss"])
    resume_checks = {
        "sharded checkpoint is a directory": ckpt.is_dir(),
        f"resumed losses equal (<= {target.tolerance:g})": difference <= target.tolerance,
        f"final val_loss equal (<= {target.tolerance:g})": val_difference <= target.tolerance,
    }
    return [
        _row(1, "tiny GPT fit, bf16-mixed", fit_checks, fit_figures),
        _row(
            1,
            f"sharded save at step {half}, resume to {target.steps}",
            resume_checks,
            {"max_loss_difference": difference, "val_loss_difference": val_difference, "resumed": resumed.losses},
        ),
    ]


def item_fp16(target: Target, work: Path) -> list[dict[str, Any]]:
    """16-mixed: FSDP2 computes in fp16 and ShardedGradScaler, created for the root device, scales the loss."""
    trainer, model, losses, monitor = _fit_tiny(target, "16-mixed", ShardedStrategy())
    checks, figures = _fit_figures(target, trainer, model, losses, monitor)
    scaler = trainer.strategy.precision_plugin.scaler
    checks["grad scaler on the root device's type"] = scaler is not None and scaler._device == target.device_type
    scale = float(scaler.get_scale()) if scaler is not None else float("nan")
    checks["loss scale finite"] = math.isfinite(scale) and scale > 0
    return [_row(1, "tiny GPT fit, 16-mixed (grad scaler)", checks, {**figures, "loss_scale": scale})]


def item_offload(target: Target, work: Path) -> list[dict[str, Any]]:
    """``fully_sharded_offload``: parameter shards and optimizer states in CPU memory, compute on the device,
    gradients clipped across ranks on the CPU (the gloo part of the process group)."""
    trainer, model, losses, monitor = _fit_tiny(target, "bf16-mixed", "fully_sharded_offload")
    checks, figures = _fit_figures(target, trainer, model, losses, monitor)
    shards = {p.to_local().device.type for p in model.parameters() if isinstance(p, DTensor)}
    states = {t.device.type for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0}
    checks["parameter shards in CPU memory"] = shards == {"cpu"}
    checks["optimizer states in CPU memory"] = states == {"cpu"}
    figures["process_group_backend"] = trainer.strategy.process_group_backend
    if target.on_gpu:
        checks["process group reduces CPU tensors"] = "cpu:gloo" in figures["process_group_backend"]
    else:
        figures["note"] = "offload is a no-op on a CPU accelerator: the shards live in CPU memory already"
    return [_row(1, "tiny GPT fit, fully_sharded_offload", checks, figures)]


def item_full_checkpoint(target: Target, work: Path) -> list[dict[str, Any]]:
    """A full (one-file) checkpoint: a plain ``torch.load`` sees whole tensors, and a fresh model loaded from it
    validates to the trained model's loss."""
    precision = "bf16-mixed" if target.on_gpu else "32-true"
    trainer, model, _, _ = _fit_tiny(target, precision, ShardedStrategy(state_dict_type="full"))
    trained = trainer.validate(model, datamodule=_tiny_data(target), verbose=False)[0]["val_loss"]
    path = work / "full.ckpt"
    trainer.save_checkpoint(path)
    checks: dict[str, bool] = {"one file": path.is_file()}
    if trainer.is_global_zero:
        weights = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        full_shape = (target.tiny["vocab_size"], target.tiny["n_embd"])
        checks["whole tensors in the file"] = tuple(weights["transformer.wte.weight"].shape) == full_shape
    L.seed_everything(0, verbose=False)
    fresh = GPT(**target.tiny, max_steps=target.steps)
    evaluator = _trainer(
        target, ShardedStrategy(), precision, 1, [], limit_val_batches=2, use_distributed_sampler=False
    )
    loaded = evaluator.validate(fresh, datamodule=_tiny_data(target), ckpt_path=path, verbose=False)[0]["val_loss"]
    difference = abs(loaded - trained)
    checks[f"loaded model validates equal (<= {target.tolerance:g})"] = difference <= target.tolerance
    return [_row(1, "full save and load", checks, {"val_loss": trained, "val_loss_difference": difference})]


def item_xl(target: Target, work: Path, compile: bool, checkpointing: str, peak: float) -> list[dict[str, Any]]:
    """GPT-3 XL on one GPU, bf16-mixed: timed steps, tokens/s, MFU, peak memory against the estimate;
    ``checkpointing``: "none", "full" or "selective"."""
    warmup, timed, batch = 3, 10, 8
    model = GPT(**{**target.xl, "max_steps": warmup + timed})
    timer = SynchronisedStepTimer()
    strategy = ShardedStrategy(
        auto_wrap_policy=["Block"], activation_checkpointing=CHECKPOINTING[checkpointing], compile=compile
    )
    trainer = _trainer(
        target, strategy, "bf16-mixed", warmup + timed, [timer], gradient_clip_val=1.0, enable_checkpointing=False
    )
    data = random_token_dataset(batch * (warmup + timed), target.xl["block_size"], target.xl["vocab_size"])
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch))
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    speed = throughput(
        timer.seconds, warmup, batch * target.xl["block_size"], training_flops_per_token(model), peak=peak
    )
    estimate = estimated_device_bytes(
        model, precision="bf16-mixed", activation_checkpointing=checkpointing, batch_size=batch
    )
    figures = {
        **speed,
        "step_seconds": timer.seconds,
        "num_params": sum(p.numel() for p in model.parameters()),
        "max_memory_allocated_bytes": allocated,
        "max_memory_reserved_bytes": reserved,
        "estimated_device_bytes": estimate,
        "allocated_over_estimate": allocated / estimate,
        "targets": {
            "mfu >= 40% (compiled, H100/H200)": speed["mfu"] >= 0.40 if compile else None,
            "peak allocated within 15% of the estimate": abs(allocated / estimate - 1) <= 0.15,
        },
    }
    checks = {"ran": len(timer.seconds) == warmup + timed}
    mode = f"{'compiled' if compile else 'eager'}, activation checkpointing {checkpointing}"
    return [_row(2, f"GPT-3 XL 1.3B, bf16-mixed, {mode}", checks, figures)]


def item_tensor_parallel(target: Target, work: Path) -> list[dict[str, Any]]:
    """One model on 2 devices, FSDP alone and 1 x 2 tensor parallelism: the same global batch every step (FSDP: half
    on each rank; tensor parallelism: all of it on both), so their losses agree; tokens/s and peak memory of each.
    On a GPU the XL model in bf16-mixed; in ``--cpu-smoke`` the tiny one in fp32."""
    warmup, timed = (2, 6) if target.on_gpu else (1, 3)
    dims = target.xl if target.on_gpu else target.tiny
    global_batch = 8 if target.on_gpu else 4
    precision = "bf16-mixed" if target.on_gpu else "32-true"
    runs: dict[str, dict[str, Any]] = {}
    for name, size in (("fsdp", 1), ("tensor_parallel", 2)):
        L.seed_everything(0, verbose=False)
        model = GPT(**{**dims, "max_steps": warmup + timed})
        timer, losses = SynchronisedStepTimer(), LossRecorder()
        strategy = ShardedStrategy(auto_wrap_policy=["Block"], tensor_parallel_size=size)
        trainer = _trainer(target, strategy, precision, warmup + timed, [timer, losses], devices=2,
                           enable_checkpointing=False, use_distributed_sampler=True)  # fmt: skip
        data = random_token_dataset(global_batch * (warmup + timed), dims["block_size"], dims["vocab_size"])
        if target.on_gpu:
            torch.cuda.reset_peak_memory_stats()
        # the sampler spans the data-parallel ranks: 2 under FSDP, 1 under tensor parallelism
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=global_batch * size // 2))
        step = median(timer.seconds[warmup:])
        runs[name] = {
            "losses": losses.losses,
            "tokens_per_s": global_batch * dims["block_size"] / step,
            "median_step_seconds": step,
            "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if target.on_gpu else None,
            "parameter_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters()),
        }
    tolerance = 5e-2 if target.on_gpu else 1e-5  # bf16: the split matmuls sum their partial products apart
    difference = max(abs(a - b) for a, b in zip(runs["fsdp"]["losses"], runs["tensor_parallel"]["losses"], strict=True))
    checks = {
        "losses finite": all(math.isfinite(x) for run in runs.values() for x in run["losses"]),
        f"the same losses (<= {tolerance:g})": difference <= tolerance,
    }
    figures = {
        "max_loss_difference": difference,
        "tokens_per_s_fsdp": runs["fsdp"]["tokens_per_s"],
        "tokens_per_s_tensor_parallel": runs["tensor_parallel"]["tokens_per_s"],
        "tensor_parallel_over_fsdp_speed": runs["tensor_parallel"]["tokens_per_s"] / runs["fsdp"]["tokens_per_s"],
        "parameter_bytes_fsdp": runs["fsdp"]["parameter_bytes"],
        "parameter_bytes_tensor_parallel": runs["tensor_parallel"]["parameter_bytes"],
        "runs": runs,
    }
    if target.on_gpu:
        figures["peak_allocated_fsdp_GiB"] = runs["fsdp"]["max_memory_allocated_bytes"] / GIB
        figures["peak_allocated_tensor_parallel_GiB"] = runs["tensor_parallel"]["max_memory_allocated_bytes"] / GIB
    model_name = "GPT-3 XL, bf16-mixed" if target.on_gpu else "tiny GPT, fp32"
    return [_row(3, f"{model_name} on 2 devices: FSDP alone vs tensor parallel 1 x 2", checks, figures)]


def _row(part: int, check: str, checks: dict[str, bool], figures: dict[str, Any]) -> dict[str, Any]:
    failed = [name for name, ok in checks.items() if not ok]
    return {"part": part, "check": check, "passed": not failed, "failed": failed, "figures": figures, "error": None}


def items(target: Target, peak: float | None) -> dict[str, Callable[[Path], list[dict[str, Any]]]]:
    """Item name -> the function that runs it (in a subprocess of its own)."""
    part1 = {
        "bf16_resume": lambda work: item_bf16_resume(target, work),
        "fp16": lambda work: item_fp16(target, work),
        "offload": lambda work: item_offload(target, work),
        "full_checkpoint": lambda work: item_full_checkpoint(target, work),
    }
    part3 = {"tensor_parallel": lambda work: item_tensor_parallel(target, work)}
    if not target.on_gpu:
        return {**part1, **part3}
    part2 = {
        f"xl_{'compiled' if c else 'eager'}_{a}": (
            lambda work, c=c, a=a: item_xl(target, work, compile=c, checkpointing=a, peak=peak)
        )
        for c in (False, True)
        for a in CHECKPOINTING
    }
    return {**part1, **part2, **(part3 if torch.cuda.device_count() >= 2 else {})}


def run_item(name: str, target: Target, peak: float | None, out: Path) -> None:
    """Run one item in this process (and, on CPU, in the rank Lightning's launcher starts). Rank 0 writes the rows
    to ``out``; every rank writes whether it finished to ``<out>.rank<r>``, so a failure on another rank counts."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        rows = items(target, peak)[name](out.parent / f"{name}_work")
    except BaseException:
        write_json(_rank_file(out, rank), {"error": traceback.format_exc(limit=-6)})
        raise
    if rank == 0:
        write_json(out, {"rows": rows})
    write_json(_rank_file(out, rank), {"error": None})


def _rank_file(out: Path, rank: int) -> Path:
    return out.with_suffix(f".rank{rank}")


# ---------------------------------------------------------------------------------------------- orchestration


def run_in_subprocess(name: str, args: argparse.Namespace, target: Target, work: Path) -> list[dict[str, Any]]:
    """Run item ``name`` as ``python gpu_check.py --item NAME``; a crash, hang or failed check stays its own."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--item", name, "--item-out", str(out)]
    command += ["--cpu-smoke"] if args.cpu_smoke else []
    command += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    part = 2 if name.startswith("xl") else 3 if name in ITEM_DEVICES else 1
    timeout = ITEM_TIMEOUT_S[part]
    devices = ITEM_DEVICES.get(name, target.devices)
    start = time.perf_counter()
    with log.open("w") as log_file:
        # A session of its own: on a timeout the whole group (rank 0 and the ranks it launched) is ended.
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
            problem = None if returncode == 0 else f"exit code {returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            problem = f"timed out after {timeout} s"
    seconds = time.perf_counter() - start
    problem = problem or _other_ranks_problem(out, devices)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    if problem or not rows:
        ranks = [_rank_file(out, r) for r in range(devices)]
        errors = [error for f in ranks if f.exists() and (error := json.loads(f.read_text())["error"])]
        details = "\n".join(errors) or "log tail:\n" + "".join(log.read_text().splitlines(True)[-25:])
        error = f"{problem or 'no result'}: {details}"
        failed = {"part": part, "check": name, "passed": False, "failed": ["ran"], "figures": {}, "error": error}
        rows = [{**row, "passed": False, "error": error} for row in rows] or [failed]
    return [{**row, "item": name, "seconds": seconds} for row in rows]


def _other_ranks_problem(out: Path, world: int, grace_s: float = 30.0) -> str | None:
    """Once rank 0 is done, every rank must have reported (it may take a moment to exit) without an error."""
    deadline = time.monotonic() + grace_s
    while not all(_rank_file(out, r).exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = [r for r in range(world) if not _rank_file(out, r).exists()]
    if missing:
        return f"rank(s) {missing} did not report"
    failed = [r for r in range(world) if json.loads(_rank_file(out, r).read_text())["error"]]
    return f"rank(s) {failed} failed" if failed else None


def report(rows: list[dict[str, Any]], target: Target, device_name: str) -> dict[str, Any]:
    """The ``report`` table the benchmarks' make_report.py renders."""

    def gib(value: Any) -> str:
        return "-" if value is None else f"{value / GIB:.2f}"

    table = []
    for row in rows:
        f = row["figures"]
        if row["part"] == 2 and "mfu" in f:
            speed = [f"{f['tokens_per_s']:,.0f}", f"{f['mfu']:.1%}"]
            memory = [gib(f["max_memory_allocated_bytes"]), gib(f["max_memory_reserved_bytes"])]
            memory += [gib(f["estimated_device_bytes"]), f"{f['allocated_over_estimate']:.2f}"]
            details = f"median step {f['median_step_seconds']:.3f} s"
        else:
            speed, memory = ["-", "-"], ["-", "-", "-", "-"]
            details = "; ".join(
                f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                for key, value in f.items()
                if not isinstance(value, (list, dict))
            )
        error = (row["error"] or "").strip().splitlines()[-1:] or [", ".join(row["failed"])]
        table.append([row["part"], row["check"], "pass" if row["passed"] else "FAIL", *speed, *memory, details, *error])
    notes = [
        f"Device: {device_name}; {target.devices} rank(s) on {target.accelerator}.",
        "Part 1: the tiny GPT (configs/gpt_tiny.yaml's model dims; --cpu-smoke: 2 layers, width 32, context 32) on "
        "the example's byte-level stdlib text, gradient clipping 1.0, validation every half run.",
        "Part 2: GPT-3 XL (configs/gpt3_xl.yaml's model dims), micro-batch 8 x 2048 random tokens, FULL_SHARD on "
        "one device, 3 warm-up + 10 timed steps, each between torch.cuda.synchronize() calls; MFU = FLOPs per token "
        "(PaLM appendix B) x tokens/s / the device's dense bf16 peak; peaks from torch.cuda.max_memory_allocated / "
        "reserved over the fit; estimate = lightning_shard.estimate_memory, same settings.",
        "Part 3 (two or more GPUs; --cpu-smoke: 2 CPU ranks, the tiny GPT): the model on 2 devices as FSDP alone "
        "and as tensor parallelism 1 x 2, the same global batch per step; losses compared, tokens/s of each.",
    ]
    columns = ["part", "check", "result", "tokens/s", "MFU", "peak allocated GiB", "peak reserved GiB"]
    columns += ["estimate GiB", "allocated / estimate", "details", "failed / error"]
    return {
        "title": "One-GPU check: the CUDA path, and GPT-3 XL throughput" if target.on_gpu else "GPU check, CPU smoke",
        "question": "Does the sharded strategy train, validate, checkpoint and resume on CUDA (fp16 scaler and CPU "
        "offload included), and what tokens/s, MFU and peak memory does the 1.3B model reach on one GPU?",
        "columns": columns,
        "rows": table,
        "notes": notes,
    }


def format_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in columns], *[[str(c) for c in row] for row in rows]]
    widths = [min(60, max(len(row[i]) for row in cells)) for i in range(len(columns))]
    return "\n".join("  ".join(cell[:60].ljust(w) for cell, w in zip(row, widths, strict=True)) for row in cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="part 1 on 2 CPU ranks at the smallest sizes")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of a device not in the table")
    parser.add_argument("--output", type=Path, default=None, help="default: benchmarks/results/gpu_check.json")
    parser.add_argument("--item", help=argparse.SUPPRESS)
    parser.add_argument("--item-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    target = make_target(args.cpu_smoke)
    if not target.on_gpu:
        device_name, peak = "cpu", None
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device here; run with --cpu-smoke for the CPU version")
        # Before anything runs: an unknown peak would waste the whole check.
        device_name = torch.cuda.get_device_name()
        peak = peak_flops(device_name, args.peak_tflops)
    if args.item:
        run_item(args.item, target, peak, args.item_out)
        return 0

    output = args.output or RESULTS / ("gpu_check_cpu_smoke.json" if args.cpu_smoke else "gpu_check.json")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        rows = [row for name in items(target, peak) for row in run_in_subprocess(name, args, target, Path(tmp))]
    table = report(rows, target, device_name)
    result = {
        "benchmark": "gpu_check",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "device": device_name,
        "peak_flops": peak,
        "passed": all(row["passed"] for row in rows),
        "wall_seconds": time.perf_counter() - start,
        "items": rows,
        "report": table,
    }
    write_json(output, result)
    print(format_table(table["columns"], table["rows"]))
    print(f"{'all passed' if result['passed'] else 'FAILED'} in {result['wall_seconds']:.0f} s; wrote {output}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
