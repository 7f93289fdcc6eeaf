"""Give freed heap memory back to the OS between training steps on CPU (glibc's ``malloc_trim``).

FSDP2 frees and re-allocates each unit's unsharded parameters and gradients on every step. On CPU those come from
glibc's heap, which keeps freed blocks; the blocks fragment, and the process's peak RSS creeps up step by step
although the live memory does not grow (measured: 22 steps of FULL_SHARD reached 1.06x DDP's peak RSS). Trimming
returns the free pages, so the peak stays at what the steps really hold. It has a price: the next step faults the
pages in again (9-13% mean step time when trimming after every step of the benchmark GPT; about 2% every 5 steps;
benchmarks/NOTES.md), so the strategy trims every few steps; the creep is slow. Other C libraries have no
``malloc_trim``: then nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): no trim
        return None


def release_freed_heap() -> bool:
    """Return the heap's free pages to the OS; ``True`` if the C library could do it.

    Example:
        >>> release_freed_heap()  # doctest: +SKIP
        True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimmer:
    """Calls :func:`release_freed_heap` on every ``every``-th :meth:`step`.

    Example:
        >>> trimmer = HeapTrimmer(every=5)
        >>> [trimmer.step() for _ in range(5)][-1]  # doctest: +SKIP
        True
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"`every={every}` must be a positive number of steps.")
        self.every = every
        self._steps = 0

    def step(self) -> bool:
        """Count one optimizer step; trim on every ``every``-th. Returns whether it trimmed."""
        self._steps += 1
        return self._steps % self.every == 0 and release_freed_heap()
