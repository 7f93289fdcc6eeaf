"""Background saves (``ShardedCheckpointIO(async_save=True)``): a sharded save that DCP's ``async_save`` writes in a
background thread, published by rank 0 once every rank's files are written.

Takes the payload of a sharded save (what :mod:`~lightning_shard.checkpoint.save` prepares), its staging folder and
its path; gives a :class:`BackgroundSave`, whose ``published`` future completes on every rank once rank 0 has
published the save (or with the error that stopped it). Every background save of this process is registered until
then, so that a load first waits for them all (:func:`wait_for_saves_in_flight`) and reads the newest published
checkpoint. The copy to CPU memory that the step waits for goes through a ``DefaultStager`` (:func:`new_stager`).

Example:
    >>> wait_for_saves_in_flight()  # returns at once: nothing in flight
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_shard.checkpoint.publish import publish
from lightning_shard.checkpoint.ranks import broadcast_object, rank
from lightning_shard.checkpoint.save_errors import discard_partial, save_failure
from lightning_shard.checkpoint.writer import ChecksummedFileSystemWriter

# torch < 2.13's DefaultStager frees its staging buffers (and its copying machinery) at the end of every stage: there
# it serves one save.
STAGER_KEEPS_BUFFERS = torch.__version__ >= "2.13"
# The background saves of this process not yet published, whichever ShardedCheckpointIO started them: a load waits
# for them all (a Trainer's `fit(ckpt_path=...)` may read what another Trainer's save is still writing).
_SAVES_IN_FLIGHT: set[Future] = set()


def new_stager(model_state: dict[str, Any]) -> DefaultStager:
    """The stager that copies a save's tensors to CPU memory, the step waiting for the copy; pinned buffers where
    the model's shards (``model_state``) are on a GPU and the stager keeps its buffers from one save to the next."""
    # Pinned buffers pay when they are kept; allocating and pinning them anew for every save would not.
    pinned = STAGER_KEEPS_BUFFERS and any(value.device.type == "cuda" for value in model_state.values())
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=False,  # the step waits for the copy: the next optimizer step would change it
            use_non_blocking_copy=pinned,
        )
    )


def start_background_save(
    payload: dict[str, Any], staging: Path, path: Path, group: dist.ProcessGroup | None, stager: DefaultStager
) -> BackgroundSave:
    """Start writing ``payload`` into ``staging`` in the background (``group``: the background thread's own process
    group); rank 0 publishes it at ``path`` once every rank's files are written."""
    save = BackgroundSave(staging, path, group)
    written = dcp.async_save(
        payload,
        storage_writer=ChecksummedFileSystemWriter(staging),
        process_group=group,
        async_stager=stager,
    )
    written.add_done_callback(save.publish)
    return save


def wait_for_saves_in_flight() -> None:
    """Block until every background save this process started is published (or has failed: the
    :class:`~lightning_shard.checkpoint.io.ShardedCheckpointIO` that started it raises its error when it next waits).

    Example:
        >>> wait_for_saves_in_flight()
    """
    concurrent.futures.wait(list(_SAVES_IN_FLIGHT))


@dataclass(eq=False)
class BackgroundSave:
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
