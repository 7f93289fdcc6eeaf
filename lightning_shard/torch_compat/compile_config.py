"""torch.compile's settings without a public name: the activation memory budget of its min-cut partitioner
(``torch._functorch.config.activation_memory_budget``), read and set.

Takes and gives a fraction between 0 and 1.
"""

from __future__ import annotations


def activation_memory_budget() -> float:
    """The current ``torch._functorch.config.activation_memory_budget`` (see :func:`set_activation_memory_budget`).

    Example:
        >>> 0.0 <= activation_memory_budget() <= 1.0
        True
    """
    import torch._functorch.config

    return torch._functorch.config.activation_memory_budget


def set_activation_memory_budget(budget: float) -> None:
    """``torch._functorch.config.activation_memory_budget``: the fraction of activations torch.compile's min-cut
    partitioner keeps for backward (1.0, its default: all it can; less: it recomputes the cheapest to recompute).
    Process-wide, read when a graph compiles.

    Example:
        >>> set_activation_memory_budget(0.5)  # doctest: +SKIP
    """
    import torch._functorch.config

    torch._functorch.config.activation_memory_budget = budget
