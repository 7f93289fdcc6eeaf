"""Lightning's launchers for the sharded strategy: the spawn/fork one taught to hand sharded weights back to the main
process, and both putting back interrupted checkpoints before Lightning looks for one to resume from, and noting the
one it selects (for the strategy's setup, :mod:`lightning_shard.init.init_skip`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_shard.init.init_skip import resume_path_noted
from lightning_shard.standalone_packages.mixing import check_one_lightning
from lightning_shard.trainer.model_checkpoint import restore_checkpoint_folders

if TYPE_CHECKING:
    import lightning.pytorch as pl


class _RestoresCheckpointFolders:
    """Before the run (and Lightning's search for the checkpoint to resume from, ``ckpt_path="last"`` or SLURM's
    ``hpc``), every process puts back the checkpoints that a kill left moved aside (:func:`restore_checkpoint_folders`;
    the renames are safe to race). First, objects made for the other Lightning package (``lightning`` /
    ``pytorch_lightning``) are refused with the class to use (:func:`check_one_lightning`)."""

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            check_one_lightning(trainer)
            restore_checkpoint_folders(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class ShardedScriptLauncher(_RestoresCheckpointFolders, _SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher (it re-runs the script for the other local ranks; under torchrun or SLURM it
    only starts the function), restoring interrupted checkpoints first.

    Example:
        >>> from lightning_shard import ShardedStrategy
        >>> strategy = ShardedStrategy()  # uses this launcher
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is None:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        with resume_path_noted(trainer):  # the strategy's setup learns which checkpoint is restored after it
            return super().launch(function, *args, trainer=trainer, **kwargs)


class ShardedMultiProcessingLauncher(_RestoresCheckpointFolders, _MultiProcessingLauncher):
    """``start_method="spawn"`` / ``"fork"`` / ``"forkserver"`` for the sharded strategy.

    After ``fit`` the worker processes end and the main process's model receives rank 0's weights. The base class
    saves ``state_dict()`` - DTensor shards - through the strategy's checkpoint IO on rank 0 alone; here every rank
    takes part in gathering the whole weights to rank 0's CPU memory, and rank 0 writes them with ``torch.save``.

    Example:
        >>> from lightning_shard import ShardedStrategy
        >>> strategy = ShardedStrategy(start_method="spawn")  # uses this launcher
    """

    @override
    def _wrapping_function(self, process_idx: int, trainer: pl.Trainer | None, *args: Any, **kwargs: Any) -> None:
        # in the worker: what the strategy's setup learns from (a wrapper made in the main process would not pickle)
        if trainer is None:
            return super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        with resume_path_noted(trainer):
            return super()._wrapping_function(process_idx, trainer, *args, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(trainer.lightning_module, options=options)  # a collective: every rank
        if trainer.global_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None)
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
