"""The draws a meta build skips, owed to the live random generators.

On the meta device a random op draws nothing, so after a meta build the caller's generators stand where they stood
before it, while an eager build leaves them advanced by every draw of the model. Anything drawn afterwards - a module
built for real after ``init_module(empty_init=True)``, dropout, a data split - would come from another point of the
stream than in the eager run. The recording notes each skipped draw here, per generator; they are drawn (into scratch
tensors of the same layout: the values are never used) when the generator's state next matters: before a real draw
from it or a read of its state while recording, and at the end of materialisation. Setting the generator's state
(``manual_seed``, ``set_rng_state``) forgives its debt, as it would make the eager stream forget those draws.

A draw whose count torch's kernel fixes (:mod:`lightning_shard.init.draw_counts`: ``normal_``, ``uniform_``) is not
drawn again: the generator jumps past it (:mod:`lightning_shard.init.stream_jump`), so paying a whole model's draws
costs one jump, not a second pass over them.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

from lightning_shard.init.construction_log import Scratch, TensorRef
from lightning_shard.init.draw_counts import JumpedDraws
from lightning_shard.init.recorded_inputs import GeneratorAt, RealValue
from lightning_shard.torch_compat.dispatch import tree_map
from lightning_shard.torch_compat.tensors import is_generator

_CPU = torch.device("cpu")


class SkippedDraws:
    """Per generator (by id), the recorded random ops on meta tensors not yet drawn from it.

    Example:
        >>> ledger = SkippedDraws()
        >>> ledger.pay()  # nothing owed
    """

    def __init__(self) -> None:
        self.pending: dict[int, tuple[torch.Generator, list[Any]]] = {}

    def add(self, generator: torch.Generator, op: Any) -> None:
        self.pending.setdefault(id(generator), (generator, []))[1].append(op)

    def forget(self, generator: torch.Generator) -> None:
        """``generator``'s state was set: the eager stream forgets the draws before, too."""
        self.pending.pop(id(generator), None)

    def pay(self, generator: torch.Generator | None = None, skip: Iterable[float] = ()) -> None:
        """Draw what ``generator`` (default: every generator) owes, but the ops in ``skip`` (by ``seq``: draws an
        eager run does not make, such as a pretrained model's constructors)."""
        skipped = set(skip)
        keys = list(self.pending) if generator is None else [id(generator)]
        with torch.no_grad():
            for key in keys:
                owner, ops = self.pending.pop(key, (None, []))
                jumped = JumpedDraws(owner)
                for op in ops:
                    if op.seq not in skipped:
                        jumped.past(op, partial(_draw, op, owner))
                jumped.settle()


SKIPPED = SkippedDraws()


def generator_of(values: Any) -> torch.Generator:
    """The generator an op draws from: a ``generator=`` argument (live or as recorded), else the default CPU one.

    Example:
        >>> generator_of(((), {})) is torch.default_generator
        True
    """
    found: list[torch.Generator] = []

    def note(value: Any) -> None:
        live = getattr(value, "generator", value)
        if is_generator(live):
            found.append(live)

    tree_map(note, values)
    return found[0] if found else torch.default_generator


def _draw(op: Any, generator: torch.Generator) -> None:
    """Run ``op``'s draw on CPU scratch tensors: its meta inputs as ones (a valid probability, scale and weight: the
    number of numbers drawn does not depend on them), its ``generator=`` the live one."""

    def scratch(value: Any) -> Any:
        if isinstance(value, Scratch):
            value = value.layout
        if isinstance(value, TensorRef):
            # on the CPU by name: the meta device may be the default here
            whole = torch.ones(value.nbytes // value.dtype.itemsize, dtype=value.dtype, device=_CPU)
            return whole.as_strided(value.size, value.stride, value.offset)
        if isinstance(value, RealValue):
            return value.tensor
        if isinstance(value, GeneratorAt):
            return generator
        if isinstance(value, torch.device) and value.type == "meta":
            return _CPU
        return value

    args, kwargs = tree_map(scratch, (op.args, op.kwargs))
    op.func(*args, **kwargs)
