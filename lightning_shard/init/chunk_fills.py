"""Tensors each rank fills in its own chunk, with nothing sent: a weight created and then filled whole - by a counted
draw (``normal_``, ``uniform_``), a constant or scalar arithmetic - is the common case (``nn.Linear``, embeddings,
norms, GPT-style inits), and each of its elements depends only on a known stretch of the random stream.

``uniform_`` draws element i from output i (two outputs for float64); ``normal_`` on a contiguous tensor draws all its
uniforms first and turns each block of 16 into normals by itself, the last 16 elements again from 16 more outputs when
the size is not a multiple of 16 (float16 / bfloat16 round up to whole blocks instead). So a rank's chunk - a row range
of the tensor, a contiguous range of its elements - is drawn by jumping the generator to where the chunk's first block
starts (:mod:`lightning_shard.init.stream_jump`) and running the same kernel on a scratch tensor of whole blocks, then
cutting the chunk out: the same numbers, computed the same way. Whether that holds on the installed torch is checked
once per op and dtype against a whole draw (:func:`_ranges_hold`); where it does not, the tensor goes through the
split's owners (:mod:`lightning_shard.init.split_replay`) as before.

Example:
    >>> whole = torch.empty(100).normal_(generator=torch.Generator().manual_seed(0))
    >>> start = torch.Generator().manual_seed(0).get_state()
    >>> part = torch.empty(65)
    >>> draw_range(torch.ops.aten.normal_.default, (0.0, 1.0), 100, Stream(start), 0, 30, part)
    >>> torch.equal(part, whole[30:95])
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_shard.init.construction_log import Op, TensorRef, held_tensor
from lightning_shard.init.draw_counts import outputs_drawn, outputs_of
from lightning_shard.init.recorded_inputs import GeneratorAt, RealValue
from lightning_shard.init.shard_init import local
from lightning_shard.init.stream_jump import advance_generator
from lightning_shard.torch_compat.dispatch import op_base_name, real_cpu_tensors, tree_leaves
from lightning_shard.torch_compat.distributed import local_chunk

_CREATE = {"aten::empty": None, "aten::zeros": 0, "aten::ones": 1}  # -> the value it fills with (None: none)
_WHOLE_WRITES = {"aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_"}
_SCALAR_UPDATES = {"aten::mul_", "aten::add_", "aten::sub_", "aten::div_", "aten::clamp_"}


class Stream:
    """The CPU random stream from ``state``, moved to any place in it: ahead by drawing or jumping (whichever is
    cheaper, :func:`~lightning_shard.init.stream_jump.advance_generator`), back by starting again.

    Example:
        >>> stream = Stream(torch.Generator().manual_seed(0).get_state())
        >>> stream.at(1000).device
        device(type='cpu')
    """

    def __init__(self, state: torch.Tensor) -> None:
        self.state, self.generator, self.position = state, torch.Generator().set_state(state), 0

    def at(self, offset: int) -> torch.Generator:
        if offset < self.position:
            self.generator.set_state(self.state)
            self.position = 0
        advance_generator(self.generator, offset - self.position)
        self.position = offset
        return self.generator

    def drew(self, outputs: int) -> None:
        self.position += outputs


def draw_range(func: Any, args: tuple, numel: int, stream: Stream, offset: int, start: int, out: torch.Tensor) -> None:
    """Draw into ``out`` elements ``start:start + len(out)`` of what ``func(tensor, *args)`` (``normal_`` /
    ``uniform_``) draws into a contiguous tensor of ``numel`` elements of ``out``'s dtype at ``offset`` outputs into
    ``stream``: straight into ``out`` where its range is whole blocks, else through a scratch block.

    Example: in the module docstring.
    """
    name, each, stop = op_base_name(func), 2 if out.dtype == torch.float64 else 1, start + out.numel()
    with real_cpu_tensors():
        if name == "aten::uniform_":
            _drawn(func, args, stream, offset + start * each, out, each)
            return
        tail = outputs_drawn(func, out.dtype, numel, contiguous=True) == (numel + 16) * each  # last 16 drawn again
        whole = numel - 16 if tail else numel  # elements drawn in the main pass that stay
        if start < whole:
            first, last, end = start // 16 * 16, -(-min(stop, whole) // 16) * 16, min(stop, whole)
            if (first, last) == (start, end):
                _drawn(func, args, stream, offset + first * each, out[: end - start], each)
            else:
                block = _drawn(
                    func, args, stream, offset + first * each, torch.empty(last - first, dtype=out.dtype), each
                )
                out[: end - start].copy_(block[start - first : end - first])
        if tail and stop > whole:
            block = _drawn(func, args, stream, offset + numel * each, torch.empty(16, dtype=out.dtype), each)
            out[max(start, whole) - start :].copy_(block[max(start, whole) - whole : stop - whole])


def _drawn(func: Any, args: tuple, stream: Stream, offset: int, out: torch.Tensor, each: int) -> torch.Tensor:
    func(out, *args, generator=stream.at(offset))
    stream.drew(out.numel() * each)
    return out


@functools.cache
def _ranges_hold(func: Any, dtype: torch.dtype) -> bool:
    """Whether :func:`draw_range` gives what a whole draw gives, on the installed torch, at sizes and ranges on both
    sides of its blocks."""
    state = torch.Generator().manual_seed(11).get_state()
    with real_cpu_tensors():
        for numel in (1040, 1031, 48, 23):
            if outputs_drawn(func, dtype, numel, contiguous=True) is None:
                return False
            whole = torch.empty(numel, dtype=dtype)
            func(whole, generator=torch.Generator().set_state(state))
            for start, stop in ((0, numel), (0, 5), (7, numel - 3), (numel // 2, numel), (numel - 9, numel), (16, 32)):
                part = torch.empty(max(0, min(stop, numel) - start), dtype=dtype)
                draw_range(func, (), numel, Stream(state), 0, start, part)
                if not torch.equal(part, whole[start:stop]):
                    return False
    return True


def chunk_filled(plan: Any, offsets: dict[float, int], events: int) -> set[int]:
    """The target storages of ``plan`` (an :class:`~lightning_shard.init.init_plan.InitPlan`) each rank fills in its
    own chunk: created, then written whole by counted draws whose place in the stream is known (``offsets``, by
    ``seq``), constants and scalar arithmetic only, read by no other op the targets need, and held whole by tensors cut
    in rows (``Shard(0)`` / ``Replicate``). None when the random stream has ``events`` (seeds, restores) besides its
    start.

    Example:
        >>> chunk_filled(plan, offsets, events=0)  # doctest: +SKIP
        {94116734496224, 94116733540464}
    """
    if events:
        return set()
    writes: dict[int, list[Op]] = {}
    entangled: set[int] = set()  # storages an op reads or writes together with another
    for op in plan.ops:
        if op.seq not in plan.needed:
            continue
        written, read = op.written_storages, op.read_storages
        if len(written) == 1 and read <= written and _fill(op) and (not op.random or op.seq in offsets):
            writes.setdefault(next(iter(written)), []).append(op)
        else:
            entangled |= written | read
    return {
        storage
        for storage in plan.targets - entangled
        if storage in writes and _program(writes[storage]) and _held_in_rows(plan, storage)
    }


def _fill(op: Op) -> bool:
    """A creation, a whole write or a scalar update, with no tensor or generator among its other arguments."""
    if not isinstance(op, Op) or not hasattr(op.func, "_schema"):
        return False
    name = op_base_name(op.func)
    if name in _CREATE:
        return not op.args or not any(isinstance(leaf, TensorRef) for leaf in tree_leaves(op.args))
    if name not in _WHOLE_WRITES | _SCALAR_UPDATES or not op.args or not isinstance(op.args[0], TensorRef):
        return False
    others = tree_leaves((op.args[1:], op.kwargs))
    if any(isinstance(leaf, TensorRef | RealValue | GeneratorAt | torch.Tensor | torch.Generator) for leaf in others):
        return False
    return op.args[0].whole and (not op.random or _countable(op))


def _countable(op: Op) -> bool:
    return outputs_of(op) is not None and _ranges_hold(op.func, op.args[0].dtype)


def _program(ops: list[Op]) -> bool:
    """Values defined from the start: a whole write first (the creation before it is no needed op then), or a creation
    with a value, or an unwritten creation followed by a whole write before any update."""
    first = op_base_name(ops[0].func)
    if first in _WHOLE_WRITES or (first in _CREATE and _CREATE[first] is not None):
        return True
    return first in _CREATE and len(ops) > 1 and op_base_name(ops[1].func) in _WHOLE_WRITES


def _held_in_rows(plan: Any, storage: int) -> bool:
    for key in plan.keys_by_storage[storage]:
        ref, live = plan.held[key], held_tensor(plan.modules, key)
        if not ref.whole or tuple(live.shape) != ref.size:
            return False
        if isinstance(live, DTensor) and not all(
            isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0) for p in live.placements
        ):
            return False
    return True


def fill_chunks(plan: Any, storages: set[int], state: torch.Tensor, offsets: dict[float, int]) -> None:
    """Fill this rank's chunk of each live tensor holding ``storages``, the random stream starting at ``state``
    (``offsets``: each draw's place in it, by ``seq``).

    Example:
        >>> fill_chunks(plan, chunk_filled(plan, offsets, 0), state, offsets)  # doctest: +SKIP
    """
    programs: dict[int, list[Op]] = {}  # in program order, so that the stream is walked forwards
    for op in plan.ops:
        if op.seq in plan.needed and isinstance(op, Op) and op.written_storages & storages:
            programs.setdefault(next(iter(op.written_storages)), []).append(op)
    stream = Stream(state)
    for storage, ops in programs.items():
        done: set[int] = set()
        for key in plan.keys_by_storage[storage]:
            live = held_tensor(plan.modules, key)
            if id(live) in done:
                continue
            done.add(id(live))
            start, stop = _elements(live)
            part, dtype = local(live), plan.held[key].dtype
            with real_cpu_tensors():
                # straight into the shard where it is host memory of the dtype drawn, else through a buffer
                direct = part.device.type == "cpu" and part.is_contiguous() and part.dtype == dtype
                values = part.view(-1) if direct else torch.empty(stop - start, dtype=dtype)
                _run(ops, live.numel(), start, stream, offsets, values)
                if not direct:
                    part.copy_(values.view(part.shape).to(part.dtype))
            plan.replayed[id(live)] = True
            plan.swap.initialized(live)


def _elements(live: torch.Tensor) -> tuple[int, int]:
    """The range of elements this rank holds of ``live``: all of a plain tensor, a row range of a DTensor."""
    if not isinstance(live, DTensor) or live.dim() == 0:
        return 0, live.numel()
    (offsets, sizes) = local_chunk(live)
    row = live.numel() // live.shape[0] if live.shape[0] else 0
    return offsets[0] * row, (offsets[0] + sizes[0]) * row


def _run(ops: list[Op], numel: int, start: int, stream: Stream, offsets: dict, values: torch.Tensor) -> None:
    """Run ``ops`` on ``values``, elements ``start:start + len(values)`` of a tensor of ``numel`` elements."""
    for op in ops:
        if op_base_name(op.func) in _CREATE:
            if _CREATE[op_base_name(op.func)] is not None:
                values.fill_(_CREATE[op_base_name(op.func)])
        elif op.random:
            draw_range(op.func, op.args[1:], numel, stream, offsets[op.seq], start, values)
        else:
            op.func(values, *op.args[1:], **op.kwargs)
