"""``ShardedCheckpointIO``: sharded (torch.distributed.checkpoint) and full (one ``torch.save`` file) checkpoints.

Formats - both hold the whole checkpoint: the Trainer's, model weights under ``"state_dict"`` with the plain module's
parameter names, optimizer states under ``"optimizer_states"`` keyed by parameter names and a weight-averaging
callback's copy under ``"averaged_model"``, or a Fabric ``state`` (weights, optimizer states and averaged copies under
the keys the program chose; see :mod:`~lightning_shard.checkpoint.layout`):

* sharded: a directory written by ``torch.distributed.checkpoint`` (DCP); every rank writes its shards.
  ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir, file)`` turns it into a full file.
* full: one file written by rank 0 from a state dict gathered to CPU memory, readable with plain ``torch.load``.

Writes are atomic: into a hidden staging folder beside the target, renamed over the target once every rank has
finished, so an interrupted save never leaves something that looks like a complete checkpoint, to this package or to
Lightning's scans of checkpoint folders (see :mod:`~lightning_shard.checkpoint.publish`). A save replaces only a
checkpoint of this package or a link: anything else at its path is refused before anything is written
(:mod:`~lightning_shard.checkpoint.target`). What a path holds - nothing, a sharded directory or a file; replaceable or
not - is decided by rank 0 and broadcast, so that ranks whose views of a network filesystem differ for a moment never
go into different collectives.

Background saves (``async_save``): a save counts as done, on every rank, once rank 0 has published it; every load
first waits for the saves in flight in this process, on every rank, so it reads the newest published checkpoint.
Either format loads into any world size: DCP reshards, and a full file is mapped by rank 0 and broadcast unit by
unit (``unit_load``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import pickle
import threading
import warnings
import zipfile
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.extra_state import EXTRA_KEY, decode_extra, encode_extra
from lightning_shard.checkpoint.layout import LAYOUT_KEY, TRAINER_LAYOUT, WORLD_SIZE_KEY, StateLayout, lookup
from lightning_shard.checkpoint.model_parallel import model_parallel_layout, with_model_parallel_entries
from lightning_shard.checkpoint.optimizer_state import saved_parameter_names, without_unsaved
from lightning_shard.checkpoint.publish import (
    clean_leftovers,
    delete,
    publish,
    publish_link,
    staging_path,
)
from lightning_shard.checkpoint.ranks import barrier, broadcast_object, rank, world_size
from lightning_shard.checkpoint.reader import InPlaceFileSystemReader
from lightning_shard.checkpoint.save_errors import discard_partial, save_failure, saving
from lightning_shard.checkpoint.target import Found, Target
from lightning_shard.checkpoint.unit_load import load_full_unit_by_unit
from lightning_shard.checkpoint.writer import ChecksummedFileSystemWriter, write_full_file
from lightning_shard.standalone_packages.mixing import describe
from lightning_shard.torch_compat.checkpoint import gc_paused, load_state_dict_from_keys, set_element
from lightning_shard.torch_compat.modules import visible_name

MODEL_KEY = TRAINER_LAYOUT.model
_DCP_METADATA = ".metadata"
# torch < 2.13's DefaultStager frees its staging buffers (and its copying machinery) at the end of every stage: there
# it serves one save.
_STAGER_KEEPS_BUFFERS = torch.__version__ >= "2.13"
# The background saves of this process not yet published, whichever ShardedCheckpointIO started them: a load waits
# for them all (a Trainer's `fit(ckpt_path=...)` may read what another Trainer's save is still writing).
_SAVES_IN_FLIGHT: set[Future] = set()


def is_sharded_checkpoint(path: _PATH) -> bool:
    """Whether ``path`` is a directory written by torch.distributed.checkpoint.

    Example:
        >>> is_sharded_checkpoint("missing.ckpt")
        False
    """
    return Path(path).is_dir() and (Path(path) / _DCP_METADATA).is_file()


class ShardedCheckpointIO(CheckpointIO):
    """Saves and loads the checkpoints of :class:`~lightning_shard.ShardedStrategy`.

    The strategy calls :meth:`save_checkpoint` and :meth:`load_into` on every rank.

    Args:
        async_save: write sharded checkpoints in the background with DCP's ``async_save``: the step waits only
            while the shards are copied to CPU memory (pinned memory on GPUs). From torch 2.13 on the copy's buffers
            are kept from one save to the next - one more copy of this rank's shards in CPU memory - so only the first
            save pays for allocating them (before 2.13 every save allocates them, unpinned). At most one save is in
            flight (the next save, a removal and teardown wait for it); the rename that publishes it happens once
            every rank's files are written.

    Example:
        >>> import lightning as L
        >>> from lightning_shard import ShardedStrategy
        >>> strategy = ShardedStrategy(checkpoint_io=ShardedCheckpointIO(async_save=True))
    """

    # Says which Lightning package the plugin is for: Lightning's refusal of the other one's prints it.
    __repr__ = describe

    def __init__(self, async_save: bool = False) -> None:
        if not isinstance(async_save, bool):
            raise TypeError(f"`async_save={async_save!r}` must be a bool.")
        self.async_save = async_save
        self._in_flight: _BackgroundSave | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._stager: DefaultStager | None = None

    # ------------------------------------------------------------------ state dicts

    @staticmethod
    def model_state(model: nn.Module, full: bool, leave_out: Collection[str] = ()) -> dict[str, Any]:
        """The model's state dict: its DTensor shards, or (``full``) whole CPU tensors on rank 0, ``{}`` elsewhere.

        ``leave_out``: names of frozen parameters to leave out (pretrained weights the checkpoint does not hold); when
        they are all the frozen parameters, they are not even gathered.
        """
        leave_out = set(leave_out)
        frozen = (
            {visible_name(name) for name, p in model.named_parameters() if not p.requires_grad} if leave_out else ()
        )
        ignore_frozen = bool(frozen) and frozen <= leave_out
        options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=ignore_frozen)
        state = get_model_state_dict(model, options=options)
        return {name: value for name, value in state.items() if name not in leave_out}

    @staticmethod
    def optimizer_state(model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        """The optimizer's state keyed by parameter names, sharded or (``full``) gathered to rank 0."""
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )

    # ------------------------------------------------------------------ save

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically; call on every rank."""
        if storage_options is not None:
            raise TypeError(f"`storage_options={storage_options!r}` is not supported by {type(self).__name__}.")
        path = Path(path)
        if _holds_shards(checkpoint):
            self.save_sharded(checkpoint, path)
        else:
            self.save_full(checkpoint, path)

    def save_sharded(self, checkpoint: dict[str, Any], path: _PATH, layout: StateLayout = TRAINER_LAYOUT) -> None:
        """Write ``checkpoint`` as a sharded directory; call on every rank. Its weights and optimizer states (where
        ``layout`` says) are written as DCP tensors (each rank its shards; whole tensors without a process group),
        everything else as one pickled object per key, so empty containers survive (see :class:`_Pickled`).

        Raises:
            IsADirectoryError, FileExistsError: on every rank, before anything is written, when ``path`` holds
                something that is not a checkpoint of this package (see :mod:`~lightning_shard.checkpoint.target`).

        Example:
            >>> full = torch.load("full.ckpt", mmap=True, weights_only=False)  # doctest: +SKIP
            >>> ShardedCheckpointIO().save_sharded(full, "sharded.ckpt")  # doctest: +SKIP
        """
        path = Path(path)
        self.wait()  # the save before, perhaps to this very path, is published first
        _check_target(path)
        staging = staging_path(path)
        checkpoint = encode_extra(checkpoint, layout.tensor_keys(), full=False)
        tensor_keys = layout.tensor_keys() | {EXTRA_KEY}  # trees of tensors and bytes, which DCP flattens
        payload = {
            key: value if key in tensor_keys else _opaque(value) for key, value in _recorded(checkpoint, layout).items()
        }
        payload[WORLD_SIZE_KEY] = world_size()
        if self.async_save:
            self._save_in_background(payload, staging, path, layout.model)
            return
        with saving(path, staging):
            dcp.save(payload, storage_writer=ChecksummedFileSystemWriter(staging))
            barrier()
            _by_rank_zero(lambda: publish(staging, path))

    def _save_in_background(self, payload: dict[str, Any], staging: Path, path: Path, model_key: str) -> None:
        if self._async_group is None and _distributed_is_initialized():
            # The background thread's collectives get their own group so they never interleave with training's.
            self._async_group = dist.new_group(backend="gloo")
        if self._stager is None or not _STAGER_KEEPS_BUFFERS:
            # Pinned buffers pay when they are kept; allocating and pinning them anew for every save would not.
            pinned = _STAGER_KEEPS_BUFFERS and any(value.device.type == "cuda" for value in payload[model_key].values())
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=False,
                    use_async_staging=False,  # the step waits for the copy: the next optimizer step would change it
                    use_non_blocking_copy=pinned,
                )
            )
        save = _BackgroundSave(staging, path, self._async_group)
        written = dcp.async_save(
            payload,
            storage_writer=ChecksummedFileSystemWriter(staging),
            process_group=self._async_group,
            async_stager=self._stager,
        )
        written.add_done_callback(save.publish)
        self._in_flight = save

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published by rank 0; re-raise its error."""
        save, self._in_flight = self._in_flight, None
        if save is not None:
            save.published.result()

    def link(self, target: _PATH, link: _PATH) -> None:
        """Make ``link`` a symbolic link to the checkpoint ``target`` (relative, as ``ModelCheckpoint(save_last=
        "link")`` makes it) once ``target`` is published: now, or - ``target`` being the background save in flight -
        right after rank 0 publishes it, so that the link never points at a checkpoint not yet complete. Replaces a
        link or a checkpoint of this package at ``link``, nothing else. Call on rank 0.

        Example:
            >>> io.link("ckpts/epoch=0-step=500.ckpt", "ckpts/last.ckpt")  # doctest: +SKIP
        """
        target, link = Path(target), Path(link)
        save = self._in_flight
        if save is not None and os.path.abspath(save.path) == os.path.abspath(target):
            save.then(lambda: publish_link(target, link))
        else:
            publish_link(target, link)

    def save_full(self, checkpoint: dict[str, Any], path: _PATH, layout: StateLayout = TRAINER_LAYOUT) -> None:
        """Write ``checkpoint`` (gathered on rank 0) as one file from rank 0; call on every rank. Refuses what
        :meth:`save_sharded` refuses."""
        path = Path(path)
        self.wait()
        _check_target(path)
        staging = staging_path(path)
        checkpoint = encode_extra(checkpoint, layout.tensor_keys(), full=True)

        def write() -> None:
            staging.parent.mkdir(parents=True, exist_ok=True)
            write_full_file(_recorded(checkpoint, layout), staging)
            publish(staging, path)

        with saving(path, staging):
            _by_rank_zero(write)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the checkpoint of this package, or the link, at ``path``; anything else is left in place, with a
        warning (call on one rank)."""
        self.wait()  # the save in flight may be publishing this very path
        path = Path(path)
        target = Target.at(path)
        if target.found is Found.OTHER:
            warnings.warn(
                f"Not removing {path}: it is not a checkpoint written by lightning-shard ({target.detail}).",
                stacklevel=2,
            )
        elif target.found is not Found.NOTHING:
            delete(path)

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()  # frees the kept staging buffers
                self._stager = None
            if self._async_group is not None:  # nothing in flight uses it now; the next run makes its own
                dist.destroy_process_group(self._async_group)
                self._async_group = None

    # ------------------------------------------------------------------ load

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Read a whole checkpoint of either format into this process (no model needed); call on every rank."""
        path, is_directory = locate(path)
        if is_directory:  # a directory without `.metadata` is named as such by the check
            integrity.check_sharded(path)
            return decode_extra(read_sharded_keys(path), None)
        checkpoint = integrity.load_full_file(path, map_location=map_location or "cpu", weights_only=bool(weights_only))
        return decode_extra(checkpoint, None)

    def load_into(
        self,
        path: _PATH,
        model: nn.Module,
        optimizers: list[Optimizer],
        strict: bool = True,
        weights_only: bool | None = None,
        layout: StateLayout = TRAINER_LAYOUT,
        absent: Collection[str] = (),
        averaged: Mapping[str, nn.Module] | None = None,
    ) -> dict[str, Any]:
        """Load weights (and optimizer states unless ``weights_only``) into the sharded ``model`` and ``optimizers``
        from a checkpoint of either format and either layout; return the rest of the checkpoint (its weights and
        optimizer states left out). ``layout`` names the optimizers: a Fabric layout's keys are looked up by name in a
        Fabric checkpoint. Call on every rank.

        ``absent``: model tensors the checkpoint leaves out on purpose (frozen pretrained weights, read from their
        files): neither expected nor loaded; they keep their values.

        ``averaged``: averaged copies of the model (``ShardedAveragedModel``) by their key in ``layout``, loaded in
        place like the model, in the same pass; one the checkpoint does not hold keeps its values."""
        path, is_directory = locate(path)
        optimizers = optimizers if optimizers and not weights_only else []
        # Without autograd, DTensor.to_local() (called per tensor by DCP's planner) is an attribute read; without
        # the garbage collector, unpickling the metadata and plans does not set off a sweep of the whole heap (as in
        # torch's own state-dict functions).
        with torch.no_grad(), gc_paused():
            if is_directory:  # sharded; a directory without `.metadata` is named as such by the check
                rest = self._load_sharded(path, model, optimizers, strict, layout, set(absent), averaged or {})
            else:
                rest = self._load_full(path, model, optimizers, strict, layout, set(absent), averaged or {})
        return decode_extra(rest, model)

    def load_raw_into(self, path: _PATH, model: nn.Module, strict: bool = True) -> None:
        """Load a file holding only a state dict (``torch.save(model.state_dict(), path)``) into the sharded
        ``model``: rank 0 maps it, checks it and broadcasts it unit by unit. Call on every rank.

        Example:
            >>> ShardedCheckpointIO().load_raw_into("lit_model.pth", sharded_model)  # doctest: +SKIP
        """
        path, is_directory = locate(path)
        if is_directory:
            raise IsADirectoryError(
                f"{path} is a sharded checkpoint, not a file holding a state dict; load it with "
                "`fabric.load(path, {'model': model})`."
            )
        with torch.no_grad(), gc_paused():
            self._load_full(path, model, [], strict, None, set(), {})

    def _load_sharded(
        self,
        path: Path,
        model: nn.Module,
        optimizers: list[Optimizer],
        strict: bool,
        layout: StateLayout,
        absent: set[str],
        averaged: Mapping[str, nn.Module],
    ) -> dict:
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
        integrity.agreed(lambda: _load_without_collectives(target, reader, planner))
        model_state.update(target[saved.model])
        loaded = [lookup(target, source) for source in sources]
        _set_live_states(model, optimizers, model_state, loaded, strict)
        for key in averaged_sources:
            set_model_state_dict(averaged[key], averaged_states[key], options=StateDictOptions(strict=strict))
        rest = _without_states(target, saved)
        return with_model_parallel_entries(path, rest) if model_parallel_layout(path, metadata) else rest

    def _load_full(
        self,
        path: Path,
        model: nn.Module,
        optimizers: list[Optimizer],
        strict: bool,
        layout: StateLayout | None,
        absent: set[str],
        averaged: Mapping[str, nn.Module],
    ) -> dict:
        # Rank 0 alone maps and checks the file (its data is read later, unit by unit); the others learn its
        # verdict before waiting in the broadcasts, and receive their shards without touching the file.
        model_state = self.model_state(model, full=False, leave_out=absent)
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
    saved = _recorded_layout(path, metadata)
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


def _recorded_layout(path: Path, metadata: Metadata) -> StateLayout:
    """The layout a sharded checkpoint recorded (one small pickled entry); the Trainer's if it recorded none."""
    entry = metadata.state_dict_metadata.get(LAYOUT_KEY)
    if entry is None:  # the Trainer's, or Lightning's ModelParallelStrategy's
        return model_parallel_layout(path, metadata) or TRAINER_LAYOUT
    target: dict[str, Any] = {LAYOUT_KEY: entry}
    _load_without_collectives(target, InPlaceFileSystemReader(path, metadata), dcp.DefaultLoadPlanner())
    return StateLayout.from_record(target[LAYOUT_KEY])


def _recorded(checkpoint: dict[str, Any], layout: StateLayout) -> dict[str, Any]:
    """``checkpoint`` with its layout recorded, unless it is the Trainer's."""
    return checkpoint if layout.is_trainer else {**checkpoint, LAYOUT_KEY: layout.record()}


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


def _load_without_collectives(target: dict[str, Any], reader: dcp.StorageReader, planner: dcp.LoadPlanner) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)


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


class _Pickled:
    """A value DCP stores as one pickled object instead of flattening it into leaves.

    DCP's flattening drops empty containers (a ``LambdaLR``'s ``lr_lambdas: [{}]``, a callback's ``{}``), which
    Lightning then misses on restore. It unpickles through ``pickle.loads`` to the original object, so neither
    ``dcp_to_torch_save`` nor a reader needs lightning_shard.

    The value is pickled when the save starts: a background save writes the state of that moment, and DCP's async
    staging, which deep-copies the state dict, copies this snapshot as it is (a deep copy through ``__reduce__``
    would hand DCP the unwrapped value to flatten).
    """

    def __init__(self, value: Any) -> None:
        self.data = pickle.dumps(value)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.data,)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Pickled:
        return self  # immutable


def _opaque(value: Any) -> Any:
    """Everything but the model and optimizer states (which DCP shards) is kept whole."""
    return value if isinstance(value, (torch.Tensor, str, int, float, bool, type(None))) else _Pickled(value)


def read_sharded_keys(path: _PATH, keys: set[str] | None = None) -> dict[str, Any]:
    """Read ``keys`` (default: all) of a sharded checkpoint whole into this process.

    Example:
        >>> read_sharded_keys("out/last.ckpt", {"global_step"})  # doctest: +SKIP
        {'global_step': 200}
    """
    with warnings.catch_warnings():
        # Reading into one process without a process group is the point here, not an accident.
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        try:
            return load_state_dict_from_keys(keys, str(path), InPlaceFileSystemReader(path))
        except CheckpointException as error:  # a damaged item: the reader's error naming it
            raise integrity.unwrapped(error) from None


def _holds_shards(checkpoint: dict[str, Any]) -> bool:
    return any(isinstance(value, DTensor) for value in checkpoint.get(MODEL_KEY, {}).values())


def wait_for_saves_in_flight() -> None:
    """Block until every background save this process started is published (or has failed: the
    :class:`ShardedCheckpointIO` that started it raises its error when it next waits).

    Example:
        >>> wait_for_saves_in_flight()
    """
    concurrent.futures.wait(list(_SAVES_IN_FLIGHT))


def locate(path: _PATH) -> tuple[Path, bool]:
    """Wait for the saves in flight, then let rank 0 decide whether ``path`` is a directory (sharded) or a file, after
    putting back a checkpoint an interrupted publish moved aside; call on every rank. Every rank gets rank 0's
    answer: ranks whose views of a network filesystem differ (just after a rename) never take different paths.

    Raises:
        FileNotFoundError: on every rank, when rank 0 finds nothing at ``path``.

    Example:
        >>> locate("missing.ckpt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: Checkpoint not found: missing.ckpt
    """
    wait_for_saves_in_flight()
    path = Path(path)
    is_directory = broadcast_object(_is_directory_here(path) if rank() == 0 else None)
    if is_directory is None:
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    return path, is_directory


def _is_directory_here(path: Path) -> bool | None:
    clean_leftovers(path)
    return path.is_dir() if path.exists() else None


def _by_rank_zero(action: Callable[[], None]) -> None:
    """Run ``action`` (writing, publishing) on rank 0; every rank returns once it is done, or raises: rank 0 its own
    error, the others a :class:`CheckpointIntegrityError` quoting it (none is left waiting at a barrier)."""
    error = None
    if rank() == 0:
        try:
            action()
        except Exception as caught:
            error = caught
    try:
        integrity.agree(error)
    except integrity.CheckpointIntegrityError:
        if error is not None:
            raise error from None
        raise


def _check_target(path: Path) -> None:
    """Rank 0 looks at what ``path`` holds (after putting back a checkpoint an interrupted publish moved aside);
    every rank raises the same refusal if it may not be replaced."""
    target = broadcast_object(_target_here(path) if rank() == 0 else None)
    target.check_replaceable(path)


def _target_here(path: Path) -> Target:
    clean_leftovers(path)
    return Target.at(path)


@dataclass(eq=False)
class _BackgroundSave:
    """A save that DCP's background thread writes; ``published`` completes on every rank once rank 0 has published
    it (or with the error that stopped it), which :meth:`publish` learns from rank 0 over the save's own group.
    Registered in ``_SAVES_IN_FLIGHT`` until then."""

    staging: Path
    path: Path
    group: dist.ProcessGroup | None
    published: Future = field(default_factory=Future)
    _after: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _outcome: BaseException | bool | None = None  # rank 0: True once published, the error if it failed

    def __post_init__(self) -> None:
        _SAVES_IN_FLIGHT.add(self.published)
        self.published.add_done_callback(_SAVES_IN_FLIGHT.discard)

    def publish(self, written: Future) -> None:
        """DCP's callback when this rank's part is written: rank 0 publishes (rank 0's write completes once every
        rank's shards and the metadata are on disk) and runs what waits for it; then one broadcast of rank 0's
        outcome, on every rank, so that no rank counts the save done before it is published."""
        error: BaseException | None
        try:
            error = written.exception()
        except BaseException as cancelled:
            error = cancelled
        if rank() == 0:
            error = error or self._publish_here()
        try:  # every rank, whatever happened here: the others wait for this broadcast
            message = broadcast_object(None if error is None else f"{type(error).__name__}: {error}", self.group)
        except BaseException as caught:  # handed to whoever waits
            error, message = error or caught, None
        if error is None and message is not None:
            error = RuntimeError(f"Rank 0 could not write or publish the checkpoint {self.path}: {message}")
        if error is None:
            self.published.set_result(None)
        else:  # every rank's writes are over: DCP's collectives ended the save on all of them
            discard_partial(self.staging)
            self.published.set_exception(save_failure(error, self.path))

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` (rank 0) once rank 0 has published this save: right after the publish, in the background
        thread, or now if that has happened; never if the save failed."""
        with self._lock:
            if self._outcome is None:
                self._after.append(action)
                return
        if self._outcome is True:
            action()

    def _publish_here(self) -> BaseException | None:
        try:
            publish(self.staging, self.path)
        except BaseException as error:
            with self._lock:
                self._outcome = error
            return error
        with self._lock:
            self._outcome, after = True, self._after
        try:
            for action in after:
                action()
        except BaseException as error:
            return error
        return None
