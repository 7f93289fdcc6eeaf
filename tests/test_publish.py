"""Publishing a finished save (``lightning_shard.checkpoint.publish``): the checkpoint's name never goes missing.

One process, no training: the saves are folders and files laid out as a sharded or full checkpoint would be. A kill
in the middle of publishing is played by an ``os.replace`` that lets the first rename through and raises at the next.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_shard.checkpoint import publish as publish_module
from lightning_shard.checkpoint.publish import exchange, publish


def sharded(path: Path, value: str) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_text(value)
    (path / "__0_0.distcp").write_text(value)
    return path


def staging_for(path: Path, token: str = "3f2a9b1c") -> Path:
    return path.parent / ".lightning_shard_staging" / f"{path.name}.tmp-{token}"


def contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in path.iterdir()}


class Killed(Exception):
    """The process ended between two renames."""


def killed_at_second_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def replace(src: os.PathLike, dst: os.PathLike) -> None:
        calls.append((src, dst))
        if len(calls) > 1:
            raise Killed(f"before renaming {src} to {dst}")
        os.rename(src, dst)

    monkeypatch.setattr(publish_module.os, "replace", replace)


@pytest.fixture
def exchange_supported(tmp_path: Path) -> None:
    a, b = sharded(tmp_path / "probe_a", "a"), sharded(tmp_path / "probe_b", "b")
    if not exchange(a, b):
        pytest.skip(f"{tmp_path}'s filesystem cannot exchange two paths in one rename")


def test_a_sharded_checkpoint_is_exchanged_with_the_one_it_replaces(
    tmp_path: Path, exchange_supported: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old order (move the old checkpoint aside, then rename the new one) left no "last.ckpt" when a kill came
    # between the two renames; the exchange is one rename, so there is no such moment.
    path = sharded(tmp_path / "last.ckpt", "step 4")
    staging = sharded(staging_for(path), "step 6")
    killed_at_second_rename(monkeypatch)
    publish(staging, path)
    assert contents(path) == {".metadata": "step 6", "__0_0.distcp": "step 6"}
    assert not staging.parent.exists()  # the old checkpoint deleted, the staging folder removed


def test_without_exchange_the_old_checkpoint_is_moved_aside_and_kept_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Filesystems without RENAME_EXCHANGE (NFS): a kill between the renames leaves the old checkpoint complete in
    # the staging folder, where Lightning's scans do not look.
    monkeypatch.setattr(publish_module, "exchange", lambda a, b: False)
    path = sharded(tmp_path / "last.ckpt", "step 4")
    staging = sharded(staging_for(path), "step 6")
    publish(staging, path)
    assert contents(path) == {".metadata": "step 6", "__0_0.distcp": "step 6"}
    assert not staging.parent.exists()

    staging = sharded(staging_for(path, "5e6f7a8b"), "step 8")
    killed_at_second_rename(monkeypatch)
    with pytest.raises(Killed):
        publish(staging, path)
    assert not path.exists()
    assert contents(staging.with_name("last.ckpt.old-5e6f7a8b")) == {".metadata": "step 6", "__0_0.distcp": "step 6"}


def test_a_full_checkpoint_replaces_the_file_in_one_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    path.write_text("step 4")
    staging = staging_for(path)
    staging.parent.mkdir()
    staging.write_text("step 6")
    killed_at_second_rename(monkeypatch)
    publish(staging, path)
    assert path.read_text() == "step 6" and not staging.parent.exists()


def test_a_link_at_the_name_is_replaced_and_its_target_kept(tmp_path: Path) -> None:
    # ModelCheckpoint(save_last="link") makes last.ckpt a link to the newest checkpoint
    target = sharded(tmp_path / "epoch=0-step=4.ckpt", "step 4")
    path = tmp_path / "last.ckpt"
    path.symlink_to(target.name)
    staging = sharded(staging_for(path), "step 6")
    publish(staging, path)
    assert not path.is_symlink() and contents(path)[".metadata"] == "step 6"
    assert contents(target)[".metadata"] == "step 4" and not staging.parent.exists()


def test_a_save_interrupted_earlier_is_cleared_by_the_next_publish(tmp_path: Path) -> None:
    path = sharded(tmp_path / "last.ckpt", "step 4")
    interrupted = sharded(staging_for(path, "0badc0de"), "half of step 5")
    staging = sharded(staging_for(path), "step 6")
    publish(staging, path)
    assert contents(path)[".metadata"] == "step 6"
    assert not interrupted.exists() and not staging.parent.exists()
