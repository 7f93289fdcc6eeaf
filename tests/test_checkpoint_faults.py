"""Failed saves name their cause and path on every rank and leave the last good checkpoint exact; a flipped byte in
any kind of stored content is refused at load naming the file and what it holds (one launch of
``checkpoint_faults_run.py`` for all cases); a killed save's leftovers go at the next save, load or launch."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoint_faults_run import holds_nothing
from conftest import run_torchrun_result
from torch.distributed.checkpoint import FileSystemReader

from lightning_shard.checkpoint.io import ShardedCheckpointIO
from lightning_shard.checkpoint.publish import STAGING_DIR, restore_interrupted_in, staging_path

CAUSES = {"EIO": "Input/output error", "EACCES": "Permission denied", "ENOSPC": "No space left on device",
          "EROFS": "Read-only file system"}  # fmt: skip


@contextlib.contextmanager
def small_tmpfs(folder: Path) -> Iterator[Path | None]:
    """A 2 MiB tmpfs at ``folder`` (None where this process may not mount one: not root, no mount command)."""
    folder.mkdir()
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)]).returncode == 0
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], bool, Path]:
    """Each rank's results, whether the mount cases ran, and the folder holding the checkpoints."""
    out = tmp_path_factory.mktemp("faults")
    with small_tmpfs(out / "tmpfs") as tmpfs:
        extra = ("--tmpfs", str(tmpfs)) if tmpfs is not None else ()
        ranks = run_torchrun_result(2, "tests/checkpoint_faults_run.py", "--out", str(out), *extra, timeout=400)
    return ranks, bool(extra), out


def test_a_failed_save_names_cause_and_path_on_every_rank_and_keeps_the_last_checkpoint(faults) -> None:
    ranks, mounted, _ = faults
    cases = ranks[0]["failed_saves"]
    expected = {"EIO", "EACCES"} | ({"ENOSPC", "EROFS"} if mounted else set())
    assert {case.split("/")[1] for case in cases} == expected
    for case in cases:
        fault = case.split("/")[1]
        for rank in ranks:
            found = rank["failed_saves"][case]
            assert found["error"].startswith("CheckpointSaveError") and CAUSES[fault] in found["error"], (case, found)
            assert f"{case.split('/')[0]}/last.ckpt" in found["error"]
            assert found["leftovers"] == [] and found["loaded_vs_good"] == 0.0, (case, found)
    if not mounted:
        pytest.skip("a full disk and a read-only mount need root and `mount` (a tmpfs); only the injected errors ran")


def test_a_flipped_byte_is_refused_naming_the_file_and_what_it_holds(faults) -> None:
    ranks, _, _ = faults
    kinds = {key.rsplit("/", 1)[0] for key in ranks[0]["flipped_bytes"]}
    assert {"sharded/metadata", "sharded/model", "sharded/optimizer", "sharded/extra state", "full/tensors"} <= kinds
    for rank in ranks:
        for case, error in rank["flipped_bytes"].items():
            name = case.rsplit("/", 1)[1].split("@")[0]
            assert error.startswith("CheckpointIntegrityError") and name in error, (case, error)
            if "/model/" in case or "/optimizer/" in case:
                assert f"'{case.split('/')[1]}." in error, (case, error)  # the tensor's key
            if case.startswith("full/tensors"):
                assert "(tensor " in error, (case, error)


def test_one_process_reading_a_two_rank_checkpoint_refuses_a_flipped_byte(faults) -> None:
    # Resharded 2 -> 1: every tensor read through FileSystemReader's slices, not in place.
    path = faults[2] / "flip-sharded.ckpt"
    shard = path / "__1_0.distcp"
    original = shard.read_bytes()
    metadata = FileSystemReader(str(path)).read_metadata()
    spans = [(info.offset, info.offset + info.length) for index, info in metadata.storage_data.items()
             if info.relative_path == shard.name and not holds_nothing(metadata, index)]  # fmt: skip
    refused = 0
    for start, end in spans[:: max(1, len(spans) // 16)]:
        offset = (start + end) // 2
        damaged = bytearray(original)
        damaged[offset] ^= 0xFF
        shard.write_bytes(damaged)
        with pytest.raises(Exception, match="Damaged checkpoint file .*__1_0.distcp"):
            ShardedCheckpointIO().load_checkpoint(path)
        refused += 1
    shard.write_bytes(original)
    assert refused >= 16 and ShardedCheckpointIO().load_checkpoint(path)["model"]


def killed_save_leftover(path: Path) -> Path:
    leftover = staging_path(path, shared=False)
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"\0" * 1024)
    return leftover


@pytest.mark.parametrize("moment", ["save", "load", "launch"])
def test_a_killed_saves_leftovers_go_at_the_next_save_load_or_launch(tmp_path: Path, moment: str) -> None:
    path = tmp_path / "last.ckpt"
    io = ShardedCheckpointIO()
    io.save_full({"step": 1, "w": torch.ones(2), "pytorch-lightning_version": "2.6"}, path)
    leftover = killed_save_leftover(path)
    if moment == "save":
        io.save_full({"step": 2, "w": torch.ones(2), "pytorch-lightning_version": "2.6"}, path)
    elif moment == "load":
        assert io.load_checkpoint(path)["step"] == 1
    else:
        restore_interrupted_in(tmp_path)
    assert not leftover.exists() and not (tmp_path / STAGING_DIR).exists()
