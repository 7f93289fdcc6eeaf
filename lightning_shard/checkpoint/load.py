"""The load path: a checkpoint of either format and either layout loaded into a sharded model, its optimizers and
its averaged copies, on every rank.

* :func:`load_sharded`: takes a sharded directory, the model, its optimizers, the layout that names them and the
  averaged copies; checks the files and the keys (every rank agreeing on the verdict), then fills the live shards in
  place in one ``dcp.load`` pass with the rest of the checkpoint read alongside; gives that rest (loops, callbacks,
  ...), the weights and optimizer states left out.
* :func:`load_full`: the same for one ``torch.save`` file: rank 0 maps and checks it, then broadcasts it unit by unit
  (:mod:`~lightning_shard.checkpoint.unit_load`); every rank gives the rest of the checkpoint, as rank 0 read it.

Either loads into any world size: DCP reshards, and the full file's units are cut into this run's shards.

Example:
    >>> rest = load_sharded(Path("last.ckpt"), model, [optimizer], True, TRAINER_LAYOUT, set(), {})  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.layout import LAYOUT_KEY, StateLayout, lookup
from lightning_shard.checkpoint.model_parallel import model_parallel_layout, with_model_parallel_entries
from lightning_shard.checkpoint.optimizer_state import saved_parameter_names, without_unsaved
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.checkpoint.read import load_without_collectives, recorded_layout
from lightning_shard.checkpoint.reader import InPlaceFileSystemReader
from lightning_shard.checkpoint.unit_load import load_full_unit_by_unit
from lightning_shard.torch_compat.checkpoint import set_element


def load_sharded(
    path: Path,
    model: nn.Module,
    optimizers: list[Optimizer],
    strict: bool,
    layout: StateLayout,
    absent: set[str],
    averaged: Mapping[str, nn.Module],
) -> dict:
    """Load the sharded checkpoint at ``path`` into ``model``, ``optimizers`` and ``averaged`` (leaving out the model
    tensors named in ``absent``); return the rest of the checkpoint. Call on every rank."""
    model_state, optimizer_states = _live_states(model, optimizers)
    saved_state = {name: value for name, value in model_state.items() if name not in absent}
    averaged_states = {key: get_model_state_dict(module) for key, module in averaged.items()}
    # Every rank checks the files and the keys, then all agree: a damaged or mismatched checkpoint raises
    # the same error everywhere instead of failing inside dcp.load on some ranks only.
    metadata, saved, averaged_sources = integrity.agreed(
        lambda: _check_sharded(path, saved_state, strict, layout, averaged_states)
    )
    sources = layout.sources(saved, len(optimizers))
    saved_paths = [tuple((metadata.planner_data or {}).get(key, (key,))) for key in metadata.state_dict_metadata]
    if any(not any(saved_path[: len(source)] == source for saved_path in saved_paths) for source in sources):
        raise KeyError(f"The checkpoint {path} holds no optimizer states (saved with `weights_only=True`?).")
    optimizer_states = [
        without_unsaved(state, saved_parameter_names(saved_paths, source))
        for source, state in zip(sources, optimizer_states, strict=True)
    ]
    target: dict[str, Any] = {}
    set_element(target, (saved.model,), saved_state)
    for source, state in zip(sources, optimizer_states, strict=True):
        set_element(target, (*source, "state"), state["state"])
    for key, source in averaged_sources.items():
        set_element(target, (source,), averaged_states[key])
    # One pass over the files for everything: the live shards are filled in place, the rest of the checkpoint
    # (loops, callbacks, ..., param groups) is read into `target` alongside; `.metadata` is not read again.
    _add_saved_entries(target, metadata, saved, sources)
    reader = InPlaceFileSystemReader(path, metadata)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    # Each rank plans and reads on its own (DCP's global load plan is each rank's own plan, unchanged), then one
    # agreement instead of DCP's three collectives: an error on any rank is raised on every rank.
    integrity.agreed(lambda: load_without_collectives(target, reader, planner))
    model_state.update(target[saved.model])
    loaded = [lookup(target, source) for source in sources]
    _set_live_states(model, optimizers, model_state, loaded, strict)
    for key in averaged_sources:
        set_model_state_dict(averaged[key], averaged_states[key], options=StateDictOptions(strict=strict))
    rest = _without_states(target, saved)
    return with_model_parallel_entries(path, rest) if model_parallel_layout(path, metadata) else rest


def load_full(
    path: Path,
    model: nn.Module,
    model_state: dict[str, Any],
    optimizers: list[Optimizer],
    strict: bool,
    layout: StateLayout | None,
    averaged: Mapping[str, nn.Module],
) -> dict:
    """Load the full checkpoint file at ``path`` into ``model`` (whose sharded state dict, less the tensors the
    checkpoint leaves out, is ``model_state``), ``optimizers`` and ``averaged``; return the rest of the checkpoint.
    ``layout=None``: the file is a bare state dict. Call on every rank."""
    # Rank 0 alone maps and checks the file (its data is read later, unit by unit); the others learn its
    # verdict before waiting in the broadcasts, and receive their shards without touching the file.
    averaged_states = {key: get_model_state_dict(module) for key, module in averaged.items()}
    found = integrity.agreed(
        lambda: _check_full(path, model_state, strict, layout, len(optimizers), averaged_states), rank() == 0
    )
    checkpoint, weights, optimizer_states, averaged_weights = found or ({}, None, None, {})
    if optimizers and not broadcast_object(optimizer_states is not None):
        raise KeyError(f"The checkpoint {path} holds no optimizer states (saved with `weights_only=True`?).")
    load_full_unit_by_unit(weights, optimizer_states, model, optimizers, strict=strict, mapped_file=path)
    for key in broadcast_object(sorted(averaged_weights)):
        load_full_unit_by_unit(averaged_weights.get(key), None, averaged[key], [], strict=strict, mapped_file=path)
    # Copied: nothing handed to Lightning may keep the mapped file alive (a ModelCheckpoint score is a tensor).
    return broadcast_object(copy.deepcopy(checkpoint))


def _check_sharded(
    path: Path, model_state: dict[str, Any], strict: bool, layout: StateLayout, averaged_states: dict[str, Any]
) -> tuple[Metadata, StateLayout, dict[str, str]]:
    """The files whole and the weights' names and shapes against the model's (and the averaged copies' against
    theirs): the metadata, the layout, and where the averaged copies the checkpoint holds are (key -> saved key)."""
    metadata = integrity.check_sharded(path)
    saved = recorded_layout(path, metadata)
    integrity.check_model_fits(path, integrity.sharded_model_shapes(metadata, saved.model), model_state, strict)
    averaged_sources = {}
    for key, state in averaged_states.items():
        source = layout.averaged_source(saved, key)
        shapes = integrity.sharded_model_shapes(metadata, source) if source is not None else {}
        if shapes:
            integrity.check_model_fits(path, shapes, state, strict)
            averaged_sources[key] = source
    return metadata, saved, averaged_sources


def _check_full(
    path: Path,
    model_state: dict[str, Any],
    strict: bool,
    layout: StateLayout | None,
    optimizers: int,
    averaged_states: dict[str, Any],
) -> tuple[dict[str, Any], Any, list[Any] | None, dict[str, Any]]:
    """Map the file and check its weights against the model's (and its averaged copies against ``averaged_states``):
    the checkpoint without its weights, optimizer states and averaged copies, the weights, the requested optimizers'
    states (None if the file holds none), and the averaged copies it holds by their key in ``layout``.
    ``layout=None``: the file is a bare state dict."""
    mmap = zipfile.is_zipfile(path)  # a file in torch's legacy format cannot be mapped; it is read
    checkpoint = integrity.load_full_file(path, map_location="cpu", weights_only=False, mmap=mmap)
    if layout is None:
        integrity.check_model_fits(path, integrity.full_model_shapes(checkpoint, path, None), model_state, strict)
        return {}, checkpoint, None, {}
    saved = StateLayout.from_record(checkpoint.get(LAYOUT_KEY) if isinstance(checkpoint, dict) else None)
    weights = checkpoint.get(saved.model) if isinstance(checkpoint, dict) else None
    integrity.check_model_fits(path, integrity.full_model_shapes(weights, path, saved.model), model_state, strict)
    optimizer_states = [lookup(checkpoint, source) for source in layout.sources(saved, optimizers)]
    found = None if any(state is None for state in optimizer_states) else optimizer_states
    averaged_weights = {}
    for key, state in averaged_states.items():
        source = layout.averaged_source(saved, key)
        if source is not None and source in checkpoint:
            shapes = integrity.full_model_shapes(checkpoint[source], path, source)
            integrity.check_model_fits(path, shapes, state, strict)
            averaged_weights[key] = checkpoint[source]
    return _without_states(checkpoint, saved), weights, found, averaged_weights


def _without_states(checkpoint: dict[str, Any], saved: StateLayout) -> dict[str, Any]:
    """The rest of a loaded checkpoint: its weights and optimizer states are in the model and optimizers now."""
    return {key: value for key, value in checkpoint.items() if key not in saved.tensor_keys()}


def _live_states(model: nn.Module, optimizers: list[Optimizer]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The sharded model and optimizer state dicts (their tensors are the live shards), for a load to fill in place.
    One optimizer: one ``get_state_dict`` call, which resolves the parameter names once for both."""
    if len(optimizers) == 1:
        model_state, optimizer_state = get_state_dict(model, optimizers[0])
        return model_state, [optimizer_state]
    return get_model_state_dict(model), [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers]


def _set_live_states(
    model: nn.Module, optimizers: list[Optimizer], model_state: dict, optimizer_states: list[dict], strict: bool
) -> None:
    """``set_state_dict`` on the filled state dicts: the load hooks run and the saved param groups take effect."""
    options = StateDictOptions(strict=strict)
    if len(optimizers) == 1:
        set_state_dict(model, optimizers[0], model_state_dict=model_state, optim_state_dict=optimizer_states[0],
                       options=options)  # fmt: skip
        return
    set_model_state_dict(model, model_state, options=options)
    for optimizer, state in zip(optimizers, optimizer_states, strict=True):
        set_optimizer_state_dict(model, optimizer, state, options=options)


def _add_saved_entries(
    target: dict[str, Any], metadata: Metadata, saved: StateLayout, sources: list[tuple[str | int, ...]]
) -> None:
    """Put placeholders into ``target`` for the entries read as saved rather than into live tensors: everything
    outside the weights and optimizer states (loops, callbacks, schedulers, ...) and the param groups of the
    optimizers loaded from ``sources`` (their hyper-parameters: the saved ones win, as in
    ``Optimizer.load_state_dict``). Rebuilt from the metadata as DCP's own ``_EmptyStateDictLoadPlanner`` rebuilds a
    whole checkpoint, so that the same ``dcp.load`` reads them."""
    tensor_keys = saved.tensor_keys()
    param_groups = [(*source, "param_groups") for source in sources]
    for key, entry in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key, (key,))
        if path[0] in tensor_keys and not any(tuple(path[: len(group)]) == group for group in param_groups):
            continue
        if isinstance(entry, TensorStorageMetadata):
            entry = torch.empty(entry.size, dtype=entry.properties.dtype)
        set_element(target, path, entry)
