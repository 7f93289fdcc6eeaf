"""A failed save says why and where, on every rank: the ``errno`` and its text (no space left, read-only filesystem,
permission denied, I/O error) and the checkpoint's path, never only what torch's zip writer makes of a short write
(``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``).

The cause travels as an ``OSError``: torch.distributed.checkpoint gathers every rank's error to every rank by
pickling it, and an ``OSError`` keeps its ``errno``, text and file name through that, where the chain of causes
behind torch's ``RuntimeError`` is lost (:func:`named_os_error` is what the writer raises). :func:`saving` turns
whatever stopped a save into one :class:`CheckpointSaveError` on every rank and deletes the partial save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from torch.distributed.checkpoint.api import CheckpointException

from lightning_shard.checkpoint.publish import discard


class CheckpointSaveError(OSError):
    """A save failed; the message names the cause (and which rank met it) and the checkpoint's path, ``errno`` is
    the cause's. The checkpoint previously at the path is unchanged."""


def named_os_error(error: BaseException, where: str) -> OSError | None:
    """The ``OSError`` behind ``error`` (itself or in its chain of causes), re-made to name ``where`` if it names no
    file; None if there is none.

    Example:
        >>> named_os_error(RuntimeError("unexpected pos"), "ckpt/__0_0.distcp") is None
        True
    """
    cause = _os_error_in(error)
    if cause is None or cause.errno is None:
        return cause
    return OSError(cause.errno, cause.strerror, cause.filename or where)  # the subclass matching the errno


def raise_named(error: BaseException, where: str) -> NoReturn:
    """Raise :func:`named_os_error` of ``error`` (from it), or ``error`` itself if no ``OSError`` is behind it."""
    named = named_os_error(error, where)
    if named is None:
        raise error
    raise named from error


def save_failure(error: BaseException, path: Path) -> CheckpointSaveError:
    """One error naming ``path`` and the cause on each rank that met one (all of them when DCP gathered them).

    Example:
        >>> save_failure(OSError(28, "No space left on device", "ckpt/__0_0.distcp"), Path("ckpt")).errno
        28
    """
    failures = error.failures if isinstance(error, CheckpointException) else {None: (error, None)}
    causes, code = [], None
    for rank, (failure, _trace) in sorted(failures.items(), key=lambda item: -1 if item[0] is None else item[0]):
        cause = _os_error_in(failure)
        code = code or (cause.errno if cause is not None else None)
        text = str(cause) if cause is not None else f"{type(failure).__name__}: {failure}"
        text = text.rstrip(".")
        causes.append(text if rank is None else f"rank {rank}: {text}")
    message = (
        f"Could not save the checkpoint {path}: {'; '.join(causes)}. The checkpoint previously at {path} (if any) "
        "is unchanged and what this save had written is deleted."
    )
    return CheckpointSaveError(code, message) if code is not None else CheckpointSaveError(message)


@contextlib.contextmanager
def saving(path: Path, staging: Path) -> Iterator[None]:
    """Around a save's writing and publishing, on every rank: if it fails, the partial save at ``staging`` is
    deleted (:func:`discard_partial`) and :func:`save_failure` raised. Only for failures every rank meets (DCP's
    collectives and the rank-0 agreement raise on all); the writes on every rank are over by then.

    Example:
        >>> with saving(Path("ckpts/last.ckpt"), staging):  # doctest: +SKIP
        ...     dcp.save(state, storage_writer=ChecksummedFileSystemWriter(staging))
    """
    try:
        yield
    except (IsADirectoryError, FileExistsError):  # a refusal to replace what is at `path`: it names both already
        discard_partial(staging)
        raise
    except (Exception, CheckpointException) as error:
        discard_partial(staging)
        raise save_failure(error, path) from error


def discard_partial(staging: Path) -> None:
    """Delete what a failed save wrote, as far as the filesystem lets (a read-only one keeps it until the next save,
    load or launch of that name: :func:`~lightning_shard.checkpoint.publish.clean_leftovers`)."""
    with contextlib.suppress(OSError):
        discard(staging)


def _os_error_in(error: BaseException | None) -> OSError | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
