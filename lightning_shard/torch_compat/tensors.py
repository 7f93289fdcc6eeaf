"""A tensor's storage: its identity (shared by views, ``.data`` and parameters made from it, meta tensors included)
and how many references to it exist; whether a value is a random generator.

Takes tensors; gives their storage's key and use count.

Example:
    >>> a = torch.zeros(2)
    >>> storage_key(a) == storage_key(a[1:])
    True
"""

from __future__ import annotations

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (its C++ address): views, ``.data`` and an ``nn.Parameter`` made from a
    tensor share it, meta tensors included.

    Example:
        >>> weight = torch.empty(2, 2, device="meta")
        >>> storage_key(torch.nn.Parameter(weight)) == storage_key(weight[0])
        True
    """
    return tensor.untyped_storage()._cdata


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many references to ``tensor``'s storage exist (tensors, views, pending collectives).

    Example:
        >>> a = torch.zeros(2); before = storage_use_count(a); b = a.view(2)
        >>> storage_use_count(a) - before
        1
    """
    return torch._C._storage_Use_Count(storage_key(tensor))


def is_generator(value: object) -> bool:
    """Whether ``value`` is a ``torch.Generator``, without ``isinstance``: from torch 2.13 the class's metaclass
    (``torch._opaque_base.OpaqueBaseMeta``) answers ``isinstance`` in Python, about 1 us a miss, and the recorder asks
    it of every C call a construction makes.

    Example:
        >>> is_generator(torch.default_generator), is_generator(0)
        (True, False)
    """
    return issubclass(type(value), torch.Generator)
