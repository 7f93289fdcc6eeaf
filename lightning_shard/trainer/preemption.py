"""Stopping a Trainer run from outside without losing a step: :class:`PreemptionCheckpoint`, the Trainer's callback
over the agreed stop both adapters share (:mod:`lightning_shard.core.preemption`: signals only noted by their
handlers, a stop agreed by all ranks at an optimizer-step boundary, the SLURM requeue, the exit code).

Takes a Trainer (its checkpoint callbacks, cluster environment and signal connector); gives a checkpoint of the
agreed step where the restarted job resumes from by itself, then the end of the run on every rank.

Without configuration: ``ShardedStrategy(preemption=True)`` (the default) adds a :class:`StrategyPreemptionCheckpoint`
to a Trainer that has no :class:`PreemptionCheckpoint` of its own (:func:`add_strategy_preemption`); a Fabric loop
gets the same from ``fabric.strategy.preemptible()`` (:mod:`lightning_shard.fabric.preemption`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_shard.core.preemption import PREEMPTED_EXIT_CODE, StopRequests, stop_after_checkpoint
from lightning_shard.core.undo import UndoLog

if TYPE_CHECKING:
    import lightning.pytorch as pl

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class PreemptionCheckpoint(Callback):
    """Stop on a signal at the next optimizer-step boundary all ranks agree on, with a checkpoint of that step.

    A signal in ``signals`` reaching any rank - all of them, some, at different moments, during validation - is noted
    by its handler (nothing else runs there) and agreed by all ranks at the next optimizer-step boundary
    (:class:`~lightning_shard.core.preemption.StopVote`: one all-reduce of 8 bytes per step, read a step after it
    started, so that no rank waits for it; see ``benchmarks/preemption.py``). Then every rank:

    1. writes a checkpoint of that step through the strategy's usual atomic save, having waited for a background
       (``async_save``) save in flight, and waits until it is complete;
    2. under SLURM, if the requeue signal (``SLURMEnvironment(requeue_signal=...)``, ``SIGUSR1``) reached any rank and
       ``auto_requeue`` is on: rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` once the checkpoint is complete;
    3. ends training by raising :class:`~lightning_shard.core.preemption.Preempted`: the process exits with
       ``exit_code`` (default :data:`~lightning_shard.core.preemption.PREEMPTED_EXIT_CODE`, 75) - except the worker
       processes that Lightning's own launcher started (local ranks > 0 when no cluster started the processes), which
       exit with 0, so that the launching process's child observer does not take their exit for a crash and kill it;
       that process exits with ``exit_code``.

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
        if not isinstance(exit_code, int) or not 0 < exit_code < 128:
            raise ValueError(f"`exit_code={exit_code!r}`: use 1..127 (128 + n means 'killed by signal n').")
        self.exit_code = exit_code
        self.requests = StopRequests([_signal_from(value) for value in signals])
        self._active = False
        self._last_step = 0

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.requests.forget()
        self._active = self._check_setup(trainer)
        if self._active:
            _install_after_lightnings_handlers(trainer, self.requests)
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank_zero_warn(
                "torchrun restarts these workers on failure, and its rendezvous store is shared across restarts: the "
                "restarted workers can read the previous attempt's addresses and fail or hang while connecting "
                "(pytorch/pytorch#135712). Run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self.requests.vote.open()
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: no optimizer step, the weights are not at a step boundary
        self._last_step = trainer.global_step
        if not self._active:
            return
        agreed = self.requests.agreed(trainer.global_rank)
        if agreed is not None:
            self._stop(trainer, *agreed)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Training is complete: a request that arrived in its last step needs no checkpoint of its own.
        if self._active:
            self.requests.vote.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.requests.vote.abandon()

    # ------------------------------------------------------------------ where and how

    def _check_setup(self, trainer: pl.Trainer) -> bool:
        """Raise now, not when the cluster stops the job, what would keep the stop from working; whether to act."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionCheckpoint installs signal handlers, which Python allows only in the main thread; "
                "run `Trainer.fit` in the main thread (Lightning's default launcher does)."
            )
        if not isinstance(_cluster_environment(trainer), SLURMEnvironment):
            _last_checkpoint_saver(trainer)
        return True

    def _stop_checkpoint_path(self, trainer: pl.Trainer) -> str:
        if isinstance(_cluster_environment(trainer), SLURMEnvironment):
            # What Lightning's SLURM handler saves, and what `ckpt_path=None` resumes from under SLURM.
            return _CheckpointConnector.hpc_save_path(trainer.default_root_dir)
        saver = _last_checkpoint_saver(trainer)
        return saver.format_checkpoint_name(_step_metrics(trainer), filename=saver.CHECKPOINT_NAME_LAST)

    def _stop(self, trainer: pl.Trainer, signum: signal.Signals, requeue: bool) -> None:
        path = self._stop_checkpoint_path(trainer)
        rank_zero_info(f"PreemptionCheckpoint: {signum.name} agreed at step {trainer.global_step}; saving {path}")
        trainer.save_checkpoint(path, weights_only=False)
        stop_after_checkpoint(trainer.strategy, path, requeue, self.exit_code)


class StrategyPreemptionCheckpoint(PreemptionCheckpoint):
    """The :class:`PreemptionCheckpoint` that ``ShardedStrategy(preemption=True)`` (the default) adds to a Trainer
    that has none: ``SIGTERM`` (torchrun, Kubernetes, Lightning's launcher, SLURM's ``scancel`` and time limit) and,
    under ``SLURMEnvironment(auto_requeue=True)``, SLURM's requeue signal stop the run at an agreed step with a
    checkpoint of it. ``SIGINT`` stays Lightning's (Ctrl+C ends an interactive run at once).

    It asks for no configuration: the stop checkpoint goes where the run resumes from by itself when it can - under
    SLURM Lightning's ``hpc_ckpt_N.ckpt``, else the ``last`` checkpoint of a ``ModelCheckpoint(save_last=True)`` - and
    otherwise beside the first ``ModelCheckpoint``'s checkpoints (or in ``default_root_dir``) under that saver's name
    for the step (a ``last`` written only at stops would go stale and be resumed after newer checkpoints); the log
    names it. A ``fit`` outside the main thread, where Python allows no signal handlers, runs without it.

    Example:
        >>> StrategyPreemptionCheckpoint().requests.signals
        [<Signals.SIGTERM: 15>]
    """

    def __init__(self) -> None:
        super().__init__(signals=("SIGTERM",))

    @override
    def _check_setup(self, trainer: pl.Trainer) -> bool:
        return threading.current_thread() is threading.main_thread()

    @override
    def _stop_checkpoint_path(self, trainer: pl.Trainer) -> str:
        savers = [callback for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
        if isinstance(_cluster_environment(trainer), SLURMEnvironment) or (savers and savers[0].save_last):
            return super()._stop_checkpoint_path(trainer)
        if savers and savers[0].dirpath:
            return savers[0].format_checkpoint_name(_step_metrics(trainer))
        return str(Path(trainer.default_root_dir) / f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt")


def add_strategy_preemption(trainer: pl.Trainer, undo_log: UndoLog) -> None:
    """Give ``trainer`` a :class:`StrategyPreemptionCheckpoint` for this run (``undo_log`` takes it out again) unless it
    has a :class:`PreemptionCheckpoint` (the user's, whose settings win).

    Example:
        >>> add_strategy_preemption(trainer, trainer.strategy.undo_log)  # doctest: +SKIP
    """
    if not any(isinstance(callback, PreemptionCheckpoint) for callback in trainer.callbacks):
        added = StrategyPreemptionCheckpoint()
        trainer.callbacks.append(added)
        undo_log.add("Trainer.callbacks", partial(trainer.callbacks.remove, added))


def _install_after_lightnings_handlers(trainer: pl.Trainer, requests: StopRequests) -> None:
    """Install ``requests``' handlers right after Lightning registers its own in this fit, in place of Lightning's for
    these signals: its SLURM handler saves a checkpoint and broadcasts inside the handler, its SIGTERM handler
    broadcasts there too - collectives that deadlock when the signal reaches the ranks at different moments. Lightning
    restores the handlers it found when the fit ends.

    The hook is an attribute of the Trainer's signal connector for this fit only: it removes itself when Lightning
    registers its handlers, and the strategy's teardown removes it where the fit ended before that (a wrong
    ``ckpt_path``). It calls the connector's class method, never an earlier hook left in place."""
    connector = trainer._signal_connector

    def register_then_install() -> None:
        vars(connector).pop("register_signal_handlers", None)  # this fit only: Lightning's own method from now on
        type(connector).register_signal_handlers(connector)
        if trainer.state.fn == TrainerFn.FITTING:
            requests.install(_cluster_environment(trainer))

    # Under another strategy (no undo log) the hook stays until the next fit replaces it or registers.
    undo_log = getattr(trainer.strategy, "undo_log", None) or UndoLog()
    undo_log.set_attribute(connector, "register_signal_handlers", register_then_install)


def _step_metrics(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    return {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}


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
