"""``lightning_shard.cpu.heap``: trimming gives freed heap pages back (RSS falls); the strategy trims after every few
optimizer steps only with the opt-in ``cpu_collectives="shared_memory"`` and on a CPU device, never on the default
path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lightning.pytorch.strategies import ParallelStrategy

from lightning_shard import ShardedStrategy
from lightning_shard.cpu import heap as cpu_heap

# A fresh interpreter, so that the test sees only its own heap: ~128 MiB of 64 KiB blocks (below glibc's mmap
# threshold, so they live on the heap), every 50th kept alive so the heap cannot shrink from its top by itself.
FRAGMENT_AND_TRIM = """
import os
from lightning_shard.cpu.heap import release_freed_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [bytearray(b"\\x01") * 65536 for _ in range(2000)]
kept = blocks[::50]
del blocks
before = rss()
trimmed = release_freed_heap()
print(trimmed, before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trimming_returns_freed_heap_pages_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", FRAGMENT_AND_TRIM], capture_output=True, text=True, check=True)
    trimmed, released = out.stdout.split()
    if trimmed == "False":
        pytest.skip("this C library has no malloc_trim")
    assert int(released) > 64 * 2**20  # most of the ~125 MiB freed


def test_the_trimmer_trims_on_every_nth_step(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu_heap, "release_freed_heap", lambda: calls.append(1) or True)
    trimmer = cpu_heap.HeapTrimmer(every=3)
    assert [trimmer.step() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert len(calls) == 2
    with pytest.raises(ValueError, match="every=0"):
        cpu_heap.HeapTrimmer(every=0)


def test_the_default_path_never_trims_the_heap() -> None:
    assert ShardedStrategy()._heap_trimmer is None


@pytest.mark.parametrize(("device", "counted"), [("cpu", 3), ("cuda", 0)])
def test_the_shared_memory_transport_trims_on_cpu_only(monkeypatch, device: str, counted: int) -> None:
    monkeypatch.setattr(ParallelStrategy, "optimizer_step", lambda self, *args, **kwargs: "stepped")
    strategy = ShardedStrategy(parallel_devices=[torch.device(device, 0)], cpu_collectives="shared_memory")
    strategy.model = torch.nn.Linear(1, 1)  # what the step is taken for (its gathered copies are dropped after it)
    steps = []
    monkeypatch.setattr(strategy._heap_trimmer, "step", lambda: steps.append(1) or False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for _ in range(3):
        assert strategy.optimizer_step(optimizer, closure=lambda: None) == "stepped"
    assert len(steps) == counted
