"""Hugging Face models built on the meta device, initialised as transformers initialises them.

The rule (it is the first step of :mod:`lightning_shard.materialize`'s): a ``transformers.PreTrainedModel`` in the tree
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
library's init (replayed by :mod:`lightning_shard.materialize`: peft's LoRA A ``kaiming_uniform_``, B zero).

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

from lightning_shard.construction import ABSENT, ConstructionLog, Registration
from lightning_shard.hf.pretrained import explain_meta_from_pretrained, load_pretrained_shards, planned_load
from lightning_shard.materialize import FullSizeParameters, LibraryModel, register_library
from lightning_shard.torch_compat import holds_values


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
    """transformers' models for :mod:`lightning_shard.materialize` (registered on import of this module).

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
    did (each nested model where its constructor ended; a pretrained one loaded and initialised in one step)."""

    def __init__(self, model: nn.Module, logs: list[ConstructionLog], ends: dict[int, float]) -> None:
        self.model = model
        self.as_built = AsBuilt(model, logs)
        with self.as_built:
            members = list(model.modules())
            self.tensors = {
                (id(m), table, name)
                for m in members
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
        self.buffers: list[tuple[str, torch.Tensor]] = []

    def library_model(self) -> LibraryModel:
        if self.planned or math.inf in self.positions:
            steps = [(self.positions[-1], self._all_steps)]
        else:
            steps = [(p, self._step(i)) for i, p in enumerate(self.positions)]
        constructions = {id(m) for m in self.inits}
        return LibraryModel(self.model, self.tensors, constructions, replays_draws=not self.planned, steps=steps)

    def _all_steps(self, swap: FullSizeParameters) -> None:
        for index in range(len(self.inits)):
            self._step(index)(swap)

    def _step(self, index: int) -> Callable[[FullSizeParameters], None]:
        def step(swap: FullSizeParameters) -> None:
            with self.as_built, _guard_torch_init_functions():
                if index == 0:
                    self._prepare(swap)
                assert self.hf_swap is not None
                _initialize_like_transformers(self.inits[index], self.hf_swap)
                if index == len(self.inits) - 1:
                    self._check_buffers()

        return step

    def _prepare(self, swap: FullSizeParameters) -> None:
        """NaN in the floating buffers (to catch one transformers' init does not compute), then the files."""
        self.buffers = [(name, b) for name, b in self.model.named_buffers() if b.is_floating_point()]
        for _, buffer in self.buffers:
            buffer.fill_(float("nan"))
        load_pretrained_shards(self.model)
        self.hf_swap = swap.with_policy(
            keep=lambda p: getattr(p, "_is_hf_initialized", False),
            refuse_unset="its model's initialisation (Hugging Face `_init_weights`)",
        )

    def _check_buffers(self) -> None:
        # a fake buffer (the memory simulation's) has no values to check
        unset = [name for name, buffer in self.buffers if holds_values(buffer) and bool(buffer.isnan().any())]
        if unset:
            raise RuntimeError(
                f"{type(self.model).__name__} was built on the meta device, but its `_init_weights` does not compute "
                f"these buffers: {unset}. Build the model in `__init__` instead of `configure_model()`."
            )


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
