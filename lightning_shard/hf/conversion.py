"""Which tensor of a checkpoint fills which tensor of a model: transformers' own conversion mapping applied to a
``save_pretrained`` directory, for a model that the sharded strategy loads shard by shard.

transformers 5 renames and fuses some families' weights when it loads them (Mixtral's per-expert
``block_sparse_moe.experts.N.w1`` / ``w3`` become ``mlp.experts.gate_up_proj``; the Qwen-MoE, DeepSeek and GLM
families alike). ``get_model_conversion_mapping`` lists a model's ``WeightRenaming``\\ s and ``WeightConverter``\\ s
and ``rename_source_key`` applies them to a name, as transformers' ``from_pretrained`` does. :func:`plan_load` works
out, on the meta model before anything is sharded or read, which file tensor fills which model tensor, runs each
conversion on meta tensors to check its shapes, and refuses a load that would leave the model's body unfilled. After
sharding, the renamed tensors are read shard by shard (torch.distributed.checkpoint) and :func:`load_converted` runs
each conversion for this rank's shard.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.hf.safetensors_files import StoredTensor

# How many names an error or warning lists before "...".
_SHOWN = 8


@dataclass
class Conversion:
    """A transformers ``WeightConverter`` (no tensors collected yet) and the file tensors it converts, as
    ``(source pattern, name)`` in transformers' order (``dot_natural_key``: expert 0, 1, 2, ...)."""

    converter: Any
    sources: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class LoadPlan:
    """How a checkpoint's tensors fill a model, worked out by :func:`plan_load`.

    Attributes:
        renamed: file tensor -> the model tensor it fills as it is (read shard by shard).
        converted: the (first) model tensor a conversion fills -> the conversion.
        stored: the file tensors, by name.
        outputs: every model tensor a conversion fills -> that conversion's key in ``converted``.
    """

    path: str
    renamed: dict[str, str]
    converted: dict[str, Conversion]
    stored: dict[str, StoredTensor]
    outputs: dict[str, str] = field(default_factory=dict)


def plan_load(model: nn.Module, path: str, stored: dict[str, StoredTensor]) -> LoadPlan:
    """Match the file tensors ``stored`` to the tensors of ``model`` (a ``PreTrainedModel``, on the meta device) as
    transformers' ``from_pretrained`` matches them, and check the match before anything is read.

    What the files do not fill is left to transformers' init only outside the model's body (a new head, as
    transformers initialises it, with a warning), and only when no unused file tensor has its shape; tensors
    transformers expects to be absent (``_keys_to_ignore_on_load_missing``) and tied weights are not missing. File
    tensors the model does not use (a head the model does not have) are named in a warning.

    Raises:
        ValueError: naming the tensors the files do not fill (and the file tensors left unused: names that needed a
            conversion transformers does not know), tensors whose shapes differ, or a conversion that fails.

    Example:
        >>> plan = plan_load(meta_model, "checkpoints/mixtral", stored)  # doctest: +SKIP
        >>> plan.converted["model.layers.0.mlp.experts.gate_up_proj"].sources[:2]  # doctest: +SKIP
        [('.experts.*.w1.weight', 'model.layers.0.block_sparse_moe.experts.0.w1.weight'), ...]
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    tensors = model.state_dict(keep_vars=True)
    transforms = get_model_conversion_mapping(model)
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    converter_of = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = model.base_model_prefix
    plan = LoadPlan(path, {}, {}, stored)
    unused = []
    for key in sorted(stored, key=dot_natural_key):  # transformers' order: a converter's sources in expert order
        name, pattern = rename_source_key(key, renamings, converters, prefix, tensors)
        if name not in tensors and key in tensors:  # as transformers' loader: the name needed no renaming after all
            name, pattern = rename_source_key(key, [], [], prefix, tensors)
        if name not in tensors:
            unused.append(key)
        elif pattern is None:
            plan.renamed[key] = name
        else:
            conversion = plan.converted.setdefault(name, Conversion(copy.deepcopy(converter_of[pattern])))
            conversion.sources.append((pattern, key))

    filled = _check_shapes(model, plan, tensors)
    missing = {name for name, tensor in tensors.items() if id(tensor) not in filled}
    # transformers' own exceptions: `_keys_to_ignore_on_load_missing` / `_unexpected`, old `inv_freq` buffers, ...
    report = SimpleNamespace(missing_keys=missing, unexpected_keys=set(unused))
    model._adjust_missing_and_unexpected_keys(report)
    _refuse_unfilled(model, plan, tensors, sorted(report.missing_keys), sorted(report.unexpected_keys))
    return plan


@torch.no_grad()
def load_converted(model: nn.Module, plan: LoadPlan) -> list[torch.Tensor]:
    """Run ``plan``'s conversions into ``model``'s shards (after sharding and allocation); return the tensors filled.

    A conversion that stacks per-expert tensors along dim 0 (``MergeModulelist(dim=0)``, then ops on other dims:
    every MoE family's) reads only the experts in this rank's rows, through transformers' ``DtensorShardOperation``
    (as transformers' own sharded loading does): a rank holds about three times its part of one fused tensor (the
    experts read, stacked, concatenated; measured 137 MiB for a 44 MiB part). Any other conversion (a ``Chunk`` of a
    fused qkv, a ``Transpose``) needs its whole sources: it reads them, converts, and keeps this rank's rows, one
    converted tensor at a time.
    """
    from transformers.distributed.sharding_utils import DtensorShardOperation

    tensors = model.state_dict(keep_vars=True)
    filled: list[torch.Tensor] = []
    for name, conversion in plan.converted.items():
        target = tensors[name]
        if isinstance(target, DTensor) and _stacks_experts_along_dim0(conversion.converter, target.ndim):
            rows = DtensorShardOperation(target)
            if target.to_local().numel():  # a rank may hold no expert (fewer experts than ranks)
                outputs = _convert(
                    model, name, conversion, plan.stored, lambda i, t, rows=rows: rows.shard_tensor(t, i)
                )
                target.to_local().copy_(outputs[name])
            filled.append(target)
            continue
        for output_name, full in read_converted(model, plan, name).items():
            output = tensors[output_name]
            if isinstance(output, DTensor):
                output.to_local().copy_(DtensorShardOperation(output).shard_tensor(full))
            else:
                output.copy_(full)
            filled.append(output)
    return filled


def read_converted(model: nn.Module, plan: LoadPlan, name: str) -> dict[str, torch.Tensor]:
    """The whole tensors that ``plan``'s conversion ``name`` fills, read from the files and converted, by model name.

    Example:
        >>> read_converted(meta_model, plan, "model.layers.0.mlp.experts.gate_up_proj")  # doctest: +SKIP
        {'model.layers.0.mlp.experts.gate_up_proj': tensor([...])}
    """
    return _convert(model, name, plan.converted[name], plan.stored, lambda i, t: t.read())


def _convert(
    model: nn.Module,
    name: str,
    conversion: Conversion,
    stored: dict[str, StoredTensor],
    read: Callable[[int, StoredTensor], torch.Tensor | None],
) -> dict[str, torch.Tensor]:
    """Run transformers' converter on ``conversion``'s sources, each read by ``read(its index among its pattern's
    sources, the stored tensor)`` when the converter asks for it (``None`` leaves it out); the outputs by full name."""
    converter = copy.deepcopy(conversion.converter)
    index: Counter[str] = Counter()
    for pattern, key in conversion.sources:
        converter.add_tensor(name, key, pattern, lambda i=index[pattern], source=stored[key]: read(i, source))
        index[pattern] += 1
    outputs = converter.convert(name, model=model, config=model.config)
    return {output: value[0] if isinstance(value, list) else value for output, value in outputs.items()}


def _check_shapes(model: nn.Module, plan: LoadPlan, tensors: dict[str, torch.Tensor]) -> set[int]:
    """Check that every file tensor, renamed or converted (on meta tensors), has its model tensor's shape; return the
    ids of the model tensors the plan fills, and note each conversion's outputs in ``plan.outputs``."""
    filled = {id(tensors[name]) for name in plan.renamed.values()}
    wrong = [
        f"{key} {list(plan.stored[key].shape)} -> {name} {list(tensors[name].shape)}"
        for key, name in plan.renamed.items()
        if tuple(plan.stored[key].shape) != tuple(tensors[name].shape)
    ]
    for name, conversion in plan.converted.items():
        sources = [key for _, key in conversion.sources]
        try:
            outputs = _convert(
                model,
                name,
                conversion,
                plan.stored,
                lambda i, source: torch.empty(source.shape, dtype=source.dtype, device="meta"),
            )
        except Exception as error:
            raise ValueError(
                f"transformers' conversion {conversion.converter!r} of {_shown(sources)} in {plan.path} into "
                f"`{name}` fails: {error}. Build the model in `__init__` with transformers' `from_pretrained` "
                "instead (every rank loads the whole model, then it is sharded)."
            ) from error
        for output, value in outputs.items():
            if output not in tensors or tuple(value.shape) != tuple(tensors[output].shape):
                expected = list(tensors[output].shape) if output in tensors else "not a tensor of the model"
                wrong.append(f"{_shown(sources)} -> {output} {list(value.shape)} (model: {expected})")
            else:
                filled.add(id(tensors[output]))
                plan.outputs[output] = name
    if wrong:
        raise ValueError(
            f"Tensors of {plan.path} do not have the shapes of {type(model).__name__}'s: {wrong[:_SHOWN]}. Is "
            "config.json the checkpoint's own?"
        )
    return filled


def _refuse_unfilled(
    model: nn.Module, plan: LoadPlan, tensors: dict[str, torch.Tensor], missing: list[str], unused: list[str]
) -> None:
    """Raise if the files leave tensors of the model's body (``base_model_prefix``) unfilled, or a head tensor while
    an unused file tensor has its shape (its name not converted); warn about a new head and unused file tensors."""
    name = type(model).__name__
    has_head = getattr(model, "base_model", model) is not model
    body = [key for key in missing if not has_head or key.startswith(f"{model.base_model_prefix}.")]
    head = [key for key in missing if key not in body]
    shapes = {tuple(tensors[key].shape) for key in head}
    unfilled = body + [key for key in head if any(tuple(plan.stored[k].shape) in shapes for k in unused)]
    if unfilled:
        also = f" and holds {len(unused)} tensors the model does not use: {_shown(unused)}" if unused else ""
        raise ValueError(
            f"{plan.path} does not fill {len(unfilled)} tensors of {name}: {_shown(unfilled)}{also}. Training would "
            "start them from random values. If the checkpoint spells them differently (a layout that this "
            "transformers version does not convert on load, or another model class), build the model in `__init__` "
            "with transformers' `from_pretrained` (every rank loads the whole model, then it is sharded)."
        )
    if head:
        rank_zero_warn(
            f"{plan.path} holds no {head}: they get {name}'s initialisation (a new head, as in transformers)."
        )
    if unused:
        rank_zero_warn(f"{plan.path} holds tensors {name} does not use; not loaded: {_shown(unused)}")


def _shown(names: list[str]) -> str:
    return str(names[:_SHOWN])[:-1] + (", ...]" if len(names) > _SHOWN else "]")


def _stacks_experts_along_dim0(converter: Any, ndim: int) -> bool:
    """Whether each source of ``converter`` becomes one index of dim 0 of its single target, so that the rows of a
    rank's shard need only its own sources: ``MergeModulelist(dim=0)`` first, then ``Concatenate`` / ``Transpose``
    on other dims."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    first, *rest = converter.operations
    if not isinstance(first, MergeModulelist) or first.dim != 0 or len(converter.target_patterns) != 1:
        return False
    for op in rest:
        dims = [op.dim] if isinstance(op, Concatenate) else [op.dim0, op.dim1] if isinstance(op, Transpose) else [0]
        if any(dim % ndim == 0 for dim in dims):
            return False
    return True
