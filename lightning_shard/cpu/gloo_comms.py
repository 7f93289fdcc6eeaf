"""FSDP2 collectives for CPU (gloo) meshes, installed through FSDP2's own comm hooks.

FSDP2 calls ``all_gather_single`` and ``reduce_scatter_single`` (torch 2.11: ``all_gather_into_tensor`` and
``reduce_scatter_tensor``). On gloo the reduce-scatter is slower than an all-reduce of the same input followed by a copy
of this rank's chunk (gloo's reduce-scatter is not a ring), and the all-gather is no faster than gloo's list all-gather
into views of the same output; both replacements write the same bytes. FSDP2 also allocates fresh comm buffers for every
unit on every step, which on CPU means new pages and a fragmented heap; the buffers here are reused. Measured alone
(``benchmarks/NOTES.md``; 2 ranks, one GPT block of 3.15M fp32 parameters: reduce-scatter 1.3x faster, a copy into a
reused buffer 1.5x faster than into a fresh one; for the whole 19M-parameter model 2.0x and 3.2x).
``tests/test_gloo_comms.py`` checks the bytes.

Ranks on one host use ``shm_comms``, which builds on these classes (their buffer pool, and them as the fall-back
for groups that span hosts or cannot get shared memory). NCCL meshes keep FSDP2's defaults: there both collectives
are native.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_shard.torch_compat.fsdp import fsdp_comm_base_classes
from lightning_shard.torch_compat.tensors import storage_use_count

AllGather, ReduceScatter = fsdp_comm_base_classes()


def _idle(entry: tuple[torch.Tensor, int]) -> bool:
    """Whether nothing but the pool refers to the buffer's storage."""
    buffer, idle_users = entry
    return storage_use_count(buffer) == idle_users


class ReusedBuffers:
    """FSDP2's per-call comm buffers, handed out again once nothing but this pool refers to their storage.

    FSDP2 allocates a fresh all-gather output and reduce-scatter input for every unit on every step. On CPU a fresh
    buffer is often new pages from the OS (glibc mmaps large blocks), which are slow to touch; the freed blocks also
    leave the process heap fragmented, so peak RSS creeps up from step to step. The ``Comm`` interface
    allows a comm to reuse persistent buffers. A buffer is free when no tensor but the pool's own refers to its
    storage (FSDP2's views, the gloo work and a gradient made from a reduce-scatter output all count), so reuse
    never aliases live data. At most ``capacity`` buffers are kept; when full, the least recently used free one
    makes room, and if none is free the request gets a plain, unpooled tensor.

    Example:
        >>> pool = ReusedBuffers(capacity=2)
        >>> a = pool.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
        >>> b = pool.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))  # ``a`` is alive: a new one
        >>> del a
        >>> c = pool.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))  # reuses ``a``'s storage
    """

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, storage users when nothing else holds it)

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        for i, entry in enumerate(self._buffers):
            buffer = entry[0]
            if buffer.dtype == dtype and buffer.numel() == numel and _idle(entry):
                self._buffers.append(self._buffers.pop(i))  # most recently used last
                return buffer.view(*size)
        if len(self._buffers) >= self.capacity:
            free = [i for i, entry in enumerate(self._buffers) if _idle(entry)]
            if not free:
                return torch.empty(*size, dtype=dtype, device=device)
            del self._buffers[free[0]]
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self._buffers.append((buffer, storage_use_count(buffer)))
        return buffer.view(*size)


class GlooAllGather(ReusedBuffers, AllGather):
    """All-gather into ``output_tensor`` with gloo's list all-gather over views of its equal chunks."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        chunks = list(output_tensor.chunk(group.size()))
        return dist.all_gather(chunks, input_tensor, group=group, async_op=async_op)


class GlooReduceScatter(ReusedBuffers, ReduceScatter):
    """Reduce-scatter as an in-place all-reduce of ``input_tensor`` followed by a copy of this rank's chunk.

    FSDP2 hands over a scratch input that it only keeps alive afterwards, so reducing it in place is safe. Only the
    inputs are pooled: FSDP2 asks for each output right after its input, and the output becomes the sharded
    gradient, which lives until ``zero_grad``; pooled, the gradients would fill the pool and push the inputs out.
    """

    def __init__(self, capacity: int = 4) -> None:
        super().__init__(capacity)
        self._last_input_numel: int | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel, last = math.prod(int(s) for s in size), self._last_input_numel
        if last is not None and numel < last and last % numel == 0:  # the output of the input just handed out
            self._last_input_numel = None
            return torch.empty(*size, dtype=dtype, device=device)
        self._last_input_numel = numel
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if async_op:
            # FSDP2 reduces synchronously; an asynchronous caller would need the copy chained behind the work.
            raise NotImplementedError("GlooReduceScatter runs synchronously only (FSDP2 calls it with async_op=False)")
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


def install_collectives(model: nn.Module, all_gather: AllGather, reduce_scatter: ReduceScatter) -> int:
    """Give every FSDP module in ``model`` the same two collectives; return how many modules got them.

    Example:
        >>> fully_shard(block, mesh=cpu_mesh); fully_shard(model, mesh=cpu_mesh)  # doctest: +SKIP
        >>> install_collectives(model, GlooAllGather(), GlooReduceScatter())  # doctest: +SKIP
        2
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return len(modules)
