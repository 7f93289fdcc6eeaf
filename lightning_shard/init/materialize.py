"""Materialising a sharded model that was created on the meta device.

The initialisation rule (README, "Creating the model"): a model created on the meta device is sharded first, then its
tensors are initialised as its construction initialised them, in the order an eager build on one process runs, from
rank 0's random stream, on the CPU (the eager build's generator), on full-size tensors of a few tensors at a time;
every rank keeps only its shards. So for the same seed the weights equal the eager build at any world size and on any
device, and the whole model never exists on a rank. Who initialises what:

1. A library that initialises its own models (transformers: :mod:`lightning_shard.hf.init` registers it with
   :func:`register_library`) claims the models built by its constructors, as they were built - a wrapper's own
   modules inside them (peft's LoRA adapters) are not theirs - and initialises them where their constructors ended.
2. Every other tensor built under a recording gets what its construction did to it
   (:mod:`lightning_shard.init.construction`), replayed exactly (:mod:`lightning_shard.init.replay`): every op,
   including those
   computing a tensor from others (a rotary table from ``arange``, layer scale ``init_values * torch.ones(dim)``, a
   cast, a deep copy), and the random generator's seeds and restores.
3. A module built on the meta device outside any recording (``nn.Linear(..., device="meta")``, your own
   ``torch.device("meta")`` block) runs its ``reset_parameters()`` first, in ``model.modules()`` order; without one it
   is an error naming it. Tensors built for real keep their values (rank 0's).

Then the safety net that does not rest on the recorder (:mod:`lightning_shard.init.unset`): every tensor allocated here
starts as a sentinel, and one that nothing wrote is an error naming it - never uninitialised memory.

DTensor's own random ops cannot give this: on the CPU each rank would draw its shard from its local generator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_shard.init.construction import (
    ConstructionLog,
    HolderKey,
    Op,
    TensorRef,
    construction_logs,
    forget_construction,
)
from lightning_shard.init.init_skip import defer_check, loaded_keys, restricted_needs
from lightning_shard.init.meta_window import end_meta_window, meta_window
from lightning_shard.init.replay import (
    Overwrite,
    Replay,
    callers_random_state_kept,
    rng_timeline,
    strided,
    write_shards,
)
from lightning_shard.init.skipped_draws import SKIPPED
from lightning_shard.init.ties import find_ties, retie
from lightning_shard.init.unset import fill_unset, holds_unset, uninitialized_memory_filled
from lightning_shard.torch_compat.dispatch import holds_values
from lightning_shard.torch_compat.fsdp import reregister_sharded_parameters
from lightning_shard.torch_compat.modules import visible_name
from lightning_shard.torch_compat.tensors import storage_key

_CPU = torch.device("cpu")


@dataclass(eq=False)
class LibraryStep:
    """One initialisation a library runs on its model.

    Attributes:
        position: where an eager build ran it, in the construction log (``math.inf``: not built under a recording).
        run: the initialisation, on every rank, given the materialiser's :class:`FullSizeParameters`.
        sets: the tensors it sets whole (:data:`~lightning_shard.init.construction.HolderKey`\\ s); the model's other
            tensors keep what their construction gave them.
    """

    position: float
    run: Callable[[FullSizeParameters], None]
    sets: set[HolderKey]


@dataclass(eq=False)
class LibraryModel:
    """A model that a library initialises itself, as :meth:`Library.claim` describes it to the materialiser.

    Attributes:
        module: the model (its place in ``modules()`` orders it when it was not built under a recording).
        tensors: the model's tensors (:data:`~lightning_shard.init.construction.HolderKey`\\ s): held outside it, they
        are
            refused.
        constructions: ids of the modules whose constructors' random draws are the library's to account for.
        replays_draws: whether those draws advance the stream, as in an eager build (not for a model whose weights are
            loaded from files: ``from_pretrained`` builds without drawing).
        steps: what the library runs, where, and what it sets.
    """

    module: nn.Module
    tensors: set[HolderKey]
    constructions: set[int]
    replays_draws: bool
    steps: list[LibraryStep] = field(default_factory=list)


class Library(Protocol):
    """A library that initialises its own models on the meta device (see :func:`register_library`)."""

    def construction_context(self) -> AbstractContextManager[None]:
        """Entered around every meta-device construction (e.g. to explain an error of the library's)."""

    def claim(self, root: nn.Module, logs: list[ConstructionLog]) -> list[LibraryModel]:
        """The models in ``root`` that are the library's."""


_LIBRARIES: list[Library] = []


def register_library(library: Library) -> None:
    """Ask ``library`` first which modules are its own (see module docstring); ``lightning_shard.hf`` registers
    transformers'.

    Example:
        >>> register_library(my_library)  # doctest: +SKIP
    """
    if library not in _LIBRARIES:
        _LIBRARIES.append(library)


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device.

    Example:
        >>> has_meta_tensors(nn.Linear(2, 2, device="meta"))
        True
    """
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


@contextmanager
def meta_construction() -> Iterator[None]:
    """Create modules on the meta device, to be materialised after sharding by :func:`materialize_sharded_module`.

    Records what construction does to each tensor (:mod:`lightning_shard.init.construction`), so that materialisation
    can
    match an eager build, inside each registered library's construction context.

    Example:
        >>> with meta_construction():
        ...     layer = nn.Linear(2, 2)
        >>> layer.weight.is_meta
        True
    """
    contexts = [library.construction_context() for library in _LIBRARIES]
    with meta_window(*contexts, torch.device("meta")):
        yield


def materialize_sharded_module(
    root: nn.Module, device: torch.device, buffer_device: torch.device | None = None
) -> None:
    """Allocate ``root``'s meta tensors on ``device`` (buffers on ``buffer_device``, default ``device``) and initialise
    them by the rule in the module docstring; tensors that are not on the meta device keep their values. Under CPU
    offload the parameter shards belong in CPU memory and the buffers on the compute device
    (:func:`~lightning_shard.devices.materialization_devices`). Call on every rank.

    Raises:
        TypeError: naming the tensors that nothing can initialise as an eager build does - before anything is
            allocated.
        RuntimeError: naming the tensors that nothing wrote (a sentinel left in them), after the replay.

    Example:
        >>> model = nn.Linear(2, 2, device="meta")
        >>> materialize_sharded_module(model, torch.device("cpu"))
        >>> model.weight.is_meta
        False
    """
    end_meta_window()
    if not has_meta_tensors(root):
        return
    logs = construction_logs(root)
    libraries = [model for library in _LIBRARIES for model in library.claim(root, logs)]
    plan = _InitPlan(root, logs, libraries)
    ties = find_ties(root)
    allocated = _allocate_meta_tensors(root, device, buffer_device or device)
    retie(root, ties)  # a plain parameter reallocated module by module is a new object in each holder
    for module in root.modules():
        if isinstance(module, FSDPModule):
            reregister_sharded_parameters(module)
    # The caller's stream as the eager build leaves it, now (not when a deferred replay runs: draws made after setup
    # must see it), also when a load makes the replay unnecessary.
    SKIPPED.pay(skip=plan.undrawn())
    # A checkpoint load follows (the Trainer's restore): what it writes is not replayed.
    _initialize(root, plan, logs, allocated, loaded_keys(root))


def _initialize(
    root: nn.Module,
    plan: _InitPlan,
    logs: list[ConstructionLog],
    allocated: list[tuple[str, nn.Module, str, str]],
    loaded: set[HolderKey],
) -> None:
    """Replay what the tensors not ``loaded`` need, check them, and leave the check of the others to the load."""
    unloaded = [entry for entry in allocated if (id(entry[1]), entry[2], entry[3]) not in loaded]
    plan.leave_to_load(loaded)
    with torch.no_grad(), callers_random_state_kept(), uninitialized_memory_filled():
        plan.run(rng_timeline(logs))
    left_to_load = [entry for entry in allocated if (id(entry[1]), entry[2], entry[3]) in loaded]
    _refuse_unwritten(unloaded, plan.replayed)
    if left_to_load:
        defer_check(root, partial(_refuse_unwritten, left_to_load, {}, by_load=True))
    forget_construction(root)


def _allocate_meta_tensors(
    root: nn.Module, device: torch.device, buffer_device: torch.device
) -> list[tuple[str, nn.Module, str, str]]:
    """Give each meta parameter (on ``device``) and buffer (on ``buffer_device``) memory holding the sentinel; return
    ``(name, module, table, name in module)`` of each. Per module, not ``root.to_empty()``: tensors built for real (a
    head built in ``__init__``, torchmetrics states) keep their values."""
    allocated = []
    for prefix, module in root.named_modules():
        meta = [(table, name) for (_, table, name), tensor in _holders(module) if tensor.is_meta]
        if meta:
            params = {id(p) for p in module._parameters.values() if p is not None}
            module._apply(partial(_allocate, params=params, device=device, buffer_device=buffer_device), recurse=False)
            allocated += [(_joined(prefix, name), module, table, name) for table, name in meta]
    return allocated


def _allocate(
    tensor: torch.Tensor, params: set[int], device: torch.device, buffer_device: torch.device
) -> torch.Tensor:
    if not tensor.is_meta:
        return tensor
    new = torch.empty_like(tensor, device=device if id(tensor) in params else buffer_device)
    fill_unset(_local(new))
    return new


def _joined(prefix: str, name: str) -> str:
    return visible_name(".".join(filter(None, [prefix, name])))


def _refuse_unwritten(
    allocated: list[tuple[str, nn.Module, str, str]], replayed: dict[int, bool], by_load: bool = False
) -> None:
    """The safety net (:mod:`lightning_shard.init.unset`): a tensor the replay found depending on unwritten memory
    (``replayed``: id of each live tensor it wrote -> whether every element was written), or one that something else
    initialised and that still holds the sentinel, was written by nothing. Every rank checks its shards, then all raise
    the same error. Fake tensors (the memory simulation) have no values to check."""
    live = [(name, module.__dict__[table][key]) for name, module, table, key in allocated]
    tensors = [(name, _local(tensor), replayed.get(id(tensor))) for name, tensor in live]
    if not any(holds_values(tensor) for _, tensor, _ in tensors):
        return
    unset = [name for name, tensor, full in tensors if full is False or (full is None and holds_unset(tensor))]
    if _distributed_is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, unset)
        unset = [name for name, _, _ in tensors if any(name in names for names in gathered)]
    if unset and by_load:
        raise RuntimeError(
            f"The checkpoint loaded after setup holds {_shown(unset)}, so materialisation left them to it, but the "
            "load did not write them: they would hold uninitialised memory. Check that the checkpoint's tensors load "
            "into this model (names, `strict_loading`), or load it after `fit` has set the model up."
        )
    if unset:
        raise RuntimeError(
            f"The model was built on the meta device, but nothing its construction did wrote {_shown(unset)}, so they "
            "would hold uninitialised memory (an eager build leaves them so too: `torch.empty`, never written). "
            "Initialise them in their module's constructor (`nn.init.*`, or call `self.reset_parameters()` there), "
            "or build the model in `__init__`."
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shown(names: list[str]) -> str:
    return str(names[:8])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > 8 else "]")


def _holders(module: nn.Module) -> Iterator[tuple[HolderKey, torch.Tensor]]:
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


class _InitPlan:
    """Who initialises each meta tensor of ``root``, and in which order (module docstring); decided before anything
    is allocated, so that a model that cannot be initialised fails before it takes memory."""

    def __init__(self, root: nn.Module, logs: list[ConstructionLog], libraries: list[LibraryModel]) -> None:
        self.modules = {id(m): m for m in root.modules()}
        self.order = {id(m): index for index, m in enumerate(root.modules())}
        self.names = {id(m): name for name, m in root.named_modules()}
        self.held = {key: ref for log in logs for key, ref in log.held.items()}
        self.swap = FullSizeParameters()
        self.replayed: dict[int, bool] = {}  # id of each live tensor the replay wrote -> every element written
        library_of = {mid: library for library in libraries for mid in library.constructions}
        recorded = [op for log in logs for op in log.ops]
        self.library_op = {
            op.seq: library
            for op in recorded
            if (library := next((library_of[id(m)] for m in op.constructing if id(m) in library_of), None))
        }
        # A library's tensor holds its value at the library's init in the storage it was registered with too, which a
        # later `.data` swap replaced (peft's PiSSA computes the adapters from it, then replaces the base weight).
        registered = {
            (id(r.parent), r.table, r.name): r.ref for log in logs for r in log.registrations if r.ref is not None
        }
        # storage -> (a tensor holding its value, its view there): what is read from the live tensors
        holder: dict[int, tuple[HolderKey, TensorRef]] = {}
        inits = [
            self._library_init(library, step, registered, holder) for library in libraries for step in library.steps
        ]
        self.ops: list[Op | Overwrite] = sorted([*recorded, *inits], key=lambda op: op.seq)
        produced = {storage for op in self.ops for storage in op.written_storages}
        meta = [(module, key, t) for module in self.modules.values() for key, t in _holders(module) if t.is_meta]
        library_tensors = {key for library in libraries for key in library.tensors}
        library_storages = {self.held[key].storage for key in library_tensors & self.held.keys()}
        self._refuse_library_tensors_held_elsewhere(meta, library_tensors, library_storages)
        # every meta tensor: replayed (up to a library's init that sets it), or its module's reset_parameters()
        self.keys_by_storage: dict[int, list[HolderKey]] = {}
        unlogged: dict[int, list[HolderKey]] = {}
        for module, key, _ in meta:
            if key in self.held and self.held[key].storage in produced:
                self.keys_by_storage.setdefault(self.held[key].storage, []).append(key)
            else:
                unlogged.setdefault(id(module), []).append(key)
        self.unlogged = unlogged
        self.fallback = self._fallback_modules(unlogged)
        for key in itertools.chain(*unlogged.values()):
            if key in self.held:
                holder.setdefault(self.held[key].storage, (key, self.held[key]))
        self.leave_to_load(set())
        self.external = holder
        self._refuse_unknown_sources(self.scope.before - holder.keys())

    def leave_to_load(self, loaded: set[HolderKey]) -> None:
        """Replay only what the tensors not ``loaded`` need: a storage that the load writes whole (every tensor
        holding it) is no target (:mod:`lightning_shard.init.init_skip`)."""
        targets = {s for s, keys in self.keys_by_storage.items() if not set(keys) <= loaded}
        self.scope, self.draws = restricted_needs(self.ops, targets, self._draws)
        self.needed = self.scope.needed
        if self.scope.stream_until == -math.inf:  # no needed draw: the stream's position does not matter
            self.fallback = [m for m in self.fallback if not set(self.unlogged[id(m)]) <= loaded]

    def _library_init(
        self,
        library: LibraryModel,
        step: LibraryStep,
        registered: dict[HolderKey, TensorRef],
        holder: dict[int, tuple[HolderKey, TensorRef]],
    ) -> Overwrite:
        """``step`` as an op that sets whole the storages its tensors were registered with and are held in."""
        refs = [(key, ref) for key in step.sets for ref in (registered.get(key), self.held.get(key)) if ref is not None]
        for key, ref in refs:
            holder[ref.storage] = (key, ref)
        storages = frozenset(ref.storage for _, ref in refs)
        order = (step.position, self.order.get(id(library.module), 0), len(library.steps))
        return Overwrite(step.position, storages, partial(step.run, self.swap), order)

    def _fallback_modules(self, unlogged: dict[int, list[HolderKey]]) -> list[nn.Module]:
        """Modules holding meta tensors that no recording saw being built: their ``reset_parameters()``."""
        modules = [self.modules[mid] for mid in unlogged]
        missing = [module for module in modules if not callable(getattr(module, "reset_parameters", None))]
        if missing:
            classes = sorted({_class_name(m) for m in missing})
            raise TypeError(
                f"The model was created on the meta device, but these modules hold parameters or buffers and define no "
                f"`reset_parameters()` to initialise them: {classes}. Add a `reset_parameters()` method to them, or "
                "create the model in `__init__` or `configure_model()` (which records how it is built) instead."
            )
        return sorted(modules, key=lambda m: self.order[id(m)])

    def _refuse_unknown_sources(self, unknown: set[int]) -> None:
        """Tensors computed from meta tensors that nothing recorded produced and no module holds: nothing knows their
        values."""
        if not unknown:
            return
        tainted = set(unknown)
        for op in self.ops:
            if op.seq in self.needed and op.read_storages & tainted:
                tainted |= op.written_storages
        names = [self._name(key) for s, keys in self.keys_by_storage.items() if s in tainted for key in keys]
        raise TypeError(
            f"The model was created on the meta device, but {_shown(names)} were computed from meta tensors that "
            "nothing in the recorded construction produced and no module holds (created on the meta device outside "
            "`configure_model()` / `init_module(empty_init=True)`, or a library's tensor that was replaced after "
            "being read), so their values are unknown. Create those tensors inside the recorded construction, or "
            "build the model in `__init__`."
        )

    def _refuse_library_tensors_held_elsewhere(
        self, meta: list[tuple[nn.Module, HolderKey, torch.Tensor]], library_tensors: set[HolderKey], storages: set[int]
    ) -> None:
        library_live = {id(tensor) for _, key, tensor in meta if key in library_tensors}
        strays = [
            f"{_class_name(module)}.{key[2]}"
            for module, key, tensor in meta
            if key not in library_tensors
            and key in self.held
            and self.held[key].storage in storages
            and id(tensor) not in library_live
        ]
        if strays:
            raise TypeError(
                f"{strays} hold tensors that a library's model built (e.g. a transformers model), outside that model: "
                "the library initialises or loads the model's own tensors, not these. Keep the model's modules in it "
                "(share the parameter, as weight tying does), or build the model in `__init__`."
            )

    def _draws(self, op: Op) -> bool:
        """Whether ``op``'s random draws advance the stream: not those made in a library's constructors that an eager
        load does not run (``from_pretrained``)."""
        return self.library_op[op.seq].replays_draws if op.seq in self.library_op else True

    def undrawn(self) -> set[float]:
        """The recorded random ops an eager build does not draw (see :meth:`_draws`)."""
        return {seq for seq, library in self.library_op.items() if not library.replays_draws}

    def _name(self, key: HolderKey) -> str:
        return _joined(self.names.get(key[0], ""), key[2])

    def run(self, rng: list[tuple[float, Callable[[], None]]]) -> None:
        self.replay = replay = Replay(
            self.ops,
            self.needed,
            write_back={s: partial(self._write_back, s) for s in self.keys_by_storage},
            external={s: partial(self._read_external, *holding) for s, holding in self.external.items()},
            draws=self.draws,
            dtypes={s: self.held[keys[0]].dtype for s, keys in self.keys_by_storage.items()},
        )
        items: list[tuple[Any, Any]] = [(_order(op), op) for op in self.ops if self.scope.runs(op)]
        items += [((position, -1, index), action) for index, (position, action) in enumerate(rng)]
        items += [((-math.inf, self.order[id(module)], 0), module) for module in self.fallback]
        for _, item in sorted(items, key=lambda entry: entry[0]):
            if isinstance(item, (Op, Overwrite)):
                replay.run(item)
            elif isinstance(item, nn.Module):
                self.swap.swap_in(item)
                item.reset_parameters()  # type: ignore[operator]
                self.swap.mark_initialized(item)
                self.swap.write_back(item)
            else:
                item()

    def _write_back(self, storage: int, buffer: torch.Tensor) -> None:
        written: set[int] = set()
        for key in self.keys_by_storage[storage]:
            live = held_tensor(self.modules, key)
            self.replayed[id(live)] = storage not in self.replay.unwritten
            if id(live) not in written:
                written.add(id(live))
                write_shards(strided(buffer, self.held[key]), live)
                self.swap.initialized(live)

    def _read_external(self, key: HolderKey, ref: TensorRef, buffer: torch.Tensor) -> None:
        live = held_tensor(self.modules, key)
        full = live.full_tensor() if isinstance(live, DTensor) else live
        strided(buffer, ref).copy_(full.to(ref.dtype))


def _order(op: Op | Overwrite) -> tuple[float, ...]:
    """Where an op runs: program order; library inits at the same place by their models' order."""
    return op.order if isinstance(op, Overwrite) else (op.seq, 0, 0)


def _class_name(module: nn.Module) -> str:
    return type(module).__name__.removeprefix("FSDP" if isinstance(module, FSDPModule) else "")


class FullSizeParameters:
    """Swaps a module's sharded (DTensor) parameters for full-size plain ones on the CPU while its initialisation runs
    (a library's init, a ``reset_parameters()``: they draw from the CPU generator, as in an eager build), then copies
    each rank's shard back. The full-size tensors start as the sentinel (:mod:`lightning_shard.init.unset`). A parameter
    shared with a module initialised earlier (tied weights), or one left on the meta device (not part of the sharded
    model), gets a scratch tensor that is dropped.

    Args:
        keep: parameters to leave in place, not swapped (those already loaded from pretrained files).
        device: where the full-size stand-ins live (``meta``: to find what an init writes, drawing nothing).
        refuse_unset: what should have written every element (e.g. "its model's initialisation (Hugging Face
            `_init_weights`)"): :meth:`write_back` then raises, naming the parameter and this, if an init left a
            sentinel. ``None``: the sentinel is written back, for the check after materialisation.

    Example:
        >>> swap = FullSizeParameters()
        >>> layer = nn.Linear(2, 2)
        >>> swap.swap_in(layer); layer.reset_parameters(); swap.mark_initialized(layer); swap.write_back(layer)
    """

    def __init__(
        self,
        keep: Callable[[nn.Parameter], bool] = lambda p: False,
        refuse_unset: str | None = None,
        device: torch.device = _CPU,
    ) -> None:
        self.keep = keep
        self.refuse_unset = refuse_unset
        self.device = device
        # on the meta device: the storage of each full-size stand-in -> the parameter it stands in for (the stand-ins
        # kept, so that no later one takes a storage's address)
        self.stand_ins: dict[int, tuple[HolderKey, torch.Tensor]] = {}
        self._initialized: set[int] = set()
        # places whose parameter the eager build replaced after the running init (a later tie): it writes scratch
        self.replaced_later: set[HolderKey] = set()
        # module id -> {name: (the module's own parameter, whether its full-size stand-in is scratch)}
        self._pending: dict[int, dict[str, tuple[nn.Parameter, bool]]] = {}

    def with_policy(self, keep: Callable[[nn.Parameter], bool], refuse_unset: str | None) -> FullSizeParameters:
        """The same record of initialised parameters under another ``keep`` / ``refuse_unset`` policy."""
        other = FullSizeParameters(keep, refuse_unset, self.device)
        other._initialized = self._initialized
        return other

    def initialized(self, param: torch.Tensor) -> None:
        """Note that ``param`` was initialised elsewhere: modules sharing it get scratch tensors."""
        self._initialized.add(id(param))

    def swap_in(self, module: nn.Module) -> None:
        if id(module) in self._pending:
            return
        swapped = {}
        for name, param in module.named_parameters(recurse=False):
            replaced = (id(module), "_parameters", name) in self.replaced_later
            scratch = id(param) in self._initialized or param.is_meta or replaced
            if not (isinstance(param, DTensor) or scratch) or self.keep(param):
                continue
            full = torch.empty(param.shape, dtype=param.dtype, device=self.device)
            if not full.is_meta:
                fill_unset(full)
            module.register_parameter(name, nn.Parameter(full, requires_grad=param.requires_grad))
            if full.is_meta:
                self.stand_ins[storage_key(full)] = ((id(module), "_parameters", name), full)
            swapped[name] = (param, scratch)
        self._pending[id(module)] = swapped

    def mark_initialized(self, module: nn.Module) -> None:
        """Call once ``module``'s init has run: later modules sharing its parameters get scratch tensors."""
        swapped = self._pending.get(id(module), {})
        self._initialized.update(
            id(swapped[name][0] if name in swapped else param)
            for name, param in module.named_parameters(recurse=False)
            if (id(module), "_parameters", name) not in self.replaced_later
        )

    def write_back(self, module: nn.Module) -> None:
        """Copy each rank's shard of ``module``'s full-size parameters into its DTensors and put them back."""
        swapped = self._pending.pop(id(module), None)
        if swapped is None:
            return
        try:
            with torch.no_grad():
                for name, (param, scratch) in swapped.items():
                    full = getattr(module, name)
                    if scratch or not isinstance(param, DTensor) or full.is_meta:
                        continue
                    if self.refuse_unset is not None and holds_unset(full):
                        raise RuntimeError(
                            f"`{_class_name(module)}.{name}` was left uninitialised: {self.refuse_unset} does not "
                            "cover it. Build the model in `__init__` instead of on the meta device, or load it with "
                            "`lightning_shard.hf.from_pretrained`."
                        )
                    write_shards(full.detach(), param)
        finally:
            for name, (param, _) in swapped.items():
                module.register_parameter(name, param)
