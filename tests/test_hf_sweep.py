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


@pytest.mark.parametrize("family", list(FAMILIES))
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
        result = f"FAIL: {'; '.join(failed)[:160]}" if failed else "pass"
        diffs = ("-", "-") if "error" in found else (f"{found['loss']:.2e}", f"{found['init']:.3g}")
        task = f"{FAMILIES[name].category}: {runs['ref'].get('class', '?')}"
        rows.append(f"| {name} | {task} | {runs['ref'].get('params', '-')} | {result} | {diffs[0]} | {diffs[1]} |")
    with capsys.disabled():
        print("\n| family | task | params | result | max loss diff | init diff |\n|---|---|---|---|---|---|")
        print("\n".join(rows))
    covered = [name for name, runs in sweep.items() if runs["ref"].get("phase") != "build"]
    assert len(covered) >= MIN_FAMILIES, f"{len(covered)} families swept: {sorted(set(sweep) - set(covered))} failed"
