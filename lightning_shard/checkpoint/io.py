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
first waits for the saves in flight in this process, on every rank, so it reads the newest published checkpoint
(:mod:`~lightning_shard.checkpoint.async_save`). Either format loads into any world size: DCP reshards, and a full
file is mapped by rank 0 and broadcast unit by unit (:mod:`~lightning_shard.checkpoint.load`).

This module is Lightning's ``CheckpointIO`` plugin and orders the steps; the steps are the save path's
(:mod:`~lightning_shard.checkpoint.save`), the load path's (:mod:`~lightning_shard.checkpoint.load`) and the reading
of what a path holds (:mod:`~lightning_shard.checkpoint.read`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.checkpoint import integrity
from lightning_shard.checkpoint.async_save import (
    STAGER_KEEPS_BUFFERS,
    BackgroundSave,
    new_stager,
    start_background_save,
)
from lightning_shard.checkpoint.extra_state import decode_extra, encode_extra
from lightning_shard.checkpoint.layout import TRAINER_LAYOUT, StateLayout
from lightning_shard.checkpoint.load import load_full, load_sharded
from lightning_shard.checkpoint.publish import delete, publish, publish_link, staging_path
from lightning_shard.checkpoint.ranks import barrier
from lightning_shard.checkpoint.read import locate, read_sharded_keys
from lightning_shard.checkpoint.save import by_rank_zero, check_target, holds_shards, recorded, sharded_payload
from lightning_shard.checkpoint.save_errors import saving
from lightning_shard.checkpoint.target import Found, Target
from lightning_shard.checkpoint.writer import ChecksummedFileSystemWriter, write_full_file
from lightning_shard.standalone_packages.mixing import describe
from lightning_shard.torch_compat.checkpoint import gc_paused
from lightning_shard.torch_compat.modules import visible_name


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
        self._in_flight: BackgroundSave | None = None
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
        if holds_shards(checkpoint):
            self.save_sharded(checkpoint, path)
        else:
            self.save_full(checkpoint, path)

    def save_sharded(self, checkpoint: dict[str, Any], path: _PATH, layout: StateLayout = TRAINER_LAYOUT) -> None:
        """Write ``checkpoint`` as a sharded directory; call on every rank. Its weights and optimizer states (where
        ``layout`` says) are written as DCP tensors (each rank its shards; whole tensors without a process group),
        everything else as one pickled object per key, so empty containers survive
        (:func:`~lightning_shard.checkpoint.save.sharded_payload`).

        Raises:
            IsADirectoryError, FileExistsError: on every rank, before anything is written, when ``path`` holds
                something that is not a checkpoint of this package (see :mod:`~lightning_shard.checkpoint.target`).

        Example:
            >>> full = torch.load("full.ckpt", mmap=True, weights_only=False)  # doctest: +SKIP
            >>> ShardedCheckpointIO().save_sharded(full, "sharded.ckpt")  # doctest: +SKIP
        """
        path = Path(path)
        self.wait()  # the save before, perhaps to this very path, is published first
        check_target(path)
        staging = staging_path(path)
        payload = sharded_payload(checkpoint, layout)
        if self.async_save:
            self._save_in_background(payload, staging, path, layout.model)
            return
        with saving(path, staging):
            dcp.save(payload, storage_writer=ChecksummedFileSystemWriter(staging))
            barrier()
            by_rank_zero(lambda: publish(staging, path))

    def _save_in_background(self, payload: dict[str, Any], staging: Path, path: Path, model_key: str) -> None:
        if self._async_group is None and _distributed_is_initialized():
            # The background thread's collectives get their own group so they never interleave with training's.
            self._async_group = dist.new_group(backend="gloo")
        if self._stager is None or not STAGER_KEEPS_BUFFERS:
            self._stager = new_stager(payload[model_key])
        self._in_flight = start_background_save(payload, staging, path, self._async_group, self._stager)

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
        check_target(path)
        staging = staging_path(path)
        checkpoint = encode_extra(checkpoint, layout.tensor_keys(), full=True)

        def write() -> None:
            staging.parent.mkdir(parents=True, exist_ok=True)
            write_full_file(recorded(checkpoint, layout), staging)
            publish(staging, path)

        with saving(path, staging):
            by_rank_zero(write)

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
                rest = load_sharded(path, model, optimizers, strict, layout, set(absent), averaged or {})
            else:
                model_state = self.model_state(model, full=False, leave_out=set(absent))
                rest = load_full(path, model, model_state, optimizers, strict, layout, averaged or {})
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
            load_full(path, model, self.model_state(model, full=False, leave_out=set()), [], strict, None, {})
