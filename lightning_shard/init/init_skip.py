"""No initialisation that a load right after setup overwrites.

``fit(ckpt_path=...)`` (also ``"last"``, ``"hpc"`` and the requeue relaunch that resumes from the newest checkpoint),
``validate`` / ``test`` / ``predict(ckpt_path=...)``: Lightning restores the checkpoint right after the strategy's
``setup``, which materialises the model. Replaying the model's construction there (every random draw of the whole
model, :mod:`lightning_shard.init.replay`) would be work the load throws away. So the strategy learns which checkpoint
Lightning selected (:func:`resume_path_noted`, around the launch), reads which model tensors it holds from its
metadata (:func:`checkpoint_tensors`: no tensor is read), and materialisation replays only what the other tensors
need (:func:`restricted_needs`): nothing at all for a complete checkpoint; for a partial one (a new head,
``strict_loading=False``) the ops those tensors depend on, and the random draws up to the last of them, so they still
equal the eager build.

The safety net keeps its promise (:mod:`lightning_shard.init.unset`): the tensors left to the load hold the sentinel
until the load; :func:`check_after_load` (called by the strategy after it loaded the checkpoint) names any the load did
not write, as the check after the replay names those nothing wrote. A tensor the checkpoint stores whole (its saved
chunks tile it, :class:`StoredTensors`) is written whole or not at all by the load, so its sentinel goes into its first
and last elements only: a resume touches no memory that the load then writes again.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint.layout import LAYOUT_KEY, TRAINER_LAYOUT, StateLayout
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.checkpoint.read import recorded_layout
from lightning_shard.init.construction_log import HolderKey, Op
from lightning_shard.init.replay import Overwrite, needed_ops
from lightning_shard.torch_compat.modules import visible_name

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass(frozen=True)
class StoredTensors:
    """The model tensors a checkpoint holds (state-dict ``names``), and those of them it stores ``whole``: every
    element saved (a sharded checkpoint's chunks tile the tensor; a file holds it whole), so that a load writes all of
    each rank's shard or fails.

    Example:
        >>> StoredTensors(frozenset({"weight", "bias"}), frozenset({"weight"})).whole
        frozenset({'weight'})
    """

    names: frozenset[str] = frozenset()
    whole: frozenset[str] = frozenset()


# The model tensors that a load right after this setup writes (set around the strategy's sharding; none outside).
_NOTHING_STORED = StoredTensors()
_LOADED_AFTER_SETUP: ContextVar[StoredTensors] = ContextVar("loaded_after_setup", default=_NOTHING_STORED)
# The checkpoint Lightning selected for each running Trainer (see `resume_path_noted`).
_SELECTED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# On the model: the check of the tensors left to a load (`check_after_load`), and the hook refusing a forward before it.
_UNCHECKED = "_lightning_shard_unchecked_after_load"
_BEFORE_LOAD = "_lightning_shard_refused_before_load"


@contextmanager
def resume_path_noted(trainer: pl.Trainer) -> Iterator[None]:
    """Note the checkpoint path Lightning selects for this run (``fit(ckpt_path="last")``, SLURM's ``hpc``, the
    requeue relaunch's) where the strategy's ``setup`` can read it (:func:`selected_checkpoint`): Lightning hands it
    to the checkpoint connector only after ``setup``. Wraps the connector's ``_select_ckpt_path`` for the duration.

    Example:
        >>> with resume_path_noted(trainer):  # doctest: +SKIP
        ...     trainer_fn(*args)
    """
    connector = trainer._checkpoint_connector
    select = connector._select_ckpt_path

    def noting(*args: Any, **kwargs: Any) -> Any:
        path = select(*args, **kwargs)
        _SELECTED[trainer] = path
        return path

    connector._select_ckpt_path = noting
    try:
        yield
    finally:
        del connector._select_ckpt_path  # the class's method again
        _SELECTED.pop(trainer, None)


def selected_checkpoint(trainer: pl.Trainer) -> Any:
    """The checkpoint path Lightning selected for the current run (``None``: none, or not known).

    Example:
        >>> selected_checkpoint(trainer)  # doctest: +SKIP
        'ckpts/last.ckpt'
    """
    return _SELECTED.get(trainer)


def trainer_checkpoint_tensors(trainer: pl.Trainer, averaging: bool) -> StoredTensors:
    """The model tensors the checkpoint selected for this run holds, which Lightning loads right after setup; none
    when none is selected, when its contents cannot be told without reading it, or when ``averaging`` (a
    weight-averaging callback copies the model before the load) and it holds no averaged copy.

    Example:
        >>> trainer_checkpoint_tensors(trainer, averaging=False).names  # doctest: +SKIP
        frozenset({'model.weight', 'model.bias'})
    """
    path = selected_checkpoint(trainer)
    return checkpoint_tensors(path, averaged=averaging) if path else _NOTHING_STORED


def checkpoint_tensors(path: Any, averaged: bool = False, raw: bool = False) -> StoredTensors:
    """The model tensors a checkpoint of this package holds (under the model key of the layout it recorded; ``raw``:
    a file holding only a state dict), read by rank 0 from its metadata (a sharded directory's ``.metadata``; a
    file's pickle, its tensors memory-mapped: none is read) and broadcast. None when it cannot be told (then nothing
    is skipped, and the load itself reports what is wrong) or, with ``averaged``, when the checkpoint holds no
    averaged copy.

    Example:
        >>> checkpoint_tensors("missing.ckpt")
        StoredTensors(names=frozenset(), whole=frozenset())
    """
    return broadcast_object(_stored_here(Path(path), averaged, raw) if rank() == 0 else None)


def _stored_here(path: Path, averaged: bool, raw: bool) -> StoredTensors:
    try:
        if path.is_dir():
            metadata = FileSystemReader(path).read_metadata()
            layout = recorded_layout(path, metadata)
            prefix = f"{layout.model}."
            keys = metadata.state_dict_metadata
            stored = {key[len(prefix) :]: entry for key, entry in keys.items() if key.startswith(prefix)}
            whole = {name for name, entry in stored.items() if _tiled(entry)}
            top = {key.split(".", 1)[0] for key in keys}
        else:
            checkpoint = torch.load(path, mmap=True, weights_only=False, map_location="cpu")
            if not raw:
                layout = StateLayout.from_record(checkpoint[LAYOUT_KEY]) if LAYOUT_KEY in checkpoint else TRAINER_LAYOUT
                top, checkpoint = set(checkpoint), checkpoint.get(layout.model, {})
            stored = checkpoint
            whole = {name for name, value in stored.items() if isinstance(value, torch.Tensor)}
    except (Exception, CheckpointException):  # unreadable here (a damaged file too): the load names the problem
        return StoredTensors()
    if not raw and averaged and not top & set(layout.averaged):
        return StoredTensors()
    return StoredTensors(frozenset(stored), frozenset(whole))


def _tiled(entry: Any) -> bool:
    """Whether a sharded checkpoint's entry is a tensor whose saved chunks hold each of its elements: they are saved
    without overlap (replicated chunks once), so their volumes add up to the tensor's exactly when they tile it."""
    if not isinstance(entry, TensorStorageMetadata):
        return False
    return sum(math.prod(chunk.sizes) for chunk in entry.chunks) == math.prod(entry.size)


def loaded_after_setup(stored: StoredTensors) -> AbstractContextManager[None]:
    """Inside, materialisation leaves the model tensors ``stored`` holds to a load that follows.

    Example:
        >>> with loaded_after_setup(StoredTensors(frozenset({"weight"}))):  # doctest: +SKIP
        ...     strategy._shard_module(model, precision, 1)
    """
    return _set_inside(_LOADED_AFTER_SETUP, stored)


@contextmanager
def _set_inside(variable: ContextVar[Any], value: Any) -> Iterator[None]:
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def keys_of(root: nn.Module, names: frozenset[str]) -> set[HolderKey]:
    """The tensors of ``root`` (as held: module id, table, name) whose state-dict names are ``names``.

    Example:
        >>> keys_of(nn.Linear(2, 2), frozenset())
        set()
    """
    if not names:
        return set()
    return {
        (id(module), table, name)
        for prefix, module in root.named_modules()
        for table in ("_parameters", "_buffers")
        for name, tensor in module.__dict__[table].items()
        if tensor is not None and visible_name(".".join(filter(None, [prefix, name]))) in names
    }


def loaded_keys(root: nn.Module) -> tuple[set[HolderKey], set[HolderKey]]:
    """The tensors of ``root`` that the load following this setup writes (:func:`loaded_after_setup`; none outside),
    and those of them it writes whole.

    Example:
        >>> loaded_keys(nn.Linear(2, 2))
        (set(), set())
    """
    stored = _LOADED_AFTER_SETUP.get()
    return keys_of(root, stored.names), keys_of(root, stored.whole)


@dataclass
class ReplayScope:
    """What the replay runs for the target storages alone (:func:`restricted_needs`).

    Attributes:
        needed: ``seq`` of the ops whose results are kept (as :func:`~lightning_shard.init.replay.needed_ops`).
        before: the storages needed from before the first op.
        last: the position of the last op the targets' values depend on; nothing after it runs.
        stream_until: the position of the last needed op that draws (a random op, or a library's init, which may
            draw): the random stream must reach each of them as in an eager build, so the draws before it run (into
            scratch when not needed); the draws after it advance a stream nothing reads any more. ``-inf``: none.
    """

    needed: set[float]
    before: set[int]
    last: float
    stream_until: float

    def runs(self, op: Op | Overwrite) -> bool:
        """Whether the replay gets ``op`` at all (it then runs it, or only its draws)."""
        if isinstance(op, Overwrite):  # a library's init: its action draws and writes the live tensors
            return op.seq in self.needed or op.seq < self.stream_until
        return op.seq <= self.last


def restricted_needs(
    ops: list[Op | Overwrite], targets: set[int], draws: Callable[[Op], bool]
) -> tuple[ReplayScope, Callable[[Op], bool]]:
    """The ops the final values of the ``targets`` storages need, and the random draws they need before them
    (:class:`ReplayScope`); ``draws`` says which random ops advance the stream in an eager build. Returned with the
    ``draws`` rule cut at :attr:`ReplayScope.stream_until`.

    Example:
        >>> restricted_needs([], set(), draws=lambda op: True)[0].last
        -inf
    """
    data_only, _ = needed_ops(ops, targets, lambda op: False)
    last = max(data_only, default=-math.inf)
    drawing = [op.seq for op in ops if op.seq in data_only and (isinstance(op, Overwrite) or (op.random and draws(op)))]
    stream_until = max(drawing, default=-math.inf)

    def draws_before(op: Op) -> bool:
        return op.seq < stream_until and draws(op)

    needed, before = needed_ops(ops, targets, draws_before)
    return ReplayScope(needed, before, last, stream_until), draws_before


def defer_check(root: nn.Module, check: Callable[[], None]) -> None:
    """Hold ``check`` (of the tensors left to the load) until :func:`check_after_load`."""
    root.__dict__[_UNCHECKED] = check


def check_after_load(root: nn.Module) -> None:
    """After the load that followed setup: run the check of the tensors materialisation left to it (an error naming
    those the load did not write). Call on every rank; does nothing when nothing was left.

    Example:
        >>> check_after_load(nn.Linear(2, 2))
    """
    check = root.__dict__.pop(_UNCHECKED, None)
    if check is not None:
        check()
    refusal = root.__dict__.pop(_BEFORE_LOAD, None)
    if refusal is not None:
        refusal.remove()


def load_pending(root: nn.Module) -> bool:
    """Whether setup left tensors of ``root`` to a load that has not run yet (:func:`check_after_load`).

    Example:
        >>> load_pending(nn.Linear(2, 2))
        False
    """
    return _UNCHECKED in root.__dict__


def refuse_use_before_load(root: nn.Module, message: str) -> None:
    """Until the load (:func:`check_after_load`), a forward of ``root`` raises ``RuntimeError(message)``: the tensors
    left to the load hold the sentinel, not values. Does nothing when setup left nothing to a load.

    Example:
        >>> refuse_use_before_load(nn.Linear(2, 2), "load first")
    """
    if not load_pending(root):
        return

    def before_forward(module: nn.Module, args: Any) -> None:
        raise RuntimeError(message)

    # first, before FSDP gathers anything for the forward it refuses
    root.__dict__[_BEFORE_LOAD] = root.register_forward_pre_hook(before_forward, prepend=True)
