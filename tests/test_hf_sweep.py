"""The architecture sweep: every transformers family of ``hf_sweep_models.FAMILIES`` (decoders, MoE, state-space,
encoders, encoder-decoders, vision, speech, multimodal), each built from its library defaults shrunk to a tiny
config, trained under ``Trainer(strategy=ShardedStrategy())`` with default settings on 2 gloo ranks against one
process (``tests/hf_sweep_run.py``: one 2-rank launch running every family in sequence, one reference process).

Per family: the meta-device build (``configure_model()``) equals the eager build tensor by tensor, buffers
included; 3 steps' losses within 1e-5 of one process; unsharded parameters and buffers equal on both ranks after
them; a sharded checkpoint resumed into an eager build on 2 ranks starts from exactly the saved weights and its 2
steps' losses are the uninterrupted run's within 1e-5. The table of figures is printed by the last test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import max_weight_diff, run_script

pytest.importorskip("transformers")
from hf_sweep_models import FAMILIES  # noqa: E402
from hf_sweep_run import STEPS  # noqa: E402

TOL = 1e-5
MIN_FAMILIES = 50
# Families failing for a class of silent damage that issue 34 names, fixed on other branches: strict, so that each
# turns into a failure saying "remove me" once the fix is merged.
SPLIT_TIE = "the MLM decoder tied to the embeddings, split by the default wrap, crashes FSDP: issue 34 part 1"
SHARED_EMBEDDING = "the shared embedding tied to embed_tokens and lm_head starts elsewhere on meta: issue 34 part 1"
SCALAR_HOOK = "the 0-d logit_scale's gradient averaging is lost at materialisation: issue 34 part 2"
BATCH_NORM = "BatchNorm running statistics differ across ranks: issue 34 part 6"
NO_OPTIMIZER_STATE = "a parameter that never had a gradient has no optimizer state, resume crashes: issue 35 part 4"
KNOWN: dict[str, str] = {
    **dict.fromkeys(["bert", "roberta", "modernbert", "xlm-roberta"], SPLIT_TIE),
    **dict.fromkeys("t5 mt5 umt5 switch_transformers bart mbart plbart pegasus marian".split(), SHARED_EMBEDDING),
    **dict.fromkeys(["blenderbot", "m2m_100", "nllb-moe", "longt5", "prophetnet"], SHARED_EMBEDDING),
    **dict.fromkeys(["clip", "chinese_clip", "altclip", "clipseg"], SCALAR_HOOK),
    **dict.fromkeys(["resnet", "regnet", "levit", "cvt"], BATCH_NORM),
    # unused in the task's forward: dinov2's mask_token, poolers of masked-LM models, Longformer's global attention
    **dict.fromkeys("dinov2 squeezebert fnet longformer big_bird".split(), NO_OPTIMIZER_STATE),
    # the resume crash hides a second class, seen in the 3 steps before it
    "wav2vec2-conformer": f"{NO_OPTIMIZER_STATE}; its conformer {BATCH_NORM}",
    "blip": f"{NO_OPTIMIZER_STATE}; {SCALAR_HOOK}",
}


def _marks(family: str) -> list[pytest.MarkDecorator]:
    reason = f"{KNOWN.get(family)} (strict: once it passes, remove {family!r} from KNOWN)"
    return [pytest.mark.xfail(strict=True, reason=reason)] if family in KNOWN else []


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("sweep")
    names = list(FAMILIES)
    run_script("tests/hf_sweep_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), *names,
               timeout=600)  # fmt: skip
    run_script("tests/hf_sweep_run.py", "--devices", "2", "--out", str(out / "two"), *names, timeout=900)
    return {name: {run: _load(out / run / f"{name}.pt") for run in ("two", "ref")} for name in names}


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False) if path.exists() else {"error": "no result (the run ended early)"}


def figures(two: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """What the sweep measures for one family: the largest differences against the reference and between ranks."""
    if "error" in ref or "error" in two:
        return {"error": f"{ref['error']}" if "error" in ref else f"{two.get('phase', '?')}: {two['error']}"}
    start, ref_start = two["start"], ref["start"]
    losses = two["losses"] + two["resumed_losses"]
    return {
        "init": max(max_weight_diff(start[kind], ref_start[kind]) for kind in ("weights", "buffers")),
        "loss": max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)),
        "ranks": two["spread"]["max"],
        "ranks_where": two["spread"]["where"],
        "resume": max_weight_diff(two["resumed_start"]["weights"], two["end"]["weights"]),
    }


def problems(found: dict[str, Any]) -> list[str]:
    """The checks a family's figures fail."""
    if "error" in found:
        return [found["error"]]
    checks = {
        f"the meta-device build differs from the eager build by {found['init']:.3g}": found["init"] == 0.0,
        f"2 ranks' losses differ from one process's by {found['loss']:.3g}": found["loss"] <= TOL,
        f"the ranks' copies differ by {found['ranks']:.3g} in {found['ranks_where']}": found["ranks"] == 0.0,
        f"the resumed weights differ from the saved ones by {found['resume']:.3g}": found["resume"] == 0.0,
    }
    return [message for message, passed in checks.items() if not passed]


@pytest.mark.parametrize("family", [pytest.param(name, marks=_marks(name)) for name in FAMILIES])
def test_family_trains_on_two_ranks_as_in_one_process(sweep: dict[str, dict[str, Any]], family: str) -> None:
    # meta build vs eager build; 3 steps, then 2 after a sharded save and resume, against one process's 5; the
    # ranks' unsharded parameters and buffers after the 3 steps; the resumed weights against the saved ones
    reference = sweep[family]["ref"]
    if reference.get("phase") == "build" and "error" in reference:  # not in this transformers, or needs a package
        pytest.skip(f"{family} cannot be built here: {reference['error']}")
    assert problems(figures(**sweep[family])) == []
    assert len(sweep[family]["two"]["losses"]) == STEPS


def test_the_sweep_covers_at_least_50_families(sweep: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture) -> None:
    rows = []
    for name, runs in sweep.items():
        found = figures(**runs)
        failed = problems(found)
        result = f"FAIL ({KNOWN.get(name, 'not a known class')}): {'; '.join(failed)[:160]}" if failed else "pass"
        diffs = ("-", "-") if "error" in found else (f"{found['loss']:.2e}", f"{found['init']:.3g}")
        task = f"{FAMILIES[name].category}: {runs['ref'].get('class', '?')}"
        rows.append(f"| {name} | {task} | {runs['ref'].get('params', '-')} | {result} | {diffs[0]} | {diffs[1]} |")
    with capsys.disabled():
        print("\n| family | task | params | result | max loss diff | init diff |\n|---|---|---|---|---|---|")
        print("\n".join(rows))
    covered = [name for name, runs in sweep.items() if runs["ref"].get("phase") != "build"]
    assert len(covered) >= MIN_FAMILIES, f"{len(covered)} families swept: {sorted(set(sweep) - set(covered))} failed"
