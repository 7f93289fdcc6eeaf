"""The GPU check's items: each runs one check of the CUDA path (or its CPU smoke) and gives its rows.

Takes a :class:`~benchmarks.gpu_fits.Target` and a work directory; gives rows ``{"part", "check", "passed",
"failed", "figures", "error"}``. ``items(target, peak)`` names every item that target runs; ``gpu_check.py`` runs
each in a subprocess of its own.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks.common import median, random_token_dataset  # noqa: E402
from benchmarks.gpu_figures import estimated_device_bytes, throughput, training_flops_per_token  # noqa: E402
from benchmarks.gpu_fits import (  # noqa: E402
    LossRecorder,
    SynchronisedStepTimer,
    Target,
    check_fit,
    fit_tiny,
    make_trainer,
    tiny_data,
)
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard import ShardedStrategy  # noqa: E402

CHECKPOINTING = {"none": None, "full": ["Block"], "selective": "selective"}
GIB = 2**30


def item_bf16_resume(target: Target, work: Path) -> list[dict[str, Any]]:
    """bf16-mixed fit with a sharded checkpoint halfway; a second fit resumes from it to the same end."""
    trainer, model, losses, monitor = fit_tiny(target, "bf16-mixed", ShardedStrategy(), checkpoint_dir=work / "ckpt")
    fit_checks, fit_figures = check_fit(target, trainer, model, losses, monitor)
    half = target.steps // 2
    ckpt = work / "ckpt" / f"step={half}.ckpt"
    resumed_trainer, _, resumed, _ = fit_tiny(target, "bf16-mixed", ShardedStrategy(), ckpt_path=ckpt)
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
    trainer, model, losses, monitor = fit_tiny(target, "16-mixed", ShardedStrategy())
    checks, figures = check_fit(target, trainer, model, losses, monitor)
    scaler = trainer.strategy.precision_plugin.scaler
    checks["grad scaler on the root device's type"] = scaler is not None and scaler._device == target.device_type
    scale = float(scaler.get_scale()) if scaler is not None else float("nan")
    checks["loss scale finite"] = math.isfinite(scale) and scale > 0
    return [_row(1, "tiny GPT fit, 16-mixed (grad scaler)", checks, {**figures, "loss_scale": scale})]


def item_offload(target: Target, work: Path) -> list[dict[str, Any]]:
    """``fully_sharded_offload``: parameter shards and optimizer states in CPU memory, compute on the device,
    gradients clipped across ranks on the CPU (the gloo part of the process group)."""
    trainer, model, losses, monitor = fit_tiny(target, "bf16-mixed", "fully_sharded_offload")
    checks, figures = check_fit(target, trainer, model, losses, monitor)
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
    trainer, model, _, _ = fit_tiny(target, precision, ShardedStrategy(state_dict_type="full"))
    trained = trainer.validate(model, datamodule=tiny_data(target), verbose=False)[0]["val_loss"]
    path = work / "full.ckpt"
    trainer.save_checkpoint(path)
    checks: dict[str, bool] = {"one file": path.is_file()}
    if trainer.is_global_zero:
        weights = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        full_shape = (target.tiny["vocab_size"], target.tiny["n_embd"])
        checks["whole tensors in the file"] = tuple(weights["transformer.wte.weight"].shape) == full_shape
    L.seed_everything(0, verbose=False)
    fresh = GPT(**target.tiny, max_steps=target.steps)
    evaluator = make_trainer(
        target, ShardedStrategy(), precision, 1, [], limit_val_batches=2, use_distributed_sampler=False
    )
    loaded = evaluator.validate(fresh, datamodule=tiny_data(target), ckpt_path=path, verbose=False)[0]["val_loss"]
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
    trainer = make_trainer(
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
        trainer = make_trainer(target, strategy, precision, warmup + timed, [timer, losses], devices=2,
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
