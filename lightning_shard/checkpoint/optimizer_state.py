"""Optimizer states of parameters that had none when the checkpoint was saved.

An optimizer creates a parameter's state at the first step that parameter has a gradient: a parameter that never had
one (a ``mask_token`` not used by the batches so far, an unused ``nn.Parameter``, a layer frozen until later) has no
entry in ``optimizer.state``, so the checkpoint holds none for it. torch's ``get_optimizer_state_dict`` of a fresh
optimizer - what a load fills in place - first runs a step with zero gradients that gives every parameter a state
(``step``, ``exp_avg``, ...). Loading must not ask the checkpoint for those entries (a strict load would fail with
``Missing key ... state.<name>.step``), and must leave such a parameter without state, as in the run that saved it:
an empty state, which every torch optimizer treats as none (it initialises a state whose ``len`` is 0 at the
parameter's first step, as for a parameter never seen) and which torch's strict ``set_optimizer_state_dict`` accepts
as the parameter's saved state. After the load the optimizer holds exactly the states the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

Path = tuple[str | int, ...]


def saved_parameter_names(saved_paths: Iterable[Path], source: Path) -> set[str]:
    """The parameter names that have optimizer state in a sharded checkpoint, among its entries' ``saved_paths``,
    for the optimizer whose state dict is at ``source``.

    Example:
        >>> paths = [("optimizer_states", 0, "state", "w", "step"), ("optimizer_states", 0, "param_groups")]
        >>> saved_parameter_names(paths, ("optimizer_states", 0))
        {'w'}
    """
    prefix = (*source, "state")
    return {str(path[len(prefix)]) for path in saved_paths if len(path) > len(prefix) and path[: len(prefix)] == prefix}


def without_unsaved(live_state: Mapping[str, Any], saved: Collection[str]) -> dict[str, Any]:
    """``live_state`` (an optimizer state dict keyed by parameter names) with an empty state for each parameter the
    checkpoint holds no state for: what a load fills (nothing, for those), and then hands to
    ``set_optimizer_state_dict``.

    Example:
        >>> without_unsaved({"state": {"w": {"step": 1}, "unused": {"step": 0}}, "param_groups": []}, {"w"})
        {'state': {'w': {'step': 1}, 'unused': {}}, 'param_groups': []}
    """
    state = {name: value if name in saved else {} for name, value in live_state["state"].items()}
    return {**live_state, "state": state}
