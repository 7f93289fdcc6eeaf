"""Whatever goes into a checkpoint comes out, on every rank (issue 35, defects 1-4): extra entries with DTensors or
per-rank values, weight-averaging checkpoints written after fit or after an exception, parameters without optimizer
state. Two launches for all cases: ``checkpoint_contents_run.py save`` on 2 ranks, ``load`` on 1."""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import pytest
import torch
from conftest import run_script, torchrun_args

from lightning_shard.checkpoint.extra_state import EXTRA_KEY, decode_extra, encode_extra

SCRIPT = "tests/checkpoint_contents_run.py"


def _result(out: str) -> dict[str, Any]:
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("contents")
    saved = _result(run_script(*torchrun_args(2), SCRIPT, "save", str(out), timeout=600))
    loaded = _result(run_script(*torchrun_args(1), SCRIPT, "load", str(out), timeout=300))
    return {"two_ranks": saved, "one_rank": loaded}


def test_random_state_trees_round_trip_on_every_rank(results: dict[str, dict[str, Any]]) -> None:
    """48 seeded trees (nested containers, empty ones, Python objects, plain tensors the same on every rank or not,
    DTensors of several placements and dtypes), sharded and full: each rank loads what it saved."""
    assert results["two_ranks"]["trees"] == 48
    assert results["two_ranks"]["tree_failures"] == []


def test_random_state_trees_load_at_another_world_size(results: dict[str, dict[str, Any]]) -> None:
    """The 2-rank files at 1 rank: rank 0's values, DTensors whole."""
    assert results["one_rank"]["loaded"] == 48
    assert results["one_rank"]["tree_failures"] == []


def test_fabric_extra_copy_of_a_sharded_weight_keeps_every_shard(results: dict[str, dict[str, Any]]) -> None:
    """The reported case: ``extra["w_copy"]`` came back as a (8, 4) DTensor holding one rank's (4, 4)."""
    result = results["two_ranks"]
    assert result["w_copy_is_dtensor"] and result["w_copy_local_equal"] and result["w_copy_whole_equal"]


def test_trainer_on_save_checkpoint_extras_round_trip(results: dict[str, dict[str, Any]]) -> None:
    """A second model's state dict, a hand-written EMA (DTensors) and per-rank RNG states added by the
    LightningModule's ``on_save_checkpoint``, back in ``on_load_checkpoint``: 2 ranks, then 1, both formats."""
    assert results["two_ranks"]["trainer_extras_equal"] == {"sharded": True, "full": True}
    assert results["one_rank"]["trainer_extras_equal"] == {"sharded": True, "full": True}


def test_averaged_checkpoint_after_fit_has_the_fit_layout(results: dict[str, dict[str, Any]]) -> None:
    """``trainer.save_checkpoint`` after a fit with ``EMAWeightAveraging``: the model's weights under
    ``state_dict``, the averaged copy whole under ``averaged_model``, nothing of Lightning's layout; validating it
    gives the loss of the model after fit (which holds the averaged weights)."""
    result = results["two_ranks"]
    assert result["after_fit_keys_lightning"] == []
    assert result["after_fit_state_dict_is_model"] == 0.0
    assert result["after_fit_averaged_is_copy"] == 0.0
    assert result["validate_after_fit_checkpoint"] == pytest.approx(result["validate_after_fit"], abs=1e-7)


def test_rescue_save_after_an_exception_has_the_fit_layout(results: dict[str, dict[str, Any]]) -> None:
    """A save after an exception ended fit holds the trained weights and the copy, exactly what the uninterrupted
    run's checkpoint of the same step holds."""
    result = results["two_ranks"]
    assert result["rescue_keys_lightning"] == []
    assert result["rescue_state_dict_is_model"] == 0.0
    assert result["rescue_vs_step4_checkpoint"] == 0.0


def test_evaluating_a_moved_aside_averaged_checkpoint_evaluates_the_averaged_weights(
    results: dict[str, dict[str, Any]],
) -> None:
    """``validate(ckpt_path=...)`` of a checkpoint an interrupted publish moved aside: put back, then the averaged
    copy evaluated, as for the intact checkpoint (base 5f9ef12: the trained weights)."""
    result = results["two_ranks"]
    assert result["validate_step4_moved_aside"] == pytest.approx(result["validate_step4"], abs=1e-7)


def test_parameters_without_optimizer_state_resume_exactly(results: dict[str, dict[str, Any]]) -> None:
    """An unused parameter and one used only from the step of the save on: resumed at step 4 (sharded and full),
    equal to the uninterrupted 6-step run (base 5f9ef12: ``Missing key ... state.mask_token.step``)."""
    assert results["two_ranks"]["late_parameters_resumed_vs_uninterrupted"] == {"sharded": 0.0, "full": 0.0}


def test_entries_the_same_on_every_rank_keep_their_format() -> None:
    """Without DTensors or per-rank values nothing moves: plain ``torch.load`` readers see what they saw."""
    checkpoint = {"state_dict": {}, "loops": {"step": torch.tensor(3)}, "callbacks": {}}
    assert encode_extra(checkpoint, {"state_dict"}, full=False) == checkpoint


def test_per_rank_entries_at_another_world_size_warn_and_take_their_rank_modulo() -> None:
    """A per-rank entry saved at 2 ranks, read by one process: rank 0's, with a warning naming it."""

    def record(value: int) -> dict[str, Any]:
        buffer = io.BytesIO()
        pickle.Pickler(buffer).dump({"seed": value})
        return {"pickle": buffer.getvalue(), "tensors": {}}

    saved = {EXTRA_KEY: {"world_size": 2, "per_rank": {"rng": {"0": record(10), "1": record(11)}}}}
    with pytest.warns(UserWarning, match=r"\['rng'\].*world size 2"):
        assert decode_extra(saved, None) == {"rng": {"seed": 10}}
