"""Averaged copies in saved checkpoints: which entry holds one, and its weights under the model's names.

A checkpoint keeps an averaged copy (:class:`~lightning_shard.averaging.ShardedAveragedModel`'s state dict, which is
``AveragedModel``'s: ``module.<name>`` per weight, plus ``n_averaged``) under a key its layout names: the Trainer's
``"averaged_model"``, or the key of the copy in a Fabric program's ``state``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import Tensor

from lightning_shard.checkpoint.layout import LAYOUT_KEY, StateLayout

# The prefix of the weights' names in an averaged copy's state dict.
AVERAGED_NAME_PREFIX = "module."


def averaged_key(layout: StateLayout, holds: Collection[str]) -> str | None:
    """The first averaged copy ``layout`` names that the checkpoint ``holds`` (its top-level keys), or None.

    Example:
        >>> averaged_key(StateLayout(), {"state_dict", "averaged_model"})
        'averaged_model'
    """
    return next((key for key in layout.averaged if key in holds), None)


def averaged_state_dict(checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
    """The averaged weights of a loaded full checkpoint (``torch.load``), under the model's names: what
    ``model.load_state_dict`` takes.

    Raises:
        ValueError: the checkpoint holds no averaged copy.

    Example:
        >>> averaged_state_dict({"averaged_model": {"module.weight": 1.0, "n_averaged": 3}})
        {'weight': 1.0}
    """
    key = averaged_key(StateLayout.from_record(checkpoint.get(LAYOUT_KEY)), set(checkpoint))
    if key is None:
        raise ValueError(
            "The checkpoint holds no averaged weights: it was written without a weight-averaging callback (Trainer) "
            "or a ShardedAveragedModel in the saved state (Fabric)."
        )
    prefix = AVERAGED_NAME_PREFIX
    return {name[len(prefix) :]: value for name, value in checkpoint[key].items() if name.startswith(prefix)}
