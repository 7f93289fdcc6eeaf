"""Opt-in machinery for CPU meshes, off the default path: ``ShardedStrategy(cpu_collectives="shared_memory")``.

By default CPU ranks train with FSDP2's own collectives on gloo, the same code path GPU users run on nccl. With
``"shared_memory"`` the ranks of one host move their all-gather and reduce-scatter data through ``/dev/shm``
(:mod:`~lightning_shard.cpu.shm_comms`, synchronised by :mod:`~lightning_shard.cpu.shm_barrier`), reuse their comm
buffers, fall back to gloo collectives with reused buffers across hosts (:mod:`~lightning_shard.cpu.gloo_comms`),
and give the freed heap back to the OS every few steps (:mod:`~lightning_shard.cpu.heap`). Measured gain:
``BENCHMARKS.md``.

Nothing here is imported until asked for: the transport builds on FSDP2's comm interfaces (private torch names,
see :mod:`lightning_shard.torch_compat.fsdp`), which the default path never touches.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HeapTrimmer": "lightning_shard.cpu.heap",
    "release_freed_heap": "lightning_shard.cpu.heap",
    "install_shared_memory_collectives": "lightning_shard.cpu.shm_comms",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
