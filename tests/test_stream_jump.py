"""Jumping the CPU generator ahead (lightning_shard.init.stream_jump) gives, byte for byte, the state drawing gives;
and the generator state's layout (lightning_shard.torch_compat.generator_state) is the one this torch writes."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_shard.init import stream_jump
from lightning_shard.init.stream_jump import advance, advance_generator
from lightning_shard.torch_compat.generator_state import (
    MT_WORDS,
    STATE_NBYTES,
    EngineState,
    check_layout,
    check_state,
    read_engine,
    write_engine,
)

_CHUNK = 1 << 20


def _drawn(state: torch.Tensor, count: int) -> torch.Tensor:
    """The state after drawing ``count`` int32 values from ``state`` (the reference), a chunk at a time."""
    generator = torch.Generator()
    generator.set_state(state)
    buffer = torch.empty(min(count, _CHUNK), dtype=torch.int32)
    for _ in range(count // _CHUNK):
        buffer.random_(generator=generator)
    buffer[: count % _CHUNK].random_(generator=generator)
    return generator.get_state()


def _seeded(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


# Start states: just seeded (left == 1, next == 0: the next output twists), mid-block, at the end of a block.
_STARTS = {"seeded": (7, 0), "mid-block": (7, 777), "block end": (11, 624)}
_COUNTS = [0, 1, 623, 624, 625, 1247, 20_000, 10**5 + 7, 3_000_017]


@pytest.mark.parametrize("start", sorted(_STARTS))
def test_jump_equals_drawing(start: str) -> None:
    seed, drawn = _STARTS[start]
    state = _drawn(_seeded(seed), drawn)
    for count in [*_COUNTS, random.Random(seed).randrange(2_500_000, 3_500_000)]:
        expected = _drawn(state, count)
        assert torch.equal(advance(state, count, draw_below=0), expected), count  # always the jump
        assert torch.equal(advance(state, count), expected), count  # drawn or jumped, as it pleases


def test_start_states_are_the_edge_cases() -> None:
    engines = {name: read_engine(_drawn(_seeded(seed), drawn)) for name, (seed, drawn) in _STARTS.items()}
    assert (engines["seeded"].left, engines["seeded"].next) == (1, 0)
    assert (engines["mid-block"].left, engines["mid-block"].next) == (472, 153)
    assert (engines["block end"].left, engines["block end"].next) == (1, MT_WORDS)


def test_any_valid_engine_position() -> None:
    # A state set by hand may stop anywhere torch accepts: 9 outputs left from word 100, then the twist.
    state = _seeded(13)
    engine = read_engine(_drawn(state, 700))
    state = write_engine(state, EngineState(engine.words, 10, 100))
    for count in (0, 5, 9, 10, 11, 633, 10**5 + 7):
        assert torch.equal(advance(state, count, draw_below=0), _drawn(state, count)), count


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 1, 2**32 + 5, 0x1234_5678_9ABC])
def test_fresh_generators(seed: int) -> None:
    state = _seeded(seed)
    for count in (625, 10**5 + 7, 1_234_567):
        assert torch.equal(advance(state, count, draw_below=0), _drawn(state, count)), count


def test_medium_jump_against_drawing() -> None:
    state = _drawn(_seeded(3), 5)
    count = 50_000_017
    assert torch.equal(advance(state, count, draw_below=0), _drawn(state, count))


@pytest.mark.parametrize("split", [2**32, 12_345, 2**33 + 5 - 624])
def test_large_jump_composes(split: int) -> None:
    state = _drawn(_seeded(5), 100)
    total = 2**33 + 5
    direct = advance(state, total)
    assert torch.equal(advance(advance(state, split, draw_below=0), total - split, draw_below=0), direct)
    assert read_engine(direct).next == (100 + total - 1) % MT_WORDS + 1  # outputs since the seed, in the last block


def test_huge_counts_compose() -> None:
    state = _seeded(9)
    a, b = 10**12 + 3, 2**45 + 11
    assert torch.equal(advance(advance(state, a), b), advance(state, a + b))


def test_seed_and_normal_caches_are_kept() -> None:
    generator = torch.Generator().manual_seed(17)
    torch.randn(3, dtype=torch.float64, generator=generator)  # leaves the double normal sample cached
    state = generator.get_state().clone()
    state[5048:5052] = torch.tensor([0.25], dtype=torch.float32).view(torch.uint8)  # a cached float normal sample
    state[5052] = 1
    for count in (1, 10**5 + 7, 10**9):
        jumped = advance(state, count, draw_below=0)
        assert torch.equal(jumped[:8], state[:8]), "the_initial_seed"
        assert torch.equal(jumped[12:16], state[12:16]), "seeded"
        assert torch.equal(jumped[5016:], state[5016:]), "the normal caches"
    assert torch.equal(advance(state, 10**5 + 7, draw_below=0), _drawn(state, 10**5 + 7))
    resumed = torch.Generator()
    resumed.set_state(advance(state, 10**5 + 7, draw_below=0))
    assert torch.randn(1, dtype=torch.float64, generator=resumed).item() != 0.0


def test_advance_generator_in_place() -> None:
    generator, reference = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    advance_generator(generator, 10**5 + 7, draw_below=0)
    advance_generator(generator, 99)  # short: drawn
    torch.empty(10**5 + 7 + 99, dtype=torch.int32).random_(generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        expected = _drawn(torch.get_rng_state(), 3_000_000)
        advance_generator(torch.default_generator, 3_000_000, draw_below=0)
        assert torch.equal(torch.get_rng_state(), expected)


def test_draws_take_the_outputs_the_count_counts() -> None:
    # One engine output per element for int32 random_ and float32 uniform_ (so counts are in elements), two for
    # float64 uniform_.
    state = _seeded(8)
    for dtype, per_element in ((torch.int32, 1), (torch.float32, 1), (torch.float64, 2)):
        generator = torch.Generator()
        generator.set_state(state)
        values = torch.empty(100_003, dtype=dtype)
        if dtype == torch.int32:
            values.random_(generator=generator)
        else:
            values.uniform_(generator=generator)
        assert torch.equal(generator.get_state(), advance(state, per_element * 100_003, draw_below=0)), dtype


def test_bad_arguments() -> None:
    state = _seeded(0)
    for count in (-1, 1.0, True, "3"):
        with pytest.raises(ValueError, match="count"):
            advance(state, count)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{STATE_NBYTES} bytes.*got 5048 bytes"):
        check_state(state[:-8])
    with pytest.raises(ValueError, match="1-D uint8"):
        check_state(state.view(torch.int32))
    engine = read_engine(state)
    with pytest.raises(ValueError, match="out of range"):
        write_engine(state, EngineState(engine.words, 0, 0))
    with pytest.raises(ValueError, match="reads past the block"):
        stream_jump._advance_engine(EngineState(engine.words, 10, 620), 5)


def test_layout_reads_and_writes_the_engine() -> None:
    check_layout()
    state = _seeded(0x1_0000_0003)
    engine = read_engine(state)
    assert (engine.left, engine.next, int(engine.words[0])) == (1, 0, 3)
    assert torch.equal(write_engine(state, engine), state)
    moved = write_engine(state, EngineState(engine.words ^ 1, 300, 325))
    assert torch.equal(moved[:8], state[:8]) and torch.equal(moved[5016:], state[5016:])
    assert read_engine(moved).left == 300 and torch.equal(read_engine(moved).words, engine.words ^ 1)
    generator = torch.Generator()
    generator.set_state(moved)  # torch accepts what write_engine writes
    assert torch.equal(generator.get_state(), moved)


def _berlekamp_massey(bits: list[int]) -> int:
    """The connection polynomial (bit i: coefficient of x**i) of the shortest LFSR giving ``bits``, over GF(2)."""
    connection, previous, length, shift, window = 1, 1, 0, 1, 0
    for n, bit in enumerate(bits):
        window = (window << 1) | bit  # bit i: bits[n - i]
        if not (connection & window).bit_count() & 1:
            shift += 1
        elif 2 * length <= n:
            connection, previous, length, shift = connection ^ (previous << shift), connection, n + 1 - length, 1
        else:
            connection ^= previous << shift
            shift += 1
    return connection


def test_characteristic_polynomial_is_berlekamp_massey_of_torchs_output() -> None:
    # Every output bit of MT19937 is a linear function of its state, so it satisfies the state transition's
    # characteristic polynomial; 2 * 19937 bits determine it. Here: bit 0 of torch's own outputs (int32 random_ keeps
    # the low 31 bits), so no code of the module is trusted.
    degree = stream_jump._D
    generator = torch.Generator().manual_seed(123)
    bits = (torch.empty(2 * degree, dtype=torch.int32).random_(generator=generator) & 1).tolist()
    connection = _berlekamp_massey(bits)
    assert connection.bit_length() - 1 == degree
    reversed_exponents = sorted(degree - i for i in range(degree + 1) if connection >> i & 1)
    assert tuple(reversed_exponents) == stream_jump._PHI_EXPONENTS


def test_reduction_matches_long_division() -> None:
    phi = sum(1 << e for e in stream_jump._PHI_EXPONENTS)
    degree = stream_jump._D
    rng = random.Random(0)
    for bits in (degree + 1, 2 * degree - 1, 2 * degree + 700):
        p = rng.getrandbits(bits) | (1 << (bits - 1))
        expected = p
        while expected.bit_length() > degree:
            expected ^= phi << (expected.bit_length() - 1 - degree)
        assert stream_jump._reduce(p) == expected, bits
