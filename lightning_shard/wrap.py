"""Module selection policies: which submodules become FSDP units or get activation checkpointing.

The user describes the modules in one of the forms fairseq, Hugging Face Accelerate and FSDP1 users know:

* a set / list of module classes (``{Block}``) - TRANSFORMER_BASED_WRAP, ``transformer_layer_cls_to_wrap``;
* class names as strings, for YAML (``["Block"]`` or ``["my_pkg.model.Block"]``);
* an ``int`` - the minimum number of parameters a unit must hold (fairseq ``min_num_params``, SIZE_BASED_WRAP);
* a callable ``module -> bool``;
* ``None`` - no submodule (NO_WRAP: only the root is sharded);
* ``"auto"`` - the block classes a Hugging Face model names in ``_no_split_modules``; otherwise the block class
  repeated inside ``nn.ModuleList`` / ``nn.Sequential`` containers (none: root only).

Everything here is a pure function of the model and the policy, so it is tested without processes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from lightning_shard.fsdp1_compat import is_fsdp1_policy

WrapPolicy = str | int | type | Iterable[Any] | Callable[[nn.Module], bool] | None

_AUTO = "auto"


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
    """Return the submodules of ``root`` (never ``root`` itself) that ``policy`` selects, in post-order.

    Post-order (children before parents) is the order ``fully_shard`` must be applied in.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> [type(m).__name__ for m in select_modules(model, {nn.Linear})]
        ['Linear', 'Linear']
    """
    if policy is None:
        return []
    match = _matcher(root, policy, argument)
    return [module for module in _post_order(root) if module is not root and match(module)]


def candidate_block_classes(root: nn.Module) -> list[str]:
    """Names of classes that appear more than once inside ``nn.ModuleList`` / ``nn.Sequential`` containers.

    These are the repeated blocks (transformer layers) a wrap policy usually names.

    Example:
        >>> candidate_block_classes(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        ['Linear']
    """
    return [cls.__name__ for cls in _repeated_block_classes(root)]


def _check_module_class(cls: type, argument: str) -> None:
    if not issubclass(cls, nn.Module):
        raise TypeError(f"`{argument}` entry {cls!r} is not an nn.Module subclass.")


def _matcher(root: nn.Module, policy: WrapPolicy, argument: str) -> Callable[[nn.Module], bool]:
    validate_policy(policy, argument)
    if isinstance(policy, int):
        return _size_matcher(policy)
    if policy == _AUTO:
        names = _no_split_class_names(root)
        if names:
            return lambda module: type(module).__name__ in names
        # No repeated block (a small or flat model) selects nothing: the root alone becomes the one unit.
        classes = tuple(_repeated_block_classes(root))
        return lambda module: isinstance(module, classes)
    if isinstance(policy, (str, type)):
        policy = [policy]
    if callable(policy):
        return policy
    classes = tuple(_resolve_class(root, entry, argument) for entry in policy)  # type: ignore[union-attr]
    return lambda module: isinstance(module, classes)


def _size_matcher(min_num_params: int) -> Callable[[nn.Module], bool]:
    """fairseq / FSDP1 size-based wrapping: a module becomes a unit when the parameters not already in a
    smaller unit below it reach ``min_num_params``. Tracks what post-order traversal has claimed."""
    claimed: set[int] = set()

    def match(module: nn.Module) -> bool:
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


def _repeated_block_classes(root: nn.Module) -> list[type]:
    """Classes repeated inside ModuleList/Sequential containers, keeping only the outermost: a class whose
    repeated instances all sit inside instances of another candidate (the Linears inside each Block) is dropped."""
    members: dict[type, list[nn.Module]] = {}
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child in module.children():
                if any(True for _ in child.parameters()):
                    members.setdefault(type(child), []).append(child)
    repeated = [cls for cls, instances in members.items() if len(instances) > 1]
    outermost = []
    for cls in repeated:
        enclosing = [members[other] for other in repeated if other is not cls]
        enclosed = {id(sub) for instances in enclosing for block in instances for sub in block.modules()}
        if any(id(instance) not in enclosed for instance in members[cls]):
            outermost.append(cls)
    return outermost


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
