"""``lightning_shard.cpu.shm_barrier``: the futex barrier between two real processes - it orders their writes and reads,
and a rank that died or never comes ends the wait with an error that names it."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_shard.cpu.shm_barrier import FutexBarrier, barrier_supported, page_bytes

pytestmark = pytest.mark.skipif(not barrier_supported(), reason="the futex barrier is for x86-64 Linux")

ROUNDS = 300
SLOTS = 64  # bytes of data per rank, after the barrier's words


def map_file(path: Path) -> torch.Tensor:
    with open(path, "r+b") as f:
        return torch.frombuffer(mmap.mmap(f.fileno(), 0), dtype=torch.uint8)


def shared_file(tmp_path: Path) -> Path:
    path = tmp_path / "page"
    path.write_bytes(bytes(page_bytes(2) + 2 * SLOTS))
    return path


def exchange(path: Path, rank: int, pids: list[int], rounds: int, timeout: float = 60.0) -> list[int]:
    """Each round: write the round number into this rank's slot, wait, read the other's slot, wait again (so that
    neither overwrites a slot the other has yet to read). Rank 1 sleeps at random, so that rank 0 is often first.
    Returns what was read from the other rank."""
    page = map_file(path)
    barrier = FutexBarrier(page[: page_bytes(2)], rank, pids, timeout)
    slots = page[page_bytes(2) :].view(torch.int64).view(2, -1)
    seen, jitter = [], random.Random(rank)
    for i in range(rounds):
        slots[rank, 0] = i
        if rank == 1 and jitter.random() < 0.2:
            time.sleep(0.002)
        barrier()
        seen.append(int(slots[1 - rank, 0]))
        barrier()
    return seen


def peer(path: str, parent: int, rounds: int, exit_after: int | None) -> None:
    """Rank 1 in a spawned process: ``rounds`` exchanges, or ``exit_after`` barriers and then it dies."""
    pids = [parent, os.getpid()]
    if exit_after is None:
        sys.exit(0 if exchange(Path(path), 1, pids, rounds) == list(range(rounds)) else 3)
    page = map_file(Path(path))
    barrier = FutexBarrier(page[: page_bytes(2)], 1, pids, 60.0)
    for _ in range(exit_after):
        barrier()
    os._exit(0)  # without any goodbye: a crash


def start_peer(path: Path, rounds: int = 0, exit_after: int | None = None) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(
        target=peer, args=(str(path), os.getpid(), rounds, exit_after)
    )
    process.start()
    return process


def test_every_read_sees_the_other_ranks_write_of_the_same_round(tmp_path: Path) -> None:
    path = shared_file(tmp_path)
    process = start_peer(path, rounds=ROUNDS)
    seen = exchange(path, 0, [os.getpid(), process.pid], ROUNDS)
    process.join(timeout=60)
    assert seen == list(range(ROUNDS))
    assert process.exitcode == 0  # and the peer saw rank 0's writes in order as well


def test_a_rank_that_died_ends_the_wait_with_an_error_naming_it(tmp_path: Path) -> None:
    path = shared_file(tmp_path)
    process = start_peer(path, exit_after=3)
    barrier = FutexBarrier(map_file(path)[: page_bytes(2)], 0, [os.getpid(), process.pid], 60.0)
    for _ in range(3):
        barrier()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of this process group exited while rank 0 waited"):
        barrier()  # the peer died without arriving (and stays a zombie until joined)
    assert time.monotonic() - start < 5.0
    process.join()


def test_a_rank_that_never_comes_ends_the_wait_after_the_groups_timeout(tmp_path: Path) -> None:
    # "rank 1" is this process's parent: alive, and it never arrives
    barrier = FutexBarrier(map_file(shared_file(tmp_path))[: page_bytes(2)], 0, [os.getpid(), os.getppid()], 0.6)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 waited 0.6 s \(the process group's timeout\) for rank 1"):
        barrier()
    assert 0.6 <= time.monotonic() - start < 5.0


def test_a_page_too_small_for_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="a barrier of 4 ranks needs 256 bytes"):
        FutexBarrier(torch.zeros(100, dtype=torch.uint8), 0, [os.getpid()] * 4, 1.0)
