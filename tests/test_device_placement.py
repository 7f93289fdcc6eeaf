"""Where tensors end up and which process-group backend is chosen, for the GPU path, tested on the CPU.

The CUDA decisions are pure functions of a ``torch.device`` (``lightning_shard.devices``), so they are called with
``torch.device("cuda", 0)`` directly; where tensors must really be allocated, the meta device stands in for the GPU
(anything that is not the CPU shows whether a tensor followed the compute device or stayed in CPU memory).
"""

from __future__ import annotations

import tempfile
import warnings
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

import lightning_shard.core.strategy_core as strategy_module
import lightning_shard.memory.callback as memory_callback
from lightning_shard import ShardedMemoryMonitor, ShardedPrecision, ShardedStrategy, ShardingConfig
from lightning_shard.devices import materialization_devices, place_unmanaged_state, process_group_backend_for
from lightning_shard.memory.process_memory import CUDA_KEYS
from lightning_shard.plan.parallelize import parallelize_module

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
META = torch.device("meta")


# ---------------------------------------------------------------- process-group backend


@pytest.mark.parametrize(
    ("device", "offload", "expected"),
    [
        (CPU, False, "gloo"),
        (CPU, True, "gloo"),  # offload is a no-op on CPU ranks
        (CUDA, False, "nccl"),
        (CUDA, True, "cuda:nccl,cpu:gloo"),  # torchtitan's string: CPU gradients reduce over gloo
    ],
)
def test_default_backend_serves_every_device_the_gradients_live_on(device, offload, expected) -> None:
    assert process_group_backend_for(device, cpu_offload=offload) == expected


def test_a_requested_backend_is_kept_unless_offloaded_gradients_could_not_be_reduced() -> None:
    assert process_group_backend_for(CUDA, cpu_offload=True, requested="cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend_for(CUDA, cpu_offload=False, requested="nccl") == "nccl"
    assert process_group_backend_for(CPU, cpu_offload=True, requested="gloo") == "gloo"
    with pytest.raises(ValueError, match=r"`process_group_backend='nccl'` cannot reduce CPU tensors.*'cuda:nccl,cpu"):
        process_group_backend_for(CUDA, cpu_offload=True, requested="nccl")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "nccl"),
        ({"cpu_offload": True}, "cuda:nccl,cpu:gloo"),
        ({"sharding_strategy": "auto"}, "cuda:nccl,cpu:gloo"),  # "auto" may choose offload after the group exists
    ],
)
def test_strategy_initialises_the_process_group_with_that_backend(monkeypatch, kwargs, expected) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(ParallelStrategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(strategy_module, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(
        strategy_module, "_init_dist_connection", lambda env, backend, **kw: calls.append((backend, kw["device_id"]))
    )
    monkeypatch.setattr(ShardedStrategy, "_build_device_mesh", lambda self: None)
    strategy = ShardedStrategy(parallel_devices=[CUDA], cluster_environment=LightningEnvironment(), **kwargs)
    strategy.setup_environment()
    assert calls == [(expected, CUDA)]
    assert strategy.process_group_backend == expected


# ---------------------------------------------------------------- parameters, buffers, metrics


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


class Normed(nn.Module):
    """A unit holding parameters and buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)


def test_materialization_devices() -> None:
    assert materialization_devices(CUDA, cpu_offload=False) == (CUDA, CUDA)
    assert materialization_devices(CUDA, cpu_offload=True) == (CPU, CUDA)


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "cpu_offload"])
def test_meta_model_buffers_follow_the_compute_device_and_offloaded_parameters_stay_on_the_cpu(mesh, offload) -> None:
    with torch.device("meta"):
        model = nn.Sequential(Normed(), Normed())
    parallelize_module(
        model,
        mesh,
        ShardingConfig(auto_wrap_policy={Normed}, cpu_offload=offload),
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy(),
        device=META,  # stands in for the GPU: the tensors that follow the compute device end up here
    )
    parameters = {p.to_local().device.type for p in model.parameters() if isinstance(p, DTensor)}
    buffers = {name: b.device.type for name, b in model.named_buffers()}
    assert parameters == {"cpu" if offload else "meta"}
    assert len(buffers) == 6 and set(buffers.values()) == {"meta"}


def test_eagerly_built_buffers_are_kept_when_materialising_the_rest(mesh) -> None:
    with torch.device("meta"):
        model = nn.Sequential(Normed())
    real = torch.arange(4.0)
    model[0].norm.running_mean = real.clone()  # built for real, e.g. a rotary table computed in __init__
    parallelize_module(
        model, mesh, ShardingConfig(), mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), device=CPU
    )
    assert model[0].norm.running_mean.device == CPU and not model[0].norm.running_var.is_meta
    # BatchNorm's reset_parameters zeroes the statistics in place: the kept tensor, not a new one
    assert model[0].norm.running_mean.eq(0).all()


class WithMetric(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.val_loss = torchmetrics.aggregation.MeanMetric()


def test_unmanaged_state_follows_the_device_and_parameters_do_not_move() -> None:
    module = WithMetric()
    place_unmanaged_state(module, META)
    assert module.device == META  # LightningModule.device, which Lightning and callbacks read
    assert {s.device.type for s in (module.val_loss.mean_value, module.val_loss.weight)} == {"meta"}
    assert module.layer.weight.device == CPU  # parameters are fully_shard's business (offload keeps them on CPU)


def test_strategy_places_the_module_on_its_root_device() -> None:
    strategy = ShardedStrategy(parallel_devices=[META])
    module = WithMetric()
    strategy.model = module
    strategy.model_to_device()
    assert module.device == META and module.val_loss.mean_value.is_meta


# ---------------------------------------------------------------- grad scaler


def test_grad_scaler_takes_the_accelerators_device() -> None:
    on_cpu = ShardedPrecision("16-mixed")
    assert on_cpu.scaler is None  # created when the strategy knows its device
    on_cpu.use_device(CPU)
    assert on_cpu.scaler._device == "cpu" and on_cpu.scaler.is_enabled()
    on_gpu = ShardedPrecision("16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler("cuda") warns and disables itself where CUDA is missing
        on_gpu.use_device(CUDA)
    assert on_gpu.scaler._device == "cuda"
    mine = torch.amp.GradScaler("cpu")
    given = ShardedPrecision("16-mixed", scaler=mine)
    given.use_device(CUDA)
    assert given.scaler is mine
    bf16 = ShardedPrecision("bf16-mixed")
    bf16.use_device(CUDA)
    assert bf16.scaler is None


# ---------------------------------------------------------------- memory monitor


def _fake_trainer(root_device: torch.device, gathered: list[torch.device]) -> Any:
    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tensor.device)
        return torch.zeros(tensor.shape)

    strategy = SimpleNamespace(root_device=root_device, all_gather=all_gather)
    return SimpleNamespace(strategy=strategy, optimizers=[], global_step=2, is_global_zero=False, loggers=[])


def test_memory_monitor_reads_cuda_figures_for_the_strategys_device(monkeypatch) -> None:
    monkeypatch.setattr(memory_callback, "cuda_memory", lambda device: dict.fromkeys(CUDA_KEYS, device.index + 7))
    module = WithMetric()  # its device property still says cpu: the monitor must not rely on it
    figures = ShardedMemoryMonitor()._measure(_fake_trainer(CUDA, []), module)
    assert {key: figures[key] for key in CUDA_KEYS} == dict.fromkeys(CUDA_KEYS, 7)
    assert not set(CUDA_KEYS) & set(ShardedMemoryMonitor()._measure(_fake_trainer(CPU, []), module))


def test_memory_monitor_gathers_on_the_strategys_device() -> None:
    gathered: list[torch.device] = []
    ShardedMemoryMonitor()._record(_fake_trainer(META, gathered), WithMetric())
    assert gathered == [META]  # nccl gathers device tensors only


# ---------------------------------------------------------------- collectives the strategy issues itself


@pytest.mark.parametrize(
    ("backend", "device_type"),
    [("nccl", "cuda"), ("cuda:nccl,cpu:gloo", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"), ("gloo", "cpu")],
)
def test_full_file_loads_and_barriers_go_over_nccl_whenever_it_serves_the_group(
    monkeypatch, backend: str, device_type: str
) -> None:
    # `dist.get_backend()` of a mixed group (CPU offload, "auto") is the composite string, never "nccl": the
    # full-file broadcast went through gloo, tensor by tensor, and the barrier had no device.
    import lightning_shard.checkpoint.unit_load as unit_load

    monkeypatch.setattr(dist, "get_backend", lambda *args: backend)
    monkeypatch.setattr(unit_load, "_distributed_is_initialized", lambda: True)
    assert unit_load._broadcast_device().type == device_type
    barriers: list[dict[str, Any]] = []
    monkeypatch.setattr(strategy_module, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: barriers.append(kwargs))
    ShardedStrategy(parallel_devices=[CUDA]).barrier()
    assert barriers == [{"device_ids": [0]} if device_type == "cuda" else {}]
