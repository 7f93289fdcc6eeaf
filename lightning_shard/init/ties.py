"""Tied parameters (one ``nn.Parameter`` held by two modules or more: ``lm_head.weight = wte.weight``) through
sharding and materialisation.

FSDP2 manages each parameter in exactly one unit: a tied parameter held both inside a unit and outside it fails at
the first forward ("shared with a parameter already managed by another FSDP group"). So the invariant here, kept at
setup: every tie of the model as built is a tie after setup.

* Wrapping: a module that holds one end of a tie but not the other cannot be a unit (:func:`modules_splitting_ties`):
  ``"auto"`` leaves it in the unit around it (the parent holding both ends), a policy that names it is an error
  (:func:`refuse_split_ties`) naming both parameters and the fix.
* Materialisation keeps each parameter one object in every module holding it (:func:`retie`), and
  :func:`check_ties` refuses a model whose ties did not survive setup, naming the pair - never a silent untie.

Example:
    >>> shared = nn.Linear(2, 2)
    >>> model = nn.Sequential(shared, nn.Linear(2, 2))
    >>> model[1].weight = shared.weight
    >>> [tie.names for tie in find_ties(model)]
    [['0.weight', '1.weight']]
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_shard.init.construction_log import HolderKey, Registration
from lightning_shard.torch_compat.modules import visible_name


@dataclass(frozen=True)
class Tie:
    """One parameter held in several places: its ``names`` (as the state dict shows them) and, name by name, its
    ``holders``."""

    names: list[str]
    holders: list[HolderKey]


def find_ties(root: nn.Module) -> list[Tie]:
    """Every parameter of ``root`` held under two names or more, with its names and holders.

    Example:
        >>> find_ties(nn.Linear(2, 2))
        []
    """
    found: dict[int, Tie] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                tie = found.setdefault(id(param), Tie([], []))
                tie.names.append(visible_name(f"{prefix}.{name}" if prefix else name))
                tie.holders.append((id(module), "_parameters", name))
    return [tie for tie in found.values() if len(tie.names) > 1]


def modules_splitting_ties(root: nn.Module, ties: list[Tie] | None = None) -> dict[int, str]:
    """The modules of ``root`` that hold some ends of a tie but not all (by ``id``), each with the reason: as FSDP units
    they would put one parameter in two units.

    Example:
        >>> model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        >>> model[1].weight = model[0].weight
        >>> list(modules_splitting_ties(model).values())[0]
        'holds `0.weight`, tied to `1.weight` outside it'
    """
    ties = find_ties(root) if ties is None else ties
    if not ties:
        return {}
    splitting: dict[int, str] = {}
    for module in root.modules():
        inside = {id(m) for m in module.modules()}
        for tie in ties:
            ends = [(holder[0] in inside, name) for holder, name in zip(tie.holders, tie.names, strict=False)]
            held = [name for is_inside, name in ends if is_inside]
            outside = [name for name in tie.names if name not in held]
            if held and outside and id(module) not in splitting:
                splitting[id(module)] = f"holds `{held[0]}`, tied to `{outside[0]}` outside it"
    return splitting


def refuse_split_ties(root: nn.Module, modules: list[nn.Module], splitting: dict[int, str], argument: str) -> None:
    """Raise ``ValueError`` if a module that an explicit policy selects as a unit would split a tie.

    Example:
        >>> refuse_split_ties(nn.Linear(2, 2), [], {}, "auto_wrap_policy")
    """
    names = {id(m): name for name, m in root.named_modules()}
    split = [f"`{visible_name(names[id(m)])}` ({splitting[id(m)]})" for m in modules if id(m) in splitting]
    if split:
        raise ValueError(
            f"`{argument}` makes FSDP units of modules holding one end of a tied parameter: {'; '.join(split)}. FSDP "
            "manages a parameter in one unit only, so the tie would be split (FSDP2 fails at the first forward: "
            '"shared with a parameter already managed by another FSDP group"). Leave these modules out of '
            f"`{argument}` (their parameters then belong to the unit holding both ends), or use "
            f"`{argument}='auto'`, which does that itself."
        )


def replaced_after(registrations: list[Registration], position: float) -> set[HolderKey]:
    """The places whose parameter a constructor replaced after ``position`` (transformers' ``tie_weights`` in an outer
    model's ``post_init`` ties a nested model's ``embed_tokens`` to its ``shared`` embedding after the nested model
    initialised its own): an init that ran at ``position`` in an eager build wrote into the parameter held there then,
    which the eager build discarded, so in a replay it writes scratch - not the tied parameter.

    Example:
        >>> replaced_after([], 0.0)
        set()
    """
    return {
        (id(r.parent), r.table, r.name)
        for r in registrations
        if r.table == "_parameters" and r.seq > position and r.constructing and isinstance(r.old, nn.Parameter)
    }


def retie(root: nn.Module, ties: list[Tie]) -> None:
    """Make each tie one parameter object again in all its holders (a per-module reallocation, as from the meta
    device, gives each holder its own); the first holder's object is kept.

    Example:
        >>> retie(nn.Linear(2, 2), [])
    """
    modules = {id(m): m for m in root.modules()}
    for tie in ties:
        (first_module, _, first_name), *others = tie.holders
        kept = modules[first_module]._parameters[first_name]
        for module_id, _, name in others:
            if modules[module_id]._parameters[name] is not kept:
                modules[module_id]._parameters[name] = kept


def check_ties(root: nn.Module, ties: list[Tie]) -> None:
    """Raise ``RuntimeError`` naming the tied parameters (of the model as built) that are no longer one parameter.

    Example:
        >>> check_ties(nn.Linear(2, 2), [])
    """
    modules = {id(m): m for m in root.modules()}
    untied = [tie.names for tie in ties if len({id(modules[m]._parameters[name]) for m, _, name in tie.holders}) > 1]
    if untied:
        raise RuntimeError(
            f"Setting the model up untied parameters that its construction tied: {untied} are no longer one "
            "parameter, so they would train apart. This is a defect of the strategy with this model; as a way "
            "around it, pass `auto_wrap_policy=None` (or build the model in `__init__`) and report it."
        )
