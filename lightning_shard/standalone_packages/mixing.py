"""Naming the two packages when a program mixes them: an object of this package made for ``lightning`` given to a
``pytorch_lightning`` Trainer (or the reverse) is refused with both names and the class to use instead.

Lightning's own refusals print the object (``Trainer(strategy=...)``, ``plugins=[...]``), so the strategies, the
checkpoint IO and the precision plugins take :func:`describe` as their ``repr``; callbacks reach no such check, so the
strategy's launcher calls :func:`check_one_lightning` before a run starts.

Example:
    >>> from lightning_shard import ShardedStrategy
    >>> print(describe(ShardedStrategy()).replace(" (", "\n("))
    <lightning_shard.ShardedStrategy for lightning.pytorch
    (with pytorch_lightning: lightning_shard.standalone.ShardedStrategy)>
"""

from __future__ import annotations

import sys
from typing import Any

from lightning_shard.standalone_packages.dependencies import PACKAGE
from lightning_shard.standalone_packages.rewrite import STANDALONE

# Each Lightning package, and its counterpart.
COUNTERPARTS = {
    "lightning.pytorch": "pytorch_lightning",
    "lightning.fabric": "lightning_fabric",
    "pytorch_lightning": "lightning.pytorch",
    "lightning_fabric": "lightning.fabric",
}


def lightning_package(cls: type) -> str | None:
    """The Lightning package ``cls`` derives from (``"lightning.pytorch"``, ``"pytorch_lightning"``, ...), if any.

    Example:
        >>> import lightning.pytorch as pl
        >>> lightning_package(pl.Callback)
        'lightning.pytorch'
    """
    for base in cls.__mro__:
        for package in COUNTERPARTS:
            if base.__module__ == package or base.__module__.startswith(package + "."):
                return package
    return None


def _public_name(cls: type) -> str:
    """``lightning_shard.ShardedStrategy`` rather than ``lightning_shard.trainer.strategy.ShardedStrategy`` where
    exported."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, cls.__name__, None) is cls:
            return f"{module.__name__}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _counterpart_name(cls: type) -> str:
    name = _public_name(cls)
    if name.startswith(STANDALONE + "."):
        return PACKAGE + name[len(STANDALONE) :]
    return STANDALONE + name[len(PACKAGE) :]


def describe(obj: Any) -> str:
    """A ``repr`` that says which Lightning package the object is for, and its class for the other one.

    Example:
        >>> from lightning_shard import ShardedCheckpointIO
        >>> describe(ShardedCheckpointIO()).split(" (")[0]
        '<lightning_shard.ShardedCheckpointIO for lightning.fabric'
    """
    cls = type(obj)
    package = lightning_package(cls)
    if package is None:
        return object.__repr__(obj)
    return f"<{_public_name(cls)} for {package} (with {COUNTERPARTS[package]}: {_counterpart_name(cls)})>"


def _is_standalone(package: str | None) -> bool:
    return package in ("pytorch_lightning", "lightning_fabric")


def check_one_lightning(trainer: Any) -> None:
    """Refuse this package's objects (strategy, checkpoint IO, precision, callbacks) made for the other Lightning
    package than ``trainer``'s, naming both packages and the class to use.

    Example:
        >>> import lightning.pytorch as pl
        >>> check_one_lightning(pl.Trainer(logger=False))  # nothing mixed: returns
    """
    trainer_package = lightning_package(type(trainer))
    strategy = trainer.strategy
    objects = [strategy, getattr(strategy, "checkpoint_io", None), getattr(strategy, "precision_plugin", None)]
    for obj in [*objects, *trainer.callbacks]:
        cls = type(obj)
        package = lightning_package(cls)
        if cls.__module__.startswith(PACKAGE + ".") and _is_standalone(package) != _is_standalone(trainer_package):
            raise TypeError(
                f"{_public_name(cls)} is made for {package}, but this Trainer is {trainer_package}'s: the two packages "
                f"hold the same code under different names, and one program must use one of them. With "
                f"`import {trainer_package}` use {_counterpart_name(cls)} (the same class, same arguments), or build "
                f"the Trainer from {COUNTERPARTS[str(trainer_package)]}."
            )
