"""``ShardedStrategy``: Lightning's ``ParallelStrategy`` on FSDP2 ``fully_shard``, the Trainer's front-end.

Lightning calls the hooks below in this order: ``setup_environment`` (process group, device mesh), the module's
``configure_model`` inside ``model_sharded_context`` (meta device), ``setup`` (activation checkpointing, sharding,
materialisation, optimizers), then training with ``block_backward_sync`` around non-final accumulation micro-batches
(it skips the gradient reduce-scatter only under ``gradient_accumulation="unsharded"``), and ``save_checkpoint`` /
``load_checkpoint`` through :class:`~lightning_shard.ShardedCheckpointIO`
(:mod:`lightning_shard.trainer.checkpoint_hooks`). ``setup_environment`` also gives
Lightning's weight-averaging callbacks (``EMAWeightAveraging``, ...) their sharded copy
(:mod:`lightning_shard.averaging`). What it shares with the Fabric front-end
(:class:`lightning_shard.fabric.ShardedStrategy`) lives in
:class:`~lightning_shard.core.strategy_core.ShardedStrategyCore`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.averaging.callbacks import (
    averaged_copy_place,
    restore_weight_averaging,
    shard_weight_averaging,
)
from lightning_shard.core.settings import StrategySettings
from lightning_shard.core.strategy_core import ShardedStrategyCore
from lightning_shard.core.undo import UndoLog
from lightning_shard.devices import place_unmanaged_state
from lightning_shard.init.init_skip import loaded_after_setup, trainer_checkpoint_tensors
from lightning_shard.init.materialize import meta_construction
from lightning_shard.plan.config import CpuCollectives, GradientAccumulation, ShardingStrategyName, StateDictType
from lightning_shard.plan.parallelize import is_parallelized
from lightning_shard.plan.precision import ShardedPrecision
from lightning_shard.plan.wrap import WrapPolicy
from lightning_shard.tensor_parallel import TensorParallelPlan
from lightning_shard.tensor_parallel.loss import local_outputs, uses_loss_parallel
from lightning_shard.trainer.checkpoint_hooks import CheckpointHooks, unwrapped_optimizer
from lightning_shard.trainer.launcher import ShardedMultiProcessingLauncher, ShardedScriptLauncher
from lightning_shard.trainer.model_checkpoint import link_when_published
from lightning_shard.trainer.preemption import add_strategy_preemption

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ShardedStrategy(CheckpointHooks, ShardedStrategyCore, ParallelStrategy):
    """Fully Sharded Data Parallel training on FSDP2 ``fully_shard``, on CPU (gloo) and CUDA (nccl).

    Args:
        sharding_strategy: ``"FULL_SHARD"`` (parameters, gradients and optimizer states sharded),
            ``"SHARD_GRAD_OP"`` (parameters kept gathered between forward and backward), ``"NO_SHARD"``
            (replicated, like DDP), ``"HYBRID_SHARD"`` (sharded within a node, replicated across nodes) or
            ``"auto"`` (the least communication whose memory estimate fits the device; see ``auto_sharding``).
        auto_wrap_policy: which submodules become FSDP units: module classes, class names (``["Block"]``), a
            minimum parameter count, a callable ``module -> bool``, ``None`` (the root only) or ``"auto"``
            (a Hugging Face model's ``_no_split_modules``, else the block class repeated in ``ModuleList`` /
            ``Sequential`` containers).
        activation_checkpointing: which submodules recompute their activations in backward, in the same forms (the
            whole module recomputed, its input kept), or ``"selective"``: the ``"auto"`` blocks with torchtitan's
            per-op policy (the outputs of matmuls and attention kept, but every second matmul's; the rest recomputed).
        selective_checkpointing_ops: the ops whose outputs ``"selective"`` keeps (aten op overload names, e.g.
            ``["aten.mm.default", "aten._scaled_dot_product_flash_attention.default"]``); default: torchtitan's list.
        activation_memory_budget: with ``compile=True`` instead of ``activation_checkpointing``: the fraction of
            activations torch.compile's partitioner keeps (0 to 1), recomputing the cheapest of the rest
            (``torch._functorch.config.activation_memory_budget``, process-wide).
        reshard_after_forward: override the strategy's choice for every unit (bool, or an int shard size).
        forward_prefetch: issue each unit's forward all-gather while the unit before it computes (FSDP1's
            ``forward_prefetch``; FSDP2 prefetches in backward already). Costs one more unit's gathered parameters.
        cpu_offload: ``True`` or a ``CPUOffloadPolicy`` keeps sharded parameters, gradients and optimizer states
            in CPU memory (CUDA only; on a CPU accelerator it changes nothing).
        hybrid_shard_size: ranks per shard group for ``HYBRID_SHARD`` (default: the devices of one node).
        reduce_dtype: gradient-reduction dtype for the mixed precisions (fairseq's ``--fp32-reduce-scatter``).
        state_dict_type: ``"sharded"`` (default: a torch.distributed.checkpoint directory) or ``"full"`` (one file).
        save_frozen_pretrained_weights: ``False`` leaves out of checkpoints the frozen parameters read from pretrained
            files by ``lightning_shard.hf.from_pretrained`` (a LoRA run's base model): a checkpoint then holds the
            trainable parameters, optimizer and loop states, and records the files (path, size, hashes of the
            safetensors header and of sampled contents). Resuming reads the base from the files again
            (``configure_model()`` does) and refuses files that are missing or changed, another fine-tune of the same
            model included. See :mod:`lightning_shard.hf.frozen_weights`.
        async_save: write sharded checkpoints in the background (see :class:`ShardedCheckpointIO`).
        preemption: ``True`` (default): without a :class:`~lightning_shard.PreemptionCheckpoint` of your own, the
            strategy adds :class:`~lightning_shard.trainer.preemption.StrategyPreemptionCheckpoint`: ``SIGTERM``, and
            SLURM's requeue signal under ``SLURMEnvironment(auto_requeue=True)``, stop the run at a step all ranks
            agree on, with a checkpoint of that step, requeue and exit status 75, never by Lightning's in-handler save.
            ``False``: Lightning's own signal handling.
        cpu_collectives: on CPU meshes, ``"gloo"`` (default: FSDP2's own collectives, the path GPU users run on
            nccl) or ``"shared_memory"`` (opt-in, ranks of one host only: FSDP2's all-gather and reduce-scatter
            through ``/dev/shm`` with reused buffers, and a periodic heap trim; see :mod:`lightning_shard.cpu`).
            No effect on GPU meshes.
        gradient_accumulation: where gradients accumulate over ``Trainer(accumulate_grad_batches=k)`` micro-batches.
            ``"sharded"`` (default, as Lightning's FSDP strategies and torchtitan): every micro-batch's gradients are
            reduce-scattered and summed into the sharded gradients, so each rank holds ``1/N`` of them.
            ``"unsharded"``: non-final micro-batches skip the reduce-scatter (FSDP2
            ``set_requires_gradient_sync(False)``): less communication, but every rank keeps each parameter's whole
            gradient (in the reduce dtype, fp32 under the mixed precisions) on the device until the last micro-batch,
            4 bytes x parameters more (48 GiB per rank for the 13B GPT), with or without CPU offload. For when memory
            allows.
        compile: ``torch.compile`` each FSDP unit (transformer block) before sharding, as torchtitan does: ``True``
            (torch.compile's defaults) or a dict of its arguments (``{"mode": "max-autotune", "fullgraph": True}``).
        tensor_parallel_size: ranks that split each layer's matmuls between them (tensor parallelism; 1: none). The
            mesh becomes ``(data-parallel dims..., tensor_parallel)``, the tensor-parallel groups consecutive ranks
            (inside a node); FSDP shards over the data-parallel dimensions, and every rank of a tensor-parallel group
            gets the same batches. The module sees the mesh as ``self.device_mesh``.
        tensor_parallel_plan: which layers are split and how: ``"auto"`` (the model's own plan: a transformers
            model's ``base_model_tp_plan``, litgpt's ``GPT``, a ``tensor_parallel_plan`` the model declares), a dict
            of module-name patterns to styles (``{"layers.*.attn.q_proj": "colwise", ...}``), or a callable
            ``parallelize_fn(model, tp_mesh)``. See :mod:`lightning_shard.tensor_parallel.plan`.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device (``"cuda:nccl,cpu:gloo"`` with CPU
            offload on GPUs: the offloaded gradients are reduced on the CPU when clipping).
        timeout: process-group timeout.
        start_method: ``"popen"`` (re-run the script, like DDP) or ``"spawn"`` / ``"fork"`` / ``"forkserver"``.
        **fsdp_strategy_arguments: Lightning ``FSDPStrategy`` names (``activation_checkpointing_policy``,
            ``save_distributed_checkpoint``, ``device_mesh=(replicas, shard_size)``) are translated, as are FSDP1
            values (``ShardingStrategy`` enums, ``CPUOffload``, ``ModuleWrapPolicy``, ...); those without an FSDP2
            meaning (``mixed_precision``, ``use_orig_params``, ...) are refused with the replacement. See
            :mod:`lightning_shard.plan.fsdp1_compat`.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(strategy=ShardedStrategy(auto_wrap_policy=["Block"]), accelerator="cpu", devices=2)
    """

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        # `| str`: LightningCLI (jsonargparse) checks a Literal before the FSDP1 translation sees "full_shard".
        sharding_strategy: ShardingStrategyName | str = "FULL_SHARD",
        auto_wrap_policy: WrapPolicy = "auto",
        activation_checkpointing: WrapPolicy = None,
        reshard_after_forward: bool | int | None = None,
        forward_prefetch: bool = False,
        cpu_offload: bool | CPUOffloadPolicy = False,
        hybrid_shard_size: int | None = None,
        reduce_dtype: torch.dtype | None = None,
        state_dict_type: StateDictType | None = None,
        save_frozen_pretrained_weights: bool = True,
        async_save: bool = False,
        preemption: bool = True,
        cpu_collectives: CpuCollectives = "gloo",
        compile: bool | Mapping[str, Any] = False,
        gradient_accumulation: GradientAccumulation = "sharded",
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: TensorParallelPlan = "auto",
        selective_checkpointing_ops: Sequence[str] | None = None,
        activation_memory_budget: float | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **fsdp_strategy_arguments: Any,
    ) -> None:
        # The signature is spelled out for LightningCLI (jsonargparse reads it); the settings are built and checked
        # by the same code as the Fabric strategy's.
        arguments = {name: value for name, value in locals().items() if name in StrategySettings.names()}
        settings = StrategySettings.from_arguments({**arguments, **fsdp_strategy_arguments})
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=self._init_settings(settings, checkpoint_io),
            precision_plugin=precision_plugin,
        )

    # ------------------------------------------------------------------ properties Lightning reads

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded optimizer state can only be loaded into optimizers built on the sharded parameters.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> ShardedPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardedPrecision(reduce_dtype=self._reduce_dtype)
        return self._precision_plugin  # type: ignore[return-value]  (the setter admits only ShardedPrecision)

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = self._sharded_precision(precision_plugin, ShardedPrecision)

    # ------------------------------------------------------------------ launch and process group

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # As DDP: the popen launcher is built on every rank, also where torchrun or this launcher already created
        # the process, because its `launch` also sets each rank's torch threads to cores // ranks.
        if self._start_method == "popen":
            self._launcher = ShardedScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ShardedMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_process_group(self.lightning_module)
        if self.lightning_module is not None:
            # Lets `configure_model()` see the mesh, as under Lightning's ModelParallelStrategy.
            self.lightning_module._device_mesh = self._device_mesh
            if self.lightning_module._trainer is not None:
                # Before the callbacks' `setup`, where Lightning's WeightAveraging would deep-copy the whole model.
                callbacks = self.lightning_module.trainer.callbacks
                shard_weight_averaging(callbacks)
                # The same instances can go to another Trainer (or be pickled) as the classes the user made.
                self.undo_log.add("weight-averaging callback classes", partial(restore_weight_averaging, callbacks))
                self._weight_averaging = averaged_copy_place(callbacks)

    def set_world_ranks(self) -> None:
        self._set_world_ranks()

    # ------------------------------------------------------------------ model

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self._preemption:  # before the callbacks' `setup`, which arms the handlers
            add_strategy_preemption(model.trainer, self.undo_log)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Lightning's convention for `trainer.init_module(empty_init)`: the meta device only when asked for.
        meta = meta_construction() if empty_init else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # `configure_model()` builds on the meta device: `setup()` shards first and materialises afterwards, so a
        # model larger than one rank's memory never exists whole.
        with meta_construction():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        _evaluate_without_inference_mode(trainer, self.undo_log)
        link_when_published(trainer.checkpoint_callbacks, self.checkpoint_io, self.undo_log)
        if not is_parallelized(self.model):
            if self._layer_sync is not None:  # `Trainer(sync_batchnorm=True)`: statistics over all ranks' batches
                self.model = self._layer_sync.apply(self.model)
            self.model = self.precision_plugin.convert_module(self.model)
            # the checkpoint Lightning restores next writes these tensors: materialisation leaves them to it
            averaging = self._weight_averaging is not None and trainer.state.fn == TrainerFn.FITTING
            with loaded_after_setup(trainer_checkpoint_tensors(trainer, averaging)):
                self._shard_module(self.model, self.precision_plugin, trainer.accumulate_grad_batches)
            # "auto" sharding may have rebuilt the mesh
            self.lightning_module._device_mesh = self._device_mesh
        else:
            self._keep_sharding(self.model, self.precision_plugin)
        self._apply_run_settings()
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._prepare_optimizers([unwrapped_optimizer(optimizer) for optimizer in self.optimizers])
        self.precision_plugin.use_device(self.root_device)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        # `fully_shard` placed the parameters and buffers (parameter shards on the CPU when offloading); the rest -
        # torchmetrics states, `LightningModule.device` - follows here, or metrics would update on the wrong device.
        assert self.model is not None
        place_unmanaged_state(self.model, self.root_device)

    # A "loss_parallel" plan entry leaves the logits split over the vocabulary: the steps' losses and their backward
    # run inside torch's `loss_parallel()`, and Lightning gets the losses as plain tensors (tensor_parallel/loss.py).
    def _uses_loss_parallel(self) -> bool:
        return self.config.tensor_parallel_size > 1 and uses_loss_parallel(self.config.tensor_parallel_plan)

    def _step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self._uses_loss_parallel():
            return step(*args, **kwargs)
        with loss_parallel():
            return local_outputs(step(*args, **kwargs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().test_step, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        return self._step(super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers from an earlier `fit` hold references to this model's parameters; rebuild them.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_optimizer_step(self.model)
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Around non-final accumulation micro-batches: under ``gradient_accumulation="unsharded"`` skip the gradient
        reduce-scatter (FSDP2 keeps whole gradients until the last micro-batch); by default reduce-scatter anyway."""
        with self._gradient_sync_skipped(self.model):
            yield

    # ------------------------------------------------------------------ collectives

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return self.all_reduce(tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        # Unlike the base Strategy, leave the sharded model where it is: moving it to the CPU would gather nothing
        # useful, and after an exception mid-step FSDP's state cannot be moved at all.
        # Lightning calls it after every run, finished or failed: what the run changed outside the model goes back.
        try:
            self.checkpoint_io.teardown()
            assert self.cluster_environment is not None
            assert self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
        finally:
            self.undo_log.undo()


def _evaluate_without_inference_mode(trainer: pl.Trainer, undo_log: UndoLog) -> None:
    """Evaluate under ``no_grad`` instead of ``inference_mode``: tensors FSDP all-gathers inside inference mode
    become inference tensors, which a later training step cannot use (pytorch/pytorch#95957); Lightning makes
    the same exception for its own FSDPStrategy."""
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        undo_log.set_attribute(loop, "inference_mode", False)
