"""``ShardedStrategy(compile=...)``: each FSDP unit compiled with inductor trains to the eager losses on 2 ranks,
with and without activation checkpointing; the setting is checked at construction.

One launch of ``tests/compile_run.py`` runs all four scenarios (inductor compiles one graph per scenario kind on the
CPU; about 45 s here, most of it the compile).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import run_script

from lightning_shard import ShardedStrategy, ShardingConfig

# Inductor fuses and reorders fp32 arithmetic; measured difference to eager: 5e-7.
TOL = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("compile") / "results.json"
    run_script("tests/compile_run.py", "--devices", "2", "--out", str(out), timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_compiled_blocks_train_to_the_eager_losses(results: dict[str, Any], checkpointing: bool) -> None:
    suffix = "_checkpointing" if checkpointing else ""
    eager, compiled = results[f"eager{suffix}"], results[f"compiled{suffix}"]
    assert len(compiled["losses"]) == len(eager["losses"]) == 3
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=TOL)
    # Both blocks compiled in place, into one graph shared by the two (fullgraph=True: no break anywhere).
    assert (compiled["compiled_blocks"], compiled["graphs"], compiled["graph_breaks"]) == (2, 1, 0)
    assert (eager["compiled_blocks"], eager["graphs"]) == (0, 0)


@pytest.mark.parametrize("scenario", ["compiled_selective", "compiled_memory_budget"])
def test_selective_and_memory_budget_checkpointing_under_compile(results: dict[str, Any], scenario: str) -> None:
    # per-op selective checkpointing traced into the blocks' graph, and the partitioner's memory budget instead of
    # checkpoint wrappers: the eager losses, one graph for both blocks, no break
    run = results[scenario]
    assert run["losses"] == pytest.approx(results["eager"]["losses"], abs=TOL)
    assert (run["compiled_blocks"], run["graphs"], run["graph_breaks"]) == (2, 1, 0)


def test_compile_setting_forms() -> None:
    assert ShardingConfig().compile_kwargs is None
    assert ShardingConfig(compile=True).compile_kwargs == {}
    assert ShardingConfig(compile={"mode": "max-autotune", "fullgraph": True}).compile_kwargs == {
        "mode": "max-autotune",
        "fullgraph": True,
    }


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("yes", TypeError, r"`compile='yes'` must be True, False or a dict"),
        ({"full_graph": True}, ValueError, r"\['full_graph'\] are not torch.compile arguments"),
        ({"mode": "fastest"}, ValueError, r"refused by torch.compile: Unrecognized mode=fastest"),
        ({"backend": "nope"}, ValueError, r"refused by torch.compile: .*Invalid backend: 'nope'"),
        ({"mode": "max-autotune", "options": {}}, ValueError, r"Either mode or options"),
    ],
)
def test_bad_compile_settings_raise_at_construction(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedStrategy(compile=value)
