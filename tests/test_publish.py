"""What a save may replace, and publishing a finished save (``lightning_shard.checkpoint.target`` / ``.publish``).

One process, no process group, no training: tiny checkpoints written by ``ShardedCheckpointIO`` itself. A kill in the
middle of publishing is a forked process that ends with ``os._exit`` just before one of publishing's filesystem
operations (nothing after it runs: no ``finally``, no cleanup); what the next load and the next save see is checked
in the test process, with the exchange on and switched off (filesystems without ``RENAME_EXCHANGE``: NFS, macOS).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardedCheckpointIO
from lightning_shard.checkpoint import publish as publish_module
from lightning_shard.checkpoint.layout import StateLayout
from lightning_shard.checkpoint.publish import STAGING_DIR, exchange, publish, staging_path
from lightning_shard.checkpoint.target import Found, Target
from lightning_shard.trainer.model_checkpoint import restore_checkpoint_folders

FABRIC = StateLayout("model", ("optimizer",))


def checkpoint(step: int) -> dict[str, Any]:
    """A Trainer checkpoint of one weight; ``step`` tells them apart."""
    return {"state_dict": {"w": torch.full((4,), float(step))}, "step": step, "pytorch-lightning_version": "2.6.6"}


def save_sharded(path: Path, step: int) -> Path:
    ShardedCheckpointIO().save_sharded(checkpoint(step), path)
    return path


def step_at(path: Path) -> int:
    return ShardedCheckpointIO().load_checkpoint(path)["step"]


def user_folder(path: Path) -> dict[str, bytes]:
    """A folder that is not a checkpoint (results, logs): what a save must never touch; returns its files."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("notes")
    (path / "sub" / "data.txt").write_text("data")
    return files_in(path)


def files_in(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ what a save may replace


SAVES = {
    "sharded": lambda path: ShardedCheckpointIO().save_sharded(checkpoint(2), path),
    "full": lambda path: ShardedCheckpointIO().save_full(checkpoint(2), path),
}


@pytest.mark.parametrize("save", SAVES)
def test_a_save_refuses_what_is_not_a_checkpoint_of_this_package_before_writing(tmp_path: Path, save: str) -> None:
    # On main a save here deleted the folder recursively (a full save replaced it with one file).
    results = tmp_path / "runs"
    before = user_folder(results)
    with pytest.raises(IsADirectoryError, match=rf"{re.escape(str(results))} is a directory that is not a checkpoint "
                       r"written by lightning-shard \(it holds notes.txt, sub\)"):  # fmt: skip
        SAVES[save](results)
    assert files_in(results) == before and not (tmp_path / STAGING_DIR).exists()  # nothing written

    # a file, a DCP folder of another program, one of ours with a file added, a torch.save of something else
    notes = tmp_path / "notes.ckpt"
    notes.write_text("notes")
    foreign_dcp = tmp_path / "foreign"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=foreign_dcp)
    added_to = save_sharded(tmp_path / "ours.ckpt", 1)
    (added_to / "README.md").write_text("which run this was")
    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, weights)
    for path, error in [(notes, FileExistsError), (foreign_dcp, IsADirectoryError), (added_to, IsADirectoryError),
                        (weights, FileExistsError)]:  # fmt: skip
        before = files_in(path) if path.is_dir() else {"": path.read_bytes()}
        with pytest.raises(error, match="is never deleted or replaced. Write to another path, or delete"):
            SAVES[save](path)
        assert (files_in(path) if path.is_dir() else {"": path.read_bytes()}) == before


def test_what_a_save_recognises_as_replaceable(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    io.save_full({"model": {"w": torch.ones(2)}, "step": 1}, tmp_path / "fabric.ckpt", FABRIC)
    io.save_full(checkpoint(1), tmp_path / "trainer.ckpt")
    save_sharded(tmp_path / "sharded.ckpt", 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "link.ckpt").symlink_to("sharded.ckpt")
    found = {name: Target.at(tmp_path / name).found for name in
             ["fabric.ckpt", "trainer.ckpt", "sharded.ckpt", "empty", "link.ckpt", "missing.ckpt"]}  # fmt: skip
    assert found == {"fabric.ckpt": Found.FULL, "trainer.ckpt": Found.FULL, "sharded.ckpt": Found.SHARDED,
                     "empty": Found.NOTHING, "link.ckpt": Found.LINK, "missing.ckpt": Found.NOTHING}  # fmt: skip
    io.save_sharded(checkpoint(2), tmp_path / "link.ckpt")  # the link replaced, not what it points to
    assert not (tmp_path / "link.ckpt").is_symlink() and step_at(tmp_path / "sharded.ckpt") == 1
    for name in found:
        io.save_sharded(checkpoint(3), tmp_path / name)
        assert step_at(tmp_path / name) == 3


def test_a_publish_rechecks_the_target_and_an_export_replaces_nothing(tmp_path: Path) -> None:
    # An async save or an export publishes minutes after its start: a folder that appeared meanwhile stays.
    path = tmp_path / "out"
    staging = save_sharded(staging_path(path, shared=False), 2)
    before = user_folder(path)
    with pytest.raises(IsADirectoryError, match="notes.txt"):
        publish(staging, path)
    assert files_in(path) == before and step_at(staging) == 2
    shutil.rmtree(path)
    save_sharded(path, 1)  # its publish clears the leftover staging of this name: stage again
    staging = save_sharded(staging_path(path, shared=False), 2)
    with pytest.raises(IsADirectoryError, match="holds a sharded checkpoint, and this writes only where there is"):
        publish(staging, path, replace=False)
    shutil.rmtree(path)
    path.mkdir()  # an empty folder: nothing is lost
    publish(staging, path, replace=False)
    assert step_at(path) == 2


def test_last_links_replace_links_and_checkpoints_only(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    target = save_sharded(tmp_path / "epoch=0-step=4.ckpt", 4)
    last = save_sharded(tmp_path / "last.ckpt", 3)  # save_last=True before, "link" now
    io.link(target, last)
    assert os.readlink(last) == target.name and step_at(last) == 4
    io.link(save_sharded(tmp_path / "epoch=0-step=6.ckpt", 6), last)
    assert os.readlink(last) == "epoch=0-step=6.ckpt" and step_at(target) == 4  # the link replaced, not its target
    before = user_folder(tmp_path / "results")
    with pytest.raises(IsADirectoryError, match="notes.txt"):
        io.link(target, tmp_path / "results")  # Lightning's own link would `shutil.rmtree` it
    assert files_in(tmp_path / "results") == before
    with pytest.warns(UserWarning, match="Not removing .*results: it is not a checkpoint"):
        io.remove_checkpoint(tmp_path / "results")
    io.remove_checkpoint(last)
    assert not os.path.lexists(last) and step_at(target) == 4


# ------------------------------------------------------------------ a kill at each step of publishing


def killed_publish(staging: Path, path: Path, before_operation: int | None, exchanges: bool = True) -> int:
    """Publish in a forked process that dies (``os._exit``) just before its ``before_operation``-th filesystem change
    (the exchange, a rename, a deletion; ``None``: it does not die); ``exchanges=False``: as on a filesystem without
    ``RENAME_EXCHANGE``. Its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: nothing here returns
        try:
            done = 0

            def trapped(operation: Any) -> Any:
                def run(*args: Any, **kwargs: Any) -> Any:
                    nonlocal done
                    done += 1
                    if done == before_operation:
                        os._exit(137)
                    return operation(*args, **kwargs)

                return run

            operations = [(os, "replace"), (os, "rename"), (shutil, "rmtree"), (Path, "rmdir"), (Path, "unlink")]
            if exchanges:
                operations.append((publish_module, "exchange"))
            else:
                publish_module.exchange = lambda a, b: False
            for owner, name in operations:
                setattr(owner, name, trapped(getattr(owner, name)))
            publish(staging, path)
        finally:
            os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture
def exchange_supported(tmp_path: Path) -> None:
    a, b = save_sharded(tmp_path / "probe" / "a", 1), save_sharded(tmp_path / "probe" / "b", 2)
    if not exchange(a, b):
        pytest.skip(f"{tmp_path}'s filesystem cannot exchange two paths in one rename")


# (exchange available, killed before operation k) -> the step under the name when the next load comes: the old
# checkpoint (1) until the new one (2) is in place. Without the exchange: 1 move aside, 2 move in, 3 delete the old,
# 4 remove the staging folder; with it: 1 exchange, 2 delete the old, 3 remove the staging folder.
KILLS = {(False, 1): 1, (False, 2): 1, (False, 3): 2, (False, 4): 2, (False, None): 2,
         (True, 1): 1, (True, 2): 2, (True, 3): 2, (True, None): 2}  # fmt: skip


@pytest.mark.parametrize(("exchanges", "killed_before"), KILLS, ids=[f"exchange={e}-kill={k}" for e, k in KILLS])
def test_a_kill_at_any_step_of_a_publish_leaves_the_old_or_the_new_checkpoint(
    tmp_path: Path, exchanges: bool, killed_before: int | None, request: pytest.FixtureRequest
) -> None:
    if exchanges:
        request.getfixturevalue("exchange_supported")
    last = save_sharded(tmp_path / "last.ckpt", 1)
    staging = save_sharded(staging_path(last, shared=False), 2)
    status = killed_publish(staging, last, killed_before, exchanges)
    assert status == (137 if killed_before else 0)
    between_renames = (exchanges, killed_before) == (False, 2)
    assert os.path.lexists(last) is not between_renames  # on main this checkpoint was never put back

    # The next load (or save) puts a moved-aside checkpoint back and reads the old or the new one.
    assert step_at(last) == KILLS[exchanges, killed_before]
    # The next save replaces it and clears what the kill left in the staging folder.
    ShardedCheckpointIO().save_sharded(checkpoint(3), last)
    assert step_at(last) == 3 and not (tmp_path / STAGING_DIR).exists()


def test_a_full_checkpoint_replaces_a_file_in_one_rename(tmp_path: Path) -> None:
    last = tmp_path / "last.ckpt"
    ShardedCheckpointIO().save_full(checkpoint(1), last)
    staging = staging_path(last, shared=False)
    ShardedCheckpointIO().save_full(checkpoint(2), staging)
    # Read with torch.load: a load through the checkpoint IO would clean the staging up as a killed save's leftover.
    assert (
        killed_publish(staging, last, before_operation=1) == 137 and torch.load(last, weights_only=False)["step"] == 1
    )
    assert killed_publish(staging, last, before_operation=2) == 137 and step_at(last) == 2


def test_a_launch_puts_a_moved_aside_checkpoint_back_before_lightning_looks_for_last(tmp_path: Path) -> None:
    # Lightning resolves `ckpt_path="last"` by listing the folder before the strategy runs: the launcher restores first.
    last = save_sharded(tmp_path / "last.ckpt", 1)
    staging = save_sharded(staging_path(last, shared=False), 2)
    assert killed_publish(staging, last, before_operation=2, exchanges=False) == 137
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[saver], logger=False, enable_progress_bar=False)
    assert saver._find_last_checkpoints(trainer) == set()  # what Lightning would resume from: nothing
    assert restore_checkpoint_folders(trainer) == [last]
    assert saver._find_last_checkpoints(trainer) == {str(last)} and step_at(last) == 1
