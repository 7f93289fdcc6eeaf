"""A load right after setup: materialisation replays nothing it writes (``lightning_shard.init.init_skip``), and the
resumed run still equals the uninterrupted one. One 2-rank launch of ``init_skip_run.py`` (conftest)."""

from __future__ import annotations

import pytest
import torch
from conftest import max_weight_diff

RESUMED = [
    ("resume", "straight"),
    ("resume_full", "straight"),
    ("resume_last", "straight"),
]
# Fabric initialises at setup (it cannot know a `fabric.load` follows), so its resume replays: not in the list.


@pytest.mark.parametrize(("scenario", "straight"), RESUMED)
def test_resume_replays_nothing_and_equals_the_uninterrupted_run(
    init_skip_result: dict, scenario: str, straight: str
) -> None:
    results = init_skip_result
    assert results[straight]["drawn"] > 0 and results[straight]["replayed"] > 0  # a fresh start does the work
    # the checkpoint holds every tensor: no op replayed, no random number drawn
    assert results[scenario]["drawn"] == 0
    assert results[scenario]["replayed"] == 0
    assert max_weight_diff(results[scenario]["weights"], results[straight]["weights"]) == 0.0


def test_a_tensor_the_checkpoint_lacks_is_replayed_as_in_the_eager_build(init_skip_result: dict) -> None:
    results = init_skip_result
    # the new head comes last in construction: every draw before it is needed for its values, no more
    assert results["partial"]["drawn"] == results["partial_fresh"]["drawn"] > 0
    assert 0 < results["partial"]["replayed"] < results["partial_fresh"]["replayed"]
    assert torch.equal(results["partial"]["head"], results["eager_head"])


def test_a_tensor_the_load_left_unwritten_is_named(init_skip_result: dict) -> None:
    assert "loaded after setup holds ['blocks.1.1.weight']" in init_skip_result["unwritten"]
