"""The precision plugin: Lightning precision strings -> FSDP2 ``MixedPrecisionPolicy``.

| ``precision=``  | stored (sharded) params | compute / all-gather | gradient reduce        | grad scaler         |
|-----------------|-------------------------|----------------------|------------------------|---------------------|
| ``"32-true"``   | fp32                    | fp32                 | fp32                   | -                   |
| ``"bf16-mixed"``| fp32                    | bf16                 | fp32 (``reduce_dtype``)| -                   |
| ``"16-mixed"``  | fp32                    | fp16                 | fp32 (``reduce_dtype``)| ``ShardedGradScaler`` |
| ``"bf16-true"`` | bf16                    | bf16                 | bf16                   | -                   |
| ``"16-true"``   | fp16                    | fp16                 | fp16                   | -                   |

Mixed precision is FSDP's module-level kind (parameters are cast when a unit is all-gathered), not autocast:
the fp32 sharded parameters stay the optimizer's master copy, so there is no second copy of the weights.
Gradients are reduced in fp32 by default, the safe choice torchtitan makes; pass ``reduce_dtype=torch.bfloat16``
to halve the reduce-scatter traffic (fairseq reduces in fp16 unless ``--fp32-reduce-scatter`` is given).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, get_args

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.standalone_packages.mixing import describe

ShardedPrecisionInput = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]

_COMPUTE_DTYPE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}
# Lightning spells some precisions in short forms; the accelerator connector normalises most of them already.
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}


class PrecisionPolicy:
    """The precision rules both front-ends share: a precision string, its dtypes (the table above), the
    ``MixedPrecisionPolicy`` for ``fully_shard``, the ``ShardedGradScaler`` for ``"16-mixed"``, and the contexts
    that build, feed and run the model. Lightning's Trainer and Fabric each have their own ``Precision`` base class
    with different backward / step hooks: :class:`ShardedPrecision` (Trainer) and
    :class:`lightning_shard.fabric.ShardedPrecision` (Fabric) put this mixin in front of theirs and add only those.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce for the mixed precisions
            (default fp32; ``torch.bfloat16`` / ``torch.float16`` trade accuracy for bandwidth).
        scaler: a ``ShardedGradScaler`` for ``"16-mixed"``. When omitted, the strategy creates one for its compute
            device in ``setup`` (:meth:`use_device`).

    Example:
        >>> ShardedPrecision("bf16-mixed").mp_policy.param_dtype
        torch.bfloat16
    """

    # Says which Lightning package the plugin is for: Lightning's refusal of the other one's prints it.
    __repr__ = describe

    def __init__(
        self,
        precision: ShardedPrecisionInput = "32-true",
        reduce_dtype: torch.dtype | None = None,
        scaler: Any | None = None,
    ) -> None:
        precision = PRECISION_ALIASES.get(str(precision), precision)  # type: ignore[assignment]
        supported = get_args(ShardedPrecisionInput)
        if precision not in supported:
            raise ValueError(
                f"`precision={precision!r}` is not supported by the sharded strategy; use one of {supported}."
            )
        check_reduce_dtype(reduce_dtype)
        if reduce_dtype is not None and "mixed" not in precision:
            raise ValueError(
                f"`reduce_dtype={reduce_dtype}` only applies to the mixed precisions; with `precision={precision!r}` "
                "gradients are reduced in the parameter dtype. Drop `reduce_dtype` or pick a '-mixed' precision."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"`precision={precision!r}` does not use a grad scaler, but one was given: {scaler}.")
        self.precision = precision  # type: ignore[assignment]
        self.reduce_dtype = reduce_dtype
        self.scaler = scaler
        self._compute_dtype = _COMPUTE_DTYPE[precision]

    def use_device(self, device: torch.device) -> None:
        """Create the default ``ShardedGradScaler`` for ``"16-mixed"`` on ``device``'s type, the accelerator the
        strategy computes on - not on whether this machine has CUDA: with CPU offload on a GPU the scaler copies its
        CPU inf flags to the device to reduce them over nccl, and a CPU job must not allocate on a GPU.

        Example:
            >>> plugin = ShardedPrecision("16-mixed")
            >>> plugin.use_device(torch.device("cpu"))
            >>> plugin.scaler._device
            'cpu'
        """
        if self.precision == "16-mixed" and self.scaler is None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device.type)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters are stored (and optimised) in: fp32 except for the '-true' half precisions."""
        return self._compute_dtype if self.precision.endswith("-true") else torch.float32

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` handed to every ``fully_shard`` call."""
        if not self.precision.endswith("-mixed"):
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self._compute_dtype, reduce_dtype=self.reduce_dtype or torch.float32)

    def convert_module(self, module: Module) -> Module:
        """Bring ``module`` to the stored dtype of the table above before it is sharded.

        '-true': the whole module in the precision's dtype (Lightning's FSDP plugin does the same). '-mixed': the
        floating-point parameters in fp32 whatever dtype the model was built in (a Hub config's ``torch_dtype:
        bfloat16``), since the sharded parameters are the optimizer's master weights (its states follow them); a
        bf16 checkpoint is then upcast as each rank reads its slices. Buffers stay as built: FSDP2 casts only
        parameters, and computed buffers (rotary ``inv_freq``) keep the dtype their model computes them in.

        Example:
            >>> layer = ShardedPrecision("bf16-mixed").convert_module(torch.nn.Linear(2, 2, dtype=torch.bfloat16))
            >>> layer.weight.dtype
            torch.float32
        """
        if self.precision.endswith("-true"):
            if _holds_only(module, self._compute_dtype):
                return module  # `.to` would walk every module to change nothing (15 ms at 350M, in every setup)
            return module.to(dtype=self._compute_dtype)
        with torch.no_grad():
            for param in module.parameters():  # each shared (tied) parameter once, and it stays shared
                if param.is_floating_point() and param.dtype != self.param_dtype:
                    param.data = param.data.to(self.param_dtype)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.param_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        # Mixed precision happens inside the FSDP units; only '-true' precisions change the default dtype so
        # tensors created during the step match the parameters.
        if self.precision.endswith("-true"):
            return _DtypeContextManager(self._compute_dtype)
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        if not self.precision.endswith("-true"):
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._compute_dtype)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class ShardedPrecision(PrecisionPolicy, Precision):
    """Precision for the Trainer's :class:`~lightning_shard.ShardedStrategy`: :class:`PrecisionPolicy` plus the
    Trainer's backward, optimizer-step and clipping hooks (the grad scaler around the closure).

    Example:
        >>> ShardedPrecision("bf16-mixed").mp_policy.param_dtype
        torch.bfloat16
    """

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # A `training_step` that returned None skipped backward: nothing to unscale or step. Unscaling anyway would
        # leave the scaler waiting for an `update()` that never comes, and the next step's unscale would raise.
        skipped = closure_result is None and model.automatic_optimization
        if not skipped:
            # Unscale before the clipping hook so `gradient_clip_val` sees true gradients.
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm(self.main_params(optimizer), clip_val)


def clip_grad_norm(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """Clip gradients to a global norm computed over all shards; returns the total norm (a plain tensor).

    torch's norm functions take DTensor gradients of one mesh and reduce the per-shard norms to the norm of the full
    gradient. Under tensor parallelism the gradients live on two meshes - the (data-parallel x tensor-parallel) mesh
    of the split layers and the data-parallel mesh of the rest - and the gradients of replicated parameters
    (:mod:`lightning_shard.plan.replicated`) are plain tensors, whole and equal on every rank. So the norm is taken per
    mesh (the plain ones locally), each reduced over its mesh, and those norms are combined (the norm of the norms):
    every element counted once, over both dimensions.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 3.0)
        >>> float(clip_grad_norm([p], 1.0))
        6.0
    """
    by_mesh: dict[Any, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = [
        _full(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite=error_if_nonfinite))
        for group in by_mesh.values()
    ]
    if not norms:
        return torch.tensor(0.0)
    total_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    for group in by_mesh.values():  # torch's foreach ops take the tensors of one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check_reduce_dtype(reduce_dtype: torch.dtype | None) -> None:
    """Raise ``TypeError`` unless ``reduce_dtype`` is None or a floating dtype.

    Example:
        >>> check_reduce_dtype(torch.bfloat16)
    """
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"`reduce_dtype={reduce_dtype!r}` must be a floating torch.dtype such as torch.float32.")


def _holds_only(module: Module, dtype: torch.dtype) -> bool:
    """Whether ``module.to(dtype=dtype)`` would change nothing: every floating-point tensor has ``dtype`` already, and
    so does the dtype a Lightning module reports (its ``dtype`` property, which ``.to`` sets)."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    floating = all(tensor.dtype == dtype for tensor in tensors if tensor.is_floating_point())
    return floating and getattr(module, "dtype", dtype) == dtype
