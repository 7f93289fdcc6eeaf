"""``torch.optim`` internals: the multi-tensor form of ``swa_utils``' averaging functions (read from their code and
closure) and the devices the fused optimizer kernels run on.

Takes an averaging function; gives its ``_foreach`` form, or the fused kernels' device types.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.optim.swa_utils import get_ema_avg_fn, get_ema_multi_avg_fn, get_swa_avg_fn, get_swa_multi_avg_fn

# The code objects of the functions ``get_ema_avg_fn`` / ``get_swa_avg_fn`` return (inside ``torch.no_grad``'s
# wrapper): how a function is recognised as one of them.
_EMA_AVG_CODE = inspect.unwrap(get_ema_avg_fn()).__code__

_SWA_AVG_CODE = inspect.unwrap(get_swa_avg_fn()).__code__


def foreach_form(avg_fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """torch's multi-tensor (``_foreach``) form of an averaging function made by ``torch.optim.swa_utils``'s
    ``get_ema_avg_fn(decay)`` / ``get_swa_avg_fn()``: ``get_ema_multi_avg_fn(decay)`` / ``get_swa_multi_avg_fn()``,
    the same averages computed for a list of tensors at once. ``None`` for any other function, which is then called
    tensor by tensor as ``AveragedModel`` calls it. The decay is read from the function's closure.

    Example:
        >>> foreach_form(get_ema_avg_fn(0.99)).__qualname__
        'get_ema_multi_avg_fn.<locals>.ema_update'
        >>> foreach_form(lambda averaged, current, n: current) is None
        True
    """
    if avg_fn is None:
        return None
    function = inspect.unwrap(avg_fn)
    code = getattr(function, "__code__", None)
    if code is _EMA_AVG_CODE:
        return get_ema_multi_avg_fn(inspect.getclosurevars(function).nonlocals["decay"])
    if code is _SWA_AVG_CODE:
        return get_swa_multi_avg_fn()
    return None


def fused_kernel_devices() -> list[str]:
    """The device types torch's fused optimizer kernels (``fused=True``) run on (``torch.utils._foreach_utils``).

    Example:
        >>> "cpu" in fused_kernel_devices()
        True
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()
