"""Checks a checkpoint before loading it, so damage or a model mismatch is an error naming the file or key.

Run before ``dcp.load`` / the full-file broadcast, on every rank, and agreed over the process group: every rank
raises the same :class:`CheckpointIntegrityError` (no rank is left waiting in a collective the others never
reach).

* sharded: ``.metadata`` readable and matching the checksum it ends with; every storage file it references present
  and long enough for its byte ranges (each item's checksum is verified as it is read, by the reader).
* full: the file matches the checksum in its zip comment (on a mismatch, the damaged records - tensors - are
  named), and unpickles (``torch.load`` errors re-raised naming the file).
* both: a checkpoint written without checksums loads with one warning
  (:mod:`~lightning_shard.checkpoint.checksums`).
* both: the saved weights' tensor names and shapes against the model's (missing / unexpected keys only under
  strict loading; mis-shaped keys always).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_shard.checkpoint import checksums
from lightning_shard.checkpoint.ranks import all_gathered, rank

_METADATA = ".metadata"
_MAX_LISTED = 8
T = TypeVar("T")


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint is damaged or does not fit the model; the message names the file or key."""


# ------------------------------------------------------------------ sharded (DCP directory)


def read_metadata(path: str | os.PathLike) -> Metadata:
    """``FileSystemReader(path).read_metadata()``, with any failure naming the ``.metadata`` file.

    Example:
        >>> read_metadata("missing.ckpt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_shard.checkpoint.integrity.CheckpointIntegrityError: Damaged checkpoint metadata missing.ckpt/...
    """
    file = Path(path) / _METADATA
    try:
        data = file.read_bytes()
        problem = checksums.metadata_problem(data)
    except OSError as error:
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        raise CheckpointIntegrityError(
            f"Damaged checkpoint metadata {file}: {problem}. The checkpoint cannot be read; load an earlier one."
        )
    if not checksums.is_sealed_metadata(data) and rank() == 0:
        checksums.warn_unchecked(str(path))
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # unpickling raises anything from EOFError to UnpicklingError to ValueError
        raise CheckpointIntegrityError(
            f"Damaged checkpoint metadata {file}: {type(error).__name__}: {error}. "
            "The checkpoint cannot be read; load an earlier one."
        ) from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointIntegrityError(
            f"Damaged checkpoint metadata {file}: holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
            "Metadata. The checkpoint cannot be read; load an earlier one."
        )
    checked_items = any(checksums.item_checksum(info) for info in (metadata.storage_data or {}).values())
    if checked_items and not checksums.is_sealed_metadata(data):
        raise CheckpointIntegrityError(
            f"Damaged checkpoint metadata {file}: its items have checksums, but the line with its own is damaged. "
            "The checkpoint cannot be read as it is; load an earlier one."
        )
    return metadata


def storage_problems(path: str | os.PathLike, metadata: Metadata) -> list[str]:
    """Storage files referenced by ``metadata`` that are missing or shorter than the byte ranges they must serve."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[relative] = max(needed.get(relative, 0), end)
    problems = []
    for relative, end in sorted(needed.items()):
        file = Path(path) / relative
        if not file.is_file():
            problems.append(f"missing shard file {file} (the metadata references {end} bytes in it)")
            continue
        size = file.stat().st_size
        if size < end:
            problems.append(f"truncated shard file {file}: {size} bytes, the metadata needs at least {end}")
    return problems


def sharded_model_shapes(metadata: Metadata, model_key: str = "state_dict") -> dict[str, torch.Size | None]:
    """A sharded checkpoint's model entries (under ``model_key``): name -> global shape (None: not a tensor)."""
    prefix = model_key + "."
    return {
        key[len(prefix) :]: (torch.Size(entry.size) if isinstance(entry, TensorStorageMetadata) else None)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }


def check_sharded(path: str | os.PathLike) -> Metadata:
    """Metadata readable and every storage file whole; return the metadata. Raises on this process only."""
    metadata = read_metadata(path)
    problems = storage_problems(path, metadata)
    if problems:
        raise CheckpointIntegrityError(f"Damaged checkpoint {path}: " + "; ".join(problems))
    return metadata


# ------------------------------------------------------------------ full (one torch.save file)


def load_full_file(path: str | os.PathLike, **kwargs: Any) -> Any:
    """:func:`check_full_file`, then ``torch.load(path, **kwargs)`` with any unpickling failure naming the file."""
    check_full_file(path)
    try:
        return torch.load(path, **kwargs)
    except Exception as error:
        raise CheckpointIntegrityError(
            f"Damaged checkpoint file {path}: torch.load failed with {type(error).__name__}: {error}"
        ) from error


def check_full_file(path: str | os.PathLike) -> None:
    """The full checkpoint file at ``path`` matches the checksum in its zip comment; one warning if it has none.

    Raises:
        CheckpointIntegrityError: it does not, naming the file and the records (tensors) whose bytes differ.
    """
    try:
        found = checksums.full_file_checksums(path)
    except OSError:
        return  # unreadable: torch.load names the problem
    except ValueError as error:  # the checksum's algorithm name is damaged (or xxhash is missing)
        raise CheckpointIntegrityError(f"Damaged checkpoint file {path}: {error}") from error
    if found is None:
        if rank() == 0:
            checksums.warn_unchecked(str(path))
        return
    recorded, actual = found
    if actual != recorded:
        raise CheckpointIntegrityError(
            f"Damaged checkpoint file {path}: its bytes do not match the checksum written at save ({actual} read, "
            f"{recorded} written); damaged: {_listed(checksums.damaged_records(path))}. The checkpoint cannot be "
            "loaded as it is; load an earlier one."
        )


def full_model_shapes(
    weights: Any, path: str | os.PathLike, model_key: str | None = "state_dict"
) -> dict[str, torch.Size | None]:
    """Name -> shape of a full checkpoint's weights (its ``model_key`` entry; ``None``: the file is a bare state
    dict).

    Raises:
        CheckpointIntegrityError: ``weights`` is not a mapping.

    Example:
        >>> full_model_shapes({"weight": torch.zeros(2, 3)}, "model.pt", None)
        {'weight': torch.Size([2, 3])}
    """
    if not isinstance(weights, Mapping):
        what = f"no `{model_key}` mapping of weights" if model_key else f"a {type(weights).__name__}, not a state dict"
        raise CheckpointIntegrityError(f"The checkpoint {path} holds {what}.")
    return {str(k): (v.shape if isinstance(v, torch.Tensor) else None) for k, v in weights.items()}


# ------------------------------------------------------------------ model comparison


def expected_model_shapes(model_state: Mapping[str, Any]) -> dict[str, torch.Size | None]:
    """Name -> global shape of the (possibly sharded) model state dict: a DTensor's ``shape`` is the global one."""
    return {name: (value.shape if isinstance(value, torch.Tensor) else None) for name, value in model_state.items()}


def mismatch_problems(
    saved: Mapping[str, torch.Size | None], expected: Mapping[str, torch.Size | None], strict: bool
) -> list[str]:
    """Missing and unexpected keys (``strict`` only) and mis-shaped keys, each named."""
    problems = []
    if strict:
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing:
            problems.append(f"missing keys (in the model, not in the checkpoint): {_listed(missing)}")
        if unexpected:
            problems.append(f"unexpected keys (in the checkpoint, not in the model): {_listed(unexpected)}")
    shaped = [
        f"{name}: checkpoint {tuple(saved[name])} vs model {tuple(shape)}"
        for name, shape in sorted(expected.items())
        if name in saved and shape is not None and saved[name] is not None and tuple(saved[name]) != tuple(shape)
    ]
    if shaped:
        problems.append(f"mis-shaped keys: {_listed(shaped)}")
    return problems


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def check_model_fits(
    path: str | os.PathLike, saved: Mapping[str, torch.Size | None], model_state: Mapping[str, Any], strict: bool
) -> None:
    """Raise :class:`CheckpointIntegrityError` when the ``saved`` weights' names and shapes do not fit
    ``model_state`` (:func:`mismatch_problems`).

    Example:
        >>> check_model_fits("out/last.ckpt", {"weight": torch.Size([2])}, {"weight": torch.zeros(2)}, strict=True)
    """
    message = model_mismatch_message(path, mismatch_problems(saved, expected_model_shapes(model_state), strict))
    if message is not None:
        raise CheckpointIntegrityError(message)


def model_mismatch_message(path: str | os.PathLike, problems: Iterable[str]) -> str | None:
    problems = list(problems)
    if not problems:
        return None
    return (
        f"The checkpoint {path} does not fit the model: " + "; ".join(problems) + ". Load it into the model it was "
        "saved from, or skip missing and unexpected keys: `strict_loading = False` on the LightningModule, "
        "`fabric.load(..., strict=False)` with Fabric."
    )


# ------------------------------------------------------------------ agreement across ranks


def agreed(check: Callable[[], T], here: bool = True) -> T | None:
    """Run ``check`` (on this rank if ``here``), then :func:`agree`: its result, or the same error on every rank.

    Example:
        >>> agreed(lambda: 42)
        42
    """
    result, error = None, None
    if here:
        try:
            result = check()
        except (Exception, CheckpointException) as caught:  # DCP wraps a reader's error in the latter
            error = unwrapped(caught)
    agree(error)
    return result


def unwrapped(error: BaseException) -> BaseException:
    """The :class:`CheckpointIntegrityError` that a ``dcp.load`` wrapped into a ``CheckpointException``, else
    ``error``."""
    failures = error.failures.values() if isinstance(error, CheckpointException) else ()
    found = [failure for failure, _ in failures if isinstance(failure, CheckpointIntegrityError)]
    return found[0] if found else error


def agree(error: BaseException | None) -> None:
    """Raise on every rank if any rank found a problem (call on every rank, after each one's own check).

    One gather of each rank's message: every rank reaches the same decision, so none is left waiting in a
    collective of the load that the others abandoned.
    """
    message = None if error is None else f"{error}"
    found = [(rank, text) for rank, text in enumerate(all_gathered(message)) if text is not None]
    if not found:
        return
    if error is not None and isinstance(error, CheckpointIntegrityError):
        raise error
    rank, text = found[0]
    raise CheckpointIntegrityError(f"(found by rank {rank}) {text}") from error
