"""``lightning_shard.cpu.gloo_comms``: the buffer pool's reuse rules, and the gloo collectives against FSDP2's defaults
(``tests/cpu_comms_run.py`` on 2 ranks: the same bytes, and the same training to the last bit)."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_shard.cpu.gloo_comms import GlooReduceScatter, ReusedBuffers

CPU = torch.device("cpu")


def take(pool: ReusedBuffers, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return pool.allocate((numel,), dtype=dtype, device=CPU)


def test_a_released_buffer_is_handed_out_again() -> None:
    pool = ReusedBuffers(capacity=2)
    first = take(pool, 8)
    address = first.data_ptr()
    del first
    again = pool.allocate((2, 4), dtype=torch.float32, device=CPU)
    assert again.data_ptr() == address
    assert again.shape == (2, 4)


def test_a_buffer_is_not_reused_while_a_view_of_it_lives() -> None:
    pool = ReusedBuffers(capacity=4)
    first = take(pool, 8)
    view = first[2:]  # FSDP2 keeps views (the all-gather input, a gradient made from the reduce-scatter output)
    address = first.data_ptr()
    del first
    second = take(pool, 8)
    assert second.data_ptr() != address
    assert view.data_ptr() == address + 2 * 4


def test_size_and_dtype_must_match() -> None:
    pool = ReusedBuffers(capacity=4)
    address = take(pool, 8).data_ptr()
    assert take(pool, 4).data_ptr() != address
    assert take(pool, 8, torch.bfloat16).data_ptr() != address
    assert take(pool, 8).data_ptr() == address


def pooled_sizes(pool: ReusedBuffers) -> list[int]:
    return sorted(buffer.numel() for buffer, _ in pool._buffers)


def test_a_full_pool_with_every_buffer_in_use_hands_out_a_plain_tensor() -> None:
    pool = ReusedBuffers(capacity=2)
    a, b = take(pool, 8), take(pool, 16)
    plain = take(pool, 32)
    assert pooled_sizes(pool) == [8, 16]
    del a  # now the 8-element buffer is free: the next new size replaces it
    c = take(pool, 64)
    assert pooled_sizes(pool) == [16, 64]
    assert (b.numel(), c.numel(), plain.numel()) == (16, 64, 32)


def test_a_full_pool_evicts_the_least_recently_used_free_buffer() -> None:
    pool = ReusedBuffers(capacity=2)
    take(pool, 8), take(pool, 16)  # both released at once
    take(pool, 8)  # the 8-element buffer is now the most recently used
    take(pool, 32)
    assert pooled_sizes(pool) == [8, 32]


def test_reduce_scatter_pools_its_inputs_but_not_the_outputs_that_become_gradients() -> None:
    comm = GlooReduceScatter(capacity=4)
    for _ in range(3):  # FSDP2's order per unit: the input (world x shard), then the output (one shard)
        reduce_input = take(comm, 8)
        gradient = take(comm, 4)
        del reduce_input
    assert pooled_sizes(comm) == [8]
    assert gradient.numel() == 4


def gloo_cases(result: dict) -> list[dict]:
    return [c for c in result["collectives"] if c["implementation"] == "gloo"]


def test_collectives_write_the_bytes_fsdp2s_defaults_write(cpu_comms_result) -> None:
    cases = gloo_cases(cpu_comms_result)
    assert len(cases) == 2 * 3 * 3  # dtypes x sizes x (all-gather, reduce-scatter SUM, AVG)
    assert [c for c in cases if not c["equal"]] == []


def test_training_with_gloo_collectives_equals_fsdp2_defaults(cpu_comms_result) -> None:
    training = cpu_comms_result["training"]["gloo"]
    assert training["installed"] == ["GlooAllGather", "GlooReduceScatter"]
    assert training["loss_diff"] == 0.0
    assert training["weight_diff"] == 0.0
    assert all(0 < size <= training["capacity"] for size in training["pool_sizes"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
