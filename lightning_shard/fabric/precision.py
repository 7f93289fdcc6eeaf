"""``ShardedPrecision`` for Fabric: the shared :class:`~lightning_shard.plan.precision.PrecisionPolicy` (precision
string
-> FSDP2 ``MixedPrecisionPolicy``, parameter dtype, ``ShardedGradScaler``) on Fabric's ``Precision`` base class.

``Fabric(precision="bf16-mixed")`` and the other strings map exactly as ``Trainer(precision=...)`` does under the
Trainer strategy; this class adds only Fabric's hooks: scaling the loss in ``backward``, stepping through the grad
scaler and unscaling before ``fabric.clip_gradients``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.plan.precision import PrecisionPolicy


class ShardedPrecision(PrecisionPolicy, Precision):
    """Precision for :class:`lightning_shard.fabric.ShardedStrategy`; Fabric's ``precision=`` strings become it.

    Example:
        >>> ShardedPrecision("bf16-mixed").mp_policy.param_dtype
        torch.bfloat16
        >>> import lightning as L
        >>> fabric = L.Fabric(plugins=[ShardedPrecision("16-mixed")])  # fp16 on a CPU too  # doctest: +SKIP
    """

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        # The scaler skips the step when a gradient is not finite, and unscales first unless clipping did.
        step_output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self.scaler.update()
        return step_output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
