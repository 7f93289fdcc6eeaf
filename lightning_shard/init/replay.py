"""Replaying a recorded construction (:mod:`lightning_shard.init.construction_log`) on real tensors, in program order.

Everything runs on the CPU from the CPU generator, whatever device the model trains on: the random ops of an eager
build on the CPU draw from that generator, and a CUDA generator draws other numbers from the same seed. Each rank
replays from rank 0's stream (the eager build is one process), on full-size tensors, and keeps its shards; the
caller's own random state, per rank, is put back afterwards.

Memory: a storage gets a full-size buffer (its bytes, on the CPU) at the first op the weights depend on that touches it,
and is written back to the live tensors (each rank its shard) and dropped after the last one. Ops the weights do not
depend on (an init that a later one overwrites whole) are skipped, but their random draws still run into scratch
tensors of the same layout, so that the stream advances as in an eager build. So only the tensors under
initialisation at one point of the construction exist whole, even when a constructor re-initialises its children at
its end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_shard.init.construction_log import ConstructionLog, Op, RngEvent, Scratch, TensorRef
from lightning_shard.init.recorded_inputs import GeneratorAt, RealValue
from lightning_shard.init.rng_watch import state_bytes
from lightning_shard.init.shard_init import host_shard
from lightning_shard.init.unset import allocates_unwritten, empty_bytes, fill_twice
from lightning_shard.torch_compat.dispatch import holds_values, tree_leaves, tree_map

_CPU = torch.device("cpu")


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
            (called for the storages that needed ops wrote).
        external: ``storage -> action`` filling a new buffer with the storage's current value, for storages whose
            values come from outside the replay (a library's init, a module's ``reset_parameters()``): called when a
            needed op first reads them.
        draws: whether an op's random draws advance the stream (not for a library's constructors that an eager load
            does not run).
        dtypes: ``storage -> dtype`` of the sentinel its buffer starts with (default: the dtype an op first saw).
    """

    def __init__(
        self,
        ops: list[Op | Overwrite],
        needed: set[float],
        write_back: dict[int, Callable[[torch.Tensor], None]],
        external: dict[int, Callable[[torch.Tensor], None]],
        draws: Callable[[Op], bool],
        dtypes: dict[int, torch.dtype],
    ) -> None:
        self.needed, self.write_back, self.external, self.draws = needed, write_back, external, draws
        self.dtypes = dict(dtypes)
        self.buffers: dict[int, torch.Tensor] = {}
        self.nbytes: dict[int, int] = {}
        self.written: set[int] = set()
        # storage -> its buffer run from the second fill, while unwritten memory may be in it (`unset`)
        self.second: dict[int, torch.Tensor] = {}
        self.unwritten: set[int] = set()  # storages finished with elements that depend on unwritten memory
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
            op.action()
            for storage in op.overwritten:  # what the replay held for them is stale: read again from the live tensors
                self.buffers.pop(storage, None)
                self.written.discard(storage)
            return
        if op.seq in self.needed:
            for storage in op.overwritten:
                self._buffer(storage, fresh=True)
            # Run twice where unwritten memory flows in (module docstring of `unset`): the same draws, each on its fill.
            dual = bool(op.read_storages & self.second.keys())
            if dual:
                for storage in op.written_storages - self.second.keys():
                    self.second[storage] = self.buffers[storage].clone()
            state = torch.get_rng_state()
            self._run_on(op, self.buffers)
            if dual:
                torch_state_after = torch.get_rng_state()
                torch.set_rng_state(state)
                self._run_on(op, {**self.buffers, **self.second}, into=self.second)
                torch.set_rng_state(torch_state_after)
            else:
                for storage in op.overwritten:
                    self.second.pop(storage, None)
            if allocates_unwritten(op.func):
                for ref in filter(None, op.outputs):
                    self.second[ref.storage] = fill_twice(self.buffers[ref.storage])
            self.written |= op.written_storages
        elif op.random and self.draws(op):
            # Only the draw: what it writes goes to scratch, what it reads is real.
            writes = op.written_storages
            args, kwargs = tree_map(lambda value: self._real(value, scratch=writes), (op.args, op.kwargs))
            op.func(*args, **kwargs)
        else:
            return
        for storage in self.closes.get(op.seq, []):
            buffer = self.buffers.pop(storage)
            second = self.second.pop(storage, None)
            if second is not None and not torch.equal(buffer, second):
                self.unwritten.add(storage)
            if storage in self.written and storage in self.write_back:
                self.write_back[storage](buffer)

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

    def _buffer(self, storage: int, fresh: bool) -> torch.Tensor:
        buffer = self.buffers.get(storage)
        if buffer is None:
            buffer = empty_bytes(self.nbytes[storage], self.dtypes[storage])
            if not fresh and storage in self.external:
                self.external[storage](buffer)
            self.buffers[storage] = buffer
        return buffer

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


# ------------------------------------------------------------------------------------------------ the random stream


def rng_timeline(logs: list[ConstructionLog]) -> list[tuple[float, Callable[[], None]]]:
    """``(position, action)`` for each change of the CPU generator's state to replay: rank 0's state where the first
    recording started (before everything; without a recording, rank 0's state now), each recorded event, and the state
    at the start of a later recording when something outside the recordings changed it. Call on every rank: rank 0's
    states are broadcast.

    Example:
        >>> [position for position, _ in rng_timeline([])]
        [-inf]
    """
    logs = sorted(logs, key=_first_seq)
    starts = [log.rng_start for log in logs] if logs else [torch.get_rng_state()]
    states = _from_rank_zero(
        starts
        + [log.rng_end for log in logs]
        + [event.value for log in logs for event in _replayed_events(log) if event.action == "set"]
    )
    timeline: list[tuple[float, Callable[[], None]]] = [(-float("inf"), _set_state(states[0]))]
    ends, sets = states[len(starts) : len(starts) + len(logs)], iter(states[len(starts) + len(logs) :])
    slots: dict[int, torch.Tensor] = {}
    for index, log in enumerate(logs):
        if index and state_bytes(states[index]) != state_bytes(ends[index - 1]):
            timeline.append((_first_seq(log) - 0.5, _set_state(states[index])))
        for event in _replayed_events(log):
            timeline.append((event.seq, _event_action(event, next(sets) if event.action == "set" else None, slots)))
    return timeline


def _replayed_events(log: ConstructionLog) -> list[RngEvent]:
    """``log``'s generator events up to its last recorded op: later ones change no replayed value. The recording lasts
    until setup, so code between the build and setup that only one rank runs (rank 0 writing starting weights under
    ``fork_rng``) adds events on that rank alone."""
    last_op = max((op.seq for op in log.ops), default=-float("inf"))
    return [event for event in log.rng_events if event.seq < last_op]


def _event_action(event: RngEvent, state: torch.Tensor | None, slots: dict[int, torch.Tensor]) -> Callable[[], None]:
    if event.action == "set":
        assert state is not None
        return _set_state(state)
    if event.action == "save":
        return lambda: slots.__setitem__(event.value, torch.get_rng_state())
    return lambda: torch.set_rng_state(slots[event.value])


def _set_state(state: torch.Tensor) -> Callable[[], None]:
    return lambda: torch.set_rng_state(state)


def _first_seq(log: ConstructionLog) -> float:
    return min(
        (entry.seq for entry in itertools.chain(log.ops, log.rng_events, log.registrations)), default=float("inf")
    )


def _from_rank_zero(states: list[Any]) -> list[Any]:
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return states
    received: list[Any] = [states]
    dist.broadcast_object_list(received, src=0)
    if len(received[0]) != len(states):
        raise RuntimeError(
            "The model's construction changed the random generator's state a different number of times on this rank "
            "than on rank 0: the ranks built different models. Build the same model on every rank."
        )
    return received[0]


@contextmanager
def callers_random_state_kept() -> Iterator[None]:
    """Put this rank's own random states (CPU, and CUDA where initialised) back after the replay drew from rank 0's.

    Example:
        >>> with callers_random_state_kept():
        ...     _ = torch.manual_seed(0)
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
