"""The byte layout of a CPU generator's state (``torch.Generator(device="cpu").get_state()``), and its engine part.

Takes the uint8 tensor ``get_state()`` gives; gives the MT19937 engine inside it (:class:`EngineState`: the 624
words, ``left``, ``next``) and writes a new engine into a copy, every other field left as it was.

The tensor is a memcpy of ``at::detail::CPUGeneratorImplState`` (aten/src/ATen/CPUGeneratorImpl.cpp), which mirrors
the legacy TH generator so that old checkpoints still load; the engine is ``at::mt19937``
(aten/src/ATen/core/MT19937RNGEngine.h). Byte offsets (64-bit alignment; found by experiment on torch 2.13, the
engine's fields checked again at run time by :func:`check_layout`), 5056 bytes in all::

    legacy_pod (CPUGeneratorImplStateLegacy)
        0     uint64_t the_initial_seed
        8     int      left            1 + the outputs the block still serves (1: the next output twists)
        12    int      seeded
        16    uint64_t next            index of the word the next output tempers (0..624)
        24    uint64_t state[624]      the engine's 32-bit words, zero-extended
        5016  double   normal_x        unused (written 0)
        5024  double   normal_y        the cached double normal sample
        5032  double   normal_rho      unused (written 0)
        5040  int      normal_is_valid
    5048  float next_float_normal_sample
    5052  bool  is_next_float_normal_sample_valid      (then padding to 5056)

The engine emits ``temper(state[next++])`` after ``--left``, and when ``left`` reaches 0 first regenerates (twists)
all 624 words and sets ``left = 624``, ``next = 0``; ``manual_seed`` leaves ``left = 1``, ``next = 0``.

Relied on: the two structs above (unchanged in torch's source for years, since the TH generator was replaced; the
package's torch range, 2.11 to 2.15, is expected to match), their native byte order (read here through dtype views,
so the host's endianness does not matter) and the engine's left/next bookkeeping. A torch whose state has another
size fails :func:`check_state` naming the size; one that moved an engine field fails :func:`check_layout` (run once
per process, on first use) rather than reading garbage.

Example:
    >>> state = torch.Generator().manual_seed(0).get_state()
    >>> engine = read_engine(state)
    >>> engine.left, engine.next, engine.words.shape, engine.words.dtype
    (1, 0, torch.Size([624]), torch.int64)
    >>> torch.equal(write_engine(state, engine), state)
    True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

STATE_NBYTES = 5056  # sizeof(at::detail::CPUGeneratorImplState) on the 64-bit platforms torch ships for
MT_WORDS = 624  # at::MERSENNE_STATE_N

# Offsets in units of the views that read them (byte offset / item size).
_SEED = 0  # int64 view: the_initial_seed
_LEFT = 2  # int32 view: left (byte 8)
_SEEDED = 3  # int32 view: seeded (byte 12)
_NEXT = 2  # int64 view: next (byte 16)
_WORDS = slice(3, 3 + MT_WORDS)  # int64 view: state[624] (bytes 24..5016)

_WORD_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class EngineState:
    """The MT19937 engine inside a CPU generator's state.

    ``words``: the 624 words of the current block, an int64 tensor with values in [0, 2**32); ``left``: outputs the
    engine gives before it twists the block, plus one (1 means the next output twists); ``next``: the index of the
    word the next output tempers (meaningless when ``left`` is 1, as the twist resets it).
    """

    words: torch.Tensor
    left: int
    next: int


def check_state(state: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``state`` is a CPU generator state of the layout this module knows.

    Example:
        >>> check_state(torch.zeros(16, dtype=torch.uint8))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: expected a CPU generator state of 5056 bytes ...
    """
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError(f"expected a CPU generator state (a 1-D uint8 tensor), got {_describe(state)}")
    if state.numel() != STATE_NBYTES:
        raise ValueError(
            f"expected a CPU generator state of {STATE_NBYTES} bytes (at::detail::CPUGeneratorImplState as "
            f"lightning_shard.torch_compat.generator_state knows it), got {state.numel()} bytes: this torch "
            f"({torch.__version__}) lays the state out differently, so the engine cannot be read from it"
        )
    check_layout()


def read_engine(state: torch.Tensor) -> EngineState:
    """The engine part of a CPU generator state (words copied; the state is not modified)."""
    check_state(state)
    buf = _own_copy(state)
    as64, as32 = buf.view(torch.int64), buf.view(torch.int32)
    return EngineState(words=as64[_WORDS].clone(), left=int(as32[_LEFT]), next=int(as64[_NEXT]))


def write_engine(state: torch.Tensor, engine: EngineState) -> torch.Tensor:
    """A copy of ``state`` holding ``engine``; the seed, the ``seeded`` flag and the normal caches stay as they were."""
    check_state(state)
    words = engine.words
    if words.shape != (MT_WORDS,) or words.dtype != torch.int64:
        raise ValueError(f"expected {MT_WORDS} int64 engine words, got {tuple(words.shape)} {words.dtype}")
    if not 1 <= engine.left <= MT_WORDS or not 0 <= engine.next <= MT_WORDS:
        raise ValueError(f"engine position out of range: left={engine.left} (1..624), next={engine.next} (0..624)")
    out = _own_copy(state)
    as64 = out.view(torch.int64)
    as64[_WORDS] = words & _WORD_MASK  # the legacy struct zero-extends each 32-bit word
    as64[_NEXT] = engine.next
    out.view(torch.int32)[_LEFT] = engine.left
    return out


@functools.lru_cache(maxsize=1)
def check_layout() -> None:
    """Check, once per process, that this torch writes the engine where this module reads it: a seeded generator's
    seed, flags, position and first two words (MT19937's initialisation), then its position after one output.
    Raises ``RuntimeError`` naming what moved."""
    seed = 0x1_2345_6789  # wider than 32 bits: the_initial_seed keeps it whole, the first word its low half
    generator = torch.Generator().manual_seed(seed)
    seeded = _own_copy(generator.get_state())
    if seeded.numel() != STATE_NBYTES:
        _layout_error(f"size {seeded.numel()} bytes, expected {STATE_NBYTES}")
    torch.empty(1, dtype=torch.int32).random_(generator=generator)  # one output: twists the block, emits word 0
    drawn = _own_copy(generator.get_state())
    word0 = seed & _WORD_MASK
    word1 = (1812433253 * (word0 ^ (word0 >> 30)) + 1) & _WORD_MASK  # init_with_uint32's recurrence, j = 1
    found = {
        "the_initial_seed": (int(seeded.view(torch.int64)[_SEED]), seed),
        "left": (int(seeded.view(torch.int32)[_LEFT]), 1),
        "seeded": (int(seeded.view(torch.int32)[_SEEDED]), 1),
        "next": (int(seeded.view(torch.int64)[_NEXT]), 0),
        "state[0]": (int(seeded.view(torch.int64)[_WORDS][0]), word0),
        "state[1]": (int(seeded.view(torch.int64)[_WORDS][1]), word1),
        "left after one output": (int(drawn.view(torch.int32)[_LEFT]), MT_WORDS),
        "next after one output": (int(drawn.view(torch.int64)[_NEXT]), 1),
    }
    wrong = [f"{name}: read {got}, expected {want}" for name, (got, want) in found.items() if got != want]
    if wrong:
        _layout_error("; ".join(wrong))


def _own_copy(state: torch.Tensor) -> torch.Tensor:
    # A contiguous copy at storage offset 0, so that the int64/int32/float64 views line up with the struct's fields.
    return state.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _layout_error(detail: str) -> None:
    raise RuntimeError(
        f"torch {torch.__version__} lays out the CPU generator state differently from what "
        f"lightning_shard.torch_compat.generator_state expects (at::detail::CPUGeneratorImplState): {detail}"
    )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor of {value.numel()} elements"
    return type(value).__name__
