"""Jump torch's CPU random generator ahead by any number of engine outputs, exactly, without drawing them.

Takes a CPU generator state (``torch.Generator().get_state()``) and a count; gives the state the generator would
have after ``count`` 32-bit engine outputs: :func:`advance` (a new state) and :func:`advance_generator` (in place).
An int32 ``random_()`` or a float32 ``uniform_()`` takes one output per element, a float64 ``uniform_()`` two, so a
rank can start at its own offset in rank 0's stream and draw exactly what rank 0 would have drawn there.

How (the standard MT19937 jump-ahead, Haramoto et al. 2008): the engine is a linear map ``A`` on its 19937-bit state,
with characteristic polynomial ``phi`` (135 terms, :data:`_PHI_EXPONENTS`). Since ``phi(A) = 0``,
``A**L = g(A)`` for ``g = x**L mod phi``, and the state after ``L`` steps is the XOR of the states after ``i`` steps
for the ``i`` where ``g`` has a 1. A state after ``i`` steps is the window of 624 untempered words at ``i`` in the
engine's word sequence, so the jump costs: ``x**L mod phi`` (``log2(L) - 14`` squarings of 19937-bit polynomials in
Python ints, reduced by the sparse ``phi``), the first 20568 words of the sequence, and one XOR of the ~10**4 windows
``g`` selects (torch). About 10-15 ms for ``count = 10**12`` on one core, nothing cached between calls; counts
under :data:`DRAW_BELOW` are drawn instead. Pure integer arithmetic: the result is exact, never approximate.

Relied on, beyond generator_state's layout: at::mt19937's recurrence (N = 624, M = 397, MATRIX_A; the same since
MT19937 was published) and int32 ``random_()`` taking one output per element (tests/test_stream_jump.py checks both
against torch's own draws). All tensor ops here are real CPU ops: call this outside fake or recording dispatch modes.

Example:
    >>> generator = torch.Generator().manual_seed(0)
    >>> jumped = advance(generator.get_state(), 10**6 + 3)
    >>> _ = torch.empty(10**6 + 3, dtype=torch.int32).random_(generator=generator)
    >>> torch.equal(jumped, generator.get_state())
    True
"""

from __future__ import annotations

import torch

from lightning_shard.torch_compat.dispatch import real_cpu_tensors
from lightning_shard.torch_compat.generator_state import MT_WORDS, EngineState, read_engine, write_engine

# Below this many outputs, drawing them (about 2.4 ns each, one core) beats jumping (about 6 ms at the least).
DRAW_BELOW = 1 << 21
_DRAW_CHUNK = 1 << 16  # the int32 buffer drawn into, over and over

_D = 19937  # bits of MT19937's state: the degree of phi
# The exponents of phi, the characteristic polynomial of MT19937's state transition (the minimal polynomial of any
# bit of its word sequence, by Berlekamp-Massey; tests/test_stream_jump.py recomputes it).
_PHI_EXPONENTS = tuple(
    int(e)
    for e in """
    0 1189 1416 1585 1643 1870 2493 2773 3000 3227 3454 3681 3908 4135 4362 4753 5661 6337 6569 7129 7477 7525 7583
    7752 7979 8206 9505 9901 9969 10128 10693 10761 10920 11089 11147 11157 11215 11321 11374 11384 11485 11611
    11712 11717 11838 11881 11944 11997 12277 12335 12393 12504 12509 12620 12673 12731 12736 12789 12905 12958
    12963 13137 13185 13190 13243 13301 13412 13528 13533 13639 13697 13760 13813 13866 14093 14151 14209 14320
    14325 14436 14547 14552 14605 14721 14774 14779 14953 15001 15006 15059 15117 15228 15344 15349 15455 15513
    15576 15629 15682 15909 15967 16025 16136 16141 16252 16363 16368 16421 16537 16590 16595 16817 16822 16875
    16933 17044 17160 17271 17329 17445 17498 17725 17783 17841 17952 18068 18179 18237 18406 18633 18691 18860
    19087 19314 19937
    """.split()
)
_PSI = _PHI_EXPONENTS[:-1]  # phi = x**_D + psi
_GAP = _D - _PSI[-1]  # 623: one round of long division by phi settles this many quotient bits
# Quotient bits per round of _reduce: seven rounds, each a division by phi's top _TOP + 1 bits (18 terms) and one
# product by psi, instead of 32 rounds of 134 shifts with plain long division (about 5x faster; measured).
_TOP = 2849
_TOP_PSI = tuple(e - (_D - _TOP) for e in _PSI if e >= _D - _TOP)

_MATRIX_A = 0x9908B0DF  # at::MATRIX_A
_MT_M = 397  # at::MERSENNE_STATE_M
_DIGIT_BITS = 4  # bits of g per table lookup in _select_windows
_DIGITS = -(-_D // _DIGIT_BITS)
_SEQUENCE_WORDS = _DIGIT_BITS * _DIGITS + MT_WORDS + _DIGIT_BITS  # 20568: every word _select_windows reads


def advance(state: torch.Tensor, count: int, *, draw_below: int = DRAW_BELOW) -> torch.Tensor:
    """The CPU generator state after ``count`` engine outputs from ``state``: byte for byte what
    ``g.set_state(state); torch.empty(count, dtype=torch.int32).random_(generator=g); g.get_state()`` gives.
    ``draw_below``: counts under it are drawn rather than jumped (the result is the same)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    generator = torch.Generator()
    generator.set_state(state)  # torch validates the state; get_state() below gives its canonical bytes
    with real_cpu_tensors():  # also inside a meta-device block, a recorder or the memory simulation's fake mode
        if count < draw_below:
            _draw(generator, count)
            return generator.get_state()
        base = generator.get_state()
        return write_engine(base, _advance_engine(read_engine(base), count))


def advance_generator(generator: torch.Generator, count: int, *, draw_below: int = DRAW_BELOW) -> None:
    """Move a CPU ``generator`` (``torch.default_generator`` included) ``count`` engine outputs ahead, in place."""
    if generator.device.type != "cpu":
        raise ValueError(f"advance_generator jumps CPU generators (MT19937), got one on {generator.device}")
    if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < draw_below:
        with real_cpu_tensors():
            _draw(generator, count)  # no state copies for the short ones
    else:
        generator.set_state(advance(generator.get_state(), count, draw_below=draw_below))


def _draw(generator: torch.Generator, count: int) -> None:
    buffer = torch.empty(min(count, _DRAW_CHUNK), dtype=torch.int32)
    for _ in range(count // _DRAW_CHUNK):
        buffer.random_(generator=generator)  # int32 random_: one 32-bit output per element
    if count % _DRAW_CHUNK:
        buffer[: count % _DRAW_CHUNK].random_(generator=generator)


def _advance_engine(engine: EngineState, count: int) -> EngineState:
    """The engine after ``count`` outputs (see generator_state for what ``left`` and ``next`` mean)."""
    in_block = engine.left - 1  # outputs still served from the current block before the engine twists it
    if engine.next + in_block > MT_WORDS:
        raise ValueError(f"invalid engine position: left={engine.left}, next={engine.next} reads past the block")
    if count <= in_block:
        return EngineState(engine.words, engine.left - count, engine.next + count)
    # Number the untempered words x_0, x_1, ... with the current block = x_0..x_623: the t-th output after the block
    # (t = 0, 1, ...) tempers x_{624 + t}, and the engine holds whole blocks x_{624 b}..x_{624 b + 623}.
    after = count - in_block  # >= 1 outputs past the current block
    blocks, taken = divmod(after - 1, MT_WORDS)  # the last output is word `taken` of block `blocks + 1`
    return EngineState(_block_at(engine.words, MT_WORDS * (blocks + 1)), MT_WORDS - taken, taken + 1)


def _block_at(block: torch.Tensor, start: int) -> torch.Tensor:
    """Words x_start..x_{start + 623} of the sequence whose first 624 words are ``block`` (int64 values)."""
    if start + MT_WORDS <= _SEQUENCE_WORDS:
        return _sequence(block, start + MT_WORDS)[start:]
    # The 19937 state bits at step i are the top bit of x_i and x_{i+1}..x_{i+623}; x_i's 31 low bits belong to the
    # past. So jump to step start - 1, whose window x_start..x_{start + 623} is all state (x_{start + 623} is the next
    # word, a linear function of it too), and take the windows starting one word late.
    g = _x_power_mod_phi(start - 1)
    return _select_windows(_sequence(block, _SEQUENCE_WORDS), g)


def _sequence(block: torch.Tensor, total: int) -> torch.Tensor:
    """x_0..x_{total - 1} (int64, in [0, 2**32)): MT19937's recurrence, x_{k+624} = x_{k+397} ^ twist(x_k, x_{k+1}),
    as at::mt19937's next_state() computes it, 227 words per step (the most that do not depend on each other)."""
    x = torch.empty(max(total, MT_WORDS), dtype=torch.int64)
    x[:MT_WORDS] = block
    for k in range(0, total - MT_WORDS, MT_WORDS - _MT_M):
        end = min(k + MT_WORDS - _MT_M, total - MT_WORDS)
        low, high = x[k:end], x[k + 1 : end + 1]
        mixed = (low & 0x80000000) | (high & 0x7FFFFFFF)
        x[k + MT_WORDS : end + MT_WORDS] = x[k + _MT_M : end + _MT_M] ^ (mixed >> 1) ^ ((high & 1) * _MATRIX_A)
    return x[:total]


_SHIFTS = torch.arange(0, 8, _DIGIT_BITS, dtype=torch.uint8, device="cpu")  # imported in a meta block too


def _select_windows(sequence: torch.Tensor, g: int) -> torch.Tensor:
    """XOR over the i where bit i of ``g`` is 1 of the windows x_{i+1}..x_{i+624}: 4 bits of ``g`` at a time through
    a table of the 16 XOR combinations of 4 consecutive windows (the method of the four Russians)."""
    # int32 bit patterns (the XOR does not care about sign), so that two words travel as one int64 below.
    words = (sequence - ((sequence >> 31) << 32)).to(torch.int32)[1:]
    length = _DIGIT_BITS * _DIGITS + MT_WORDS  # the table's columns: every start 4a and its 624 words
    table = torch.zeros(1 << _DIGIT_BITS, length, dtype=torch.int32)
    for t in range(_DIGIT_BITS):  # row v holds the XOR of the windows starting t words late, t in v's bits
        table[1 << t : 2 << t] = table[: 1 << t] ^ words[t : t + length]
    raw = torch.frombuffer(bytearray(g.to_bytes((_D + 7) // 8, "little")), dtype=torch.uint8)
    digits = ((raw.unsqueeze(1) >> _SHIFTS) & ((1 << _DIGIT_BITS) - 1)).flatten()[:_DIGITS].long()
    # Windows start at even words (4a), so pairs of words can be XORed as int64s: half the elements to move.
    windows = table.view(torch.int64).unfold(1, MT_WORDS // 2, _DIGIT_BITS // 2)
    picked = windows[digits, torch.arange(_DIGITS)]  # (4985, 312): the digit's row at each group's start
    rows = picked.shape[0]
    while rows > 1:  # XOR-reduce the rows by halves (torch has no XOR reduction)
        half = rows // 2
        picked[:half] ^= picked[rows - half : rows]
        rows -= half
    return picked[0].view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _x_power_mod_phi(exponent: int) -> int:
    """x**exponent mod phi, as an int whose bit i is the coefficient of x**i: left to right, one squaring (and a
    shift by the exponent's next bit) per bit below the top 14, whose power is still a plain monomial."""
    if exponent < _D:
        return 1 << exponent
    bits = exponent.bit_length()
    lead = _D.bit_length() - 1  # 14: 2**14 <= _D
    result = 1 << (exponent >> (bits - lead))
    for i in range(bits - lead - 1, -1, -1):
        result = _reduce(_square(result) << ((exponent >> i) & 1))
    return result


_SPREAD_LOW = bytes(sum(((v >> i) & 1) << (2 * i) for i in range(4)) for v in range(256))
_SPREAD_HIGH = bytes(sum(((v >> (i + 4)) & 1) << (2 * i) for i in range(4)) for v in range(256))


def _square(p: int) -> int:
    """p**2 over GF(2): the cross terms cancel, so bit i moves to bit 2i (each byte spreads to two)."""
    raw = p.to_bytes((p.bit_length() + 7) // 8, "little")
    spread = bytearray(2 * len(raw))
    spread[0::2] = raw.translate(_SPREAD_LOW)
    spread[1::2] = raw.translate(_SPREAD_HIGH)
    return int.from_bytes(spread, "little")


def _reduce(p: int) -> int:
    """p mod phi, by long division _TOP quotient bits at a time. The top bits of a quotient depend only on the top
    bits of the dividend and the divisor, so each digit is the quotient by phi's top _TOP + 1 bits (_divide_top, on
    small ints); then digit * phi is subtracted where it belongs."""
    while p.bit_length() > _D:
        low = max(0, p.bit_length() - _D - _TOP)  # the digit is quotient bits low..(degree - _D)
        digit = _divide_top(p >> (_D - _TOP + low))
        p ^= (digit << (_D + low)) ^ (_times_psi(digit) << low)
    return p


def _divide_top(p: int) -> int:
    """The quotient of ``p`` by phi's top _TOP + 1 bits (x**_TOP + the _TOP_PSI terms), _GAP bits per round."""
    quotient = 0
    while p.bit_length() > _TOP:
        low = max(0, p.bit_length() - _TOP - _GAP)
        digit = p >> (_TOP + low)
        quotient ^= digit << low
        p ^= digit << (_TOP + low)
        for e in _TOP_PSI:
            p ^= digit << (low + e)
    return quotient


# phi has more structure than its 135 terms show: phi = x * F(v) + 1 with v = x**396 + x**623 (x**(M-1) + x**(N-1))
# and F of degree 32 with 15 terms (found and checked at import by _f_terms). The powers v**(2**k) have two terms, so
# a product by psi = phi - x**_D takes ~45 shifts of mostly small ints instead of 134 of large ones (2.5x faster).
_V_LOW, _V_HIGH = _MT_M - 1, MT_WORDS - 1
_Plan = bool | tuple["_Plan", "_Plan", int]  # a sum of powers of v: a leaf (present or not) or (low, high, half)


def _times_v_power(p: int, power: int) -> int:
    return (p << (_V_LOW * power)) ^ (p << (_V_HIGH * power))


def _f_terms() -> tuple[int, ...]:
    """The powers of v in F but v**32, found by expanding (phi - 1) / x in powers of v from the top."""
    rest, powers = sum(1 << e for e in _PHI_EXPONENTS) >> 1, [1]
    for _ in range(_D // _V_HIGH):
        powers.append(_times_v_power(powers[-1], 1))
    terms = []
    for i in range(len(powers) - 1, -1, -1):
        if rest.bit_length() - 1 == _V_HIGH * i:
            rest ^= powers[i]
            terms.append(i)
    if rest or _PHI_EXPONENTS[0] != 0 or terms[0] != _D // _V_HIGH:
        raise RuntimeError("the shipped characteristic polynomial of MT19937 is not x * F(x**396 + x**623) + 1")
    return tuple(sorted(terms[1:]))


def _plan(terms: tuple[int, ...], width: int) -> _Plan:
    """A binary splitting of the sum of v**i over ``terms`` (each < 2**width): (low half, high half, 2**(width-1))."""
    if not terms or width == 0:
        return bool(terms)
    half = 1 << (width - 1)
    low = tuple(i for i in terms if i < half)
    high = tuple(i - half for i in terms if i >= half)
    return (_plan(low, width - 1), _plan(high, width - 1), half)


def _times_plan(p: int, plan: _Plan) -> int:
    if not isinstance(plan, tuple):
        return p if plan else 0
    low, high, half = plan
    return _times_plan(p, low) ^ _times_v_power(_times_plan(p, high), half)


_F_PLAN = _plan(_f_terms(), (_D // _V_HIGH).bit_length() - 1)
_X_V32 = 1 + (_D // _V_HIGH) * _V_LOW  # x * v**32 = x**12673 + x**_D


def _times_psi(p: int) -> int:
    """p * psi over GF(2), psi = phi - x**_D = x**12673 + 1 + x * (F(v) - v**32)."""
    return (p << _X_V32) ^ p ^ (_times_plan(p, _F_PLAN) << 1)
