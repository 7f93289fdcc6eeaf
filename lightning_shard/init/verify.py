"""Verify: after the replay, nothing a model is trained with holds memory that nothing wrote.

Takes the tensors materialisation allocated (``(name, module, table, name in module)``) and what the replay found
(id of each live tensor it wrote -> whether every element was written); gives nothing, or a ``RuntimeError`` naming
each tensor that nothing wrote, the same on every rank. The safety net that does not rest on the recorder: every
allocated tensor started as a sentinel (:mod:`lightning_shard.init.unset`), so one that still holds it, or that the
replay found depending on unwritten memory, was written by nothing - never uninitialised memory handed to training.
Tensors left to a checkpoint load are checked after it (:func:`~lightning_shard.init.init_skip.defer_check`).

Example:
    >>> layer = nn.Linear(2, 2)
    >>> refuse_unwritten([("weight", layer, "_parameters", "weight")], {})  # written: no error
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.checkpoint.ranks import all_gathered
from lightning_shard.init.names import shown
from lightning_shard.init.shard_init import local
from lightning_shard.init.unset import edges, holds_unset
from lightning_shard.torch_compat.dispatch import holds_values


def refuse_unwritten(
    allocated: list[tuple[str, nn.Module, str, str]],
    replayed: dict[int, bool],
    by_load: bool = False,
    at_edges: frozenset[str] = frozenset(),
) -> None:
    """The safety net (:mod:`lightning_shard.init.unset`): a tensor the replay found depending on unwritten memory
    (``replayed``: id of each live tensor it wrote -> whether every element was written), or one that something else
    initialised and that still holds the sentinel, was written by nothing. Those named in ``at_edges`` hold it in
    their first and last elements only (:func:`~lightning_shard.init.unset.edges`). Every rank checks its shards, then
    all raise the same error. Fake tensors (the memory simulation) have no values to check."""
    live = [(name, module.__dict__[table][key]) for name, module, table, key in allocated]
    tensors = [(name, local(tensor), replayed.get(id(tensor))) for name, tensor in live]
    if not any(holds_values(tensor) for _, tensor, _ in tensors):
        return
    unset = [
        name for name, tensor, full in tensors if full is False or (full is None and _unset(name, tensor, at_edges))
    ]
    gathered = all_gathered(unset)
    unset = [name for name, _, _ in tensors if any(name in names for names in gathered)]
    if unset and by_load:
        raise RuntimeError(
            f"The checkpoint loaded after setup holds {shown(unset)}, so materialisation left them to it, but the "
            "load did not write them: they would hold uninitialised memory. Check that the checkpoint's tensors load "
            "into this model (names, `strict_loading`), or load it after `fit` has set the model up."
        )
    if unset:
        raise RuntimeError(
            f"The model was built on the meta device, but nothing its construction did wrote {shown(unset)}, so they "
            "would hold uninitialised memory (an eager build leaves them so too: `torch.empty`, never written). "
            "Initialise them in their module's constructor (`nn.init.*`, or call `self.reset_parameters()` there), "
            "or build the model in `__init__`."
        )


def _unset(name: str, tensor: torch.Tensor, at_edges: frozenset[str]) -> bool:
    return any(holds_unset(part) for part in edges(tensor)) if name in at_edges else holds_unset(tensor)
