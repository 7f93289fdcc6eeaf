"""Gloo process groups beside the default one, for collectives that must never queue with training's: the stop vote
(:mod:`lightning_shard.core.preemption`), the background checkpoint save (:mod:`lightning_shard.checkpoint.io`) and,
on NCCL meshes, the split initialisation's exchange of host tensors (:mod:`lightning_shard.init.split_replay`).

One group per purpose and default process group, made on first use and reused by every later run in the process; it
ends with the default group (``dist.destroy_process_group()``). Making one is a collective: every rank asks for a
purpose at the same point of the program, as each caller does (at the start of a fit, of a background save, of the
materialisation).

Why not a group per run, destroyed after it: gloo can still be handling a peer's last protocol message for a group
after this rank's collective on it completed, and destroying the group frees what that message is handled with. With
one stop-vote group made and destroyed per fit, a rank of the architecture sweep (about 300 fits in one process) died
of SIGSEGV in gloo's transport thread (``tcp::Pair::handleRemotePendingSend -> free()``) in about 1 of 5 sweeps here
and in 2 CI runs of 2, while the main thread waited in the next collective on the default group. Reuse also spares a
rendezvous per run (a gloo group connects every pair of ranks).

Example:
    >>> vote_group = side_group("stop-vote")  # doctest: +SKIP
    >>> vote_group is side_group("stop-vote")  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

# purpose -> (the default group it was made beside, the group)
_GROUPS: dict[str, tuple[Any, dist.ProcessGroup]] = {}


def side_group(purpose: str) -> dist.ProcessGroup:
    """The gloo group for ``purpose`` beside the current default group; made (a collective: call on every rank) when
    there is none yet, or the default group was destroyed and made again since."""
    world = dist.group.WORLD
    held = _GROUPS.get(purpose)
    if held is not None and held[0] is world:
        return held[1]
    group = dist.new_group(backend="gloo")
    _GROUPS[purpose] = (world, group)
    return group


def forget_side_group(purpose: str) -> None:
    """Never hand out ``purpose``'s group again: a collective started on it may never complete (another rank failed),
    so a later one would be matched with it. The next :func:`side_group` makes a new one (a collective, as always)."""
    _GROUPS.pop(purpose, None)


def side_groups_held() -> list[dist.ProcessGroup]:
    """The groups this module keeps for the current default group (what a check of leaked groups should not count)."""
    world = dist.group.WORLD
    return [group for made_beside, group in _GROUPS.values() if made_beside is world]
