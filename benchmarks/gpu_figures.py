"""The arithmetic of the GPU check: the device's dense bf16 peak, model FLOPs per training token, tokens/s and
MFU from timed steps, and the estimator's device figure for the same settings.

Takes a device name, a model and step times; gives numbers. No process is launched and nothing touches a device.

FLOPs per token follow the PaLM paper's appendix B (as nanoGPT's ``estimate_mfu``): 6 x parameters for the matmuls
of forward and backward, plus 12 x layers x width x context for attention scores and values; the learned position
table is a lookup and is left out.

    >>> throughput([9.0, 1.0, 3.0, 2.0], warmup=1, tokens_per_step=100, flops_per_token=1e9, peak=1e12)
    {'median_step_seconds': 2.0, 'tokens_per_s': 50.0, 'mfu': 0.05}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard import estimate_memory  # noqa: E402

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
