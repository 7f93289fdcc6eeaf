"""torch's dispatch machinery: ATen ops (their schema arguments, whether they draw random numbers, their name
without the overload), dispatch and function modes (and leaving one from the middle of its stack), pytrees, and
whether a tensor holds values (not a fake tensor).

Takes ops, modes and tensors as a ``TorchDispatchMode`` sees them; gives what the initialisation record needs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_leaves, tree_map  # noqa: F401  (re-exported)

# The type of `torch.ops.aten.mm.default`: the selective-checkpointing policy's op names resolve to it.
OpOverload = torch._ops.OpOverload


def op_arguments(op: Any) -> list[Any]:
    """An ATen op's schema arguments (each with ``name`` and ``alias_info``: whether the op writes the argument).

    Example:
        >>> [a.name for a in op_arguments(torch.ops.aten.add_.Tensor)]
        ['self', 'other', 'alpha']
    """
    return list(op._schema.arguments)


@functools.cache
def draws_random_numbers(op: Any) -> bool:
    """Whether an ATen op consumes a random generator, decided from the op itself: torch tags every such op
    (``normal_``, ``randn``, ``randperm``, ``rand_like``, ``bernoulli``, ...) ``nondeterministic_seeded``, whether
    or not it takes a ``generator`` argument.

    Example:
        >>> draws_random_numbers(torch.ops.aten.randn.default), draws_random_numbers(torch.ops.aten.add.Tensor)
        (True, False)
    """
    return torch.Tag.nondeterministic_seeded in op.tags


def op_base_name(op: Any) -> str:
    """An ATen op's name without its overload: ``aten::fill_`` for ``aten::fill_.Scalar`` (``op.name()`` carries the
    overload since torch 2.x's ``OpOverload.name``, the schema's ``name`` never does).

    Example:
        >>> op_base_name(torch.ops.aten.empty.memory_format)
        'aten::empty'
    """
    return op._schema.name


def remove_mode(mode: Any) -> None:
    """Leave ``mode`` (a ``TorchDispatchMode`` or ``TorchFunctionMode`` entered with ``__enter__``) wherever it is on
    its stack: modes entered after it and still active are lifted off and put back (torch's ``__exit__`` pops the
    innermost mode, whichever it is). A mode not on its stack is left alone.

    Example:
        >>> mode = TorchDispatchMode(); _ = mode.__enter__(); remove_mode(mode)
    """
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if isinstance(mode, TorchFunctionMode):
        stack, pop, push = (
            _get_current_function_mode_stack(),
            torch._C._pop_torch_function_stack,
            torch._C._push_on_torch_function_stack,
        )
    else:
        stack = _get_current_dispatch_mode_stack()
        pop, push = (lambda: torch._C._pop_torch_dispatch_stack(None)), torch._C._push_on_torch_dispatch_stack
    if not any(entry is mode for entry in stack):
        return
    lifted = []
    while stack and stack[-1] is not mode:
        lifted.append(pop())
        stack.pop()
    mode.__exit__(None, None, None)
    for entry in reversed(lifted):
        push(entry)


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be read: not a fake tensor (``FakeTensorMode``, the memory simulation's: shape,
    dtype and device only; reading a value raises ``DataDependentOutputException``).

    Example:
        >>> holds_values(torch.zeros(2))
        True
    """
    from torch._subclasses.fake_tensor import is_fake  # imported by torch itself

    return not is_fake(tensor)
