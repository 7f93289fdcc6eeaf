"""How many numbers a recorded draw takes from the CPU generator, so that a draw whose values nothing needs is jumped
over (:mod:`lightning_shard.init.stream_jump`) instead of drawn.

The replay draws the random ops that no kept tensor needs only to move the stream on as an eager build does (a rank's
share of the model starts where the other shares' draws end; the caller's generator owes every draw of a meta
build). What such a draw leaves behind is the generator's state, which depends only on how many 32-bit outputs it
took from the engine. That count is a property of torch's CPU kernel: ``uniform_`` takes one output per element (two
for float64), ``normal_`` on a contiguous tensor of at least 16 elements one per element (two for float64) and 16 more
when the size is not a multiple of 16 (the last 16 are drawn again; float16 and bfloat16 round up to whole blocks of
16 instead). Other draws (``normal_`` on a strided or small
tensor keeps a cached second sample in the generator, ``randperm``, ``bernoulli``, an ``nn.init`` function called
whole) are not counted: they are drawn, as before.

The counts are not trusted: the form of each op and dtype is checked once per process against the kernel it describes
(:func:`_form`: the op run on a scratch generator must leave the state that drawing the counted outputs leaves), at
sizes on both sides of the kernel's thresholds; where no form holds on the installed torch, nothing is counted and the
op is drawn.

Example:
    >>> op = torch.ops.aten.normal_.default
    >>> outputs_drawn(op, torch.float32, numel=100, contiguous=True)
    116
    >>> outputs_drawn(op, torch.float32, numel=5, contiguous=True) is None
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from lightning_shard.init.construction_log import Op, Scratch, TensorRef
from lightning_shard.init.recorded_inputs import GeneratorAt
from lightning_shard.init.stream_jump import advance_generator
from lightning_shard.torch_compat.dispatch import op_base_name, real_cpu_tensors, tree_leaves

_FACTORIES = {"aten::randn": "aten::normal_", "aten::rand": "aten::uniform_"}
# Sizes the rules are checked at: below, at and above normal_'s 16-element block, a multiple of 16 and not.
_CHECKED_SIZES = (16, 23, 48, 1031)


def _per_element(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.float64 else 1  # a double takes a 64-bit number: two engine outputs


# The forms torch's CPU kernels take, per op: outputs for ``numel`` elements, before the per-element factor.
# ``normal_`` on a contiguous tensor of 16 or more: float32 / float64 draw one per element and the last 16 again when
# the size is not a multiple of 16; float16 / bfloat16 fill whole blocks of 16.
_FORMS: dict[str, tuple[Callable[[int], int], ...]] = {
    "aten::uniform_": (lambda n: n,),
    "aten::normal_": (lambda n: n + (16 if n % 16 else 0), lambda n: -(-n // 16) * 16),
}


def _counted(name: str, dtype: torch.dtype, numel: int, contiguous: bool) -> bool:
    """Whether a count applies at all: floating point; ``normal_`` only on contiguous tensors of 16 or more."""
    return dtype.is_floating_point and (name == "aten::uniform_" or (contiguous and numel >= 16))


def outputs_drawn(func: Any, dtype: torch.dtype, numel: int, contiguous: bool) -> int | None:
    """The 32-bit outputs ``func`` (an ATen op) takes from the CPU generator to fill a tensor of ``numel`` elements of
    ``dtype``; ``None`` when that is not known (module docstring)."""
    name = op_base_name(func) if hasattr(func, "_schema") else ""
    name = _FACTORIES.get(name, name)
    if name not in _FORMS or not _counted(name, dtype, numel, contiguous):
        return None
    form = _form(name, dtype, contiguous)
    return None if form is None else form(numel) * _per_element(dtype)


def outputs_of(op: Op) -> int | None:
    """The outputs a recorded random ``op`` takes from the generator it draws from (:func:`outputs_drawn`); ``None``
    when not known.

    Example:
        >>> outputs_of(op)  # doctest: +SKIP
        4096
    """
    # what it fills: a meta tensor, or a real one (a real draw, replayed into scratch)
    filled = [*op.writes, *filter(None, op.outputs)] or [
        leaf.layout for leaf in tree_leaves((op.args, op.kwargs)) if isinstance(leaf, Scratch)
    ]
    if len(filled) != 1:
        return None
    ref = filled[0]
    return outputs_drawn(op.func, ref.dtype, math.prod(ref.size), _contiguous(ref))


def draws_elsewhere(op: Op) -> bool:
    """Whether ``op`` draws only from a ``generator=`` argument: the replay gives it a copy of that generator at its
    recorded state, so a draw whose values nothing keeps changes nothing at all.

    Example:
        >>> draws_elsewhere(op)  # doctest: +SKIP
        True
    """
    return any(isinstance(leaf, GeneratorAt) for leaf in tree_leaves((op.args, op.kwargs)))


def _contiguous(ref: TensorRef) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(ref.size, ref.stride, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@functools.cache
def _form(name: str, dtype: torch.dtype, contiguous: bool) -> Callable[[int], int] | None:
    """The form of :data:`_FORMS` that the installed torch's kernel takes at every size of :data:`_CHECKED_SIZES`;
    ``None``: none does (the op is then drawn, not counted)."""
    for form in _FORMS[name]:
        if all(_takes(name, dtype, contiguous, n, form(n) * _per_element(dtype)) for n in _CHECKED_SIZES):
            return form
    return None


def _takes(name: str, dtype: torch.dtype, contiguous: bool, numel: int, outputs: int) -> bool:
    """Whether ``name`` on ``numel`` elements leaves a generator where drawing ``outputs`` outputs does (on real CPU
    tensors: a meta-device block, a recorder or the memory simulation's fake tensors would draw nothing)."""
    drawn, raw = torch.Generator().manual_seed(numel), torch.Generator().manual_seed(numel)
    start = drawn.get_state()
    with real_cpu_tensors():
        tensor = torch.empty(numel, 2, dtype=dtype)[:, 0]
        tensor = tensor.contiguous() if contiguous else tensor
        if name == "aten::normal_":
            tensor.normal_(generator=drawn)
        else:
            tensor.uniform_(generator=drawn)
        torch.empty(outputs, dtype=torch.int32).random_(generator=raw)  # one output per int32 element
        return not torch.equal(drawn.get_state(), start) and torch.equal(drawn.get_state(), raw.get_state())


class JumpedDraws:
    """Draws of the default CPU generator jumped over instead of drawn: counted as they come, moved past in one jump
    (:func:`~lightning_shard.init.stream_jump.advance_generator`) when the generator's state next matters.

    Example:
        >>> jumped = JumpedDraws()
        >>> jumped.add(outputs_of(op))  # doctest: +SKIP
        >>> jumped.settle()  # the generator now stands after the draw
    """

    def __init__(self, generator: torch.Generator | None = None, counting: bool = True) -> None:
        self.generator = generator if generator is not None else torch.default_generator
        # ``counting=False`` (or a generator the jump does not know: CUDA's) draws every op instead
        self.counting = counting and self.generator.device.type == "cpu"
        self.pending = 0
        self.total = 0  # outputs jumped over in all

    def add(self, outputs: int) -> None:
        self.pending += outputs

    def past(self, op: Op, draw: Callable[[], Any]) -> None:
        """Move past ``op``'s draw: counted, to be jumped over, where its count is known; else ``draw()`` it now, from
        where the draws counted so far leave the generator."""
        outputs = outputs_of(op) if self.counting else None
        if outputs is None:
            self.settle()
            draw()
        else:
            self.add(outputs)

    def settle(self) -> None:
        """Move the generator past the draws counted so far."""
        if self.pending:
            advance_generator(self.generator, self.pending)
            self.total += self.pending
            self.pending = 0
