"""Reliability with real 2-process jobs: a failing rank ends the job promptly, an interrupted save never replaces
the last good checkpoint, and a damaged or mismatched checkpoint raises an error naming the file or key on every
rank. Scenarios live in ``tests/fault_run.py``; every job runs under a timeout and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, leftover_processes, run_script, torchrun_args

from lightning_shard import ShardedCheckpointIO, is_sharded_checkpoint
from lightning_shard.checkpoint.integrity import CheckpointIntegrityError, mismatch_problems
from lightning_shard.checkpoint.publish import STAGING_DIR

SCRIPT = "tests/fault_run.py"
JOB_TIMEOUT = 150  # a hang fails the test long before the 60 s process-group timeout could be masked
PROMPT = 60  # seconds within which a failing job must be over (the process-group timeout is 60 s, default 30 min)


def launch(launcher: str, *args: str, timeout: float = JOB_TIMEOUT) -> tuple[int, str, float]:
    """Run ``fault_run.py *args`` on 2 ranks with Lightning's launcher or torchrun; return (rc, output, seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if launcher == "torchrun":
        command = [sys.executable, *torchrun_args(2), SCRIPT, *args]
    else:
        command = [sys.executable, SCRIPT, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{launcher} job `{' '.join(args)}` still running after {timeout} s:\n{output[-6000:]}")
    return proc.returncode, output, time.monotonic() - start


def staged(folder: Path) -> list[Path]:
    """What saves into ``folder`` left in its staging folder."""
    return sorted((folder / STAGING_DIR).glob("*")) if (folder / STAGING_DIR).exists() else []


def assert_failed_promptly(rc: int, output: str, seconds: float, out: Path, *expected: str) -> None:
    assert rc != 0, output[-4000:]
    assert seconds < PROMPT, f"the job took {seconds:.0f} s to end:\n{output[-4000:]}"
    for text in expected:
        assert text in output, f"{text!r} not in the output:\n{output[-4000:]}"
    assert "finished without the injected fault" not in output
    assert not leftover_processes(str(out)), leftover_processes(str(out))


# ------------------------------------------------------------------ a rank that raises ends the job


@pytest.mark.parametrize(
    ("launcher", "where", "rank"),
    [
        ("lightning", "fit", 1),
        ("lightning", "fit", 0),
        ("torchrun", "fit", 1),
        ("lightning", "validate", 1),
    ],
)
def test_rank_that_raises_ends_the_job(tmp_path: Path, launcher: str, where: str, rank: int) -> None:
    out = tmp_path / f"{launcher}-{where}-{rank}"
    rc, output, seconds = launch(launcher, "raise", "--where", where, "--rank", str(rank), "--out", str(out))
    step = "training_step" if where == "fit" else "validation_step"
    assert_failed_promptly(rc, output, seconds, out, "Traceback", f"injected failure in {step} on rank {rank}")
    print(f"{launcher} {where} rank {rank}: rc={rc} in {seconds:.1f} s")


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_rank_that_raises_in_save_ends_the_job_and_keeps_the_last_checkpoint(tmp_path: Path, launcher: str) -> None:
    out = tmp_path / launcher
    rc, output, seconds = launch(launcher, "raise", "--where", "save", "--rank", "1", "--out", str(out))
    assert_failed_promptly(rc, output, seconds, out, "Traceback", "injected failure in save_checkpoint on rank 1")
    ckpts = out / "ckpts"
    visible = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    assert visible == ["epoch=0-step=2.ckpt", "last.ckpt"], visible
    assert ShardedCheckpointIO().load_checkpoint(ckpts / "last.ckpt")["global_step"] == 2
    hidden = [p for p in ckpts.iterdir() if p.name.startswith(".")]
    assert hidden == [ckpts / STAGING_DIR] or not hidden, hidden
    assert all(".tmp-" in p.name and not is_sharded_checkpoint(p) for p in staged(ckpts)), staged(ckpts)
    print(f"{launcher} save rank 1: rc={rc} in {seconds:.1f} s")


# ------------------------------------------------------------------ a rank killed in the middle of a save


def test_rank_killed_mid_save_keeps_last_good_checkpoint_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "killsave"
    rc, output, seconds = launch("lightning", "killsave", "--out", str(out))
    assert_failed_promptly(rc, output, seconds, out, "[rank 1] SIGKILL after writing shards")
    ckpts = out / "ckpts"
    visible = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    assert visible == ["epoch=0-step=2.ckpt", "last.ckpt"], visible  # step 4 never became `last` nor a top-k file
    # the half-written step-4 save: deleted by rank 0 when its save failed (a kill of every rank would leave it for
    # the next save, load or launch: tests/test_checkpoint_faults.py)
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".")] == []
    last = ShardedCheckpointIO().load_checkpoint(ckpts / "last.ckpt")
    assert last["global_step"] == 2
    # ... and resumes: 4 more steps from step 2, starting from exactly the saved weights
    resumed = tmp_path / "resumed"
    last_path = str(ckpts / "last.ckpt")
    run_script("tests/checkpoint_run.py", "resume", "--devices", "2", "--steps", "6", "--ckpt", last_path,
               "--out", str(resumed), timeout=JOB_TIMEOUT)  # fmt: skip
    result = torch.load(resumed / "result.pt", weights_only=False)
    assert len(result["losses"]) == 4
    for name, saved in last["state_dict"].items():
        assert torch.equal(result["start"]["weights"][name], saved), name
    print(f"killsave: rc={rc} in {seconds:.1f} s")


# ------------------------------------------------------------------ damaged and mismatched checkpoints

# case -> texts the error must contain (None: the load must succeed)
INTEGRITY_CASES: dict[str, list[str] | None] = {
    "sharded_intact": None,
    "full_intact": None,
    "sharded_truncated_shard": ["truncated shard file", "sharded_truncated_shard/__1_0.distcp", "needs at least"],
    "sharded_missing_shard": ["missing shard file", "sharded_missing_shard/__1_0.distcp"],
    "sharded_damaged_metadata": ["Damaged checkpoint metadata", "sharded_damaged_metadata/.metadata"],
    "sharded_without_metadata": ["sharded_without_metadata/.metadata", "FileNotFoundError"],
    "full_truncated": ["Damaged checkpoint file", "damaged/full_truncated", "torch.load failed"],
    "sharded_missing_keys": ["good_sharded.ckpt does not fit the model", "missing keys", "blocks.3.fc1.weight"],
    "sharded_unexpected_keys": ["good_sharded.ckpt does not fit the model", "unexpected keys", "blocks.2.fc1.weight"],
    "sharded_misshaped_key": ["mis-shaped keys", "head.weight: checkpoint (1, 16) vs model (2, 16)"],
    "full_missing_keys": ["good_full.ckpt does not fit the model", "missing keys", "blocks.3.fc1.weight"],
    "full_unexpected_keys": ["good_full.ckpt does not fit the model", "unexpected keys", "blocks.2.fc1.weight"],
    "full_misshaped_key": ["mis-shaped keys", "head.weight: checkpoint (1, 16) vs model (2, 16)"],
    "missing_path": ["FileNotFoundError: Checkpoint not found", "no_such.ckpt"],
}


@pytest.fixture(scope="module")
def integrity(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One torchrun job: save good checkpoints, then `trainer.fit(ckpt_path=...)` every case in the same processes."""
    out = tmp_path_factory.mktemp("integrity")
    rc, output, seconds = launch("torchrun", "integrity", "--out", str(out))
    assert rc == 0, output[-6000:]
    assert not leftover_processes(str(out))
    print(f"integrity job: {seconds:.1f} s")
    return out, [json.loads((out / f"integrity_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("case", sorted(INTEGRITY_CASES))
def test_load_raises_naming_file_or_key_on_every_rank(integrity: tuple[Path, list[dict]], case: str) -> None:
    _, per_rank = integrity
    expected = INTEGRITY_CASES[case]
    for rank, results in enumerate(per_rank):
        error, seconds = results[case]["error"], results[case]["seconds"]
        assert seconds < 20, f"rank {rank} took {seconds} s"
        if expected is None:
            assert error is None, f"rank {rank}: {error}"
            continue
        assert error is not None, f"rank {rank} loaded the {case} checkpoint without an error"
        for text in expected:
            assert text in error, f"rank {rank}: {text!r} not in {error!r}"


def test_load_checkpoint_in_one_process_names_the_damage(integrity: tuple[Path, list[dict]]) -> None:
    out, _ = integrity
    io = ShardedCheckpointIO()
    for case, texts in INTEGRITY_CASES.items():
        path = out / "damaged" / case
        if not path.exists():
            continue
        with pytest.raises(CheckpointIntegrityError) as caught:
            io.load_checkpoint(path)
        assert case in str(caught.value), caught.value
        assert texts[0] in str(caught.value), caught.value
    assert io.load_checkpoint(out / "good_sharded.ckpt")["global_step"] == 2


def test_load_checkpoint_names_a_damaged_full_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointIntegrityError, match="garbage.ckpt: torch.load failed"):
        ShardedCheckpointIO().load_checkpoint(path)
    half = tmp_path / "half.ckpt"
    (half).mkdir()
    with pytest.raises(CheckpointIntegrityError, match=r"half.ckpt/\.metadata"):
        ShardedCheckpointIO().load_checkpoint(half)
    shutil.rmtree(half)


def test_mismatch_problems_strictness() -> None:
    saved = {"a": torch.Size([2]), "b": torch.Size([3]), "extra": torch.Size([1])}
    expected = {"a": torch.Size([2]), "b": torch.Size([4]), "new": torch.Size([1])}
    strict = mismatch_problems(saved, expected, strict=True)
    assert any("missing keys" in p and "new" in p for p in strict)
    assert any("unexpected keys" in p and "extra" in p for p in strict)
    assert any("b: checkpoint (3,) vs model (4,)" in p for p in strict)
    assert mismatch_problems(saved, expected, strict=False) == ["mis-shaped keys: b: checkpoint (3,) vs model (4,)"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
