"""Publishing a finished save: its staging folder or file takes the checkpoint's name, replacing only a checkpoint of
this package or a link (:class:`~lightning_shard.checkpoint.target.Target`), and a kill at any moment leaves the old
or the new checkpoint under the name, or the old one where the next save, load or launch puts it back.

A save is written into ``.lightning_shard_staging/NAME.tmp-XXXXXXXX`` beside its target (:func:`staging_path`).
A file replaces a file or a link in one ``rename``. A folder cannot be renamed over a folder that has entries, so a
sharded checkpoint replacing another is swapped with it in one ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, glibc
2.28+; local filesystems such as ext4, xfs, btrfs and tmpfs); the old one then lies at the staging name and is
deleted. Where the exchange is not available (macOS, NFS) the old checkpoint is first moved aside to
``NAME.old-XXXXXXXX`` in the staging folder; a kill before the second rename leaves no checkpoint at the name for a
moment, and :func:`restore_interrupted` (run by the next save or load of that path, and for the Trainer's checkpoint
folders when a run is launched, before Lightning looks for ``last`` checkpoints) renames it back. Whatever a kill
leaves in the staging folder besides (a half-written save, a replaced checkpoint not yet deleted) is deleted by the
next publish of that name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import logging
import os
import shutil
import sys
import uuid
from pathlib import Path

from lightning_shard.checkpoint.ranks import broadcast_object
from lightning_shard.checkpoint.target import Target

log = logging.getLogger(__name__)

# Holds saves being written: no "ckpt_" and no "last" in the name (see `staging_path`).
STAGING_DIR = ".lightning_shard_staging"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# The kernel, libc or filesystem cannot exchange: fall back to moving aside.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV}
# Staging entries: a save being written (`NAME.tmp-XXXXXXXX`), a checkpoint replaced or moved aside (`NAME.old-...`).
_KINDS = ("tmp", "old")


def staging_path(path: Path, shared: bool = True) -> Path:
    """Where a save to ``path`` is written before it is published: ``.lightning_shard_staging/NAME.tmp-XXXXXXXX``
    beside it; ``shared``: one name for all ranks (call on every rank), else this process's own.

    Lightning scans checkpoint folders by name - hpc numbering reads the digits after any ``ckpt_``
    (``.hpc_ckpt_2.ckpt.tmp-3f2a9b1c`` would count as version 23291), ``ckpt_path="last"`` matches ``last*.ckpt`` -
    but only the folder's own entries: inside a subfolder whose name has neither, a save killed half-way is never
    taken for a checkpoint. The same filesystem as ``path``, so publishing is a rename."""
    token = uuid.uuid4().hex[:8]
    if shared:
        token = broadcast_object(token)  # rank 0's
    return path.parent / STAGING_DIR / f"{path.name}.tmp-{token}"


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries at ``a`` and ``b`` in one rename; False (nothing done) where that is not supported.

    Example:
        >>> staging = Path("ckpts/.lightning_shard_staging/last.ckpt.tmp-3f2a9b1c")
        >>> exchange(staging, Path("ckpts/last.ckpt"))  # doctest: +SKIP
        True
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def publish(staging: Path, path: Path, replace: bool = True) -> None:
    """Move the finished save ``staging`` to ``path`` (see module docstring); then delete what it replaced and what
    saves interrupted earlier left at this name. ``replace=False``: only where there is nothing (or an empty
    directory). Call on one process.

    Raises:
        IsADirectoryError, FileExistsError: ``path`` holds something that is not a checkpoint of this package (see
            :meth:`Target.check_replaceable`); ``staging`` is left for the caller.

    Example:
        >>> staging = Path("ckpts/.lightning_shard_staging/last.ckpt.tmp-3f2a9b1c")
        >>> publish(staging, Path("ckpts/last.ckpt"))  # doctest: +SKIP
    """
    restore_interrupted(path)
    # Checked again here, not only when the save started: an async save or an export publishes minutes later.
    Target.at(path).check_replaceable(path, replace)
    retired = staging.with_name(f"{path.name}.old-{staging.name.rsplit('-', 1)[-1]}")
    if _is_directory(path) and not any(path.iterdir()):
        path.rmdir()  # an empty directory; fails, leaving it, if something was put into it since it was checked
    if _is_directory(staging) and _is_directory(path) and exchange(staging, path):
        retired = staging  # the old checkpoint, now at the staging name
    else:
        if os.path.lexists(path) and (_is_directory(path) or _is_directory(staging)):
            os.replace(path, retired)  # a file over a file or a link needs no move
        os.replace(staging, path)
    for leftover in _leftovers(path, _KINDS):
        delete(leftover)
    discard(retired)


def publish_link(target: Path, link: Path) -> None:
    """Make ``link`` a symbolic link to ``target`` (relative to ``link``'s folder), replacing what :func:`publish`
    replaces, in one rename. Call on one process.

    Example:
        >>> publish_link(Path("ckpts/epoch=0-step=500.ckpt"), Path("ckpts/last.ckpt"))  # doctest: +SKIP
    """
    staging = staging_path(link, shared=False)
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.symlink_to(os.path.relpath(target, link.parent))  # resolved where it lands, not in the staging folder
    try:
        publish(staging, link)
    finally:
        discard(staging)  # left there only if the publish failed


def restore_interrupted(path: Path) -> bool:
    """Put back the checkpoint a publish without the exchange moved aside, if a kill left ``path`` without one;
    whether it did. Safe to run on several processes at once (one rename wins, the others find nothing to do).

    Example:
        >>> restore_interrupted(Path("ckpts/last.ckpt"))  # doctest: +SKIP
        False
    """
    if os.path.lexists(path):
        return False
    for retired in sorted(_leftovers(path, ("old",)), key=_modified, reverse=True):
        # A rename onto a name that another process restored meanwhile fails: a directory over a directory with
        # entries, or over a file, is refused by the kernel; the source being gone means it was restored.
        with contextlib.suppress(OSError):
            os.rename(retired, path)
            log.warning(f"Restored {path} from {retired}: a save publishing it was interrupted between two renames.")
            return True
    return False


def restore_interrupted_in(directory: Path) -> list[Path]:
    """:func:`clean_leftovers` for every checkpoint name that has something in ``directory``'s staging folder: what
    a launch runs before Lightning scans the folder for checkpoints; the paths restored.

    Example:
        >>> restore_interrupted_in(Path("ckpts"))  # doctest: +SKIP
        [PosixPath('ckpts/last.ckpt')]
    """
    staging = Path(directory) / STAGING_DIR
    entries = [entry.name.rsplit(".", 1) for entry in staging.glob("*.*-*")] if staging.is_dir() else []
    names = {name for name, kind in entries if kind.split("-", 1)[0] in _KINDS}
    return [Path(directory) / name for name in sorted(names) if clean_leftovers(Path(directory) / name)]


def clean_leftovers(path: Path) -> bool:
    """Put back a checkpoint an interrupted publish moved aside (:func:`restore_interrupted`), then delete what
    saves of ``path`` killed or failed earlier left in the staging folder (half-written saves, replaced checkpoints
    not yet deleted); whether a checkpoint was put back. Run by rank 0 when a save or a load of ``path`` starts,
    once the saves in flight in this process are over, and at launch: nothing else may be writing this name then.

    Example:
        >>> clean_leftovers(Path("ckpts/last.ckpt"))  # doctest: +SKIP
        False
    """
    restored = restore_interrupted(path)
    leftovers = _leftovers(path, _KINDS) if os.path.lexists(path) else _leftovers(path, ("tmp",))
    for leftover in leftovers:
        with contextlib.suppress(OSError):  # a read-only filesystem: left for a later attempt
            delete(leftover)
    if leftovers:
        with contextlib.suppress(OSError):
            (path.parent / STAGING_DIR).rmdir()
    return restored


def _leftovers(path: Path, kinds: tuple[str, ...]) -> list[Path]:
    staging = path.parent / STAGING_DIR
    return [entry for kind in kinds for entry in staging.glob(f"{glob.escape(path.name)}.{kind}-*")]


def _modified(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:  # restored by another process meanwhile
        return 0.0


def _is_directory(path: Path) -> bool:
    """A directory itself, not a link to one."""
    return path.is_dir() and not path.is_symlink()


def discard(staging: Path) -> None:
    """Delete ``staging`` (a save that failed, or what a publish replaced), then the staging folder if nothing else
    is in it."""
    delete(staging)
    with contextlib.suppress(OSError):  # still holds another save's staging, or a leftover of another name
        staging.parent.rmdir()


def delete(path: Path) -> None:
    """Delete the directory, file or link (not what it points to) at ``path``, if any."""
    if _is_directory(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()
