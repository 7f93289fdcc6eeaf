"""``ShardedStrategy`` for Lightning Fabric: FSDP2 ``fully_shard`` behind ``Fabric(strategy="fully_sharded")``.

A thin adapter: Fabric's hooks translated into calls of the core the Trainer strategy uses too
(:class:`~lightning_shard.core.strategy_core.ShardedStrategyCore`: process group, mesh, the sharding plan, precision
policy, checkpoint IO). What Fabric calls, in a typical loop:

* ``fabric.launch()`` - ``setup_environment``: process group and device mesh.
* ``fabric.init_module(empty_init=True)`` - ``module_init_context``: the meta device (materialised at setup by the
  project's initialisation rule: ``reset_parameters()`` / Hugging Face ``_init_weights`` from rank 0's stream).
* ``fabric.setup(model, optimizer)`` / ``fabric.setup_module`` + ``fabric.setup_optimizers`` - ``setup_module``:
  the plan (activation checkpointing, per-block compile, ``fully_shard``, materialisation); optimizers built before
  setup are pointed at the sharded parameters.
* ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.no_backward_sync`` (skips the reduce-scatter only under
  ``gradient_accumulation="unsharded"``), ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` in the sharded or
  full format, at any world size.
* ``with fabric.strategy.preemptible() as preemption`` and ``preemption.step_end(path, state)`` after each optimizer
  step: a stop signal ends the run at a step all ranks agree on, with a checkpoint of it
  (:mod:`lightning_shard.fabric.preemption`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.core.settings import StrategySettings
from lightning_shard.core.strategy_core import ShardedStrategyCore
from lightning_shard.devices import place_unmanaged_state
from lightning_shard.fabric.precision import ShardedPrecision
from lightning_shard.fabric.preemption import Preemptible
from lightning_shard.fabric.state import checkpoint_from_state, layout_of, restore_rest
from lightning_shard.init.init_skip import (
    check_after_load,
    checkpoint_tensors,
    load_pending,
    loaded_after_setup,
    refuse_use_before_load,
)
from lightning_shard.init.materialize import meta_construction
from lightning_shard.plan.direct_calls import drop_gathered_parameters
from lightning_shard.plan.parallelize import is_parallelized
from lightning_shard.plan.precision import clip_grad_norm
from lightning_shard.torch_compat.modules import visible_name

# The order in which this process set models up (shared by every rank: they run the same program).
_SETUP_COUNTER = itertools.count()
_SETUP_INDEX = "_lightning_shard_setup_index"


class ShardedStrategy(ShardedStrategyCore, ParallelStrategy):
    """Fully Sharded Data Parallel training on FSDP2 ``fully_shard`` for Lightning Fabric, on CPU (gloo) and CUDA
    (nccl).

    Args:
        **settings: the settings of the Trainer's :class:`lightning_shard.ShardedStrategy` - ``sharding_strategy``,
            ``auto_wrap_policy``, ``activation_checkpointing``, ``reshard_after_forward``, ``forward_prefetch``,
            ``cpu_offload``, ``hybrid_shard_size``, ``reduce_dtype``, ``state_dict_type``, ``async_save``,
            ``preemption`` (whether :meth:`preemptible` acts), ``cpu_collectives``, ``compile``,
            ``gradient_accumulation``, ``tensor_parallel_size``, ``tensor_parallel_plan``,
            ``selective_checkpointing_ops``, ``activation_memory_budget``, ``process_group_backend``, ``timeout``,
            ``start_method`` - with the same checks, and Lightning ``FSDPStrategy`` / FSDP1 spellings translated
            (``activation_checkpointing_policy``, ``ShardingStrategy`` enums, ``ModuleWrapPolicy``, ...).
            ``gradient_accumulation`` decides what ``fabric.no_backward_sync(model, enabled=True)`` does:
            ``"sharded"`` (default) still reduce-scatters every micro-batch, ``"unsharded"`` skips it.

    Example:
        >>> import lightning as L
        >>> from litgpt.model import Block  # doctest: +SKIP
        >>> strategy = ShardedStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
        ...                            state_dict_type="full")  # doctest: +SKIP
        >>> fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **settings: Any,
    ) -> None:
        parsed = StrategySettings.from_arguments(settings)
        if not parsed.config.save_frozen_pretrained_weights:
            raise ValueError(
                "`save_frozen_pretrained_weights=False` is a setting of the Trainer strategy. With Fabric, choose what "
                "a checkpoint holds with Fabric's own `filter`, e.g. `fabric.save(path, state, filter={'model': lambda "
                "name, value: 'lora_' in name})`, and load it with `fabric.load(path, state, strict=False)`."
            )
        checkpoint_io = self._init_settings(parsed, checkpoint_io)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._backward_sync_control = _GradientSyncControl(self)
        # The parameters `fully_shard` replaced (by id; weak, and compared by identity, never by tensor `==`): an
        # optimizer still holding one would train nothing.
        self._replaced_parameters: weakref.WeakValueDictionary[int, torch.nn.Parameter] = weakref.WeakValueDictionary()
        # The models set up here: an optimizer step or a load changes their shards (Fabric's step names no model).
        self._sharded_models: weakref.WeakSet[Module] = weakref.WeakSet()
        self._load_follows: str | None = None  # the checkpoint a load after setup reads (`checkpoint_follows`)

    @property  # type: ignore[override]
    @override
    def precision(self) -> ShardedPrecision:
        if self._precision is None:
            self._precision = ShardedPrecision(reduce_dtype=self._reduce_dtype)
        return self._precision  # type: ignore[return-value]  (the setter admits only ShardedPrecision)

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        self._precision = self._sharded_precision(precision, ShardedPrecision)

    # ------------------------------------------------------------------ launch and process group

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method != "popen":
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_process_group()
        self.precision.use_device(self.root_device)

    # ------------------------------------------------------------------ model and optimizers

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: build on the meta device (``setup`` shards, then materialises each module by the
        initialisation rule, so the weights equal an eager build); otherwise on this rank's device."""
        stack = ExitStack()
        stack.enter_context(meta_construction() if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """Shard ``module`` and point ``optimizers`` (built on its parameters before sharding, on the meta device
        too) at the sharded parameters of the same names."""
        names = {id(param): name for name, param in module.named_parameters()}
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    f"The optimizer {type(optimizer).__name__} has state already (it stepped before `fabric.setup`); "
                    "its per-parameter states cannot follow the parameters into their shards. Create it fresh, or "
                    "load its states with `fabric.load` after setup."
                )
        module = self.setup_module(module)
        sharded = {visible_name(name): param for name, param in module.named_parameters()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [_sharded_counterpart(param, names, sharded) for param in group["params"]]
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        if any(isinstance(child, FSDP1) for child in module.modules()):
            raise TypeError(
                "The model holds FSDP1 `FullyShardedDataParallel` modules; the sharded strategy applies FSDP2's "
                "`fully_shard` itself. Pass the plain model."
            )
        if not is_parallelized(module):
            self._replaced_parameters.update({id(param): param for param in module.parameters()})
            # Fabric's loop decides how many micro-batches a step accumulates; "unsharded" is chosen only to
            # accumulate, so the "auto" memory estimate counts the whole gradients it holds between them.
            accumulate = 2 if self.config.gradient_accumulation == "unsharded" else 1
            # Initialised here, not deferred to the first use: Fabric cannot know whether a `fabric.load` follows
            # (unless told: `checkpoint_follows`), and deferred values would read as sentinels, and be overwritten if
            # written, until then.
            self._shard_module(module, self.precision, accumulate)
            refuse_use_before_load(
                module,
                f"`fabric.setup` left the model tensors that {self._load_follows} holds to the `fabric.load` that "
                "`checkpoint_follows` announced, but the model ran before it: they hold no values yet. Call "
                f"`fabric.load({self._load_follows!r}, state)` right after setup, or set the model up outside "
                "`checkpoint_follows`.",
            )
        else:
            self._keep_sharding(module, self.precision)
        self._apply_run_settings()
        self._sharded_models.add(module)
        module.__dict__.setdefault(_SETUP_INDEX, next(_SETUP_COUNTER))
        place_unmanaged_state(module, self.root_device)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        params = [param for group in optimizer.param_groups for param in group["params"]]
        stale = [param for param in params if self._replaced_parameters.get(id(param)) is param]
        if stale:
            raise ValueError(
                f"The optimizer {type(optimizer).__name__} holds {len(stale)} parameters that sharding replaced, so "
                "it would update nothing. Create it after `fabric.setup_module(model)` from the sharded model's "
                "parameters, or set both up together: `fabric.setup(model, optimizer)`."
            )
        self._prepare_optimizers([optimizer])
        return optimizer

    @override
    def module_to_device(self, module: Module) -> None:
        # `setup_module` places the model: `fully_shard` its parameters and buffers, `place_unmanaged_state` the rest.
        pass

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self._after_optimizer_step(*self._models_stepped_by(optimizer))
        return output

    def _models_stepped_by(self, optimizer: Optimizable) -> list[Module]:
        """The sharded models whose parameters ``optimizer`` steps, in the order they were set up: the same list on
        every rank (a WeakSet's order, and which dropped models it still holds, differ per process), for the
        collectives that follow the step."""
        stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
        models = [model for model in self._sharded_models if any(id(p) in stepped for p in model.parameters())]
        return sorted(models, key=lambda model: model.__dict__[_SETUP_INDEX])

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip to a global norm over all shards; returns that norm (before clipping) on every rank."""
        self.precision.unscale_gradients(optimizer)
        parameters = self.precision.main_params(optimizer)
        return clip_grad_norm(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    @override
    def teardown(self) -> None:
        """Fabric calls no teardown of its own: call ``fabric.strategy.teardown()`` to undo what the setup changed
        outside the model (``activation_memory_budget``) before another Fabric or Trainer uses the process."""
        try:
            super().teardown()
        finally:
            self.undo_log.undo()

    # ------------------------------------------------------------------ checkpoints

    @contextmanager
    def checkpoint_follows(self, path: _PATH) -> Iterator[None]:
        """Inside, ``fabric.setup`` leaves the model tensors that the checkpoint at ``path`` holds to the
        ``fabric.load(path, state)`` that follows: nothing the load overwrites is initialised (no op replayed, no
        random number drawn for them, none of their memory written before the load), as ``fit(ckpt_path=...)`` does
        for the Trainer; Fabric alone cannot tell that a load follows. No checkpoint at ``path`` (a first run):
        setup initialises everything. Until the load the model refuses to run and ``fabric.save`` refuses it; a load
        that leaves some of those tensors unwritten names them. Enter on every rank.

        Example:
            >>> with fabric.strategy.checkpoint_follows("ckpts/last.ckpt"):  # doctest: +SKIP
            ...     model, optimizer = fabric.setup(model, optimizer)
            >>> fabric.load("ckpts/last.ckpt", {"model": model, "optimizer": optimizer})  # doctest: +SKIP
        """
        path = self.broadcast(str(path))
        with loaded_after_setup(checkpoint_tensors(path)):
            self._load_follows = path
            try:
                yield
            finally:
                self._load_follows = None

    def preemptible(self) -> Preemptible:
        """A context for the training loop in which a stop signal (``SIGTERM``; SLURM's requeue signal under
        ``SLURMEnvironment(auto_requeue=True)``) ends the run at a step all ranks agree on, with a checkpoint of that
        step: call ``step_end(path, state)`` on it after every optimizer step (see
        :mod:`lightning_shard.fabric.preemption`). Enter it on every rank; with ``preemption=False`` it does nothing.

        Example:
            >>> with fabric.strategy.preemptible() as preemption:  # doctest: +SKIP
            ...     for step in range(steps):
            ...         train_step()
            ...         preemption.step_end("ckpts/last.ckpt", {"model": model, "optimizer": optimizer, "step": step})
        """
        return Preemptible(self, enabled=self._preemption)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Write ``state`` as a sharded directory or one file (``state_dict_type``), atomically; every rank calls."""
        if storage_options is not None:
            raise TypeError(f"`storage_options={storage_options!r}` is not supported by {type(self).__name__}.")
        path = self.broadcast(str(path))
        if any(load_pending(model) for model in self._sharded_models):
            raise RuntimeError(
                f"Saving {path} before the `fabric.load` that `checkpoint_follows` announced: the model tensors left "
                "to it hold no values yet. Load the checkpoint first."
            )
        full = self.config.state_dict_type == "full"
        checkpoint, layout = checkpoint_from_state(state, self.checkpoint_io, full=full, filter=filter)
        if full:
            self.checkpoint_io.save_full(checkpoint, path, layout)
        else:
            self.checkpoint_io.save_sharded(checkpoint, path, layout)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint of either format, written at any world size by this strategy or the Trainer's, into
        ``state``; return what ``state`` did not ask for. ``state`` a module: a file holding its bare state dict
        (``fabric.load_raw``)."""
        if weights_only:
            raise ValueError(
                "`weights_only=True` is not supported: a sharded checkpoint's non-tensor entries are pickled objects "
                "read by torch.distributed.checkpoint. Load checkpoints you trust with the default."
            )
        path = self.broadcast(str(path))
        if not state:
            return self.checkpoint_io.load_checkpoint(path)
        if isinstance(state, Module):
            self.checkpoint_io.load_raw_into(path, state, strict=strict)
            check_after_load(state)
            drop_gathered_parameters(state)  # gathered before the load (a call after a step): stale now
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Loading an optimizer alone is not supported: its sharded states are keyed by the model's parameter "
                "names. Load it with its model: `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
            )
        model, optimizers, averaged, layout = layout_of(state, "load")
        rest = self.checkpoint_io.load_into(
            path, model, list(optimizers.values()), strict=strict, layout=layout, averaged=averaged
        )
        check_after_load(model)
        drop_gathered_parameters(model)
        return restore_rest(state, rest, layout, strict)


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: the core's rule for accumulation micro-batches."""

    def __init__(self, strategy: ShardedStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._strategy._gradient_sync_skipped(module, skip=enabled)


def _sharded_counterpart(
    param: torch.nn.Parameter, names: dict[int, str], sharded: dict[str, torch.nn.Parameter]
) -> torch.nn.Parameter:
    name = names.get(id(param))
    if name is None or name not in sharded:
        raise ValueError(
            "An optimizer passed to `fabric.setup(model, optimizer)` holds a parameter that is not the model's; "
            "under the sharded strategy every optimized parameter must belong to the model set up with it."
        )
    return sharded[name]
