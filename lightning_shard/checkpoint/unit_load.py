"""Loading a full checkpoint (one ``torch.save`` file) into a sharded model, one FSDP unit at a time.

Rank 0 maps the file (``torch.load(mmap=True)``: nothing is read until used) and tells the other ranks what it holds
(names, shapes, dtypes; small values whole). Then, unit by unit, it broadcasts the unit's weights and the optimizer
states of those weights, and every rank copies its own shard into the live sharded parameters and optimizer states
(the DTensors ``get_model_state_dict`` / ``get_optimizer_state_dict`` return). After each unit rank 0 drops the pages
it read from its address space (they stay in the page cache), so it never holds more than one unit of the file on
top of its own shard. The other ranks never open the file. Finally ``set_model_state_dict`` /
``set_optimizer_state_dict`` run on the filled state dicts (load hooks, extra state, the saved param groups).

torch's own ``set_*_state_dict(broadcast_from_rank0=True)`` does the broadcast too, but per call it walks (and
copies onto itself) the whole model and optimizer: called once per unit that cost more than the load itself.
"""

from __future__ import annotations

import copy
import ctypes
import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_shard.checkpoint.optimizer_state import without_unsaved
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.devices import collective_device
from lightning_shard.torch_compat.distributed import local_chunk
from lightning_shard.torch_compat.modules import visible_name


@dataclass(frozen=True)
class _Sent:
    """A tensor rank 0 will broadcast: what the receivers allocate."""

    shape: torch.Size
    dtype: torch.dtype


def load_full_unit_by_unit(
    weights: Mapping[str, Any] | None,
    optimizer_states: Sequence[Mapping[str, Any]] | None,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    mapped_file: str | os.PathLike | None = None,
) -> None:
    """Load a full checkpoint's weights and optimizer states, held by rank 0, into the sharded ``model`` and
    ``optimizers``; call on every rank.

    Args:
        weights: the checkpoint's ``state_dict`` on rank 0 (names and shapes already checked against the model);
            ignored elsewhere.
        optimizer_states: the checkpoint's ``optimizer_states`` on rank 0 (one per optimizer), ignored elsewhere
            and when ``optimizers`` is empty.
        optimizers: the optimizers to restore (empty: weights only).
        strict: passed to ``set_model_state_dict``; model keys missing from the checkpoint keep their values.
        mapped_file: the file both were ``torch.load``-ed from with ``mmap=True``; rank 0 drops its pages from its
            memory unit by unit.

    Example:
        >>> ckpt = torch.load("model.ckpt", mmap=True, weights_only=False) if rank == 0 else {}  # doctest: +SKIP
        >>> load_full_unit_by_unit(ckpt.get("state_dict"), ckpt.get("optimizer_states"), model, [optimizer],
        ...                        strict=True, mapped_file="model.ckpt")  # doctest: +SKIP
    """
    source = rank() == 0
    model_state = get_model_state_dict(model)
    live_states = [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers]
    pages = _MappedPages(mapped_file, weights.values()) if source and mapped_file is not None else None
    described = broadcast_object(_describe(weights, optimizer_states if optimizers else []) if source else None)
    if pages is not None:
        pages.release()  # those of the scalars (AdamW's `step`s) copied into the description
    if len(described["optimizers"]) < len(optimizers):
        raise ValueError(
            f"The checkpoint holds the states of {len(described['optimizers'])} optimizer(s), the model has "
            f"{len(optimizers)}: load it into the model it was saved from."
        )
    if any(not isinstance(key, str) for saved in described["optimizers"] for key in saved["state"]):
        raise ValueError(
            "The checkpoint's optimizer states are keyed by parameter position, not name (saved by a strategy "
            "that does not name them, such as Lightning's single-device or DDP): they cannot be matched to sharded "
            "parameters. Load its weights with `LightningModule.load_from_checkpoint(...)` and train from there."
        )
    # Parameters the checkpoint holds no state for (no gradient before the save) get none.
    live_states = [
        without_unsaved(live, saved["state"]) for live, saved in zip(live_states, described["optimizers"], strict=False)
    ]
    device = _broadcast_device()

    for unit_keys in unit_key_groups(model, model_state):
        for key in unit_keys:
            if key in described["model"]:
                original = weights[key] if source else None
                model_state[key] = _receive(original, described["model"][key], model_state[key], device)
        for index, live in enumerate(live_states):
            saved = described["optimizers"][index]["state"]
            for key in (key for key in unit_keys if key in saved):
                originals = optimizer_states[index]["state"][key] if source else {}
                state = live["state"].setdefault(key, {})
                for name, spec in saved[key].items():
                    if isinstance(spec, _Sent) and not isinstance(state.get(name), torch.Tensor):
                        raise ValueError(
                            f"The checkpoint holds optimizer state {key!r}[{name!r}] that optimizer {index} does not "
                            "have: load it into the optimizer it was saved from."
                        )
                    state[name] = _receive(originals.get(name), spec, state.get(name), device)
        if pages is not None:
            pages.release()

    set_model_state_dict(model, model_state, options=StateDictOptions(strict=strict))
    for index, (optimizer, live) in enumerate(zip(optimizers, live_states, strict=True)):
        live["param_groups"] = described["optimizers"][index]["param_groups"]
        set_optimizer_state_dict(model, optimizer, live)


def unit_key_groups(model: nn.Module, keys: Iterable[str]) -> list[list[str]]:
    """State-dict keys grouped by the FSDP unit that owns them (a key goes to its innermost unit), in key order.

    Example:
        >>> unit_key_groups(nn.Linear(2, 2), ["weight", "bias"])
        [['weight', 'bias']]
    """
    prefixes = sorted(
        {visible_name(name) + "." for name, module in model.named_modules() if isinstance(module, FSDPModule) and name},
        key=len,
        reverse=True,
    )
    groups: dict[str, list[str]] = {}
    for key in keys:
        owner = next((prefix for prefix in prefixes if key.startswith(prefix)), "")
        groups.setdefault(owner, []).append(key)
    return list(groups.values())


def _describe(weights: Mapping[str, Any], optimizer_states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What every rank needs before the broadcasts: tensor shapes and dtypes, and small values whole (copied:
    nothing handed to the model or optimizer may keep the mapped file alive)."""

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return _Sent(value.shape, value.dtype)
        return copy.deepcopy(value)  # a scalar tensor (e.g. AdamW's `step`) or a plain value travels whole

    return {
        "model": {key: spec(value) for key, value in weights.items()},
        "optimizers": [
            {
                "state": {key: {name: spec(v) for name, v in state.items()} for key, state in osd["state"].items()},
                "param_groups": copy.deepcopy(osd["param_groups"]),
            }
            for osd in optimizer_states
        ],
    }


def _receive(original: torch.Tensor | None, spec: Any, target: Any, device: torch.device) -> Any:
    """Rank 0's ``original`` (the others: ``spec``) into ``target``'s local shard, in place; returns the value."""
    if not isinstance(spec, _Sent):
        if isinstance(target, torch.Tensor) and isinstance(spec, torch.Tensor):
            (target.to_local() if isinstance(target, DTensor) else target).copy_(spec)
            return target
        return spec
    if original is not None:
        buffer = original.to(device).contiguous()
    else:
        buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if _distributed_is_initialized():
        dist.broadcast(buffer, src=0)
    local, (offsets, sizes) = _local_chunk(target)
    part = buffer
    for dim, (start, length) in enumerate(zip(offsets, sizes, strict=True)):
        part = part.narrow(dim, start, length)
    local.copy_(part)
    return target


def _local_chunk(target: torch.Tensor) -> tuple[torch.Tensor, tuple[tuple[int, ...], tuple[int, ...]]]:
    """This rank's part of ``target``: its local tensor and where that sits in the global tensor."""
    if isinstance(target, DTensor):
        # The same per-rank chunk torch.distributed.checkpoint saves and loads for a DTensor.
        return target.to_local(), local_chunk(target)
    return target, ((0,) * target.dim(), tuple(target.shape))


def _broadcast_device() -> torch.device:
    """Where broadcast buffers live: on the GPU whenever nccl serves the group (also beside gloo, under offload)."""
    return collective_device(dist.get_backend()) if _distributed_is_initialized() else torch.device("cpu")


class _MappedPages:
    """Drops the resident pages of the mapping ``torch.load(path, mmap=True)`` made from this process's memory.

    ``madvise(MADV_DONTNEED)`` on a file mapping nothing writes to discards only this process's page-table entries:
    the data stays in the page cache, and a tensor read again maps it back. The whole mapping is advised each time,
    so pages the kernel mapped around a fault (ahead of the tensors read) go too. Only the mapping of ``path`` that
    holds ``tensors`` (from ``/proc/self/maps``) is advised: never anonymous memory, nor another mapping of the
    same file. Linux only; elsewhere a no-op.
    """

    def __init__(self, path: str | os.PathLike, tensors: Iterable[Any]) -> None:
        anchor = next((t.data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()), None)
        self.ranges = [(low, high) for low, high in _file_mappings(Path(path)) if anchor and low <= anchor < high]
        self.madvise = _libc_madvise() if self.ranges else None

    def release(self) -> None:
        if self.madvise is None:
            return
        for low, high in self.ranges:
            self.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), mmap.MADV_DONTNEED)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (matched by device and inode)."""
    try:
        stat = path.stat()
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or int(fields[4]) != stat.st_ino:
            continue
        major, minor = (int(part, 16) for part in fields[3].split(":"))
        if os.makedev(major, minor) != stat.st_dev:
            continue
        low, high = (int(part, 16) for part in fields[0].split("-"))
        ranges.append((low, high))
    return ranges


def _libc_madvise() -> Any:
    if not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
