"""Preemption with real processes and real signals, with the strategy alone (no ``PreemptionCheckpoint`` added: the one
``ShardedStrategy(preemption=True)`` installs) under Lightning's launcher, a simulated SLURM job (one process per task
with srun's variables, a fake ``scontrol`` first on ``PATH``) and torchrun with ``--max-restarts``, and a Fabric loop
with ``fabric.strategy.preemptible()``. Every job runs under a timeout (a hang is a failure).

The runs train the tiny GPT example (``tests/preemption_run.py``: 2 ranks, FULL_SHARD, the example's mid-epoch
resumable data, 8 steps per epoch) for 12 steps, and every interrupted-then-resumed run is compared with one
uninterrupted run of the same 2-rank job: the mean loss over ranks of each optimizer step must be equal (tolerance 0:
the same sharded computation on the same data, restored from exactly the saved weights, AdamW states, LR schedule
and data position). 75-215 s on the 2 shared cores, depending on their load (reference 11-32 s, Lightning launcher
15-43 s, SLURM 18-54 s for its 2 jobs, torchrun 30-89 s for its 3 attempts); the in-process tests take seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import REPO, clean_env, free_port, leftover_processes, srun_env, torchrun_args
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn

from lightning_shard import PREEMPTED_EXIT_CODE, PreemptionCheckpoint, ShardedStrategy, is_sharded_checkpoint
from lightning_shard.checkpoint import read_sharded_keys
from lightning_shard.checkpoint.publish import STAGING_DIR, staging_path
from lightning_shard.core.preemption import StopVote, _requeue_slurm_job
from lightning_shard.trainer.preemption import StrategyPreemptionCheckpoint

SCRIPT = "tests/preemption_run.py"
STEPS = 12
TIMEOUT = 240  # seconds for any one job; each takes 20-45 s on 2 busy cores


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``command`` in a session of its own (so that a timeout can kill all it started), output to ``log``."""
    with open(log, "w") as handle:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def finish(procs: list[subprocess.Popen], logs: list[Path], deadline: float) -> list[int]:
    """Wait for every process until ``deadline`` (``time.monotonic()``); on a timeout kill them all and fail."""
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            output = "\n".join(log.read_text()[-4000:] for log in logs)
            pytest.fail(f"still running after the timeout (a hang):\n{output}")
    return [proc.returncode for proc in procs]


def run(command: list[str], env: dict[str, str], out: Path) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"job{len(list(out.glob('job*.log')))}.log"
    (rc,) = finish([start(command, env, log)], [log], time.monotonic() + TIMEOUT)
    return rc, log.read_text()


def losses(out: Path) -> list[dict]:
    """What rank 0 recorded: ``{"attempt", "step", "loss"}`` per optimizer step, in order."""
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def assert_equal_to_reference(recorded: list[dict], reference: dict[int, float], steps: list[int]) -> None:
    assert [r["step"] for r in recorded] == steps, [r["step"] for r in recorded]
    differences = {r["step"]: r["loss"] - reference[r["step"]] for r in recorded}
    assert all(d == 0.0 for d in differences.values()), differences


def global_step(checkpoint: Path) -> int:
    assert is_sharded_checkpoint(checkpoint), checkpoint
    return read_sharded_keys(checkpoint, {"global_step"})["global_step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted 2-rank run (Lightning's launcher): the loss of each of the 12 steps."""
    out = tmp_path_factory.mktemp("reference")
    rc, output = run([sys.executable, SCRIPT, "--out", str(out), "--steps", str(STEPS)], clean_env(), out)
    assert rc == 0, output[-4000:]
    recorded = losses(out)
    assert [r["step"] for r in recorded] == list(range(1, STEPS + 1))
    return {r["step"]: r["loss"] for r in recorded}


# ------------------------------------------------------------------ real jobs


def test_lightning_launcher_stops_at_an_agreed_step_after_the_save_in_flight(tmp_path: Path, reference: dict) -> None:
    """Rank 1 gets SIGTERM during the validation after step 4, rank 0 SIGTERM after step 5; the periodic (async)
    checkpoint of step 5 takes 1.5 s more to write. Both ranks stop after step 6 (the requests, voted at the boundary
    of step 5, are read at the next one) with the step-5 save complete and a step-6 checkpoint as `last`."""
    command = [sys.executable, SCRIPT, "--out", str(tmp_path), "--steps", str(STEPS), "--every", "5", "--async-save",
               "--slow-save", "1.5", "--act", "0:1:4:val-SIGTERM", "--act", "0:0:5:SIGTERM"]  # fmt: skip
    rc, output = run(command, clean_env(), tmp_path)
    assert rc == PREEMPTED_EXIT_CODE, output[-4000:]
    assert "[rank 1] attempt 0 step 4: val-SIGTERM" in output and "SIGTERM agreed at step 6" in output
    assert_equal_to_reference(losses(tmp_path), reference, list(range(1, 7)))  # and no step after the stop
    ckpts = tmp_path / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=5.ckpt", "last.ckpt"]  # no staging left
    assert global_step(ckpts / "epoch=0-step=5.ckpt") == 5 and global_step(ckpts / "last.ckpt") == 6
    assert not leftover_processes(str(tmp_path))


def test_slurm_requeue_after_the_checkpoint_and_the_requeued_job_resumes_exactly(
    tmp_path: Path, reference: dict
) -> None:
    """Two tasks started as srun starts them, ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default under
    SLURM). SIGUSR1 from outside reaches rank 0, then rank 1 0.3 s later, while training runs (0.5 s per step, so
    that rank 1's signal still finds it training: once the job has ended, SIGUSR1's default action kills a process).
    Both stop at one step with a complete ``hpc_ckpt_1.ckpt``; ``scontrol requeue`` runs once, after it is
    complete; nobody trains on. The requeued job (same command, ``ckpt_path=None``) resumes from it by itself,
    beside the staging a save killed half-way would leave, and its losses equal the uninterrupted run's."""
    root = tmp_path / "job"
    root.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(  # records its arguments and whether the checkpoint was complete when it ran
        f'#!/bin/sh\nif [ -f "{root}/hpc_ckpt_1.ckpt/.metadata" ]; then state=complete; else state=missing; fi\n'
        f'echo "$* $state" >> "{tmp_path}/scontrol.log"\n'
    )
    scontrol.chmod(0o755)
    command = [sys.executable, SCRIPT, "--out", str(root), "--steps", str(STEPS)]

    def job(*args: str, signal_after_step: int | None = None) -> tuple[list[int], str]:
        port, index = free_port(), len(list(tmp_path.glob("task*.log"))) // 2
        logs = [tmp_path / f"task{index * 2 + rank}.log" for rank in (0, 1)]
        envs = [
            dict(srun_env(rank, port, job_name="preempt"), PATH=f"{bin_dir}:{os.environ['PATH']}") for rank in (0, 1)
        ]
        procs = [start([*command, *args], env, log) for env, log in zip(envs, logs, strict=True)]
        deadline = time.monotonic() + TIMEOUT
        if signal_after_step is not None:
            marker = root / f"reached_{signal_after_step}"
            while not marker.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
                time.sleep(0.05)
            os.kill(procs[0].pid, signal.SIGUSR1)
            time.sleep(0.3)
            os.kill(procs[1].pid, signal.SIGUSR1)
        codes = finish(procs, logs, deadline)
        return codes, "\n".join(log.read_text() for log in logs)

    codes, output = job("--step-sleep", "0.5", "--marker-step", "3", signal_after_step=3)
    assert codes == [PREEMPTED_EXIT_CODE] * 2, output[-6000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242 complete\n"
    stopped = losses(root)
    stop_step = global_step(root / "hpc_ckpt_1.ckpt")
    assert 3 < stop_step < STEPS and stopped[-1]["step"] == stop_step, (stop_step, stopped)
    assert_equal_to_reference(stopped, reference, list(range(1, stop_step + 1)))

    # A later save to hpc_ckpt_2 killed half-way: its staging must not count as a checkpoint (nor as version 23291).
    leftover = root / STAGING_DIR / "hpc_ckpt_2.ckpt.tmp-3f2a9b1c"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    codes, output = job()  # the requeued job: the same command, as SLURM starts it again
    assert codes == [0, 0], output[-6000:]
    assert f"Restoring states from the checkpoint path at {root / 'hpc_ckpt_1.ckpt'}" in output
    resumed = losses(root)[len(stopped) :]
    assert_equal_to_reference(resumed, reference, list(range(stop_step + 1, STEPS + 1)))
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242 complete\n"  # the finished job: no requeue


def test_torchrun_restarts_resume_from_the_newest_complete_checkpoint(tmp_path: Path, reference: dict) -> None:
    """``torchrun --max-restarts 2``, ``fit(ckpt_path="last")``, async saves every 4 steps. Attempt 0: rank 1 is
    SIGKILLed in the step-8 save, after writing its shards. Attempt 1 resumes from step 4 (the half-written step-8
    checkpoint is never picked), and both ranks get SIGTERM after step 9 at once (as torchrun forwards it): both stop
    after step 10 with a checkpoint as `last` and exit with status 75, which torchrun restarts too. Attempt 2 resumes
    from step 10 and finishes."""
    env = dict(clean_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see docs/multinode.md, "Preemption"
    command = [sys.executable, *torchrun_args(2), "--max-restarts=2", SCRIPT, "--out", str(tmp_path), "--steps",
               str(STEPS), "--async-save", "--ckpt-path", "last", "--act", "0:1:7:killsave",
               "--act", "1:0:9:SIGTERM", "--act", "1:1:9:SIGTERM"]  # fmt: skip
    rc, output = run(command, env, tmp_path)
    assert rc == 0, output[-6000:]
    assert (
        f"SIGKILL after writing shards into {tmp_path / 'ckpts' / STAGING_DIR / 'epoch=0-step=8.ckpt.tmp-'}" in output
    )
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in output  # attempt 1's stop, as torchrun reports it
    recorded = losses(tmp_path)
    for attempt, steps in {0: range(1, 9), 1: range(5, 11), 2: range(11, STEPS + 1)}.items():
        assert_equal_to_reference([r for r in recorded if r["attempt"] == attempt], reference, list(steps))
    ckpts = tmp_path / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=12.ckpt", "last.ckpt"]
    assert not leftover_processes(str(tmp_path))


def test_a_fabric_loop_stops_at_agreed_steps_and_resumes_exactly(tmp_path: Path) -> None:
    """``tests/fabric_preemption_run.py`` (the toy model, 10 steps, Lightning's launcher): uninterrupted; then stopped
    by SIGTERM on rank 1 after step 3 and on rank 0 after step 4 (both stop after step 4: rank 1's request, voted at
    the boundary of step 3, is read at the next); resumed and stopped by SIGTERM on both ranks after step 7 (both stop
    after step 8); resumed to the end. The losses equal the uninterrupted run's (tolerance 0)."""
    script = [sys.executable, "tests/fabric_preemption_run.py", "--steps", "10"]
    rc, output = run([*script, "--out", str(tmp_path / "reference")], clean_env(), tmp_path / "reference")
    assert rc == 0, output[-4000:]
    reference = {r["step"]: r["loss"] for r in losses(tmp_path / "reference")}
    job = tmp_path / "job"
    for acts, code, steps in [
        (["1:3:SIGTERM", "0:4:SIGTERM"], PREEMPTED_EXIT_CODE, range(1, 5)),
        (["0:7:SIGTERM", "1:7:SIGTERM"], PREEMPTED_EXIT_CODE, range(5, 9)),
        ([], 0, range(9, 11)),
    ]:
        rc, output = run([*script, "--out", str(job), *(f"--act={act}" for act in acts)], clean_env(), job)
        assert rc == code, output[-4000:]
        assert_equal_to_reference(losses(job)[steps.start - 1 :], reference, list(steps))
        assert global_step_of_fabric(job / "ckpts" / "last.ckpt") == (steps.stop - 1 if code else 8)
    assert not leftover_processes(str(tmp_path))


def global_step_of_fabric(checkpoint: Path) -> int:
    return read_sharded_keys(checkpoint, {"step"})["step"]


# ------------------------------------------------------------------ in one process


def test_staging_is_invisible_to_lightnings_checkpoint_scans(tmp_path: Path) -> None:
    """Lightning's hpc numbering reads the digits after any "ckpt_" in a folder's entries and `ckpt_path="last"`
    takes entries named last*.ckpt: a save's staging (and a replaced checkpoint moved aside) must be neither."""
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    (tmp_path / "last.ckpt").mkdir()
    for name in ("hpc_ckpt_2.ckpt", "last.ckpt"):
        staging = staging_path(tmp_path / name)
        staging.mkdir(parents=True)
        staging.with_name(f"{name}.old-3f2a9b1c").mkdir()
    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert trainer._checkpoint_connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_1.ckpt")
    saver = ModelCheckpoint(dirpath=tmp_path)
    assert saver._find_last_checkpoints(trainer) == {str(tmp_path / "last.ckpt")}


def test_handler_only_notes_the_request_and_a_second_ctrl_c_interrupts() -> None:
    requests = PreemptionCheckpoint().requests
    requests.note(signal.SIGUSR1, None)
    requests.note(signal.SIGTERM, None)
    assert requests.requested == signal.SIGUSR1 and not requests.requeue_requested  # no SLURM auto-requeue
    requests = PreemptionCheckpoint().requests
    requests.note(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        requests.note(signal.SIGINT, None)


def sharded_trainer(tmp_path: Path, callbacks: list, **strategy: object) -> Trainer:
    return Trainer(strategy=ShardedStrategy(**strategy), accelerator="cpu", devices=1, default_root_dir=tmp_path,
                   callbacks=callbacks, logger=False, enable_progress_bar=False)  # fmt: skip


def fit_started(trainer: Trainer) -> None:
    """What `fit` does before the callbacks' `setup`: attach the model, connect it to the strategy."""
    model = BoringModel()
    model.trainer = trainer
    trainer.strategy.connect(model)
    trainer.state.fn = TrainerFn.FITTING


def preemption_callbacks(trainer: Trainer) -> list[PreemptionCheckpoint]:
    return [callback for callback in trainer.callbacks if isinstance(callback, PreemptionCheckpoint)]


def test_the_strategy_adds_preemption_unless_the_user_has_it_or_switches_it_off(tmp_path: Path) -> None:
    trainer = sharded_trainer(tmp_path, [])
    fit_started(trainer)
    (added,) = preemption_callbacks(trainer)
    assert type(added) is StrategyPreemptionCheckpoint and added.requests.signals == [signal.SIGTERM]
    fit_started(trainer)  # a second fit adds no second one
    assert preemption_callbacks(trainer) == [added]
    own = PreemptionCheckpoint(signals=["SIGUSR2"], exit_code=99)
    trainer = sharded_trainer(tmp_path, [own, ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    fit_started(trainer)
    assert preemption_callbacks(trainer) == [own]  # the user's settings win
    trainer = sharded_trainer(tmp_path, [], preemption=False)
    fit_started(trainer)
    assert preemption_callbacks(trainer) == []
    with pytest.raises(TypeError, match="`preemption='yes'` must be a bool"):
        ShardedStrategy(preemption="yes")


@pytest.mark.parametrize("slurm", [False, True], ids=["torchrun", "slurm-auto-requeue"])
def test_the_stop_handlers_replace_lightnings_as_soon_as_lightning_registers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm: bool
) -> None:
    # Lightning's SLURM handler saves and broadcasts inside the handler, its SIGTERM handler broadcasts there: from
    # the moment Lightning registers them (before the sanity check and the data loaders), ours are in their place.
    if slurm:
        for name, value in srun_env(0, free_port(), tasks_per_node=1).items():
            monkeypatch.setenv(name, value)
    trainer = sharded_trainer(tmp_path, [], **({"cluster_environment": SLURMEnvironment()} if slurm else {}))
    fit_started(trainer)
    (callback,) = preemption_callbacks(trainer)
    callback.setup(trainer, BoringModel(), "fit")
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer._signal_connector.register_signal_handlers()  # where `fit` calls it
        expected = {signal.SIGTERM, signal.SIGUSR1} if slurm else {signal.SIGTERM}
        assert {signum for signum in before if signal.getsignal(signum) == callback.requests.note} == expected
        trainer._signal_connector.teardown()  # at the end of `fit`: the handlers found before it
        assert {signum: signal.getsignal(signum) for signum in before} == before
        trainer._signal_connector.register_signal_handlers()  # a later `validate`: Lightning's own again
        assert signal.getsignal(signal.SIGTERM) != callback.requests.note
    finally:
        trainer._signal_connector.teardown()


def test_the_strategys_stop_checkpoint_goes_where_the_run_resumes_from(tmp_path: Path) -> None:
    callback = StrategyPreemptionCheckpoint()
    for savers, expected in [
        ([ModelCheckpoint(dirpath=tmp_path / "a", save_last=True)], tmp_path / "a" / "last.ckpt"),
        ([ModelCheckpoint(dirpath=tmp_path / "b")], tmp_path / "b" / "epoch=0-step=0.ckpt"),  # no stale `last`
        ([], tmp_path / "epoch=0-step=0.ckpt"),
    ]:
        trainer = sharded_trainer(tmp_path, savers)
        fit_started(trainer)
        callback.setup(trainer, BoringModel(), "fit")  # asks for no `last` ModelCheckpoint
        assert callback._stop_checkpoint_path(trainer) == str(expected)


def test_stop_vote_outcome_is_lag_exchanges_late() -> None:
    vote = StopVote(lag=2)
    vote.open()
    ballots = [(0, 0), (15, 1), (0, 0), (0, 0), (10, 0)]
    assert [vote.exchange(ballot) for ballot in ballots] == [(0, 0), (0, 0), (0, 0), (15, 1), (0, 0)]
    assert vote.close() == (10, 0)  # the two still in flight
    vote = StopVote()  # lag 1, PreemptionCheckpoint's
    vote.open()
    assert [vote.exchange(ballot) for ballot in ballots] == [(0, 0), (0, 0), (15, 1), (0, 0), (0, 0)]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"signals": ["SIGNOPE"]}, ValueError, "'SIGNOPE' is not a signal"),
        ({"signals": ["SIGKILL"]}, ValueError, "SIGKILL cannot be handled"),
        ({"exit_code": 143}, ValueError, "128 \\+ n"),
    ],
)
def test_settings_are_checked(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PreemptionCheckpoint(**kwargs)


@pytest.mark.parametrize("saver", [None, ModelCheckpoint(save_last=False)], ids=["no-modelcheckpoint", "no-last"])
def test_a_stop_checkpoint_without_a_last_to_resume_from_is_refused_at_setup(tmp_path: Path, saver) -> None:
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[PreemptionCheckpoint(), *([saver] if saver else [])],
        enable_checkpointing=saver is not None,
        logger=False,
        enable_progress_bar=False,
    )
    (callback,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    with pytest.raises(ValueError, match="save_last=True"):
        callback.setup(trainer, None, "fit")


def test_torchrun_restarts_through_the_shared_rendezvous_store_are_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[PreemptionCheckpoint(), ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        logger=False,
        enable_progress_bar=False,
    )
    (callback,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets unless the variable below is 1
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        callback.setup(trainer, None, "fit")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.setup(trainer, None, "fit")


def test_requeue_runs_scontrol_for_this_job_and_reports_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\n[ "$2" = 4242 ] || {{ echo "Invalid job id" >&2; exit 1; }}\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert _requeue_slurm_job() is None
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")  # an array task is requeued as JOB_TASK
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert _requeue_slurm_job() == "`scontrol requeue 77_3` exited with 1: Invalid job id"
    assert (tmp_path / "calls").read_text() == "requeue 4242\nrequeue 77_3\n"
