"""The result of a memory estimate or simulation: bytes one rank holds, by category, on the device and the host."""

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds in one place (device or host), by category, at that place's peak.

    ``grads`` are the sharded gradients; ``accumulated_grads`` the whole gradients FSDP2 keeps between the
    micro-batches of one optimizer step when their reduce-scatter is skipped (``gradient_accumulation="unsharded"``).
    ``gathered_peak`` counts the per-unit transients: gathered parameters and the all-gather / reduce-scatter buffers.
    ``averaged_weights``: the fp32 averaged copy (EMA, SWA) of a weight-averaging run, sharded like the parameters.
    """

    params: int = 0
    grads: int = 0
    accumulated_grads: int = 0
    optimizer_states: int = 0
    gathered_peak: int = 0
    activations: int = 0
    averaged_weights: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(asdict(self).values())

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def to_dict(self) -> dict[str, int]:
        return {"total_bytes": self.total_bytes, **asdict(self)}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory of one training configuration; ``per_rank`` is device plus host.

    ``n_params`` counts every parameter, ``trainable_params`` those with gradients and optimizer states.
    ``simulation`` (simulate mode only): the simulating process's ``wall_seconds`` and ``peak_rss_bytes``.
    """

    n_params: int
    trainable_params: int
    device: MemoryBreakdown
    cpu: MemoryBreakdown
    config: dict[str, Any] = field(default_factory=dict)
    simulation: dict[str, float] | None = None

    @property
    def per_rank(self) -> MemoryBreakdown:
        return self.device + self.cpu

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_params": self.n_params,
            "trainable_params": self.trainable_params,
            "per_rank": self.per_rank.to_dict(),
            "device": self.device.to_dict(),
            "cpu": self.cpu.to_dict(),
            "config": self.config,
            **({"simulation": self.simulation} if self.simulation is not None else {}),
        }
