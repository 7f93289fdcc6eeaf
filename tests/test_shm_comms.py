"""``lightning_shard.cpu.shm_comms``: the shared-memory collectives against FSDP2's defaults
(``tests/cpu_comms_run.py``: the same bytes on 2 ranks, one rounding of the sum order apart on 3, the same training
to the last bit), the fall-back to gloo, and the segment reservation."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import run_torchrun_result

from lightning_shard.cpu import shm_comms
from lightning_shard.cpu.shm_barrier import barrier_supported


def shm_cases(result: dict) -> list[dict]:
    """Whole segments and 64 KiB segments (collectives in pieces), and whole segments with gloo's barrier."""
    return [c for c in result["collectives"] if c["implementation"].startswith("shm")]


def test_two_ranks_write_the_bytes_fsdp2s_defaults_write(cpu_comms_result) -> None:
    cases = shm_cases(cpu_comms_result)
    # (segment sizes + gloo's barrier) x dtypes x sizes x (all-gather, reduce-scatter SUM, AVG), one rank slowed down
    assert len(cases) == 3 * 2 * 3 * 3
    assert [c for c in cases if not c["equal"]] == []


def test_three_ranks_gather_the_same_bytes_and_reduce_within_one_rounding() -> None:
    result = run_torchrun_result(3, "tests/cpu_comms_run.py", "--collectives-only")
    cases = shm_cases(result)
    assert result["world"] == 3 and len(cases) == 54
    assert [c for c in cases if c["collective"] == "all_gather" and not c["equal"]] == []
    # gloo sums the three contributions in another order: the last place of the largest value may differ
    assert max(c["ulps"] for c in cases) <= 2.0


def test_training_with_shared_memory_equals_fsdp2_defaults(cpu_comms_result) -> None:
    training = cpu_comms_result["training"]["shm"]
    assert training["installed"] == ["SharedMemoryAllGather", "SharedMemoryReduceScatter"]
    assert training["fell_back_to_gloo"] == [False]
    assert training["barrier"] == ["futex" if barrier_supported() else "gloo"]
    assert (training["loss_diff"], training["weight_diff"]) == (0.0, 0.0)
    assert list(Path("/dev/shm").glob("lightning-shard-*")) == []  # every segment was unlinked once mapped


def test_a_group_where_one_rank_cannot_use_the_futex_barrier_agrees_on_gloos_barrier(cpu_comms_result) -> None:
    training = cpu_comms_result["training"]["shm, gloo barrier"]
    assert training["installed"] == ["SharedMemoryAllGather", "SharedMemoryReduceScatter"]
    assert (training["fell_back_to_gloo"], training["barrier"]) == ([False], ["gloo"])
    assert (training["loss_diff"], training["weight_diff"], training["warnings"]) == (0.0, 0.0, [])


@pytest.mark.parametrize(
    ("case", "warning"),
    [
        ("shm, ranks on different hosts", None),  # the expected case on several hosts: no warning
        ("shm, no segment on rank 1", "could not reserve"),
        ("shm, memory not shared", "not the same memory"),
    ],
)
def test_a_group_that_cannot_share_memory_falls_back_to_gloo_on_every_rank(cpu_comms_result, case, warning) -> None:
    training = cpu_comms_result["training"][case]
    assert training["fell_back_to_gloo"] == [True]
    assert (training["loss_diff"], training["weight_diff"]) == (0.0, 0.0)
    if warning is None:
        assert training["warnings"] == []
    else:
        assert len(training["warnings"]) == 1 and warning in training["warnings"][0]
        assert "--shm-size" in training["warnings"][0]


def test_pieces_cover_the_range_once_in_order() -> None:
    assert shm_comms._pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert shm_comms._pieces(3, 8) == [(0, 3)]


def test_a_reserved_segment_is_a_shared_writable_mapping(tmp_path) -> None:
    path = tmp_path / "segment"
    segment = shm_comms._reserve_segment(path, 4096)
    assert segment.dtype == torch.uint8 and segment.numel() == 4096
    segment[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert path.read_bytes()[:3] == b"\x01\x02\x03"  # what another process mapping the file would read


def test_a_segment_that_does_not_fit_is_refused_instead_of_faulting_later(tmp_path) -> None:
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with mock.patch.object(os, "posix_fallocate", full):
        assert shm_comms._reserve_segment(tmp_path / "segment", 1 << 30) is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
