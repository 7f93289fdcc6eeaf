"""Lightning ``FSDPStrategy`` / ``ModelParallelStrategy`` arguments and FSDP1 objects, met at construction.

Users arrive with FSDP1 habits: ``ShardingStrategy.FULL_SHARD`` or ``"full_shard"``, ``CPUOffload(...)``,
``ModuleWrapPolicy({Block})``, ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``,
``activation_checkpointing_policy=``. Where the meaning is the same under FSDP2 they are translated to
:class:`~lightning_shard.ShardedStrategy`'s own settings; otherwise the strategy refuses them when it is built,
with an error naming the replacement - never later, after the ranks have started.

Example:
    >>> from torch.distributed.fsdp import ShardingStrategy
    >>> translate_fsdp_strategy_arguments({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, {}, [])
    {'sharding_strategy': 'SHARD_GRAD_OP'}
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.distributed.fsdp import wrap as fsdp1_wrap

# Lightning / FSDP1 names with no FSDP2 counterpart to translate to: the reason and the replacement.
_REFUSED = {
    "mixed_precision": "FSDP2 mixed precision comes from `Trainer(precision='bf16-mixed')` (or '16-mixed', "
    "'bf16-true', ...); choose the gradient-reduction dtype with `ShardedStrategy(reduce_dtype=torch.float32)`",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors); drop it",
    "limit_all_gathers": "FSDP2 bounds the all-gathers in flight itself; drop it",
    "backward_prefetch": "FSDP2 prefetches the next unit's all-gather in backward by default; drop it (for forward: "
    "`forward_prefetch=True`)",
    "sync_module_states": "a model built in `__init__` is broadcast from rank 0 before sharding and a "
    "`configure_model()` model is initialised from rank 0's random stream; drop it",
    "param_init_fn": "a model built on the meta device is initialised after sharding by its modules' "
    "`reset_parameters()` (Hugging Face models: their `_init_weights`); put the init there and drop it",
    "ignored_modules": "every parameter is sharded; to keep parameters out of training set `requires_grad=False`",
    "ignored_states": "every parameter is sharded; to keep parameters out of training set `requires_grad=False`",
    "device_id": "the strategy places each rank on its device; drop it",
    "process_group": "the strategy builds the process group and the device mesh; for hybrid sharding pass "
    "`sharding_strategy='HYBRID_SHARD', hybrid_shard_size=N`",
    "data_parallel_size": "the data-parallel size is the world size divided by `tensor_parallel_size` (FSDP shards "
    "over it; `hybrid_shard_size` for a 2-D data-parallel mesh); drop it",
}
_RENAMED = ("activation_checkpointing_policy", "save_distributed_checkpoint", "device_mesh")


def translate_fsdp_strategy_arguments(
    settings: dict[str, Any], extra: dict[str, Any], accepted: Sequence[str]
) -> dict[str, Any]:
    """``settings`` (ShardedStrategy's own arguments) with Lightning's FSDP names in ``extra`` and FSDP1 values
    translated.

    Raises:
        TypeError: for a name neither ShardedStrategy nor Lightning's FSDP strategies know, listing ``accepted``.
        ValueError / TypeError: for a known name or value with no FSDP2 meaning, naming the replacement.
    """
    unknown = [name for name in extra if name not in _REFUSED and name not in _RENAMED]
    if unknown:
        raise TypeError(
            f"ShardedStrategy() got an unexpected keyword argument {unknown[0]!r}. Its arguments: {list(accepted)}; "
            f"it also takes Lightning FSDPStrategy's {list(_RENAMED)} (translated)."
        )
    for name in extra:
        if name in _REFUSED:
            raise ValueError(
                f"ShardedStrategy does not take `{name}=` (an FSDPStrategy / FSDP1 argument): {_REFUSED[name]}."
            )
    settings = dict(settings)
    _rename_activation_checkpointing_policy(settings, extra)
    _rename_save_distributed_checkpoint(settings, extra)
    if "state_dict_type" in settings and settings["state_dict_type"] is None:
        settings["state_dict_type"] = "sharded"  # the default, once save_distributed_checkpoint had its say
    _rename_device_mesh(settings, extra)
    if "sharding_strategy" in settings:
        _translate_sharding_strategy(settings)
    if "cpu_offload" in settings:
        settings["cpu_offload"] = _cpu_offload(settings["cpu_offload"])
    for argument in ("auto_wrap_policy", "activation_checkpointing"):
        if argument in settings:
            settings[argument] = translate_policy(settings[argument], argument)
    return settings


def translate_policy(policy: Any, argument: str) -> Any:
    """An FSDP1 wrap policy as our policy forms: ``ModuleWrapPolicy`` / ``transformer_auto_wrap_policy`` -> the
    classes, ``lambda_auto_wrap_policy`` -> its function, ``always_wrap_policy`` -> every module; anything else
    FSDP1-shaped is refused. Other values pass through unchanged.

    Example:
        >>> from torch import nn
        >>> translate_policy(fsdp1_wrap.ModuleWrapPolicy({nn.Linear}), "auto_wrap_policy")
        {<class 'torch.nn.modules.linear.Linear'>}
    """
    if isinstance(policy, fsdp1_wrap.ModuleWrapPolicy):
        return set(policy._module_classes)
    func = policy.func if isinstance(policy, functools.partial) else policy
    keywords = policy.keywords if isinstance(policy, functools.partial) else {}
    if func is fsdp1_wrap.transformer_auto_wrap_policy and "transformer_layer_cls" in keywords:
        return set(keywords["transformer_layer_cls"])
    if func is fsdp1_wrap.lambda_auto_wrap_policy and "lambda_fn" in keywords:
        return keywords["lambda_fn"]
    if func is fsdp1_wrap.always_wrap_policy:
        return lambda module: True
    if func is fsdp1_wrap.size_based_auto_wrap_policy:
        min_num_params = keywords.get("min_num_params", int(1e8))
        raise ValueError(
            f"`{argument}=size_based_auto_wrap_policy`: FSDP1's size rule also skips ModuleList / ModuleDict "
            f"containers; pass our size rule as an int, `{argument}={min_num_params}` (a unit holds at least that "
            "many parameters not already in a smaller unit), or the block classes."
        )
    if is_fsdp1_policy(policy):
        raise TypeError(
            f"`{argument}={policy!r}` is an FSDP1 policy (called with `module, recurse, nonwrapped_numel`) that "
            "cannot be translated; pass the block classes (`{Block}` or `['Block']`), an int minimum parameter "
            "count, or a callable `module -> bool`."
        )
    return policy


def is_fsdp1_policy(policy: Any) -> bool:
    """Whether ``policy`` is an FSDP1 wrap policy: a ``_Policy`` object, a function of ``torch.distributed.fsdp.wrap``
    (or a ``partial`` of one), or any callable taking FSDP1's ``recurse`` argument.

    Example:
        >>> is_fsdp1_policy(lambda module: True)
        False
    """
    if isinstance(policy, fsdp1_wrap._Policy):
        return True
    func = policy.func if isinstance(policy, functools.partial) else policy
    if getattr(func, "__module__", None) == fsdp1_wrap.__name__:
        return True
    if not callable(policy) or isinstance(policy, type):
        return False
    try:
        return "recurse" in inspect.signature(policy).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def _translate_sharding_strategy(settings: dict[str, Any]) -> None:
    value = settings["sharding_strategy"]
    if isinstance(value, ShardingStrategy):
        value = value.name
    if isinstance(value, str) and value.upper() in ShardingStrategy.__members__:
        value = value.upper()  # Lightning's FSDPStrategy accepts any case
    if value == "_HYBRID_SHARD_ZERO2":
        # FSDP1's HYBRID_SHARD that keeps the parameters gathered from forward to backward.
        if settings.get("reshard_after_forward") not in (None, False):
            raise ValueError(
                "`sharding_strategy=_HYBRID_SHARD_ZERO2` keeps parameters gathered after forward, which contradicts "
                f"`reshard_after_forward={settings['reshard_after_forward']!r}`; drop one of them."
            )
        value = "HYBRID_SHARD"
        settings["reshard_after_forward"] = False
    settings["sharding_strategy"] = value


def _cpu_offload(value: Any) -> Any:
    if isinstance(value, CPUOffload):
        return bool(value.offload_params)
    return False if value is None else value


def _rename_activation_checkpointing_policy(settings: dict[str, Any], extra: dict[str, Any]) -> None:
    if "activation_checkpointing_policy" not in extra:
        return
    if settings.get("activation_checkpointing") is not None:
        raise ValueError(
            "Pass `activation_checkpointing=` (ShardedStrategy's name) or `activation_checkpointing_policy=` "
            "(FSDPStrategy's), not both."
        )
    settings["activation_checkpointing"] = extra["activation_checkpointing_policy"]


def _rename_save_distributed_checkpoint(settings: dict[str, Any], extra: dict[str, Any]) -> None:
    if "save_distributed_checkpoint" not in extra:
        return
    value = extra["save_distributed_checkpoint"]
    if not isinstance(value, bool):
        raise TypeError(f"`save_distributed_checkpoint={value!r}` must be True or False.")
    wanted = "sharded" if value else "full"
    if settings.get("state_dict_type") not in (None, wanted):
        raise ValueError(
            f"`save_distributed_checkpoint={value}` contradicts `state_dict_type={settings['state_dict_type']!r}`; "
            "pass only `state_dict_type`."
        )
    settings["state_dict_type"] = wanted


def _rename_device_mesh(settings: dict[str, Any], extra: dict[str, Any]) -> None:
    if "device_mesh" not in extra:
        return
    mesh = extra["device_mesh"]
    if not (isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(size, int) for size in mesh)):
        raise TypeError(
            f"`device_mesh={mesh!r}`: the strategy builds the mesh; for hybrid sharding pass "
            "`sharding_strategy='HYBRID_SHARD', hybrid_shard_size=N` (ranks per shard group)."
        )
    if settings.get("hybrid_shard_size") not in (None, mesh[1]):
        raise ValueError(f"`device_mesh={mesh}` contradicts `hybrid_shard_size={settings['hybrid_shard_size']}`.")
    # FSDPStrategy's (replicas, shard group size) for hybrid sharding; the replicas are checked against the world
    # size when the mesh is built.
    settings["hybrid_replicas"], settings["hybrid_shard_size"] = mesh
