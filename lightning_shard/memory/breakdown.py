"""The result of a memory estimate or simulation: bytes one rank holds, by category, on the device and the host."""

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds in one place (device or host), by category."""

    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    gathered_peak: int = 0
    activations: int = 0

    @property
    def total_bytes(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.gathered_peak + self.activations

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def to_dict(self) -> dict[str, int]:
        return {"total_bytes": self.total_bytes, **asdict(self)}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory of one training configuration; ``per_rank`` is device plus host."""

    n_params: int
    device: MemoryBreakdown
    cpu: MemoryBreakdown
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def per_rank(self) -> MemoryBreakdown:
        return self.device + self.cpu

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_params": self.n_params,
            "per_rank": self.per_rank.to_dict(),
            "device": self.device.to_dict(),
            "cpu": self.cpu.to_dict(),
            "config": self.config,
        }
