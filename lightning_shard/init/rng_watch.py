"""The random generator's bookkeeping while a construction is recorded (:mod:`lightning_shard.init.construction`).

Takes the log being recorded; gives it the CPU generator's state changes that are no tensor ops
(:class:`~lightning_shard.init.construction_log.RngEvent`): :class:`GeneratorWatch` compares the state before each op
with the state it last explained, so a ``manual_seed``, ``seed()`` or ``set_rng_state`` by any name is recorded as the
state it left, and a ``get_rng_state()`` / ``set_rng_state()`` pair (``fork_rng``) as a save and a restore of one slot.
:data:`INTERNAL` marks the recorder's own reads of a generator's state, which are none of the model code's.

Example:
    >>> watch = GeneratorWatch(ConstructionLog(rng_start=torch.default_generator.get_state()))
    >>> _ = torch.manual_seed(0); watch.check(); [event.action for event in watch.log.rng_events]
    ['set']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_shard.init.construction_log import SEQUENCE, ConstructionLog, RngEvent
from lightning_shard.torch_compat.dispatch import torch_functions_off


def state_bytes(state: torch.Tensor | None) -> bytes:
    """A generator state's bytes, compared without a tensor op (none may run under the memory simulation's fake mode).

    Example:
        >>> state_bytes(torch.get_rng_state()) == state_bytes(torch.get_rng_state())
        True
    """
    if state is None:
        return b""
    with torch_functions_off():  # the recorder's own read: no torch-function mode around it sees it
        return state.numpy().tobytes()


class _Internal:
    """Marks the recorder's own calls (reading a generator's state), which the profile hook must not take for the
    model code's."""

    active = 0

    def run(self, call: Callable[[], Any]) -> Any:
        self.active += 1
        try:
            return call()
        finally:
            self.active -= 1


INTERNAL = _Internal()


class GeneratorWatch:
    """Notices changes of the CPU generator's state between the ops (see :class:`RngEvent`): any change that no
    recorded op or event explains is a seed or a state set by some name, recorded as the state it left."""

    def __init__(self, log: ConstructionLog) -> None:
        self.log = log
        self.last = state_bytes(log.rng_start)
        self.saved: dict[int, tuple[int, torch.Tensor]] = {}  # id(state tensor) -> (slot, the tensor, kept alive)
        self._reading = False  # reading the state runs torch ops, which the recorder sees

    def check(self) -> None:
        if self._reading:
            return
        state, raw = self._state()
        if raw != self.last:
            self.log.rng_events.append(RngEvent(next(SEQUENCE), "set", state))
            self.last = raw

    def explained(self) -> None:
        """The state changed through something already recorded (a real draw, a restored slot)."""
        self.last = self._state()[1]

    def _state(self) -> tuple[torch.Tensor, bytes]:
        """The state and its bytes. The generator's own method: a call of `torch.get_rng_state` would be seen by the
        profile hook; reading the bytes runs torch ops, which the recorder sees while checks are off."""
        self._reading = True
        try:
            state = torch.default_generator.get_state()
            return state, state_bytes(state)
        finally:
            self._reading = False

    def saved_state(self, state: torch.Tensor) -> None:
        slot = len(self.saved)
        self.saved[id(state)] = (slot, state)
        self.log.rng_events.append(RngEvent(next(SEQUENCE), "save", slot))

    def restoring(self, state: Any) -> bool:
        """Record ``set_rng_state(state)`` of a state saved while recording; False for any other state."""
        entry = self.saved.get(id(state))
        if entry is None or entry[1] is not state:
            return False
        self.log.rng_events.append(RngEvent(next(SEQUENCE), "restore", entry[0]))
        return True
