"""``ShardedStrategyCore``: what the Trainer strategy and the Fabric strategy share.

Lightning has two front-ends with a ``ParallelStrategy`` each - the Trainer's (``lightning.pytorch``) and Fabric's
(``lightning.fabric``) - whose hooks differ (a ``LightningModule`` and its loops against a ``state`` dict and the
user's loop) but whose plumbing is the same: ranks, process group, device mesh, collectives, the checkpoint IO. The
two ``ShardedStrategy`` classes put this mixin in front of their framework's base class and keep only the hooks
that differ; the sharding itself (:func:`~lightning_shard.plan.parallelize.parallelize_module`), the precision rules
(:class:`~lightning_shard.plan.precision.PrecisionPolicy`) and the checkpoint machinery
(:class:`~lightning_shard.checkpoint.ShardedCheckpointIO`) are called from here, never copied into an adapter.
"""

from __future__ import annotations

import atexit
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.optim import Optimizer

from lightning_shard.checkpoint import ShardedCheckpointIO
from lightning_shard.core.buffers import broadcast_buffers
from lightning_shard.core.fused_optimizer import use_fused_kernels
from lightning_shard.core.process_exit import end_process_group
from lightning_shard.core.settings import StrategySettings
from lightning_shard.core.sharded_with import check_same_sharding, record_sharding, sharded_mesh
from lightning_shard.core.undo import UndoLog
from lightning_shard.devices import collective_device, process_group_backend_for
from lightning_shard.memory.auto_sharding import choose_sharding, device_memory_bytes
from lightning_shard.plan.activation_checkpointing import SELECTIVE
from lightning_shard.plan.config import DATA_PARALLEL_DIM, ShardingConfig
from lightning_shard.plan.direct_calls import drop_gathered_parameters
from lightning_shard.plan.parallelize import parallelize_module
from lightning_shard.plan.precision import PrecisionPolicy
from lightning_shard.plan.replicated import set_gradient_sync
from lightning_shard.standalone_packages.mixing import describe
from lightning_shard.torch_compat.compile_config import activation_memory_budget, set_activation_memory_budget
from lightning_shard.torch_compat.distributed import flatten_mesh_dims

TBroadcast = TypeVar("TBroadcast")
TPrecision = TypeVar("TPrecision", bound=PrecisionPolicy)

# Methods FSDP must treat as forward: Lightning calls the step methods (Fabric too, for a LightningModule), not
# `forward`, so the root unit's parameters (embeddings, final norm) are gathered around them.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class ShardedStrategyCore:
    """The plumbing both ``ShardedStrategy`` front-ends share, in front of their framework's ``ParallelStrategy``
    (which provides ``parallel_devices``, ``cluster_environment`` and the ranks).

    Example:
        >>> from lightning_shard import ShardedStrategy
        >>> ShardedStrategy(sharding_strategy="SHARD_GRAD_OP").config.sharding_strategy
        'SHARD_GRAD_OP'
    """

    strategy_name = "fully_sharded"
    # Says which Lightning package the strategy is for: Lightning's refusal of the other one's prints it.
    __repr__ = describe

    # Provided by Lightning's ParallelStrategy (Trainer or Fabric).
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    _checkpoint_io: CheckpointIO | None
    local_rank: int
    node_rank: int
    global_rank: int
    world_size: int

    def _init_settings(self, settings: StrategySettings, checkpoint_io: CheckpointIO | None) -> CheckpointIO | None:
        """Keep ``settings`` (call before the framework's constructor, whose precision setter reads them); return the
        checkpoint IO to hand to that constructor."""
        self.config: ShardingConfig = settings.config
        self._reduce_dtype = settings.reduce_dtype
        self._process_group_backend = settings.process_group_backend
        self._timeout = settings.timeout
        self._start_method = settings.start_method
        self._preemption = settings.preemption
        self._num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        # Where a weight-averaging copy will be kept ("device" / "cpu"), for "auto" sharding's estimate.
        self._weight_averaging: str | None = None
        self._heap_trimmer = _heap_trimmer(settings.config.cpu_collectives)
        # What a run changes outside the model, undone by `teardown` after every run, finished or failed.
        self.undo_log = UndoLog()
        if not settings.async_save:
            return checkpoint_io
        if checkpoint_io is not None:
            raise ValueError("Pass `async_save` to your `ShardedCheckpointIO(async_save=True)`, not to both.")
        return ShardedCheckpointIO(async_save=True)

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
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one tensor-parallel group compute on the same batch: the sampler spans the data-parallel ranks
        # (the tensor-parallel dimension is the mesh's last, so a group is `tensor_parallel_size` consecutive ranks).
        size = self.config.tensor_parallel_size
        return {"num_replicas": self.num_nodes * self.num_processes // size, "rank": self.global_rank // size}

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh: data-parallel ``("shard",)``, or ``("replicate", "shard")`` for hybrid / no sharding; with
        ``tensor_parallel_size > 1`` a last ``"tensor_parallel"`` dimension, and ``"data_parallel"`` naming the
        data-parallel dimensions together (the names of Lightning's ``ModelParallelStrategy``)."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once `setup_environment()` has initialised the process group.")
        return self._device_mesh

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def checkpoint_io(self) -> ShardedCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        return self._checkpoint_io  # type: ignore[return-value]  (the setter admits only ShardedCheckpointIO)

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, ShardedCheckpointIO):
            raise TypeError(
                f"`checkpoint_io={io!r}`: the sharded strategy writes through `ShardedCheckpointIO` "
                "(torch.distributed.checkpoint); pass an instance of it or a subclass."
            )
        self._checkpoint_io = io

    def _sharded_precision(self, plugin: Any, kind: type[TPrecision]) -> TPrecision | None:
        """The framework hands every strategy a generic plugin (autocast MixedPrecision, HalfPrecision, ...) for its
        ``precision=`` string; FSDP does mixed precision itself, so translate the string into ``kind``. ``None``
        stays unset: the frameworks read it to tell a strategy built with a precision from one without."""
        if plugin is None or isinstance(plugin, kind):
            return plugin
        return kind(plugin.precision, reduce_dtype=self._reduce_dtype)

    # ------------------------------------------------------------------ process group and mesh

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _setup_process_group(self, model: nn.Module | None = None) -> None:
        """Ranks, the process group (its backend from the device and the offload setting) and the device mesh: that
        of ``model`` when an earlier run sharded it."""
        reset_seed()
        self._set_world_ranks()
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
            # Lightning ends the process group at exit for nccl only; under gloo a collective's worker thread can
            # still hold tensors when the interpreter finalises, and the process aborts (see `process_exit`).
            # Unregister first so that a second fit in the same process does not queue the handler twice.
            atexit.unregister(end_process_group)
            atexit.register(end_process_group)
        self._device_mesh = sharded_mesh(model) or self._build_device_mesh()

    def _build_device_mesh(self) -> DeviceMesh:
        data_parallel = self.config.mesh_shape(self.world_size, self.num_processes)
        size, per_node = self.config.tensor_parallel_size, self.num_processes
        if size > 1 and per_node % size:
            rank_zero_warn(
                f"`tensor_parallel_size={size}` with {per_node} devices per node puts tensor-parallel groups across "
                "nodes, whose links are much slower than a node's own; choose a divisor of the devices per node."
            )
        group = data_parallel[-1] * size  # consecutive ranks that one shard group spans
        if self.config.sharding_strategy == "HYBRID_SHARD" and group % per_node and per_node % group:
            rank_zero_warn(
                f"`hybrid_shard_size={data_parallel[-1]}` with {per_node} devices per node makes shard groups that "
                "straddle nodes unevenly; pick a divisor or a multiple of the devices per node."
            )
        names = self.config.mesh_dim_names(len(data_parallel))
        mesh = init_device_mesh(self.root_device.type, (*data_parallel, size)[: len(names)], mesh_dim_names=names)
        if size > 1:
            flatten_mesh_dims(mesh, names[:-1], DATA_PARALLEL_DIM)
        return mesh

    # ------------------------------------------------------------------ model

    def _shard_module(self, module: nn.Module, precision: PrecisionPolicy, accumulate_grad_batches: int) -> None:
        """Checkpoint, compile, shard and materialise ``module`` in place (already converted to ``precision``'s
        parameter dtype), recording the settings on it."""
        requested = self.config
        if self.config.sharding_strategy == "auto":
            self._choose_sharding(module, precision, accumulate_grad_batches)
        units = parallelize_module(
            module,
            self.device_mesh,
            self.config,
            mp_policy=precision.mp_policy,
            offload_policy=self._offload_policy(),
            device=self.root_device,
            forward_methods=[name for name in _STEP_METHODS if hasattr(module, name)],
        )
        record_sharding(module, requested, self.config, precision, self.device_mesh)
        rank_zero_info(
            f"{type(self).__name__}: {self.config.sharding_strategy} over mesh {tuple(self.device_mesh.shape)}, "
            f"{len(units)} FSDP units + root: {sorted({type(u).__name__.removeprefix('FSDP') for u in units})}"
        )

    def _keep_sharding(self, module: nn.Module, precision: Any) -> None:
        """A model sharded by an earlier run (a second ``fit``, another Trainer or Fabric): go on with its sharding
        if this run's settings are the ones it was sharded with, else stop before any work (see
        :mod:`lightning_shard.core.sharded_with`)."""
        self.config = check_same_sharding(module, self.config, precision)

    def _apply_run_settings(self) -> None:
        """The process-wide settings of this run, undone at teardown: they must not govern the next run."""
        budget = self.config.activation_memory_budget
        if self.config.compile_kwargs is not None and budget is not None:
            self.undo_log.add(
                "activation_memory_budget", partial(set_activation_memory_budget, activation_memory_budget())
            )
            set_activation_memory_budget(budget)

    def _choose_sharding(self, module: nn.Module, precision: PrecisionPolicy, accumulate_grad_batches: int) -> None:
        checkpointed = self.config.activation_checkpointing
        choice = choose_sharding(
            module,
            world_size=self.world_size,
            precision=precision.precision,
            activation_checkpointing=checkpointed if checkpointed == SELECTIVE else checkpointed is not None,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_accumulation=self.config.gradient_accumulation,
            device_memory_bytes=device_memory_bytes(self.root_device, self.num_processes),
            can_offload=self.root_device.type == "cuda",
            weight_averaging=self._weight_averaging,  # type: ignore[arg-type]
            tensor_parallel_size=self.config.tensor_parallel_size,
            tensor_parallel_plan=self.config.tensor_parallel_plan,
        )
        # Rank 0 decides for all: nodes may report different memory.
        choice = self.broadcast(choice)
        rank_zero_info(
            f"{type(self).__name__}: sharding_strategy='auto' chose {choice.sharding_strategy}: {choice.reason}"
        )
        self.config = replace(self.config, sharding_strategy=choice.sharding_strategy, cpu_offload=choice.cpu_offload)
        if self.device_mesh["shard"].size() != self.config.mesh_shape(self.world_size, self.num_processes)[-1]:
            self._device_mesh = self._build_device_mesh()

    def _offload_policy(self) -> OffloadPolicy:
        if not self.config.cpu_offload:
            return OffloadPolicy()
        if self.root_device.type == "cpu":
            rank_zero_info("`cpu_offload` changes nothing on a CPU accelerator: the shards already live in CPU memory.")
            return OffloadPolicy()
        return self.config.cpu_offload if isinstance(self.config.cpu_offload, CPUOffloadPolicy) else CPUOffloadPolicy()

    @contextmanager
    def _gradient_sync_skipped(self, module: nn.Module | None, skip: bool = True) -> Generator[None, None, None]:
        """Around non-final accumulation micro-batches: under ``gradient_accumulation="unsharded"`` skip the gradient
        reduce-scatter (FSDP2 keeps whole gradients until the last micro-batch); by default reduce-scatter anyway."""
        if not skip or self.config.gradient_accumulation == "sharded" or not isinstance(module, FSDPModule):
            yield
            return
        module.set_requires_gradient_sync(False)
        set_gradient_sync(module, False)  # the replicated parameters' gradients wait for the last micro-batch too
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
            set_gradient_sync(module, True)

    def _prepare_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Refuse optimizers that would compute wrong updates on shards; switch the rest to fused kernels."""
        whole = self.device_mesh["shard"].size() == 1 and self.config.tensor_parallel_size == 1
        for optimizer in [] if whole else optimizers:  # whole parameters: any optimizer computes the same update
            name = type(optimizer).__name__
            if name in _NON_ELEMENTWISE_OPTIMIZERS:
                raise ValueError(
                    f"The optimizer {name} computes each update from whole-parameter statistics, but under the "
                    "sharded strategy every rank holds only a shard of each parameter, so its updates would be wrong. "
                    "Use an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...), or "
                    "`sharding_strategy='NO_SHARD'` without tensor parallelism, where every rank holds whole "
                    "parameters."
                )
        use_fused_kernels(optimizers)

    def _after_optimizer_step(self, *models: nn.Module | None) -> None:
        for model in models:
            if model is not None:
                # A call made between backward and the step (a callback) left gathered copies of the old values.
                drop_gathered_parameters(model)
                broadcast_buffers(model)  # rank 0's, as DDP: see lightning_shard.core.buffers
        if self._heap_trimmer is not None and self.root_device.type == "cpu":
            # The step's transient buffers are free now; without a trim now and then the CPU heap's peak creeps up.
            self._heap_trimmer.step()

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if collective_device(dist.get_backend()).type == "cuda":  # "nccl" or "cuda:nccl,cpu:gloo"
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """The same names in the Trainer's and in Fabric's registry: ``Trainer(strategy="fully_sharded")`` and
        ``Fabric(strategy="fully_sharded")``."""
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


# Optimizers whose update for one element depends on others of the same parameter (factored or matrix
# statistics, layer-wise trust ratios, line searches): on a shard they would compute a different update.
_NON_ELEMENTWISE_OPTIMIZERS = {"Adafactor", "LBFGS", "Muon", "Shampoo", "DistributedShampoo", "LAMB", "Lamb", "LARS"}
