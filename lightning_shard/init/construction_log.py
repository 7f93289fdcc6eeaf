"""The construction log: what :mod:`lightning_shard.init.construction` records and every later step reads.

Takes nothing; gives the record's vocabulary and where a model keeps it. A :class:`ConstructionLog` holds, in one
program order (:data:`SEQUENCE`, shared by every log):

* the ops (:class:`Op`), each meta tensor as the op saw it (:class:`TensorRef`: its storage and view at that moment),
  a real draw's target as :class:`Scratch`;
* the random generator's state changes that are no tensor ops (:class:`RngEvent`);
* the registrations of submodules, parameters and buffers (:class:`Registration`);
* at the recording's end, the storage each meta tensor is held in (:func:`note_held`, by
  :data:`HolderKey`), which also sets the log on every module of the model: :func:`construction_logs` finds it there
  for materialisation, :func:`forget_construction` drops it once materialised.

Example:
    >>> log = ConstructionLog()
    >>> layer = nn.Linear(2, 2, device="meta"); log.modules[id(layer)] = layer
    >>> note_held(log); construction_logs(layer) == [log], len(log.held)
    (True, 2)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_shard.torch_compat.dispatch import tree_map
from lightning_shard.torch_compat.tensors import storage_key

# Set on every module seen while a log was recorded: the log.
_LOG = "_lightning_shard_construction_log"
# One order for every log: a model built in two recorded steps replays them in program order.
SEQUENCE = itertools.count()
ABSENT = object()  # what a registration replaced when nothing was registered under that name before

# A module's tensor, named by where it is held: (id(module), "_parameters" | "_buffers", name).
HolderKey = tuple[int, str, str]


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
    """One recorded op: an ATen op, or a Python function called whole
    (:data:`~lightning_shard.init.python_calls.WHOLE_INIT_FUNCTIONS`).

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
    """Everything :func:`~lightning_shard.init.construction.record_construction` noted, and at its end the storage
    each meta tensor was held in.

    Example:
        >>> from lightning_shard.init.construction import record_construction
        >>> with torch.device("meta"), record_construction() as log:
        ...     layer = nn.Linear(2, 2)
        >>> [op.func.__name__ for op in log.ops]
        ['empty.memory_format', 'empty.memory_format', 'uniform_.default', 'uniform_.default']
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


@dataclass(frozen=True)
class Scratch:
    """A real tensor a real draw wrote: replayed into a fresh tensor of its layout (the values are never used)."""

    layout: TensorRef


def note_held(log: ConstructionLog) -> None:
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


def holders(module: nn.Module) -> Iterator[tuple[HolderKey, torch.Tensor]]:
    """``(HolderKey, tensor)`` of each parameter and buffer ``module`` holds itself."""
    for table in ("_parameters", "_buffers"):
        for name, tensor in module.__dict__[table].items():
            if tensor is not None:
                yield (id(module), table, name), tensor


def held_tensor(modules: dict[int, nn.Module], key: HolderKey) -> torch.Tensor:
    """The tensor held at ``key`` now (``modules``: by id).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> held_tensor({id(layer): layer}, (id(layer), "_parameters", "bias")) is layer.bias
        True
    """
    module_id, table, name = key
    return modules[module_id].__dict__[table][name]
