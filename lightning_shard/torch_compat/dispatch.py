"""torch's dispatch machinery: ATen ops (their schema arguments, whether they draw random numbers, their name
without the overload), dispatch and function modes (and leaving one from the middle of its stack), pytrees, and
whether a tensor holds values (not a fake tensor).

Takes ops, modes and tensors as a ``TorchDispatchMode`` sees them; gives what the initialisation record needs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,  # noqa: F401  (re-exported)
    _disable_current_modes,
)

# The type of `torch.ops.aten.mm.default`: the selective-checkpointing policy's op names resolve to it.
OpOverload = torch._ops.OpOverload

# Leaves an op's arguments hold that are no containers: mapped without asking pytree, whose type checks cost more than
# the rest of recording an op (torch 2.13: an isinstance against every opaque type for each leaf).
_LEAF_TYPES = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
                         torch.memory_format})  # fmt: skip


def tree_map(fn: Any, tree: Any) -> Any:
    """``torch.utils._pytree.tree_map``, with plain tuples, lists and dicts (what ATen ops take and return) and their
    common leaves walked here; any other type goes to pytree, so the result is the same.

    Example:
        >>> tree_map(lambda x: x * 2, ((1, [2]), {"a": 3}))
        ((2, [4]), {'a': 6})
    """
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind([tree_map(fn, value) for value in tree])
    if kind is dict:
        return {key: tree_map(fn, value) for key, value in tree.items()}
    if kind in _LEAF_TYPES or isinstance(tree, torch.Tensor):
        return fn(tree)
    return _pytree.tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """``torch.utils._pytree.tree_leaves``, walked as :func:`tree_map` walks.

    Example:
        >>> tree_leaves(((1, [2]), {"a": None}))
        [1, 2, None]
    """
    leaves: list[Any] = []
    tree_map(leaves.append, tree)
    return leaves


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


def torch_functions_off() -> AbstractContextManager[None]:
    """Inside, no torch-function mode (``torch.device("meta")``, a recorder's) and no ``__torch_function__`` of a
    subclass runs: a context torch implements in C, cheap enough to enter for each recorded op, where each tensor
    query would otherwise call every mode's Python handler.

    Example:
        >>> with torch.device("meta"), torch_functions_off():
        ...     torch.ones(1).device
        device(type='cpu')
    """
    return torch._C.DisableTorchFunction()


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be read: not a fake tensor (``FakeTensorMode``, the memory simulation's: shape,
    dtype and device only; reading a value raises ``DataDependentOutputException``).

    Example:
        >>> holds_values(torch.zeros(2))
        True
    """
    from torch._subclasses.fake_tensor import is_fake  # imported by torch itself

    return not is_fake(tensor)


@contextmanager
def real_cpu_tensors() -> Iterator[None]:
    """Inside, new tensors are real CPU tensors whatever is active around: no dispatch mode (a recorder, the memory
    simulation's fake tensors) and the CPU as the default device (not a meta-device block).

    Example:
        >>> with torch.device("meta"), real_cpu_tensors():
        ...     torch.ones(1).device
        device(type='cpu')
    """
    # No torch-function mode either (a `torch.device("meta")` block is one): the default device is the CPU again, and
    # the many small ops of a stream jump pay no Python handler each.
    with _disable_current_modes(), torch_functions_off():
        yield
