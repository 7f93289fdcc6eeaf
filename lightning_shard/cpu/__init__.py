"""Opt-in machinery for CPU meshes, off the default path: ``ShardedStrategy(cpu_collectives="shared_memory")``.

By default CPU ranks train with FSDP2's own collectives on gloo, the same code path GPU users run on nccl. With
``"shared_memory"`` the ranks of one host move their all-gather and reduce-scatter data through ``/dev/shm``
(:mod:`~lightning_shard.cpu.shm_comms`, synchronised by :mod:`~lightning_shard.cpu.shm_barrier`), reuse their comm
buffers, fall back to gloo collectives with reused buffers across hosts (:mod:`~lightning_shard.cpu.gloo_comms`),
and give the freed heap back to the OS every few steps (:mod:`~lightning_shard.cpu.heap`). Measured gain:
``BENCHMARKS.md``.
"""

from lightning_shard.cpu.heap import HeapTrimmer, release_freed_heap
from lightning_shard.cpu.shm_comms import install_shared_memory_collectives

__all__ = ["HeapTrimmer", "install_shared_memory_collectives", "release_freed_heap"]
