"""Stopping a sharded run from outside without losing a step: :class:`PreemptionCheckpoint`.

Clusters stop jobs with signals (SLURM ``--signal=USR1@90`` and ``SIGTERM``, ``SIGTERM`` from torchrun and Kubernetes,
``SIGINT`` from a terminal), reaching the ranks at different moments or only some of them. Lightning answers them
inside the signal handler - a checkpoint save and a broadcast, collectives that every rank then starts at a
different moment: a rank whose handler waits in ``save_checkpoint`` while another sits in FSDP's all-gather is a
deadlock, and a handler that runs in the middle of the optimizer step saves half-updated weights.

Here the handlers only note the signal. At each optimizer-step boundary every rank puts its note into a tiny
all-reduce started without waiting and reads the result of the previous boundary's (:class:`StopVote`), so all ranks
learn of the request at the same step, one step after the first rank noted it. Then every rank writes one checkpoint
of that step through the strategy's normal (atomic) save, waits for any background save still in flight, rank 0
requeues the SLURM job if that was asked for, and the job ends with :data:`PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_shard.checkpoint import ShardedCheckpointIO

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": stopped on request, resumable from the
# checkpoint it wrote. Not 0 (a Kubernetes Job or a shell loop would take that for a finished run) and not 128 + n
# (which says the signal killed the process).
PREEMPTED_EXIT_CODE = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class Preempted(SIGTERMException):
    """Raised on every rank once the stop checkpoint is complete; its ``code`` becomes the process's exit status.

    A ``SystemExit`` (as Lightning's own :class:`SIGTERMException`): ``except Exception`` in a training script does not
    swallow it, and the interpreter exits with the status without a traceback.
    """


class StopVote:
    """Whether any rank has been asked to stop, agreed by all ranks ``lag`` votes after it was cast.

    Every rank calls :meth:`exchange` at the same optimizer-step boundaries. It starts an all-reduce (max) of this
    rank's ballot - two int32 - without waiting, and returns the outcome of the one started ``lag`` exchanges earlier,
    which has had whole steps to finish: all ranks see the same outcome at the same boundary, and a rank that reaches
    a boundary first does not wait there for the others. The all-reduce runs on a gloo group of its own: on GPUs it
    costs no device synchronisation, and it never queues behind FSDP's collectives.

    Example:
        >>> vote = StopVote()
        >>> vote.open()  # without a process group: this process's ballot is the outcome
        >>> vote.exchange((15, 0)), vote.exchange((0, 0))
        ((0, 0), (15, 0))
    """

    def __init__(self, lag: int = 1) -> None:
        self.lag = lag
        self._group: dist.ProcessGroup | None = None
        self._distributed = False
        self._in_flight: deque[tuple[torch.Tensor, dist.Work | None]] = deque()

    def open(self) -> None:
        """Call on every rank before the first exchange (creating the group is a collective)."""
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self._distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")
        self._in_flight.clear()

    def exchange(self, ballot: tuple[int, int]) -> tuple[int, int]:
        """Cast ``ballot``; return the element-wise maximum over ranks of the ballots cast ``lag`` exchanges ago
        (``(0, 0)`` for the first ``lag`` exchanges)."""
        tensor = torch.tensor(ballot, dtype=torch.int32)
        work = (
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            if self._distributed
            else None
        )
        self._in_flight.append((tensor, work))
        return self._outcome(self._in_flight.popleft()) if len(self._in_flight) > self.lag else (0, 0)

    def close(self) -> tuple[int, int]:
        """Wait for every vote in flight (call on every rank); the element-wise maximum of their outcomes."""
        outcomes = [self._outcome(vote) for vote in self._in_flight]
        self._in_flight.clear()
        return (max((o[0] for o in outcomes), default=0), max((o[1] for o in outcomes), default=0))

    def abandon(self) -> None:
        """Forget the votes in flight without waiting: after an error, other ranks may never complete them."""
        self._in_flight.clear()

    @staticmethod
    def _outcome(vote: tuple[torch.Tensor, dist.Work | None]) -> tuple[int, int]:
        tensor, work = vote
        if work is not None:
            work.wait()
        return int(tensor[0]), int(tensor[1])


class PreemptionCheckpoint(Callback):
    """Stop on a signal at the next optimizer-step boundary all ranks agree on, with a checkpoint of that step.

    A signal in ``signals`` reaching any rank - all of them, some, at different moments, during validation - is noted
    by its handler (nothing else runs there) and agreed by all ranks at the next optimizer-step boundary
    (:class:`StopVote`: one all-reduce of 8 bytes per step, read a step after it started, so that no rank waits
    for it; see ``benchmarks/preemption.py``). Then every rank:

    1. writes a checkpoint of that step through the strategy's usual atomic save, having waited for a background
       (``async_save``) save in flight, and waits until it is complete;
    2. under SLURM, if the requeue signal (``SLURMEnvironment(requeue_signal=...)``, ``SIGUSR1``) reached any rank and
       ``auto_requeue`` is on: rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` once the checkpoint is complete;
    3. ends training by raising :class:`Preempted`: the process exits with ``exit_code`` (default
       :data:`PREEMPTED_EXIT_CODE`, 75) - except the worker processes that Lightning's own launcher started (local
       ranks > 0 when no cluster started the processes), which exit with 0, so that the launching process's child
       observer does not take their exit for a crash and kill it; that process exits with ``exit_code``.

    Where the checkpoint goes, so that the restarted job resumes from it by itself:

    * under SLURM, Lightning's next ``hpc_ckpt_N.ckpt`` in ``default_root_dir``: a requeued (or resubmitted) job
      that calls ``fit`` with ``ckpt_path=None`` resumes from the newest of them, as Lightning does under SLURM;
    * elsewhere (torchrun, Lightning's launcher), the ``last`` checkpoint of the first ``ModelCheckpoint``
      (``dirpath/last.ckpt``), which ``fit(ckpt_path="last")`` resumes: a torchrun that restarts its workers
      (``--max-restarts``) or a pod that restarts runs the same command and continues from it. That
      ``ModelCheckpoint`` needs ``save_last=True`` (so that ``last`` stays current between stops) and a fixed
      ``dirpath`` (one under a logger's ``version_N`` differs in the next run).

    Checkpoints are atomic (see :class:`~lightning_shard.ShardedCheckpointIO`): a save killed half-way (``SIGKILL``
    after the grace period) leaves the previous checkpoint in place and nothing Lightning's ``hpc``/``last`` scans
    would pick up.

    Lightning calls callbacks in list order and its checkpoint callbacks last: list this one after callbacks whose
    ``on_train_batch_end`` should still see the last step. That step's logged metrics are not written (the loop
    stops before Lightning's logger step); a validation due at that step runs in neither job.

    Args:
        signals: names or numbers of the signals that request a stop. Under SLURM with ``auto_requeue`` its requeue
            signal is added. ``SIGINT`` a second time raises ``KeyboardInterrupt`` as usual (a stop without a
            checkpoint). Lightning's handlers stay in place for the signals not listed.
        exit_code: the exit status that says "stopped on request, resumable".

    Example:
        >>> import lightning as L
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> trainer = L.Trainer(  # doctest: +SKIP
        ...     strategy="fully_sharded",
        ...     callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True), PreemptionCheckpoint()],
        ... )
        >>> trainer.fit(model, ckpt_path="last")  # doctest: +SKIP
    """

    def __init__(self, signals: Sequence[str | int] = DEFAULT_SIGNALS, exit_code: int = PREEMPTED_EXIT_CODE) -> None:
        self.signals = [_signal_from(value) for value in signals]
        if not isinstance(exit_code, int) or not 0 < exit_code < 128:
            raise ValueError(f"`exit_code={exit_code!r}`: use 1..127 (128 + n means 'killed by signal n').")
        self.exit_code = exit_code
        self.vote = StopVote()
        self._requested: signal.Signals | None = None  # set by the handlers
        self._requeue_signal: signal.Signals | None = None
        self._requeue_requested = False
        self._announced = False
        self._last_step = 0

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # A request noted in an earlier fit's last step (which needed no stop) is not this fit's.
        self._requested, self._requeue_requested, self._announced = None, False, False
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionCheckpoint installs signal handlers, which Python allows only in the main thread; "
                "run `Trainer.fit` in the main thread (Lightning's default launcher does)."
            )
        if not isinstance(_cluster_environment(trainer), SLURMEnvironment):
            _last_checkpoint_saver(trainer)  # raises now, not when the cluster stops the job
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank_zero_warn(
                "torchrun restarts these workers on failure, and its rendezvous store is shared across restarts: the "
                "restarted workers can read the previous attempt's addresses and fail or hang while connecting "
                "(pytorch/pytorch#135712). Run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."
            )

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install_handlers(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its own handlers just before the loops start (after `setup`) and restores the ones it
        # found when fit ends; installed here, ours replace Lightning's for these signals for the loops' duration.
        self._install_handlers(trainer)
        self.vote.open()
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: no optimizer step, the weights are not at a step boundary
        self._last_step = trainer.global_step
        if self._requested is not None and not self._announced:
            self._announced = True
            log.info(f"[rank {trainer.global_rank}] {self._requested.name} received: stopping at an agreed step")
        signum, requeue = self.vote.exchange((int(self._requested or 0), int(self._requeue_requested)))
        if signum:
            self._stop(trainer, signal.Signals(signum), bool(requeue))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Training is complete: a request that arrived in its last step needs no checkpoint of its own.
        self.vote.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.vote.abandon()

    # ------------------------------------------------------------------ signals

    def _install_handlers(self, trainer: pl.Trainer) -> None:
        handled = list(self.signals)
        environment = _cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self._requeue_signal = environment.requeue_signal
            handled.append(environment.requeue_signal)
        for signum in set(handled):
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        """The handler: records the request and nothing else (no collective, no I/O, no lock)."""
        received = signal.Signals(signum)
        if received == signal.SIGINT and self._requested == signal.SIGINT:
            signal.default_int_handler(signum, frame)  # Ctrl+C twice: stop now, without a checkpoint
        self._requested = self._requested or received
        self._requeue_requested = self._requeue_requested or received == self._requeue_signal

    # ------------------------------------------------------------------ the stop

    def _stop(self, trainer: pl.Trainer, signum: signal.Signals, requeue: bool) -> None:
        # Every rank stops at this step with the same votes in flight: finish them, or a gloo thread still holding one
        # at interpreter exit aborts the process ("terminate called without an active exception", rc -6).
        self.vote.close()
        path = _stop_checkpoint_path(trainer)
        rank_zero_info(f"PreemptionCheckpoint: {signum.name} agreed at step {trainer.global_step}; saving {path}")
        trainer.save_checkpoint(path, weights_only=False)
        if isinstance(trainer.strategy.checkpoint_io, ShardedCheckpointIO):
            trainer.strategy.checkpoint_io.wait()  # a background save: until its files are published
        trainer.strategy.barrier("PreemptionCheckpoint.saved")  # rank 0 publishes; every rank waits for it
        if requeue:
            # Before any rank exits: srun --kill-on-bad-exit would end rank 0 before it requeues.
            error = trainer.strategy.broadcast(_requeue_slurm_job() if trainer.is_global_zero else None)
            if error:
                raise RuntimeError(f"{error}. The checkpoint {path} is complete: resubmit the job to resume from it.")
        environment = _cluster_environment(trainer)
        launched_here = environment is not None and not environment.creates_processes_externally
        rank_zero_info(
            f"PreemptionCheckpoint: stopped at step {trainer.global_step}, checkpoint {path} complete"
            f"{', job requeued' if requeue else ''}; exiting with status {self.exit_code}"
        )
        raise Preempted(0 if launched_here and trainer.local_rank > 0 else self.exit_code)


def _cluster_environment(trainer: pl.Trainer) -> ClusterEnvironment | None:
    return getattr(trainer.strategy, "cluster_environment", None)  # single-device strategies have none


def _signal_from(value: str | int) -> signal.Signals:
    try:
        signum = signal.Signals[value] if isinstance(value, str) else signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(
            f"`signals`: {value!r} is not a signal on this platform (e.g. 'SIGTERM', 'SIGUSR1')."
        ) from None
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(
            f"`signals`: {signum.name} cannot be handled; a job killed with it resumes from its last complete "
            "checkpoint (`ckpt_path='last'`, or 'hpc' under SLURM)."
        )
    return signum


def _last_checkpoint_saver(trainer: pl.Trainer) -> ModelCheckpoint:
    savers = [callback for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    if not savers or not savers[0].save_last:
        raise ValueError(
            "PreemptionCheckpoint writes the stop checkpoint as the `last` checkpoint of the first ModelCheckpoint, "
            "which `fit(ckpt_path='last')` resumes from, but "
            + ("the trainer has no ModelCheckpoint" if not savers else "that ModelCheckpoint has `save_last` off")
            + ". Add `ModelCheckpoint(dirpath=..., save_last=True)` (under SLURM the stop checkpoint goes to "
            "`default_root_dir/hpc_ckpt_N.ckpt` instead)."
        )
    return savers[0]


def _stop_checkpoint_path(trainer: pl.Trainer) -> str:
    if isinstance(_cluster_environment(trainer), SLURMEnvironment):
        # What Lightning's SLURM handler saves, and what `ckpt_path=None` resumes from under SLURM.
        return _CheckpointConnector.hpc_save_path(trainer.default_root_dir)
    saver = _last_checkpoint_saver(trainer)
    metrics = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
    return saver.format_checkpoint_name(metrics, filename=saver.CHECKPOINT_NAME_LAST)


def _requeue_slurm_job() -> str | None:
    """``scontrol requeue`` this job (as Lightning's SLURM handler does); the error, or ``None`` when it worked."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        return f"SLURM job id {job_id!r} is not a number"
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`scontrol requeue {job_id}` failed: {error}"
    if done.returncode != 0:
        return f"`scontrol requeue {job_id}` exited with {done.returncode}: {(done.stderr or done.stdout).strip()}"
    log.info(f"Requeued SLURM job {job_id}")
    return None
