"""What each record of a ``torch.save`` zip holds, for error messages: ``data/3`` -> ``tensor state_dict.fc.weight``.

Read from the archive's pickle without building any tensor: its persistent ids name the storage records, and the
functions that rebuild tensors and parameters around them are replaced by ones that hand the record's name back.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Mapping
from typing import Any

_PICKLE = "data.pkl"


class _Storage(str):
    """A storage record's name where the pickle refers to it."""


def _rebuild(storage: Any, *args: Any, **kwargs: Any) -> Any:
    return storage


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, saved_id: Any) -> _Storage:
        return _Storage(f"data/{saved_id[2]}")  # ("storage", type, key, location, numel)

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch") and (name.startswith("_rebuild") or name.endswith("Storage")):
            return _rebuild
        return super().find_class(module, name)


def record_contents(archive: zipfile.ZipFile) -> dict[str, str]:
    """``{record: what it holds}`` for the records of the ``torch.save`` archive (``data/N`` -> its tensor's key
    path, ``data.pkl`` -> the pickle); empty if the pickle cannot be read.

    Example:
        >>> record_contents(zipfile.ZipFile("model.ckpt"))  # doctest: +SKIP
        {'data.pkl': 'the pickle: every non-tensor value and the tensors' shapes', 'data/0': 'tensor state_dict.w'}
    """
    names = {_PICKLE: "the pickle: every non-tensor value and every tensor's dtype and shape"}
    pickles = [name for name in archive.namelist() if name.endswith("/" + _PICKLE)]
    try:
        tree = _Unpickler(io.BytesIO(archive.read(pickles[0]))).load()
    except Exception:  # damaged, or a class that cannot be imported here: the record names stand alone
        return names
    for path, record in _storages(tree, ()):
        names.setdefault(record, "tensor " + ".".join(str(part) for part in path))
    return names


def _storages(tree: Any, path: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], _Storage]]:
    if isinstance(tree, _Storage):
        return [(path, tree)]
    if isinstance(tree, Mapping):
        return [found for key, value in tree.items() for found in _storages(value, (*path, key))]
    if isinstance(tree, (list, tuple)):
        return [found for i, value in enumerate(tree) for found in _storages(value, (*path, i))]
    if hasattr(tree, "__dict__"):
        return _storages(vars(tree), path)
    return []
