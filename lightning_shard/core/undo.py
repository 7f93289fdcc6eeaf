"""``UndoLog``: everything a run changes outside the model, and how to put it back.

To do its work the strategy changes objects it does not own: an instance attribute on the user's
``ModelCheckpoint`` (linking ``last`` once a checkpoint is published), the Trainer's signal connector (the stop
handlers go in right after Lightning's), the class of a weight-averaging callback, the Trainer's evaluation loops, a
torch setting read process-wide (``torch._functorch.config.activation_memory_budget``), the callback list (the
strategy's preemption callback). Left in place, each follows its object into the next run: a callback handed to
another Trainer keeps linking through the first one's checkpoint IO, a fit that failed before Lightning registered
its handlers left the patch for the next fit to trip over, a setting meant for one run governs the next.

So every such change goes through the strategy's :class:`UndoLog`, which records how to undo it, and the strategy's
``teardown`` - which Lightning calls after every run, finished or failed - undoes them all, newest first. What
belongs to the sharded model itself (its FSDP units and their hooks, the wrappers that let its children be called
directly, its device mesh) stays: it lives as long as the model, whose parameters it shards.

Example:
    >>> class Saver:
    ...     pass
    >>> saver, log = Saver(), UndoLog()
    >>> log.set_attribute(saver, "link", print)
    >>> log.undo()
    >>> hasattr(saver, "link")
    False
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class UndoLog:
    """The undo actions of the changes made so far, run newest first by :meth:`undo`.

    Example:
        >>> undone = []
        >>> log = UndoLog()
        >>> log.add("first", lambda: undone.append(1))
        >>> log.add("second", lambda: undone.append(2))
        >>> log.undo()
        >>> undone, len(log)
        ([2, 1], 0)
    """

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []

    def __len__(self) -> int:
        return len(self._actions)

    def add(self, what: str, undo: Callable[[], None]) -> None:
        """Record ``undo``, the action that reverts the change ``what`` (named in a failure to undo it)."""
        self._actions.append((what, undo))

    def set_attribute(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, undone to what was there: the previous value of an attribute of the
        instance (or of a module, a torch config module included), else no instance attribute, so that the class's
        shows through again."""
        own = isinstance(owner, types.ModuleType) or name in getattr(owner, "__dict__", {})
        previous = getattr(owner, name) if own else None
        setattr(owner, name, value)
        if own:
            self.add(f"{_name_of(owner)}.{name}", lambda: setattr(owner, name, previous))
        else:
            self.add(f"{_name_of(owner)}.{name}", lambda: owner.__dict__.pop(name, None))

    def undo(self) -> None:
        """Run every undo action, newest first, and forget them. All run even if one fails; the first failure is
        raised afterwards (the others are logged)."""
        failures: list[BaseException] = []
        while self._actions:
            what, action = self._actions.pop()
            try:
                action()
            except Exception as error:  # the remaining actions must still run
                log.error(f"Undoing the change of {what} failed: {error!r}")
                failures.append(error)
        if failures:
            raise failures[0]


def _name_of(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, types.ModuleType) else type(owner).__name__
