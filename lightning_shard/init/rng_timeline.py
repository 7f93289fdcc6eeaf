"""The random stream's timeline for the replay (:mod:`lightning_shard.init.replay`): rank 0's generator state where the
construction started and each change of it the recording saw (a seed, a ``set_rng_state``, ``fork_rng``'s save and
restore), as actions placed in program order; and the caller's own random state, put back after the replay.

Takes the construction logs; gives ``(position, action)`` pairs (:func:`rng_timeline`) and
:func:`callers_random_state_kept`.

Example:
    >>> [position for position, _ in rng_timeline([])]
    [-inf]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_shard.checkpoint.ranks import broadcast_object
from lightning_shard.init.construction_log import ConstructionLog, RngEvent
from lightning_shard.init.rng_watch import state_bytes


def rng_timeline(logs: list[ConstructionLog]) -> list[tuple[float, Callable[[], None]]]:
    """``(position, action)`` for each change of the CPU generator's state to replay: rank 0's state where the first
    recording started (before everything; without a recording, rank 0's state now), each recorded event, and the state
    at the start of a later recording when something outside the recordings changed it. Call on every rank: rank 0's
    states are broadcast.

    Example:
        >>> [position for position, _ in rng_timeline([])]
        [-inf]
    """
    logs = sorted(logs, key=_first_seq)
    starts = [log.rng_start for log in logs] if logs else [torch.get_rng_state()]
    states = _from_rank_zero(
        starts
        + [log.rng_end for log in logs]
        + [event.value for log in logs for event in _replayed_events(log) if event.action == "set"]
    )
    timeline: list[tuple[float, Callable[[], None]]] = [(-float("inf"), _set_state(states[0]))]
    ends, sets = states[len(starts) : len(starts) + len(logs)], iter(states[len(starts) + len(logs) :])
    slots: dict[int, torch.Tensor] = {}
    for index, log in enumerate(logs):
        if index and state_bytes(states[index]) != state_bytes(ends[index - 1]):
            timeline.append((_first_seq(log) - 0.5, _set_state(states[index])))
        for event in _replayed_events(log):
            timeline.append((event.seq, _event_action(event, next(sets) if event.action == "set" else None, slots)))
    return timeline


def _replayed_events(log: ConstructionLog) -> list[RngEvent]:
    """``log``'s generator events up to its last recorded op: later ones change no replayed value. The recording lasts
    until setup, so code between the build and setup that only one rank runs (rank 0 writing starting weights under
    ``fork_rng``) adds events on that rank alone."""
    last_op = max((op.seq for op in log.ops), default=-float("inf"))
    return [event for event in log.rng_events if event.seq < last_op]


def _event_action(event: RngEvent, state: torch.Tensor | None, slots: dict[int, torch.Tensor]) -> Callable[[], None]:
    if event.action == "set":
        assert state is not None
        return _set_state(state)
    if event.action == "save":
        return lambda: slots.__setitem__(event.value, torch.get_rng_state())
    return lambda: torch.set_rng_state(slots[event.value])


def _set_state(state: torch.Tensor) -> Callable[[], None]:
    return lambda: torch.set_rng_state(state)


def _first_seq(log: ConstructionLog) -> float:
    return min(
        (entry.seq for entry in itertools.chain(log.ops, log.rng_events, log.registrations)), default=float("inf")
    )


def _from_rank_zero(states: list[Any]) -> list[Any]:
    received = broadcast_object(states)
    if len(received) != len(states):
        raise RuntimeError(
            "The model's construction changed the random generator's state a different number of times on this rank "
            "than on rank 0: the ranks built different models. Build the same model on every rank."
        )
    return received


@contextmanager
def callers_random_state_kept() -> Iterator[None]:
    """Put this rank's own random states (CPU, and CUDA where initialised) back after the replay drew from rank 0's.

    Example:
        >>> with callers_random_state_kept():
        ...     _ = torch.manual_seed(0)
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
