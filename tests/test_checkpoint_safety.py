"""Checkpoints never lose or mix data, with real 2-rank jobs: one torchrun launch of ``tests/checkpoint_safety_run.py``
(the Trainer and Fabric in the same processes; 30-70 s on 2 busy cores), its scenarios checked here one by one.

Each scenario failed on bc620f2: a save into a results folder deleted it (Trainer and Fabric, sharded and full); a
load, a ``fit(ckpt_path=...)`` and a ``convert`` right after a background save read the checkpoint before it; rank
1's ``wait()`` returned before rank 0 had published; ``save_last="link"`` linked to unpublished checkpoints; and a
rank whose view of the path differed went into other collectives than rank 0 (the job hung).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_torchrun_result

from lightning_shard import ShardedCheckpointIO
from lightning_shard.checkpoint import convert
from lightning_shard.checkpoint.publish import STAGING_DIR
from lightning_shard.cli import main as cli_main

# The module: `lightning_shard.checkpoint.convert` is also the name of the function the package exports.
convert_module = importlib.import_module("lightning_shard.checkpoint.convert")

FORMATS = ("sharded", "full")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the 2 ranks found, scenario by scenario."""
    out = tmp_path_factory.mktemp("safety")
    return run_torchrun_result(2, "tests/checkpoint_safety_run.py", "--out", str(out), timeout=300)


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
@pytest.mark.parametrize("kind", FORMATS)
def test_a_save_into_a_folder_that_is_not_a_checkpoint_is_refused_on_every_rank(
    ranks: list[dict[str, Any]], front_end: str, kind: str
) -> None:
    found = [rank[f"{front_end}_saves_into_a_results_folder"][kind] for rank in ranks]
    assert found[0]["kept"]  # the user's notes.txt and sub/data.txt are still there
    for rank in found:
        assert rank["error"].startswith("IsADirectoryError: ")
        assert (
            f"results-{front_end}-{kind} is a directory that is not a checkpoint written by lightning-shard (it holds "
            "notes.txt, sub): it is never deleted or replaced. Write to another path"
        ) in rank["error"]


def test_fabric_loads_and_converts_the_save_just_made_in_the_background(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        found = rank["fabric_loads_right_after_a_background_save"]
        assert found["loaded_step"] == 2 and found["loaded_weights_vs_step_2"] == 0.0  # main: step 1's, off by 0.01
        assert found["after_wait"] == 3  # main: rank 1's wait returned before rank 0 published (2 on disk)
        assert found["converted_step"] == 4  # main: 3


def test_fit_resumes_from_the_save_just_made_in_the_background(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["trainer_resumes_right_after_a_background_save"] == {"saved_step": 2, "resumed_from": 2}


def test_last_link_points_only_at_published_checkpoints(ranks: list[dict[str, Any]]) -> None:
    found = ranks[0]["last_link_under_background_saves"]
    # At the start of each of steps 2-4: no link yet or a link to a published checkpoint (main: to one being written).
    assert found["seen"] and all(is_link and published for is_link, published in found["seen"]), found
    assert found["last"] == "epoch=0-step=4.ckpt"


def test_ranks_that_see_the_path_differently_load_by_rank_zeros_view(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["ranks_that_see_the_path_differently"] == {"error": "ok", "difference": 0.0}


# ------------------------------------------------------------------ convert, in this process


@pytest.mark.parametrize("direction", ["full -> sharded", "sharded -> full"])
def test_convert_never_replaces_what_appears_at_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    # A folder that appears at the output while converting (another job, a user) stays: on main the sharded output
    # was exchanged with it and the folder deleted.
    source, out = tmp_path / "source.ckpt", tmp_path / "out.ckpt"
    checkpoint = {"state_dict": {"w": torch.ones(4)}, "pytorch-lightning_version": "2.6.6"}
    if direction == "full -> sharded":
        ShardedCheckpointIO().save_full(checkpoint, source)
        writes, name = dcp, "save"
    else:
        ShardedCheckpointIO().save_sharded(checkpoint, source)
        writes, name = convert_module, "write_full_file"
    write = getattr(writes, name)

    def write_then_someone_fills_the_output(*args: Any, **kwargs: Any) -> None:
        write(*args, **kwargs)
        (out / "notes.txt").parent.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(writes, name, write_then_someone_fills_the_output)
    assert cli_main(["convert", str(source), str(out)]) == 2
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    monkeypatch.setattr(writes, name, write)
    assert cli_main(["convert", str(source), str(out)]) == 2  # an existing output is refused before any work
    (out / "notes.txt").unlink()
    out.rmdir()
    assert convert(source, out) == direction and not (tmp_path / STAGING_DIR).exists()
