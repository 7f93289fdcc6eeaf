"""What building a model on the meta device did, recorded so that materialisation can do it again exactly.

On the meta device nothing has values, so the code that initialises a model (``reset_parameters()``, ``nn.init.*``,
``torch.ones``, a rotary table computed from ``arange``, a cast, a deep copy, a library's own init such as peft's LoRA)
computes nothing. :func:`record_construction` notes, in program order:

* every ATen op that creates, reads or writes a meta tensor (at the dispatch level, whatever Python name called it),
  with each meta tensor as the op saw it (:class:`TensorRef`: its storage and its view of it at that moment, so that a
  later ``.data`` swap, as ``Module.to()`` makes, does not change what the op read), and every random op on real
  tensors (it advances the random stream of an eager build);
* the calls of the ``torch.nn.init`` functions that do nothing to a meta tensor (``trunc_normal_``, ``orthogonal_``,
  ``sparse_``, ``dirac_``: their draws depend on values), however they were imported, as one op each;
* the random generator's state changes that are not tensor ops (:class:`RngEvent`): ``manual_seed``, ``seed``,
  ``set_rng_state`` and ``fork_rng`` by any name, found by comparing the generator's state before each op;
* each registration of a submodule, parameter or buffer, with the modules whose constructors were running.

:mod:`lightning_shard.init.replay` replays the ops on real tensors after sharding, in the same order and from the same
random
stream, so the weights equal an eager build whatever code initialised them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode

from lightning_shard.init.recorded_inputs import GeneratorAt, RealValue
from lightning_shard.init.skipped_draws import SKIPPED, generator_of
from lightning_shard.torch_compat.dispatch import (
    TorchDispatchMode,
    draws_random_numbers,
    op_arguments,
    op_base_name,
    remove_mode,
    tree_leaves,
    tree_map,
)
from lightning_shard.torch_compat.tensors import storage_key

# Set on every module seen while a log was recorded: the log.
_LOG = "_lightning_shard_construction_log"
# One order for every log: a model built in two recorded steps replays them in program order.
_SEQUENCE = itertools.count()
# `table name of a module -> the kind of what it holds`
TABLES = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}
ABSENT = object()  # what a registration replaced when nothing was registered under that name before

# A module's tensor, named by where it is held: (id(module), "_parameters" | "_buffers", name).
HolderKey = tuple[int, str, str]

# In-place ops that set every element of the tensor they write without reading it (by their overload packet's name:
# `aten::fill_` for `aten::fill_.Scalar`). Knowing them only saves memory: the value before is not kept for them.
OVERWRITES = frozenset(
    {
        "aten::uniform_",
        "aten::normal_",
        "aten::fill_",
        "aten::zero_",
        "aten::random_",
        "aten::exponential_",
        "aten::geometric_",
        "aten::cauchy_",
        "aten::log_normal_",
        "aten::bernoulli_",
        "aten::copy_",
    }
)
# torch.nn.init functions that return at once on a meta tensor: recorded as one op each, replayed whole.
WHOLE_INIT_FUNCTIONS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@dataclass(frozen=True)
class TensorRef:
    """A meta tensor as an op saw it: its storage and its view of that storage at that moment.

    Example:
        >>> weight = torch.empty(2, 3, device="meta")
        >>> TensorRef.of(weight.t()).stride
        (1, 3)
    """

    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int  # the storage's size at that moment

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorRef:
        return cls(
            storage_key(tensor),
            tuple(tensor.size()),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.dtype,
            tensor.untyped_storage().nbytes(),
        )

    @property
    def whole(self) -> bool:
        """Whether the view spans its whole storage, contiguously (row-major)."""
        numel, expected = 1, 1
        for size, stride in reversed(list(zip(self.size, self.stride, strict=True))):
            if size != 1 and stride != expected:
                return False
            expected *= size
            numel *= size
        return self.offset == 0 and numel * self.dtype.itemsize == self.nbytes


@dataclass(eq=False)
class Op:
    """One recorded op: an ATen op, or a Python function called whole (:data:`WHOLE_INIT_FUNCTIONS`).

    Attributes:
        args, kwargs: as called, meta tensors replaced by :class:`TensorRef`\\ s and real tensors by
            :class:`RealValue`\\ s.
        outputs: the op's flattened result, a :class:`TensorRef` for each new meta tensor it returned, else ``None``.
        writes: the meta tensors it wrote in place.
        reads: the meta tensors it read as inputs; ``updates``: those it wrote in place without setting every element
            (their other elements, or their values, carry over).
        overwritten: storages it set whole without reading them (its outputs' included).
        random: it draws from the random stream; ``real_draw``: on real tensors only (replayed into scratch).
        constructing: the modules whose ``__init__`` was running, outermost first.
    """

    seq: int
    func: Callable[..., Any]
    args: tuple
    kwargs: dict
    outputs: list[TensorRef | None]
    writes: tuple[TensorRef, ...]
    reads: tuple[TensorRef, ...]
    updates: tuple[TensorRef, ...]
    overwritten: frozenset[int]
    random: bool
    real_draw: bool
    constructing: tuple[nn.Module, ...]

    @property
    def written_storages(self) -> set[int]:
        return {ref.storage for ref in itertools.chain(self.writes, filter(None, self.outputs))}

    @property
    def read_storages(self) -> set[int]:
        """The storages whose values before the op its results depend on."""
        return {ref.storage for ref in itertools.chain(self.reads, self.updates)}

    @property
    def input_storages(self) -> set[int]:
        """The storages it reads as inputs (what a draw into scratch still needs: ``bernoulli``'s probabilities)."""
        return {ref.storage for ref in self.reads}

    def refs(self) -> Iterator[TensorRef]:
        """Every meta tensor the op touched."""
        yield from self.writes
        yield from self.reads
        yield from self.updates
        yield from filter(None, self.outputs)
        found: list[TensorRef] = []
        tree_map(lambda value: found.append(value) if isinstance(value, TensorRef) else None, (self.args, self.kwargs))
        yield from found


@dataclass(eq=False)
class RngEvent:
    """A change of the CPU generator's state that is no tensor op: ``"set"`` it to ``value`` (a state, taken right
    after ``manual_seed``, ``seed()`` or ``set_rng_state`` of a state not taken while recording), ``"save"`` it as slot
    ``value`` (``get_rng_state()``), or ``"restore"`` slot ``value`` (``set_rng_state`` of that state: ``fork_rng``)."""

    seq: int
    action: Literal["set", "save", "restore"]
    value: Any


@dataclass(eq=False)
class Registration:
    """``parent.<name> = new`` (a submodule, parameter or buffer), replacing ``old`` (:data:`ABSENT`: nothing);
    ``ref``: a meta tensor's storage and view at that moment (a later ``.data`` swap replaces the storage)."""

    seq: int
    parent: nn.Module
    table: str
    name: str
    old: Any
    new: Any
    constructing: tuple[nn.Module, ...]
    ref: TensorRef | None = None


@dataclass(eq=False)
class ConstructionLog:
    """Everything :func:`record_construction` noted, and at its end the storage each meta tensor was held in.

    Example:
        >>> with torch.device("meta"), record_construction() as log:
        ...     layer = nn.Linear(2, 2)
        >>> [op.func.__name__ for op in log.ops]
        ['empty.memory_format', 'uniform_.default', 'empty.memory_format', 'uniform_.default']
    """

    ops: list[Op] = field(default_factory=list)
    rng_events: list[RngEvent] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)
    # HolderKey -> the meta tensor held there when construction ended, as a TensorRef.
    held: dict[HolderKey, TensorRef] = field(default_factory=dict)
    modules: dict[int, nn.Module] = field(default_factory=dict)  # every module seen, by id (kept alive)
    # HolderKey -> (id, version) of the meta tensor held there when the recording ended: changed after it (by code
    # run once another model was started on the meta device), it is refused before sharding, never dropped.
    versions: dict[HolderKey, tuple[int, int]] = field(default_factory=dict)
    # Storage key -> the meta storage: kept alive, so that no other storage takes its address (its key) while the log
    # lives.
    storages: dict[int, Any] = field(default_factory=dict)
    rng_start: torch.Tensor | None = None  # the CPU generator's state when recording started and ended
    rng_end: torch.Tensor | None = None

    def constructor_ends(self) -> dict[int, float]:
        """``id(module) -> position just after the last op or registration made while its __init__ ran``: where an
        eager build finished constructing it."""
        ends: dict[int, float] = {}
        for entry in itertools.chain(self.ops, self.registrations):
            for module in entry.constructing:
                ends[id(module)] = max(ends.get(id(module), -1.0), entry.seq + 0.5)
        return ends


def covers_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` spans its whole storage, contiguously.

    Example:
        >>> weight = torch.empty(2, 2, device="meta")
        >>> covers_storage(weight), covers_storage(weight[1])
        (True, False)
    """
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    )


class Recording:
    """A recording in progress (see module docstring): :meth:`start`, then :meth:`stop` (:func:`record_construction`
    is the scoped form). Between them it can step aside (:meth:`pause`, :meth:`resume`) so that a context entered
    before it (the meta device) can leave first: a model stays recorded after its build until it is set up
    (:mod:`lightning_shard.init.meta_window`).

    Example:
        >>> recording = Recording().start()
        >>> recording.stop().ops
        []
    """

    def __init__(self, owes_draws: bool = True) -> None:
        self.log = ConstructionLog(rng_start=torch.default_generator.get_state())
        self.rng = _GeneratorWatch(self.log)
        self.recorder = _OpRecorder(self.log, self.rng, owes_draws)
        self.calls = _PythonCalls(self.log, self.recorder, self.rng)
        self.factories = _DataFactories(self.log, self.recorder, self.rng)
        self.handles: list[Any] = []
        self.modes: list[Any] = []  # the modes pushed now, innermost last

    def start(self, resume: bool = True) -> Recording:
        self.handles = [
            register_module_module_registration_hook(self._registered("_modules")),
            register_module_parameter_registration_hook(self._registered("_parameters")),
            register_module_buffer_registration_hook(self._registered("_buffers")),
        ]
        self.calls.__enter__()
        return self.resume() if resume else self

    def resume(self, factories: bool = True) -> Recording:
        """Push the op recorder, and the data factories' recorder (needed where the meta device is the default)."""
        for mode in (self.recorder, self.factories) if factories else (self.recorder,):
            mode.__enter__()
            self.modes.append(mode)
        return self

    def pause(self) -> None:
        """Pop the modes :meth:`resume` pushed, wherever they are on the mode stacks."""
        while self.modes:
            remove_mode(self.modes.pop())

    def stop(self) -> ConstructionLog:
        """End the recording; the log notes where each meta tensor is held now."""
        self.pause()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.calls.__exit__()
        self.rng.check()
        self.log.rng_end = torch.default_generator.get_state()
        _note_held(self.log)
        return self.log

    def _registered(self, table: str) -> Callable[[nn.Module, str, Any], None]:
        log = self.log

        def hook(parent: nn.Module, name: str, value: Any) -> None:
            old = parent.__dict__[table].get(name, ABSENT)
            seq = next(_SEQUENCE)
            ref = None
            if isinstance(value, torch.Tensor) and value.is_meta:
                log.storages.setdefault(storage_key(value), value.untyped_storage())
                ref = TensorRef.of(value)
            constructing = _modules_under_construction()
            log.registrations.append(Registration(seq, parent, table, name, old, value, constructing, ref))
            log.modules[id(parent)] = parent
            if isinstance(value, nn.Module):
                log.modules[id(value)] = value

        return hook


@contextmanager
def record_construction() -> Iterator[ConstructionLog]:
    """Record the construction of the modules built inside (see module docstring); each module seen keeps the log.

    Example:
        >>> with torch.device("meta"), record_construction() as log:
        ...     model = nn.Sequential(nn.Linear(2, 2))
        >>> construction_logs(model) == [log]
        True
    """
    recording = Recording().start()
    try:
        yield recording.log
    finally:
        recording.stop()


@contextmanager
def written_storages() -> Iterator[set[int]]:
    """The storages of the meta tensors that the code run inside writes in place (filled in on exit), recorded as a
    construction is, without a log on any module: what an initialisation would set, found on the meta device, where
    it draws nothing.

    Example:
        >>> weight = torch.empty(2, device="meta")
        >>> with written_storages() as written:
        ...     _ = nn.init.ones_(weight)
        >>> written == {storage_key(weight)}
        True
    """
    recording = Recording(owes_draws=False)
    written: set[int] = set()
    try:
        with recording.calls:
            recording.resume()
            try:
                yield written
            finally:
                recording.pause()
    finally:
        written.update(ref.storage for op in recording.log.ops for ref in op.writes)


def _note_held(log: ConstructionLog) -> None:
    """Mark every module in the trees of the modules seen (a deep copy's submodules are never registered one by one)
    that holds meta tensors, or contains one that does, with the log, and note the storage each of their meta tensors
    is held in. A module built for real while the recording ran (a LightningModule, a head) is not marked: its model
    is not this log's to replay."""
    with_meta: dict[int, bool] = {}

    def holds_meta(module: nn.Module) -> bool:
        if id(module) not in with_meta:
            own = any(
                t.is_meta
                for t in itertools.chain(module._parameters.values(), module._buffers.values())
                if t is not None
            )
            with_meta[id(module)] = own or any(holds_meta(child) for child in module.children())
        return with_meta[id(module)]

    for module in [m for seen in list(log.modules.values()) for m in seen.modules()]:
        log.modules[id(module)] = module
        if not holds_meta(module):
            continue
        module.__dict__[_LOG] = log
        for table in ("_parameters", "_buffers"):
            for name, tensor in module.__dict__[table].items():
                if not isinstance(tensor, torch.Tensor):
                    continue
                if tensor.is_meta:
                    log.storages.setdefault(storage_key(tensor), tensor.untyped_storage())
                    log.held[(id(module), table, name)] = TensorRef.of(tensor)
                    log.versions[(id(module), table, name)] = (id(tensor), tensor._version)


def state_bytes(state: torch.Tensor | None) -> bytes:
    """A generator state's bytes, compared without a tensor op (none may run under the memory simulation's fake mode).

    Example:
        >>> state_bytes(torch.get_rng_state()) == state_bytes(torch.get_rng_state())
        True
    """
    return b"" if state is None else state.numpy().tobytes()


def construction_logs(root: nn.Module) -> list[ConstructionLog]:
    """The logs recorded while ``root``'s modules were built (usually one; none if built outside a recording).

    Example:
        >>> construction_logs(nn.Linear(2, 2))
        []
    """
    logs = {id(log): log for m in root.modules() if (log := m.__dict__.get(_LOG)) is not None}
    return list(logs.values())


def forget_construction(root: nn.Module) -> None:
    """Drop the logs from ``root``'s modules once materialised: they are replayed once.

    Example:
        >>> forget_construction(model); construction_logs(model)  # doctest: +SKIP
        []
    """
    for module in root.modules():
        module.__dict__.pop(_LOG, None)


class _Internal:
    """Marks the recorder's own calls (reading a generator's state), which the profile hook must not take for the
    model code's."""

    active = 0

    def run(self, call: Callable[[], Any]) -> Any:
        self.active += 1
        try:
            return call()
        finally:
            self.active -= 1


_INTERNAL = _Internal()


class _GeneratorWatch:
    """Notices changes of the CPU generator's state between the ops (see :class:`RngEvent`): any change that no
    recorded op or event explains is a seed or a state set by some name, recorded as the state it left."""

    def __init__(self, log: ConstructionLog) -> None:
        self.log = log
        self.last = state_bytes(log.rng_start)
        self.saved: dict[int, tuple[int, torch.Tensor]] = {}  # id(state tensor) -> (slot, the tensor, kept alive)
        self._reading = False  # reading the state runs torch ops, which the recorder sees

    def check(self) -> None:
        if self._reading:
            return
        state, raw = self._state()
        if raw != self.last:
            self.log.rng_events.append(RngEvent(next(_SEQUENCE), "set", state))
            self.last = raw

    def explained(self) -> None:
        """The state changed through something already recorded (a real draw, a restored slot)."""
        self.last = self._state()[1]

    def _state(self) -> tuple[torch.Tensor, bytes]:
        """The state and its bytes. The generator's own method: a call of `torch.get_rng_state` would be seen by the
        profile hook; reading the bytes runs torch ops, which the recorder sees while checks are off."""
        self._reading = True
        try:
            state = torch.default_generator.get_state()
            return state, state_bytes(state)
        finally:
            self._reading = False

    def saved_state(self, state: torch.Tensor) -> None:
        slot = len(self.saved)
        self.saved[id(state)] = (slot, state)
        self.log.rng_events.append(RngEvent(next(_SEQUENCE), "save", slot))

    def restoring(self, state: Any) -> bool:
        """Record ``set_rng_state(state)`` of a state saved while recording; False for any other state."""
        entry = self.saved.get(id(state))
        if entry is None or entry[1] is not state:
            return False
        self.log.rng_events.append(RngEvent(next(_SEQUENCE), "restore", entry[0]))
        return True


class _OpRecorder(TorchDispatchMode):
    def __init__(self, log: ConstructionLog, rng: _GeneratorWatch, owes_draws: bool) -> None:
        super().__init__()
        self.log = log
        self.rng = rng
        self.owes_draws = owes_draws  # its skipped draws are owed to the live generators (SKIPPED)
        self.suspended = 0  # inside a function recorded whole

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        self.rng.check()
        if self.owes_draws and draws_random_numbers(func) and not any(t.is_meta for t in _tensors((args, kwargs))):
            self.settle(generator_of((args, kwargs)))  # a real draw: from where an eager build's stream stands
        out = func(*args, **kwargs)
        op = self._classify(func, args, kwargs, out)
        if op is not None:
            self.log.ops.append(op)
            if op.real_draw:
                self.rng.explained()
            else:
                self.owe(op)
        return out

    def owe(self, op: Op) -> None:
        """Note a draw skipped on the meta device (see :mod:`lightning_shard.init.skipped_draws`)."""
        if self.owes_draws and op.random:
            SKIPPED.add(generator_of((op.args, op.kwargs)), op)

    def settle(self, generator: torch.Generator) -> None:
        """Make up ``generator``'s skipped draws now, unrecorded."""
        if generator.device.type != "cpu" or id(generator) not in SKIPPED.pending:
            return
        self.suspended += 1
        try:
            SKIPPED.pay(generator)
        finally:
            self.suspended -= 1
        self.rng.explained()

    def _classify(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Op | None:
        inputs = _tensors((args, kwargs))
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        random = draws_random_numbers(func)
        real = not any(t.is_meta for t in [*inputs, *results])
        if real and (not random or any(t.device.type != "cpu" for t in [*inputs, *results])):
            # On real tensors only: no value of the model's; but a draw on the CPU advances the eager build's stream.
            return None
        input_storages = {storage_key(t) for t in inputs if t.is_meta}
        outputs = [TensorRef.of(t) if t.is_meta and storage_key(t) not in input_storages else None for t in results]
        writes: list[TensorRef] = []
        reads: list[TensorRef] = []
        updates: list[TensorRef] = []
        written_real: set[int] = set()
        overwritten = {ref.storage for ref in outputs if ref is not None}
        for argument, value in _arguments(func, args, kwargs):
            written = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                if not tensor.is_meta:
                    if written:
                        written_real.add(id(tensor))
                    continue
                self.log.storages.setdefault(storage_key(tensor), tensor.untyped_storage())
                ref = TensorRef.of(tensor)
                if not written:
                    reads.append(ref)
                    continue
                writes.append(ref)
                # An `out=` argument is set without being read; `self` of an in-place op that sets every element
                # (`fill_`, `normal_`, `copy_`) too, when it spans its storage. Anything else updates what it writes.
                if ref.whole and (argument.kwarg_only or op_base_name(func) in OVERWRITES):
                    overwritten.add(ref.storage)
                else:
                    updates.append(ref)
        if not writes and not any(outputs) and not random:
            return None  # a view, or a query (`is_nonzero`, `sym_size`)
        for tensor in results:
            if tensor.is_meta:
                self.log.storages.setdefault(storage_key(tensor), tensor.untyped_storage())
        recorded = partial(_recorded_args, scratch=written_real)
        return _new_op(
            func,
            recorded(args),
            recorded(kwargs),
            outputs,
            tuple(writes),
            tuple(reads),
            tuple(updates),
            frozenset(overwritten),
            random,
            real,
        )


def _new_op(
    func: Any,
    args: tuple,
    kwargs: dict,
    outputs: list[TensorRef | None],
    writes: tuple[TensorRef, ...],
    reads: tuple[TensorRef, ...],
    updates: tuple[TensorRef, ...],
    overwritten: frozenset[int],
    random: bool,
    real_draw: bool,
) -> Op:
    return Op(
        next(_SEQUENCE),
        func,
        args,
        kwargs,
        outputs,
        writes,
        reads,
        updates,
        overwritten,
        random,
        real_draw,
        _modules_under_construction(),
    )


def _arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
    """``(schema argument, value)`` for each argument ``func`` was called with."""
    for position, argument in enumerate(op_arguments(func)):
        if position < len(args):
            yield argument, args[position]
        elif argument.name in kwargs:
            yield argument, kwargs[argument.name]


def _recorded_args(tree: Any, scratch: set[int] = frozenset()) -> Any:  # type: ignore[assignment]
    """An op's arguments as recorded: meta tensors as ``TensorRef``, real tensors it writes (``scratch``, by id: a real
    draw's target) as ``Scratch`` placeholders, other real tensors as ``RealValue``."""

    def recorded(value: Any) -> Any:
        if isinstance(value, torch.Generator):
            return GeneratorAt(value, _INTERNAL.run(value.get_state))
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_meta:
            return TensorRef.of(value)
        return Scratch(TensorRef.of(value)) if id(value) in scratch else RealValue.of(value)

    return tree_map(recorded, tree)


@dataclass(frozen=True)
class Scratch:
    """A real tensor a real draw wrote: replayed into a fresh tensor of its layout (the values are never used)."""

    layout: TensorRef


class _DataFactories(TorchFunctionMode):
    """``torch.tensor(data)`` and its kin copy Python or NumPy data to the meta device below the dispatcher, where no
    op is seen: each call that returns a meta tensor is recorded as one op, replayed by calling it again with a copy of
    the data as it was (``nn.Parameter(torch.tensor(2.6592))``, CLIP's ``logit_scale``)."""

    FUNCTIONS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

    def __init__(self, log: ConstructionLog, recorder: _OpRecorder, rng: _GeneratorWatch) -> None:
        super().__init__()
        self.log, self.recorder, self.rng = log, recorder, rng

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.FUNCTIONS or self.recorder.suspended:
            return func(*args, **kwargs)
        self.rng.check()
        data = _recorded_args(copy.deepcopy(args))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_meta:
            self.log.storages.setdefault(storage_key(out), out.untyped_storage())
            ref = TensorRef.of(out)
            op = _new_op(func, data, _recorded_args(kwargs), [ref], (), (), (), frozenset({ref.storage}), False, False)
            self.log.ops.append(op)
        return out


class _PythonCalls:
    """A profile hook (``sys.setprofile``, chained to any already set) that sees the calls of the functions recorded
    whole and of ``get_rng_state`` / ``set_rng_state`` by their code objects, so that any name bound to them counts
    (``from torch.nn.init import trunc_normal_`` before recording, as timm-style code does)."""

    def __init__(self, log: ConstructionLog, recorder: _OpRecorder, rng: _GeneratorWatch) -> None:
        self.log, self.recorder, self.rng = log, recorder, rng
        self.whole = {
            getattr(torch.nn.init, name).__code__: getattr(torch.nn.init, name) for name in WHOLE_INIT_FUNCTIONS
        }
        self.get_state = torch.random.get_rng_state.__code__
        self.set_state = torch.random.set_rng_state.__code__
        self.open: list[Any] = []  # frames of the calls being recorded whole
        self.stop_at: dict[Any, Callable[[], None]] = {}  # code object -> what to do when it is called
        self.previous: Any = None

    def __enter__(self) -> _PythonCalls:
        self.previous = sys.getprofile()
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self.previous)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.previous is not None:
            self.previous(frame, event, arg)
        if event == "call":
            self._call(frame)
        elif event == "return":
            self._return(frame, arg)
        elif event == "c_call" and isinstance(getattr(arg, "__self__", None), torch.Generator):
            self._generator_call(arg.__self__, arg.__name__)

    def _generator_call(self, generator: torch.Generator, method: str) -> None:
        """A generator's state set (its skipped draws forgiven) or read (they are drawn first), by any caller."""
        if _INTERNAL.active or self.rng._reading:  # the recorder's own reads
            return
        if method in ("manual_seed", "seed", "set_state", "graphsafe_set_state"):
            SKIPPED.forget(generator)
            if generator is torch.default_generator:
                self.rng.last = b""  # a "set" even to the state it holds: the eager stream stood elsewhere
        elif method in ("get_state", "graphsafe_get_state"):
            self.recorder.settle(generator)

    def _call(self, frame: Any) -> None:
        code = frame.f_code
        if code in self.stop_at:
            self.stop_at[code]()
            return
        if self.recorder.suspended:
            return
        if code is self.set_state:
            self.rng.check()
            if not self.rng.restoring(frame.f_locals.get("new_state")):
                return  # a state from elsewhere: the generator watch records the state it leaves
            # what the generator does to the state tensor inside is no construction's (and the state it sets is
            # recorded already)
            self.open.append(frame)
            self.recorder.suspended += 1
        elif code in self.whole:
            tensor = frame.f_locals.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                self._record_whole(self.whole[code], frame, tensor)

    def _record_whole(self, function: Callable[..., Any], frame: Any, tensor: torch.Tensor) -> None:
        self.rng.check()
        parameters = list(_signature(function).parameters)
        kwargs = {name: frame.f_locals[name] for name in parameters[1:] if name in frame.f_locals}
        ref = TensorRef.of(tensor)
        self.log.storages.setdefault(ref.storage, tensor.untyped_storage())
        overwritten = frozenset({ref.storage}) if ref.whole else frozenset()
        updates = () if ref.whole else (ref,)
        random = function.__name__ != "dirac_"
        op = _new_op(function, (ref,), _recorded_args(kwargs), [], (ref,), (), updates, overwritten, random, False)
        self.log.ops.append(op)
        self.recorder.owe(op)
        self.open.append(frame)
        self.recorder.suspended += 1

    def _return(self, frame: Any, value: Any) -> None:
        if self.open and frame is self.open[-1]:
            self.open.pop()
            self.recorder.suspended -= 1
            if frame.f_code is self.set_state:
                self.rng.explained()
        elif frame.f_code is self.get_state and not self.recorder.suspended and isinstance(value, torch.Tensor):
            self.rng.check()
            self.rng.saved_state(value)


@functools.cache
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda value: found.append(value) if isinstance(value, torch.Tensor) else None, tree)
    return found


def _modules_under_construction() -> tuple[nn.Module, ...]:
    """The modules whose ``__init__`` is on the call stack, outermost first."""
    chain: list[nn.Module] = []
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module) and not any(obj is m for m in chain):
                chain.append(obj)
        frame = frame.f_back
    return tuple(reversed(chain))
