"""FSDP2's private state: the parameter group behind a ``fully_shard`` unit, whether it is gathered, its forward
hooks around another method, the gradients kept between micro-batches, the re-registration of replaced parameters,
its comm interfaces (for the opt-in CPU transport) and its memory tracker (for the memory simulation).

Takes modules ``fully_shard`` was applied to; gives what FSDP2 keeps about them without a public name.

Example:
    >>> from torch import nn
    >>> fsdp_param_group(nn.Linear(2, 2)) is None  # not sharded: no FSDP state
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def fsdp_param_group(module: nn.Module) -> Any | None:
    """The ``FSDPParamGroup`` of a module ``fully_shard`` was applied to (its parameters, their gathered state);
    ``None`` for any other module or a unit without parameters of its own.

    Example:
        >>> fsdp_param_group(nn.Linear(2, 2)) is None
        True
    """
    if not isinstance(module, FSDPModule):
        return None
    return module._get_fsdp_state()._fsdp_param_group


def root_is_gathered(root: FSDPModule) -> bool:
    """Whether the unit's own parameters are all-gathered now (inside its forward, or kept after it), or it has
    none to gather.

    Example:
        >>> root_is_gathered(sharded_model)  # doctest: +SKIP
        False
    """
    group = fsdp_param_group(root)
    return group is None or group.is_unsharded


def call_as_fsdp_forward(root: FSDPModule, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``method(*args, **kwargs)`` inside ``root``'s FSDP pre- and post-forward, as torch's
    ``register_fsdp_forward_method`` runs a registered method: the unit's parameters are gathered for the call
    (and its floating inputs cast to the compute dtype), and gradients flowing back through the output are
    reduce-scattered in backward.

    Example:
        >>> call_as_fsdp_forward(sharded_model, sharded_model.model.generate, input_ids)  # doctest: +SKIP
    """
    state = root._get_fsdp_state()
    args, kwargs = state._pre_forward(root, args, kwargs)
    output = method(*args, **kwargs)
    return state._post_forward(root, args, output)


def unsharded_gradient(fsdp_param: Any) -> torch.Tensor | None:
    """The gradient FSDP2 keeps for one parameter between micro-batches whose reduce-scatter was skipped: the one
    upcast to the reduce dtype (mixed precision), or else the autograd gradient of the gathered parameter.

    Example:
        >>> grads = [unsharded_gradient(p) for p in fsdp_param_group(unit).fsdp_params]  # doctest: +SKIP
    """
    grad = fsdp_param.unsharded_accumulated_grad
    if grad is None and hasattr(fsdp_param, "_unsharded_param"):
        grad = fsdp_param._unsharded_param.grad
    return grad


def reregister_sharded_parameters(module: FSDPModule) -> None:
    """Make FSDP2 take the module's current sharded parameters as its own (after they were replaced, e.g. allocated
    from the meta device). ``FSDPModule._apply`` re-registers them (``FSDPParam.reset_sharded_param``) after any
    ``Module._apply``; this runs one that changes no tensor.

    Example:
        >>> reregister_sharded_parameters(unit)  # doctest: +SKIP
    """
    module._apply(lambda tensor: tensor, recurse=False)


def fsdp_comm_base_classes() -> tuple[type, type]:
    """FSDP2's ``AllGather`` and ``ReduceScatter`` comm interfaces (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` take instances). Imported on demand: only the opt-in CPU transport needs them.

    Example:
        >>> [cls.__name__ for cls in fsdp_comm_base_classes()]
        ['AllGather', 'ReduceScatter']
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def memory_simulation_tools() -> dict[str, Any]:
    """What ``lightning-shard estimate --mode simulate`` runs on: ``FakeTensorMode``, FSDP2's ``FSDPMemTracker``
    and its category enum, a function that tags a tensor with a category, and the fake process group's store.
    Imported on demand (they take seconds to import).

    Example:
        >>> sorted(memory_simulation_tools())
        ['FSDPMemTracker', 'FakeStore', 'FakeTensorMode', 'UNSHARDED_GRAD', 'tag']
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def tag(tracker: FSDPMemTracker, tensor: torch.Tensor, category: Any) -> None:
        tracker._update_and_maybe_create_winfos(tensor, category, update_existing=True)

    return {
        "FakeTensorMode": FakeTensorMode,
        "FSDPMemTracker": FSDPMemTracker,
        "FakeStore": FakeStore,
        "UNSHARDED_GRAD": _FSDPRefType.UNSHARDED_GRAD,
        "tag": tag,
    }
