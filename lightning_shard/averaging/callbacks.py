"""Lightning's weight-averaging callbacks under the sharded Trainer strategy, as the user wrote them.

Lightning 2.6's ``WeightAveraging`` (and ``EMAWeightAveraging``, and any subclass written the way its docstring
shows) creates ``AveragedModel(pl_module)`` in its ``setup`` hook - a deep copy of the whole LightningModule, made
before the strategy shards it, after calling ``configure_model()`` itself outside the strategy's meta-device context
- and then fails at the first update (``aten.copy_.default got mixed torch.Tensor and DTensor``). So the strategy, in
``setup_environment`` (which Lightning calls before the callbacks' ``setup``), hands each such callback the sharded
machinery with :func:`shard_weight_averaging`: the instance stays the user's - same object, same class name and
checkpoint state key, their ``should_update``, ``avg_fn`` / ``multi_avg_fn``, ``use_buffers`` and ``device`` - and
its class gains :class:`ShardedWeightAveraging` just above Lightning's ``WeightAveraging`` in the method order, so a
subclass's own methods still win. What changes:

* ``setup`` copies nothing; ``on_fit_start`` (after the strategy sharded the model, before a checkpoint is restored)
  creates a :class:`~lightning_shard.averaging.ShardedAveragedModel`: fp32 shards beside the parameters.
* The updates after each optimizer step, the swap for validation and the copy at the end of training run exactly
  when Lightning's callback runs them (its hooks are unchanged); they work on the local shards, no communication.
* Checkpoints keep the model's trained weights under ``state_dict`` and the averaged copy under
  ``"averaged_model"`` (``AveragedModel``'s state dict: ``module.<name>``, ``n_averaged``), sharded or gathered with
  the model; ``fit(ckpt_path=...)`` restores both. Lightning's callback instead moves the trained weights to
  ``current_model_state`` and writes the averaged ones into ``state_dict``, so that evaluating one of its checkpoints
  evaluates the averaged weights; validate / test / predict from a checkpoint holding a copy do the same here
  (:func:`copy_for_evaluation`), with or without the callback.

``StochasticWeightAveraging`` is refused before training: it deep-copies the model in ``setup`` and retunes the
learning rate and batch-norm epochs around that copy. ``WeightAveraging()`` with its default ``avg_fn`` computes the
same equal-weight average, sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_shard.averaging.averaged_model import ShardedAveragedModel
from lightning_shard.checkpoint.averaged import holds_averaged_copy
from lightning_shard.checkpoint.layout import TRAINER_LAYOUT

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Where a Trainer checkpoint keeps the averaged copy.
AVERAGED_KEY = TRAINER_LAYOUT.averaged[0]
# Where Lightning's own `WeightAveraging.on_save_checkpoint` moves the trained weights, and the entries it writes.
LIGHTNING_MOVED_WEIGHTS_KEY = "current_model_state"
_LIGHTNING_AVERAGING_KEYS = {LIGHTNING_MOVED_WEIGHTS_KEY, "averaging_state"}


class ShardedWeightAveraging(WeightAveraging):
    """``WeightAveraging`` whose averaged copy is a :class:`ShardedAveragedModel`; the strategy puts it under the
    user's callback class (see the module docstring), so there is no need to name it.

    Example:
        >>> from lightning.pytorch.callbacks import EMAWeightAveraging
        >>> callbacks = [EMAWeightAveraging(decay=0.999)]
        >>> shard_weight_averaging(callbacks)
        >>> isinstance(callbacks[0], ShardedWeightAveraging), type(callbacks[0]).__name__
        (True, 'EMAWeightAveraging')
    """

    _average_model: ShardedAveragedModel | None  # type: ignore[assignment]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Nothing to copy yet: the strategy builds (`configure_model()` on the meta device) and shards the model after
        # the callbacks' `setup`. The copy of an earlier fit goes, also before validate / test / predict: the model
        # holds its values since that fit ended, and a checkpoint loaded now brings its own.
        self._average_model = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._average_model = ShardedAveragedModel(
            pl_module, device=self._device, use_buffers=self._use_buffers, **self._kwargs
        )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._average_model is None:
            super().on_save_checkpoint(trainer, pl_module, checkpoint)  # Lightning's note: nothing to save
            return
        if self._average_model.is_swapped_in:
            raise RuntimeError("A checkpoint is saved while the averaged weights are swapped into the model.")
        full = trainer.strategy.config.state_dict_type == "full"  # type: ignore[attr-defined]
        checkpoint[AVERAGED_KEY] = trainer.strategy.checkpoint_io.model_state(self._average_model, full=full)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The strategy's `load_checkpoint` has filled the averaged copy in place (see `averaged_models`), as it fills
        # the model; here only Lightning's notes remain.
        if self._average_model is None:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
        elif self.state_key not in checkpoint.get("callbacks", {}):
            rank_zero_warn(
                "The checkpoint was not written with weight averaging: the averaged copy starts from the model's "
                "weights at its first update."
            )

    @override
    def _swap_models(self, pl_module: pl.LightningModule) -> None:
        # Lightning swaps at the start and at the end of each validation epoch.
        assert self._average_model is not None
        if self._average_model.is_swapped_in:
            self._average_model.swap_out()
        else:
            self._average_model.swap_in()

    @override
    def _copy_average_to_current(self, pl_module: pl.LightningModule) -> None:
        assert self._average_model is not None
        self._average_model.copy_to(pl_module)


def shard_weight_averaging(callbacks: list[Callback]) -> None:
    """Give Lightning's weight-averaging callbacks among ``callbacks`` the sharded machinery, in place (see the
    module docstring); call before their ``setup``.

    Raises:
        ValueError: ``StochasticWeightAveraging``, or more than one weight-averaging callback (each would swap its
            copy into the same model for validation).

    Example:
        >>> from lightning.pytorch.callbacks import StochasticWeightAveraging
        >>> shard_weight_averaging([StochasticWeightAveraging(swa_lrs=0.01)])
        Traceback (most recent call last):
        ...
        ValueError: `StochasticWeightAveraging` deep-copies the whole model ...
    """
    if any(isinstance(callback, StochasticWeightAveraging) for callback in callbacks):
        raise ValueError(
            "`StochasticWeightAveraging` deep-copies the whole model before the sharded strategy shards it, so it is "
            "not supported. `WeightAveraging()` (from lightning.pytorch.callbacks) computes the same equal-weight "
            "average, sharded: override its `should_update(step_idx, epoch_idx)` to start at your SWA epoch "
            "(`return epoch_idx is not None and epoch_idx >= swa_start`), and return "
            "`torch.optim.swa_utils.SWALR(optimizer, swa_lr=...)` from `configure_optimizers` for the SWA learning "
            "rate."
        )
    averaging = [callback for callback in callbacks if isinstance(callback, WeightAveraging)]
    if len(averaging) > 1:
        raise ValueError(
            f"{len(averaging)} weight-averaging callbacks ({', '.join(type(c).__name__ for c in averaging)}): each "
            "swaps its averaged weights into the model for validation. Keep one."
        )
    for callback in averaging:
        if not isinstance(callback, ShardedWeightAveraging):
            callback.__class__ = _sharded_class(type(callback))


def restore_weight_averaging(callbacks: list[Callback]) -> None:
    """Give the callbacks :func:`shard_weight_averaging` changed their own class back, in place, when the run ends:
    the same instance can then go to another Trainer and strategy (or be pickled) as the class the user made.
    Their averaged copy stays where ``_average_model`` holds it.

    Example:
        >>> from lightning.pytorch.callbacks import EMAWeightAveraging
        >>> callbacks = [EMAWeightAveraging(decay=0.999)]
        >>> shard_weight_averaging(callbacks)
        >>> restore_weight_averaging(callbacks)
        >>> type(callbacks[0]) is EMAWeightAveraging
        True
    """
    for callback in callbacks:
        user_class = getattr(type(callback), "_user_class", None)
        if user_class is not None:
            callback.__class__ = user_class


def copy_for_evaluation(path: str, module: nn.Module) -> dict[str, ShardedAveragedModel]:
    """Where validate / test / predict load a checkpoint that holds an averaged copy: a copy of ``module`` for the load
    to fill, whose values then replace the module's (:meth:`ShardedAveragedModel.copy_to`), so that the averaged
    weights are evaluated, as with Lightning's own callbacks, whose checkpoints hold them as ``state_dict``. Empty
    for a checkpoint without one. Call on every rank.

    Example:
        >>> copy_for_evaluation("out/best.ckpt", sharded_module)  # doctest: +SKIP
        {'averaged_model': ShardedAveragedModel(...)}
    """
    if not holds_averaged_copy(path):  # decided by rank 0 after waiting for saves and repairs, as the load decides
        return {}
    return {AVERAGED_KEY: ShardedAveragedModel(module)}


def averaged_models(callbacks: list[Callback]) -> dict[str, ShardedAveragedModel]:
    """The averaged copies of the (sharded) weight-averaging callbacks, by checkpoint key: what a checkpoint load
    fills in place.

    Example:
        >>> averaged_models([])
        {}
    """
    # `shard_weight_averaging` admits one weight-averaging callback.
    sharded = [callback for callback in callbacks if isinstance(callback, ShardedWeightAveraging)]
    copies = [callback._average_model for callback in sharded if callback._average_model is not None]
    return {AVERAGED_KEY: copies[0]} if copies else {}


def with_averaged_copy_entry(
    checkpoint: dict[str, Any], callbacks: list[Callback], averaged_state: Callable[[nn.Module], dict[str, Any]]
) -> dict[str, Any]:
    """``checkpoint`` in this package's layout (trained weights under ``state_dict``, the averaged copy under
    ``"averaged_model"``) when Lightning's own ``WeightAveraging.on_save_checkpoint`` wrote it in Lightning's: after
    fit or after an exception, when :func:`restore_weight_averaging` has given the callback its class back but its
    copy is still the sharded one, ``trainer.save_checkpoint`` runs Lightning's hook, which moves the weights to
    ``current_model_state`` and puts the copy's shards, unlabelled, in ``state_dict``. ``averaged_state``: the state
    dict of the copy as the checkpoint stores weights (sharded, or gathered). Call on every rank.

    Example:
        >>> with_averaged_copy_entry({"state_dict": {}}, [], lambda copy: {})
        {'state_dict': {}}
    """
    copies = [
        callback._average_model
        for callback in callbacks
        if isinstance(callback, WeightAveraging) and isinstance(callback._average_model, ShardedAveragedModel)
    ]
    if not copies or LIGHTNING_MOVED_WEIGHTS_KEY not in checkpoint:
        return checkpoint
    rest = {key: value for key, value in checkpoint.items() if key not in _LIGHTNING_AVERAGING_KEYS}
    return {**rest, "state_dict": checkpoint[LIGHTNING_MOVED_WEIGHTS_KEY], AVERAGED_KEY: averaged_state(copies[0])}


def averaged_copy_place(callbacks: list[Callback]) -> str | None:
    """Where the weight-averaging callback among ``callbacks`` will keep its copy, for the memory estimate:
    ``"cpu"`` (``device="cpu"``), ``"device"`` (beside the sharded parameters), or ``None`` without one.

    Example:
        >>> from lightning.pytorch.callbacks import EMAWeightAveraging
        >>> averaged_copy_place([EMAWeightAveraging(device="cpu")]), averaged_copy_place([])
        ('cpu', None)
    """
    for callback in callbacks:
        if isinstance(callback, WeightAveraging):
            requested = callback._device
            return "cpu" if requested is not None and torch.device(requested).type == "cpu" else "device"
    return None


@functools.cache
def _sharded_class(cls: type[WeightAveraging]) -> type[ShardedWeightAveraging]:
    """``cls`` with :class:`ShardedWeightAveraging` just above ``WeightAveraging`` in its method order; named as
    ``cls``, so that the checkpoint's callback state key stays the same."""
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_user_class": cls,  # for `restore_weight_averaging`
    }
    bases = (ShardedWeightAveraging,) if cls is WeightAveraging else (cls, ShardedWeightAveraging)
    return type(cls.__name__, bases, namespace)
