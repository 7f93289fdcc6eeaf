"""FSDP2 collectives for CPU ranks that share one host: the data moves through shared memory.

Gloo sends every byte through the loopback TCP stack, several kernel copies per byte, while two processes on one host
can read each other's memory directly. Here each collective writes what the other ranks need into a shared segment,
waits at one barrier, and reads what it needs. The barrier is ``shm_barrier.FutexBarrier`` (futex words in a third
shared file) on x86-64 Linux, where every rank sees the others' pids; elsewhere gloo's.

FULL_SHARD moves 1.5x DDP's bytes per step in about 20 synchronous collectives, so on a CPU host this is where its
time goes (``benchmarks/NOTES.md``). On 2 ranks the bytes written are those of
``all_gather_single`` / ``reduce_scatter_single``; on more, the reduce-scatter sums in another order than gloo, one
rounding apart (``tests/test_shm_comms.py``).

Why one barrier per collective is enough: a group's collectives take its two segments in turn, and every rank reads
a segment before it enters the next collective's barrier. A rank writes to a segment again only two collectives later,
after that barrier, so nobody still reads it.

Groups whose ranks are on more than one host (boot id), whose segments cannot be reserved (a full ``/dev/shm``),
or whose ranks map the same file name but not the same memory (containers on one host without a shared
``/dev/shm``: each rank marks the segments, and every rank must see every mark) use the gloo collectives of
``gloo_comms`` instead; every rank of the group decides together, so they never disagree on the transport.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.cpu.gloo_comms import GlooAllGather, GlooReduceScatter, install_collectives
from lightning_shard.cpu.shm_barrier import FutexBarrier, barrier_supported, page_bytes, pid_namespace
from lightning_shard.torch_compat.distributed import group_timeout

SHM_DIR = Path("/dev/shm")
# Per segment, two per process group. A collective larger than a segment runs in pieces, one barrier each: at 16 MiB
# a barrier (0.1-0.3 ms) costs a few percent of the copies, and two segments fit in Docker's default 64 MiB /dev/shm.
SEGMENT_BYTES = 16 << 20


def _host_identity() -> str:
    """The kernel's boot id (the hostname where it cannot be read): containers on one kernel have different
    hostnames but the same boot id, and whether they share ``/dev/shm`` is checked afterwards."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _barrier_namespace() -> str | None:
    """What ranks must share to use the futex barrier: its support here, and the pid namespace (peers' pids)."""
    return pid_namespace() if barrier_supported() else None


def _futex_barrier(page: torch.Tensor, rank: int, identities: list, group: dist.ProcessGroup) -> FutexBarrier | None:
    """The group's futex barrier, or ``None`` where a rank cannot take part (then gloo's barrier is used)."""
    namespaces = {i[3] for i in identities}
    if None in namespaces or len(namespaces) > 1:
        return None
    try:
        return FutexBarrier(page, rank, [i[2] for i in identities], _group_timeout(group))
    except OSError:  # pidfd_open refused
        return None


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The group's collective timeout in seconds (torch has no public getter; its default where this fails)."""
    timeout = group_timeout(group) or dist.default_pg_timeout
    return timeout.total_seconds()


def _reserve_segment(path: Path, nbytes: int) -> torch.Tensor | None:
    """Map ``nbytes`` of ``path`` (created if absent) as a uint8 tensor; ``None`` if the space cannot be reserved.

    ``posix_fallocate`` reserves the pages up front: a tmpfs file grown with ``ftruncate`` alone would accept the
    size and then kill the process with SIGBUS on the first page that does not fit.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        buffer = mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)  # the mapping keeps the file alive
    return torch.frombuffer(buffer, dtype=torch.uint8)


@dataclass
class _GroupSegments:
    """One process group's two shared segments, taken in turn by its collectives, and the group's barrier."""

    segments: tuple[torch.Tensor, torch.Tensor]
    barrier: Callable[[], object]
    calls: int = 0

    def synchronize(self) -> None:
        """Wait until every rank of the group has written its part of the current collective."""
        self.barrier()

    def next(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The start of the segment for the group's next collective, as a tensor of ``shape`` and ``dtype``."""
        self.calls += 1
        nbytes = math.prod(shape) * dtype.itemsize
        return self.segments[self.calls % 2][:nbytes].view(dtype).view(shape)


class SharedMemoryTransport:
    """The shared segments of every process group that the collectives below have been called with.

    Example:
        >>> transport = SharedMemoryTransport()
        >>> all_gather, reduce_scatter = SharedMemoryAllGather(transport), SharedMemoryReduceScatter(transport)
    """

    def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.segment_bytes = segment_bytes
        self._groups: dict[str, _GroupSegments | None] = {}

    def segments(self, group: dist.ProcessGroup) -> _GroupSegments | None:
        """The group's segments; ``None`` means use gloo. Collective on first use: every rank of ``group`` calls
        it for the same collective."""
        name = group.group_name
        if name not in self._groups:
            self._groups[name] = self._join(group)
        return self._groups[name]

    def _join(self, group: dist.ProcessGroup) -> _GroupSegments | None:
        """Map the group's two segments on every rank, or agree on gloo: ranks on several hosts, no space, or
        segments that are not actually shared (two containers with one hostname but separate ``/dev/shm``)."""
        identity = (_host_identity(), uuid.uuid4().hex, os.getpid(), _barrier_namespace()) if SHM_DIR.is_dir() else None
        identities: list[tuple[str, str, int, str | None] | None] = [None] * group.size()
        dist.all_gather_object(identities, identity, group=group)
        if any(i is None for i in identities) or len({i[0] for i in identities}) > 1:
            return None
        world, rank = group.size(), group.rank()
        paths = [SHM_DIR / f"lightning-shard-{identities[0][1]}-{part}" for part in ("0", "1", "barrier")]
        segments = [_reserve_segment(path, self.segment_bytes) for path in paths[:2]]
        page = _reserve_segment(paths[2], page_bytes(world))
        reserved = all(s is not None for s in [*segments, page])
        if reserved:
            for segment in segments:
                segment[rank] = 1  # the files start zeroed: every rank must see every other rank's mark
        # The futex barrier needs every rank to support it and to see the others' pids.
        futex = _futex_barrier(page, rank, identities, group) if reserved else None
        agreed = torch.tensor([reserved, futex is not None], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # also: every rank has mapped and marked both
        for path in paths:
            path.unlink(missing_ok=True)  # the mappings outlive the names, and nothing is left behind on a crash
        if not agreed[0].item():
            return self._fall_back(f"could not reserve 2 x {self.segment_bytes} bytes of shared memory in {SHM_DIR}")
        if futex is not None and not agreed[1].item():
            futex.close()
            futex = None
        agreed[0] = all(bool((segment[:world] == 1).all()) for segment in segments)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if not agreed[0].item():
            return self._fall_back(f"the ranks' files in {SHM_DIR} are not the same memory (separate containers?)")
        return _GroupSegments((segments[0], segments[1]), futex or partial(dist.barrier, group=group))

    @staticmethod
    def _fall_back(reason: str) -> None:
        warnings.warn(
            f"lightning_shard: {reason}, so this process group uses gloo's collectives for FSDP (slower). Give the "
            "ranks one shared /dev/shm with room for it (e.g. `docker run --ipc=host` or `--shm-size=1g`) to get the "
            "faster path.",
            stacklevel=5,
        )


def _pieces(numel: int, per_piece: int) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of ``range(numel)``, at most ``per_piece`` long (at least 1)."""
    step = max(1, per_piece)
    return [(start, min(step, numel - start)) for start in range(0, numel, step)]


class _OverSharedMemory:
    """What both collectives share: the transport, and the gloo collective they extend as the fall-back."""

    def __init__(self, transport: SharedMemoryTransport, capacity: int = 4) -> None:
        super().__init__(capacity)
        self.transport = transport

    def piece_numel(self, slots_per_rank: int, dtype: torch.dtype, world: int) -> int:
        """Elements per slot so that ``world`` x ``slots_per_rank`` slots fill one segment."""
        return self.transport.segment_bytes // (world * slots_per_rank * dtype.itemsize)


class SharedMemoryAllGather(_OverSharedMemory, GlooAllGather):
    """All-gather: each rank writes its shard into its slot of a shared segment and reads the others' slots."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        shared = self.transport.segments(group)
        if shared is None:
            return super().__call__(output_tensor, input_tensor, group, async_op)
        world, rank = group.size(), group.rank()
        chunks = output_tensor.view(world, -1)
        for start, length in _pieces(chunks.size(1), self.piece_numel(1, output_tensor.dtype, world)):
            slots = shared.next((world, length), output_tensor.dtype)
            slots[rank].copy_(input_tensor[start : start + length])
            shared.synchronize()
            for source in range(world):
                if source != rank:
                    chunks[source, start : start + length].copy_(slots[source])
        if input_tensor.data_ptr() != chunks[rank].data_ptr():  # FSDP2 passes a view of the output: nothing to do
            chunks[rank].copy_(input_tensor)
        return None  # done: FSDP2 waits only on a returned work


class SharedMemoryReduceScatter(_OverSharedMemory, GlooReduceScatter):
    """Reduce-scatter: each rank writes every other rank's chunk of its input into a shared segment, then sums the
    contributions to its own chunk. SUM and AVG only (what FSDP2 asks of a CPU group); other ops go to gloo."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        shared = self.transport.segments(group) if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) else None
        if shared is None or async_op:
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        world, rank = group.size(), group.rank()
        chunks = input_tensor.view(world, -1)
        for start, length in _pieces(output_tensor.numel(), self.piece_numel(world - 1, output_tensor.dtype, world)):
            # Slot [source, j] holds source's piece for the j-th other rank: (world - 1) pieces per source.
            slots = shared.next((world, world - 1, length), output_tensor.dtype)
            for dest in range(world):
                if dest != rank:
                    slots[rank, dest - (dest > rank)].copy_(chunks[dest, start : start + length])
            shared.synchronize()
            # Sum in rank order, as gloo does for 2 ranks, so that the bytes match.
            out = output_tensor[start : start + length]
            for source in range(world):
                part = chunks[rank, start : start + length] if source == rank else slots[source, rank - (rank > source)]
                if source == 0:
                    out.copy_(part)
                else:
                    out.add_(part)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def install_shared_memory_collectives(model: nn.Module) -> int:
    """Give every FSDP module in ``model`` the shared-memory collectives (one transport for all of them); return how
    many modules got them.

    Example:
        >>> fully_shard(block, mesh=cpu_mesh); fully_shard(model, mesh=cpu_mesh)  # doctest: +SKIP
        >>> install_shared_memory_collectives(model)  # doctest: +SKIP
        2
    """
    transport = SharedMemoryTransport()
    return install_collectives(model, SharedMemoryAllGather(transport), SharedMemoryReduceScatter(transport))
