"""The GPU throughput benchmark's arithmetic, checked on CPU: the FLOPs formula against torch's FLOP counter, and
the reported tokens/s and MFU against the step times it recorded (a dry run of the script on the tiny config)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu_throughput import peak_flops, training_flops_per_token  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402


def test_flops_per_token_matches_the_counted_matmul_and_attention_flops() -> None:
    model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    model.configure_model()
    batch = 3
    tokens = torch.randint(0, 256, (batch, 32))
    # The math kernel runs attention as bmm calls, which the counter knows; CPU's flash kernel is not in its table.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model._loss((tokens, tokens)).backward()
    counted_per_token = counter.get_total_flops() / (batch * 32)
    # The formula also charges 6 FLOPs per bias and LayerNorm parameter, which the counter (matmuls and attention
    # only) does not see; everything else must agree exactly.
    vector_params = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert counted_per_token == training_flops_per_token(model) - 6 * vector_params


def test_peak_flops_by_device_name_or_override() -> None:
    assert peak_flops("NVIDIA H200", None) == 989.4e12
    assert peak_flops("NVIDIA H200", 500.0) == 500e12
    with pytest.raises(ValueError, match=r"'Tesla T4'.*--peak-tflops"):
        peak_flops("Tesla T4", None)


def test_cpu_dry_run_reports_tokens_per_second_and_mfu_from_its_step_times(tmp_path: Path) -> None:
    out = tmp_path / "dry_run.json"
    args = ["--accelerator", "cpu", "--config", "configs/gpt_tiny.yaml", "--precision", "32-true"]
    args += ["--batch-size", "2", "--warmup", "1", "--steps", "2", "--peak-tflops", "1", "--output", str(out)]
    subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", *args], cwd=REPO, check=True, timeout=300)
    result = json.loads(out.read_text())
    assert len(result["step_seconds"]) == len(result["losses"]) == 3
    assert all(math.isfinite(loss) for loss in result["losses"])
    step = statistics.median(result["step_seconds"][1:])
    assert result["median_step_seconds"] == step
    assert result["tokens_per_s"] == pytest.approx(2 * 128 / step, rel=1e-12)
    assert result["mfu"] == pytest.approx(result["flops_per_token"] * result["tokens_per_s"] / 1e12, rel=1e-12)
    assert result["max_memory_allocated_bytes"] is None  # CPU: no device memory figures
