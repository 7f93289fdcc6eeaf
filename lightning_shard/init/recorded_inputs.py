"""The real inputs a recorded construction read, kept so that the replay reads them as they were: small tensors by
value, large ones by reference with a digest of their bytes (checked when replayed), ``generator=`` arguments with
their state at the op.

Example:
    >>> RealValue.of(torch.ones(2)).changed()
    False
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Real tensors an op reads are kept by value up to this size (a later in-place change must not reach the replay);
# larger ones by reference, checked for changes (a digest of their bytes) when replayed.
_COPIED_REAL_NUMEL = 1 << 16


@dataclass(frozen=True)
class RealValue:
    """A real tensor an op read: kept by value (``copied``), or by reference with a digest of its bytes at that moment
    (a change through ``.data`` or by another view leaves its version counter as it was; the digest sees it).

    Example:
        >>> RealValue.of(torch.ones(2)).copied
        True
    """

    tensor: torch.Tensor
    digest: bytes
    copied: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> RealValue:
        if tensor.numel() <= _COPIED_REAL_NUMEL:
            return cls(tensor.detach().clone(), b"", True)
        return cls(tensor, tensor_digest(tensor), False)

    def changed(self) -> bool:
        return not self.copied and tensor_digest(self.tensor) != self.digest


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """A digest of ``tensor``'s values (read on the CPU).

    Example:
        >>> tensor_digest(torch.zeros(2)) == tensor_digest(torch.zeros(2))
        True
    """
    values = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return hashlib.blake2b(values.numpy().tobytes(), digest_size=16).digest()


@dataclass(frozen=True, eq=False)
class GeneratorAt:
    """A ``generator=`` argument and its state when the op ran: the replay draws from a copy at that state, so that
    the generator's use after the construction does not change what the replay draws."""

    generator: torch.Generator
    state: torch.Tensor

    def copy(self) -> torch.Generator:
        device = self.generator.device if self.generator.device.type not in ("meta", "cpu") else "cpu"
        return torch.Generator(device=device).set_state(self.state)
