"""Where each tensor lives and which process-group backend serves it: small decisions the strategy and
:func:`~lightning_shard.plan.parallelize.parallelize_module` take from the compute device and the offload setting.

They are pure functions of a ``torch.device`` (or act on a module given one), so the CUDA answers are tested on a
CPU machine with a stand-in device. What FSDP2 itself does, read in ``torch/distributed/fsdp/_fully_shard/``:

* ``fully_shard`` moves the parameters and buffers of the modules it manages to the mesh's device
  (``_get_device_from_mesh``, ``_move_states_to_device``), skipping meta tensors, and with a ``CPUOffloadPolicy``
  copies each parameter's shard back to CPU memory (``FSDPParam._init_sharded_param``). Buffers stay on the device:
  forward computes with them there.
* It moves nothing else: a module without parameters or buffers (a torchmetrics ``Metric`` keeps its states as
  plain attributes) stays where it was built, and ``LightningModule.device`` is never updated.
"""

from __future__ import annotations

import torch
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from torch import nn

_CPU = torch.device("cpu")


def process_group_backend_for(device: torch.device, *, cpu_offload: bool, requested: str | None = None) -> str:
    """The ``init_process_group`` backend for ranks computing on ``device``.

    Offloading keeps gradients on the CPU, where gradient clipping and the fp16 inf check reduce them across ranks;
    nccl reduces device tensors only, so an offloading GPU job also needs gloo for CPU tensors - torchtitan's
    ``cuda:nccl,cpu:gloo``. FSDP2's own collectives keep running on the device backend.

    Raises:
        ValueError: a requested backend without a CPU part for an offloading GPU job.

    Example:
        >>> process_group_backend_for(torch.device("cuda", 0), cpu_offload=True)
        'cuda:nccl,cpu:gloo'
        >>> process_group_backend_for(torch.device("cpu"), cpu_offload=True)
        'gloo'
    """
    needs_cpu_backend = cpu_offload and device.type != "cpu"
    if requested is None:
        backend = _get_default_process_group_backend_for_device(device)
        return f"{device.type}:{backend},cpu:gloo" if needs_cpu_backend else backend
    if needs_cpu_backend and not _serves_cpu_tensors(requested):
        raise ValueError(
            f"`process_group_backend={requested!r}` cannot reduce CPU tensors, but with CPU offload the gradients "
            f"that clipping and the fp16 grad scaler reduce live on the CPU. Use '{device.type}:{requested},cpu:gloo' "
            "or leave `process_group_backend` unset."
        )
    return requested


def collective_device(backend: str) -> torch.device:
    """Where the tensors of a collective the strategy issues itself (a broadcast of checkpoint tensors, a barrier)
    should live for process-group ``backend``: on the current CUDA device whenever nccl serves the group - alone
    (``"nccl"``) or beside gloo (``"cuda:nccl,cpu:gloo"``, CPU offload) - so that the data goes over nccl, not gloo;
    in CPU memory otherwise.

    Example:
        >>> collective_device("cuda:nccl,cpu:gloo").type, collective_device("gloo").type
        ('cuda', 'cpu')
    """
    if any(part.split(":")[-1].strip() == "nccl" for part in backend.split(",")):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return _CPU


def _serves_cpu_tensors(backend: str) -> bool:
    if ":" not in backend:
        return backend in ("gloo", "mpi")
    return any(part.split(":")[0].strip() == "cpu" for part in backend.split(","))


def materialization_devices(device: torch.device, *, cpu_offload: bool) -> tuple[torch.device, torch.device]:
    """``(parameters, buffers)``: where a meta-device model's tensors are allocated after sharding.

    With CPU offload the parameter shards live in CPU memory (FSDP2 copies them to the device for each all-gather),
    but buffers - RoPE tables, BatchNorm statistics - are used by forward as they are, so they must be on the device
    that computes, as ``fully_shard`` itself places the buffers of a model built eagerly.

    Example:
        >>> materialization_devices(torch.device("cuda", 0), cpu_offload=True)
        (device(type='cpu'), device(type='cuda', index=0))
    """
    return (_CPU if cpu_offload else device), device


def place_unmanaged_state(model: nn.Module, device: torch.device) -> None:
    """Move what ``fully_shard`` leaves behind to ``device``: torchmetrics states (Lightning's own helper for its
    FSDP strategy) and the ``device`` property of every Lightning module inside ``model``.

    Not ``model.to(device)`` (Lightning's ModelParallelStrategy): under CPU offload that would copy every parameter
    shard to the device. The parameters and buffers are where ``fully_shard`` / materialisation put them already.

    Example:
        >>> import lightning as L
        >>> module = L.LightningModule()
        >>> place_unmanaged_state(module, torch.device("meta"))
        >>> module.device
        device(type='meta')
    """
    _move_torchmetrics_to_device(model, device)
    _update_properties(model, device=device)
