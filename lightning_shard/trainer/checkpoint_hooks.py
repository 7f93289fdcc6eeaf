"""The Trainer strategy's checkpoint hooks: what Lightning's ``ParallelStrategy`` calls to save and load a checkpoint,
answered through the sharded checkpoint IO (:class:`~lightning_shard.ShardedCheckpointIO`).

Takes the strategy's sharded model, its optimizers and the Trainer's callbacks; gives Lightning the checkpoint dict to
save (model and optimizer states sharded or gathered by ``state_dict_type``, the weight-averaging callback's copy, the
record of frozen pretrained weights left out) and, on load, a checkpoint whose weights and optimizer states are
already in the sharded model, so ``load_model_state_dict`` / ``load_optimizer_state_dict`` have nothing left to do.
:class:`~lightning_shard.trainer.strategy.ShardedStrategy` puts :class:`CheckpointHooks` in front of its bases.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_shard.averaging.callbacks import averaged_models, copy_for_evaluation, with_averaged_copy_entry
from lightning_shard.checkpoint.layout import LAYOUT_KEY
from lightning_shard.hf.frozen_weights import (
    RECORD_KEY,
    checkpoint_record,
    frozen_pretrained_weights,
    names_to_skip_on_resume,
)
from lightning_shard.init.init_skip import check_after_load
from lightning_shard.plan.direct_calls import drop_gathered_parameters

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.nn import Module

    from lightning_shard.checkpoint import ShardedCheckpointIO
    from lightning_shard.plan.config import ShardingConfig


class CheckpointHooks:
    """Lightning's save and load hooks for the Trainer strategy, in front of its ``ParallelStrategy`` (which, with
    :class:`~lightning_shard.core.strategy_core.ShardedStrategyCore`, provides what they read).

    Example:
        >>> from lightning_shard import ShardedStrategy
        >>> issubclass(ShardedStrategy, CheckpointHooks)
        True
    """

    # Provided by the strategy it is mixed into.
    model: Module | None
    lightning_module: pl.LightningModule | None
    optimizers: list[Optimizer]
    config: ShardingConfig
    checkpoint_io: ShardedCheckpointIO
    is_global_zero: bool
    broadcast: Any
    barrier: Any

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        leave_out = self._frozen_pretrained_weights_left_out()
        return self.checkpoint_io.model_state(
            self.model, full=self.config.state_dict_type == "full", leave_out=leave_out
        )

    def _frozen_pretrained_weights_left_out(self) -> dict[str, Any]:
        if self.config.save_frozen_pretrained_weights:
            return {}
        assert self.model is not None
        return frozen_pretrained_weights(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        full = self.config.state_dict_type == "full"
        return self.checkpoint_io.optimizer_state(self.model, unwrapped_optimizer(optimizer), full=full)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Every rank takes part: a sharded save writes each rank's shard, a full save gathers to rank 0.
        path = self.broadcast(str(filepath))
        full = self.config.state_dict_type == "full"
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            checkpoint = with_averaged_copy_entry(
                checkpoint,
                self.lightning_module.trainer.callbacks,
                lambda copy: self.checkpoint_io.model_state(copy, full=full),
            )
        left_out = self._frozen_pretrained_weights_left_out()
        if left_out:  # the state dict left them out; the checkpoint says which, and where they are read from
            checkpoint = {**checkpoint, RECORD_KEY: checkpoint_record(left_out)}
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
        self.barrier("remove_checkpoint")

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None
        assert self.lightning_module is not None
        path = self.broadcast(str(checkpoint_path))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # Fit restores the weight-averaging callback's copy; evaluation evaluates a checkpoint's averaged weights.
        callbacks = self.lightning_module.trainer.callbacks
        averaged = averaged_models(callbacks) if fitting else copy_for_evaluation(path, self.lightning_module)
        checkpoint = self.checkpoint_io.load_into(
            path,
            self.model,
            [unwrapped_optimizer(optimizer) for optimizer in self.optimizers],
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            absent=names_to_skip_on_resume(path, self.model),
            averaged=averaged,
        )
        check_after_load(self.model)  # the tensors materialisation left to this load: written now?
        for copy in [] if fitting else averaged.values():
            copy.copy_to(self.lightning_module)
        drop_gathered_parameters(self.model)  # gathered before the load (a call after fit): stale now
        if LAYOUT_KEY in checkpoint:  # written by a Fabric program: weights, optimizer states and its own entries
            if fitting:
                raise ValueError(
                    f"The checkpoint {path} was written by a Fabric program: it holds weights and optimizer states "
                    "but no Trainer loop or scheduler state, so `fit(ckpt_path=...)` cannot resume from it. To train "
                    "on from its weights, load them with `trainer.validate(model, ckpt_path=...)`, then call "
                    "`trainer.fit(model)`."
                )
            # Lightning migrates checkpoints by their version; the program's own entries have nothing to migrate.
            checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # `load_checkpoint` already loaded the weights into the sharded model.
        pass

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # `load_checkpoint` already loaded the optimizer states into the sharded optimizers.
        pass


def unwrapped_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer under Lightning's ``LightningOptimizer`` wrapper (``optimizer`` itself when unwrapped)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
