"""The counted draws (``lightning_shard.init.draw_counts``): a counted op leaves the generator where drawing the counted
number of outputs leaves it, for the dtypes, sizes and layouts models use; what is not counted says so; jumping over
counted draws (``JumpedDraws``) leaves the generator where drawing them does."""

from __future__ import annotations

import pytest
import torch

from lightning_shard.init.draw_counts import JumpedDraws, outputs_drawn

NORMAL, UNIFORM = torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _after(fill, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    fill(generator)
    return generator.get_state()


def _raw(count: int, seed: int = 7) -> torch.Tensor:
    return _after(lambda g: torch.empty(count, dtype=torch.int32).random_(generator=g), seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [16, 17, 100, 4096, 65_537, 1_000_003])
def test_a_counted_fill_takes_what_it_is_counted_to_take(dtype: torch.dtype, numel: int) -> None:
    for func, fill in ((NORMAL, torch.Tensor.normal_), (UNIFORM, torch.Tensor.uniform_)):
        counted = outputs_drawn(func, dtype, numel, contiguous=True)
        assert counted is not None
        tensor = torch.empty(numel, dtype=dtype)
        assert torch.equal(_after(lambda g, t=tensor, f=fill: f(t, generator=g)), _raw(counted)), (func, dtype, numel)


def test_uniform_on_a_strided_view_is_counted_and_what_is_unknown_says_so() -> None:
    view = torch.empty(300, 4)[:, 1]
    counted = outputs_drawn(UNIFORM, torch.float32, 300, contiguous=False)
    assert torch.equal(_after(lambda g: view.uniform_(generator=g)), _raw(counted))
    # normal_ on a strided or small tensor keeps a cached sample in the generator: not counted
    assert outputs_drawn(NORMAL, torch.float32, 300, contiguous=False) is None
    assert outputs_drawn(NORMAL, torch.float32, 15, contiguous=True) is None
    assert outputs_drawn(torch.ops.aten.randperm.default, torch.int64, 300, contiguous=True) is None
    assert outputs_drawn(torch.ops.aten.bernoulli_.float, torch.float32, 300, contiguous=True) is None


def test_jumping_over_counted_draws_leaves_the_generator_where_drawing_them_does() -> None:
    sizes = [(NORMAL, 4096 * 3 + 5), (UNIFORM, 77), (NORMAL, 2_000_000)]
    drawn = torch.Generator().manual_seed(3)
    for func, numel in sizes:
        (torch.empty(numel).normal_ if func is NORMAL else torch.empty(numel).uniform_)(generator=drawn)
    jumped = JumpedDraws(torch.Generator().manual_seed(3))
    for func, numel in sizes:
        jumped.add(outputs_drawn(func, torch.float32, numel, contiguous=True))
    jumped.settle()
    assert torch.equal(jumped.generator.get_state(), drawn.get_state())
    assert jumped.pending == 0 and jumped.total == 4096 * 3 + 5 + 16 + 77 + 2_000_000
