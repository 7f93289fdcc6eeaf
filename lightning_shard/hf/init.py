"""Hugging Face models built on the meta device, initialised as transformers initialises them.

The rule (it is the first step of :mod:`lightning_shard.init.materialize`'s): a ``transformers.PreTrainedModel`` in
the tree
is initialised where its constructor ended in an eager build (``post_init``), by its own ``_initialize_weights`` /
``_init_weights``, module by module in transformers' order (``initialize_weights``: children before parents, nested
``PreTrainedModel``\\ s with their own init where their own constructors ended), on full-size tensors of one module at
a time, from rank 0's random stream. ``_init_weights`` also recomputes the buffers a constructor computes (rotary
``inv_freq``), and the weights tied in the constructor (``tie_weights``) stay one parameter through sharding. A model
built by :func:`lightning_shard.hf.from_pretrained` is loaded from its files first; the init covers the rest.

transformers' init sees the model **as its constructors built it**: changes made to it afterwards - peft's
``get_peft_model`` replacing ``q_proj`` by a ``lora.Linear`` that holds the original as ``base_layer``, a user's own
adapters or heads put into it - are undone around the init and the load (:class:`AsBuilt`), so the original modules
are initialised (and named, for the files) as in an eager build, and the modules a wrapper added are left to their own
library's init (replayed by :mod:`lightning_shard.init.materialize`: peft's LoRA A ``kaiming_uniform_``, B zero).

An eager build draws twice: each constructor's torch init (``nn.Linear.reset_parameters``, GPT-2's ``Conv1D``) and
then transformers' init in ``post_init``. On the meta device transformers skips its init and the constructors' draws
compute nothing; materialisation replays those draws into scratch tensors, so for the same seed the weights and buffers
equal an eager build on one process. (transformers' own meta-device loading does not replay them, so its random init
of missing weights differs from an eager build.)

transformers stays optional: nothing here imports it; a model is a ``PreTrainedModel`` only if transformers is
already imported and says so.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.hf.pretrained import (
    explain_meta_from_pretrained,
    load_pretrained_shards,
    planned_load,
    planned_names,
)
from lightning_shard.init.construction import written_storages
from lightning_shard.init.construction_log import ABSENT, ConstructionLog, HolderKey, Registration
from lightning_shard.init.full_size import FullSizeParameters
from lightning_shard.init.libraries import LibraryModel, LibraryStep, register_library
from lightning_shard.init.ties import replaced_after
from lightning_shard.torch_compat.tensors import storage_key


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if transformers is imported, else ``None`` (never imports it).

    Example:
        >>> pretrained_model_class() is None or pretrained_model_class().__name__ == "PreTrainedModel"
        True
    """
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``PreTrainedModel``.

    Example:
        >>> is_pretrained_model(nn.Linear(2, 2))
        False
    """
    cls = pretrained_model_class()
    return cls is not None and isinstance(module, cls)


def outermost_pretrained_models(root: nn.Module) -> list[nn.Module]:
    """The ``PreTrainedModel``\\ s in ``root`` (``root`` included) that are not inside another one.

    Example:
        >>> outermost_pretrained_models(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    if pretrained_model_class() is None:
        return []
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if is_pretrained_model(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found


class AsBuilt:
    """Undoes, while entered, the changes made to a model after its constructor returned (its submodules,
    parameters and buffers replaced or added from outside, as peft's ``get_peft_model`` does), then redoes them.

    Example:
        >>> with AsBuilt(model, logs):  # doctest: +SKIP
        ...     model.model.layers[0].self_attn.q_proj  # the Linear transformers built, not peft's lora.Linear
    """

    def __init__(self, model: nn.Module, logs: list[ConstructionLog]) -> None:
        registrations = sorted((r for log in logs for r in log.registrations), key=lambda r: r.seq)
        built = {id(model)}
        for registration in registrations:
            if isinstance(registration.new, nn.Module) and any(m is model for m in registration.constructing):
                built.add(id(registration.new))
        self.edits: list[Registration] = [
            r for r in registrations if id(r.parent) in built and not any(m is model for m in r.constructing)
        ]
        self._saved: list[tuple[Registration, Any]] = []

    def __enter__(self) -> None:
        for edit in reversed(self.edits):
            self._saved.append((edit, edit.parent.__dict__[edit.table].get(edit.name, ABSENT)))
            _put(edit.parent, edit.table, edit.name, edit.old)

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, []
        for edit, value in reversed(saved):
            _put(edit.parent, edit.table, edit.name, value)


def _put(parent: nn.Module, table: str, name: str, value: Any) -> None:
    if value is ABSENT:
        delattr(parent, name)
    elif table == "_modules":
        parent.register_module(name, value)
    elif table == "_parameters":
        parent.register_parameter(name, value)
    else:
        parent.register_buffer(name, value, persistent=name not in parent._non_persistent_buffers_set)


class TransformersLibrary:
    """transformers' models for the registry of :mod:`lightning_shard.init.libraries` (registered on import).

    Example:
        >>> TransformersLibrary().claim(nn.Linear(2, 2), [])
        []
    """

    def construction_context(self) -> AbstractContextManager[None]:
        return explain_meta_from_pretrained()

    def claim(self, root: nn.Module, logs: list[ConstructionLog]) -> list[LibraryModel]:
        ends = {key: value for log in logs for key, value in log.constructor_ends().items()}
        return [_TransformersModel(model, logs, ends).library_model() for model in outermost_pretrained_models(root)]


class _TransformersModel:
    """One outermost ``PreTrainedModel`` as built: its tensors, and the steps that initialise it where an eager build
    did (each nested model where its constructor ended; a pretrained one loaded and initialised in one step), each
    with the tensors it sets. A tensor transformers' init has no rule for (CLIP's ``logit_scale``, set by its
    constructor only) keeps what its construction gave it, as in an eager build."""

    def __init__(self, model: nn.Module, logs: list[ConstructionLog], ends: dict[int, float]) -> None:
        self.model = model
        self.registrations = [r for log in logs for r in log.registrations]
        self.as_built = AsBuilt(model, logs)
        with self.as_built:
            members = list(model.modules())
            self.keys = {
                f"{prefix}.{name}".lstrip("."): (id(m), table, name)
                for prefix, m in model.named_modules(remove_duplicate=False)
                for table in ("_parameters", "_buffers")
                for name, t in m.__dict__[table].items()
                if t is not None
            }
            nested = [m for m in members if is_pretrained_model(m)]
        self.planned = planned_load(model)
        # transformers' order: a nested model's init where its constructor ended, the outermost one's last
        self.inits = sorted(nested, key=lambda m: (ends.get(id(m), math.inf), m is model))
        self.positions = [ends.get(id(m), math.inf) for m in self.inits]
        self.hf_swap: FullSizeParameters | None = None
        self.sets: set[HolderKey] = set()

    def library_model(self) -> LibraryModel:
        if self.planned or math.inf in self.positions:
            indices = list(range(len(self.inits)))
            steps = [LibraryStep(self.positions[-1], self._all_steps, self._set_by(indices) | self._loaded())]
        else:
            steps = [LibraryStep(p, self._step(i), self._set_by([i])) for i, p in enumerate(self.positions)]
        self.sets = {key for step in steps for key in step.sets}
        constructions = {id(m) for m in self.inits}
        tensors = set(self.keys.values())
        return LibraryModel(self.model, tensors, constructions, replays_draws=not self.planned, steps=steps)

    def _set_by(self, indices: list[int]) -> set[HolderKey]:
        """The tensors transformers' init of ``self.inits[i]`` (``i`` in ``indices``) writes: the init run on meta
        stand-ins under a write recorder (it draws nothing there), transformers' ``_is_hf_initialized`` flags put
        back after."""
        swap = FullSizeParameters(device=torch.device("meta"))
        flags = _initialized_flags(self.model)
        try:
            with self.as_built, _guard_torch_init_functions(), written_storages() as written:
                for index in indices:
                    _initialize_like_transformers(self.inits[index], swap)
        finally:
            _restore_flags(flags)
        with self.as_built:
            modules = {id(m): m for m in self.model.modules()}
            storages = {
                storage_key(tensor): key
                for key in self.keys.values()
                if (tensor := modules[key[0]].__dict__[key[1]][key[2]]).is_meta and not isinstance(tensor, DTensor)
            }
        storages.update({storage: key for storage, (key, _) in swap.stand_ins.items()})
        return {storages[s] for s in written if s in storages}

    def _loaded(self) -> set[HolderKey]:
        return {self.keys[name] for name in planned_names(self.model) if name in self.keys}

    def _all_steps(self, swap: FullSizeParameters) -> None:
        for index in range(len(self.inits)):
            self._step(index)(swap)

    def _step(self, index: int) -> Callable[[FullSizeParameters], None]:
        def step(swap: FullSizeParameters) -> None:
            with self.as_built, _guard_torch_init_functions():
                if index == 0:
                    self._prepare(swap)
                assert self.hf_swap is not None
                self.hf_swap.replaced_later = replaced_after(self.registrations, self.positions[index])
                _initialize_like_transformers(self.inits[index], self.hf_swap)

        return step

    def _prepare(self, swap: FullSizeParameters) -> None:
        """Load the files, then initialise the parameters the init sets (the others keep their constructors' values)."""
        load_pretrained_shards(self.model)
        modules = {id(m): m for m in self.model.modules()}
        set_here = {id(modules[mid].__dict__[table][name]) for mid, table, name in self.sets if mid in modules}
        self.hf_swap = swap.with_policy(
            keep=lambda p: getattr(p, "_is_hf_initialized", False) or id(p) not in set_here,
            refuse_unset="its model's initialisation (Hugging Face `_init_weights`)",
        )


def _initialized_flags(model: nn.Module) -> dict[int, tuple[Any, Any]]:
    """transformers' ``_is_hf_initialized`` flag of every module and parameter (absent: ``ABSENT``), to restore."""
    holders = [*model.modules(), *model.parameters()]
    return {id(h): (h, getattr(h, "_is_hf_initialized", ABSENT)) for h in holders}


def _restore_flags(flags: dict[int, tuple[Any, Any]]) -> None:
    for holder, flag in flags.values():
        if flag is ABSENT:
            holder.__dict__.pop("_is_hf_initialized", None)
        else:
            holder._is_hf_initialized = flag


def _initialize_like_transformers(model: nn.Module, swap: FullSizeParameters) -> None:
    """transformers' ``initialize_weights`` (its ``smart_apply``: children first, a nested ``PreTrainedModel`` with
    its own ``_initialize_weights``), one module's full-size parameters at a time. A module's direct children keep
    their full-size parameters until it has run: some inits set a child's weight (GPT-2's ``c_proj``)."""
    extra = (model.is_custom_code(),) if hasattr(model, "is_custom_code") else ()

    def visit(module: nn.Module, init_fn: Any) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if is_pretrained_model(child) else init_fn)
        if not getattr(module, "_is_hf_initialized", False):
            swap.swap_in(module)
            init_fn(module, *extra)
            swap.mark_initialized(module)
        for child in module.children():
            swap.write_back(child)

    visit(model, model._initialize_weights)
    swap.write_back(model)


def _guard_torch_init_functions() -> Any:
    """transformers' guard around ``initialize_weights``: torch's init functions skip tensors already loaded."""
    guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
    return guard() if guard is not None else nullcontext()


register_library(TransformersLibrary())
