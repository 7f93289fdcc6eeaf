"""Tensor-parallel plans: their forms, their checks, and applying them on the ``tensor_parallel`` mesh dimension.

``ShardedStrategy(tensor_parallel_plan=...)`` takes one of:

* ``"auto"`` (default): the model's own plan, from the first source that has one (:func:`register_plan_source`):
  a module that declares ``tensor_parallel_plan`` (a dict as below, or a method ``tensor_parallel_plan(size) -> dict``
  that raises for sizes it cannot split; the GPT example does), a transformers model's ``tp_plan`` (its config's
  ``base_model_tp_plan``, applied by transformers' own code: :mod:`lightning_shard.hf.tensor_parallel`), litgpt's
  ``GPT`` (:mod:`lightning_shard.tensor_parallel.litgpt`).
* a dict of module-name patterns (``*`` matches one name component: ``"layers.*.attn.q_proj"``) to styles, for any
  model, applied with torch's ``parallelize_module``: :data:`PLAN_STYLES` names (``"colwise"``, ``"rowwise"``,
  ``"colwise_gather_output"``, ``"sequence_parallel"``, ``"loss_parallel"``:
  :mod:`~lightning_shard.tensor_parallel.loss`) or ``torch.distributed.tensor.parallel.ParallelStyle`` objects
  (``PrepareModuleInput(...)`` and the like, for sequence parallelism between norms and blocks).
* a callable ``parallelize_fn(model, tp_mesh)`` that applies torch's tensor parallel API itself.

A plan is checked when the strategy applies it, before the first step, and every error names the plan entry or the
parameter: a pattern that matches no module, a style on a module it cannot split, a dimension (output or input
features, vocabulary, attention heads) that ``tensor_parallel_size`` does not divide, a split weight tied to another
module, and ``"auto"`` for a model without a plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_shard.tensor_parallel.lora import SplitKind, adapted_targets
from lightning_shard.tensor_parallel.loss import LOSS_PARALLEL_STYLE
from lightning_shard.torch_compat.modules import visible_name

TensorParallelPlan = str | Mapping[str, Any] | Callable[[nn.Module, DeviceMesh], Any]

# Style names of the dict form -> torch's parallel styles (their defaults: local tensors between the modules).
PLAN_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    # output features split (nn.Linear; nn.Embedding: the embedding dimension); its input replicated
    "colwise": ColwiseParallel,
    # input features split, the partial outputs summed (nn.Linear; nn.Embedding: the vocabulary)
    "rowwise": RowwiseParallel,
    # an output layer whose split outputs (the vocabulary's logits) are gathered for the loss
    "colwise_gather_output": partial(ColwiseParallel, output_layouts=Replicate()),
    # norms and dropout computing on this rank's slice of the sequence
    "sequence_parallel": SequenceParallel,
    # an output layer whose logits stay split over the vocabulary, for a vocabulary-parallel loss (`loss.py`)
    LOSS_PARALLEL_STYLE: partial(ColwiseParallel, use_local_output=False),
}


def check_tensor_parallel_settings(size: object, plan: object) -> None:
    """Check ``tensor_parallel_size`` and the form of ``tensor_parallel_plan`` (the model is checked at setup).

    Example:
        >>> check_tensor_parallel_settings(2, {"layers.*.q_proj": "colwise"})
        >>> check_tensor_parallel_settings(2, {"layers.*.q_proj": "columnwise"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `tensor_parallel_plan` entry 'layers.*.q_proj': 'columnwise' is not a style; use one of [...
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"`tensor_parallel_size={size!r}` must be a positive int: the ranks that split each layer (1: none)."
        )
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(
                f"`tensor_parallel_plan={plan!r}`: pass 'auto' (the model's own plan), a dict of module-name patterns "
                "to styles, or a callable `parallelize_fn(model, tp_mesh)`."
            )
        return
    if size == 1:
        raise ValueError(
            "`tensor_parallel_plan` was given but `tensor_parallel_size=1` splits nothing; set `tensor_parallel_size` "
            "to the ranks of one tensor-parallel group (e.g. 8: the GPUs of one node)."
        )
    if callable(plan) and not isinstance(plan, Mapping):
        return
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"`tensor_parallel_plan={plan!r}` must be 'auto', a non-empty dict of module-name patterns to styles, or "
            "a callable `parallelize_fn(model, tp_mesh)`."
        )
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"`tensor_parallel_plan` keys are module-name patterns such as 'layers.*.mlp.fc', not "
                            f"{pattern!r}.")  # fmt: skip
        _style(pattern, style, None)


@dataclass
class ResolvedPlan:
    """One plan as it applies to one model: how to apply it, and what to check before.

    Attributes:
        origin: where the plan came from, for messages (``"`tensor_parallel_plan`"``, ``"LlamaForCausalLM.tp_plan"``).
        apply: applies the plan on the tensor-parallel mesh.
        checks: checks of a tensor-parallel size that need the plan (attention heads, tied weights), each raising
            ``ValueError`` naming what does not fit; :func:`apply_tensor_parallel_plan` checks every split after.
        split: the parameters the plan splits (the rest is replicated over the tensor-parallel ranks), for the memory
            estimate; ``None`` when only applying the plan would tell (a ``parallelize_fn``).
    """

    origin: str
    apply: Callable[[DeviceMesh], None]
    checks: list[Callable[[int], None]] = field(default_factory=list)
    split: list[nn.Parameter] | None = field(default_factory=list)

    def check(self, size: int) -> None:
        for check in self.checks:
            check(size)


# "auto": functions `(model, tensor_parallel_size) -> plans or None`, asked in order.
_PLAN_SOURCES: list[Callable[[nn.Module, int], list[ResolvedPlan] | None]] = []


def register_plan_source(source: Callable[[nn.Module, int], list[ResolvedPlan] | None]) -> None:
    """Ask ``source`` for a model's own plan under ``tensor_parallel_plan="auto"`` (after the modules that declare
    ``tensor_parallel_plan``, before later sources); :mod:`lightning_shard.hf` registers transformers'.

    Example:
        >>> register_plan_source(lambda model, size: None)  # doctest: +SKIP
    """
    if source not in _PLAN_SOURCES:
        _PLAN_SOURCES.append(source)


def resolve_plan(model: nn.Module, plan: TensorParallelPlan, size: int) -> list[ResolvedPlan]:
    """The plans ``plan`` stands for on ``model``, checked against ``size``.

    Raises:
        ValueError: naming the pattern, entry or model (module docstring).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> [found.origin for found in resolve_plan(model, {"0": "colwise", "2": "rowwise"}, 2)]
        ['`tensor_parallel_plan`']
    """
    if callable(plan) and not isinstance(plan, Mapping):
        origin = f"parallelize_fn {getattr(plan, '__name__', plan)!r}"
        resolved = [ResolvedPlan(origin, partial(plan, model), split=None)]
    elif isinstance(plan, Mapping):
        resolved = [module_plan(model, plan, "`tensor_parallel_plan`")]
    else:
        resolved = _auto_plan(model, size)
    for found in resolved:
        found.check(size)
    return resolved


def apply_tensor_parallel_plan(model: nn.Module, mesh: DeviceMesh, plan: TensorParallelPlan) -> list[ResolvedPlan]:
    """Split ``model``'s layers over the 1-D tensor-parallel ``mesh`` by ``plan``, in place, before ``fully_shard``.

    Raises:
        ValueError: a plan that does not fit the model (module docstring), or one that split no parameter.

    Example:
        >>> apply_tensor_parallel_plan(model, mesh["tensor_parallel"], "auto")  # doctest: +SKIP
    """
    resolved = resolve_plan(model, plan, mesh.size())
    for found in resolved:
        found.apply(mesh)
    origins = " and ".join(found.origin for found in resolved)
    _check_even_splits(model, mesh.size(), origins)
    if not any(isinstance(param, DTensor) for param in model.parameters()):
        raise ValueError(
            f"{origins} split no parameter of {type(model).__name__} over the tensor-parallel mesh, so "
            f"`tensor_parallel_size={mesh.size()}` would only compute everything {mesh.size()} times; give a plan that "
            "names its linear layers, or drop `tensor_parallel_size`."
        )
    return resolved


def module_plan(root: nn.Module, patterns: Mapping[str, Any], origin: str, prefix: str = "") -> ResolvedPlan:
    """A dict plan on ``root`` (names relative to ``root``; ``prefix`` names ``root`` in messages), with torch's
    parallel styles; peft LoRA layers' adapters follow their base layer (:mod:`~lightning_shard.tensor_parallel.lora`).

    Raises:
        ValueError: a pattern that matches no module, a column- or row-wise style on a module that is neither an
            ``nn.Linear`` nor an ``nn.Embedding``.

    Example:
        >>> module_plan(nn.Sequential(nn.Linear(4, 8)), {"0": "colwise"}, "plan").origin
        'plan'
    """
    modules = dict(root.named_modules())
    targets: list[tuple[str, nn.Module, ParallelStyle]] = []
    for pattern, value in patterns.items():
        kind = _split_kind(_style(pattern, value, None))
        matched = [name for name in modules if name and _matches(pattern, name)]
        if not matched:
            raise ValueError(
                f"{origin} entry {pattern!r} matches no module of {type(root).__name__}; its modules are named like "
                f"{_examples(modules)}. (`*` stands for one name component, e.g. 'layers.*.mlp.fc'.)"
            )
        for name in matched:
            for target_name, target in adapted_targets(name, modules[name], kind):
                if kind is not None and not isinstance(target, (nn.Linear, nn.Embedding)):
                    raise ValueError(
                        f"{origin} entry {pattern!r}: {kind} splits nn.Linear and nn.Embedding layers, but "
                        f"`{_joined(prefix, target_name)}` is a {type(target).__name__}; name its linear layers."
                    )
                targets.append((target_name, target, _style(pattern, value, target)))
    holders = {id(module) for _, module, _ in targets}
    checks = [partial(check_ties, root, holders, origin)]
    split = [param for _, module, style in targets for param in _split_parameters(module, _split_kind(style))]
    return ResolvedPlan(origin, partial(_apply_styles, targets), checks, split)


def split_parameters(model: nn.Module, plan: TensorParallelPlan, size: int) -> set[int] | None:
    """Ids of the parameters ``plan`` splits over ``size`` ranks (resolved as :func:`resolve_plan` does), or ``None``
    when only applying it would tell (a ``parallelize_fn``).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        >>> len(split_parameters(model, {"0": "colwise"}, 2))
        2
    """
    resolved = resolve_plan(model, plan, size)
    if any(found.split is None for found in resolved):
        return None
    return {id(param) for found in resolved for param in found.split or ()}


def _split_parameters(module: nn.Module, kind: SplitKind | None) -> list[nn.Parameter]:
    """What a column- or row-wise style splits: the weight, and a column-wise layer's bias (a row-wise layer's is
    added after the sum, replicated)."""
    if kind is None:
        return []
    bias = getattr(module, "bias", None) if kind == "colwise" else None
    return [module.weight, *([bias] if bias is not None else [])]


def _apply_styles(targets: list[tuple[str, nn.Module, ParallelStyle]], mesh: DeviceMesh) -> None:
    # `src_data_rank=None`: every rank splits its own copy - identical already (a meta-device model has no values; an
    # eager one was broadcast from rank 0 before this), so no scatter is needed.
    for _, module, style in targets:
        parallelize_module(module, mesh, style, src_data_rank=None)


def _auto_plan(model: nn.Module, size: int) -> list[ResolvedPlan]:
    declared = _declared_plans(model, size)
    if declared:
        return declared
    for source in _PLAN_SOURCES:
        found = source(model, size)
        if found:
            return found
    raise ValueError(
        f"`tensor_parallel_plan='auto'` found no tensor-parallel plan for {type(model).__name__}: it is not a "
        "transformers model with a `base_model_tp_plan`, nor litgpt's GPT, and no module of it declares "
        "`tensor_parallel_plan`. Pass the plan: a dict of module-name patterns to styles (e.g. "
        "`{'layers.*.attn.qkv': 'colwise', 'layers.*.attn.proj': 'rowwise'}`) or a callable "
        "`parallelize_fn(model, tp_mesh)`."
    )


def _declared_plans(model: nn.Module, size: int) -> list[ResolvedPlan]:
    """Plans declared by the outermost modules that have a ``tensor_parallel_plan`` attribute."""
    found: list[ResolvedPlan] = []

    def visit(prefix: str, module: nn.Module) -> None:
        declared = getattr(module, "tensor_parallel_plan", None)
        if declared is None:
            for name, child in module.named_children():
                visit(_joined(prefix, name), child)
            return
        patterns = declared(size) if callable(declared) else declared
        origin = f"{type(module).__name__}.tensor_parallel_plan"
        found.append(module_plan(module, patterns, origin, prefix))

    visit("", model)
    return found


def _style(pattern: object, value: object, module: nn.Module | None) -> ParallelStyle:
    """The style ``value`` names for ``module``; a row-wise embedding takes its token ids whole (torch's default
    input layout for a row-wise layer, the last dimension split, is a linear layer's)."""
    if isinstance(value, ParallelStyle):
        return value
    if value == "rowwise" and isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate())
    if isinstance(value, str) and value in PLAN_STYLES:
        return PLAN_STYLES[value]()
    raise ValueError(
        f"`tensor_parallel_plan` entry {pattern!r}: {value!r} is not a style; use one of {list(PLAN_STYLES)} or a "
        "torch.distributed.tensor.parallel.ParallelStyle."
    )


def _split_kind(style: ParallelStyle) -> SplitKind | None:
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def check_ties(root: nn.Module, split: set[int], origin: str, size: int) -> None:
    """A weight held by several modules (tied) must not be split: the styles replace each module's parameter on their
    own, so the holders would each get their own split copy and train apart (``split``: ids of the modules a plan
    splits).

    Example:
        >>> check_ties(nn.Linear(2, 2), set(), "plan", 2)
    """
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((name, module))
    for tied in holders.values():
        names = sorted({name for name, _ in tied})
        if len(names) > 1 and any(id(module) in split for _, module in tied):
            raise ValueError(
                f"{origin} splits a weight tied between {names}: the modules would each get their own split copy and "
                "train apart. Leave the tied modules out of the plan (replicated over the tensor-parallel ranks), or "
                "untie the weights."
            )


def _check_even_splits(model: nn.Module, size: int, origins: str) -> None:
    """Every dimension a plan split must divide evenly: each rank computes whole heads, features or vocabulary rows
    (and FSDP2 shards the pieces further)."""
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        for placement in param.placements:
            dim = getattr(placement, "dim", None)
            if dim is not None and param.shape[dim] % size:
                raise ValueError(
                    f"{origins} splits `{visible_name(name)}` of shape {tuple(param.shape)} along dimension "
                    f"{dim % param.ndim} ({param.shape[dim]}), which `tensor_parallel_size={size}` does not divide; "
                    "choose a tensor-parallel size that divides it, or leave its module out of the plan."
                )


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names, strict=True))


def _joined(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _examples(modules: Mapping[str, nn.Module]) -> list[str]:
    names = [name for name, module in modules.items() if name and next(module.parameters(False), None) is not None]
    return names[:6]
