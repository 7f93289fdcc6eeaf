"""Publishing a finished save: its staging folder or file takes the checkpoint's name with no moment at which that
name is missing, where the filesystem allows it.

A file replaces a file in one ``rename``. A folder cannot be renamed over a folder that has entries, so a sharded
checkpoint replacing another is swapped with it in one ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, glibc 2.28+; local
filesystems such as ext4, xfs, btrfs and tmpfs). The old one then lies at the staging name and is deleted. Where
the exchange is not available (macOS, NFS), the old checkpoint is moved aside into the staging folder first. A
kill between the two renames then leaves no checkpoint at the name; the old one is still complete in the staging
folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import sys
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# The kernel, libc or filesystem cannot exchange: fall back to moving aside.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV}


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


def publish(staging: Path, path: Path) -> None:
    """Move the finished save ``staging`` to ``path``, replacing a checkpoint there (see module docstring); then
    delete the replaced checkpoint and staging left at this name by saves interrupted earlier.

    Example:
        >>> staging = Path("ckpts/.lightning_shard_staging/last.ckpt.tmp-3f2a9b1c")
        >>> publish(staging, Path("ckpts/last.ckpt"))  # doctest: +SKIP
    """
    retired = staging.with_name(f"{path.name}.old-{staging.name.rsplit('-', 1)[-1]}")
    swap = staging.is_dir() and path.is_dir() and not path.is_symlink()
    if swap and exchange(staging, path):
        retired = staging  # the old checkpoint, now at the staging name
    else:
        if path.is_symlink() or (path.exists() and (path.is_dir() or staging.is_dir())):
            os.replace(path, retired)  # a file over a file needs no move
        os.replace(staging, path)
    for leftover in [retired, *staging.parent.glob(f"{glob.escape(path.name)}.tmp-*")]:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.exists() or leftover.is_symlink():
            leftover.unlink()
    with contextlib.suppress(OSError):  # still holds another save's staging, or a leftover of another name
        staging.parent.rmdir()
