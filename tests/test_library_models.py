"""Models from five libraries nobody on this project wrote (transformers, kornia, diffusers, x-transformers, MONAI),
trained under ``Trainer(strategy=ShardedStrategy())`` with the default ``auto_wrap_policy="auto"`` on 2 gloo ranks
against one process (Lightning's single-device strategy on the whole global batch): per-step losses and final weights
within 1e-5 (relative for losses; measured: losses 4.8e-7, weights 1.9e-6), the units "auto" picked, the 0-d
parameters kept whole on every rank (gradient averaging with unsharded accumulation, clipping and a hybrid mesh; both
checkpoint formats, resumed on 2 ranks and resharded onto 1), and the meta-device build (``configure_model()``)
compared tensor by tensor with the eager one. Two launches, about 2 minutes on 2 busy cores (``tests/library_run.py``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import max_weight_diff, run_script

LIBRARIES = ("transformers", "kornia", "diffusers", "x_transformers", "monai")
missing = [name for name in LIBRARIES if importlib.util.find_spec(name) is None]
if missing:
    pytest.skip(f"not installed: {missing} (pip install -e '.[test,hf]')", allow_module_level=True)

from library_models import CASES  # noqa: E402

TOL = 1e-5
MODELS = list(CASES)
CLIP_EXTRAS = ["clip_accumulate", "clip_hybrid", "clip_bf16", "clip_resume_sharded", "clip_resume_full"]
# The meta-device builds that the initialisation rule does not reproduce yet (issue 27, items 1-9: the lead's rewrite
# of construction.py / materialize.py); strict=False, so they pass as soon as it does.
# What "auto" shards as units in each model (class names, one entry per unit), and why.
EXPECTED_UNITS = {
    # transformers' `_no_split_modules`: the layers of both towers and their embeddings
    "clip": ["CLIPEncoderLayer"] * 4 + ["CLIPTextEmbeddings", "CLIPVisionEmbeddings"],
    # no `_no_split_modules`: the repeated layers; the nn.MultiheadAttention head stays in the root
    "siglip2": ["SigLip2TextLayer"] * 2 + ["SigLip2VisionLayer"] * 2,
    # blocks found inside down_blocks[i].resnets[j] / .attentions[j]
    "unet2d": ["Attention"] * 4 + ["ResnetBlock2D"] * 8,
    # the forward reads `self.transformer_blocks[0].norm1.emb`: block 0 stays in the root
    "dit": ["BasicTransformerBlock"] * 2,
    # layers[i] is a ModuleList of (norms, block, residual): the blocks, not the lists
    "x_transformer": ["Attention", "Attention", "FeedForward", "FeedForward"],
    # the Linear head no longer makes Linear a block (which wrapped MultiheadAttention's out_proj);
    # nn.TransformerEncoder reads its first layer's parameters for its fast-path checks: layer 0 stays in the root
    "mil": ["TransformerEncoderLayer"],
    # a recursive UNet has no repeated block: the root alone, with one line saying so
    "monai_unet": [],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("library")
    checkpoints = ["--checkpoints", str(out / "checkpoints")]
    metas = [f"{name}_meta" for name in MODELS]
    # `clip` saves the checkpoints the resume scenarios load, in this run and in the reference's
    run_script("tests/library_run.py", "--devices", "2", "--out", str(out / "two"), *checkpoints, *MODELS,
               *CLIP_EXTRAS, *metas, timeout=900)  # fmt: skip
    reference = [*MODELS, "clip_accumulate", "clip_resume_sharded", "clip_resume_full"]
    run_script("tests/library_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), *checkpoints,
               *reference, timeout=600)  # fmt: skip
    return {"two": out / "two", "ref": out / "ref"}


def load(results: dict[str, Path], run: str, scenario: str) -> dict[str, Any]:
    return torch.load(results[run] / f"{scenario}.pt", weights_only=False)


def assert_trains_as_one_process(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert len(run["losses"]) == len(reference["losses"]) > 0
    assert run["losses"] == pytest.approx(reference["losses"], rel=TOL, abs=TOL)
    assert max_weight_diff(run["end"]["weights"], reference["end"]["weights"]) < TOL


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_match_one_process_with_the_default_wrapping(results: dict[str, Path], name: str) -> None:
    two = load(results, "two", name)
    assert_trains_as_one_process(two, load(results, "ref", name))
    assert sorted(two["units"]) == sorted(EXPECTED_UNITS[name])


@pytest.mark.parametrize(
    ("name", "replicated"),
    [("clip", ["model.logit_scale"]), ("siglip2", ["model.logit_bias", "model.logit_scale"])],
)
def test_zero_dim_parameters_are_kept_whole_on_every_rank(results: dict[str, Path], name: str, replicated) -> None:
    # fully_shard refuses them ("doesn't support scalar parameters"); the parity above shows their gradients averaged
    assert load(results, "two", name)["replicated"] == replicated


def test_replicated_gradients_wait_for_the_last_micro_batch_and_count_once_in_the_norm(
    results: dict[str, Path],
) -> None:
    # 2 micro-batches per step with gradient_accumulation="unsharded" (the reduce-scatter and the replicated
    # all-reduce both skipped on the first) and gradient_clip_val=0.05, which clips every step here
    assert_trains_as_one_process(load(results, "two", "clip_accumulate"), load(results, "ref", "clip_accumulate"))


def test_replicated_gradients_are_averaged_over_the_replicas_of_a_hybrid_mesh(results: dict[str, Path]) -> None:
    # HYBRID_SHARD with shard groups of 1: the mesh is (2, 1) and only its "replicate" dimension averages
    assert_trains_as_one_process(load(results, "two", "clip_hybrid"), load(results, "ref", "clip"))


def test_under_bf16_mixed_a_replicated_scalar_stays_fp32_and_the_logits_bf16(results: dict[str, Path]) -> None:
    # FSDP's MixedPrecisionPolicy casts only what it manages; torch's type promotion keeps `logit_scale.exp() * ...`
    # in the activations' bf16, as if the scalar had been cast
    run = load(results, "two", "clip_bf16")
    assert run["dtypes"] == {"logits": "torch.bfloat16", "logit_scale": "torch.float32"}
    assert run["losses"] == pytest.approx(load(results, "ref", "clip")["losses"], rel=2e-2)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("run", ["two", "ref"])
def test_replicated_parameters_round_trip_through_checkpoints(results: dict[str, Path], fmt: str, run: str) -> None:
    # saved by the 2-rank `clip` run after 3 steps; resumed on 2 ranks, and on 1 rank of the strategy (resharded)
    saved = load(results, "two", "clip")["end"]
    resumed = load(results, run, f"clip_resume_{fmt}")["start"]
    assert max_weight_diff(resumed["weights"], saved["weights"]) == 0.0
    assert torch.equal(resumed["weights"]["model.logit_scale"], saved["weights"]["model.logit_scale"])
    momentum = [state["optimizer"]["state"]["model.logit_scale"]["momentum_buffer"] for state in (resumed, saved)]
    assert torch.equal(*momentum)


@pytest.mark.parametrize("name", MODELS)
def test_meta_device_build_equals_the_eager_build(results: dict[str, Path], name: str) -> None:
    # built in configure_model() on the meta device under the strategy on 2 ranks, against the eager build in one
    # process with the same seed, before the first step
    meta = load(results, "two", f"{name}_meta")
    assert "error" not in meta, meta.get("error")
    eager = load(results, "ref", name)["start"]["weights"]
    assert meta["start"]["weights"].keys() == eager.keys()
    for key, value in eager.items():
        assert torch.equal(meta["start"]["weights"][key], value), key
