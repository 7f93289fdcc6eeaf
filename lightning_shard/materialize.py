"""Materialising a sharded model that was created on the meta device.

The initialisation rule (README, "Creating the model"): a model created on the meta device is sharded first, then its
tensors are initialised as its construction initialised them, in the order an eager build on one process runs,
from rank 0's random stream, on full-size tensors of a few tensors at a time; every rank keeps only its shards. So
for the same seed the weights equal the eager build at any world size, and the whole model never exists on a rank.
Who initialises what is asked in this order:

1. A library that initialises its own models (transformers: :mod:`lightning_shard.hf.init` registers it with
   :func:`register_library`) claims the models built by its constructors, as they were built - a wrapper's own
   modules inside them (peft's LoRA adapters) are not theirs - and initialises them where their constructors ended.
2. Every other tensor gets what its construction did to it (:mod:`lightning_shard.construction`): the recorded
   ``reset_parameters()``, ``nn.init.*``, factory and copy ops replayed in program order - a module's constructor
   and any later init by an enclosing module or library (peft's ``kaiming_uniform_`` on LoRA A, ``zeros_`` on B).
3. A module whose construction computed a tensor from other tensors (a rotary table) runs its own
   ``reset_parameters()`` where its constructor ended; so does any module built on the meta device outside
   ``configure_model()`` / ``meta_construction()`` (in ``model.modules()`` order). Anything else is an error that
   names the module.

DTensor's own random ops cannot give this: on the CPU each rank would draw its shard from its local generator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_shard.construction import (
    ConstructionLog,
    HolderKey,
    Op,
    construction_logs,
    forget_construction,
    record_construction,
)
from lightning_shard.torch_compat import holds_values, reregister_sharded_parameters, storage_key, tree_map


@dataclass(eq=False)
class LibraryModel:
    """A model that a library initialises itself, as :meth:`Library.claim` describes it to the materialiser.

    Attributes:
        module: the model (its place in ``modules()`` orders it when it was not built under a recording).
        tensors: the tensors the library sets (:data:`~lightning_shard.construction.HolderKey`\\ s).
        constructions: ids of the modules whose constructors' random draws are the library's to account for.
        replays_draws: whether those draws advance the stream, as in an eager build (not for a model whose weights are
            loaded from files: ``from_pretrained`` builds without drawing).
        steps: ``(position in the construction log, action)``: what the library runs and where an eager build ran it
            (``math.inf``: not built under a recording).
    """

    module: nn.Module
    tensors: set[HolderKey]
    constructions: set[int]
    replays_draws: bool
    steps: list[tuple[float, Callable[[FullSizeParameters], None]]] = field(default_factory=list)


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

    Records what construction does to each tensor (:mod:`lightning_shard.construction`), so that materialisation can
    match an eager build, inside each registered library's construction context.

    Example:
        >>> with meta_construction():
        ...     layer = nn.Linear(2, 2)
        >>> layer.weight.is_meta
        True
    """
    with ExitStack() as stack:
        for library in _LIBRARIES:
            stack.enter_context(library.construction_context())
        stack.enter_context(torch.device("meta"))
        stack.enter_context(record_construction())
        yield


def materialize_sharded_module(
    root: nn.Module, device: torch.device, buffer_device: torch.device | None = None
) -> None:
    """Allocate ``root``'s meta tensors on ``device`` (buffers on ``buffer_device``, default ``device``) and initialise
    them by the rule in the module docstring. Under CPU offload the parameter shards belong in CPU memory and the
    buffers on the compute device (:func:`~lightning_shard.devices.materialization_devices`).

    Raises:
        TypeError: naming the modules whose tensors neither a library, nor their recorded construction, nor a
            ``reset_parameters()`` can initialise - before anything is allocated.

    Example:
        >>> model = nn.Linear(2, 2, device="meta")
        >>> materialize_sharded_module(model, torch.device("cpu"))
        >>> model.weight.is_meta
        False
    """
    if not has_meta_tensors(root):
        return
    buffer_device = buffer_device or device
    logs = construction_logs(root)
    libraries = [model for library in _LIBRARIES for model in library.claim(root, logs)]
    plan = _InitPlan(root, logs, libraries)
    # Allocate per owning module, not `root.to_empty()`: modules without parameters (torchmetrics metrics) would
    # have their states replaced by uninitialised memory.
    for module in plan.owners:
        buffers = dict(module.named_buffers(recurse=False))
        module.to_empty(device=device, recurse=False)
        for name, buffer in buffers.items():
            # A buffer built for real (not on meta) keeps its values where `fully_shard` put it (the compute device).
            setattr(module, name, torch.empty_like(buffer, device=buffer_device) if buffer.is_meta else buffer)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            reregister_sharded_parameters(module)
    _use_rank_zero_rng()
    with torch.no_grad():
        plan.run(device)
    forget_construction(root)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))


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
        self.libraries = libraries
        self.modules = {id(m): m for m in root.modules()}
        self.owners = [m for m in root.modules() if next(_own_tensors(m), None) is not None]
        self.order = {id(m): index for index, m in enumerate(root.modules())}
        self.ops = sorted((op for log in logs for op in log.ops), key=lambda op: op.seq)
        self.held = {key: tensor for log in logs for key, tensor in log.held.items()}
        library_tensors = {key for library in libraries for key in library.tensors}
        self.library_keys: dict[int, list[HolderKey]] = {}  # a library's storage -> where its tensor is held
        for key in library_tensors & self.held.keys():
            self.library_keys.setdefault(storage_key(self.held[key]), []).append(key)
        self.library_storages = set(self.library_keys)
        meta: dict[int, dict[HolderKey, torch.Tensor]] = {}  # module id -> its meta tensors outside the libraries'
        library_live = set()
        for module in self.owners:
            for key, tensor in _holders(module):
                if tensor.is_meta and key in library_tensors:
                    library_live.add(id(tensor))
                elif tensor.is_meta:
                    meta.setdefault(id(module), {})[key] = tensor
        self._refuse_library_tensors_held_elsewhere(meta, library_live)
        self.library_op, state, ops_on = self._follow_ops()
        ends = {key: value for log in logs for key, value in log.constructor_ends().items()}
        self.replayed, self.fallback = self._assign_modules(root, meta, state, ops_on, ends)
        # A library's tensors changed after the library initialised them (a user's `zeros_` on a new head) are replayed
        # over the library's values; so is every storage that a replayed copy reads.
        for s in self.library_storages & ops_on.keys():
            self.replayed[s] = self.library_keys[s]
        self.needed = set(self.replayed)
        for op in reversed(self.ops):
            if op.seq not in self.library_op and op.storage in self.needed and op.source is not None:
                if op.source_storage not in self.library_storages:
                    self.needed.add(op.source_storage)
        self.fallback_ids = {id(module) for _, _, module in self.fallback}

    def _follow_ops(self) -> tuple[dict[int, LibraryModel], dict[int, str], dict[int, list[Op]]]:
        """Which ops are a library's (made inside its constructors); what every other op leaves its storage as."""
        library_of = {mid: library for library in self.libraries for mid in library.constructions}
        library_op: dict[int, LibraryModel] = {}
        state: dict[int, str] = {}
        ops_on: dict[int, list[Op]] = {}
        for op in self.ops:
            library = next((library_of[id(m)] for m in op.constructing if id(m) in library_of), None)
            if library is not None:
                library_op[op.seq] = library
            elif op.target is not None:
                ops_on.setdefault(op.storage, []).append(op)
                state[op.storage] = _state_after(op, state, self.library_storages)
        return library_op, state, ops_on

    def _assign_modules(
        self,
        root: nn.Module,
        meta: dict[int, dict[HolderKey, torch.Tensor]],
        state: dict[int, str],
        ops_on: dict[int, list[Op]],
        ends: dict[int, float],
    ) -> tuple[dict[int, list[HolderKey]], list[tuple[float, int, nn.Module]]]:
        """Each module with meta tensors outside the libraries' models: replayed (``storage -> the tensors it
        fills``), or its ``reset_parameters()`` (``(position, modules() index, module)``); else an error."""
        replayed: dict[int, list[HolderKey]] = {}
        fallback: list[tuple[float, int, nn.Module]] = []
        unlogged: list[nn.Module] = []
        unable: list[str] = []
        names = {id(m): name for name, m in root.named_modules()}
        for module_id, tensors in meta.items():
            module = self.modules[module_id]
            storages = {key: storage_key(self.held[key]) for key in tensors if key in self.held}
            unset = [key for key in tensors if state.get(storages.get(key, -1)) != "set"]
            if not unset:
                for key, s in storages.items():
                    replayed.setdefault(s, []).append(key)
                continue
            touched = [op for s in storages.values() for op in ops_on.get(s, [])]
            has_reset = callable(getattr(module, "reset_parameters", None))
            if not has_reset and not touched:
                unlogged.append(module)
            elif not has_reset or any(not any(m is module for m in op.constructing) for op in touched):
                # computed from other tensors, and no reset_parameters() - or one that cannot redo what was done to the
                # module after its constructor (by an enclosing module or library)
                unable += [".".join(filter(None, [names[module_id], key[2]])) for key in unset]
            else:
                fallback.append((ends.get(module_id, math.inf), self.order[module_id], module))
        _refuse(unlogged, unable)
        return replayed, fallback

    def _refuse_library_tensors_held_elsewhere(
        self, meta: dict[int, dict[HolderKey, torch.Tensor]], library_live: set[int]
    ) -> None:
        strays = [
            f"{type(self.modules[key[0]]).__name__}.{key[2]}"
            for tensors in meta.values()
            for key, tensor in tensors.items()
            if key in self.held and storage_key(self.held[key]) in self.library_storages
            and id(tensor) not in library_live
        ]  # fmt: skip
        if strays:
            raise TypeError(
                f"{strays} hold tensors that a library's model built (e.g. a transformers model), outside that model: "
                "the library initialises or loads the model's own tensors, not these. Keep the model's modules in it "
                "(share the parameter, as weight tying does), or build the model in `__init__`."
            )

    def run(self, device: torch.device) -> None:
        swap = FullSizeParameters(scratch_device=device)
        replay = _Replay(self, device, swap)
        items: list[tuple[float, int, int, Any]] = [(op.seq, 0, op.seq, op) for op in self.ops]
        for library in self.libraries:
            for index, (position, action) in enumerate(library.steps):
                items.append((position, self.order.get(id(library.module), 0), index, action))
        items += [(position, index, 0, module) for position, index, module in self.fallback]
        for _, _, _, item in sorted(items, key=lambda entry: entry[:3]):
            if isinstance(item, Op):
                replay.op(item)
            elif isinstance(item, nn.Module):
                swap.swap_in(item)
                item.reset_parameters()  # type: ignore[operator]
                swap.mark_initialized(item)
                swap.write_back(item)
            else:
                item(swap)


def _state_after(op: Op, state: dict[int, str], library_storages: set[int]) -> str:
    """``"set"``, ``"unset"`` or ``"computed"``: what replaying the ops so far leaves ``op``'s storage as."""
    before = "set" if op.storage in library_storages else state.get(op.storage, "unset")
    if op.kind == "allocate":
        return "unset"
    if op.kind == "create" or (op.kind == "write" and op.overwrites):
        return "set"
    if op.kind == "write":
        return before  # a slice written, or values updated in place
    if op.kind == "copy":
        source = "set" if op.source_storage in library_storages else state.get(op.source_storage, "unset")
        return "set" if source == "set" and op.whole else "computed"
    return "computed"


def _refuse(unlogged: list[nn.Module], unable: list[str]) -> None:
    if unlogged:
        classes = sorted({type(m).__name__.removeprefix("FSDP" if isinstance(m, FSDPModule) else "") for m in unlogged})
        raise TypeError(
            f"The model was created on the meta device, but these modules hold parameters or buffers and define no "
            f"`reset_parameters()` to initialise them: {classes}. Add a `reset_parameters()` method to them, or create "
            "the model in `__init__` instead of `configure_model()`."
        )
    if unable:
        shown = str(unable[:8])[:-1] + (f", ... ({len(unable)} in all)]" if len(unable) > 8 else "]")
        raise TypeError(
            f"The model was created on the meta device, but {shown} were computed from other tensors while it was "
            "built, which cannot be redone on real tensors, and no `reset_parameters()` of their module redoes it (it "
            "is missing, or the tensors were changed after the module's constructor, by an enclosing module or "
            "library). Initialise them in place (`nn.init.*`, `torch.ones`, ...) or in the module's own "
            "`reset_parameters()`, or create the model in `__init__` instead of `configure_model()`."
        )


class _Replay:
    """Runs recorded ops on full-size tensors: storages replayed into their live tensors, draws into scratch.

    A storage gets a full-size buffer when an op creates or overwrites it (the value before is dead) and keeps it while
    later ops update or read it; at the last of those the buffer is dropped - written back to the live tensors first
    (each rank its shard) if no later op overwrites it again. So only the tensors under initialisation at one point of
    the construction exist whole, even when a constructor re-initialises its children at its end.
    """

    def __init__(self, plan: _InitPlan, device: torch.device, swap: FullSizeParameters) -> None:
        self.plan, self.device, self.swap = plan, device, swap
        self.buffers: dict[int, torch.Tensor] = {}
        self.closes: dict[int, list[tuple[int, bool]]] = {}  # op seq -> [(storage, write it back)] after the op
        last: dict[int, int] = {}  # storage -> the op that last used its current buffer
        for op in plan.ops:
            if op.seq in plan.library_op:
                continue
            if op.storage in plan.needed and _overwrites(op) and op.storage in last:
                self.closes.setdefault(last.pop(op.storage), []).append((op.storage, False))
            for storage in (op.storage, op.source_storage):
                if storage in plan.needed:
                    last[storage] = op.seq
        for storage, seq in last.items():
            self.closes.setdefault(seq, []).append((storage, True))

    def op(self, op: Op) -> None:
        library = self.plan.library_op.get(op.seq)
        if library is not None or op.storage not in self.plan.needed:
            # A draw into a tensor no one keeps advances the stream as in an eager build - unless it was made in a
            # library's constructors that an eager load does not run (`from_pretrained`), or in the constructor of a
            # module whose reset_parameters() redoes that constructor's work.
            if library is not None:
                draws = library.replays_draws
            else:
                draws = not any(id(m) in self.plan.fallback_ids for m in op.constructing)
            if op.random and draws:
                args, kwargs = _on_device(op, self.device, {})
                op.func(*args, **kwargs)
            return
        assert op.target is not None
        target = self._view(op.target, fresh=_overwrites(op))
        swapped = {id(op.target): target}
        if op.source is not None:
            swapped[id(op.source)] = self._source(op.source)
        args, kwargs = _on_device(op, self.device, swapped)
        result = op.func(*args, **kwargs)
        if op.kind == "create" or (op.kind == "copy" and result is not target):
            target.copy_(result)
        for storage, write_back in self.closes.get(op.seq, []):
            self._close(storage, write_back)

    def _view(self, tensor: torch.Tensor, fresh: bool) -> torch.Tensor:
        s = storage_key(tensor)
        if fresh or s not in self.buffers:
            buffer = torch.empty(tensor.untyped_storage().nbytes(), dtype=torch.uint8, device=self.device)
            if not fresh and s in self.plan.library_storages:
                _strided(buffer, self.plan.held[self.plan.library_keys[s][0]]).copy_(self._library_value(s))
            self.buffers[s] = buffer
        return _strided(self.buffers[s], tensor)

    def _source(self, tensor: torch.Tensor) -> torch.Tensor:
        s = storage_key(tensor)
        if s in self.buffers:
            return _strided(self.buffers[s], tensor)
        return self._library_value(s)  # a library's tensor, after the library initialised it

    def _library_value(self, s: int) -> torch.Tensor:
        live = held_tensor(self.plan.modules, self.plan.library_keys[s][0])
        return live.full_tensor() if isinstance(live, DTensor) else live

    def _close(self, s: int, write_back: bool) -> None:
        buffer = self.buffers.pop(s)
        if not write_back:
            return
        written: set[int] = set()
        for key in self.plan.replayed.get(s, []):
            live = held_tensor(self.plan.modules, key)
            if id(live) in written:
                continue
            written.add(id(live))
            full = _strided(buffer, self.plan.held[key])
            if isinstance(live, DTensor):
                shard = distribute_tensor(full.to(live.dtype), live.device_mesh, live.placements, src_data_rank=None)
                live.to_local().copy_(shard.to_local())
            else:
                live.copy_(full)
            self.swap.initialized(live)


def _strided(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s elements in ``buffer`` (the bytes of its full-size storage)."""
    return buffer.view(like.dtype).as_strided(like.size(), like.stride(), like.storage_offset())


def _overwrites(op: Op) -> bool:
    """Whether ``op`` sets every element of its storage without reading them: it starts the storage afresh."""
    return op.kind == "create" or op.overwrites or (op.kind == "copy" and op.whole)


def _on_device(op: Op, device: torch.device, swapped: dict[int, torch.Tensor]) -> tuple[tuple, dict]:
    """``op``'s arguments for running it on ``device``: its meta tensors replaced by their stand-ins in ``swapped`` (by
    id), or by scratch tensors of their size (a draw into them advances the random stream as in an eager build)."""

    def real(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return swapped[id(value)] if id(value) in swapped else torch.empty_like(value, device=device)
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        return value

    return tree_map(real, op.args), tree_map(real, op.kwargs)


class FullSizeParameters:
    """Swaps a module's sharded (DTensor) parameters for full-size plain ones while its initialisation runs, then
    copies each rank's shard back. A parameter shared with a module initialised earlier (tied weights), or one left
    on the meta device (not part of the sharded model), gets a scratch tensor that is dropped.

    Args:
        unset: ``"empty"`` leaves the full-size tensors uninitialised (``reset_parameters()`` writes every value);
            ``"nan"`` fills floating-point ones with NaN and :meth:`write_back` raises if an init left any (a
            parameter that a Hugging Face ``_init_weights`` does not cover would otherwise be uninitialised memory).
        keep: parameters to leave in place, not swapped (those already loaded from pretrained files).
        scratch_device: where scratch stand-ins for meta parameters are drawn (the materialisation device).

    Example:
        >>> swap = FullSizeParameters()
        >>> layer = nn.Linear(2, 2)
        >>> swap.swap_in(layer); layer.reset_parameters(); swap.mark_initialized(layer); swap.write_back(layer)
    """

    def __init__(
        self,
        unset: str = "empty",
        keep: Callable[[nn.Parameter], bool] = lambda p: False,
        scratch_device: torch.device | None = None,
    ) -> None:
        self.unset = unset
        self.keep = keep
        self.scratch_device = scratch_device or torch.device("cpu")
        self._initialized: set[int] = set()
        # module id -> {name: (the module's own parameter, whether its full-size stand-in is scratch)}
        self._pending: dict[int, dict[str, tuple[nn.Parameter, bool]]] = {}

    def with_policy(self, unset: str, keep: Callable[[nn.Parameter], bool]) -> FullSizeParameters:
        """The same record of initialised parameters under another ``unset`` / ``keep`` policy."""
        other = FullSizeParameters(unset, keep, self.scratch_device)
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
            scratch = id(param) in self._initialized or param.is_meta
            if not (isinstance(param, DTensor) or scratch) or self.keep(param):
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            device = self.scratch_device if param.is_meta else local.device
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            if self.unset == "nan" and not scratch and full.is_floating_point():
                full.fill_(float("nan"))
            module.register_parameter(name, nn.Parameter(full, requires_grad=param.requires_grad))
            swapped[name] = (param, scratch)
        self._pending[id(module)] = swapped

    def mark_initialized(self, module: nn.Module) -> None:
        """Call once ``module``'s init has run: later modules sharing its parameters get scratch tensors."""
        swapped = self._pending.get(id(module), {})
        self._initialized.update(
            id(swapped[name][0] if name in swapped else param) for name, param in module.named_parameters(recurse=False)
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
                    if scratch or not isinstance(param, DTensor):
                        continue
                    if self.unset == "nan" and _left_nan(full):
                        owner = type(module).__name__.removeprefix("FSDP" if isinstance(module, FSDPModule) else "")
                        raise RuntimeError(
                            f"`{owner}.{name}` was left uninitialised: its model's initialisation "
                            "(Hugging Face `_init_weights`) does not cover it. Build the model in `__init__` "
                            "instead of on the meta device, or load it with `lightning_shard.hf.from_pretrained`."
                        )
                    shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
        finally:
            for name, (param, _) in swapped.items():
                module.register_parameter(name, param)


def _left_nan(full: torch.Tensor) -> bool:
    """Whether an init left NaN in the floating-point ``full``; a fake tensor (the memory simulation's) has no values
    to check and is never a model's weight."""
    return full.is_floating_point() and holds_values(full) and bool(full.isnan().any())


def _use_rank_zero_rng() -> None:
    """Give every rank rank 0's generator state, so they all draw the same full-size tensors."""
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])
