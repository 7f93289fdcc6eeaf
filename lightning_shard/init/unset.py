"""Values that say "nothing wrote me": the guarantee under the initialisation rule that does not rest on the recorder.

In the replay the check does not rest on a value either: memory that ``torch.empty`` and its kin allocate is run twice,
once filled with the bytes ``0xFF`` and once with ``0x00`` (:func:`fill_twice`), and every op that reads it runs on both
(the same draws); a tensor whose two results differ anywhere depends on unwritten memory, whatever its dtype, and
whatever casts (``torch.empty(4).long()``) or ``empty`` implementations (``bool``, filled with True by torch) did to the
fill, while any value written on purpose (an int8 127, a uint8 255) is the same in both. The sentinel below remains for
what the replay does not run op by op (a library's init, a ``reset_parameters()`` of a module built outside a
recording).

Materialisation allocates every tensor it initialises filled with a sentinel - NaN for floating point (and complex)
dtypes, the largest value of an integer dtype, the byte ``0xFF`` (no valid ``bool``) for ``bool`` - and replays
``torch.empty`` and its kin the same way (torch's ``fill_uninitialized_memory`` under deterministic algorithms). After
the replay, a tensor that still holds a sentinel was written by nothing: neither the replay, nor a library's init, nor a
``reset_parameters()``. It is an error naming the tensor, never uninitialised memory handed to training, whatever the
recorder saw or missed.

The price of the rule: a model whose construction sets NaN or an integer dtype's largest value on purpose cannot be
built on the meta device (build it in ``__init__``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.utils.deterministic

from lightning_shard.torch_compat.dispatch import OpOverload, holds_values, op_base_name

# The ops that return memory they did not write.
_ALLOCATING = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)


def allocates_unwritten(func: object) -> bool:
    """Whether the ATen op ``func`` returns memory it did not write.

    Example:
        >>> allocates_unwritten(torch.ops.aten.empty_like.default), allocates_unwritten(torch.ops.aten.ones.default)
        (True, False)
    """
    return isinstance(func, OpOverload) and op_base_name(func) in _ALLOCATING


def fill_twice(buffer: torch.Tensor) -> torch.Tensor:
    """Fill the bytes of ``buffer`` (``uint8``) with ``0xFF``; return a copy filled with ``0x00``: two fills that
    differ in every bit, so that no cast or dtype maps them to one value.

    Example:
        >>> first = torch.zeros(2, dtype=torch.uint8); fill_twice(first), first
        (tensor([0, 0], dtype=torch.uint8), tensor([255, 255], dtype=torch.uint8))
    """
    buffer.fill_(0xFF)
    return torch.zeros_like(buffer)


@contextmanager
def uninitialized_memory_filled() -> Iterator[None]:
    """Inside, ``torch.empty`` (and every op that allocates without writing) returns sentinel-filled memory: torch's
    ``fill_uninitialized_memory``, which works under deterministic algorithms only (``warn_only``: nothing the replay
    runs is refused; on CPU, where the replay runs, the deterministic kernels compute the same values).

    Example:
        >>> with uninitialized_memory_filled():
        ...     torch.empty(2)
        tensor([nan, nan])
    """
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    previous_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = previous_fill
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def fill_unset(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` with its dtype's sentinel, in place.

    Example:
        >>> fill_unset(torch.zeros(2, dtype=torch.int8))
        tensor([127, 127], dtype=torch.int8)
    """
    if tensor.dtype == torch.bool:
        tensor.view(torch.uint8).fill_(0xFF)
    elif tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor


def edges(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views of the first and the last element of ``tensor`` where it is contiguous (the whole of it otherwise): where a
    tensor that is written whole or not at all (a load of a tensor the checkpoint stores whole) gets its sentinel and
    has it checked, without touching the rest of its memory.

    Example:
        >>> weight = torch.zeros(2, 3); [fill_unset(edge) for edge in edges(weight)]; holds_unset(weight[0, 1:2])
        [tensor([nan]), tensor([nan])]
        False
    """
    if not tensor.is_contiguous() or tensor.numel() <= 2:
        return [tensor]
    flat = tensor.view(-1)
    return [flat[:1], flat[-1:]]


def empty_bytes(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` of CPU memory as ``uint8``, holding ``dtype``'s sentinel (a replay buffer for a storage).

    Example:
        >>> empty_bytes(4, torch.float32).view(torch.float32)
        tensor([nan])
    """
    return fill_unset(torch.empty(nbytes // dtype.itemsize, dtype=dtype)).view(torch.uint8)


def holds_unset(tensor: torch.Tensor) -> bool:
    """Whether any element of ``tensor`` is its dtype's sentinel; a fake or meta tensor (the memory simulation's, a
    test's stand-in device) has no values and never holds one.

    Example:
        >>> holds_unset(torch.tensor([1.0, float("nan")])), holds_unset(torch.arange(3))
        (True, False)
    """
    if tensor.is_meta or not holds_values(tensor) or tensor.numel() == 0:
        return False
    # One pass that allocates nothing: the largest value, or a sum, which is NaN wherever a NaN is (and, rarely,
    # where +inf meets -inf: then the exact test decides).
    if tensor.dtype == torch.bool:
        return int(tensor.view(torch.uint8).max()) == 0xFF
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.sum().isnan()) and bool(tensor.isnan().any())
    return int(tensor.max()) == torch.iinfo(tensor.dtype).max
