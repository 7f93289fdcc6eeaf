"""What a save finds at its path, and whether it may replace it: nothing, a link, a checkpoint this package wrote, or
something else, which no save ever deletes or replaces.

Recognised without unpickling anything (the path may hold anything):

* a sharded checkpoint: a directory holding only torch.distributed.checkpoint's files (``.metadata`` and
  ``__R_N.distcp``) whose ``.metadata`` names the ``sharded_world_size`` entry every sharded save of this package
  writes (Trainer, Fabric and ``convert``, since the first release);
* a full checkpoint: a ``torch.save`` zip file whose pickle names ``pytorch-lightning_version`` (a Lightning
  Trainer's checkpoint, which a Trainer save to that path replaces, as Lightning's own strategies do) or
  ``sharded_layout`` (a Fabric checkpoint of this package);
* a symbolic link (``ModelCheckpoint(save_last="link")``'s ``last.ckpt``): the link is replaced, never what it points
  to; an empty directory counts as nothing.

A directory or file that is anything else - a results folder, a log folder passed by mistake, a checkpoint holding a
file someone added - is refused with an error naming it, before anything is written.
"""

from __future__ import annotations

import enum
import os
import re
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lightning_shard.checkpoint.layout import LAYOUT_KEY, WORLD_SIZE_KEY

_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
_DCP_METADATA = ".metadata"
_FULL_MARKERS = (b"pytorch-lightning_version", LAYOUT_KEY.encode())
_MAX_LISTED = 4


class Found(enum.Enum):
    NOTHING = "nothing"
    LINK = "a symbolic link"
    SHARDED = "a sharded checkpoint"
    FULL = "a full checkpoint"
    OTHER = "something else"


@dataclass(frozen=True)
class Target:
    """What is at a checkpoint path (``detail`` says why it is not a checkpoint of this package).

    Example:
        >>> Target.at(Path("missing.ckpt")).found
        <Found.NOTHING: 'nothing'>
    """

    found: Found
    is_directory: bool = False
    detail: str = ""

    @classmethod
    def at(cls, path: Path) -> Target:
        try:
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                return cls(Found.LINK)
            if stat.S_ISDIR(info.st_mode):
                found, detail = _directory(path)
                return cls(found, is_directory=True, detail=detail)
            if stat.S_ISREG(info.st_mode) and _is_full_checkpoint(path):
                return cls(Found.FULL)
        except FileNotFoundError:
            return cls(Found.NOTHING)
        except OSError as error:
            return cls(Found.OTHER, detail=f"it cannot be inspected: {error}")
        return cls(Found.OTHER, detail="not a torch.save zip file of a Lightning or lightning-shard checkpoint")

    def check_replaceable(self, path: Path, replace: bool = True) -> None:
        """Raise unless a save may put a new checkpoint at ``path``: always where there is nothing, and, if
        ``replace``, in place of a link or a checkpoint of this package.

        Raises:
            IsADirectoryError: a directory that is not one of these checkpoints.
            FileExistsError: a file that is not, or (``replace=False``) anything but nothing.
        """
        if self.found is Found.NOTHING or (replace and self.found is not Found.OTHER):
            return
        if self.found is Found.OTHER:
            kind = "a directory" if self.is_directory else "a file"
            problem = f"{path} is {kind} that is not a checkpoint written by lightning-shard ({self.detail})"
        else:
            problem = f"{path} holds {self.found.value}, and this writes only where there is nothing"
        message = (
            f"{problem}: it is never deleted or replaced. Write to another path, or delete {path} yourself if it is "
            "meant to go."
        )
        raise (IsADirectoryError if self.is_directory else FileExistsError)(message)


def _directory(path: Path) -> tuple[Found, str]:
    entries = sorted(os.listdir(path))
    if not entries:
        return Found.NOTHING, "an empty directory"
    foreign = [entry for entry in entries if entry != _DCP_METADATA and not _SHARD_FILE.fullmatch(entry)]
    if foreign:
        more = f" and {len(foreign) - _MAX_LISTED} more" if len(foreign) > _MAX_LISTED else ""
        return Found.OTHER, f"it holds {', '.join(foreign[:_MAX_LISTED])}{more}"
    metadata = path / _DCP_METADATA
    if len(entries) > 1 and metadata.is_file() and WORLD_SIZE_KEY.encode() in metadata.read_bytes():
        return Found.SHARDED, ""
    return Found.OTHER, "torch.distributed.checkpoint files that lightning-shard did not write, or an incomplete set"


def _is_full_checkpoint(path: Path) -> bool:
    """A ``torch.save`` zip whose pickle (not unpickled: searched) names one of the markers."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            return len(pickles) == 1 and any(marker in archive.read(pickles[0]) for marker in _FULL_MARKERS)
    except (OSError, zipfile.BadZipFile):
        return False
