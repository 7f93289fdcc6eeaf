"""Every private torch name lightning-shard relies on, in one place.

FSDP2, torch.distributed.checkpoint and torch's dispatch machinery leave a few things we need without a public
name: the FSDP state behind a module, the parameter re-registration after ``_apply``, DCP's nested-dict writer and
its archive reader, the Hugging Face reader's per-request hook, the memory tracker's categories, a module's
non-persistent buffers, the decay inside ``get_ema_avg_fn``'s function. Each is reached
through this module only, so that a torch release that moves one breaks here, loudly, and in
``tests/test_torch_compat.py``, which exercises every name below.

Checked on torch 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (``scripts/torch_matrix.sh``; CI runs the tests on 2.11, 2.13 and
2.15). Where a name differs between versions, the difference is handled here and says so; no other module of the
package names a private torch attribute (``tests/test_torch_compat.py`` reads their source to keep it so).

Example:
    >>> from torch import nn
    >>> fsdp_param_group(nn.Linear(2, 2)) is None  # not sharded: no FSDP state
    True
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401  (re-exported)
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401  (re-exported)
from torch.distributed.checkpoint.state_dict import _gc_context as gc_paused  # noqa: F401  (re-exported)
from torch.distributed.checkpoint.utils import _create_file_view as file_view  # noqa: F401  (re-exported)
from torch.distributed.fsdp import FSDPModule
from torch.optim.swa_utils import get_ema_avg_fn, get_ema_multi_avg_fn, get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_leaves, tree_map  # noqa: F401  (re-exported)

# The type of `torch.ops.aten.mm.default`: the selective-checkpointing policy's op names resolve to it.
OpOverload = torch._ops.OpOverload

# torch's zip-archive reader (``torch.load`` uses it; ``get_record_offset`` is what ``torch.load(mmap=True)`` uses).
PyTorchFileReader = torch._C.PyTorchFileReader

# Module names that torch's wrappers insert into parameter names and its state-dict API leaves out again:
# activation checkpointing's ``CheckpointWrapper`` and ``torch.compile``'s ``OptimizedModule``.
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
HIDDEN_MODULE_NAMES = frozenset({CHECKPOINT_WRAPPED_MODULE, "_orig_mod"})


def visible_name(name: str) -> str:
    """A parameter's name as torch's state-dict API gives it: without the wrappers' module names.

    Example:
        >>> visible_name("layers.0._checkpoint_wrapped_module.attn.weight")
        'layers.0.attn.weight'
    """
    return ".".join(part for part in name.split(".") if part not in HIDDEN_MODULE_NAMES)


# Where torch.distributed.checkpoint's ``FileSystemReader.read_data`` reads each stored item from its file: a subclass
# that overrides it sees every item's bytes (lightning_shard.checkpoint.reader verifies their checksums there).
DCP_READER_SLICE_HOOK = "_slice_file"

# The per-request hook of torch.distributed.checkpoint's ``HuggingFaceStorageReader.read_data``: a subclass that
# overrides it reads each request its own way (lightning_shard.hf's slice reader).
HF_READER_REQUEST_HOOK = "_process_read_request"


# ---------------------------------------------------------------------------------------------------- FSDP2 state


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


# ---------------------------------------------------------------------------------------------------- averaging


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` is part of its state dict (``register_buffer(persistent=True)``).

    Example:
        >>> norm = nn.BatchNorm1d(2)
        >>> is_persistent_buffer(norm, "running_mean")
        True
    """
    return name not in module._non_persistent_buffers_set


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


# ---------------------------------------------------------------------------------------------------- DCP


def load_state_dict_from_keys(keys: set[str] | None, checkpoint_id: str, reader: Any = None) -> dict[str, Any]:
    """Read ``keys`` (all if ``None``) of a DCP checkpoint whole into this process, with no state dict to load into;
    ``reader``: its ``StorageReader`` (default: a ``FileSystemReader``).

    Example:
        >>> load_state_dict_from_keys({"global_step"}, "out/last.ckpt")  # doctest: +SKIP
        {'global_step': 200}
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # no_dist: the read is this process's alone, also inside a process group (torch's `_load_state_dict_from_keys`
    # would run collectives then, and hang when one rank reads, as `convert` does), as `dcp_to_torch_save` reads.
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=reader or FileSystemReader(checkpoint_id),
        planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    return state


def local_chunk(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of this rank's part of a DTensor in the global tensor: the chunk DCP saves and loads
    for it (``DTensor.__create_chunk_list__``).

    Example:
        >>> local_chunk(sharded_weight)  # doctest: +SKIP
        ((4, 0), (4, 8))
    """
    (chunk,) = dtensor.__create_chunk_list__()
    return tuple(chunk.offsets), tuple(chunk.sizes)


def check_hf_reader_hook(reader_class: type) -> None:
    """Fail loudly if ``HuggingFaceStorageReader`` no longer reads through the per-request hook a subclass
    overrides: the subclass would be bypassed silently and every rank would read whole files.

    Example:
        >>> from torch.distributed.checkpoint import HuggingFaceStorageReader
        >>> check_hf_reader_hook(HuggingFaceStorageReader)
    """
    if not callable(getattr(reader_class, HF_READER_REQUEST_HOOK, None)):
        raise RuntimeError(
            f"torch {torch.__version__}'s {reader_class.__name__} has no `{HF_READER_REQUEST_HOOK}`, which "
            "lightning_shard.hf's shard-wise reader overrides; this torch is outside the tested range (see "
            "pyproject.toml). Install a torch in that range."
        )


# ---------------------------------------------------------------------------------------------------- dispatch


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


# ---------------------------------------------------------------------------------------------------- processes


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (its C++ address): views, ``.data`` and an ``nn.Parameter`` made from a
    tensor share it, meta tensors included.

    Example:
        >>> weight = torch.empty(2, 2, device="meta")
        >>> storage_key(nn.Parameter(weight)) == storage_key(weight[0])
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


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout of a group's CPU backend (torch has no public getter); ``None`` if it cannot tell.

    Example:
        >>> group_timeout(dist.group.WORLD)  # doctest: +SKIP
        datetime.timedelta(seconds=1800)
    """
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def fsdp_comm_base_classes() -> tuple[type, type]:
    """FSDP2's ``AllGather`` and ``ReduceScatter`` comm interfaces (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` take instances). Imported on demand: only the opt-in CPU transport needs them.

    Example:
        >>> [cls.__name__ for cls in fsdp_comm_base_classes()]
        ['AllGather', 'ReduceScatter']
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be read: not a fake tensor (``FakeTensorMode``, the memory simulation's: shape,
    dtype and device only; reading a value raises ``DataDependentOutputException``).

    Example:
        >>> holds_values(torch.zeros(2))
        True
    """
    from torch._subclasses.fake_tensor import is_fake  # imported by torch itself

    return not is_fake(tensor)


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


def flatten_mesh_dims(mesh: Any, dims: tuple[str, ...], name: str) -> None:
    """Make ``mesh[name]`` the 1-D mesh over the dimensions ``dims`` together (``DeviceMesh._flatten``; torch has no
    public name for it): the strategy's ``"data_parallel"``, as Lightning's ``ModelParallelStrategy`` names it.

    Example:
        >>> flatten_mesh_dims(mesh, ("replicate", "shard"), "data_parallel")  # doctest: +SKIP
        >>> mesh["data_parallel"].size()  # doctest: +SKIP
        4
    """
    mesh[dims]._flatten(name)


def activation_memory_budget() -> float:
    """The current ``torch._functorch.config.activation_memory_budget`` (see :func:`set_activation_memory_budget`).

    Example:
        >>> 0.0 <= activation_memory_budget() <= 1.0
        True
    """
    import torch._functorch.config

    return torch._functorch.config.activation_memory_budget


def set_activation_memory_budget(budget: float) -> None:
    """``torch._functorch.config.activation_memory_budget``: the fraction of activations torch.compile's min-cut
    partitioner keeps for backward (1.0, its default: all it can; less: it recomputes the cheapest to recompute).
    Process-wide, read when a graph compiles.

    Example:
        >>> set_activation_memory_budget(0.5)  # doctest: +SKIP
    """
    import torch._functorch.config

    torch._functorch.config.activation_memory_budget = budget


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


def fused_kernel_devices() -> list[str]:
    """The device types torch's fused optimizer kernels (``fused=True``) run on (``torch.utils._foreach_utils``).

    Example:
        >>> "cpu" in fused_kernel_devices()
        True
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()
