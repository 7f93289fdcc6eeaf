"""The per-library init rule: libraries that initialise their own models, as the materialiser asks them.

A library (transformers: :mod:`lightning_shard.hf.init` registers it on import) is asked, for each model being
materialised, "which of these modules are yours?" (:meth:`Library.claim`): it gives :class:`LibraryModel`\\ s, each
with the tensors it owns and the :class:`LibraryStep`\\ s it runs, where an eager build ran them. The plan
(:mod:`lightning_shard.init.init_plan`) places each step among the replayed ops; the step runs on full-size stand-ins of
the sharded parameters (:class:`~lightning_shard.init.full_size.FullSizeParameters`). The generic code never imports a
library: the registry is the only link.

Example:
    >>> register_library(my_library)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from lightning_shard.init.construction_log import ConstructionLog, HolderKey
from lightning_shard.init.full_size import FullSizeParameters


@dataclass(eq=False)
class LibraryStep:
    """One initialisation a library runs on its model.

    Attributes:
        position: where an eager build ran it, in the construction log (``math.inf``: not built under a recording).
        run: the initialisation, on every rank, given the materialiser's :class:`FullSizeParameters`.
        sets: the tensors it sets whole (:data:`~lightning_shard.init.construction_log.HolderKey`\\ s); the
            model's other tensors keep what their construction gave them.
    """

    position: float
    run: Callable[[FullSizeParameters], None]
    sets: set[HolderKey]


@dataclass(eq=False)
class LibraryModel:
    """A model that a library initialises itself, as :meth:`Library.claim` describes it to the materialiser.

    Attributes:
        module: the model (its place in ``modules()`` orders it when it was not built under a recording).
        tensors: the model's tensors (:data:`~lightning_shard.init.construction_log.HolderKey`\\ s): held outside
            it, they are refused.
        constructions: ids of the modules whose constructors' random draws are the library's to account for.
        replays_draws: whether those draws advance the stream, as in an eager build (not for a model whose weights are
            loaded from files: ``from_pretrained`` builds without drawing).
        steps: what the library runs, where, and what it sets.
    """

    module: nn.Module
    tensors: set[HolderKey]
    constructions: set[int]
    replays_draws: bool
    steps: list[LibraryStep] = field(default_factory=list)


class Library(Protocol):
    """A library that initialises its own models on the meta device (see :func:`register_library`)."""

    def construction_context(self) -> AbstractContextManager[None]:
        """Entered around every meta-device construction (e.g. to explain an error of the library's)."""

    def claim(self, root: nn.Module, logs: list[ConstructionLog]) -> list[LibraryModel]:
        """The models in ``root`` that are the library's."""


LIBRARIES: list[Library] = []


def register_library(library: Library) -> None:
    """Ask ``library`` first which modules are its own (the rule: :mod:`lightning_shard.init.materialize`);
    ``lightning_shard.hf`` registers transformers'.

    Example:
        >>> register_library(my_library)  # doctest: +SKIP
    """
    if library not in LIBRARIES:
        LIBRARIES.append(library)
