"""Module selection policies: which submodules become FSDP units or get activation checkpointing.

The user describes the modules in one of the forms fairseq, Hugging Face Accelerate and FSDP1 users know:

* a set / list of module classes (``{Block}``) - TRANSFORMER_BASED_WRAP, ``transformer_layer_cls_to_wrap``;
* class names as strings, for YAML (``["Block"]`` or ``["my_pkg.model.Block"]``);
* an ``int`` - the minimum number of parameters a unit must hold (fairseq ``min_num_params``, SIZE_BASED_WRAP);
* a callable ``module -> bool``;
* ``None`` - no submodule (NO_WRAP: only the root is sharded);
* ``"auto"`` - the block classes a Hugging Face model names in ``_no_split_modules``; otherwise the block classes
  repeated inside ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` containers, looking through containers
  nested in containers (``layers[i][j]``). None found: the root alone is the one unit.

Whatever the policy, a module that cannot be a unit is left to the unit around it: a container without ``forward``
(``fully_shard`` refuses it) and a module whose insides an enclosing module's code reads without calling it
(``nn.MultiheadAttention`` hands ``self.out_proj.weight`` to its attention function; FSDP2 gathers a unit's
parameters only around its own call; see :mod:`lightning_shard.plan.forward_reads`). ``"auto"`` leaves them out quietly;
a policy that names them gets a warning saying which and why (:func:`plan_units`). When the selected modules become
FSDP units (``shards=True``), a module holding one end of a tied parameter but not the other is one more that cannot
be a unit (:mod:`lightning_shard.init.ties`): ``"auto"`` leaves it in the unit around it, any other policy is an error.

Everything here is a pure function of the model and the policy, so it is tested without processes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_shard.init.ties import modules_splitting_ties, refuse_split_ties
from lightning_shard.plan.forward_reads import has_own_forward, modules_read_from_outside
from lightning_shard.plan.fsdp1_compat import is_fsdp1_policy

WrapPolicy = str | int | type | Iterable[Any] | Callable[[nn.Module], bool] | None

_AUTO = "auto"
# Containers: they hold blocks, they are not blocks (``nn.Sequential`` has a forward and may be one as well).
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# A repeated class whose largest instance holds less than this share of the largest candidate block's parameters (the
# norms beside the attention and MLP of an x-transformers layer) is not made a unit: it would cost a collective per
# step for memory that does not matter.
_SMALLEST_BLOCK_SHARE = 1 / 16


@dataclass(frozen=True)
class UnitPlan:
    """What a policy selects in a model: ``modules`` (post-order), the ``left_out`` ones it matched but that cannot be
    units (their names and why), and a ``note`` when ``"auto"`` found no block and the root alone is the unit."""

    modules: list[nn.Module]
    left_out: dict[str, str] = field(default_factory=dict)
    note: str | None = None


def validate_policy(policy: Any, argument: str) -> None:
    """Raise ``TypeError`` / ``ValueError`` for policy values no model could accept.

    Called at strategy construction, before any process starts; model-dependent checks (a class name that
    matches nothing) happen in :func:`select_modules`.

    Example:
        >>> validate_policy({nn.Linear}, "auto_wrap_policy")
        >>> validate_policy(-1, "auto_wrap_policy")
        Traceback (most recent call last):
        ...
        ValueError: `auto_wrap_policy=-1`: a minimum parameter count must be a positive int, e.g. `100_000_000`.
    """
    if is_fsdp1_policy(policy):
        raise TypeError(
            f"`{argument}={policy!r}` is an FSDP1 policy (called with `module, recurse, nonwrapped_numel`). "
            "ShardedStrategy(...) translates ModuleWrapPolicy and transformer_auto_wrap_policy / "
            "lambda_auto_wrap_policy partials; here pass the block classes, an int minimum parameter count or a "
            "callable `module -> bool`."
        )
    if policy is None or callable(policy) and not isinstance(policy, type):
        return
    if isinstance(policy, bool):
        raise TypeError(
            f"`{argument}={policy!r}`: pass the block classes (e.g. `{{Block}}` or `['Block']`), a minimum "
            "parameter count, a callable, `'auto'` or `None` - not a bool."
        )
    if isinstance(policy, int):
        if policy <= 0:
            raise ValueError(
                f"`{argument}={policy!r}`: a minimum parameter count must be a positive int, e.g. `100_000_000`."
            )
        return
    if isinstance(policy, str):
        if policy != _AUTO and not policy.strip():
            raise ValueError(f"`{argument}={policy!r}`: give a class name such as `'Block'`, or `'auto'`.")
        return
    if isinstance(policy, type):
        _check_module_class(policy, argument)
        return
    if isinstance(policy, Iterable):
        entries = list(policy)
        if not entries:
            raise ValueError(
                f"`{argument}={policy!r}` is empty: list the block classes to wrap, or pass `None` for the root only."
            )
        for entry in entries:
            if isinstance(entry, type):
                _check_module_class(entry, argument)
            elif not isinstance(entry, str):
                raise TypeError(
                    f"`{argument}` entries must be nn.Module classes or class names, got {entry!r} "
                    f"({type(entry).__name__})."
                )
        return
    raise TypeError(
        f"`{argument}={policy!r}` ({type(policy).__name__}) is not a policy: pass module classes, class names, "
        "a minimum parameter count, a callable `module -> bool`, `'auto'` or `None`."
    )


def select_modules(root: nn.Module, policy: WrapPolicy, argument: str = "auto_wrap_policy") -> list[nn.Module]:
    """Return the submodules of ``root`` (never ``root`` itself) that ``policy`` selects and that can be units, in
    post-order (:func:`plan_units` also says what it left out).

    Post-order (children before parents) is the order ``fully_shard`` must be applied in.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> [type(m).__name__ for m in select_modules(model, {nn.Linear})]
        ['Linear', 'Linear']
    """
    return plan_units(root, policy, argument).modules


def plan_units(
    root: nn.Module, policy: WrapPolicy, argument: str = "auto_wrap_policy", shards: bool = True
) -> UnitPlan:
    """What ``policy`` selects in ``root``, what it matched but left out (a module that cannot be a unit stays in the
    unit around it) and, for ``"auto"`` without any block, the note that the root alone is the unit. ``shards``: the
    modules become FSDP units (not only checkpointed), so none may split a tied parameter.

    Raises:
        ValueError: a policy other than ``"auto"`` selects a module that would split a tie, naming both parameters.

    Example:
        >>> plan = plan_units(nn.MultiheadAttention(8, 2), {nn.Linear})
        >>> plan.modules, plan.left_out
        ([], {'out_proj': 'MultiheadAttention.forward reads `self.out_proj.weight`'})
    """
    if policy is None:
        return UnitPlan([])
    unusable = _unusable_as_units(root)
    splitting = modules_splitting_ties(root) if shards else {}
    if policy == _AUTO:
        unusable = {**splitting, **unusable}
    match = _matcher(root, policy, argument, unusable)
    matched = [module for module in _post_order(root) if module is not root and match(module)]
    refuse_split_ties(root, [module for module in matched if id(module) not in unusable], splitting, argument)
    names = {id(module): name for name, module in root.named_modules()}
    left_out = {names[id(m)]: unusable[id(m)] for m in matched if id(m) in unusable and _size(m)}
    modules = [module for module in matched if id(module) not in unusable]
    note = None
    if policy == _AUTO and not modules:
        note = (
            f"`{argument}='auto'` found no repeated block in {type(root).__name__} that can be a unit of its own "
            "(a module with a forward that its parents only call), so the root alone is sharded as one unit; name "
            f"the block classes in `{argument}` to shard block by block."
        )
    return UnitPlan(modules, left_out, note)


def candidate_block_classes(root: nn.Module) -> list[str]:
    """Names of the block classes repeated inside containers (``nn.ModuleList`` / ``nn.Sequential`` /
    ``nn.ModuleDict``, nested or not) that can be units: the transformer layers a wrap policy usually names.

    Example:
        >>> candidate_block_classes(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        ['Linear']
    """
    return [cls.__name__ for cls in _repeated_block_classes(root, _unusable_as_units(root))]


def _check_module_class(cls: type, argument: str) -> None:
    if not issubclass(cls, nn.Module):
        raise TypeError(f"`{argument}` entry {cls!r} is not an nn.Module subclass.")


def _unusable_as_units(root: nn.Module) -> dict[int, str]:
    """The modules of ``root`` that cannot be FSDP units, by ``id``, with the reason."""
    unusable = {
        id(module): f"{type(module).__name__} has no forward of its own (a container)"
        for module in root.modules()
        if not has_own_forward(module)
    }
    return {**modules_read_from_outside(root), **unusable}


def _matcher(
    root: nn.Module, policy: WrapPolicy, argument: str, unusable: dict[int, str]
) -> Callable[[nn.Module], bool]:
    validate_policy(policy, argument)
    if isinstance(policy, int):
        return _size_matcher(policy, unusable)
    if policy == _AUTO:
        names = _no_split_class_names(root)
        if names:
            return lambda module: type(module).__name__ in names
        # No repeated block (a small or flat model) selects nothing: the root alone becomes the one unit.
        classes = set(_repeated_block_classes(root, unusable))
        return lambda module: type(module) in classes
    if isinstance(policy, (str, type)):
        policy = [policy]
    if callable(policy):
        return policy
    classes = tuple(_resolve_class(root, entry, argument) for entry in policy)  # type: ignore[union-attr]
    return lambda module: isinstance(module, classes)


def _size_matcher(min_num_params: int, unusable: dict[int, str]) -> Callable[[nn.Module], bool]:
    """fairseq / FSDP1 size-based wrapping: a module becomes a unit when the parameters not already in a
    smaller unit below it reach ``min_num_params``. Tracks what post-order traversal has claimed; a module that
    cannot be a unit claims nothing, so its parameters count towards the module around it."""
    claimed: set[int] = set()

    def match(module: nn.Module) -> bool:
        if id(module) in unusable:
            return False
        unclaimed = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in unclaimed) < min_num_params:
            return False
        claimed.update(id(p) for p in unclaimed)
        return True

    return match


def _resolve_class(root: nn.Module, entry: type | str, argument: str) -> type:
    if isinstance(entry, type):
        return entry
    if "." in entry:
        module_name, _, class_name = entry.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"`{argument}` names {entry!r}, which cannot be imported ({error}). Candidate block classes in "
                f"{type(root).__name__}: {candidate_block_classes(root)}."
            ) from error
        _check_module_class(cls, argument)
        return cls
    for module in root.modules():
        # Compare against every class in the MRO so the name of a base class matches too, and so
        # FSDP's dynamic `FSDP<Name>` subclasses still answer to `<Name>`.
        for cls in type(module).__mro__:
            if cls.__name__ == entry:
                return cls
    raise ValueError(
        f"`{argument}` names the class {entry!r}, which matches no module in {type(root).__name__}. "
        f"Candidate block classes: {candidate_block_classes(root)}; or pass the class itself / its full "
        "import path (e.g. 'my_pkg.model.Block')."
    )


def _no_split_class_names(root: nn.Module) -> set[str]:
    """The block classes Hugging Face models declare in ``_no_split_modules`` (what Accelerate wraps), keeping the
    names that match a module in ``root``; found by duck typing, without importing transformers."""
    declared: set[str] = set()
    for module in root.modules():
        names = getattr(module, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)):
            declared.update(name for name in names if isinstance(name, str))
    return declared & {type(module).__name__ for module in root.modules()}


def _repeated_block_classes(root: nn.Module, unusable: dict[int, str]) -> list[type]:
    """The block classes of ``root``: classes with a forward whose instances are members of containers more than once
    - looking through containers held in containers (an x-transformers layer is a ``ModuleList`` inside ``layers``) -
    and of which at least one instance can be a unit. Kept: the outermost (a class most of whose parameters sit
    inside instances of another candidate, such as ``Linear`` inside each block beside one ``Linear`` head, is
    dropped), unless tiny next to the largest block (:data:`_SMALLEST_BLOCK_SHARE`)."""
    members: dict[type, int] = {}
    for container in root.modules():
        if isinstance(container, _CONTAINERS):
            for child in container.children():
                if has_own_forward(child) and any(True for _ in child.parameters()):
                    members[type(child)] = members.get(type(child), 0) + 1
    instances: dict[type, list[nn.Module]] = {}
    for module in root.modules():
        if members.get(type(module), 0) > 1:
            instances.setdefault(type(module), []).append(module)
    repeated = {cls: found for cls, found in instances.items() if any(id(m) not in unusable for m in found)}
    outermost = []
    for cls, found in repeated.items():
        enclosing = [block for other, blocks in repeated.items() if other is not cls for block in blocks]
        enclosed = {id(sub) for block in enclosing for sub in block.modules() if sub is not block}
        if 2 * sum(_size(m) for m in found if id(m) in enclosed) < sum(_size(m) for m in found):
            outermost.append(cls)
    largest = max((_size(block) for cls in outermost for block in repeated[cls]), default=0)
    return [cls for cls in outermost if max(map(_size, repeated[cls])) >= largest * _SMALLEST_BLOCK_SHARE]


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _post_order(module: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(current: nn.Module) -> None:
        if id(current) in seen:
            return
        seen.add(id(current))
        for child in current.children():
            visit(child)
        order.append(current)

    visit(module)
    return order
