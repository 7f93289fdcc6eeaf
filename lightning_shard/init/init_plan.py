"""Plan: who initialises each meta tensor of a model, and in which order, decided before anything is allocated.

Takes the model (sharded, still on the meta device), its construction logs
(:mod:`lightning_shard.init.construction_log`) and the models its libraries claim
(:mod:`lightning_shard.init.libraries`); gives an :class:`InitPlan`: the recorded ops and the libraries' steps in
program order, the ops the final values depend on (restricted to what a checkpoint load right after setup does not
write: :mod:`lightning_shard.init.init_skip`), and the modules that fall back to their ``reset_parameters()``. A model
that cannot be initialised as an eager build fails here, naming the tensors, before it takes memory. Once the tensors
are allocated, :meth:`InitPlan.run` drives the replay (:mod:`lightning_shard.init.replay`) with the random stream's
timeline and writes each finished storage into the live tensors, each rank its shard. The rule it follows is
:mod:`lightning_shard.init.materialize`'s.

Example:
    >>> plan = InitPlan(nn.Linear(2, 2, device="meta"), logs=[], libraries=[])
    >>> [type(module).__name__ for module in plan.fallback]
    ['Linear']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.init.construction_log import ConstructionLog, HolderKey, Op, TensorRef, held_tensor, holders
from lightning_shard.init.full_size import FullSizeParameters
from lightning_shard.init.init_skip import ReplayScope, restricted_needs
from lightning_shard.init.libraries import LibraryModel, LibraryStep
from lightning_shard.init.names import class_name, joined, shown
from lightning_shard.init.replay import Overwrite, Replay, strided, write_shards
from lightning_shard.init.split_replay import WorkSplit


class InitPlan:
    """Who initialises each meta tensor of ``root``, and in which order (the rule:
    :mod:`lightning_shard.init.materialize`); decided before anything is allocated, so that a model that cannot be
    initialised fails before it takes memory."""

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
        meta = [(module, key, t) for module in self.modules.values() for key, t in holders(module) if t.is_meta]
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
        self.targets = {s for s, keys in self.keys_by_storage.items() if not set(keys) <= loaded}
        self.scope, self.draws = restricted_needs(self.ops, self.targets, self._draws)
        self.needed = self.scope.needed
        if self.scope.stream_until == -math.inf:  # no needed draw: the stream's position does not matter
            self.fallback = [m for m in self.fallback if not set(self.unlogged[id(m)]) <= loaded]

    def written_back(self, loaded: set[HolderKey]) -> set[HolderKey]:
        """The tensors the replay writes whole through its write-back (targets no library init sets in place), when
        ``loaded`` are left to a load.

        Example:
            >>> plan.written_back(set())  # doctest: +SKIP
            {(140211, '_parameters', 'weight')}
        """
        by_library = {storage for op in self.ops if isinstance(op, Overwrite) for storage in op.overwritten}
        return {
            key
            for storage, keys in self.keys_by_storage.items()
            if storage not in by_library and not set(keys) <= loaded
            for key in keys
        }

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
            classes = sorted({class_name(m) for m in missing})
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
            f"The model was created on the meta device, but {shown(names)} were computed from meta tensors that "
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
            f"{class_name(module)}.{key[2]}"
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
        return joined(self.names.get(key[0], ""), key[2])

    def run(self, rng: list[tuple[float, Callable[[], None]]]) -> None:
        """Replay, ``rng`` being the random stream's timeline: split between the ranks where it can be
        (:mod:`~lightning_shard.init.split_replay`), else whole on every rank."""
        split = WorkSplit.of(self, rng)
        if split is not None and split.run(rng):
            return
        # A split whose stream check failed found a count torch does not keep: then every draw is drawn.
        write_back = {s: partial(self._write_back, s) for s in self.keys_by_storage}
        self.replay_scope(rng, self.scope, self.draws, write_back, jump=split is None)

    def replay_scope(
        self,
        rng: list[tuple[float, Callable[[], None]]],
        scope: ReplayScope,
        draws: Callable[[Op], bool],
        write_back: dict[int, Callable[[torch.Tensor], None]],
        jump: bool = True,
    ) -> Replay:
        """Run the ops ``scope`` keeps (drawing what ``draws`` says; ``jump``: see :class:`Replay`) with ``rng``'s
        generator events and the fallback modules' ``reset_parameters()`` in program order; finished storages go to
        ``write_back``."""
        self.replay = replay = Replay(
            self.ops,
            scope.needed,
            write_back=write_back,
            external={s: partial(self._read_external, *holding) for s, holding in self.external.items()},
            draws=draws,
            dtypes={s: self.held[keys[0]].dtype for s, keys in self.keys_by_storage.items()},
            jump=jump,
        )
        items: list[tuple[Any, Any]] = [(_order(op), op) for op in self.ops if scope.runs(op)]
        items += [((position, -1, index), action) for index, (position, action) in enumerate(rng)]
        items += [((-math.inf, self.order[id(module)], 0), module) for module in self.fallback]
        for _, item in sorted(items, key=lambda entry: entry[0]):
            if isinstance(item, (Op, Overwrite)):
                replay.run(item)
                continue
            replay.jumped.settle()  # a reset_parameters() or a generator event reads the stream
            if isinstance(item, nn.Module):
                self.swap.swap_in(item)
                item.reset_parameters()  # type: ignore[operator]
                self.swap.mark_initialized(item)
                self.swap.write_back(item)
            else:
                item()
        return replay

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
