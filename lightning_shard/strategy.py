"""``ShardedStrategy``: Lightning's ``ParallelStrategy`` on FSDP2 ``fully_shard``.

Lightning calls the hooks below in this order: ``setup_environment`` (process group, device mesh), the module's
``configure_model`` inside ``model_sharded_context`` (meta device), ``setup`` (activation checkpointing, sharding,
materialisation, optimizers), then training with ``block_backward_sync`` around non-final accumulation micro-batches
(it skips the gradient reduce-scatter only under ``gradient_accumulation="unsharded"``), and ``save_checkpoint`` /
``load_checkpoint`` through :class:`~lightning_shard.ShardedCheckpointIO`.
"""

from __future__ import annotations

import atexit
import inspect
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.checkpoint import ShardedCheckpointIO
from lightning_shard.config import (
    CpuCollectives,
    GradientAccumulation,
    ShardingConfig,
    ShardingStrategyName,
    StateDictType,
)
from lightning_shard.devices import collective_device, place_unmanaged_state, process_group_backend_for
from lightning_shard.direct_calls import drop_gathered_parameters
from lightning_shard.fsdp1_compat import translate_fsdp_strategy_arguments
from lightning_shard.hf.frozen_weights import (
    RECORD_KEY,
    checkpoint_record,
    frozen_pretrained_weights,
    names_to_skip_on_resume,
)
from lightning_shard.launcher import ShardedMultiProcessingLauncher
from lightning_shard.materialize import meta_construction
from lightning_shard.memory.auto_sharding import choose_sharding, device_memory_bytes
from lightning_shard.parallelize import parallelize_module
from lightning_shard.precision import ShardedPrecision, check_reduce_dtype
from lightning_shard.wrap import WrapPolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
# Methods FSDP must treat as forward: Lightning calls the step methods, not `forward`, so the root unit's
# parameters (embeddings, final norm) are gathered around them.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class ShardedStrategy(ParallelStrategy):
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
        activation_checkpointing: which submodules recompute their activations in backward, in the same forms.
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
            trainable parameters, optimizer and loop states, and records the files (path, size, safetensors header
            hash). Resuming reads the base from the files again (``configure_model()`` does) and refuses files that
            are missing or changed. See :mod:`lightning_shard.hf.frozen_weights`.
        async_save: write sharded checkpoints in the background (see :class:`ShardedCheckpointIO`).
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
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device (``"cuda:nccl,cpu:gloo"`` with CPU
            offload on GPUs: the offloaded gradients are reduced on the CPU when clipping).
        timeout: process-group timeout.
        start_method: ``"popen"`` (re-run the script, like DDP) or ``"spawn"`` / ``"fork"`` / ``"forkserver"``.
        **fsdp_strategy_arguments: Lightning ``FSDPStrategy`` names (``activation_checkpointing_policy``,
            ``save_distributed_checkpoint``, ``device_mesh=(replicas, shard_size)``) are translated, as are FSDP1
            values (``ShardingStrategy`` enums, ``CPUOffload``, ``ModuleWrapPolicy``, ...); those without an FSDP2
            meaning (``mixed_precision``, ``use_orig_params``, ...) are refused with the replacement. See
            :mod:`lightning_shard.fsdp1_compat`.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(strategy=ShardedStrategy(auto_wrap_policy=["Block"]), accelerator="cpu", devices=2)
    """

    strategy_name = "fully_sharded"

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
        cpu_collectives: CpuCollectives = "gloo",
        compile: bool | Mapping[str, Any] = False,
        gradient_accumulation: GradientAccumulation = "sharded",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **fsdp_strategy_arguments: Any,
    ) -> None:
        settings = translate_fsdp_strategy_arguments(
            {
                "sharding_strategy": sharding_strategy,
                "auto_wrap_policy": auto_wrap_policy,
                "activation_checkpointing": activation_checkpointing,
                "reshard_after_forward": reshard_after_forward,
                "cpu_offload": cpu_offload,
                "hybrid_shard_size": hybrid_shard_size,
                "state_dict_type": state_dict_type,
            },
            fsdp_strategy_arguments,
            accepted=[
                name for name in inspect.signature(ShardedStrategy).parameters if name != "fsdp_strategy_arguments"
            ],
        )
        self.config = ShardingConfig(
            forward_prefetch=forward_prefetch,
            cpu_collectives=cpu_collectives,
            compile=compile,
            gradient_accumulation=gradient_accumulation,
            save_frozen_pretrained_weights=save_frozen_pretrained_weights,
            **settings,
        )
        if start_method not in _START_METHODS:
            raise ValueError(f"`start_method={start_method!r}` is not one of {_START_METHODS}.")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"`timeout={timeout!r}` must be a datetime.timedelta, e.g. `timedelta(minutes=10)`.")
        check_reduce_dtype(reduce_dtype)
        self._reduce_dtype = reduce_dtype
        self._heap_trimmer = _heap_trimmer(cpu_collectives)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        if async_save:
            if checkpoint_io is not None:
                raise ValueError("Pass `async_save` to your `ShardedCheckpointIO(async_save=True)`, not to both.")
            if self.config.state_dict_type != "sharded":
                raise ValueError("`async_save=True` writes sharded checkpoints; use `state_dict_type='sharded'`.")
            self._checkpoint_io = ShardedCheckpointIO(async_save=True)

    # ------------------------------------------------------------------ properties Lightning reads

    @property
    def is_distributed(self) -> bool:
        """Tells the Trainer to add a DistributedSampler and honour ``sync_dist``."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh: 1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` for hybrid / no sharding."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once `setup_environment()` has initialised the process group.")
        return self._device_mesh

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

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
        # The accelerator connector hands every strategy a generic plugin (autocast MixedPrecision, HalfPrecision,
        # ...) for the `precision=` string; FSDP does mixed precision itself, so translate the string.
        if precision_plugin is not None and not isinstance(precision_plugin, ShardedPrecision):
            precision_plugin = ShardedPrecision(precision_plugin.precision, reduce_dtype=self._reduce_dtype)
        self._precision_plugin = precision_plugin

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> ShardedCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        return self._checkpoint_io  # type: ignore[return-value]  (the setter admits only ShardedCheckpointIO)

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, ShardedCheckpointIO):
            raise TypeError(
                f"`checkpoint_io={io!r}`: the sharded strategy writes through `ShardedCheckpointIO` "
                "(torch.distributed.checkpoint); pass an instance of it or a subclass."
            )
        self._checkpoint_io = io

    # ------------------------------------------------------------------ launch and process group

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # As DDP: the popen launcher is built on every rank, also where torchrun or this launcher already created
        # the process, because its `launch` also sets each rank's torch threads to cores // ranks.
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ShardedMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # "auto" may choose CPU offload after the process group exists.
        may_offload = bool(self.config.cpu_offload) or self.config.sharding_strategy == "auto"
        self._process_group_backend = process_group_backend_for(
            self.root_device, cpu_offload=may_offload, requested=self._process_group_backend
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        created_here = not _distributed_is_initialized()
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        if created_here:
            # Lightning destroys the process group at exit for nccl only. Under gloo a worker thread can still drop
            # the last reference to a collective's tensors while the interpreter finalises; taking the GIL then
            # aborts the process ("terminate called without an active exception", rc -6, seen once in CI).
            # Destroying the group while the interpreter is alive joins those threads first. Unregister first so
            # that nccl, or a second fit in the same process, does not queue the handler twice.
            atexit.unregister(_destroy_dist_connection)
            atexit.register(_destroy_dist_connection)
        self._device_mesh = self._build_device_mesh()
        if self.lightning_module is not None:
            # Lets `configure_model()` see the mesh, as under Lightning's ModelParallelStrategy.
            self.lightning_module._device_mesh = self._device_mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _build_device_mesh(self) -> DeviceMesh:
        shape = self.config.mesh_shape(self.world_size, self.num_processes)
        shard_size, per_node = shape[-1], self.num_processes
        if self.config.sharding_strategy == "HYBRID_SHARD" and shard_size % per_node and per_node % shard_size:
            rank_zero_warn(
                f"`hybrid_shard_size={shard_size}` with {per_node} devices per node makes shard groups that straddle "
                "nodes unevenly; pick a divisor or a multiple of the devices per node."
            )
        device_type = self.root_device.type
        if len(shape) == 1:
            return init_device_mesh(device_type, shape, mesh_dim_names=("shard",))
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))

    # ------------------------------------------------------------------ model

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
        _evaluate_without_inference_mode(trainer)
        if not isinstance(self.model, FSDPModule):
            self._shard_model()
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.device_mesh["shard"].size() > 1:
                _check_optimizers_are_elementwise(self.optimizers)
        self.precision_plugin.use_device(self.root_device)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_model(self) -> None:
        assert self.model is not None
        if self.config.sharding_strategy == "auto":
            self._choose_sharding()
        self.model = self.precision_plugin.convert_module(self.model)
        units = parallelize_module(
            self.model,
            self.device_mesh,
            self.config,
            mp_policy=self.precision_plugin.mp_policy,
            offload_policy=self._offload_policy(),
            device=self.root_device,
            forward_methods=[name for name in _STEP_METHODS if hasattr(self.model, name)],
        )
        rank_zero_info(
            f"{type(self).__name__}: {self.config.sharding_strategy} over mesh {tuple(self.device_mesh.shape)}, "
            f"{len(units)} FSDP units + root: {sorted({type(u).__name__.removeprefix('FSDP') for u in units})}"
        )

    def _choose_sharding(self) -> None:
        assert self.model is not None
        choice = choose_sharding(
            self.model,
            world_size=self.world_size,
            precision=self.precision_plugin.precision,
            activation_checkpointing=self.config.activation_checkpointing is not None,
            accumulate_grad_batches=self.lightning_module.trainer.accumulate_grad_batches,
            gradient_accumulation=self.config.gradient_accumulation,
            device_memory_bytes=device_memory_bytes(self.root_device, self.num_processes),
            can_offload=self.root_device.type == "cuda",
        )
        # Rank 0 decides for all: nodes may report different memory.
        choice = self.broadcast(choice)
        rank_zero_info(
            f"{type(self).__name__}: sharding_strategy='auto' chose {choice.sharding_strategy}: {choice.reason}"
        )
        self.config = replace(self.config, sharding_strategy=choice.sharding_strategy, cpu_offload=choice.cpu_offload)
        if tuple(self.device_mesh.shape) != self.config.mesh_shape(self.world_size, self.num_processes):
            self._device_mesh = self._build_device_mesh()
            self.lightning_module._device_mesh = self._device_mesh

    def _offload_policy(self) -> OffloadPolicy:
        if not self.config.cpu_offload:
            return OffloadPolicy()
        if self.root_device.type == "cpu":
            rank_zero_info("`cpu_offload` changes nothing on a CPU accelerator: the shards already live in CPU memory.")
            return OffloadPolicy()
        return self.config.cpu_offload if isinstance(self.config.cpu_offload, CPUOffloadPolicy) else CPUOffloadPolicy()

    @override
    def model_to_device(self) -> None:
        # `fully_shard` placed the parameters and buffers (parameter shards on the CPU when offloading); the rest -
        # torchmetrics states, `LightningModule.device` - follows here, or metrics would update on the wrong device.
        assert self.model is not None
        place_unmanaged_state(self.model, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers from an earlier `fit` hold references to this model's parameters; rebuild them.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # A call made between backward and the step (a callback) left gathered copies of the old values.
        drop_gathered_parameters(self.model)
        if self._heap_trimmer is not None and self.root_device.type == "cpu":
            # The step's transient buffers are free now; without a trim now and then the CPU heap's peak creeps up.
            self._heap_trimmer.step()
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Around non-final accumulation micro-batches: under ``gradient_accumulation="unsharded"`` skip the gradient
        reduce-scatter (FSDP2 keeps whole gradients until the last micro-batch); by default reduce-scatter anyway."""
        if self.config.gradient_accumulation == "sharded" or not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if collective_device(dist.get_backend()).type == "cuda":  # "nccl" or "cuda:nccl,cpu:gloo"
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
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

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self.checkpoint_io.optimizer_state(self.model, optimizer, full=self.config.state_dict_type == "full")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Every rank takes part: a sharded save writes each rank's shard, a full save gathers to rank 0.
        path = self.broadcast(str(filepath))
        left_out = self._frozen_pretrained_weights_left_out()
        if left_out:  # the state dict left them out; the checkpoint says which, and where they are read from
            checkpoint = {**checkpoint, RECORD_KEY: checkpoint_record(left_out)}
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
        self.barrier("remove_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None
        assert self.lightning_module is not None
        path = self.broadcast(str(checkpoint_path))
        checkpoint = self.checkpoint_io.load_into(
            path,
            self.model,
            [opt._optimizer if isinstance(opt, LightningOptimizer) else opt for opt in self.optimizers],
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            absent=names_to_skip_on_resume(path, self.model),
        )
        drop_gathered_parameters(self.model)  # gathered before the load (a call after fit): stale now
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # `load_checkpoint` already loaded the weights into the sharded model.
        pass

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # `load_checkpoint` already loaded the optimizer states into the sharded optimizers.
        pass

    @override
    def teardown(self) -> None:
        # Unlike the base Strategy, leave the sharded model where it is: moving it to the CPU would gather nothing
        # useful, and after an exception mid-step FSDP's state cannot be moved at all.
        self.checkpoint_io.teardown()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = {
            "fully_sharded": ("FULL_SHARD", False, "shards parameters, gradients and optimizer states (FSDP2)"),
            "fully_sharded_grad_op": ("SHARD_GRAD_OP", False, "keeps parameters gathered from forward to backward"),
            "fully_sharded_offload": ("FULL_SHARD", True, "FULL_SHARD with parameters and states in CPU memory"),
            "hybrid_sharded": ("HYBRID_SHARD", False, "shards within a node, replicates across nodes"),
        }
        for name, (sharding_strategy, cpu_offload, description) in entries.items():
            strategy_registry.register(
                name,
                cls,
                description=f"lightning-shard: {description}",
                sharding_strategy=sharding_strategy,
                cpu_offload=cpu_offload,
            )


def _heap_trimmer(cpu_collectives: str) -> Any:
    """The opt-in CPU transport trims the heap every 5 optimizer steps (after every step cost 9-13% of the step
    time, every 5th about 2%); the default path leaves the allocator alone."""
    if cpu_collectives != "shared_memory":
        return None
    from lightning_shard.cpu import HeapTrimmer

    return HeapTrimmer(every=5)


def _evaluate_without_inference_mode(trainer: pl.Trainer) -> None:
    """Evaluate under ``no_grad`` instead of ``inference_mode``: tensors FSDP all-gathers inside inference mode
    become inference tensors, which a later training step cannot use (pytorch/pytorch#95957); Lightning makes
    the same exception for its own FSDPStrategy."""
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


# Optimizers whose update for one element depends on others of the same parameter (factored or matrix
# statistics, layer-wise trust ratios, line searches): on a shard they would compute a different update.
_NON_ELEMENTWISE_OPTIMIZERS = {"Adafactor", "LBFGS", "Muon", "Shampoo", "DistributedShampoo", "LAMB", "Lamb", "LARS"}


def _check_optimizers_are_elementwise(optimizers: list[Optimizer]) -> None:
    for optimizer in optimizers:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        name = type(inner).__name__
        if name in _NON_ELEMENTWISE_OPTIMIZERS:
            raise ValueError(
                f"The optimizer {name} computes each update from whole-parameter statistics, but under the sharded "
                "strategy every rank holds only a shard of each parameter, so its updates would be wrong. Use an "
                "elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...), or `sharding_strategy='NO_SHARD'`, "
                "where every rank holds whole parameters."
            )
