"""FSDP2 collectives for CPU ranks that share one host: the data moves through shared memory, gloo only synchronises.

Gloo sends every byte through the loopback TCP stack, several kernel copies per byte, while two processes on one host
can read each other's memory directly. Here each collective writes what the other ranks need into a shared segment,
waits at one gloo barrier, and reads what it needs. FULL_SHARD moves 1.5x DDP's bytes per step in about 20
synchronous collectives, so on a CPU host this is where its time goes (``benchmarks/gloo_collectives.py``,
``benchmarks/NOTES.md``). The bytes written are those of ``all_gather_single`` / ``reduce_scatter_single``
(``tests/test_shm_comms.py``).

Why one barrier per collective is enough: a group's collectives take its two segments in turn, and every rank reads
a segment before it enters the next collective's barrier. A rank writes to a segment again only two collectives later,
after that barrier, so nobody still reads it.

Groups whose ranks are on more than one host, or whose segment cannot be reserved (a small ``/dev/shm``, as in a
default Docker container), use the gloo collectives of ``gloo_comms`` instead; every rank of the group decides
together, so they never disagree on the transport.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.gloo_comms import GlooAllGather, GlooReduceScatter, install_collectives

SHM_DIR = Path("/dev/shm")
_ALIGN = 1 << 20  # segment sizes grow in whole MiB, so a few slightly larger units do not each remap it


def _host_identity() -> str:
    """Hostname and boot id: two containers may share a hostname but not a boot, and the reverse."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


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
    """One process group's two shared segments, taken in turn; ``None`` once the group fell back to gloo."""

    token: str
    segments: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    generation: int = 0
    calls: int = 0


class SharedMemoryTransport:
    """The shared segments of every process group that the collectives below have been called with.

    Example:
        >>> transport = SharedMemoryTransport()
        >>> all_gather, reduce_scatter = SharedMemoryAllGather(transport), SharedMemoryReduceScatter(transport)
    """

    def __init__(self) -> None:
        self._groups: dict[str, _GroupSegments | None] = {}

    def segment(self, group: dist.ProcessGroup, nbytes: int) -> torch.Tensor | None:
        """The group's segment for its next collective, at least ``nbytes`` long; ``None`` means use gloo.

        Collective: every rank of ``group`` calls it for the same collective, with the same ``nbytes``.
        """
        name = group.group_name
        if name not in self._groups:
            self._groups[name] = self._join(group)
        state = self._groups[name]
        if state is None:
            return None
        index = state.calls % 2
        state.calls += 1
        current = state.segments[index]
        if current is None or current.numel() < nbytes:
            current = self._grow(group, state, index, nbytes)
            if current is None:
                self._groups[name] = None
                return None
        return current

    @staticmethod
    def _join(group: dist.ProcessGroup) -> _GroupSegments | None:
        """Agree on the group's segment name, or on gloo when its ranks are not all on this host."""
        if not SHM_DIR.is_dir():
            identity: tuple[str, str] | None = None
        else:
            identity = (_host_identity(), uuid.uuid4().hex)
        identities: list[tuple[str, str] | None] = [None] * group.size()
        dist.all_gather_object(identities, identity, group=group)
        if any(i is None for i in identities) or len({i[0] for i in identities}) > 1:
            return None
        return _GroupSegments(token=identities[0][1])

    @staticmethod
    def _grow(group: dist.ProcessGroup, state: _GroupSegments, index: int, nbytes: int) -> torch.Tensor | None:
        size = -(-nbytes // _ALIGN) * _ALIGN
        state.generation += 1
        path = SHM_DIR / f"lightning-shard-{state.token}-{state.generation}"
        segment = _reserve_segment(path, size)
        reserved = torch.tensor([segment is not None], dtype=torch.int32)
        dist.all_reduce(reserved, op=dist.ReduceOp.MIN, group=group)  # also: every rank has mapped the file
        path.unlink(missing_ok=True)  # the mappings outlive the name, and nothing is left behind on a crash
        if not reserved.item():
            warnings.warn(
                f"lightning_shard: could not reserve {size} bytes of shared memory in {SHM_DIR} for FSDP's "
                "collectives; this process group uses gloo's instead (slower). Give the container more shared "
                "memory (e.g. `docker run --shm-size=2g`) to get the faster path.",
                stacklevel=3,
            )
            return None
        state.segments[index] = segment
        return segment


class SharedMemoryAllGather(GlooAllGather):
    """All-gather: each rank writes its shard into its slot of the shared segment and reads the others'."""

    def __init__(self, transport: SharedMemoryTransport, capacity: int = 4) -> None:
        super().__init__(capacity)
        self.transport = transport

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        nbytes = output_tensor.numel() * output_tensor.element_size()
        segment = self.transport.segment(group, nbytes)
        if segment is None:
            return super().__call__(output_tensor, input_tensor, group, async_op)
        world, rank = group.size(), group.rank()
        slots = segment[:nbytes].view(output_tensor.dtype).view(world, -1)
        chunks = output_tensor.view(world, -1)
        slots[rank].copy_(input_tensor)
        dist.barrier(group=group)
        for source in range(world):
            if source != rank:
                chunks[source].copy_(slots[source])
        if input_tensor.data_ptr() != chunks[rank].data_ptr():  # FSDP2 passes a view of the output: nothing to do
            chunks[rank].copy_(input_tensor)
        return None  # done: FSDP2 waits only on a returned work


class SharedMemoryReduceScatter(GlooReduceScatter):
    """Reduce-scatter: each rank writes every other rank's chunk of its input into the shared segment, then sums the
    contributions to its own chunk. SUM and AVG only (what FSDP2 asks of a CPU group); other ops go to gloo."""

    def __init__(self, transport: SharedMemoryTransport, capacity: int = 4) -> None:
        super().__init__(capacity)
        self.transport = transport

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        chunk_bytes = output_tensor.numel() * output_tensor.element_size()
        # Slot [source, j] holds source's chunk for the j-th other rank: (world - 1) chunks per source.
        nbytes = world * (world - 1) * chunk_bytes
        segment = None if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) else self.transport.segment(group, nbytes)
        if segment is None or async_op:
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        slots = segment[:nbytes].view(output_tensor.dtype).view(world, world - 1, -1)
        chunks = input_tensor.view(world, -1)
        for dest in range(world):
            if dest != rank:
                slots[rank, dest - (dest > rank)].copy_(chunks[dest])
        dist.barrier(group=group)
        # Sum in rank order, as gloo does, so that the bytes match.
        first = True
        for source in range(world):
            part = chunks[rank] if source == rank else slots[source, rank - (rank > source)]
            if first:
                output_tensor.copy_(part)
                first = False
            else:
                output_tensor.add_(part)
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
