"""A load right after setup: materialisation replays nothing it writes (``lightning_shard.init.init_skip``) nor
writes the memory the load writes, and the resumed run still equals the uninterrupted one. One 2-rank launch of
``init_skip_run.py`` (conftest)."""

from __future__ import annotations

import pytest
import torch
from conftest import max_weight_diff
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_shard.init.init_skip import _tiled

# The output layer's own weight: drawn by the eager build, then replaced by the tie to the input layer's (jumped over)
DISCARDED = 16 * 16
RESUMED = [
    ("resume", "straight"),
    ("resume_full", "straight"),
    ("resume_last", "straight"),
    ("fabric_told", "fabric"),  # `fabric.setup` inside `checkpoint_follows`
]


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
    # the checkpoint stores every tensor whole: each gets the sentinel in its first and last elements only (checked
    # after the load), so no memory the load writes is written before it; a fresh start fills what it replays
    assert 0 < results[scenario]["sentinel"] <= 2 * results[scenario]["local_tensors"]


def test_a_tensor_the_checkpoint_lacks_is_replayed_as_in_the_eager_build(init_skip_result: dict) -> None:
    results = init_skip_result
    # the new head comes last in construction: the draws before it are jumped over; only its own are drawn
    head_elements = results["eager_head"].numel() + 1  # its weight and bias
    assert sum(results["partial"]["drawn_by_rank"]) == head_elements
    assert max(results["partial_fresh"]["drawn_by_rank"]) < results["eager_drawn"]["new_head"] - DISCARDED
    assert results["partial"]["replayed"] > 0
    assert torch.equal(results["partial"]["head"], results["eager_head"])


def test_a_fresh_start_splits_the_draws_between_the_ranks(init_skip_result: dict) -> None:
    drawn = init_skip_result["straight"]["drawn_by_rank"]
    kept = init_skip_result["eager_drawn"]["plain"] - DISCARDED
    # each rank draws its share (whole blocks of 16 around its rows, and the small replicated buffer), not the model
    assert 0 < min(drawn) <= max(drawn) < kept <= sum(drawn) < kept + 16 * 2 * len(drawn)


def test_a_tensor_the_load_left_unwritten_is_named(init_skip_result: dict) -> None:
    assert "loaded after setup holds ['blocks.1.1.weight']" in init_skip_result["unwritten"]


def _entry(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in chunks],
    )


def test_only_a_tensor_whose_saved_chunks_tile_it_counts_as_stored_whole() -> None:
    # stored whole: the load writes every element of every rank's shard, so the sentinel goes at the edges only
    assert _tiled(_entry((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))]))
    assert _tiled(_entry((3,), [((0,), (3,))]))
    # stored in part (a chunk missing) or not a tensor: the whole sentinel and the whole check stay
    assert not _tiled(_entry((4, 2), [((0, 0), (2, 2))]))
    assert not _tiled(BytesStorageMetadata())


def test_fabric_without_the_announcement_initialises_everything(init_skip_result: dict) -> None:
    """Fabric cannot know that a `fabric.load` follows its setup: told nothing, it initialises the whole model."""
    results = init_skip_result
    assert results["fabric_resume"]["drawn"] == results["fabric"]["drawn"] > 0
    assert max_weight_diff(results["fabric_resume"]["weights"], results["fabric"]["weights"]) == 0.0


def test_a_model_left_to_an_announced_load_refuses_to_run_or_be_saved_before_it(init_skip_result: dict) -> None:
    seen = init_skip_result["fabric_unloaded"]
    assert seen["forward"].startswith("RuntimeError: `fabric.setup` left the model tensors that ")
    assert "Call `fabric.load(" in seen["forward"]
    assert seen["save"].startswith("RuntimeError: Saving ") and "Load the checkpoint first" in seen["save"]
    assert seen["forward_after_load"] == "ok"
