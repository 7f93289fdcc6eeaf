"""``StateLayout``: where a checkpoint keeps the model's weights, the optimizers' states and averaged copies.

Lightning's Trainer keeps them under ``"state_dict"``, ``"optimizer_states"`` (a list) and ``"averaged_model"`` (the
weight-averaging callback's copy); a Fabric program names them itself in the ``state`` it hands to ``fabric.save``
(``{"model": model, "optimizer": optimizer, "ema": averaged, ...}``). The
checkpoint machinery works on either: it shards and reads those entries as tensors and keeps everything else whole.
A checkpoint records its layout unless it is the Trainer's (whose checkpoints predate the record), so either
front-end finds the weights and optimizer states in the other's checkpoints: the one model's weights wherever they
are, optimizer states and averaged copies by name between two Fabric layouts and by position otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Recorded in checkpoints whose layout is not the Trainer's, next to the payload.
LAYOUT_KEY = "sharded_layout"
# Recorded in every sharded checkpoint: the world size that saved it (`lightning-shard inspect` shows it), and the
# mark by which a save recognises a checkpoint of this package that it may replace (`target`). Lightning ignores keys
# it does not know.
WORLD_SIZE_KEY = "sharded_world_size"

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class StateLayout:
    """The checkpoint keys of the weights and the optimizer states.

    Args:
        model: the top-level key of the model's state dict.
        optimizers: one top-level key holding a list of optimizer state dicts (the Trainer's), or a tuple of keys,
            one per optimizer (Fabric's, in the order of the ``state`` dict).
        averaged: the top-level keys of averaged copies of the model (``ShardedAveragedModel`` state dicts), in
            order; a checkpoint may hold fewer (the Trainer's holds one only with a weight-averaging callback).

    Example:
        >>> StateLayout().optimizer_paths(2)
        [('optimizer_states', 0), ('optimizer_states', 1)]
        >>> StateLayout("model", ("optimizer",)).optimizer_paths(1)
        [('optimizer',)]
    """

    model: str = "state_dict"
    optimizers: str | tuple[str, ...] = "optimizer_states"
    averaged: tuple[str, ...] = ("averaged_model",)

    @property
    def is_trainer(self) -> bool:
        return self == TRAINER_LAYOUT

    def optimizer_paths(self, count: int) -> list[Path]:
        """Where the first ``count`` optimizers' states are (a Fabric layout has exactly its own)."""
        if isinstance(self.optimizers, str):
            return [(self.optimizers, index) for index in range(count)]
        return [(key,) for key in self.optimizers[:count]]

    def tensor_keys(self) -> set[str]:
        """The top-level keys whose values are trees of tensors (sharded on save, filled in place on load)."""
        optimizers = [self.optimizers] if isinstance(self.optimizers, str) else self.optimizers
        return {self.model, *optimizers, *self.averaged}

    def sources(self, saved: StateLayout, count: int) -> list[Path]:
        """Where a checkpoint saved in ``saved`` keeps the states of this layout's first ``count`` optimizers.

        Raises:
            KeyError: a Fabric optimizer key the Fabric checkpoint does not hold, or fewer optimizers than ``count``
                in a Fabric checkpoint.
        """
        if isinstance(self.optimizers, tuple) and isinstance(saved.optimizers, tuple):
            missing = [key for key in self.optimizers[:count] if key not in saved.optimizers]
            if missing:
                raise KeyError(
                    f"The checkpoint holds no optimizer states under {missing}; it holds {list(saved.optimizers)}."
                )
            return [(key,) for key in self.optimizers[:count]]
        paths = saved.optimizer_paths(count)
        if len(paths) < count:
            raise KeyError(f"The checkpoint holds the states of {len(paths)} optimizer(s), not of {count}.")
        return paths

    def averaged_source(self, saved: StateLayout, key: str) -> str | None:
        """The key under which a checkpoint saved in ``saved`` may keep this layout's averaged copy ``key``: the same
        name, else the same position; ``None`` if it has none there.

        Example:
            >>> StateLayout("model", ("optimizer",), ("ema",)).averaged_source(StateLayout(), "ema")
            'averaged_model'
        """
        if key in saved.averaged:
            return key
        index = self.averaged.index(key)
        return saved.averaged[index] if index < len(saved.averaged) else None

    def record(self) -> dict[str, Any]:
        """What is saved under :data:`LAYOUT_KEY`: plain values, readable without lightning_shard."""
        optimizers = self.optimizers if isinstance(self.optimizers, str) else list(self.optimizers)
        return {"model": self.model, "optimizers": optimizers, "averaged": list(self.averaged)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> StateLayout:
        """The layout a checkpoint recorded; the Trainer's when it recorded none."""
        if not record:
            return TRAINER_LAYOUT
        optimizers = record["optimizers"]
        optimizers = optimizers if isinstance(optimizers, str) else tuple(optimizers)
        # Records written before averaged copies were recorded hold none.
        return cls(record["model"], optimizers, tuple(record.get("averaged", ())))


TRAINER_LAYOUT = StateLayout()
# Where the Trainer's checkpoints (and the exports reading them) find the model's weights.
MODEL_KEY = TRAINER_LAYOUT.model


def lookup(tree: Any, path: Path) -> Any:
    """The value at ``path`` in nested dicts and lists, or None.

    Example:
        >>> lookup({"optimizer_states": [{"state": {}}]}, ("optimizer_states", 0))
        {'state': {}}
        >>> lookup({"optimizer_states": []}, ("optimizer_states", 0)) is None
        True
    """
    for part in path:
        if isinstance(part, int) and isinstance(tree, list) and part < len(tree):
            tree = tree[part]
        elif isinstance(part, str) and isinstance(tree, Mapping) and part in tree:
            tree = tree[part]
        else:
            return None
    return tree
