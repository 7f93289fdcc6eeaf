"""Tokens/s and model FLOPs utilisation (MFU) of the example GPT on one GPU under ``ShardedStrategy``.

The prepared check for a lent GPU: GPT-3 XL (1.3B, ``configs/gpt3_xl.yaml``'s model section), bf16-mixed, random
tokens (nothing is downloaded), one device, Lightning's Trainer. It times each step between
``on_train_batch_start`` and ``on_train_batch_end`` with the device synchronised on both ends, and reports the median
after warm-up, tokens/s, MFU against the device's dense bf16 peak, and peak device memory.

    python benchmarks/gpu_throughput.py                                  # GPU: 1.3B, bf16-mixed
    python benchmarks/gpu_throughput.py --accelerator cpu --config configs/gpt_tiny.yaml --precision 32-true \\
        --batch-size 2 --warmup 1 --steps 2 --peak-tflops 1 --output /tmp/dry_run.json   # the same path on CPU

FLOPs per token follow the PaLM paper's appendix B (as nanoGPT's ``estimate_mfu``): 6 x parameters for the matmuls
of forward and backward, plus 12 x layers x width x context for attention scores and values; the learned position
table is a lookup and is left out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from benchmarks.common import REPO, RESULTS, machine, median, peak_rss_bytes, random_token_dataset, write_json
from examples.gpt.model import GPT
from lightning_shard import ShardedStrategy

# Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts), in FLOP/s; matched on the device name.
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362.05e12, "A10G": 70e12}


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


def peak_flops(device_name: str, override_tflops: float | None) -> float:
    """The device's dense bf16 peak in FLOP/s: ``--peak-tflops`` if given, else looked up by name."""
    if override_tflops is not None:
        return override_tflops * 1e12
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    raise ValueError(
        f"no bf16 peak known for device {device_name!r} (known: {', '.join(PEAK_BF16_FLOPS)}); "
        "pass --peak-tflops with its data-sheet figure"
    )


class SynchronisedStepTimer(Callback):
    """Seconds per training step, with the device's queued work finished at both ends of the step."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    @staticmethod
    def _synchronise(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._synchronise(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._synchronise(pl_module.device)
        self.seconds.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "gpt3_xl.yaml", help="its model section")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD")
    parser.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every Block")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak, if not in PEAK_BF16_FLOPS")
    parser.add_argument("--output", type=Path, default=RESULTS / "gpu_throughput.json")
    args = parser.parse_args(argv)

    # Fail before anything is built if the peak is unknown: the run would be wasted.
    device_name = torch.cuda.get_device_name() if args.accelerator in ("gpu", "cuda") else "cpu"
    peak = peak_flops(device_name, args.peak_tflops)
    model_config = yaml.safe_load(args.config.read_text())["model"]
    model = GPT(**model_config)
    timer = SynchronisedStepTimer()
    strategy = ShardedStrategy(
        sharding_strategy=args.sharding_strategy,
        auto_wrap_policy=["Block"],
        activation_checkpointing=["Block"] if args.activation_checkpointing else None,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    block_size = model_config["block_size"]
    data = random_token_dataset(args.batch_size * (args.warmup + args.steps), block_size, model_config["vocab_size"])
    start = time.perf_counter()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch_size))
    wall = time.perf_counter() - start

    step = median(timer.seconds[args.warmup :])
    tokens_per_s = args.batch_size * block_size / step
    flops_per_token = training_flops_per_token(model)
    on_cuda = model.device.type == "cuda"
    result = {
        "benchmark": "gpu_throughput",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "device": device_name,
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": model_config,
        "num_params": sum(p.numel() for p in model.parameters()),
        "step_seconds": timer.seconds,
        "losses": timer.losses,
        "median_step_seconds": step,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "mfu": flops_per_token * tokens_per_s / peak,
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved() if on_cuda else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "wall_seconds": wall,
    }
    write_json(args.output, result)
    print(
        f"{device_name}: {result['num_params'] / 1e9:.3f}B parameters, median step {step:.3f} s, "
        f"{tokens_per_s:,.0f} tokens/s, MFU {result['mfu']:.1%}, wrote {args.output}"
    )


if __name__ == "__main__":
    main()
