"""The prepared GPU check, as far as a CPU can take it: its arithmetic (the FLOPs formula against torch's FLOP
counter, the peak table's exact names, tokens/s and MFU from step times) and its part 1 run on 2 CPU ranks
(``--cpu-smoke``: the same fits, checkpoint round trips and equalities the GPU run checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu_figures import peak_flops, throughput, training_flops_per_token  # noqa: E402
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


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),  # the SXM part's name
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
    ],
)
def test_peak_flops_by_the_exact_device_name(name: str, tflops: float) -> None:
    assert peak_flops(name, None) == tflops * 1e12


def test_an_unknown_or_partial_name_asks_for_the_figure() -> None:
    for name in ("Tesla T4", "NVIDIA H100", "NVIDIA H200 NVL 2"):  # no substring matching
        with pytest.raises(ValueError, match=rf"'{name}'.*--peak-tflops"):
            peak_flops(name, None)
    assert peak_flops("Tesla T4", 65.0) == 65e12


def test_tokens_per_second_and_mfu_come_from_the_median_timed_step() -> None:
    figures = throughput([30.0, 0.5, 0.4, 0.6, 0.5], warmup=1, tokens_per_step=16384, flops_per_token=9e9, peak=1e15)
    assert figures["median_step_seconds"] == 0.5
    assert figures["tokens_per_s"] == 32768
    assert figures["mfu"] == pytest.approx(9e9 * 32768 / 1e15)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu.json"
    run_script("benchmarks/gpu_check.py", "--cpu-smoke", "--output", str(out), timeout=400, check=False)
    return json.loads(out.read_text())["sections"]["gpu_check_cpu_smoke"]


def test_cpu_smoke_passes_every_part_1_check(smoke: dict) -> None:
    failures = {row["check"]: (row["failed"], row["error"]) for row in smoke["items"] if not row["passed"]}
    assert not failures
    assert smoke["passed"]
    checks = [row["check"] for row in smoke["items"]]
    assert checks == [
        "tiny GPT fit, bf16-mixed",
        "sharded save at step 2, resume to 4",
        "tiny GPT fit, 16-mixed (grad scaler)",
        "tiny GPT fit, fully_sharded_offload",
        "full save and load",
        "tiny GPT, fp32 on 2 devices: FSDP alone vs tensor parallel 1 x 2",
    ]


def test_cpu_smoke_resumes_and_reloads_to_equal_losses(smoke: dict) -> None:
    rows = {row["check"]: row["figures"] for row in smoke["items"]}
    resume = rows["sharded save at step 2, resume to 4"]
    assert len(resume["resumed"]) == 2 and resume["max_loss_difference"] <= 1e-5
    assert resume["resumed"] == rows["tiny GPT fit, bf16-mixed"]["losses"][2:]
    assert rows["full save and load"]["val_loss_difference"] <= 1e-5
    assert rows["tiny GPT fit, 16-mixed (grad scaler)"]["loss_scale"] > 0
    tensor_parallel = rows["tiny GPT, fp32 on 2 devices: FSDP alone vs tensor parallel 1 x 2"]
    assert tensor_parallel["max_loss_difference"] <= 1e-5
    # each rank holds half of the split layers (1 x 2) as it holds half of every parameter under FSDP on 2 ranks
    assert tensor_parallel["parameter_bytes_tensor_parallel"] >= tensor_parallel["parameter_bytes_fsdp"]


def test_cpu_smoke_writes_one_report_table(smoke: dict) -> None:
    report = smoke["report"]
    assert {"title", "question", "columns", "rows", "notes"} <= set(report)
    assert len(report["rows"]) == 6 and {len(row) for row in report["rows"]} == {len(report["columns"])}
    assert smoke["command"].startswith("python benchmarks/gpu_check.py --cpu-smoke")
    assert smoke["machine"]["git_commit"]
