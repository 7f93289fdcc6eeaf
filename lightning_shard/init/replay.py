"""Replaying a recorded construction (:mod:`lightning_shard.init.construction_log`) on real tensors, in program order.

Everything runs on the CPU from the CPU generator, whatever device the model trains on: the random ops of an eager
build on the CPU draw from that generator, and a CUDA generator draws other numbers from the same seed. The replay
draws from rank 0's stream (the eager build is one process; :mod:`lightning_shard.init.rng_timeline`), on full-size
tensors, and the ranks keep their shards: each rank replays the tensors it owns and receives the others' shards where
the work is split (:mod:`lightning_shard.init.split_replay`), else every rank replays all of them.

Memory: a storage gets a full-size buffer (its bytes, on the CPU) at the first op the weights depend on that touches it,
and is written back to the live tensors (each rank its shard) and dropped after the last one. Ops the weights do not
depend on (an init that a later one overwrites whole, another rank's tensors) are skipped, but the stream must advance
past their draws as in an eager build: a draw whose count is known is jumped over
(:mod:`lightning_shard.init.draw_counts`), any other is drawn into scratch tensors of the same layout. So only the
tensors under initialisation at one point of the construction exist whole, even when a constructor re-initialises its
children at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_shard.init.construction_log import Op, Scratch, TensorRef
from lightning_shard.init.draw_counts import JumpedDraws, draws_elsewhere
from lightning_shard.init.recorded_inputs import GeneratorAt, RealValue
from lightning_shard.init.shard_init import host_shard
from lightning_shard.init.unset import allocates_unwritten, empty_bytes, fill_twice, fill_unset
from lightning_shard.torch_compat.dispatch import holds_values, tree_leaves, tree_map

_CPU = torch.device("cpu")
# Finished full-size buffers kept for reuse (`Replay.recycle`), at most this many bytes.
SPARE_BYTES = 1 << 30


def strided(buffer: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """``ref``'s elements in ``buffer`` (the bytes of its full-size storage).

    Example:
        >>> strided(torch.zeros(8, dtype=torch.uint8), TensorRef(0, (2,), (1,), 0, torch.float32, 8))
        tensor([0., 0.])
    """
    return buffer.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)


@dataclass(eq=False)
class Overwrite:
    """An initialisation the replay does not run op by op (a library's init of its model, transformers'
    ``_init_weights``): at ``seq`` its ``action`` sets the ``overwritten`` storages whole, in the live tensors; ops
    after it read them from there.

    Example:
        >>> Overwrite(3.5, frozenset({1}), lambda: None).written_storages
        {1}
    """

    seq: float
    overwritten: frozenset[int]
    action: Callable[[], None]
    order: tuple[float, ...] = ()  # where it runs among ops at the same ``seq`` (the caller's ordering)
    random = False

    @property
    def written_storages(self) -> set[int]:
        return set(self.overwritten)

    @property
    def read_storages(self) -> set[int]:
        return set()

    input_storages = read_storages

    def refs(self) -> Iterator[TensorRef]:
        return iter(())


def needed_ops(
    ops: list[Op | Overwrite], targets: set[int], draws: Callable[[Op], bool]
) -> tuple[set[float], set[int]]:
    """The ops (by ``seq``) the final values of the ``targets`` storages depend on, found backwards from the end: an
    op is needed when it writes a storage whose value is read later; a storage it sets whole is not needed before it,
    one it reads is. A random op that ``draws`` still needs its inputs (a draw's count can depend on them:
    ``bernoulli``'s probabilities). Also returned: the storages needed from before the first op (values that come
    from outside the replay).

    Example:
        >>> needed_ops([], {1}, draws=lambda op: True)
        (set(), {1})
    """
    live = set(targets)
    needed: set[float] = set()
    for op in reversed(ops):
        if op.written_storages & live:
            needed.add(op.seq)
            live -= op.overwritten
            live |= op.read_storages
        elif op.random and draws(op):
            live |= op.input_storages
    return needed, live


class Replay:
    """Runs the needed ops on full-size CPU buffers and writes the finished storages back (module docstring).

    Args:
        ops: every recorded op that the replay runs or draws for, and the library inits, in program order.
        needed: ``seq`` of the ops whose results are kept (:func:`needed_ops`).
        write_back: ``storage -> action`` storing a finished storage's full-size buffer into the live tensors
            (called for the storages that needed ops wrote); it returns whether it keeps the buffer (else the buffer
            is reused, :meth:`recycle`).
        external: ``storage -> action`` filling a new buffer with the storage's current value, for storages whose
            values come from outside the replay (a library's init, a module's ``reset_parameters()``): called when a
            needed op first reads them.
        draws: whether an op's random draws advance the stream (not for a library's constructors that an eager load
            does not run).
        dtypes: ``storage -> dtype`` of the sentinel its buffer starts with (default: the dtype an op first saw).
        jump: jump over the counted draws whose values nothing keeps (:mod:`~lightning_shard.init.draw_counts`);
            ``False``: draw them all.
    """

    def __init__(
        self,
        ops: list[Op | Overwrite],
        needed: set[float],
        write_back: dict[int, Callable[[torch.Tensor], None]],
        external: dict[int, Callable[[torch.Tensor], None]],
        draws: Callable[[Op], bool],
        dtypes: dict[int, torch.dtype],
        jump: bool = True,
    ) -> None:
        self.needed, self.write_back, self.external, self.draws = needed, write_back, external, draws
        self.dtypes = dict(dtypes)
        self.buffers: dict[int, torch.Tensor] = {}
        self.nbytes: dict[int, int] = {}
        self.written: set[int] = set()
        # storage -> its buffer run from the second fill, while unwritten memory may be in it (`unset`)
        self.second: dict[int, torch.Tensor] = {}
        self.unwritten: set[int] = set()  # storages finished with elements that depend on unwritten memory
        self.jumped = JumpedDraws(counting=jump)  # the default generator's draws whose values nothing keeps
        self.spare: dict[int, list[torch.Tensor]] = {}  # finished buffers by size (`recycle`)
        self.spare_bytes = 0
        # (position, the generator's state) before the first needed draw and after the last (split_replay's check)
        self.first_draw: tuple[float, torch.Tensor] | None = None
        self.last_draw: tuple[float, torch.Tensor] | None = None
        self.closes: dict[int, list[int]] = {}  # op seq -> storages last used by it
        last: dict[int, int] = {}
        for op in ops:
            if op.seq in needed:
                refs = list(op.refs())
            elif op.random and draws(op):
                refs = list(op.reads)  # a draw into scratch reads its inputs
            else:
                continue
            for ref in refs:
                self.nbytes[ref.storage] = max(self.nbytes.get(ref.storage, 0), ref.nbytes)
                self.dtypes.setdefault(ref.storage, ref.dtype)
                last[ref.storage] = op.seq
        for storage, seq in last.items():
            self.closes.setdefault(seq, []).append(storage)

    def run(self, op: Op | Overwrite) -> None:
        if isinstance(op, Overwrite):
            self.jumped.settle()
            op.action()
            for storage in op.overwritten:  # what the replay held for them is stale: read again from the live tensors
                self.buffers.pop(storage, None)
                self.written.discard(storage)
            return
        if op.seq in self.needed:
            self.jumped.settle()
            for storage in op.overwritten:
                self._buffer(storage, fresh=True, whole=_spans(op, storage, self.nbytes[storage]))
            # Run twice where unwritten memory flows in (module docstring of `unset`): the same draws, each on its fill.
            dual = bool(op.read_storages & self.second.keys())
            if dual:
                for storage in op.written_storages - self.second.keys():
                    self.second[storage] = self.buffers[storage].clone()
            state = torch.get_rng_state()
            self._run_on(op, self.buffers)
            after = torch.get_rng_state()
            if dual:
                torch.set_rng_state(state)
                self._run_on(op, {**self.buffers, **self.second}, into=self.second)
                torch.set_rng_state(after)
            else:
                for storage in op.overwritten:
                    self.second.pop(storage, None)
            if op.random and not draws_elsewhere(op):
                self.first_draw = self.first_draw or (op.seq, state)
                self.last_draw = (op.seq, after)
            if allocates_unwritten(op.func):
                for ref in filter(None, op.outputs):
                    self.second[ref.storage] = fill_twice(self.buffers[ref.storage])
            self.written |= op.written_storages
        elif op.random and self.draws(op):
            self._draw_only(op)
        else:
            return
        for storage in self.closes.get(op.seq, []):
            buffer = self.buffers.pop(storage)
            second = self.second.pop(storage, None)
            if second is not None and not torch.equal(buffer, second):
                self.unwritten.add(storage)
            kept = storage in self.written and storage in self.write_back and self.write_back[storage](buffer)
            if not kept:
                self.recycle(buffer)

    def _draw_only(self, op: Op) -> None:
        """Move the stream past ``op``'s draw, whose values nothing keeps: jumped over where its count is known
        (:mod:`~lightning_shard.init.draw_counts`), else drawn into scratch (what it reads is real)."""
        if draws_elsewhere(op):
            return  # from a copy of its own generator, thrown away: nothing changes
        self.jumped.past(op, lambda: self._draw_into_scratch(op))

    def _draw_into_scratch(self, op: Op) -> None:
        writes = op.written_storages
        args, kwargs = tree_map(lambda value: self._real(value, scratch=writes), (op.args, op.kwargs))
        op.func(*args, **kwargs)

    def _run_on(self, op: Op, buffers: dict[int, torch.Tensor], into: dict[int, torch.Tensor] | None = None) -> None:
        """Run ``op`` on the storages' ``buffers`` (the first fill's, or the second's where they differ); its new
        tensors go ``into`` those (default: the first fill's)."""
        args, kwargs = tree_map(lambda value: self._real(value, buffers=buffers), (op.args, op.kwargs))
        result = op.func(*args, **kwargs)
        for leaf, ref in zip(tree_leaves(result), op.outputs, strict=False):
            if ref is not None:
                target = (into if into is not None else self.buffers).setdefault(
                    ref.storage, self.buffers[ref.storage].clone()
                )
                strided(target, ref).copy_(leaf)

    def _buffer(self, storage: int, fresh: bool, whole: bool = False) -> torch.Tensor:
        """``storage``'s buffer, new ones holding the sentinel; ``whole``: the op about to run sets every byte of it,
        so no sentinel is written first."""
        buffer = self.buffers.get(storage)
        if buffer is None:
            nbytes = self.nbytes[storage]
            spare = self.spare.get(nbytes)
            if spare:
                self.spare_bytes -= nbytes
                buffer = spare.pop() if whole else fill_unset(spare.pop().view(self.dtypes[storage])).view(torch.uint8)
            elif whole:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=_CPU)
            else:
                buffer = empty_bytes(nbytes, self.dtypes[storage])
            if not fresh and storage in self.external:
                self.external[storage](buffer)
            self.buffers[storage] = buffer
        return buffer

    def recycle(self, buffer: torch.Tensor) -> None:
        """Keep a finished buffer for a later storage of its size (a model repeats its blocks' shapes): its memory is
        already mapped, where a new one is faulted in page by page; at most :data:`SPARE_BYTES` are kept."""
        if self.spare_bytes + buffer.numel() <= SPARE_BYTES:
            self.spare.setdefault(buffer.numel(), []).append(buffer)
            self.spare_bytes += buffer.numel()

    def _real(
        self,
        value: Any,
        scratch: set[int] = frozenset(),  # type: ignore[assignment]
        buffers: dict[int, torch.Tensor] | None = None,
    ) -> Any:
        """A recorded argument's value for running the op: a view of its storage's buffer (in ``buffers`` where given,
        or of ``scratch``, for those storages), a real tensor's value, the CPU for the meta device."""
        if isinstance(value, TensorRef):
            if value.storage in scratch:
                return strided(torch.empty(value.nbytes, dtype=torch.uint8), value)
            if buffers is not None and value.storage in buffers:
                return strided(buffers[value.storage], value)
            return strided(self._buffer(value.storage, fresh=False), value)
        if isinstance(value, Scratch):
            return strided(torch.empty(value.layout.nbytes, dtype=torch.uint8), value.layout)
        if isinstance(value, RealValue):
            return _real_value(value)
        if isinstance(value, GeneratorAt):
            return value.copy()
        if isinstance(value, torch.device) and value.type == "meta":
            return _CPU
        return value


def _spans(op: Op, storage: int, nbytes: int) -> bool:
    """Whether ``op``, which sets ``storage`` whole, sees it at its full size ``nbytes`` (not before a resize)."""
    return any(ref.storage == storage and ref.nbytes == nbytes for ref in op.refs())


def _real_value(value: RealValue) -> torch.Tensor:
    if value.changed():
        raise RuntimeError(
            f"A real tensor of shape {tuple(value.tensor.shape)} that the model's construction read on the meta "
            "device was changed in place afterwards (also through `.data`), so its construction cannot be redone as it "
            "ran. Build the model "
            "in `__init__`, or leave the tensor unchanged until the model is set up."
        )
    return value.tensor.to(_CPU)


def write_shards(full: torch.Tensor, live: torch.Tensor) -> None:
    """Store the full-size ``full`` into ``live``: each rank its shard of a DTensor, the whole of a plain tensor.

    Example:
        >>> live = torch.zeros(2)
        >>> write_shards(torch.ones(2), live); live
        tensor([1., 1.])
    """
    full = full.to(live.dtype)
    if isinstance(live, DTensor) and not holds_values(live.to_local()):
        # the memory simulation's fake tensors: no values, and no concrete offsets to slice the host tensor at
        live.to_local().copy_(distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None).to_local())
    elif isinstance(live, DTensor):
        live.to_local().copy_(host_shard(full, live))  # only the shard crosses to the device (shard_init)
    else:
        live.copy_(full)
